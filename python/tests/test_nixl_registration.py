"""register_memory of many DRAM regions in one step (issue #39, point 5): one `register_batch`
frame on the agent's local session per 64 regions, their descriptors with it (a daemon without it:
one pipelined round trip), each buffer's granule lists made by the daemon with its registration
(no RegisterBlocks call); all or none when one region cannot be registered; a daemon that makes no
lists with a registration still gets them asked for one by one."""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest

import tcpxd
from tcpxd import _local, _proto
from tcpxd.nixl import _utils, nixl_agent, nixl_agent_config
from tcpxd.nixl._errors import nixlInvalidParamError

MIB = 1 << 20


def _wait(agent, h, timeout=30.0):
    deadline = time.monotonic() + timeout
    while agent.check_xfer_state(h) == "PROC" and time.monotonic() < deadline:
        time.sleep(0.001)
    return agent.check_xfer_state(h)


@pytest.fixture
def pair(daemons):
    a, _ = daemons
    A = nixl_agent("reg-A", nixl_agent_config(endpoint=a.endpoint))
    B = nixl_agent("reg-B", nixl_agent_config(endpoint=a.endpoint))
    calls: list = []
    unary = A._client._unary

    def counting(name, req, timeout=-1.0):
        calls.append(name)
        return unary(name, req, timeout)

    A._client._unary = counting  # type: ignore[method-assign]
    try:
        yield A, B, calls
    finally:
        A.close()
        B.close()


def _buffers(endpoint):
    with tcpxd.Client(endpoint) as c:
        return {b.id: b for b in c.list_buffers()}


def _body_spy(sent, count, older=False):
    """A spy on Connection.send_body (register_batch frames of memory by address, written without
    a message object): records ("register_batch", count(the request)); `older`: the frame sent is
    the one a daemon predating the op sees, no op set."""
    send_body = _local.Connection.send_body

    def spy(self, key, body, timeout):
        req = _proto.message("RegisterBatchRequest").FromString(body)
        assert req.packed_answer, "the packed answer asked for"
        sent.append(("register_batch", count(req)))
        if not older:
            return send_body(self, key, body, timeout)
        self._tag += 1
        self.sock.sendall(_local.frame(_proto.message("SessionRequest")(tag=self._tag)))
        return True

    return spy


def test_many_regions_register_in_one_step_with_their_granule_lists(daemons, pair):
    A, B, calls = pair
    n = 24
    before = set(_buffers(daemons[0].endpoint))
    regs = [_utils.malloc_passthru(MIB) for _ in range(n)]
    odd = _utils.malloc_passthru(3 * 4096 + 512)  # not a multiple of 4 KiB: 3 coarse granules, 25 fine ones
    rl = A.register_memory(A.get_reg_descs([(r, MIB, 0, "") for r in regs] + [(odd, 3 * 4096 + 512, 0, "")], "DRAM"))
    assert "RegisterBlocks" not in calls and "RegisterBuffer" not in calls, calls
    regions = {r.addr: r for r in A._memory.regions()}
    assert len(regions) == n + 1
    new = set(_buffers(daemons[0].endpoint)) - before
    assert {r.buffer_id for r in regions.values()} == new
    with tcpxd.Client(daemons[0].endpoint) as c:
        for r in regions.values():
            assert (r.granule, r.fine) == (4096, 512)
            for g, count, list_id in (r.tiling(False)[:3], r.tiling(True)[:3]):
                bl = c._unary("DescribeBlocks", tcpxd._proto.message("DescribeBlocksRequest")(list_id=list_id))
                assert (bl.buffer_id, bl.count, bl.block_length) == (r.buffer_id, r.size // g, g) == (r.buffer_id, count, g)
    # The lists serve transfers: B reads 512-byte blocks (the fine lists) and 4 KiB ones out of A's regions.
    data = np.random.default_rng(3).integers(0, 256, n * MIB, dtype=np.uint8)
    for i, r in enumerate(regs):
        np.ctypeslib.as_array((ctypes.c_uint8 * MIB).from_address(r))[:] = data[i * MIB : (i + 1) * MIB]
    B.add_remote_agent(A.get_agent_metadata())
    mine = _utils.malloc_passthru(n * MIB)
    B.register_memory(B.get_reg_descs([(mine, n * MIB, 0, "")], "DRAM"))
    for blk in (512, 4096):
        loc = B.prep_xfer_dlist("NIXL_INIT_AGENT", [(mine + i * blk, blk, 0) for i in range(n * MIB // blk)], "DRAM")
        rem = B.prep_xfer_dlist("reg-A", [(regs[i * blk // MIB] + i * blk % MIB, blk, 0) for i in range(n * MIB // blk)], "DRAM")
        idx = np.random.default_rng(blk).permutation(n * MIB // blk)
        h = B.make_prepped_xfer("READ", loc, idx, rem, idx)
        assert B.transfer(h) in ("PROC", "DONE")
        assert _wait(B, h) == "DONE"
        got = np.ctypeslib.as_array((ctypes.c_uint8 * (n * MIB)).from_address(mine))
        assert np.array_equal(got, data), f"{blk}-byte blocks"
        got[:] = 0
        B.release_xfer_handle(h)
    A.deregister_memory(rl)
    assert not set(_buffers(daemons[0].endpoint)) & {r.buffer_id for r in regions.values()}


def test_a_region_that_cannot_register_leaves_none_registered(daemons, pair):
    A, _, _ = pair
    before = set(_buffers(daemons[0].endpoint))
    good = [_utils.malloc_passthru(MIB) for _ in range(3)]
    nowhere = 0x1000  # the first page past NULL: never mapped
    descs = A.get_reg_descs([(g, MIB, 0, "") for g in good[:2]] + [(nowhere, 4096, 0, "")] + [(good[2], MIB, 0, "")], "DRAM")
    with pytest.raises(nixlInvalidParamError, match=r"reg_list\[2\] \(DRAM at 0x1000, 4096 bytes\): .*not mapped"):
        A.register_memory(descs)
    assert A._memory.regions() == []
    deadline = time.monotonic() + 10
    while set(_buffers(daemons[0].endpoint)) != before:
        assert time.monotonic() < deadline, "the registered ones were not released"
        time.sleep(0.01)


def test_a_daemon_that_makes_no_lists_gets_them_asked_for(pair, monkeypatch):
    A, _, calls = pair
    many = tcpxd.Client._register_host_many

    def older(self, memories, lists, label=""):  # a daemon that ignores block_lists: none made
        return many(self, memories, [[] for _ in lists], label)

    monkeypatch.setattr(tcpxd.Client, "_register_host_many", older)
    r = _utils.malloc_passthru(MIB)
    A.register_memory(A.get_reg_descs([(r, MIB, 0, "")], "DRAM"))
    [region] = A._memory.regions()  # (the first use: registered now, held until then)
    assert calls.count("RegisterBlocks") == 2
    assert (region.granule, region.granules, region.fine, region.fine_granules) == (4096, 256, 512, 2048)


def test_metadata_fetched_before_the_remote_registered_is_fetched_again(daemons):
    """NIXL's two-peer examples fetch the target's metadata from its listener while the target may
    still be registering: a descriptor outside the regions fetched has the metadata fetched again
    once (then it resolves), bytes checked; one outside the new metadata too is still refused."""
    import numpy as np

    from tcpxd.nixl._errors import nixlNotFoundError as NotFound

    a, b = daemons
    T = nixl_agent("refetch-T", nixl_agent_config(enable_listen_thread=True, listen_port=0, endpoint=a.endpoint))
    I = nixl_agent("refetch-I", nixl_agent_config(endpoint=b.endpoint))
    try:
        I.fetch_remote_metadata("refetch-T", "127.0.0.1", T._listener.port)
        deadline = time.monotonic() + 30
        while not I.check_remote_metadata("refetch-T"):
            assert time.monotonic() < deadline, "the metadata never came"
            time.sleep(0.001)
        src = _utils.malloc_passthru(MIB)  # registered only now, after the fetch
        np.ctypeslib.as_array((ctypes.c_uint8 * MIB).from_address(src))[:] = np.arange(MIB, dtype=np.uint64).astype(np.uint8) ^ 0x5A
        T.register_memory(T.get_reg_descs([(src, MIB, 0, "")], "DRAM"))
        dst = _utils.malloc_passthru(MIB)
        I.register_memory(I.get_reg_descs([(dst, MIB, 0, "")], "DRAM"))
        h = I.initialize_xfer("READ", I.get_xfer_descs([(dst, MIB, 0)], "DRAM"),
                              I.get_xfer_descs([(src, MIB, 0)], "DRAM"), "refetch-T")
        I.transfer(h)
        assert _wait(I, h) == "DONE", h.error
        got = np.ctypeslib.as_array((ctypes.c_uint8 * MIB).from_address(dst))
        assert bytes(got) == bytes(np.ctypeslib.as_array((ctypes.c_uint8 * MIB).from_address(src)))
        with pytest.raises(NotFound, match=r"remote_descs\[0\]"):
            I.initialize_xfer("READ", I.get_xfer_descs([(dst, 4096, 0)], "DRAM"),
                              I.get_xfer_descs([(src + MIB, 4096, 0)], "DRAM"), "refetch-T")
    finally:
        I.close()
        T.close()


def test_regions_go_64_to_a_frame_and_to_an_older_daemon_one_request_each(daemons, pair, monkeypatch):
    """Numpy arrays (by address) and memfds (by descriptor) mixed: up to 64 entries to a
    register_batch frame, the memfds' first with one descriptor per entry, then those by address
    in frames of their own (last: past a session's first, they are not waited for); a daemon that refuses the op (one predating it) gets the same
    regions as single requests, from then on."""
    A, _, _ = pair
    sent: list = []
    send = _local.Connection.send

    def spy(self, field, req, timeout, fd=None, fds=()):
        sent.append((field, len(fds) if field == "register_batch" else int(fd is not None)))
        return send(self, field, req, timeout, fd, fds)

    monkeypatch.setattr(_local.Connection, "send", spy)
    monkeypatch.setattr(_local.Connection, "send_body", _body_spy(sent, lambda req: 0))
    arrays = [np.full(64 << 10, i, np.uint8) for i in range(40)]
    memfds = [_utils.malloc_passthru(MIB) for _ in range(40)]
    descs = [(a.ctypes.data, a.nbytes, 0, "") for a in arrays] + [(m, MIB, 0, "") for m in memfds]

    def registered():
        rl = A.register_memory(A.get_reg_descs(descs, "DRAM"))
        regions = A._memory.regions()
        assert len(regions) == 80
        kinds = {b.id: tcpxd._ops.kind_name(b.kind) for b in _buffers(daemons[0].endpoint).values()}
        got = sorted(kinds[r.buffer_id] for r in regions)
        assert got == ["host_attached"] * 40 + ["host_shared"] * 40, got
        assert all((r.granule, r.fine) == (4096, 512) for r in regions)
        return rl

    def deregistered(rl):
        ids = {r.buffer_id for r in A._memory.regions()}
        A.deregister_memory(rl)
        assert A._memory.regions() == []
        assert not set(_buffers(daemons[0].endpoint)) & ids

    deregistered(registered())
    # Registered 64 to a frame at the first use (by address, held, going with the connection's
    # next message: the frame by descriptor), released likewise.
    assert sent == [("register_batch", 0), ("register_batch", 40), ("release_batch", 0), ("release_batch", 0)], sent
    sent.clear()

    def older(self, field, req, timeout, fd=None, fds=()):  # the frame of a daemon's unknown op: none set
        if field not in ("register_batch", "release_batch"):
            return spy(self, field, req, timeout, fd, fds)
        sent.append((field, len(fds)))
        self._tag += 1
        empty = _local.frame(_proto.message("SessionRequest")(tag=self._tag))
        if fds:
            _local.send_with_fds(self.sock, empty, fds)
        else:
            self.sock.sendall(empty)
        return True

    monkeypatch.setattr(_local.Connection, "send", older)
    monkeypatch.setattr(_local.Connection, "send_body", _body_spy(sent, lambda req: 0, older=True))
    # (what a new session to a daemon predating the op knows: not yet that it takes none, so its
    # first registrations wait to find out)
    A._client._registrar._batches = None
    deregistered(registered())
    singles = [("register_client_memory", 0)] * 40 + [("register_host_fd", 1)] * 40
    assert sent == [("register_batch", 0)] + singles, sent  # released by ReleaseBuffer calls
    sent.clear()
    deregistered(registered())
    assert sent == singles, "asked once"


def test_regions_by_address_go_several_frames_at_once_and_to_an_older_daemon_one_request_each(daemons, pair, monkeypatch):
    """200 numpy arrays: four register_batch frames (64, 64, 64, 8) sent before the first answer
    is read, and four release_batch frames likewise; every region registered, then released. A
    daemon that refuses the op has every frame it was sent answered before the regions go one
    request each."""
    A, _, _ = pair
    sent: list = []
    send = _local.Connection.send

    def spy(self, field, req, timeout, fd=None, fds=()):
        n = len(req.entries) if field == "register_batch" else len(req.buffer_ids) if field == "release_batch" else 1
        sent.append((field, n))
        return send(self, field, req, timeout, fd, fds)

    monkeypatch.setattr(_local.Connection, "send", spy)
    monkeypatch.setattr(_local.Connection, "send_body", _body_spy(sent, lambda req: len(req.entries)))
    arrays = [np.full(4096, i % 256, np.uint8) for i in range(200)]
    descs = [(a.ctypes.data, a.nbytes, 0, "") for a in arrays]

    def round_trip():
        rl = A.register_memory(A.get_reg_descs(descs, "DRAM"))
        regions = A._memory.regions()
        assert sorted(r.addr for r in regions) == sorted(d[0] for d in descs)
        ids = {r.buffer_id for r in regions}
        assert len(ids) == 200 and ids <= set(_buffers(daemons[0].endpoint))
        A.deregister_memory(rl)
        assert A._memory.regions() == [] and not set(_buffers(daemons[0].endpoint)) & ids

    round_trip()
    frames = [("register_batch", n) for n in (64, 64, 64, 8)] + [("release_batch", n) for n in (64, 64, 64, 8)]
    assert sent == frames, sent
    sent.clear()

    def older(self, field, req, timeout, fd=None, fds=()):  # the frame of a daemon's unknown op: none set
        if field not in ("register_batch", "release_batch"):
            return spy(self, field, req, timeout, fd, fds)
        sent.append((field, len(req.entries) if field == "register_batch" else len(req.buffer_ids)))
        self._tag += 1
        self.sock.sendall(_local.frame(_proto.message("SessionRequest")(tag=self._tag)))
        return True

    monkeypatch.setattr(_local.Connection, "send", older)
    monkeypatch.setattr(_local.Connection, "send_body", _body_spy(sent, lambda req: len(req.entries), older=True))
    # (what a new session to a daemon predating the op knows: not yet that it takes none, so its
    # first registration waits to find out)
    A._client._registrar._batches = None
    round_trip()
    assert sent == frames[:4] + [("register_client_memory", 1)] * 200, sent  # released by ReleaseBuffer calls
