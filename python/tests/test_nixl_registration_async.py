"""register_memory that does not wait for the daemon (issue #39 point 5; docs/NIXL.md, "Registration
that does not wait"): memory by address is checked by the client first (mapped, writable: the
kernel's PROCMAP_QUERY, or /proc/self/maps), sent, and answered later; what needs the regions
(metadata, descriptors, transfers, deregistration) folds the answers in first, and a refusal the
daemon still makes is raised there, naming the region, none of its call left registered."""

from __future__ import annotations

import ctypes
import mmap
import os
import time

import numpy as np
import pytest

import tcpxd
from tcpxd import _addresses
from tcpxd._native_gate import native as _native
from tcpxd.nixl import nixl_agent, nixl_agent_config
from tcpxd.nixl._errors import nixlInvalidParamError, nixlNotFoundError

KIB = 1 << 10


def _wait(agent, h, timeout=30.0):
    deadline = time.monotonic() + timeout
    while agent.check_xfer_state(h) == "PROC" and time.monotonic() < deadline:
        time.sleep(0.001)
    return agent.check_xfer_state(h)


def _buffers(endpoint):
    with tcpxd.Client(endpoint) as c:
        return {b.id for b in c.list_buffers()}


@pytest.fixture
def agents(daemons):
    a, _ = daemons
    A = nixl_agent("async-A", nixl_agent_config(endpoint=a.endpoint))
    B = nixl_agent("async-B", nixl_agent_config(endpoint=a.endpoint))
    # The session's first registration by address, answered at its first use (the metadata
    # here): it shows the daemon may attach, so later ones are sent without waiting.
    first = np.zeros(4 * KIB, np.uint8)
    A.register_memory(A.get_reg_descs([(first.ctypes.data, first.nbytes, 0, "")], "DRAM"))
    A.get_agent_metadata()
    try:
        yield A, B, first
    finally:
        A.close()
        B.close()


def _anon(pages: int) -> int:
    """`pages` pages of anonymous private memory (libc mmap), read-write."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    p = libc.mmap(None, pages * mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert p and p != ctypes.c_void_p(-1).value
    return int(p)


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


@pytest.mark.parametrize("kernel", [True, False], ids=["procmap_query", "proc_self_maps"])
def test_the_client_finds_what_the_daemon_would_refuse(monkeypatch, kernel):
    """address_ranges: mapped and writable throughout, a hole, a read-only page, nothing mapped,
    a shared file mapping; the kernel's answer and /proc/self/maps's agree."""
    if not kernel:
        monkeypatch.setattr(_addresses, "_procmap", False)
    page = mmap.PAGESIZE
    libc = _libc()
    B, F, U, H, R = _addresses.BY_ADDRESS, _addresses.FILE_SHARED, _addresses.UNMAPPED, _addresses.HOLE, _addresses.READ_ONLY
    for _ in range(20):  # (another thread's mmap may land in the hole meanwhile: then again)
        ok, hole, ro = _anon(3), _anon(3), _anon(3)
        assert libc.munmap(hole + page, page) == 0
        assert libc.mprotect(ro + 2 * page, page, mmap.PROT_READ) == 0
        shared = mmap.mmap(-1, page)  # (anonymous shared: a file of the kernel's, handed over by descriptor)
        shared_at = ctypes.addressof(ctypes.c_char.from_buffer(shared))
        arr = np.ones(1 << 20, np.uint8)
        addrs = [ok, ok + 100, hole, hole, ro, ro, 0x1000, shared_at, arr.ctypes.data]
        sizes = [3 * page, 5, page, 2 * page + 1, 2 * page, 3 * page, 4096, page, arr.nbytes]
        got = list(_addresses.address_ranges(addrs, sizes))
        if _addresses.address_ranges([hole + page], [1]) == bytes([U]):
            break
    assert got == [B, B, B, H, B, R, U, F, B]
    if not kernel:
        assert _addresses._procmap is False, "the maps were read"
    del shared_at
    libc.munmap(ok, 3 * page)
    libc.munmap(hole, page)
    libc.munmap(hole + 2 * page, page)
    libc.munmap(ro, 3 * page)


def _maps_fds():
    """This process's descriptors of /proc/<pid>/maps."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").endswith("/maps"):
                out.append(int(name))
        except OSError:
            continue
    return out


def test_a_lone_row_is_found_in_one_call_as_address_ranges_finds_it():
    """row_range (tcpxd._native.vma_row: a registration list of one region, checked in one
    call, the descriptor of /proc/self/maps used without a check each query): what
    address_ranges finds, each case; None for a list that is not one row; right again after its
    descriptor was closed under it (the number reused), and in a forked child (its own memory,
    not the parent's)."""
    if getattr(_native, "vma_row", None) is None:
        pytest.skip("tcpxd._native is not built here")
    page = mmap.PAGESIZE
    arr = np.ones(1 << 20, np.uint8)
    _addresses.address_ranges([arr.ctypes.data], [arr.nbytes])  # (finds out whether the kernel answers)
    if not _addresses._procmap:
        pytest.skip("the kernel has no PROCMAP_QUERY (before Linux 6.11)")
    libc = _libc()
    ok, ro = _anon(3), _anon(3)
    assert libc.mprotect(ro + 2 * page, page, mmap.PROT_READ) == 0
    shared = mmap.mmap(-1, page)
    shared_at = ctypes.addressof(ctypes.c_char.from_buffer(shared))
    cases = [(ok, 3 * page), (ro, 2 * page), (ro, 3 * page), (0x1000, 4096), (shared_at, page), (arr.ctypes.data, arr.nbytes)]

    def check():
        for a, n in cases:
            assert _addresses.row_range(np.array([[a, n, 7]], np.uint64)) == (a, n, 7, _addresses.address_ranges([a], [n])[0])

    check()
    assert [k for *_, k in (_addresses.row_range(np.array([[a, n, 0]], np.uint64)) for a, n in cases)] == [
        _addresses.BY_ADDRESS, _addresses.BY_ADDRESS, _addresses.READ_ONLY, _addresses.UNMAPPED, _addresses.FILE_SHARED,
        _addresses.BY_ADDRESS]
    assert _addresses.row_range(np.zeros((2, 3), np.uint64)) is None
    assert _addresses.row_range(np.zeros((1, 3), np.float64)) is None
    # Its descriptor closed under it, the number taken by another file: found out, opened again.
    for fd in _maps_fds():
        os.close(fd)
    other = os.open("/dev/null", os.O_RDONLY)
    try:
        check()
    finally:
        os.close(other)
    # A forked child asks about its own memory (the parent's descriptor names the parent's).
    assert libc.munmap(ok, page) == 0
    pid = os.fork()
    if pid == 0:  # (the child: only the extension's call, then out)
        try:
            libc.munmap(ok + page, page)
            got = _addresses.row_range(np.array([[ok + page, page, 0]], np.uint64))
            os._exit(0 if got is not None and got[3] == _addresses.UNMAPPED else 1)
        finally:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0, "the child was answered for the parent's memory"
    assert _addresses.row_range(np.array([[ok + page, page, 0]], np.uint64))[3] == _addresses.BY_ADDRESS
    del shared_at
    libc.munmap(ok + page, 2 * page)
    libc.munmap(ro, 3 * page)


def test_memory_the_daemon_would_refuse_is_refused_before_anything_is_sent(agents):
    A, _, _ = agents
    page = mmap.PAGESIZE
    ro = _anon(2)
    assert _libc().mprotect(ro + page, page, mmap.PROT_READ) == 0
    good = np.zeros(page, np.uint8)
    sent = A._client._registrar._conn.tag
    with pytest.raises(nixlInvalidParamError, match=r"reg_list\[1\] \(DRAM at 0x[0-9a-f]+, 8192 bytes\): .*not writable"):
        A.register_memory(A.get_reg_descs([(good.ctypes.data, page, 0, ""), (ro, 2 * page, 0, "")], "DRAM"))
    assert A._client._registrar._conn.tag == sent, "nothing went to the daemon"
    assert [r.addr for r in A._memory.regions()] == [agents[2].ctypes.data]


def test_register_memory_returns_before_the_answers_and_the_regions_serve_transfers(daemons, agents):
    """Past the session's first, 200 numpy arrays are sent and register_memory returns with their
    answers unread; a peer's READ through the metadata (the first use folds them in) gets every
    byte; deregistering releases every buffer."""
    A, B, _ = agents
    before = _buffers(daemons[0].endpoint)
    rng = np.random.default_rng(5)
    arrays = [rng.integers(0, 256, 16 * KIB, dtype=np.uint8) for _ in range(200)]
    rl = A.register_memory(A.get_reg_descs([(a.ctypes.data, a.nbytes, 0, "") for a in arrays], "DRAM"))
    assert A._memory._sent, "answered later"
    pending = A._memory._sent[0].pending
    B.add_remote_agent(A.get_agent_metadata())  # folds them in
    assert not A._memory._sent and pending.frames == 0
    regions = {r.addr: r for r in A._memory.regions()}
    assert all(regions[a.ctypes.data].buffer_id for a in arrays)
    new = _buffers(daemons[0].endpoint) - before
    assert {regions[a.ctypes.data].buffer_id for a in arrays} == new
    mine = np.zeros(200 * 16 * KIB, np.uint8)
    B.register_memory(B.get_reg_descs([(mine.ctypes.data, mine.nbytes, 0, "")], "DRAM"))
    loc = B.get_xfer_descs([(mine.ctypes.data + i * 16 * KIB, 16 * KIB, 0) for i in range(200)], "DRAM")
    rem = B.get_xfer_descs([(a.ctypes.data, a.nbytes, 0) for a in arrays], "DRAM")
    h = B.initialize_xfer("READ", loc, rem, "async-A")
    assert B.transfer(h) in ("PROC", "DONE")
    assert _wait(B, h) == "DONE"
    assert np.array_equal(mine, np.concatenate(arrays))
    B.release_xfer_handle(h)
    A.deregister_memory(rl)
    assert not _buffers(daemons[0].endpoint) & new


def test_a_refusal_the_daemon_still_makes_is_raised_at_first_use_naming_the_region(daemons, agents, monkeypatch):
    """Memory gone between the client's check and the daemon's probe (here: the check told it is
    there): register_memory returns; the next call needing the regions raises the daemon's
    refusal naming reg_list[2], the call's other regions released; the agent goes on."""
    A, B, first = agents
    before = _buffers(daemons[0].endpoint)
    real = _addresses.address_ranges
    monkeypatch.setattr("tcpxd.nixl._memory.address_ranges", lambda a, s: bytes(len(list(a))))  # "all fine"
    good = [np.zeros(8 * KIB, np.uint8) for _ in range(3)]
    descs = [(g.ctypes.data, g.nbytes, 0, "") for g in good[:2]] + [(0x1000, 4096, 0, "")] + [(good[2].ctypes.data, good[2].nbytes, 0, "")]
    rl = A.register_memory(A.get_reg_descs(descs, "DRAM"))
    monkeypatch.setattr("tcpxd.nixl._memory.address_ranges", real)
    with pytest.raises(nixlInvalidParamError, match=r"register_memory \(answered later\): reg_list\[2\] \(DRAM at 0x1000, 4096 bytes\): .*0x1000"):
        A.get_agent_metadata()
    assert [r.addr for r in A._memory.regions()] == [first.ctypes.data], "none of the call registered"
    deadline = time.monotonic() + 10
    while _buffers(daemons[0].endpoint) != before:
        assert time.monotonic() < deadline, "the call's registered regions were not released"
        time.sleep(0.01)
    with pytest.raises(nixlNotFoundError):
        A.deregister_memory(rl)
    # The agent goes on: a later registration is answered and usable.
    again = np.full(8 * KIB, 7, np.uint8)
    A.register_memory(A.get_reg_descs([(again.ctypes.data, again.nbytes, 0, "")], "DRAM"))
    assert again.ctypes.data in {r.addr for r in A._memory.regions()}


def test_answers_lost_with_the_session_are_registered_again_on_a_new_one(daemons, agents):
    """The registrar's connection ends with answers unread (its buffers released by the daemon with
    the session): the first use registers the regions again on a new session, and they serve."""
    A, B, first = agents
    arrays = [np.full(8 * KIB, i, np.uint8) for i in range(70)]
    A.register_memory(A.get_reg_descs([(a.ctypes.data, a.nbytes, 0, "") for a in arrays], "DRAM"))
    assert A._memory._sent
    A._client._registrar.send_held(10.0)  # (sent: as the connection's next message does)
    assert A._client._registrar._unanswered and not A._memory._sent[0].pending.held
    A._client._registrar.reset()  # (as a daemon restart noticed does)
    regions = {r.addr: r for r in A._memory.regions()}
    live = _buffers(daemons[0].endpoint)
    assert all(regions[a.ctypes.data].buffer_id in live for a in arrays)
    mine = np.zeros(8 * KIB, np.uint8)
    B.register_memory(B.get_reg_descs([(mine.ctypes.data, mine.nbytes, 0, "")], "DRAM"))
    B.add_remote_agent(A.get_agent_metadata())
    h = B.initialize_xfer("READ", B.get_xfer_descs([(mine.ctypes.data, mine.nbytes, 0)], "DRAM"),
                          B.get_xfer_descs([(arrays[69].ctypes.data, 8 * KIB, 0)], "DRAM"), "async-A")
    assert B.transfer(h) in ("PROC", "DONE")
    assert _wait(B, h) == "DONE"
    assert (mine == 69).all()


@pytest.mark.parametrize("packed", [True, False], ids=["packed_answer", "buffer_messages"])
def test_regions_read_from_either_answer_are_what_the_daemon_says(daemons, agents, monkeypatch, packed):
    """The daemon's packed answer (arrays: ids, list ids and counts, descriptors and tokens) and a
    daemon without it (a Buffer message an entry: the flag stripped here) give the same regions:
    each one's descriptor as ListBuffers says, its granule lists' tokens and counts as
    DescribeBlocks says."""
    from tcpxd import _proto, _registrar

    if not packed:
        monkeypatch.setattr(_registrar, "PACKED", b"")
    A, _, _ = agents
    arrays = [np.zeros(n, np.uint8) for n in (4 * KIB, 64 * KIB, 100 * KIB, 12 * KIB + 512, 3 * KIB)]
    for _ in range(2):  # the session's second registration is answered later: both ways read
        A.register_memory(A.get_reg_descs([(a.ctypes.data, a.nbytes, 0, "") for a in arrays], "DRAM"))
        regions = {r.addr: r for r in A._memory.regions()}
        with tcpxd.Client(daemons[0].endpoint) as c:
            listed = {b.id: b for b in c.list_buffers()}
            for a in arrays:
                r = regions[a.ctypes.data]
                assert listed[r.buffer_id].descriptor == r.descriptor
                # (under 4 KiB: no granule lists at all, as tcpxd.nixl asks for them)
                want = [(4096, a.nbytes // 4096), (512, a.nbytes // 512)] if a.nbytes >= 4096 else []
                got = [(g, n) for g, n, _, _ in (r.tiling(False), r.tiling(True)) if g]
                assert got == want, (a.nbytes, got)
                for fine in (False, True):
                    g, n, list_id, token = r.tiling(fine)
                    if g:
                        bl = c._unary("DescribeBlocks", _proto.message("DescribeBlocksRequest")(list_id=list_id))
                        assert (bl.buffer_id, bl.count, bl.token) == (r.buffer_id, n, token)
        A.deregister_memory(A.get_reg_descs([(a.ctypes.data, a.nbytes, 0, "") for a in arrays], "DRAM"))


def test_memory_a_file_backs_is_looked_up_at_first_use_and_serves(daemons, agents):
    """memfd regions (nixl._utils.malloc_passthru): register_memory holds them (the files are
    looked up and handed over by descriptor at the first use, the answers read there); a peer's
    READ through the metadata gets every byte; deregistering releases every buffer."""
    from tcpxd.nixl import _utils

    A, B, _ = agents
    before = _buffers(daemons[0].endpoint)
    n, size = 40, 64 * KIB
    regs = [_utils.malloc_passthru(size) for _ in range(n)]
    for i, r in enumerate(regs):
        ctypes.memset(r, i + 1, size)
    sent = A._client._registrar._conn.tag
    rl = A.register_memory(A.get_reg_descs([(r, size, 0, "") for r in regs], "DRAM"))
    assert A._memory._sent and A._memory._sent[0].files, "by descriptor, at first use"
    assert A._client._registrar._conn.tag == sent and _buffers(daemons[0].endpoint) == before
    B.add_remote_agent(A.get_agent_metadata())
    regions = {r.addr: r for r in A._memory.regions()}
    new = _buffers(daemons[0].endpoint) - before
    assert {regions[r].buffer_id for r in regs} == new and len(new) == n
    mine = np.zeros(n * size, np.uint8)
    B.register_memory(B.get_reg_descs([(mine.ctypes.data, mine.nbytes, 0, "")], "DRAM"))
    h = B.initialize_xfer("READ", B.get_xfer_descs([(mine.ctypes.data + i * size, size, 0) for i in range(n)], "DRAM"),
                          B.get_xfer_descs([(r, size, 0) for r in regs], "DRAM"), "async-A")
    assert B.transfer(h) in ("PROC", "DONE")
    assert _wait(B, h) == "DONE"
    assert all((mine[i * size:(i + 1) * size] == i + 1).all() for i in range(n))
    A.deregister_memory(rl)
    assert not _buffers(daemons[0].endpoint) & new


def test_memory_a_file_backs_that_cannot_be_handed_over_is_refused_at_first_use(daemons, agents):
    """A shared mapping of a file this process no longer holds open (and that has no path):
    register_memory holds it; the first use raises, naming the region, and none of the call
    stays registered."""
    import os

    A, _, first = agents
    fd = os.memfd_create("gone", os.MFD_CLOEXEC)
    os.ftruncate(fd, 16 * KIB)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    at = libc.mmap(None, 16 * KIB, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    assert at and at != ctypes.c_void_p(-1).value
    os.close(fd)  # (mmap.mmap would keep a duplicate of it open)
    good = np.zeros(8 * KIB, np.uint8)
    rl = A.register_memory(A.get_reg_descs([(good.ctypes.data, good.nbytes, 0, ""), (at, 16 * KIB, 0, "")], "DRAM"))
    with pytest.raises(Exception, match=r"register_memory \(answered later\): reg_list\[1\] \(DRAM at 0x[0-9a-f]+, 16384 bytes\): .*no longer holds open"):
        A.get_agent_metadata()
    assert [r.addr for r in A._memory.regions()] == [first.ctypes.data], "none of the call registered"
    with pytest.raises(nixlNotFoundError):
        A.deregister_memory(rl)
