"""A lone DRAM region's register_memory and deregister_memory in one C call each (since session
23: tcpxd._native.Lone, docs/NIXL.md "Session 23, the lone region in one call"): the same steps
as the general path, with the same outcomes — held until the first use, registered then and
usable, withdrawn unsent when deregistered first, refused as before where the daemon would refuse
— and anything the call does not take left to the general path with nothing changed. Each test
runs with the C call and without it (the general path alone, as without the extension)."""

from __future__ import annotations

import array
import ctypes
import mmap
import time

import numpy as np
import pytest

import tcpxd
from tcpxd import _addresses
from tcpxd._native_gate import native
from tcpxd.nixl import _memory, _utils, nixl_agent, nixl_agent_config
from tcpxd.nixl._errors import nixlInvalidParamError, nixlNotFoundError

KIB = 1 << 10

needs_lone = pytest.mark.skipif(getattr(native, "Lone", None) is None, reason="the C extension is not built")


def _kernel_answers():
    """Whether the kernel answers PROCMAP_QUERY here (the one call needs it)."""
    _addresses.address_kinds(array.array("Q", [id(object())]))
    return bool(_addresses._procmap)


def _buffers(endpoint):
    with tcpxd.Client(endpoint) as c:
        return {b.id for b in c.list_buffers()}


def _sent(agent):
    """What the agent's registration connection has sent: (whether one is open, its last tag)."""
    conn = agent._client._registrar._conn
    return (conn is not None, conn.tag if conn is not None else 0)


def _general_only(agent):
    """The agent without the lone C call: the general path takes every registration."""
    mem = agent._memory
    mem.hold_one = mem.withdraw_one = _memory._no


@pytest.fixture(params=["one call", "general path"])
def agents(request, daemons):
    """Two agents on daemon a, A's first registration answered (the session's first: the daemon
    may attach); with the lone C call where the extension has it, or the general path alone."""
    if request.param == "one call" and (getattr(native, "Lone", None) is None or not _kernel_answers()):
        pytest.skip("no C extension, or a kernel without PROCMAP_QUERY")
    a, _ = daemons
    A = nixl_agent("lone-A", nixl_agent_config(endpoint=a.endpoint))
    B = nixl_agent("lone-B", nixl_agent_config(endpoint=a.endpoint))
    if request.param == "general path":
        _general_only(A)
    first = np.zeros(16 * KIB, np.uint8)
    A.register_memory(A.get_reg_descs([(first.ctypes.data, first.nbytes, 0, "")], "DRAM"))
    A.get_agent_metadata()
    try:
        yield A, B, request.param == "one call"
    finally:
        A.close()
        B.close()


def _wait(agent, h, timeout=30.0):
    deadline = time.monotonic() + timeout
    while agent.check_xfer_state(h) == "PROC" and time.monotonic() < deadline:
        time.sleep(0.001)
    return agent.check_xfer_state(h)


def _read(B, A_name, mine, addr, n):
    h = B.initialize_xfer("READ", B.get_xfer_descs([(mine.ctypes.data, n, 0)], "DRAM"),
                          B.get_xfer_descs([(addr, n, 0)], "DRAM"), A_name)
    assert B.transfer(h) in ("PROC", "DONE")
    assert _wait(B, h) == "DONE"
    B.release_xfer_handle(h)


def test_a_lone_region_is_held_as_the_general_path_holds_it_then_serves(daemons, agents):
    """register_memory of one numpy array of a size registered before: nothing sent, one record
    held with every field the general path's record of one region has; at the first use it is a
    daemon buffer, and a peer reads it byte-exact."""
    A, B, one_call = agents
    before, sent = _buffers(daemons[0].endpoint), _sent(A)
    arr = np.full(16 * KIB, 7, np.uint8)
    dl = A.get_reg_descs([(arr.ctypes.data, arr.nbytes, 0, "")], "DRAM")
    assert A.register_memory(dl) is dl
    assert A.register_memory(dl) is dl  # (again: NIXL accepts it, nothing more held)
    assert _sent(A) == sent and _buffers(daemons[0].endpoint) == before
    mem = A._memory
    assert len(mem._sent) == 1
    rec = mem._sent[0]
    key = ("DRAM", arr.ctypes.data, arr.nbytes, 0)
    assert type(rec) is _memory._Sent and mem._sent_keys == {key: rec}
    assert rec.keys == [key] and rec.by_address == [key] and rec.todo == {key: (0, None)}
    assert rec.files == [] and rec.got == [None] and rec.frames == 0 and rec.lost is None
    assert list(rec.tails) == [mem._tails[arr.nbytes][0]] and rec.sizes[arr.nbytes] is mem._tails[arr.nbytes]
    assert isinstance(rec.addrs, array.array) and rec.addrs.typecode == "Q" and list(rec.addrs) == [arr.ctypes.data]
    assert rec.pending is rec and rec.held and rec in A._client._registrar._held
    if one_call:  # (the general path files the list whole: its rows and id kept)
        assert rec.list_id == 0 and rec.rows == b"" and rec.sizes is mem._tails
    B.add_remote_agent(A.get_agent_metadata())  # the first use: sent, answered, folded in
    assert not mem._sent and not mem._sent_keys and rec.pending is None
    assert len(_buffers(daemons[0].endpoint) - before) == 1
    assert arr.ctypes.data in {r.addr for r in mem.regions()}
    mine = np.zeros(16 * KIB, np.uint8)
    B.register_memory(B.get_reg_descs([(mine.ctypes.data, mine.nbytes, 0, "")], "DRAM"))
    _read(B, "lone-A", mine, arr.ctypes.data, mine.nbytes)
    assert (mine == 7).all()
    mid, bid = _buffers(daemons[0].endpoint), mem._dram[key]
    A.deregister_memory(dl)  # (after use: released by the daemon, before it returns)
    assert mid - _buffers(daemons[0].endpoint) == {bid}
    with pytest.raises(nixlNotFoundError, match=r"dereg_list\[0\]: DRAM \(0x[0-9a-f]+, 16384 bytes\) is not registered"):
        A.deregister_memory(dl)


def test_a_lone_region_deregistered_before_use_is_withdrawn_unsent(daemons, agents):
    """register_memory then deregister_memory of one region (by the list returned, and by a new
    list naming it): the daemon hears of neither; the record leaves the registrar and the agent,
    its cycle broken; deregistering again raises nixlNotFoundError naming it."""
    A, _, _ = agents
    before, sent = _buffers(daemons[0].endpoint), _sent(A)
    arrs = [np.zeros(16 * KIB, np.uint8) for _ in range(3)]
    for i, arr in enumerate(arrs):
        dl = A.get_reg_descs([(arr.ctypes.data, arr.nbytes, 0, "")], "DRAM")
        A.register_memory(dl)
        rec = A._memory._sent[-1]
        again = dl if i != 1 else A.get_reg_descs([(arr.ctypes.data, arr.nbytes, 0, "")], "DRAM")
        A.deregister_memory(again)
        assert not A._memory._sent and not A._memory._sent_keys and not A._memory._by_list
        assert rec not in A._client._registrar._held and not rec.held
        with pytest.raises(nixlNotFoundError, match=rf"dereg_list\[0\]: DRAM \({arr.ctypes.data:#x}, 16384 bytes\) is not registered"):
            A.deregister_memory(dl)
    # Two held, the older withdrawn first: the newer stays held, then serves its first use.
    one, two = (A.get_reg_descs([(a.ctypes.data, a.nbytes, 0, "")], "DRAM") for a in arrs[:2])
    A.register_memory(one)
    A.register_memory(two)
    A.deregister_memory(one)
    assert [s.keys[0][1] for s in A._memory._sent] == [arrs[1].ctypes.data]
    assert _sent(A) == sent and _buffers(daemons[0].endpoint) == before
    A.get_agent_metadata()
    assert {r.addr for r in A._memory.regions()} >= {arrs[1].ctypes.data}
    assert arrs[0].ctypes.data not in {r.addr for r in A._memory.regions()}
    assert len(_buffers(daemons[0].endpoint) - before) == 1


def test_lone_memory_a_file_backs_is_held_and_handed_over_at_first_use(daemons, agents):
    """One memfd region alone: held with no registrar record (handed over by descriptor at the
    first use), withdrawn unsent when deregistered first; registered and read byte-exact when
    used."""
    A, B, _ = agents
    before, sent = _buffers(daemons[0].endpoint), _sent(A)
    addr = _utils.malloc_passthru(16 * KIB)
    try:
        ctypes.memset(addr, 9, 16 * KIB)
        dl = A.get_reg_descs([(addr, 16 * KIB, 0, "")], "DRAM")
        A.register_memory(dl)
        rec = A._memory._sent[-1]
        key = ("DRAM", addr, 16 * KIB, 0)
        assert rec.files == [key] and rec.by_address == [] and rec.pending is None and not rec.held
        assert len(rec.tails) == 0 and rec.got == [] and len(rec.addrs) == 0
        A.deregister_memory(dl)
        assert not A._memory._sent and _sent(A) == sent and _buffers(daemons[0].endpoint) == before
        A.register_memory(dl)
        B.add_remote_agent(A.get_agent_metadata())
        mine = np.zeros(16 * KIB, np.uint8)
        B.register_memory(B.get_reg_descs([(mine.ctypes.data, mine.nbytes, 0, "")], "DRAM"))
        _read(B, "lone-A", mine, addr, mine.nbytes)
        assert (mine == 9).all()
        mid, bid = _buffers(daemons[0].endpoint), A._memory._dram[key].id
        A.deregister_memory(dl)
        assert mid - _buffers(daemons[0].endpoint) == {bid}
    finally:
        _utils.free_passthru(addr)


def _anon(pages):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    at = libc.mmap(None, pages * mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    return libc, at


def test_what_the_daemon_would_refuse_is_refused_at_once_naming_the_region(agents):
    """A lone region of a size registered before that is read-only in part, has a hole, or is not
    mapped, or a region of 0 bytes: register_memory raises the general path's message, nothing
    held."""
    A, _, _ = agents
    page = mmap.PAGESIZE
    libc, ro = _anon(4)
    assert libc.mprotect(ro + page, page, mmap.PROT_READ) == 0
    _, hole = _anon(4)
    assert libc.munmap(hole + 2 * page, page) == 0
    ok = np.zeros(4 * page, np.uint8)
    A.register_memory(A.get_reg_descs([(ok.ctypes.data, ok.nbytes, 0, "")], "DRAM"))  # (the size known)
    held = len(A._memory._sent)
    for at, why in ((ro, "not writable"), (hole, "has a hole"), (0x1000, "not mapped")):
        with pytest.raises(nixlInvalidParamError, match=rf"reg_list\[0\] \(DRAM at {at:#x}, {4 * page} bytes\): .*{why}"):
            A.register_memory(A.get_reg_descs([(at, 4 * page, 0, "")], "DRAM"))
        assert len(A._memory._sent) == held
    shared = _utils.malloc_passthru(page)
    try:
        for at in (ok.ctypes.data, shared):  # (by address; a file's, which needs no size seen before)
            with pytest.raises(nixlInvalidParamError, match=r"reg_list\[0\]: a region of 0 bytes"):
                A.register_memory(A.get_reg_descs([(at, 0, 0, "")], "DRAM"))
            assert len(A._memory._sent) == held
    finally:
        _utils.free_passthru(shared)
    libc.munmap(ro, 4 * page)
    libc.munmap(hole, 2 * page)
    libc.munmap(hole + 3 * page, page)


@needs_lone
def test_the_one_call_leaves_what_it_does_not_take_unchanged(daemons):
    """Lone.hold / withdraw answer False, nothing changed, for what is not theirs: two rows, VRAM,
    a list that is not rows of u64s, a size past the 64 whose tails are kept, a closed registrar,
    a region sent already (then released by the general path); True for one registered already
    and for a size's first region (its tail made once and kept)."""
    a, _ = daemons
    A = nixl_agent("lone-C", nixl_agent_config(endpoint=a.endpoint))
    try:
        mem = A._memory
        if not _kernel_answers():
            pytest.skip("a kernel without PROCMAP_QUERY")
        arrs = [np.zeros(32 * KIB, np.uint8) for _ in range(3)]
        lone = [A.get_reg_descs([(x.ctypes.data, x.nbytes, 0, "")], "DRAM") for x in arrs]
        assert 32 * KIB not in mem._tails
        assert mem.hold_one(lone[0]) and len(mem._sent) == 1, "a size's first region: held by the one call"
        assert 32 * KIB in mem._tails and mem._sent[0].sizes is mem._tails
        pair = A.get_reg_descs([(x.ctypes.data, x.nbytes, 0, "") for x in arrs[1:]], "DRAM")
        vram = A.get_reg_descs([(arrs[1].ctypes.data, arrs[1].nbytes, 0, "")], "VRAM")
        odd = A.get_reg_descs([(arrs[1].ctypes.data, arrs[1].nbytes, 0, "")], "DRAM")
        odd.rows = odd.rows.astype(np.float64)
        n = len(mem._sent)
        for dl in (pair, vram, odd):
            assert not mem.hold_one(dl) and not mem.withdraw_one(dl) and len(mem._sent) == n
        assert mem.hold_one(lone[1]) and len(mem._sent) == n + 1
        assert mem.hold_one(lone[1]) and len(mem._sent) == n + 1, "held already: taken, nothing more"
        A.get_agent_metadata()  # (sent and answered)
        assert mem.hold_one(lone[1]) and not mem._sent, "registered already: taken, nothing more"
        assert not mem.withdraw_one(lone[1]), "sent already: the general path releases it"
        before = _buffers(a.endpoint)
        A.deregister_memory(lone[1])
        assert len(before - _buffers(a.endpoint)) == 1
        # Past the 64 sizes whose tails are kept: the general path (which makes the tail for the call).
        for n in range(64 - len(mem._tails)):
            mem._tail(KIB * (100 + n))
        odd_size = np.zeros(48 * KIB, np.uint8)
        past = A.get_reg_descs([(odd_size.ctypes.data, odd_size.nbytes, 0, "")], "DRAM")
        n = len(mem._sent)
        assert not mem.hold_one(past) and len(mem._sent) == n and 48 * KIB not in mem._tails
        A.register_memory(past)
        assert len(mem._sent) == n + 1 and mem._sent[-1].sizes[48 * KIB][0] == mem._tail(48 * KIB)[0]
        A.get_agent_metadata()
        assert odd_size.ctypes.data in {r.addr for r in mem.regions()}
        registrar = A._client._registrar
        registrar._closed = True
        try:
            assert not mem.hold_one(lone[2]) and not mem._sent and not registrar._held, "a closed registrar holds nothing"
        finally:
            registrar._closed = False
    finally:
        A.close()


@needs_lone
def test_the_one_call_takes_only_a_record_class_with_the_slots_it_writes():
    """Lone(cls, ...) checks that cls has each slot it writes, as a writable object slot."""
    import threading

    class Bare:
        __slots__ = ("addrs",)

    class Reg:
        _lock = threading.Lock()

    args = (threading.Lock(), threading.Lock(), [], {}, {}, {}, len, Reg(), [], array.array("Q"), {})
    with pytest.raises(TypeError, match=r"Bare\.tails is not a writable __slots__ slot|has no attribute 'tails'"):
        native.Lone(Bare, *args)
    assert native.Lone(_memory._Sent, *args) is not None
    with pytest.raises(TypeError):
        native.Lone(_memory._Sent, *args[:-1])
