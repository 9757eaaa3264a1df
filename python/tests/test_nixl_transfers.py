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


def regions(agent, nblocks):
    mem = host_array(nblocks * BLOCK)
    base = int(mem.ctypes.data)
    agent.register_memory([(base, mem.nbytes, 0, "")], "DRAM")
    return mem, [(base + i * BLOCK, BLOCK, 0) for i in range(nblocks)]


def wait(agent, h, timeout=30.0):
    deadline = time.monotonic() + timeout
    while agent.check_xfer_state(h) == "PROC" and time.monotonic() < deadline:
        time.sleep(0.002)
    return agent.check_xfer_state(h)


def test_a_transfer_cut_into_requests_notifies_once_after_all(daemons, monkeypatch):
    a, b = daemons
    A, B = pair(a, b)
    try:
        amem, ablocks = regions(A, 16)
        bmem, bblocks = regions(B, 16)
        amem[:] = np.arange(amem.nbytes, dtype=np.uint64).astype(np.uint8)
        A.add_remote_agent(B.get_agent_metadata())  # again, now with B's region
        local = A.prep_xfer_dlist("NIXL_INIT_AGENT", ablocks, "DRAM")
        remote = A.prep_xfer_dlist("xf-B", bblocks, "DRAM")
        monkeypatch.setattr(_plan, "MAX_ENTRIES", 3)
        idx = np.array([0, 2, 4, 6, 8, 10, 12, 14, 1, 3])  # nothing merges: 10 entries, 4 requests
        h = A.make_prepped_xfer("WRITE", local, idx, remote, idx[::-1].copy(), notif_msg=b"all ten")
        with pytest.raises(nixlNotPostedError):
            A.check_xfer_state(h)
        assert len(h._xfer.plan.requests) == 4
        assert A.transfer(h) in ("PROC", "DONE")
        with pytest.raises(nixlRepostActiveError):
            A.transfer(h)
        assert wait(A, h) == "DONE", h.error
        deadline = time.monotonic() + 10
        got = {}
        while not got and time.monotonic() < deadline:
            got = B.get_new_notifs()
        assert got == {"xf-A": [b"all ten"]}
        for li, ri in zip(idx, idx[::-1]):
            assert np.array_equal(bmem[ri * BLOCK:(ri + 1) * BLOCK], amem[li * BLOCK:(li + 1) * BLOCK])
        t = A.get_xfer_telemetry(h)
        assert (t.totalBytes, t.descCount) == (10 * BLOCK, 10) and t.xferDuration > 0 and t.startTime > 0
        amem[:] = 7  # re-posted: the new bytes go, with the new notification
        assert A.transfer(h, b"again") in ("PROC", "DONE")
        assert wait(A, h) == "DONE"
        assert (bmem[idx[::-1][0] * BLOCK:(idx[::-1][0] + 1) * BLOCK] == 7).all()
        A.release_xfer_handle(h)
        with pytest.raises(nixlNotFoundError, match="handle: released"):
            A.check_xfer_state(h)
    finally:
        A.close()
        B.close()


def test_releasing_an_unfinished_transfer_cancels_it(slow):
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
        assert A.transfer(h) == "PROC"  # 64 MiB at 1 Gbit/s: half a second
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
        anon = np.zeros(1 << 16, dtype=np.uint8)  # plain (anonymous) memory: the daemon cannot map it
        with pytest.raises(nixlInvalidParamError, match=r"reg_list\[0\] \(DRAM at 0x[0-9a-f]+, 65536 bytes\): .*anonymous"):
            A.register_memory([(int(anon.ctypes.data), anon.nbytes, 0, "")], "DRAM")
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
