"""The prepared path's fast lane (issue #24): requests between two handles whose earlier request
took the index ring reuse what that one worked out (`_plan.Lane`: one lookup, one reduction a side
to check the indices, the request one bytes frame through `Session._submit_frame`). Everything
the general way guarantees holds on it: bad indices refused at make_prepped_xfer naming them,
released handles, reposts, session renewal, ring exhaustion, telemetry, cancellation."""

from __future__ import annotations

import time
from typing import Any, List

import numpy as np
import pytest

from tcpxd import _proto, _session
from tcpxd.errors import TcpxdError
from tcpxd.nixl import _indices, _plan, nixlInvalidParamError, nixlNotFoundError, nixlRepostActiveError
from tcpxd.nixl._xfer import Xfer

from test_nixl_compact_indices import _FakeBuffer, _agents_with_lists, _check_blocks, _fill
from test_nixl_prepared_send import _Sink
from test_nixl_transfers import BLOCK, _notifs, wait

rng = np.random.default_rng(2413)
R, N = 4, 64


class _Side:
    """What Lane.fits and telemetry read of a prepared list: its count, its signature (4 KiB
    descriptors: `Prepped._granules`)."""

    def __init__(self, count: int):
        self.count = count
        self.usig = 4096 * 64 + 12


def _lane(n: int = 1000) -> _plan.Lane:
    return _plan.Lane("READ", _Side(n), _Side(n), True, 0)  # type: ignore[arg-type]


@pytest.fixture
def small_ring(monkeypatch):
    monkeypatch.setattr(_indices, "WINDOW_MIN", 8)


def _counting(monkeypatch, agent) -> List[str]:
    """Which session method each request of the agent's session went through."""
    seen: List[str] = []
    s = agent._session_now()
    enc, frame = s._submit_encoded, s._submit_frame
    monkeypatch.setattr(s, "_submit_encoded", lambda f, b, k: (seen.append("encoded"), enc(f, b, k))[1])
    monkeypatch.setattr(s, "_submit_frame", lambda f, b, k: (seen.append("frame"), frame(f, b, k))[1])

    def joined(f: str, key: bytes, pieces: Any, k: Any) -> None:  # one frame too, of pieces
        if s._conn is not None and _session._frame is not None:  # (else through _submit_frame, counted there)
            seen.append("frame")
        type(s)._submit_joined(s, f, key, pieces, k)

    monkeypatch.setattr(s, "_submit_joined", joined)
    return seen


def _ring_free(agent) -> int:
    for _ in range(300):
        if agent._windows.free == _indices.WINDOW_SLOTS:
            break
        time.sleep(0.01)
    return agent._windows.free  # type: ignore[no-any-return]


def test_fits_takes_in_range_int64_arrays_only(small_ring):
    lane = _lane(1000)
    ok = rng.permutation(1000)[:64].astype(np.int64)
    assert lane.fits(ok, ok)
    edge = ok.copy()
    edge[5] = 999
    assert lane.fits(edge, ok)  # n - 1: in range
    for bad in (1000, -1, 1 << 32, (1 << 32) + 3, -(1 << 63)):  # exactly n, negative, past u32, wrapping
        b = ok.copy()
        b[7] = bad
        assert not lane.fits(b, ok) and not lane.fits(ok, b), bad
    assert lane.fits(np.arange(0, 128, 2, dtype=np.int64)[::1], ok)
    strided = np.arange(128, dtype=np.int64)[::2]  # not contiguous: read as it is
    assert lane.fits(strided, ok)
    for other in (ok.astype(np.uint32), ok.astype(np.int32), ok.astype(np.uint64), ok.astype(">i8"), list(ok)):
        assert not lane.fits(other, ok)  # the general way checks (and packs) these
    assert not lane.fits(ok.reshape(8, 8), ok.reshape(8, 8))
    assert not lane.fits(ok, ok[:63])
    assert lane.fits(ok[:7], ok[:7])  # below WINDOW_MIN: packed into the request
    assert not lane.fits(ok[:0], ok[:0])  # no index: the general way refuses it
    big = np.zeros(_indices.WINDOW_MAX + 1, dtype=np.int64)
    assert not lane.fits(big, big)  # past WINDOW_MAX


def test_pack_both_fills_the_slot_and_keeps_the_fields_per_count():
    ring = _indices.Windows(_FakeBuffer())
    li = np.arange(200, dtype=np.int64)[::2]  # not contiguous
    ri = rng.permutation(1 << 20)[:100]
    slot, fields = ring.put(li, ri)  # type: ignore[misc]
    assert fields == ring.pack(slot, 0, li) + ring.pack(slot, 1, ri)
    assert ring.pack_both(slot, li, ri) is fields  # the same count: the same bytes object
    m = _proto.message("ReadPreparedRequest").FromString(fields)
    for w, want in ((m.local_window, li), (m.remote_window, ri)):
        assert w.count == len(want)
        assert np.array_equal(ring.buffer.mem[w.offset:w.offset + 4 * w.count].view("<u4"), want)
    fewer = ring.pack_both(slot, li[:10], ri[:10])
    assert _proto.message("ReadPreparedRequest").FromString(fewer).local_window.count == 10
    while ring.take() is not None:
        pass
    assert ring.put(li, ri) is None  # no slot free


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_requests_between_the_same_handles_take_the_lane(daemons, monkeypatch, small_ring, op):
    """The first request is made the general way and keeps its lane on the local handle (its
    post already takes the lane); the next ones (fresh arrays each) are made on it: one frame
    each, through the ring, bytes and notifications delivered, telemetry kept; a DONE handle
    posts again on the lane; the slots come back."""
    A, B, amem, bmem, local, remote = _agents_with_lists(daemons, R, N)
    try:
        seen = _counting(monkeypatch, A)
        assert not local._lanes
        lane0 = None
        for k in range(3):
            _fill(op, amem, bmem)
            li, ri = rng.permutation(R * N)[:32], rng.permutation(R * N)[:32]
            h = A.make_prepped_xfer(op, local, li, remote, ri, notif_msg=f"lane-{k}".encode())
            lane0 = lane0 or h._xfer.plan.lane
            assert list(local._lanes.values()) == [lane0] and h._xfer.plan.lane is lane0
            A.transfer(h)
            assert h._xfer.plan.windowed == 2
            assert wait(A, h) == "DONE", h.error
            _check_blocks(op, li, ri, amem, bmem, N)
            assert _notifs(B, 1) == {"xf-A": [f"lane-{k}".encode()]}
            t = A.get_xfer_telemetry(h)
            assert (t.totalBytes, t.descCount) == (32 * BLOCK, 32) and t.startTime > 0 and t.xferDuration >= t.postDuration >= 0
            if k == 2:  # posted again once DONE: the lane again
                A.transfer(h)
                assert wait(A, h) == "DONE", h.error
            A.release_xfer_handle(h)
        assert seen == ["frame"] * 4
        assert _ring_free(A) == _indices.WINDOW_SLOTS
    finally:
        A.close()
        B.close()


def test_a_lane_still_refuses_bad_indices_naming_them(daemons, small_ring):
    A, B, amem, bmem, local, remote = _agents_with_lists(daemons, R, N)
    try:
        h = A.make_prepped_xfer("READ", local, rng.permutation(R * N)[:32], remote, rng.permutation(R * N)[:32])
        assert local._lanes
        A.release_xfer_handle(h)
        for at, bad in ((9, R * N), (3, -1), (0, 1 << 32), (31, (1 << 32) + 5)):
            li = rng.permutation(R * N)[:32]
            li[at] = bad
            with pytest.raises(nixlInvalidParamError, match=rf"local_indices\[{at}\]: index {bad} is outside the prepared list"):
                A.make_prepped_xfer("READ", local, li, remote, rng.permutation(R * N)[:32])
            with pytest.raises(nixlInvalidParamError, match=rf"remote_indices\[{at}\]: index {bad} is outside the prepared list"):
                A.make_prepped_xfer("READ", local, rng.permutation(R * N)[:32], remote, li)
        with pytest.raises(Exception, match="local_indices: 32 indices against remote_indices' 31"):
            A.make_prepped_xfer("READ", local, rng.permutation(R * N)[:32], remote, rng.permutation(R * N)[:31])
    finally:
        A.close()
        B.close()


def test_a_lane_ends_with_its_handles_and_a_refusal(daemons, small_ring):
    A, B, amem, bmem, local, remote = _agents_with_lists(daemons, R, N)
    try:
        li, ri = rng.permutation(R * N)[:32], rng.permutation(R * N)[:32]
        A.release_xfer_handle(A.make_prepped_xfer("READ", local, li, remote, ri))
        lane = next(iter(local._lanes.values()))
        lane.local.refused = True  # as a renewed session's PrepareBlocks refusal marks it
        h = A.make_prepped_xfer("READ", local, li, remote, ri)
        assert h._xfer.plan.path == "blocks"  # the general way: the block path
        A.release_xfer_handle(h)
        lane.local.refused = False
        remote2 = A.prep_xfer_dlist("xf-B", [(int(m.ctypes.data) + i * BLOCK, BLOCK, 0) for m in bmem for i in range(N)], "DRAM")
        A.release_xfer_handle(A.make_prepped_xfer("READ", local, li, remote2, ri))
        assert len(local._lanes) == 2
        with pytest.raises(nixlInvalidParamError, match="local_xfer_side: not a prepared list of this agent"):
            B.make_prepped_xfer("READ", local, li, remote, ri)  # A's handles, B's call
        A.release_dlist_handle(remote2)
        with pytest.raises(nixlNotFoundError, match="remote_xfer_side: released"):
            A.make_prepped_xfer("READ", local, li, remote2, ri)
        A.release_dlist_handle(local)
        assert not local._lanes
        with pytest.raises(nixlNotFoundError, match="local_xfer_side: released"):
            A.make_prepped_xfer("READ", local, li, remote, ri)
    finally:
        A.close()
        B.close()


def test_a_lane_binds_a_renewed_session_and_falls_back_when_the_ring_is_full(daemons, small_ring):
    A, B, amem, bmem, local, remote = _agents_with_lists(daemons, R, N)
    try:
        _fill("READ", amem, bmem)
        li, ri = rng.permutation(R * N)[:32], rng.permutation(R * N)[:32]
        A.release_xfer_handle(A.make_prepped_xfer("READ", local, li, remote, ri))
        first = A._session_now()
        first._abort("cancelled")
        while first._ended is None:
            time.sleep(0.01)
        h = A.make_prepped_xfer("READ", local, li, remote, ri)
        A.transfer(h)  # the lists prepared again on the new session, then the lane binds it
        assert wait(A, h) == "DONE", h.error
        _check_blocks("READ", li, ri, amem, bmem, N)
        lane = h._xfer.plan.lane
        A.transfer(h)
        assert wait(A, h) == "DONE", h.error
        assert lane.bound[0][0] is A._session_now() is not first
        held = [A._windows.take() for _ in range(_indices.WINDOW_SLOTS)]
        A.transfer(h)  # no slot: packed, as before
        assert h._xfer.plan.windowed == 0 and wait(A, h) == "DONE", h.error
        for s in held:
            A._windows.give(s)
    finally:
        A.close()
        B.close()


class _NoAnswer:
    """A session that takes frames and never answers them (cancels are recorded)."""

    def __init__(self) -> None:
        self.sent: List[Any] = []
        self.cancelled: List[Any] = []

    def _submit_frame(self, field: str, body: bytes, sink: Any) -> None:
        sink.tag = len(self.sent) + 1
        self.sent.append((field, body))

    def _submit_joined(self, field: str, key: bytes, pieces: Any, sink: Any) -> None:
        self._submit_frame(field, b"".join(pieces), sink)

    def cancel(self, part: Any) -> None:
        self.cancelled.append(part.tag)


def test_post_one_keeps_the_handle_rules():
    """Xfer.post_one: PROC; posting again while PROC is refused; releasing cancels the request
    and frees its slot; a released handle is refused; a session closed under it ends it in ERR."""
    lane = _plan.Lane("READ", _Side(100), _Side(100), True, 0)  # type: ignore[arg-type]
    pr = _plan.Prepared(lane, np.arange(10), np.arange(10))
    x = Xfer(pr, "peer", b"", timed=False)
    s = _NoAnswer()
    freed: List[int] = []
    assert x.post_one(s, "read_prepared", b"body", lambda: freed.append(1)) == "PROC"
    assert s.sent == [("read_prepared", b"body")] and x.telemetry is None
    with pytest.raises(nixlRepostActiveError):
        x.post_one(s, "read_prepared", b"body", None)
    x.release()
    assert x.state == "ERR" and s.cancelled == [1]
    x._parts[0].set_exception(TcpxdError("cancelled"))  # the daemon's answer to the cancel
    assert freed == [1] and x.state == "ERR"
    with pytest.raises(nixlNotFoundError, match="handle: released"):
        x.post_one(s, "read_prepared", b"body", None)

    class Closed:
        def _submit_frame(self, *_a: Any) -> None:
            raise TcpxdError("the session is closed")

    y = Xfer(pr, "peer", b"", timed=True)
    with pytest.raises(TcpxdError):
        y.post_one(Closed(), "read_prepared", b"body", lambda: freed.append(2))
    assert y.state == "ERR" and freed == [1]  # nothing was sent: `answered` not called
    z = Xfer(pr, "peer", b"", timed=True)  # a body in pieces, with its field's key: joined
    assert z.post_one(s, "read_prepared", (b"bo", b"", b"dy"), None, b"\x42") == "PROC"
    assert s.sent[-1] == ("read_prepared", b"body") and z.telemetry.startTime > 0


@pytest.mark.parametrize("how", ["frame", "joined"])
@pytest.mark.parametrize("path", ["local", "grpc"])
def test_submit_frame_lands_byte_exact_and_fails_like_submit_encoded(peered, path, how):
    """Session._submit_frame, and _submit_joined (the body as pieces, framed by the C pass where
    it is built): a WRITE with its notification lands byte exact (on the local session as one
    frame; over gRPC, and for a body past 32 KiB, the general way); after the session ended the
    sink gets its end; a closed session refuses it."""
    import tcpxd
    from tcpxd._session import _field_key

    def submit(s: Any, body: bytes, sink: Any) -> None:
        if how == "frame":
            s._submit_frame("write", body, sink)
        else:
            third = len(body) // 3
            s._submit_joined("write", _field_key("write"), (body[:third], body[third:2 * third], body[2 * third:]), sink)

    a, b = peered
    kw = {} if path == "local" else {"local": False}
    with tcpxd.Client(a.endpoint, **kw) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(1 << 16) as src, cb.register_host(1 << 16) as dst, cb.subscribe() as sub:
            src.fill(seed=13)
            s = ca.session()
            for i, note in enumerate((b"small", b"n" * 5000, b"m" * 40000)):
                entry = _proto.message("WriteEntry")(local_buffer_id=src.id, local_offset=i * 4096, remote_descriptor=dst.descriptor,
                                                     remote_offset=(3 - i) * 4096, length=4096).SerializeToString()
                W = _proto.message("WriteRequest")
                body = W(entry=_proto.message("WriteEntry").FromString(entry), notification=note).SerializeToString()
                sink = _Sink()
                submit(s, body, sink)
                assert sink.wait() == "ok" and sink.tag > 0
                assert sub.next(timeout=30).payload == note
                assert dst.read_bytes((3 - i) * 4096, 4096) == src.read_bytes(i * 4096, 4096)
            if path == "local":
                s._abort("cancelled")
                while s._ended is None:
                    time.sleep(0.01)
                ended = _Sink()
                submit(s, body, ended)
                assert ended.wait().startswith("error: ") and not s._pending
            s.close()
            with pytest.raises(TcpxdError, match="the session is closed"):
                submit(s, body, _Sink())


@pytest.mark.parametrize("how", ["frame", "joined"])
def test_a_request_past_the_frame_limit_fails_unsent(peered, monkeypatch, how):
    """A request over the local session's frame limit (lowered here) fails its sink with
    ResourceExhausted naming the limit, is no longer pending, and the session goes on."""
    import tcpxd
    from tcpxd import _local
    from tcpxd._session import _field_key

    a, _b = peered
    monkeypatch.setattr(_local, "MAX_FRAME", 40000)
    with tcpxd.Client(a.endpoint) as ca:
        s = ca.session()
        sink = _Sink()
        body = b"\x2a\xc0\xbb\x03" + b"n" * 56768  # WriteRequest.notification: 56,768 bytes
        if how == "frame":
            s._submit_frame("write", body, sink)
        else:
            s._submit_joined("write", _field_key("write"), (body[:10], body[10:]), sink)
        out = sink.wait()
        assert out.startswith("error: ") and "over the local session's 40000-byte frame limit" in out, out
        assert not s._pending and s._ended is None
        s.close()


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_few_indices_on_a_lane_go_packed_in_the_request(daemons, monkeypatch, op):
    """Requests of fewer than WINDOW_MIN indices (vLLM's one-block ones) take the lane too, their
    indices packed into the request (no ring slot): one frame, the blocks and the notification
    delivered."""
    A, B, amem, bmem, local, remote = _agents_with_lists(daemons, R, N)
    try:
        sent: List[Any] = []
        s = A._session_now()
        frame = s._submit_frame
        monkeypatch.setattr(s, "_submit_frame", lambda f, b, k: (sent.append((f, b)), frame(f, b, k))[1])
        for k in range(3):
            _fill(op, amem, bmem)
            li, ri = rng.permutation(R * N)[:4], rng.permutation(R * N)[:4]
            h = A.make_prepped_xfer(op, local, li, remote, ri, notif_msg=f"few-{k}".encode())
            A.transfer(h)
            assert wait(A, h) == "DONE", h.error
            assert h._xfer.plan.windowed == 0 and local._lanes
            _check_blocks(op, li, ri, amem, bmem, N)
            assert _notifs(B, 1) == {"xf-A": [f"few-{k}".encode()]}
            field, body = sent[-1]
            req = _proto.message("ReadPreparedRequest" if op == "READ" else "WritePreparedRequest").FromString(body)
            assert field == op.lower() + "_prepared" and req.notification and not req.HasField("local_window")
            assert np.array_equal(np.frombuffer(req.local_indices, "<u4"), li)
            assert np.array_equal(np.frombuffer(req.remote_indices, "<u4"), ri)
        assert len(sent) == 3 and A._windows is None  # no ring registered for them
    finally:
        A.close()
        B.close()
