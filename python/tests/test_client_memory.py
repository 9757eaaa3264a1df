"""Host memory with no file behind it (a plain numpy array): registered by address, the daemon
reading and writing this process's pages by cross-memory attach (docs/API.md, "Client host
memory"). Within one node it moves both ways, byte-checked, through the client and through two
NIXL agents of one daemon; a transfer with another node naming it is refused saying why. The
refusal when the kernel denies the daemon access (no CAP_SYS_PTRACE) is checked in the daemon's
own tests (net::cross_memory), which can make the kernel's answer: here the daemon runs as root."""

from __future__ import annotations

import time

import numpy as np
import pytest

import tcpxd
from tcpxd.nixl import nixl_agent, nixl_agent_config

MIB = 1 << 20
K = 16384


def test_a_plain_numpy_array_moves_both_ways_on_one_daemon(daemons):
    a, _ = daemons
    rng = np.random.default_rng(3)
    mine = rng.integers(0, 256, 4 * MIB, dtype=np.uint8)  # anonymous memory
    with tcpxd.Client(a.endpoint) as c1, tcpxd.Client(a.endpoint) as c2:
        buf = c1.register_host(mine)
        other = c2.register_host(4 * MIB)
        try:
            assert buf.kind == "host_attached" and buf.size == 4 * MIB
            # The daemon reads the pages themselves (no copy was handed over).
            mine[:16] = 42
            assert buf.read_bytes(0, 16) == b"\x2a" * 16
            c1.write(buf, other.descriptor, timeout=30)
            assert np.array_equal(other.numpy(), mine)
            other.numpy()[:] = rng.integers(0, 256, 4 * MIB, dtype=np.uint8)
            c1.read(other.descriptor, buf, MIB, remote_offset=12345, local_offset=7, timeout=30)
            assert np.array_equal(mine[7:7 + MIB], other.numpy()[12345:12345 + MIB])
            # The other client writes into the array by its descriptor, with a notification.
            sub = c1.subscribe()
            c2.write(other, buf.descriptor, 4096, notification=b"into numpy", timeout=30)
            assert np.array_equal(mine[:4096], other.numpy()[:4096])
            assert sub.next(timeout=10).payload == b"into numpy"
            sub.close()
        finally:
            buf.release()
            other.release()


def test_a_plain_numpy_array_is_refused_across_nodes_saying_why(peered):
    a, b = peered
    mine = np.zeros(MIB, dtype=np.uint8)
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        buf = ca.register_host(mine)
        far = cb.register_host(MIB)
        try:
            with pytest.raises(tcpxd.FailedPrecondition, match="cross-memory attach: it moves only within this node"):
                ca.write(buf, far.descriptor, timeout=30)
            with pytest.raises(tcpxd.FailedPrecondition, match="moves only within this node"):
                cb.read(buf.descriptor, far, timeout=30)
        finally:
            buf.release()
            far.release()


def _wait(agent, h, timeout=30.0):
    deadline = time.monotonic() + timeout
    while agent.check_xfer_state(h) == "PROC" and time.monotonic() < deadline:
        time.sleep(0.001)
    return agent.check_xfer_state(h)


@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_two_nixl_agents_on_one_daemon_with_plain_numpy_arrays(daemons, op):
    """NIXL's two-peer examples register plain numpy arrays; on one node they now just work."""
    a, _ = daemons
    A = nixl_agent(f"cm-A-{op}", nixl_agent_config(endpoint=a.endpoint))
    B = nixl_agent(f"cm-B-{op}", nixl_agent_config(endpoint=a.endpoint))
    try:
        rng = np.random.default_rng(5)
        amem = rng.integers(0, 256, 16 * K, dtype=np.uint8)
        bmem = rng.integers(0, 256, 16 * K, dtype=np.uint8)
        A.register_memory([(int(amem.ctypes.data), amem.nbytes, 0, "")], "DRAM")
        B.register_memory([(int(bmem.ctypes.data), bmem.nbytes, 0, "")], "DRAM")
        A.add_remote_agent(B.get_agent_metadata())
        B.add_remote_agent(A.get_agent_metadata())
        la = [(int(amem.ctypes.data) + i * K, K, 0) for i in range(16)]
        lb = [(int(bmem.ctypes.data) + i * K, K, 0) for i in range(16)]
        local = A.prep_xfer_dlist("NIXL_INIT_AGENT", la, "DRAM")
        remote = A.prep_xfer_dlist(B.name, lb, "DRAM")
        li, ri = [0, 3, 5, 15], [9, 1, 2, 0]
        h = A.make_prepped_xfer(op, local, li, remote, ri, notif_msg=b"np")
        assert A.transfer(h) in ("PROC", "DONE")
        assert _wait(A, h) == "DONE", h.error
        src, dst = (amem, bmem) if op == "WRITE" else (bmem, amem)
        for x, y in zip(li, ri):
            s, d = (x, y) if op == "WRITE" else (y, x)
            assert np.array_equal(src[s * K:(s + 1) * K], dst[d * K:(d + 1) * K]), (x, y)
        A.release_xfer_handle(h)
    finally:
        A.close()
        B.close()
