"""tcpxd.nixl transfers between two agents (one process, two daemons) in shared host memory: the
handle's life (never posted, re-posted, released mid-transfer), a transfer cut into several
requests with its notification after all of them, and the refusals that need registered memory."""

from __future__ import annotations

import time

import numpy as np
import pytest

import tcpxd
from tcpxd.nixl import (
    host_array,
    nixl_agent,
    nixl_agent_config,
    nixlInvalidParamError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlRepostActiveError,
)
from tcpxd.nixl import _plan


BLOCK = 4096


def pair(a, b, **kw):
    A = nixl_agent("xf-A", nixl_agent_config(endpoint=a.endpoint, capture_telemetry=True, **kw))
    B = nixl_agent("xf-B", nixl_agent_config(endpoint=b.endpoint))
    A.add_remote_agent(B.get_agent_metadata())
    return A, B


def regions(agent, nblocks, skew=0):
    """A region of `nblocks` blocks; its descriptors start `skew` bytes into each block (a skew
    that is not a multiple of 4 KiB makes them unaligned to the granule list: the batch path)."""
    mem = host_array(nblocks * BLOCK)
    base = int(mem.ctypes.data)
    agent.register_memory([(base, mem.nbytes, 0, "")], "DRAM")
    return mem, [(base + i * BLOCK + skew, BLOCK - skew, 0) for i in range(nblocks)]


def calls(monkeypatch, agent):
    """The SessionRequest fields the agent's session is sent, in order."""
    seen = []
    session = agent._session_now()
    submit, encoded = session._submit, session._submit_encoded

    def counting(*a, **op):
        seen.extend(op)
        return submit(*a, **op)

    def counting_encoded(field, bodies, sinks):
        seen.extend([field] * len(bodies))
        return encoded(field, bodies, sinks)

    def counting_frame(field, body, sink):  # (counted once where it hands the body to _submit_encoded)
        before = len(seen)
        frame(field, body, sink)
        if len(seen) == before:
            seen.append(field)

    frame = session._submit_frame
    monkeypatch.setattr(session, "_submit", counting)
    monkeypatch.setattr(session, "_submit_encoded", counting_encoded)
    monkeypatch.setattr(session, "_submit_frame", counting_frame)
    return seen


def wait(agent, h, timeout=30.0):
    deadline = time.monotonic() + timeout
    while agent.check_xfer_state(h) == "PROC" and time.monotonic() < deadline:
        time.sleep(0.002)
    return agent.check_xfer_state(h)


def test_a_transfer_cut_into_requests_notifies_once_after_all(daemons, monkeypatch):
    a, b = daemons
    A, B = pair(a, b)
    try:
        S = 520  # unaligned to the granules (4 KiB, and 512 bytes for the fine lists): the batch path
        amem, ablocks = regions(A, 16, S)
        bmem, bblocks = regions(B, 16, S)
        amem[:] = np.arange(amem.nbytes, dtype=np.uint64).astype(np.uint8)
        A.add_remote_agent(B.get_agent_metadata())  # again, now with B's region
        local = A.prep_xfer_dlist("NIXL_INIT_AGENT", ablocks, "DRAM")
        remote = A.prep_xfer_dlist("xf-B", bblocks, "DRAM")
        monkeypatch.setattr(_plan, "MAX_ENTRIES", 3)
        idx = np.array([0, 2, 4, 6, 8, 10, 12, 14, 1, 3])  # nothing merges: 10 entries, 4 requests
        h = A.make_prepped_xfer("WRITE", local, idx, remote, idx[::-1].copy(), notif_msg=b"all ten")
        with pytest.raises(nixlNotPostedError):
            A.check_xfer_state(h)
        assert h._xfer.plan.path == "batch" and len(h._xfer.plan.requests) == 4
        sent = calls(monkeypatch, A)
        assert A.transfer(h) in ("PROC", "DONE")
        with pytest.raises(nixlRepostActiveError):
            A.transfer(h)
        assert wait(A, h) == "DONE", h.error
        deadline = time.monotonic() + 10
        got = {}
        while not got and time.monotonic() < deadline:
            got = B.get_new_notifs()
        assert got == {"xf-A": [b"all ten"]}
        assert sent == ["write_batch"] * 4 + ["write"]  # the notification: a mailbox WRITE after all four
        for li, ri in zip(idx, idx[::-1]):
            assert np.array_equal(bmem[ri * BLOCK + S:(ri + 1) * BLOCK], amem[li * BLOCK + S:(li + 1) * BLOCK])
            assert not bmem[ri * BLOCK:ri * BLOCK + S].any()  # the bytes before each descriptor: untouched
        t = A.get_xfer_telemetry(h)
        assert (t.totalBytes, t.descCount) == (10 * (BLOCK - S), 10) and t.xferDuration > 0 and t.startTime > 0
        amem[:] = 7  # re-posted: the new bytes go, with the new notification
        assert A.transfer(h, b"again") in ("PROC", "DONE")
        assert wait(A, h) == "DONE"
        assert (bmem[idx[::-1][0] * BLOCK + S:(idx[::-1][0] + 1) * BLOCK] == 7).all()
        A.release_xfer_handle(h)
        with pytest.raises(nixlNotFoundError, match="handle: released"):
            A.check_xfer_state(h)
    finally:
        A.close()
        B.close()


def test_releasing_an_unfinished_transfer_cancels_it(slow, slow_gate):
    a, b = slow
    A, B = pair(a, b)
    try:
        n = 64 << 20
        amem, _ = regions(A, n // BLOCK)
        bmem, _ = regions(B, n // BLOCK)
        A.add_remote_agent(B.get_agent_metadata())
        with pytest.raises(nixlInvalidParamError, match="mem_type"):
            A.initialize_xfer("READ", [(int(amem.ctypes.data), n, 0)], [(1, 1, 0)], "xf-B")  # tuples need a mem_type
        h = A.initialize_xfer("READ", A.get_xfer_descs([(int(amem.ctypes.data), n, 0)], "DRAM"),
                              A.get_xfer_descs([(int(bmem.ctypes.data), n, 0)], "DRAM"), "xf-B")
        with slow_gate.closed():  # 64 MiB held (the senders stop after 16 MiB) until released
            assert A.transfer(h) == "PROC"
            xfer = h._xfer
            A.release_xfer_handle(h)
            assert xfer.state == "ERR" and isinstance(xfer.error, tcpxd.Cancelled)
        deadline = time.monotonic() + 10
        with tcpxd.Client(a.endpoint) as c:
            while time.monotonic() < deadline:
                totals = {(t.op, t.status): t.transfers for t in c.stats().transfer_totals}
                if totals.get(("read", "cancelled")):
                    break
                time.sleep(0.05)
        assert totals.get(("read", "cancelled")), totals
    finally:
        A.close()
        B.close()


def test_refusals_that_need_registered_memory(daemons):
    a, b = daemons
    A, B = pair(a, b)
    try:
        amem, ablocks = regions(A, 4)
        bmem, bblocks = regions(B, 4)
        A.add_remote_agent(B.get_agent_metadata())
        end = int(bmem.ctypes.data) + bmem.nbytes
        with pytest.raises(nixlNotFoundError, match=r"xfer_list\[1\]: DRAM .* is not inside any region remote agent 'xf-B' registered"):
            A.prep_xfer_dlist("xf-B", [bblocks[0], (end - 100, 200, 0)], "DRAM")
        with pytest.raises(nixlNotFoundError, match="dereg_list"):
            A.deregister_memory(A.get_reg_descs([(int(bmem.ctypes.data), 64, 0, "")], "DRAM"))
        anon = np.zeros(1 << 16, dtype=np.uint8)  # plain (anonymous) memory: registered by address
        A.deregister_memory(A.register_memory([(int(anon.ctypes.data), anon.nbytes, 0, "")], "DRAM"))
        local = A.prep_xfer_dlist("NIXL_INIT_AGENT", ablocks, "DRAM")
        remote = A.prep_xfer_dlist("xf-B", bblocks, "DRAM")
        with pytest.raises(nixlInvalidParamError, match="local_xfer_side: prepared for a remote agent"):
            A.make_prepped_xfer("READ", remote, [0], remote, [0])
        with pytest.raises(nixlInvalidParamError, match=r"remote_indices\[0\]: index 9"):
            A.make_prepped_xfer("READ", local, [0], remote, [9])
        A.remove_remote_agent("xf-B")
        h = A.make_prepped_xfer("READ", local, [0], remote, [0])
        with pytest.raises(nixlNotFoundError, match="no remote agent 'xf-B'"):
            A.transfer(h)  # its agent was removed
    finally:
        A.close()
        B.close()


def test_one_agent_from_many_threads(daemons):
    """The agent is thread-safe: threads preparing, posting and polling their own transfers at once
    (and one registering more memory meanwhile) all land their bytes."""
    import threading

    a, b = daemons
    A, B = pair(a, b)
    try:
        amem, ablocks = regions(A, 64)
        bmem, bblocks = regions(B, 64)
        bmem[:] = np.random.default_rng(1).integers(0, 256, bmem.nbytes, dtype=np.uint8)
        A.add_remote_agent(B.get_agent_metadata())
        local = A.prep_xfer_dlist("NIXL_INIT_AGENT", ablocks, "DRAM")
        remote = A.prep_xfer_dlist("xf-B", bblocks, "DRAM")
        errors = []

        def worker(t: int) -> None:
            try:
                for r in range(5):
                    idx = np.arange(t * 8, t * 8 + 8)
                    h = A.make_prepped_xfer("READ", local, idx, remote, idx[::-1].copy(), f"t{t}-{r}")
                    A.transfer(h)
                    assert wait(A, h) == "DONE", h.error
                    A.release_xfer_handle(h)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        def registrar() -> None:
            try:
                for _ in range(5):
                    m, _ = regions(A, 1)
                    A.deregister_memory(A.get_reg_descs([(int(m.ctypes.data), m.nbytes, 0, "")], "DRAM"))
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)] + [threading.Thread(target=registrar)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors, errors
        for t in range(8):
            for k, i in enumerate(range(t * 8, t * 8 + 8)):
                j = t * 8 + 7 - k
                assert np.array_equal(amem[i * BLOCK:(i + 1) * BLOCK], bmem[j * BLOCK:(j + 1) * BLOCK])
        got: dict = {}
        deadline = time.monotonic() + 10
        while sum(len(v) for v in got.values()) < 40 and time.monotonic() < deadline:
            for k, v in B.get_new_notifs().items():
                got.setdefault(k, []).extend(v)
        assert sorted(got["xf-A"]) == sorted(f"t{t}-{r}".encode() for t in range(8) for r in range(5))
    finally:
        A.close()
        B.close()


def _notifs(agent, n, timeout=20.0):
    got: dict = {}
    deadline = time.monotonic() + timeout
    while sum(len(v) for v in got.values()) < n and time.monotonic() < deadline:
        for k, v in agent.get_new_notifs().items():
            got.setdefault(k, []).extend(v)
        time.sleep(0.001)
    return got


@pytest.mark.parametrize("path", ["prepared", "blocks"])
@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_aligned_lists_over_several_buffer_pairs_notify_after_every_byte(slow, monkeypatch, op, path):
    """Aligned descriptors over 3 local and 2 remote regions (buffers). Prepared path: the lists
    live in the daemon and the transfer is one request of two index arrays, its notification
    riding it (a READ's too). Block path (the lists not held by the daemon): one block request per
    buffer pair in use, granule ranges, the notification after them. Either way it reaches the
    target only once every byte landed (checked the moment it arrives, at 1 Gbit/s so the
    transfer takes a while)."""
    a, b = slow
    A, B = pair(a, b)
    try:
        K = 16384
        nb = 64
        rng = np.random.default_rng(5)
        amems = [host_array(nb * K) for _ in range(3)]
        bmems = [host_array(nb * K) for _ in range(2)]
        for m in amems + bmems:
            m[:] = rng.integers(0, 256, m.nbytes, dtype=np.uint8)
        A.register_memory([(int(m.ctypes.data), m.nbytes, 0, "") for m in amems], "DRAM")
        B.register_memory([(int(m.ctypes.data), m.nbytes, 0, "") for m in bmems], "DRAM")
        A.add_remote_agent(B.get_agent_metadata())
        ldescs = [(int(m.ctypes.data) + i * K, K, 0) for m in amems for i in range(nb)]
        rdescs = [(int(m.ctypes.data) + i * K, K, 0) for m in bmems for i in range(nb)]
        local = A.prep_xfer_dlist("NIXL_INIT_AGENT", ldescs, "DRAM")
        remote = A.prep_xfer_dlist("xf-B", rdescs, "DRAM")
        lp, rp = A._dlist(local, "local"), A._dlist(remote, "remote")
        assert lp.held and rp.held  # prepared in the daemon by prep_xfer_dlist
        if path == "blocks":
            lp.held = False
        # Pairs over all six buffer pairs in random order (2-3 MiB: tens of ms at 1 Gbit/s); the
        # destination side names no block twice, the source side may.
        if op == "READ":
            li, ri = rng.permutation(3 * nb), rng.integers(0, 2 * nb, 3 * nb)
        else:
            li, ri = rng.integers(0, 3 * nb, 2 * nb), rng.permutation(2 * nb)
        h = A.make_prepped_xfer(op, local, li, remote, ri, notif_msg=b"all landed")
        plan = h._xfer.plan
        pairs = {(int(x) // nb, int(y) // nb) for x, y in zip(li, ri)}
        assert len(pairs) == 6
        if path == "blocks":
            assert plan.path == "blocks" and len(plan.requests) == 6
        else:
            assert plan.path == "prepared" and not plan.bodies  # bound to the session's ids when posted
        sent = calls(monkeypatch, A)
        assert A.transfer(h) == "PROC"
        got = _notifs(B, 1)
        assert got == {"xf-A": [b"all landed"]}
        # The moment it arrived, every byte is in place.
        for x, y in zip(li, ri):
            lm, lo = amems[x // nb], (x % nb) * K
            rm, ro = bmems[y // nb], (y % nb) * K
            assert np.array_equal(lm[lo:lo + K], rm[ro:ro + K]), (x, y)
        assert wait(A, h) == "DONE", h.error
        if path == "blocks":
            assert sent == [op.lower() + "_blocks"] * 6 + ["write"]  # the notification after the six parts
        else:
            assert sent == [op.lower() + "_prepared"]  # one request, the notification riding it
        t = A.get_xfer_telemetry(h)
        assert (t.totalBytes, t.descCount) == (len(li) * K, len(li))
        # One buffer pair: one part, a WRITE's notification rides it.
        if op == "WRITE":
            h1 = A.make_prepped_xfer("WRITE", local, np.arange(4), remote, np.arange(4) + 9, notif_msg=b"one part")
            sent.clear()
            A.transfer(h1)
            assert wait(A, h1) == "DONE" and sent == ["write_" + path]
            assert _notifs(B, 1) == {"xf-A": [b"one part"]}
            assert np.array_equal(bmems[0][9 * K:13 * K], amems[0][:4 * K])
    finally:
        A.close()
        B.close()


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_blocks_4k_aligned_here_and_512_bytes_off_there_take_both_fine_lists(daemons, op):
    """16 KiB blocks at 4 KiB offsets here, the remote's 512 bytes into its buffer (a header
    before them): each list alone is aligned (the 4 KiB lists here, the fine ones there), and the
    transfer takes the block path over both fine lists, byte-exact, the notification after it."""
    a, b = daemons
    A, B = pair(a, b)
    try:
        K, nb = 16384, 32
        rng = np.random.default_rng(7)
        amem, bmem = host_array(nb * K), host_array(nb * K + 4096)
        for m in (amem, bmem):
            m[:] = rng.integers(0, 256, m.nbytes, dtype=np.uint8)
        A.register_memory([(int(amem.ctypes.data), amem.nbytes, 0, "")], "DRAM")
        B.register_memory([(int(bmem.ctypes.data), bmem.nbytes, 0, "")], "DRAM")
        A.add_remote_agent(B.get_agent_metadata())
        local = A.prep_xfer_dlist("NIXL_INIT_AGENT", [(int(amem.ctypes.data) + i * K, K, 0) for i in range(nb)], "DRAM")
        remote = A.prep_xfer_dlist("xf-B", [(int(bmem.ctypes.data) + 512 + i * K, K, 0) for i in range(nb)], "DRAM")
        lp, rp = A._dlist(local, "local"), A._dlist(remote, "remote")
        assert (lp.aligned, lp.fine, rp.aligned, rp.fine) == (True, False, True, True)
        li, ri = rng.permutation(nb)[:20], rng.permutation(nb)[:20]
        h = A.make_prepped_xfer(op, local, li, remote, ri, notif_msg=b"fine")
        assert h._xfer.plan.path == "blocks"
        assert A.transfer(h) in ("PROC", "DONE")
        assert wait(A, h) == "DONE", h.error
        assert _notifs(B, 1) == {"xf-A": [b"fine"]}
        for x, y in zip(li.tolist(), ri.tolist()):
            here, there = amem[x * K:(x + 1) * K], bmem[512 + y * K:512 + (y + 1) * K]
            assert np.array_equal(here, there), (x, y)
    finally:
        A.close()
        B.close()


def test_block_path_ends_in_err_within_the_deadline_when_the_peer_dies(tmp_root):
    """A prepared READ from a peer whose daemon is killed mid-transfer: "ERR" before the
    (long) deadline, the other parts cancelled."""
    from conftest import start_daemon, stop_daemon

    env = {"TCPXEMU_RATE_GBPS": "1"}
    a = start_daemon(tmp_root, "xka", env=env)
    b = start_daemon(tmp_root, "xkb", env=env)
    A = nixl_agent("xf-A", nixl_agent_config(endpoint=a.endpoint, timeout_s=60))
    B = nixl_agent("xf-B", nixl_agent_config(endpoint=b.endpoint))
    try:
        n = 32 << 20
        amems = [host_array(n) for _ in range(2)]
        bmems = [host_array(n) for _ in range(2)]
        A.register_memory([(int(m.ctypes.data), n, 0, "") for m in amems], "DRAM")
        B.register_memory([(int(m.ctypes.data), n, 0, "") for m in bmems], "DRAM")
        A.add_remote_agent(B.get_agent_metadata())
        K = 1 << 20
        local = A.prep_xfer_dlist("NIXL_INIT_AGENT", [(int(m.ctypes.data) + i * K, K, 0) for m in amems for i in range(32)], "DRAM")
        remote = A.prep_xfer_dlist("xf-B", [(int(m.ctypes.data) + i * K, K, 0) for m in bmems for i in range(32)], "DRAM")
        idx = np.arange(64)
        h = A.make_prepped_xfer("READ", local, idx, remote, idx[::-1].copy(), notif_msg=b"never")
        assert h._xfer.plan.path == "prepared"  # one request; two buffer pairs (two parts) in the daemon
        assert A.transfer(h) == "PROC"  # 64 MiB at 1 Gbit/s: about half a second
        time.sleep(0.1)
        t0 = time.monotonic()
        b.proc.kill()
        state = wait(A, h, timeout=30)
        took = time.monotonic() - t0
        assert state == "ERR", state
        assert took < 15, took  # the heartbeat's 3 s, not the 60 s deadline
        assert h.error is not None
    finally:
        A.close()
        B.close()
        stop_daemon(a)
        stop_daemon(b)


def test_prepared_lists_follow_the_session_and_are_released(daemons, monkeypatch):
    """The daemon's prepared lists go with the agent's session: a renewed session prepares them
    again on first use; release_dlist_handle releases the daemon's copy; a destination named
    twice is refused by the daemon ("ERR" naming it), and the lists still work after."""
    a, b = daemons
    A, B = pair(a, b)
    try:
        amem, ablocks = regions(A, 32)
        bmem, bblocks = regions(B, 32)
        rng = np.random.default_rng(11)
        amem[:] = rng.integers(0, 256, amem.nbytes, dtype=np.uint8)
        A.add_remote_agent(B.get_agent_metadata())
        local = A.prep_xfer_dlist("NIXL_INIT_AGENT", ablocks, "DRAM")
        remote = A.prep_xfer_dlist("xf-B", bblocks, "DRAM")
        lp = A._dlist(local, "local")
        first = A._session_now()
        assert lp.daemon is not None and lp.daemon[0] is first
        li, ri = rng.permutation(32)[:8], rng.permutation(32)[:8]
        h = A.make_prepped_xfer("WRITE", local, li, remote, ri)
        assert A.transfer(h) in ("PROC", "DONE") and wait(A, h) == "DONE", h.error
        for x, y in zip(li, ri):
            assert np.array_equal(bmem[y * BLOCK:(y + 1) * BLOCK], amem[x * BLOCK:(x + 1) * BLOCK])
        # The session ends (the daemon drops its prepared lists): the next transfer prepares anew.
        first._abort("cancelled")
        A.transfer(h)
        assert wait(A, h) == "DONE", h.error
        assert lp.daemon is not None and lp.daemon[0] is not first
        # A destination block named twice: the daemon refuses the transfer, naming the index.
        bad = A.make_prepped_xfer("WRITE", local, np.array([0, 1]), remote, np.array([5, 5]))
        assert bad._xfer.plan.path == "prepared"
        A.transfer(bad)
        assert wait(A, bad) == "ERR"
        assert "remote_indices" in str(bad.error) or "twice" in str(bad.error), bad.error
        assert wait(A, h) == "DONE"
        A.transfer(h)
        assert wait(A, h) == "DONE", h.error
        # Releasing the list releases the daemon's copy.
        sent = calls(monkeypatch, A)
        pid = lp.daemon[1]
        A.release_dlist_handle(local)
        assert sent == ["release_prepared"] and lp.daemon is None and pid > 0
    finally:
        A.close()
        B.close()
