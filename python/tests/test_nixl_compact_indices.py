"""The prepared path's large index arrays without 4 bytes an index in the request: through the
agent's index ring (IndexWindow: packed into a slot of a host buffer shared with the daemon, the
slot free again once the request is answered), or, where the ring cannot serve, index arrays of
vLLM's form (region base + block id, R regions × B blocks, flattened) found exactly and sent as
outer sums (OuterIndices); anything else packed as before. The transfers land byte-exact; a daemon
refuses malformed windows and outer sums naming the field and the limit."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import tcpxd
from tcpxd import _proto
from tcpxd.nixl import nixlInvalidParamError
from tcpxd.nixl import _indices, _plan

rng = np.random.default_rng(2411)


class Lst:
    """What Outer.encode reads of a prepared list: its length and its descriptors' regions."""

    def __init__(self, regions: int, per: int):
        self.region = np.repeat(np.arange(regions), per)
        self._rows = None

    rows = _plan.Prepped.rows

    def __len__(self) -> int:
        return len(self.region)


def vllm_ids(regions: int, blocks: int, per: int, region_ids: Any = None) -> np.ndarray:
    """vLLM's descriptor ids: region_ids[:, None] * blocks + block_ids[None, :], flattened."""
    r = np.arange(regions) if region_ids is None else np.asarray(region_ids)
    b = rng.choice(blocks, per, replace=False)
    return (r[:, None] * blocks + b[None, :]).reshape(-1)


def decoded(enc: bytes) -> np.ndarray:
    m = _proto.message("OuterIndices").FromString(enc)
    rows, cols = np.frombuffer(m.rows, "<u4"), np.frombuffer(m.cols, "<u4")
    return (rows.astype(np.int64)[:, None] + cols.astype(np.int64)[None, :]).reshape(-1)


@pytest.mark.parametrize("dtype", ["<i8", "<u8"])
@pytest.mark.parametrize("regions, blocks, per", [(64, 4096, 512), (2, 1024, 512), (8, 300, 300)])
def test_vllm_ids_are_sent_as_outer_sums_that_expand_to_them(dtype, regions, blocks, per):
    lst = Lst(regions, blocks)
    ids = vllm_ids(regions, blocks, per).astype(dtype)
    enc = _indices.Outer().encode(ids, lst)
    assert enc is not None
    assert np.array_equal(decoded(enc), ids.astype(np.int64))
    assert len(enc) <= 4 * (regions + per) + 8  # R + B u32s, not R × B


def test_any_arithmetic_row_bases_and_descending_rows():
    lst = Lst(16, 1000)
    for region_ids in (np.arange(15, -1, -1), np.arange(16)):
        ids = vllm_ids(16, 1000, 100, region_ids)
        enc = _indices.Outer().encode(ids, lst)
        assert enc is not None and np.array_equal(decoded(enc), ids)
    same = np.tile(rng.choice(16000, 200, replace=False), 16)  # every row the same: K = 0
    enc = _indices.Outer().encode(same, lst)
    assert enc is not None and np.array_equal(decoded(enc), same)


def test_other_arrays_go_packed():
    lst = Lst(64, 4096)
    o = _indices.Outer()
    ids = vllm_ids(64, 4096, 512)
    assert o.encode(rng.permutation(len(lst))[:32768], lst) is None  # not of the form
    assert o.encode(ids.astype(np.int32), lst) is None  # 8-byte integers only
    assert o.encode(ids.astype(">i8"), lst) is None  # native only
    assert o.encode(ids[:960], Lst(64, 4096)) is None  # fewer than OUTER_MIN
    assert o.encode(ids[:-1], lst) is None  # not R whole rows
    assert o.encode(ids.tolist(), lst) is None  # a list: the general path
    assert o.encode(ids.reshape(64, 512), lst) is None  # 2-D
    assert o.encode(ids, Lst(1, 262144)) is None  # one region: nothing to gain
    broken = ids.copy()
    broken[40000 % len(ids)] += 1  # one index off the form, in the middle
    assert o.encode(broken, lst) is None
    assert o.encode(ids, lst) is not None  # the scratch arrays serve the next call


@pytest.mark.parametrize("where, bad", [(0, -1), (5, 262144), (32767, 262144), (513, -4096)])
def test_out_of_range_indices_of_the_form_are_left_to_the_check_that_names_them(where, bad):
    """Shifting a whole column keeps the form; an index it pushes out of the list is not sent
    outer, and `indices` names the first one, as it always did."""
    lst = Lst(64, 4096)
    ids = vllm_ids(64, 4096, 512)
    col = where % 512
    ids[col::512] += bad - ids[where]
    assert _indices.Outer().encode(ids, lst) is None
    first = int(np.flatnonzero((ids < 0) | (ids >= len(lst)))[0])
    with pytest.raises(nixlInvalidParamError, match=rf"local_indices\[{first}\]: index {int(ids[first])} is outside the prepared list of 262144"):
        _indices.indices(ids, len(lst), "local_indices")


def test_wrapping_values_never_pass_for_the_form():
    """Rows that agree only modulo 2**64 (or indices past int64 as uint64) are not taken."""
    lst = Lst(4, 1024)
    top = np.int64(np.iinfo(np.int64).max)
    a = np.empty(4 * 512, dtype=np.int64)
    base = rng.choice(1024, 512, replace=False).astype(np.int64)
    for r in range(4):
        a[r * 512:(r + 1) * 512] = base + r * 1024
    a[:512] += top  # row 0 far out of range; the others not of the form then
    assert _indices.Outer().encode(a, lst) is None
    u = np.tile(rng.choice(1024, 512, replace=False).astype(np.uint64), 4)
    u[:] += np.uint64(1 << 63)  # every row the same, every index past int64
    assert _indices.Outer().encode(u, lst) is None
    with pytest.raises(nixlInvalidParamError, match=r"remote_indices\[0\]: index 922337203685477\d{4} is outside"):
        _indices.indices(u, len(lst), "remote_indices")


@pytest.mark.parametrize("op, msg", [("READ", "ReadPreparedRequest"), ("WRITE", "WritePreparedRequest")])
@pytest.mark.parametrize("outer_sides", [(True, True), (True, False), (False, True)])
def test_the_body_carries_outer_sides_in_their_fields(op, msg, outer_sides):
    lst = Lst(64, 4096)
    li, ri = vllm_ids(64, 4096, 512), vllm_ids(64, 4096, 512)
    o = _indices.Outer()
    lo = o.encode(li, lst) if outer_sides[0] else None
    ro = o.encode(ri, lst) if outer_sides[1] else None
    pr = _plan.Prepared(_plan.Lane(op, None, None, True, 900), li, ri, lo, ro)  # type: ignore[arg-type]
    body = pr.body(77, 1 << 40, b"req-3:1", _indices.Scratch())
    got = _proto.message(msg).FromString(b"".join(bytes(memoryview(p).cast("B")) for p in body))
    assert (got.local_prepared_id, got.remote_prepared_id, got.notification, got.timeout_ms) == (77, 1 << 40, b"req-3:1", 900)
    for outer, packed, field, want in ((lo, got.local_indices, got.local_outer, li), (ro, got.remote_indices, got.remote_outer, ri)):
        if outer is None:
            assert not field.rows and np.array_equal(np.frombuffer(packed, "<u4"), want)
        else:
            assert packed == b"" and np.array_equal(decoded(field.SerializeToString()), want)
    assert sum(len(memoryview(p).cast("B")) for p in body) < 20_000 if all(outer_sides) else True


def test_vllm_requests_move_the_named_blocks_by_outer_sums(daemons, monkeypatch):
    """Through the agents, without the index ring: 4 regions (registrations) of 64 blocks a side,
    vLLM's ids for 16 random blocks of each, READ and WRITE on the prepared path with both sides
    sent as outer sums (OUTER_MIN lowered to these sizes), bytes checked; the same with the remote
    side's ids not of the form (packed), and a bad index still refused by make_prepped_xfer,
    naming it."""
    from test_nixl_transfers import BLOCK, pair, regions, wait

    monkeypatch.setattr(_indices, "OUTER_MIN", 8)
    a, b = daemons
    A, B = pair(a, b)
    A._no_windows = True
    R, N, PER = 4, 64, 16
    try:
        amem, ablocks = zip(*[regions(A, N) for _ in range(R)])
        bmem, bblocks = zip(*[regions(B, N) for _ in range(R)])
        A.add_remote_agent(B.get_agent_metadata())
        local = A.prep_xfer_dlist("NIXL_INIT_AGENT", [d for r in ablocks for d in r], "DRAM")
        remote = A.prep_xfer_dlist("xf-B", [d for r in bblocks for d in r], "DRAM")
        sent = []
        session = A._session_now()
        submit, submit_frame, submit_joined = session._submit_encoded, session._submit_frame, session._submit_joined
        monkeypatch.setattr(session, "_submit_encoded", lambda f, bodies, sinks: (sent.append((f, bodies)), submit(f, bodies, sinks))[1])
        # (requests on a lane go as one frame; with both sides outer sums, joined in C)
        monkeypatch.setattr(session, "_submit_frame", lambda f, body, sink: (sent.append((f, [[body]])), submit_frame(f, body, sink))[1])
        monkeypatch.setattr(session, "_submit_joined",
                            lambda f, key, pieces, sink: (sent.append((f, [list(pieces)])), submit_joined(f, key, pieces, sink))[1])
        for op, remote_form in (("READ", True), ("WRITE", True), ("READ", False)):
            src, dst = (bmem, amem) if op == "READ" else (amem, bmem)
            for m in src:
                m[:] = rng.integers(0, 256, m.nbytes, dtype=np.uint8)
            for m in dst:
                m[:] = 0
            li = vllm_ids(R, N, PER)
            ri = vllm_ids(R, N, PER) if remote_form else rng.permutation(R * N)[: R * PER]
            h = A.make_prepped_xfer(op, local, li, remote, ri, notif_msg=b"outer")
            pr = h._xfer.plan.prepared
            assert pr is not None and pr.lo is not None and (pr.ro is not None) == remote_form
            A.transfer(h)
            assert wait(A, h) == "DONE", h.error
            field, bodies = sent[-1]
            assert field == ("read_prepared" if op == "READ" else "write_prepared")
            req = _proto.message("ReadPreparedRequest" if op == "READ" else "WritePreparedRequest").FromString(
                b"".join(bytes(memoryview(p).cast("B")) for p in bodies[0]))
            assert req.local_indices == b"" and len(req.local_outer.rows) == 4 * R
            assert (req.remote_indices == b"") == remote_form
            for x, y in zip(li.tolist(), ri.tolist()):
                s, d = (y, x) if op == "READ" else (x, y)
                sm, dm = src[s // N], dst[d // N]
                so, do = (s % N) * BLOCK, (d % N) * BLOCK
                assert np.array_equal(dm[do:do + BLOCK], sm[so:so + BLOCK]), (x, y)
            A.release_xfer_handle(h)
        bad = vllm_ids(R, N, PER)
        bad[PER + 3::PER] = R * N  # a column pushed out of the list: still the form
        with pytest.raises(nixlInvalidParamError, match=rf"remote_indices\[{PER + 3}\]: index {R * N} is outside the prepared list of {R * N}"):
            A.make_prepped_xfer("READ", local, vllm_ids(R, N, PER), remote, bad)
    finally:
        A.close()
        B.close()


def _outer(rows: Any, cols: Any) -> Any:
    return _proto.message("OuterIndices")(rows=np.asarray(rows, "<u4").tobytes(), cols=np.asarray(cols, "<u4").tobytes())


HOSTILE = [
    (dict(local_indices=b"\x01\x00\x00\x00", local_outer=_outer([0], [1])), "local_indices, local_outer: set one of them, not both"),
    (dict(remote_outer=_outer([0, 1], [])), "remote_outer.cols: at least one value is required"),
    (dict(local_outer=_proto.message("OuterIndices")(rows=b"\x00" * 6, cols=b"\x00" * 4)),
     "local_outer.rows: 6 bytes are not a whole number of 4-byte little-endian values"),
    (dict(remote_outer=_proto.message("OuterIndices")(rows=b"\x00" * 4 * 4096, cols=b"\x00" * 4 * 2048)),
     "remote_outer: 4096 rows x 2048 cols = 8388608 entries exceed the limit of 4194304"),
    (dict(local_outer=_outer([7, 0xFFFFFFF0], [0, 16])),
     "local_outer: the largest row (4294967280) plus the largest col (16) exceed the u32 limit of 4294967295"),
]


@pytest.mark.parametrize("path", ["local", "grpc", "unary"])
@pytest.mark.parametrize("fields, want", HOSTILE)
@pytest.mark.parametrize("msg, field", [("ReadPreparedRequest", "read_prepared"), ("WritePreparedRequest", "write_prepared")])
def test_a_daemon_refuses_malformed_outer_sums_naming_the_field(daemons, path, fields, want, msg, field):
    """Over both session paths (and the unary call): INVALID_ARGUMENT naming the field and the
    limit, before the prepared ids are looked up (these name none)."""
    a, _ = daemons
    full = {"local_indices": b"\x00\x00\x00\x00", "remote_indices": b"\x00\x00\x00\x00"}
    for k in fields:
        full.pop(k.replace("_outer", "_indices"), None)
    full.update(fields)
    req = _proto.message(msg)(local_prepared_id=1, remote_prepared_id=2, **full)
    kw = {} if path == "local" else {"local": False}
    with tcpxd.Client(a.endpoint, **kw) as c:
        if path == "unary":
            with pytest.raises(tcpxd.errors.InvalidArgument) as got:
                c._unary("WritePrepared" if field == "write_prepared" else "ReadPrepared", req)
            err: Any = got.value
        else:
            with c.session() as s:
                sink = _Sink()
                s._submit_encoded(field, [req.SerializeToString()], [sink])
                err = sink.wait()
        assert isinstance(err, tcpxd.errors.InvalidArgument), err
        assert str(err).endswith(want) or want in str(err), str(err)


class _Sink:
    def __init__(self) -> None:
        self.tag = 0
        self._ev = threading.Event()
        self.err: Any = None

    def set_result(self, _r: Any) -> None:
        self._ev.set()

    def set_exception(self, e: BaseException) -> None:
        self.err = e
        self._ev.set()

    def wait(self) -> Any:
        assert self._ev.wait(30)
        return self.err


def _agents_with_lists(daemons, R, N):
    from test_nixl_transfers import pair, regions

    a, b = daemons
    A, B = pair(a, b)
    amem, ablocks = zip(*[regions(A, N) for _ in range(R)])
    bmem, bblocks = zip(*[regions(B, N) for _ in range(R)])
    A.add_remote_agent(B.get_agent_metadata())
    local = A.prep_xfer_dlist("NIXL_INIT_AGENT", [d for r in ablocks for d in r], "DRAM")
    remote = A.prep_xfer_dlist("xf-B", [d for r in bblocks for d in r], "DRAM")
    return A, B, amem, bmem, local, remote


def _check_blocks(op, li, ri, amem, bmem, N):
    from test_nixl_transfers import BLOCK

    src, dst = (bmem, amem) if op == "READ" else (amem, bmem)
    for x, y in zip(li.tolist(), ri.tolist()):
        s, d = (y, x) if op == "READ" else (x, y)
        so, do = (s % N) * BLOCK, (d % N) * BLOCK
        assert np.array_equal(dst[d // N][do:do + BLOCK], src[s // N][so:so + BLOCK]), (x, y)


def _fill(op, amem, bmem):
    src, dst = (bmem, amem) if op == "READ" else (amem, bmem)
    for m in src:
        m[:] = rng.integers(0, 256, m.nbytes, dtype=np.uint8)
    for m in dst:
        m[:] = 0


@pytest.mark.parametrize("op", ["READ", "WRITE"])
@pytest.mark.parametrize("dtype", ["<i8", "<u4", "<i4"])
def test_requests_pass_their_indices_through_the_index_ring(daemons, monkeypatch, op, dtype):
    """Indices of any form and integer type (WINDOW_MIN lowered to these sizes) go through the
    ring: the request names two IndexWindows of the agent's ring buffer and carries no index; the
    named blocks move (bytes checked); the slot is free again once the request is answered."""
    from test_nixl_transfers import wait

    monkeypatch.setattr(_indices, "WINDOW_MIN", 8)
    monkeypatch.setattr(_indices, "OUTER_MIN", 8)  # one side alone of vLLM's form: both through the ring
    R, N = 4, 64
    A, B, amem, bmem, local, remote = _agents_with_lists(daemons, R, N)
    try:
        sent = []
        session = A._session_now()
        submit, frame = session._submit_encoded, session._submit_frame
        monkeypatch.setattr(session, "_submit_encoded", lambda f, bodies, sinks: (sent.append(bodies[0]), submit(f, bodies, sinks))[1])
        monkeypatch.setattr(session, "_submit_frame", lambda f, body, sink: (sent.append([body]), frame(f, body, sink))[1])
        for form in ("vllm", "random"):
            _fill(op, amem, bmem)
            li = vllm_ids(R, N, 16) if form == "vllm" else rng.permutation(R * N)[:64]
            ri = rng.permutation(R * N)[:64]
            li, ri = li.astype(dtype), ri.astype(dtype)
            h = A.make_prepped_xfer(op, local, li, remote, ri, notif_msg=b"ring")
            assert h._xfer.plan.prepared.lo is None  # no outer sums where the ring serves
            A.transfer(h)
            ring = A._windows
            assert ring is not None and h._xfer.plan.prepared.windowed == 2
            assert wait(A, h) == "DONE", h.error
            req = _proto.message("ReadPreparedRequest" if op == "READ" else "WritePreparedRequest").FromString(
                b"".join(bytes(memoryview(p).cast("B")) for p in sent[-1]))
            assert req.local_indices == b"" and req.remote_indices == b""
            assert (req.local_window.buffer_id, req.local_window.count) == (ring.id, 64)
            assert (req.remote_window.buffer_id, req.remote_window.count) == (ring.id, 64)
            assert req.remote_window.offset == req.local_window.offset + 4 * _indices.WINDOW_MAX
            assert len(req.SerializeToString()) < 100
            _check_blocks(op, li.astype(np.int64), ri.astype(np.int64), amem, bmem, N)
            deadline = 50
            while ring.free != _indices.WINDOW_SLOTS and deadline:  # the answer frees it
                import time

                time.sleep(0.01)
                deadline -= 1
            assert ring.free == _indices.WINDOW_SLOTS
            A.release_xfer_handle(h)
        # a bad index is still refused by make_prepped_xfer, naming it
        bad = rng.permutation(R * N)[:64]
        bad[9] = R * N + 5
        with pytest.raises(nixlInvalidParamError, match=rf"local_indices\[9\]: index {R * N + 5} is outside the prepared list"):
            A.make_prepped_xfer(op, local, bad, remote, rng.permutation(R * N)[:64])
    finally:
        A.close()
        B.close()


def test_a_slot_is_reused_only_after_its_request_was_answered(daemons, monkeypatch):
    """Six requests posted at once on a ring of 4 slots: the first four go through the ring, the
    others packed (no slot free); every one moves its own blocks; all slots come back."""
    from test_nixl_transfers import wait

    monkeypatch.setattr(_indices, "WINDOW_MIN", 8)
    monkeypatch.setattr(_indices, "WINDOW_SLOTS", 4)
    R, N = 4, 64
    A, B, amem, bmem, local, remote = _agents_with_lists(daemons, R, N)
    try:
        _fill("READ", amem, bmem)
        dests = rng.permutation(R * N)[: 6 * 32].reshape(6, 32)  # disjoint: each request's blocks its own
        hs = []
        for k in range(6):
            li, ri = dests[k], rng.permutation(R * N)[:32]
            h = A.make_prepped_xfer("READ", local, li, remote, ri)
            A.transfer(h)
            hs.append((h, li, ri, h._xfer.plan.prepared.windowed))
        assert [w for *_, w in hs][:4] == [2, 2, 2, 2]  # then packed, unless an answer came back already
        assert all(w in (0, 2) for *_, w in hs)
        for h, li, ri, _ in hs:
            assert wait(A, h) == "DONE", h.error
            _check_blocks("READ", li, ri, amem, bmem, N)
        import time

        for _ in range(50):
            if A._windows.free == 4:
                break
            time.sleep(0.01)
        assert A._windows.free == 4
    finally:
        A.close()
        B.close()


def test_the_ring_gives_a_slot_back_when_the_request_cannot_be_sent(daemons, monkeypatch):
    """A post that raises (the session closed under it) sent nothing: the slot is free again."""
    from tcpxd.errors import TcpxdError

    monkeypatch.setattr(_indices, "WINDOW_MIN", 8)
    R, N = 4, 64
    A, B, amem, bmem, local, remote = _agents_with_lists(daemons, R, N)
    try:
        h = A.make_prepped_xfer("READ", local, rng.permutation(R * N)[:32], remote, rng.permutation(R * N)[:32])
        session = A._session_now()

        def closed(*_a, **_k):
            raise TcpxdError("the session is closed")

        monkeypatch.setattr(session, "_submit_encoded", closed)
        monkeypatch.setattr(session, "_submit_frame", closed)
        with pytest.raises(Exception, match="the session is closed"):
            A.transfer(h)
        assert A._windows is not None and A._windows.free == _indices.WINDOW_SLOTS
    finally:
        A.close()
        B.close()


def _window(buffer_id: int, offset: int, count: int) -> Any:
    return _proto.message("IndexWindow")(buffer_id=buffer_id, offset=offset, count=count)


@pytest.mark.parametrize("path", ["local", "grpc", "unary"])
@pytest.mark.parametrize("msg, field", [("ReadPreparedRequest", "read_prepared"), ("WritePreparedRequest", "write_prepared")])
def test_a_daemon_refuses_malformed_windows_naming_the_field(daemons, path, msg, field):
    a, _ = daemons
    kw = {} if path == "local" else {"local": False}
    with tcpxd.Client(a.endpoint) as owner:
        with owner.register_host(4096) as buf:
            cases = [
                (dict(local_window=_window(buf.id, 0, 0)), tcpxd.errors.InvalidArgument, "local_window.count: at least one entry is required"),
                (dict(remote_window=_window(buf.id, 0, (1 << 22) + 1)), tcpxd.errors.InvalidArgument,
                 "remote_window.count: 4194305 indices exceed the limit of 4194304"),
                (dict(local_window=_window(buf.id + 1000, 0, 1)), tcpxd.errors.NotFound,
                 f"local_window.buffer_id: buffer {buf.id + 1000} does not exist"),
                (dict(remote_window=_window(buf.id, 4090, 2)), tcpxd.errors.InvalidArgument,
                 f"remote_window: 2 indices (8 bytes) at offset 4090 run past the end of buffer {buf.id} (4096 bytes)"),
                (dict(local_indices=b"\x00" * 4, local_window=_window(buf.id, 0, 1)), tcpxd.errors.InvalidArgument,
                 "local_indices, local_window: set one of them, not both"),
            ]
            with tcpxd.Client(a.endpoint, **kw) as c, c.session() as s:
                for fields, cls, want in cases:
                    full = {"local_indices": b"\x00" * 4, "remote_indices": b"\x00" * 4}
                    for k in fields:
                        if k.endswith("_window"):
                            full.pop(k.replace("_window", "_indices"), None)
                    full.update(fields)
                    req = _proto.message(msg)(local_prepared_id=1, remote_prepared_id=2, **full)
                    if path == "unary":
                        with pytest.raises(cls) as got:
                            c._unary("WritePrepared" if field == "write_prepared" else "ReadPrepared", req)
                        err: Any = got.value
                    else:
                        sink = _Sink()
                        s._submit_encoded(field, [req.SerializeToString()], [sink])
                        err = sink.wait()
                    assert isinstance(err, cls), (want, err)
                    assert want in str(err), str(err)


class _FakeBuffer:
    id = 77

    def __init__(self) -> None:
        self.mem = np.zeros(_indices.Windows.nbytes(), dtype=np.uint8)

    def numpy(self) -> np.ndarray:
        return self.mem


def test_windows_hand_out_each_slot_once_until_given_back():
    ring = _indices.Windows(_FakeBuffer())
    got = [ring.take() for _ in range(_indices.WINDOW_SLOTS)]
    assert sorted(got) == list(range(_indices.WINDOW_SLOTS)) and ring.take() is None and ring.free == 0
    ring.give(got[3])
    assert ring.take() == got[3] and ring.take() is None
    a = rng.permutation(1 << 20)[:_indices.WINDOW_MAX]
    field = ring.pack(5, 1, a)
    w = _proto.message("IndexWindow").FromString(field[2:])
    assert field[:1] == b"\x5a" and field[1] == len(field) - 2
    assert (w.buffer_id, w.offset, w.count) == (77, 4 * (2 * 5 + 1) * _indices.WINDOW_MAX, _indices.WINDOW_MAX)
    seen = ring.buffer.mem[w.offset:w.offset + 4 * w.count].view("<u4")
    assert np.array_equal(seen, a)


def test_the_daemon_lists_both_forms_and_an_agent_on_an_older_one_sends_indices_packed(daemons, monkeypatch):
    """DescribeNode's `features` names both forms; an agent whose daemon lists neither (an older
    daemon, which would read such a side as empty) sends its indices packed, bytes checked."""
    import dataclasses

    from test_nixl_transfers import wait

    a, _ = daemons
    with tcpxd.Client(a.endpoint) as c:
        assert {"prepared_outer_indices", "prepared_index_windows"} <= set(c.describe_node().features)
    describe = tcpxd.Client.describe_node
    monkeypatch.setattr(tcpxd.Client, "describe_node", lambda self: dataclasses.replace(describe(self), features=[]))
    monkeypatch.setattr(_indices, "WINDOW_MIN", 8)
    monkeypatch.setattr(_indices, "OUTER_MIN", 8)
    R, N = 4, 64
    A, B, amem, bmem, local, remote = _agents_with_lists(daemons, R, N)
    try:
        _fill("READ", amem, bmem)
        li, ri = vllm_ids(R, N, 16), vllm_ids(R, N, 16)
        h = A.make_prepped_xfer("READ", local, li, remote, ri)
        A.transfer(h)
        pr = h._xfer.plan.prepared
        assert pr.lo is None and pr.ro is None and pr.windowed == 0 and A._windows is None
        assert wait(A, h) == "DONE", h.error
        _check_blocks("READ", li, ri, amem, bmem, N)
    finally:
        A.close()
        B.close()


@pytest.mark.parametrize("op, msg", [("READ", "ReadPreparedRequest"), ("WRITE", "WritePreparedRequest")])
@pytest.mark.parametrize("notification", [b"", b"req-9:2"])
@pytest.mark.parametrize("outer_sides", [(False, False), (True, False), (False, True)])
def test_the_window_body_names_its_slot_and_carries_every_field(op, msg, notification, outer_sides):
    """Prepared.window_body: the prepared ids, notification and timeout as fields, each side not
    sent as an outer sum packed into its side of the slot and named by an IndexWindow (bytes
    read back from the ring), an outer side in its field; `windowed` counts the ring's sides."""
    lst = Lst(64, 4096)
    li = vllm_ids(64, 4096, 512)
    ri = vllm_ids(64, 4096, 512) if outer_sides[1] else rng.permutation(64 * 4096)[:64 * 512]
    o = _indices.Outer()
    lo = o.encode(li, lst) if outer_sides[0] else None
    ro = o.encode(ri, lst) if outer_sides[1] else None
    ring = _indices.Windows(_FakeBuffer())
    slot = ring.take()
    pr = _plan.Prepared(_plan.Lane(op, None, None, True, 900), li, ri, lo, ro)  # type: ignore[arg-type]
    body = pr.window_body(_plan.ids_field(300, 5), notification, ring, slot)
    assert len(body) == 1 and isinstance(body[0], bytes) and len(body[0]) < 3000
    got = _proto.message(msg).FromString(body[0])
    assert (got.local_prepared_id, got.remote_prepared_id, got.notification, got.timeout_ms) == (300, 5, notification, 900)
    assert got.local_indices == b"" and got.remote_indices == b""
    assert pr.windowed == (lo is None) + (ro is None)
    for side, (outer, field, window, want) in enumerate(((lo, got.local_outer, got.local_window, li),
                                                        (ro, got.remote_outer, got.remote_window, ri))):
        if outer is None:
            assert not field.rows and (window.buffer_id, window.count) == (77, len(want))
            assert window.offset == 4 * (2 * slot + side) * _indices.WINDOW_MAX
            seen = ring.buffer.mem[window.offset:window.offset + 4 * window.count].view("<u4")
            assert np.array_equal(seen, want)
        else:
            assert window.count == 0 and np.array_equal(decoded(field.SerializeToString()), want)
    ring.give(slot)
    assert ring.free == _indices.WINDOW_SLOTS


@pytest.mark.parametrize("idx", [[0], [3, 1, 2], list(range(16)), [0] * 16])
def test_a_short_list_of_indices_comes_back_as_the_array_numpy_makes(idx):
    """Session 21: a list of up to 16 ints (a small request's) skips numpy's checks; the same
    int64 array comes back, and anything out of range or not an int is still refused by name."""
    got = _indices.indices(idx, 16, "local_idx")
    assert got.dtype == np.int64 and got.tolist() == idx
    assert np.array_equal(got, _indices.indices(np.array(idx, dtype=np.int32), 16, "local_idx"))


@pytest.mark.parametrize("idx, k, v", [([0, 16], 1, 16), ([-1], 0, -1), ([2, 3, 99], 2, 99)])
def test_a_short_list_out_of_range_is_refused_naming_the_index(idx, k, v):
    with pytest.raises(nixlInvalidParamError, match=rf"local_idx\[{k}\]: index {v} is outside the prepared list of 16"):
        _indices.indices(idx, 16, "local_idx")
    with pytest.raises(nixlInvalidParamError, match="integer indices"):
        _indices.indices([0, 1.5], 16, "local_idx")
