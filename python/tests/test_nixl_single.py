"""A one-descriptor transfer on a kept lane (`_plan.Lane.one`): made without the general way's
planning, sent as the plain ReadRequest / WriteRequest (the daemon's one-range path, as
`tcpxd.Client.read` / `write`), bytes moved and checked, a WRITE's notification riding it, a
READ's notification on the prepared request; what the lane does not take still goes the general
way, which names it; a transfer the daemon refuses ends in "ERR" with why. With the C pass and
without it (the agent then keeps its lanes through the index ring only)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tcpxd import _proto
from tcpxd.nixl import nixlInvalidParamError, nixlMismatchError
from tcpxd.nixl import _plan

from test_nixl_transfers import BLOCK, calls, pair, regions, wait


@pytest.fixture(params=["C pass", "no C pass"])
def agents(request, daemons):
    a, b = daemons
    A, B = pair(a, b)
    if request.param == "no C pass":
        A._outer_native = False  # as an agent without tcpxd._native: lanes through the index ring
    try:
        yield A, B
    finally:
        A.close()
        B.close()


def _lists(A, B, n=16):
    amem, ablocks = regions(A, n)
    bmem, bblocks = regions(B, n)
    A.add_remote_agent(B.get_agent_metadata())  # again, now with B's region
    rng = np.random.default_rng(5)
    amem[:] = rng.integers(0, 256, amem.nbytes, dtype=np.uint8)
    bmem[:] = rng.integers(0, 256, bmem.nbytes, dtype=np.uint8)
    local = A.prep_xfer_dlist("NIXL_INIT_AGENT", ablocks, "DRAM")
    remote = A.prep_xfer_dlist("xf-B", bblocks, "DRAM")
    return amem, bmem, local, remote


def _notifs(B, want, timeout=10.0):
    got = {}
    deadline = time.monotonic() + timeout
    while sum(map(len, got.values())) < want and time.monotonic() < deadline:
        for k, v in B.get_new_notifs().items():
            got.setdefault(k, []).extend(v)
    return got


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_one_block_at_a_time_goes_as_the_plain_request(agents, monkeypatch, op):
    A, B = agents
    amem, bmem, local, remote = _lists(A, B)
    first = A.make_prepped_xfer(op, local, [3], remote, [4])  # the general way: the lane is kept
    assert first._xfer.plan.path == "prepared" and first._xfer.plan.single is None
    assert A.transfer(first) in ("PROC", "DONE") and wait(A, first) == "DONE", first.error
    A.release_xfer_handle(first)
    sent = calls(monkeypatch, A)
    forms = [([0], [15]), ((7,), (2,)), (np.array([9], dtype=np.int32), np.array([9], dtype=np.uint16)),
             (np.array([12]), [1]), ([15], np.array([0], dtype=np.uint64))]
    for li, ri in forms:
        h = A.make_prepped_xfer(op, local, li, remote, ri)
        pr = h._xfer.plan
        assert pr.path == "prepared" and pr.single is not None, (li, ri)  # made on the lane
        assert A.transfer(h) in ("PROC", "DONE") and wait(A, h) == "DONE", h.error
        i, j = int(np.asarray(li)[0]), int(np.asarray(ri)[0])
        src, dst = (bmem, amem) if op == "READ" else (amem, bmem)
        s, d = (j, i) if op == "READ" else (i, j)
        assert np.array_equal(dst[d * BLOCK:(d + 1) * BLOCK], src[s * BLOCK:(s + 1) * BLOCK]), (li, ri)
        t = A.get_xfer_telemetry(h)
        assert (t.totalBytes, t.descCount) == (BLOCK, 1)
        A.release_xfer_handle(h)
    assert sent == [op.lower()] * len(forms)  # one plain request each, nothing else


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_the_plain_request_is_what_protobuf_writes(agents, op):
    A, B = agents
    _, _, local, remote = _lists(A, B)
    A.transfer(first := A.make_prepped_xfer(op, local, [0], remote, [0]))
    assert wait(A, first) == "DONE", first.error
    h = A.make_prepped_xfer(op, local, [5], remote, [11])
    pr = h._xfer.plan
    lp, rp = pr.lane.local, pr.lane.remote
    lreg, rreg = lp.regions[int(lp.region[5])], rp.regions[int(rp.region[11])]
    if op == "READ":
        want = _proto.message("ReadRequest")(entry=_proto.message("ReadEntry")(
            remote_descriptor=rreg.descriptor, remote_offset=int(rp.offset[11]), local_buffer_id=lreg.buffer_id,
            local_offset=int(lp.offset[5]), length=BLOCK), timeout_ms=pr.lane.timeout_ms)
        assert pr.single[0] + pr.single[1] == want.SerializeToString()
    else:
        want = _proto.message("WriteRequest")(entry=_proto.message("WriteEntry")(
            local_buffer_id=lreg.buffer_id, local_offset=int(lp.offset[5]), remote_descriptor=rreg.descriptor,
            remote_offset=int(rp.offset[11]), length=BLOCK), notification=b"n-1", timeout_ms=pr.lane.timeout_ms)
        assert pr.single[0] + b"\x12\x03n-1" + pr.single[1] == want.SerializeToString()


def test_notifications_ride_one_block_transfers(agents, monkeypatch):
    A, B = agents
    amem, bmem, local, remote = _lists(A, B)
    for op in ("READ", "WRITE"):
        A.transfer(first := A.make_prepped_xfer(op, local, [0], remote, [0]))
        assert wait(A, first) == "DONE", first.error
    sent = calls(monkeypatch, A)
    w = A.make_prepped_xfer("WRITE", local, [2], remote, [6], notif_msg=b"wrote 2")
    assert A.transfer(w) in ("PROC", "DONE") and wait(A, w) == "DONE", w.error
    assert _notifs(B, 1) == {"xf-A": [b"wrote 2"]}
    assert np.array_equal(bmem[6 * BLOCK:7 * BLOCK], amem[2 * BLOCK:3 * BLOCK])  # landed before it was told
    r = A.make_prepped_xfer("READ", local, [8], remote, [1], notif_msg=b"read 1")
    assert r._xfer.plan.single is not None
    assert A.transfer(r) in ("PROC", "DONE") and wait(A, r) == "DONE", r.error
    assert _notifs(B, 1) == {"xf-A": [b"read 1"]}
    assert np.array_equal(amem[8 * BLOCK:9 * BLOCK], bmem[BLOCK:2 * BLOCK])
    # A WRITE's notification is in its plain request; a READ's rides the prepared one (a
    # ReadRequest has no notification): one request each, no mailbox WRITE after.
    assert sent == ["write", "read_prepared"]
    A.transfer(w, b"again")  # a notification given to transfer(): the general way, as before
    assert wait(A, w) == "DONE" and _notifs(B, 1) == {"xf-A": [b"again"]}
    assert sent[2:] == ["write_prepared"]


def test_what_the_lane_does_not_take_is_named_by_the_general_way(agents):
    A, B = agents
    _, _, local, remote = _lists(A, B)
    A.transfer(first := A.make_prepped_xfer("READ", local, [0], remote, [0]))
    assert wait(A, first) == "DONE", first.error
    with pytest.raises(nixlInvalidParamError, match=r"local_indices\[0\]: index 16 is outside"):
        A.make_prepped_xfer("READ", local, [16], remote, [0])
    with pytest.raises(nixlInvalidParamError, match=r"remote_indices\[0\]: index -1 is outside"):
        A.make_prepped_xfer("READ", local, [0], remote, [-1])
    with pytest.raises(nixlMismatchError):
        A.make_prepped_xfer("READ", local, [0], remote, [0, 1])
    two = A.make_prepped_xfer("READ", local, [1, 2], remote, [3, 4])  # two a side: the prepared request
    assert two._xfer.plan.single is None
    assert A.transfer(two) in ("PROC", "DONE") and wait(A, two) == "DONE", two.error


def test_a_refused_one_block_transfer_ends_in_err_with_why(agents):
    A, B = agents
    _, bmem, local, remote = _lists(A, B)
    A.transfer(first := A.make_prepped_xfer("WRITE", local, [0], remote, [0]))
    assert wait(A, first) == "DONE", first.error
    base = int(bmem.ctypes.data)  # the remote buffer goes; A's metadata still names it
    B.deregister_memory(B.get_reg_descs([(base, bmem.nbytes, 0, "")], "DRAM"))
    h = A.make_prepped_xfer("WRITE", local, [1], remote, [1])
    assert h._xfer.plan.single is not None
    A.transfer(h)
    assert wait(A, h) == "ERR" and h.error is not None
    assert A.transfer(h) in ("PROC", "ERR")  # re-posted: refused again, not stuck
    assert wait(A, h) == "ERR"


def test_single_fields_are_none_for_unequal_lengths():
    class Side:
        length = np.array([4096, 8192])
        region = np.array([0, 0])
        offset = np.array([0, 4096])
        buffer_ids = np.array([7], dtype=np.uint64)
        desc_rows = {"READ": [b"\x0a\x01d"], "WRITE": [b"\x1a\x01d"]}

    s = Side()
    assert _plan.single_fields("READ", s, 0, s, 1, 0) is None  # type: ignore[arg-type]
    entry = b"\x0a\x01d" + b"\x10\x80\x20" + b"\x18\x07" + b"\x20\x80\x20" + b"\x28\x80\x40"
    assert _plan.single_fields("READ", s, 1, s, 1, 5) == (b"\x0a" + bytes([len(entry)]) + entry, b"\x10\x05")  # type: ignore[arg-type]
    entry = b"\x08\x07" + b"\x10\x80\x20" + b"\x1a\x01d" + b"\x20\x80\x20" + b"\x28\x80\x40"
    assert _plan.single_fields("WRITE", s, 1, s, 1, 0) == (b"\x0a" + bytes([len(entry)]) + entry, b"")  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout_s", [None, 2.5])
def test_send_notif_sends_the_mailbox_write_from_its_kept_head(daemons, monkeypatch, timeout_s):
    """send_notif's WriteRequest is made from pieces kept per remote agent (`_Remote.notif_head`):
    the same bytes as mailbox_write of the framed message, for short and long messages alike."""
    from tcpxd._session import _varint
    from tcpxd.nixl import nixl_agent, nixl_agent_config
    from tcpxd.nixl._notify import frame
    from tcpxd.nixl._xfer import mailbox_write

    a, b = daemons
    A = nixl_agent("nh-A", nixl_agent_config(endpoint=a.endpoint, timeout_s=timeout_s))
    B = nixl_agent("nh-B", nixl_agent_config(endpoint=b.endpoint))
    try:
        A.add_remote_agent(B.get_agent_metadata())
        bodies = []
        post = A._inbox.post_notif  # (its pieces: the C pass writes them into the ring's slot as one)

        def post_notif(head, msg, to):
            bodies.append(head[0] + _varint(len(head[1]) + len(msg)) + head[1] + msg + head[2])
            return post(head, msg, to)

        monkeypatch.setattr(A._inbox, "post_notif", post_notif)
        msgs = [b"", b"x", b"m" * 200, b"n" * 70000]
        for m in msgs:
            A.send_notif("nh-B", m)
        remote = A._remotes["nh-B"]
        assert bodies == [mailbox_write(remote.mailbox_entry, frame("nh-A", "nh-B", m), A._timeout_ms) for m in msgs]
        assert _notifs(B, len(msgs)) == {"nh-A": msgs}
    finally:
        A.close()
        B.close()


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_initialize_xfer_of_one_range_sends_the_plain_request(agents, monkeypatch, op):
    """initialize_xfer of one descriptor a side (NIXL's examples' small transfers), aligned or not:
    the plain request; a WRITE's notification in it, a READ's after it (a mailbox WRITE, as the
    block and batch paths send it); a range past SINGLE_MAX keeps the block path."""
    A, B = agents
    amem, bmem, _, _ = _lists(A, B)
    a0, b0 = int(amem.ctypes.data), int(bmem.ctypes.data)
    sent = calls(monkeypatch, A)
    for off, n, note in ((0, BLOCK, b""), (3 * BLOCK + 100, 999, b""), (5 * BLOCK, 2 * BLOCK, b"one range")):
        h = A.initialize_xfer(op, A.get_xfer_descs([(a0 + off, n, 0)], "DRAM"),
                              A.get_xfer_descs([(b0 + off + BLOCK, n, 0)], "DRAM"), "xf-B", note)
        assert h._xfer.plan.path == "plain" and len(h._xfer.plan.requests) == 1
        assert A.transfer(h) in ("PROC", "DONE") and wait(A, h) == "DONE", h.error
        src, so, do = (bmem, off + BLOCK, off) if op == "READ" else (amem, off, off + BLOCK)
        dst = amem if op == "READ" else bmem
        assert np.array_equal(dst[do:do + n], src[so:so + n])
        if note:
            assert _notifs(B, 1) == {"xf-A": [note]}
    assert sent == [op.lower()] * 3 + ([] if op == "WRITE" else ["write"])  # (a READ's notification: the mailbox WRITE)
    monkeypatch.setattr(_plan, "SINGLE_MAX", BLOCK)  # (a range past it: as before)
    h = A.initialize_xfer(op, A.get_xfer_descs([(a0, 2 * BLOCK, 0)], "DRAM"),
                          A.get_xfer_descs([(b0 + 2 * BLOCK, 2 * BLOCK, 0)], "DRAM"), "xf-B")
    assert h._xfer.plan.path == "blocks"
    assert A.transfer(h) in ("PROC", "DONE") and wait(A, h) == "DONE", h.error


def test_a_lane_of_ranges_past_single_max_keeps_the_prepared_request(agents, monkeypatch):
    A, B = agents
    _, _, local, remote = _lists(A, B)
    monkeypatch.setattr(_plan, "SINGLE_MAX", BLOCK - 1)
    A.transfer(first := A.make_prepped_xfer("READ", local, [0], remote, [0]))
    assert wait(A, first) == "DONE", first.error
    sent = calls(monkeypatch, A)
    for li in ([1], np.array([2])):
        h = A.make_prepped_xfer("READ", local, li, remote, [3])
        assert h._xfer.plan.path == "prepared" and h._xfer.plan.single is None
        assert A.transfer(h) in ("PROC", "DONE") and wait(A, h) == "DONE", h.error
    assert sent == ["read_prepared"] * 2


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_a_released_transfer_leaves_nothing_for_the_gc(agents, op):
    """A tight loop of made, posted, polled and released transfers leaves no reference cycle:
    each one is freed as its handle goes, so the collector never runs because of them (before
    session 31 each left five objects in a cycle, a collection every ~140 transfers: in the
    slowest 1%). The bytes still move."""
    import gc

    A, B = agents
    amem, bmem, local, remote = _lists(A, B)
    for _ in range(3):  # what a first use sets up
        h = A.make_prepped_xfer(op, local, [1], remote, [2])
        assert A.transfer(h) in ("PROC", "DONE") and wait(A, h) == "DONE", h.error
        A.release_xfer_handle(h)
    gc.collect()
    gc.disable()
    try:
        for i in range(40):
            h = A.make_prepped_xfer(op, local, [i % 16], remote, [(i + 5) % 16])
            assert A.transfer(h) in ("PROC", "DONE") and wait(A, h) == "DONE", h.error
            A.release_xfer_handle(h)
            del h
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        # (other threads' garbage may be there too: the session's, grpc's)
        ours = [type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("tcpxd.nixl")]
        gc.garbage.clear()
    finally:
        gc.set_debug(0)
        gc.enable()
    assert not ours, f"{len(ours)} of the transfers' objects in cycles after 40 transfers: {sorted(set(ours))}"
    src, dst = (bmem, amem) if op == "READ" else (amem, bmem)
    s, d = ((44 % 16), (39 % 16)) if op == "READ" else ((39 % 16), (44 % 16))
    assert np.array_equal(dst[d * BLOCK:(d + 1) * BLOCK], src[s * BLOCK:(s + 1) * BLOCK])
