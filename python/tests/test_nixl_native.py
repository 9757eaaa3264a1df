"""tcpxd._native (the optional C pass that finds vLLM's index form) against its numpy fallback,
and the agent's lane taking outer sums through it: every answer the same as numpy's on arrays of
and near the form, the requests on a lane sent as outer sums (no index ring slot) with the named
blocks moved, the ring again with the native pass off, and a bad index still refused by name."""

from __future__ import annotations

import time
from typing import Any, List

import numpy as np
import pytest

from tcpxd import _proto
from tcpxd.nixl import _indices, nixlInvalidParamError

from test_nixl_compact_indices import _agents_with_lists, _check_blocks, _fill, vllm_ids

native = pytest.importorskip("tcpxd._native", reason="tcpxd._native not built (no C compiler or Python headers)")
if _indices._native is None:
    pytest.skip("tcpxd._native turned off (TCPXD_NATIVE=0)", allow_module_level=True)
rng = np.random.default_rng(14)


class _List:
    """What Outer.encode reads of a prepared list: its rows (regions) and count."""

    def __init__(self, rows: int, n: int) -> None:
        self.rows, self.count = rows, n

    def __len__(self) -> int:
        return self.count


def _arrays() -> List[Any]:
    """(array, rows, n) of the form and just off it, every edge both passes check."""
    R, B, N = 16, 96, 128  # 16 regions of 128 blocks, 96 a request: 1,536 indices
    n = R * N
    out = []
    ids = vllm_ids(R, N, B)
    out.append((ids, R, n))  # vLLM's form, K = N
    out.append((ids.astype(np.uint64), R, n))  # as unsigned
    out.append((vllm_ids(R, N, B, region_ids=np.arange(R)[::-1]), R, n))  # K < 0: rows lifted by s
    out.append((np.tile(rng.choice(n, B, replace=False), R), R, n))  # K = 0: every row the same
    top = vllm_ids(R, N, B)
    top[B - 1 :: B] = np.arange(R) * N + (N - 1)  # the last row's largest index exactly n - 1
    out.append((top, R, n))
    over = top.copy()
    over[B - 1 :: B] += 1  # ... and one past: n, out of range
    out.append((over, R, n))
    out.append((ids, R, n - 1))  # the same array against a list one shorter (in range or not)
    neg = vllm_ids(R, N, B)
    neg[::B] -= neg[0] + 1  # column 0 at -1 in row 0: still the form, out of range
    out.append((neg, R, n))
    wrap = vllm_ids(R, N, B)
    wrap[: B] += 1 << 32
    wrap[B:] += 1 << 32  # every index 2**32 above the form's: the form, out of range
    out.append((wrap, R, n))
    for at in (B, B + 7, len(ids) // 2, 4096 + B, len(ids) - 1):  # one index off, in every stretch
        off = ids.copy()
        off[min(at, len(ids) - 1)] += 1
        out.append((off, R, n))
    out.append((rng.permutation(n)[: R * B], R, n))  # no form
    out.append((ids, R // 2, n))  # other rows: B doubled, not of the form
    big = vllm_ids(64, 4096, 512)  # vLLM's pull: 32,768 indices, three stretches of 4,096 and more
    out.append((big, 64, 64 * 4096))
    bad = big.copy()
    bad[20000] = 5
    out.append((bad, 64, 64 * 4096))
    return out


@pytest.mark.parametrize("case", range(len(_arrays())))
def test_the_native_pass_answers_as_numpy_does(case):
    a, rows, n = _arrays()[case]
    fast, slow = _indices.Outer(), _indices.Outer()
    slow.native = False
    assert fast.native
    p = _List(rows, n)
    got, want = fast.encode(a, p), slow.encode(a, p)
    assert got == want
    if got is not None:  # and it names exactly the array's indices, each in range
        from test_nixl_compact_indices import decoded

        assert np.array_equal(decoded(got), a.astype(np.int64))
        assert int(a.view(np.uint64).max()) < n


def test_the_native_pass_takes_only_contiguous_8_byte_integers():
    ids = vllm_ids(8, 64, 32)
    assert native.outer(ids, 8, 512) is not None
    assert native.outer(ids.astype(np.float64), 8, 512) is None  # the same bits' width, not integers
    assert native.outer(ids.astype(np.int32), 8, 512) is None
    assert native.outer(ids.astype(">i8"), 8, 512) is None  # not native-endian
    ro = ids.copy()
    ro.flags.writeable = False
    assert native.outer(ro, 8, 512) == native.outer(ids, 8, 512)  # read-only is fine
    assert native.outer(np.repeat(ids, 2)[::2], 8, 512) is None  # strided
    assert native.outer(ids.tobytes(), 8, 512) is None  # bytes: format "B"
    assert native.outer(ids, 1, 512) is None and native.outer(ids, 7, 512) is None  # one row; rows not dividing
    assert native.outer(ids, 8, (1 << 32) + 1) is None  # past u32 columns
    got = _proto.message("OuterIndices").FromString(native.outer(ids, 8, 512))
    assert np.array_equal(np.frombuffer(got.rows, "<u4"), np.arange(8) * 64)
    assert np.array_equal(np.frombuffer(got.cols, "<u4"), ids[:32])
    with pytest.raises(TypeError):
        native.outer(ids, "8", 512)


def test_the_native_fields_are_both_sides_or_none():
    """outer_fields: both sides' messages, as outer gives them, as the request's fields 8 and 9,
    only when both are of the form (with their own rows and counts) and of one length; and
    split_fields gives the two messages back."""
    li, ri = vllm_ids(8, 64, 32), vllm_ids(4, 128, 64)
    fields = native.outer_fields(li, ri, 8, 512, 4, 512)
    lo, ro = native.outer(li, 8, 512), native.outer(ri, 4, 512)
    req = _proto.message("ReadPreparedRequest").FromString(fields)
    assert (req.local_outer.SerializeToString(), req.remote_outer.SerializeToString()) == (lo, ro)
    assert _indices.split_fields(fields) == (lo, ro)
    big = vllm_ids(64, 4096, 512)  # lengths past one varint byte (2,048-byte columns)
    fields = native.outer_fields(big, big, 64, 1 << 18, 64, 1 << 18)
    assert _indices.split_fields(fields) == (native.outer(big, 64, 1 << 18),) * 2
    off = ri.copy()
    off[100] += 1
    assert native.outer_fields(li, off, 8, 512, 4, 512) is None and native.outer_fields(off, li, 4, 512, 8, 512) is None
    assert native.outer_fields(li, ri, 8, int(li.max()), 4, 512) is None  # a side out of range by one
    assert native.outer_fields(li, ri[:-64], 8, 512, 4, 512) is None  # lengths differ
    assert native.outer_fields(li, ri.astype(np.int32), 8, 512, 4, 512) is None


@pytest.mark.parametrize("tag,note,cuts", [(1, 0, []), (127, 5, [0, 3]), (128, 100, [1]), (300000, 4096, [2, 2, 4000]),
                                            (1 << 40, 200000, [7])])
def test_the_native_frame_is_the_session_frame(tag, note, cuts):
    """frame(tag, key, *pieces): the local session's frame of a SessionRequest holding the
    pieces joined in the key's field (byte for byte what Session._submit_frame sends), as the
    protobuf runtime reads it back; anything but an int tag and bytes refused."""
    from tcpxd import _local
    from tcpxd._session import _field_key, _varint

    msg = _proto.message("ReadPreparedRequest")(local_prepared_id=3, remote_prepared_id=300, timeout_ms=5,
                                                notification=bytes(rng.integers(0, 256, note, dtype=np.uint8)))
    body = msg.SerializeToString()
    at = [0, *sorted(c % (len(body) + 1) for c in cuts), len(body)]
    pieces = [body[a:b] for a, b in zip(at, at[1:])]
    key = _field_key("read_prepared")
    got = native.frame(tag, key, *pieces)
    inner = b"\x08" + _varint(tag) + key + _varint(len(body)) + body
    assert got == _local.HEADER.pack(len(inner)) + inner
    req = _proto.message("SessionRequest").FromString(got[4:])
    assert req.tag == tag and req.WhichOneof("op") == "read_prepared" and req.read_prepared == msg
    with pytest.raises(TypeError):
        native.frame(tag, key, bytearray(b"x"))
    with pytest.raises(TypeError):
        native.frame("1", key)
    with pytest.raises(OverflowError):
        native.frame(-1, key)


def _ring_frames(monkeypatch, A):
    """Every request A's session frames itself: (field, body)."""
    sent: List[Any] = []
    session = A._session_now()
    frame, joined = session._submit_frame, session._submit_joined
    monkeypatch.setattr(session, "_submit_frame", lambda f, body, sink: (sent.append((f, body)), frame(f, body, sink))[1])
    monkeypatch.setattr(session, "_submit_joined",
                        lambda f, key, pieces, sink: (sent.append((f, b"".join(pieces))), joined(f, key, pieces, sink))[1])
    return sent


@pytest.mark.parametrize("op", ["READ", "WRITE"])
@pytest.mark.parametrize("N,PER", [(64, 16), (512, 320)])
def test_a_lane_sends_vllm_indices_as_outer_sums_found_natively(daemons, monkeypatch, op, N, PER):
    """vLLM's requests on a lane (OUTER_MIN lowered to these sizes): both sides go as outer sums in
    one frame (a few hundred bytes or KiB, joined by the C pass), no ring slot taken, the named
    blocks moved (bytes checked); with the native pass off the same requests take the index ring;
    a bad index on the lane is refused by make_prepped_xfer, naming it, and nothing is sent."""
    from test_nixl_transfers import wait

    monkeypatch.setattr(_indices, "OUTER_MIN", 8)
    monkeypatch.setattr(_indices, "WINDOW_MIN", 8)
    R = 4
    A, B, amem, bmem, local, remote = _agents_with_lists(daemons, R, N)
    try:
        assert A._outer_native
        sent = _ring_frames(monkeypatch, A)
        from tcpxd import _proto

        msg = _proto.message("ReadPreparedRequest" if op == "READ" else "WritePreparedRequest")
        for i in range(3):  # the first is planned the general way and keeps the lane
            _fill(op, amem, bmem)
            li, ri = vllm_ids(R, N, PER), vllm_ids(R, N, PER)
            h = A.make_prepped_xfer(op, local, li, remote, ri, notif_msg=b"outer-%d" % i)
            pr = h._xfer.plan
            assert pr.lo is not None and pr.ro is not None
            assert local._lanes[op, remote, False] is pr.lane  # kept by the first, taken by the next
            A.transfer(h)
            assert wait(A, h) == "DONE", h.error
            req = msg.FromString(sent[-1][1])
            assert (len(sent[-1][1]) > 1024) == (PER > 128)
            assert req.local_indices == b"" and req.remote_indices == b"" and not req.HasField("local_window")
            assert len(req.local_outer.rows) == 4 * R and len(req.remote_outer.cols) == 4 * PER
            assert req.notification.endswith(b"outer-%d" % i)
            _check_blocks(op, li, ri, amem, bmem, N)
            assert A._windows is None or A._windows.free == _indices.WINDOW_SLOTS
            A.release_xfer_handle(h)
        bad = vllm_ids(R, N, PER)
        bad[PER + 2] = R * N + 1
        n = len(sent)
        with pytest.raises(nixlInvalidParamError, match=rf"remote_indices\[{PER + 2}\]: index {R * N + 1} is outside"):
            A.make_prepped_xfer(op, local, vllm_ids(R, N, PER), remote, bad)
        assert len(sent) == n
        # the native pass off: the lane's requests go through the index ring
        A._outer_native = False
        _fill(op, amem, bmem)
        li, ri = vllm_ids(R, N, PER), vllm_ids(R, N, PER)
        h = A.make_prepped_xfer(op, local, li, remote, ri)
        assert h._xfer.plan.lo is None
        A.transfer(h)
        assert wait(A, h) == "DONE", h.error
        assert h._xfer.plan.windowed == 2 and msg.FromString(sent[-1][1]).HasField("local_window")
        _check_blocks(op, li, ri, amem, bmem, N)
        deadline = time.monotonic() + 5
        while A._windows.free != _indices.WINDOW_SLOTS and time.monotonic() < deadline:  # the answer frees it
            time.sleep(0.01)
        assert A._windows.free == _indices.WINDOW_SLOTS
        A.release_xfer_handle(h)
    finally:
        A.close()
        B.close()


def test_an_agent_says_once_when_the_c_pass_is_off(daemons, monkeypatch, caplog):
    """Without the C pass (here: turned off) the first agent made says so at INFO, naming why; the
    next agents say nothing more; with it, nothing is said."""
    import logging

    from tcpxd.nixl import _agent

    from test_nixl_transfers import pair

    a, b = daemons
    monkeypatch.setattr(_agent, "_told_no_native", False)
    with caplog.at_level(logging.INFO, logger="tcpxd.nixl"):
        A, B = pair(a, b)  # the C pass on: nothing said
        A.close()
        B.close()
        assert not [r for r in caplog.records if "C pass" in r.getMessage()]
        monkeypatch.setenv("TCPXD_NATIVE", "0")
        monkeypatch.setattr(_indices.Outer, "__init__", _off(_indices.Outer.__init__))
        A, B = pair(a, b)
        A.close()
        B.close()
    said = [r.getMessage() for r in caplog.records if "C pass" in r.getMessage()]
    assert len(said) == 1 and "turned off by TCPXD_NATIVE=0" in said[0]


def _off(init: Any) -> Any:
    def off(self: Any) -> None:
        init(self)
        self.native = False

    return off
