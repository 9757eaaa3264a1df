"""register_memory that sends nothing (since session 22; docs/NIXL.md, "Registration that does
not wait"): DRAM regions, checked by the client, are held back and go to the daemon with the
registration connection's next message or at the first call that needs them (metadata,
descriptors, transfers), which reads the answers; the session's first registration too (the
daemon's permission to attach is found out then); regions deregistered before any use are
withdrawn unsent. A refusal is raised at that first use, naming the region, none of its call
left registered."""

from __future__ import annotations

import ctypes
import socket
import time

import numpy as np
import pytest

import tcpxd
from tcpxd.nixl import _utils, nixl_agent, nixl_agent_config
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


def _released(endpoint, want, timeout=10.0):
    """Waits until the daemon's buffers are `want` (a closed session's go behind its back)."""
    deadline = time.monotonic() + timeout
    while _buffers(endpoint) != want:
        assert time.monotonic() < deadline, "the buffers were not released"
        time.sleep(0.01)


def _sent(agent):
    """What the agent's registration connection has sent: (whether one is open, its last tag;
    the agent's mailbox goes on it when the agent is made)."""
    conn = agent._client._registrar._conn
    return (conn is not None, conn.tag if conn is not None else 0)


@pytest.fixture
def pair(daemons):
    a, _ = daemons
    A = nixl_agent("held-A", nixl_agent_config(endpoint=a.endpoint))
    B = nixl_agent("held-B", nixl_agent_config(endpoint=a.endpoint))
    try:
        yield A, B
    finally:
        A.close()
        B.close()


def _read(B, A_name, mine, addr, n):
    h = B.initialize_xfer("READ", B.get_xfer_descs([(mine.ctypes.data, n, 0)], "DRAM"),
                          B.get_xfer_descs([(addr, n, 0)], "DRAM"), A_name)
    assert B.transfer(h) in ("PROC", "DONE")
    assert _wait(B, h) == "DONE"
    B.release_xfer_handle(h)


def test_lone_regions_and_the_sessions_first_are_held_until_first_use(daemons, pair):
    """A new agent's registrations, one region each: nothing reaches the daemon until the
    metadata is taken; then every region is a daemon buffer with the
    descriptor the daemon lists, and a peer reads each byte-exact."""
    A, B = pair
    before, sent = _buffers(daemons[0].endpoint), _sent(A)
    arrays = [np.full(8 * KIB, i + 1, np.uint8) for i in range(20)]
    for a in arrays + arrays[:2]:  # (the last two again: NIXL accepts a region registered twice)
        A.register_memory(A.get_reg_descs([(a.ctypes.data, a.nbytes, 0, "")], "DRAM"))
    assert _sent(A) == sent, "nothing sent"
    assert len(A._memory._sent) == 20 and all(s.pending.held for s in A._memory._sent)
    assert _buffers(daemons[0].endpoint) == before
    B.add_remote_agent(A.get_agent_metadata())  # the first use: sent, answered, folded in
    assert not A._memory._sent and not A._memory._sent_keys and not A._memory._by_list
    regions = {r.addr: r for r in A._memory.regions()}
    with tcpxd.Client(daemons[0].endpoint) as c:
        listed = {b.id: b for b in c.list_buffers()}
    assert {regions[a.ctypes.data].buffer_id for a in arrays} == set(listed) - before
    assert all(listed[regions[a.ctypes.data].buffer_id].descriptor == regions[a.ctypes.data].descriptor for a in arrays)
    mine = np.zeros(8 * KIB, np.uint8)
    B.register_memory(B.get_reg_descs([(mine.ctypes.data, mine.nbytes, 0, "")], "DRAM"))
    for i in (0, 19):
        _read(B, "held-A", mine, arrays[i].ctypes.data, mine.nbytes)
        assert (mine == i + 1).all()


def test_deregistering_before_any_use_sends_nothing(daemons, pair):
    """Regions deregistered before any use (memory by address, alone and 70 together; memfds)
    are withdrawn: no frame goes to the daemon, no buffer is made; deregistering them again
    raises nixlNotFoundError; part of a call deregistered is registered and released as usual,
    the rest of it serving."""
    A, B = pair
    first = np.zeros(4 * KIB, np.uint8)
    A.register_memory(A.get_reg_descs([(first.ctypes.data, first.nbytes, 0, "")], "DRAM"))
    A.get_agent_metadata()  # (the connection open, the first registration answered)
    before, sent = _buffers(daemons[0].endpoint), _sent(A)
    lone = np.zeros(64 * KIB, np.uint8)
    many = [np.zeros(16 * KIB, np.uint8) for _ in range(70)]
    files = [_utils.malloc_passthru(16 * KIB) for _ in range(5)]
    lists = [A.get_reg_descs([(lone.ctypes.data, lone.nbytes, 0, "")], "DRAM"),
             A.get_reg_descs([(m.ctypes.data, m.nbytes, 0, "") for m in many], "DRAM"),
             A.get_reg_descs([(f, 16 * KIB, 0, "") for f in files], "DRAM")]
    for dl in lists:
        A.register_memory(dl)
    assert A._memory._sent[-1].files, "the memfds by descriptor, held too"
    for dl in lists:
        A.deregister_memory(dl)
    assert _sent(A) == sent, "nothing went to the daemon"
    assert _buffers(daemons[0].endpoint) == before
    assert not A._memory._sent and [r.addr for r in A._memory.regions()] == [first.ctypes.data]
    for dl in lists:
        with pytest.raises(nixlNotFoundError):
            A.deregister_memory(dl)
    # Part of one call: registered (sent, answered), that part released, the rest serving.
    two = [np.full(8 * KIB, 30 + i, np.uint8) for i in range(2)]
    A.register_memory(A.get_reg_descs([(t.ctypes.data, t.nbytes, 0, "") for t in two], "DRAM"))
    A.deregister_memory(A.get_reg_descs([(two[0].ctypes.data, two[0].nbytes, 0, "")], "DRAM"))
    assert [r.addr for r in A._memory.regions()] == [first.ctypes.data, two[1].ctypes.data]
    assert len(_buffers(daemons[0].endpoint) - before) == 1
    mine = np.zeros(8 * KIB, np.uint8)
    B.register_memory(B.get_reg_descs([(mine.ctypes.data, mine.nbytes, 0, "")], "DRAM"))
    B.add_remote_agent(A.get_agent_metadata())
    _read(B, "held-A", mine, two[1].ctypes.data, mine.nbytes)
    assert (mine == 31).all()
    for f in files:
        _utils.free_passthru(f)


def test_held_registrations_go_with_the_connections_next_message(daemons, pair):
    """A registration held, then a deregistration of answered regions (a release_batch on the
    same connection): the held one goes first, its answer read before the release's, folded in
    at the first use, and it serves."""
    A, B = pair
    old = np.zeros(4 * KIB, np.uint8)
    A.register_memory(A.get_reg_descs([(old.ctypes.data, old.nbytes, 0, "")], "DRAM"))
    A.get_agent_metadata()
    new = np.full(32 * KIB, 9, np.uint8)
    A.register_memory(A.get_reg_descs([(new.ctypes.data, new.nbytes, 0, "")], "DRAM"))
    pending = A._memory._sent[0].pending
    assert pending.held
    A.deregister_memory(A.get_reg_descs([(old.ctypes.data, old.nbytes, 0, "")], "DRAM"))
    assert not pending.held and pending.frames == 0, "sent before the release, its answer read before the release's"
    assert A._memory._sent, "folded in at the first use"
    assert [r.addr for r in A._memory.regions()] == [new.ctypes.data]
    assert not A._memory._sent
    mine = np.zeros(32 * KIB, np.uint8)
    B.register_memory(B.get_reg_descs([(mine.ctypes.data, mine.nbytes, 0, "")], "DRAM"))
    B.add_remote_agent(A.get_agent_metadata())
    _read(B, "held-A", mine, new.ctypes.data, mine.nbytes)
    assert (mine == 9).all()


def test_the_sessions_first_registration_refused_is_raised_at_first_use(daemons, pair, monkeypatch):
    """The session's first registration, held, with a region the daemon refuses (here: not
    mapped; the client's check told it fine): register_memory returns; the first use raises the
    daemon's refusal naming reg_list[1], the call's other region released; the agent goes on."""
    A, _ = pair
    before, sent = _buffers(daemons[0].endpoint), _sent(A)
    real = tcpxd.nixl._memory.address_ranges
    monkeypatch.setattr("tcpxd.nixl._memory.address_ranges", lambda a, s: bytes(len(list(a))))  # "all fine"
    good = np.zeros(8 * KIB, np.uint8)
    rl = A.register_memory(A.get_reg_descs([(good.ctypes.data, good.nbytes, 0, ""), (0x1000, 4096, 0, "")], "DRAM"))
    monkeypatch.setattr("tcpxd.nixl._memory.address_ranges", real)
    assert _sent(A) == sent
    with pytest.raises(nixlInvalidParamError, match=r"register_memory \(answered later\): reg_list\[1\] \(DRAM at 0x1000, 4096 bytes\): .*0x1000"):
        A.get_agent_metadata()
    assert A._memory.regions() == []
    _released(daemons[0].endpoint, before)
    with pytest.raises(nixlNotFoundError):
        A.deregister_memory(rl)
    again = np.full(8 * KIB, 7, np.uint8)
    A.register_memory(A.get_reg_descs([(again.ctypes.data, again.nbytes, 0, "")], "DRAM"))
    assert [r.addr for r in A._memory.regions()] == [again.ctypes.data]
    assert _buffers(daemons[0].endpoint) - before == {A._memory.regions()[0].buffer_id}


def test_closing_an_agent_with_registrations_held_sends_none(daemons):
    """An agent closed with registrations held (by address and memfds): none reaches the daemon."""
    a, _ = daemons
    before = _buffers(a.endpoint)
    A = nixl_agent("held-closed", nixl_agent_config(endpoint=a.endpoint))
    arr = np.zeros(16 * KIB, np.uint8)
    f = _utils.malloc_passthru(16 * KIB)
    ctypes.memset(f, 1, 16 * KIB)
    A.register_memory(A.get_reg_descs([(arr.ctypes.data, arr.nbytes, 0, "")], "DRAM"))
    A.register_memory(A.get_reg_descs([(f, 16 * KIB, 0, "")], "DRAM"))
    registrar = A._client._registrar
    sent = _sent(A)
    assert registrar._held
    A.close()
    assert registrar._conn is None and not registrar._held
    assert sent[1] <= 1, "nothing but the mailbox went to the daemon"
    assert _buffers(a.endpoint) == before
    _utils.free_passthru(f)


@pytest.mark.parametrize("answered_before", [False, True], ids=["sessions_first", "later"])
def test_a_connection_found_gone_at_first_use_is_replaced(daemons, pair, answered_before):
    """The registration connection dead when the held regions go (as a daemon restart not
    noticed yet leaves it): the first use registers them on a new connection, and they serve."""
    A, B = pair
    if answered_before:
        first = np.zeros(4 * KIB, np.uint8)
        A.register_memory(A.get_reg_descs([(first.ctypes.data, first.nbytes, 0, "")], "DRAM"))
        A.get_agent_metadata()
    arrays = [np.full(8 * KIB, 50 + i, np.uint8) for i in range(3)]
    A.register_memory(A.get_reg_descs([(a.ctypes.data, a.nbytes, 0, "") for a in arrays], "DRAM"))
    old = A._client._registrar._conn
    old.sock.shutdown(socket.SHUT_RDWR)
    regions = {r.addr: r for r in A._memory.regions()}
    assert A._client._registrar._conn is not old
    assert all(regions[a.ctypes.data].buffer_id in _buffers(daemons[0].endpoint) for a in arrays)
    mine = np.zeros(8 * KIB, np.uint8)
    B.register_memory(B.get_reg_descs([(mine.ctypes.data, mine.nbytes, 0, "")], "DRAM"))
    B.add_remote_agent(A.get_agent_metadata())
    _read(B, "held-A", mine, arrays[2].ctypes.data, mine.nbytes)
    assert (mine == 52).all()


def test_a_lone_region_the_daemon_would_refuse_is_refused_at_once(pair):
    """A lone region of a size registered before (the lone path) that is not writable
    throughout: refused by register_memory, naming it, nothing held."""
    import mmap

    A, _ = pair
    page = mmap.PAGESIZE
    good = np.zeros(2 * page, np.uint8)
    A.register_memory(A.get_reg_descs([(good.ctypes.data, good.nbytes, 0, "")], "DRAM"))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    ro = libc.mmap(None, 2 * page, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert libc.mprotect(ro + page, page, mmap.PROT_READ) == 0
    held = len(A._memory._sent)
    with pytest.raises(nixlInvalidParamError, match=rf"reg_list\[0\] \(DRAM at 0x[0-9a-f]+, {2 * page} bytes\): .*not writable"):
        A.register_memory(A.get_reg_descs([(ro, 2 * page, 0, "")], "DRAM"))
    assert len(A._memory._sent) == held
    assert [r.addr for r in A._memory.regions()] == [good.ctypes.data]


def test_a_call_is_withdrawn_by_its_list_or_by_another_naming_its_regions(daemons, pair):
    """Regions held by one call are withdrawn whether the deregistration names them by the list
    register_memory returned (found whole), by a new list of the same regions, or by that list
    changed since (each region looked at); nothing reaches the daemon."""
    A, _ = pair
    first = np.zeros(4 * KIB, np.uint8)
    A.register_memory(A.get_reg_descs([(first.ctypes.data, first.nbytes, 0, "")], "DRAM"))
    A.get_agent_metadata()
    before, sent = _buffers(daemons[0].endpoint), _sent(A)
    arrays = [np.zeros(16 * KIB, np.uint8) for _ in range(3 * 10)]
    lists = [A.get_reg_descs([(a.ctypes.data, a.nbytes, 0, "") for a in arrays[i * 10:(i + 1) * 10]], "DRAM")
             for i in range(3)]
    regs = [A.register_memory(dl) for dl in lists]
    assert len(A._memory._by_list) == 3
    A.deregister_memory(regs[0])  # the very list: found whole
    A.deregister_memory(A.get_reg_descs([(a.ctypes.data, a.nbytes, 0, "") for a in arrays[10:20]], "DRAM"))
    regs[2].rows[[0, 1]] = regs[2].rows[[1, 0]]  # (changed: the same regions in another order)
    A.deregister_memory(regs[2])
    assert _sent(A) == sent and _buffers(daemons[0].endpoint) == before
    assert not A._memory._sent and not A._memory._sent_keys and not A._memory._by_list
    assert [r.addr for r in A._memory.regions()] == [first.ctypes.data]
    with pytest.raises(nixlNotFoundError):
        A.deregister_memory(regs[0])
