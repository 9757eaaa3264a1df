"""The prepared path's request, as sent: indices checked in one pass and packed as u32s into
reused scratch arrays, the body sent as pieces (no join) by one sendmsg, resumed after a partial
send; and a session's encoded submits of piece bodies over both paths, bytes checked."""

from __future__ import annotations

import time
from typing import Any, List

import numpy as np
import pytest

import tcpxd
from tcpxd import _proto
from tcpxd.client import _send_pieces
from tcpxd.nixl import nixlInvalidParamError
from tcpxd.nixl import _indices, _plan

rng = np.random.default_rng(24)


@pytest.mark.parametrize("dtype", ["<i8", "<u8", "<i4", "<u4", "<i2", "<u2"])
def test_native_integer_indices_come_back_as_given(dtype):
    a = rng.permutation(300)[:200].astype(dtype)
    got = _indices.indices(a, 300, "local_indices")
    assert got is a  # checked in place: no conversion, no copy


@pytest.mark.parametrize("bad, at, shown", [(-1, 5, -1), (300, 7, 300), ((1 << 32) + 3, 9, (1 << 32) + 3), (-(1 << 40), 0, -(1 << 40))])
def test_an_index_out_of_range_is_named(bad, at, shown):
    a = np.arange(20, dtype=np.int64)
    a[at] = bad
    with pytest.raises(nixlInvalidParamError, match=rf"local_indices\[{at}\]: index {shown} is outside the prepared list of 300"):
        _indices.indices(a, 300, "local_indices")


def test_uint64_past_int64_and_big_endian_indices():
    a = np.array([1, 2, (1 << 64) - 1], dtype=np.uint64)
    with pytest.raises(nixlInvalidParamError, match=rf"remote_indices\[2\]: index {(1 << 64) - 1} is outside"):
        _indices.indices(a, 10, "remote_indices")
    be = np.array([3, 0, 9], dtype=">i8")  # not native: the general path, as int64
    got = _indices.indices(be, 10, "remote_indices")
    assert got.dtype == np.int64 and got.tolist() == [3, 0, 9]
    with pytest.raises(nixlInvalidParamError, match=r"remote_indices\[1\]: index -4 is outside"):
        _indices.indices(np.array([3, -4], dtype=">i8"), 10, "remote_indices")
    assert _indices.indices([4, 1], 10, "x").tolist() == [4, 1]
    strided = np.arange(40, dtype=np.int64)[::3]  # a view: checked in place too
    assert _indices.indices(strided, 40, "x") is strided


def test_scratch_packs_u32_bytes_and_reuses_its_arrays():
    s = _indices.Scratch()
    a = rng.integers(0, 1 << 22, 5000).astype(np.int64)
    got = s.pack(0, a)
    assert bytes(got) == a.astype("<u4").tobytes()
    first = got.obj
    b = rng.integers(0, 1 << 22, 3000).astype(np.int64)[::-1]  # smaller, not contiguous
    got = s.pack(0, b)
    assert bytes(got) == b.astype("<u4").tobytes()
    assert np.shares_memory(np.frombuffer(got, dtype="<u4"), first)  # the same array, reused
    big = rng.integers(0, 1 << 22, 9000).astype(np.int32)
    assert bytes(s.pack(0, big)) == big.astype("<u4").tobytes()  # grown
    assert bytes(s.pack(1, a[:10])) == a[:10].astype("<u4").tobytes()  # the other side's own
    u = np.arange(100, dtype="<u4")
    mv = s.pack(1, u)
    assert np.shares_memory(np.frombuffer(mv, dtype="<u4"), u)  # sent from the caller's array


@pytest.mark.parametrize("op, msg", [("READ", "ReadPreparedRequest"), ("WRITE", "WritePreparedRequest")])
@pytest.mark.parametrize("n, notif, tmo", [(1, b"", 0), (64, b"req-7:1", 2500), (32768, b"x" * 300, 1 << 40)])
def test_the_body_is_the_prepared_request(op, msg, n, notif, tmo):
    li = rng.integers(0, 1 << 22, n).astype(np.int64)
    ri = rng.integers(0, 1 << 22, n).astype(np.uint32)
    pr = _plan.Prepared(_plan.Lane(op, None, None, True, tmo), li, ri)  # type: ignore[arg-type]
    body = pr.body(130, 5, notif, _indices.Scratch())
    want = _proto.message(msg)(local_prepared_id=130, local_indices=li.astype("<u4").tobytes(), remote_prepared_id=5,
                               remote_indices=ri.tobytes(), notification=notif, timeout_ms=tmo)
    assert b"".join(body) == want.SerializeToString()


class Trickle:
    """A socket that takes at most `most` bytes a sendmsg (a partial send each time)."""

    def __init__(self, most: int):
        self.most = most
        self.got = bytearray()
        self.calls = 0

    def sendmsg(self, buffers: List[Any]) -> int:
        self.calls += 1
        data = b"".join(bytes(memoryview(b).cast("B")) for b in buffers)[: self.most]
        self.got += data
        return len(data)


@pytest.mark.parametrize("most", [1, 7, 4096, 1 << 30])
def test_pieces_are_sent_in_order_through_partial_sends(most):
    arr = rng.integers(0, 1 << 30, 3000 if most > 1 else 20).astype("<u4")
    pieces = [b"head", arr.data.cast("B"), b"", b"mid", memoryview(b"tail-bytes")]
    want = b"".join(bytes(memoryview(p).cast("B")) for p in pieces)
    sock = Trickle(most)
    _send_pieces(sock, pieces, len(want))  # type: ignore[arg-type]
    assert bytes(sock.got) == want
    assert sock.calls == -(-len(want) // most)  # one sendmsg when it takes everything


def test_more_pieces_than_iov_max():
    pieces = [bytes([i % 251]) * 3 for i in range(2500)]
    want = b"".join(pieces)
    sock = Trickle(1 << 30)
    _send_pieces(sock, pieces, len(want))  # type: ignore[arg-type]
    assert bytes(sock.got) == want and sock.calls == 3


@pytest.mark.parametrize("path", ["local", "grpc"])
def test_encoded_piece_bodies_land_byte_exact(peered, path):
    """Session._submit_encoded with bodies given as pieces (bytes and numpy byte views) on both
    paths: WRITEs whose entries and notifications are split across pieces."""
    a, b = peered
    kw = {} if path == "local" else {"local": False}
    with tcpxd.Client(a.endpoint, **kw) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(1 << 16) as src, cb.register_host(1 << 16) as dst, cb.subscribe() as sub:
            src.fill(seed=11)
            with ca.session() as s:
                bodies, sinks = [], []
                for i in range(3):
                    entry = _proto.message("WriteEntry")(local_buffer_id=src.id, local_offset=i * 4096, remote_descriptor=dst.descriptor,
                                                         remote_offset=(5 - i) * 4096, length=4096).SerializeToString()
                    note = np.frombuffer(f"piece-{i}".encode(), dtype=np.uint8)
                    head = b"\x0a" + bytes([len(entry)])
                    bodies.append([head, memoryview(entry), b"\x12" + bytes([len(note)]), note.data.cast("B")])
                    sinks.append(_Sink())
                s._submit_encoded("write", bodies, sinks)
                for sink in sinks:
                    assert sink.wait() == "ok"
            got = sorted(sub.next(timeout=30).payload for _ in range(3))
            assert got == [b"piece-0", b"piece-1", b"piece-2"]
            for i in range(3):
                assert dst.read_bytes((5 - i) * 4096, 4096) == src.read_bytes(i * 4096, 4096)


def test_one_encoded_body_lands_byte_exact_in_each_form_and_fails_alone_when_too_large(peered):
    """Session._submit_encoded with one body (its own frame path: tcpxd.nixl's prepared
    requests): as bytes, as one piece, as pieces with a numpy byte view; each WRITE lands byte
    exact with its notification. One over the frame limit fails alone (ResourceExhausted naming
    the limit, nothing pending), the session goes on; after the session ended, the sink gets the
    session's end."""
    from tcpxd import _local

    a, b = peered
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(1 << 16) as src, cb.register_host(1 << 16) as dst, cb.subscribe() as sub:
            src.fill(seed=12)
            s = ca.session()
            assert s.path == "local session"
            for i, form in enumerate(("bytes", "one piece", "pieces")):
                entry = _proto.message("WriteEntry")(local_buffer_id=src.id, local_offset=i * 4096, remote_descriptor=dst.descriptor,
                                                     remote_offset=(7 - i) * 4096, length=4096).SerializeToString()
                whole = b"\x0a" + bytes([len(entry)]) + entry + b"\x12" + bytes([len(form)]) + form.encode()
                note = np.frombuffer(form.encode(), dtype=np.uint8)
                body: Any = {"bytes": whole, "one piece": [whole],
                             "pieces": [b"\x0a" + bytes([len(entry)]), memoryview(entry), b"\x12" + bytes([len(note)]), note.data.cast("B")]}[form]
                sink = _Sink()
                s._submit_encoded("write", [body], [sink])
                assert sink.wait() == "ok", form
                assert sink.tag > 0
            got = sorted(sub.next(timeout=30).payload for _ in range(3))
            assert got == [b"bytes", b"one piece", b"pieces"]
            for i in range(3):
                assert dst.read_bytes((7 - i) * 4096, 4096) == src.read_bytes(i * 4096, 4096)
            huge = _Sink()
            s._submit_encoded("write", [[b"\x12\x80\x80\x80\x20", bytes(_local.MAX_FRAME)]], [huge])
            assert "67108864-byte frame limit" in huge.wait() and not s._pending
            after = _Sink()
            entry = _proto.message("WriteEntry")(local_buffer_id=src.id, local_offset=0, remote_descriptor=dst.descriptor,
                                                 remote_offset=0, length=16).SerializeToString()
            s._submit_encoded("write", [b"\x0a" + bytes([len(entry)]) + entry], [after])
            assert after.wait() == "ok"
            s._abort("cancelled")
            deadline = time.monotonic() + 30
            while s._ended is None and time.monotonic() < deadline:
                time.sleep(0.01)
            ended = _Sink()
            s._submit_encoded("write", [b"\x0a" + bytes([len(entry)]) + entry], [ended])
            assert ended.wait().startswith("error: ") and not s._pending


class _Sink:
    def __init__(self):
        import threading

        self.tag = 0
        self._ev = threading.Event()
        self.outcome = ""

    def set_result(self, _r: Any) -> None:
        self.outcome = "ok"
        self._ev.set()

    def set_exception(self, e: BaseException) -> None:
        self.outcome = f"error: {e}"
        self._ev.set()

    def wait(self) -> str:
        assert self._ev.wait(30)
        return self.outcome


@pytest.mark.parametrize("op, dtype", [("READ", "<u4"), ("WRITE", "<i4"), ("READ", "<i8")])
def test_indices_of_any_integer_dtype_move_the_right_blocks_on_both_paths(daemons, monkeypatch, op, dtype):
    """The indices as given (u32 sent from the caller's own array, others packed): the prepared
    request moves the named blocks; when the daemon will not take the prepared lists at transfer
    time, the same handle goes by the block path, the same bytes."""
    from test_nixl_transfers import BLOCK, pair, regions, wait

    from tcpxd.errors import FailedPrecondition

    a, b = daemons
    A, B = pair(a, b)
    try:
        amem, ablocks = regions(A, 64)
        bmem, bblocks = regions(B, 64)
        A.add_remote_agent(B.get_agent_metadata())
        local = A.prep_xfer_dlist("NIXL_INIT_AGENT", ablocks, "DRAM")
        remote = A.prep_xfer_dlist("xf-B", bblocks, "DRAM")
        for path in ("prepared", "blocks"):
            src, dst = (bmem, amem) if op == "READ" else (amem, bmem)
            src[:] = rng.integers(0, 256, src.nbytes, dtype=np.uint8)
            dst[:] = 0
            li, ri = rng.permutation(64)[:24].astype(dtype), rng.permutation(64)[:24].astype(dtype)
            h = A.make_prepped_xfer(op, local, li, remote, ri, notif_msg=b"landed")
            assert h._xfer.plan.path == "prepared"
            if path == "blocks":  # a new session, on which the daemon refuses to prepare the lists again
                def refuse(session, prepped):
                    raise FailedPrecondition("prepared lists refused (test)")
                monkeypatch.setattr(A, "_prepared_id", refuse)
                A._session_now()._abort("cancelled")
            A.transfer(h)
            assert wait(A, h) == "DONE", h.error
            assert h._xfer.plan.path == path
            for x, y in zip(li.tolist(), ri.tolist()):
                s, d = (y, x) if op == "READ" else (x, y)
                assert np.array_equal(dst[d * BLOCK:(d + 1) * BLOCK], src[s * BLOCK:(s + 1) * BLOCK]), (x, y)
            A.release_xfer_handle(h)
    finally:
        A.close()
        B.close()
