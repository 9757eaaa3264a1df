"""Two NIXL agents on one daemon (NIXL's partial_md_example and prep_xfer_perf put two agents on
one node; so do vLLM's and SGLang's disaggregation tests): the daemon copies between the two
agents' memory itself. Every path the shim takes (descriptor lists: the block path or batches;
prepared lists), WRITE and READ, byte-checked, the notification after the bytes; and two plain
clients of one daemon."""

from __future__ import annotations

import time

import numpy as np
import pytest

import tcpxd
from tcpxd.nixl import host_array, nixl_agent, nixl_agent_config

K = 16384


def _notifs(agent, n, timeout=20.0):
    got: dict = {}
    deadline = time.monotonic() + timeout
    while sum(len(v) for v in got.values()) < n and time.monotonic() < deadline:
        for k, v in agent.get_new_notifs().items():
            got.setdefault(k, []).extend(v)
        time.sleep(0.001)
    return got


def _wait(agent, h, timeout=30.0):
    deadline = time.monotonic() + timeout
    while agent.check_xfer_state(h) == "PROC" and time.monotonic() < deadline:
        time.sleep(0.001)
    return agent.check_xfer_state(h)


@pytest.fixture
def agents(daemons):
    a, _ = daemons
    A = nixl_agent("sn-A", nixl_agent_config(endpoint=a.endpoint))
    B = nixl_agent("sn-B", nixl_agent_config(endpoint=a.endpoint))
    A.add_remote_agent(B.get_agent_metadata())
    B.add_remote_agent(A.get_agent_metadata())
    A.make_connection("sn-B")  # nothing to pair: one daemon
    try:
        yield A, B
    finally:
        A.close()
        B.close()


@pytest.mark.parametrize("op", ["WRITE", "READ"])
@pytest.mark.parametrize("path", ["descs", "prepped", "unaligned"])
def test_two_agents_on_one_daemon_move_bytes_exactly(agents, op, path):
    A, B = agents
    nb = 32
    rng = np.random.default_rng(11)
    amem, bmem = host_array(nb * K), host_array(nb * K)
    amem[:] = rng.integers(0, 256, amem.nbytes, dtype=np.uint8)
    bmem[:] = rng.integers(0, 256, bmem.nbytes, dtype=np.uint8)
    A.register_memory([(int(amem.ctypes.data), amem.nbytes, 0, "")], "DRAM")
    B.register_memory([(int(bmem.ctypes.data), bmem.nbytes, 0, "")], "DRAM")
    A.add_remote_agent(B.get_agent_metadata())  # B's new registration
    skew = 100 if path == "unaligned" else 0  # off the 4 KiB granules: the batch path
    li, ri = rng.permutation(nb)[:12], rng.permutation(nb)[:12]
    before_a, before_b = amem.copy(), bmem.copy()
    la = [(int(amem.ctypes.data) + i * K + skew, K - skew, 0) for i in range(nb)]
    lb = [(int(bmem.ctypes.data) + i * K + skew, K - skew, 0) for i in range(nb)]
    if path == "prepped":
        local = A.prep_xfer_dlist("NIXL_INIT_AGENT", la, "DRAM")
        remote = A.prep_xfer_dlist("sn-B", lb, "DRAM")
        h = A.make_prepped_xfer(op, local, li, remote, ri, notif_msg=b"done")
    else:
        h = A.initialize_xfer(op, A.get_xfer_descs([la[i] for i in li], "DRAM"),
                              A.get_xfer_descs([lb[i] for i in ri], "DRAM"), "sn-B", b"done")
    # Aligned descriptor lists take the block path, prepared ones the prepared path (the daemon
    # prepares a list over the other agent's lists of this node), unaligned ones batches.
    assert h._xfer.plan.path == {"descs": "blocks", "prepped": "prepared", "unaligned": "batch"}[path]
    assert A.transfer(h) in ("PROC", "DONE")
    assert _wait(A, h) == "DONE", h.error
    assert _notifs(B, 1) == {"sn-A": [b"done"]}
    src, dst = (amem, bmem) if op == "WRITE" else (bmem, amem)
    for x, y in zip(li.tolist(), ri.tolist()):
        s, d = (x, y) if op == "WRITE" else (y, x)
        assert np.array_equal(src[s * K + skew:(s + 1) * K], dst[d * K + skew:(d + 1) * K]), (x, y)
    # The source is untouched, and so is every destination byte no pair names.
    assert np.array_equal(amem if op == "WRITE" else bmem, before_a if op == "WRITE" else before_b)
    named = set((ri if op == "WRITE" else li).tolist())
    orig = before_b if op == "WRITE" else before_a
    for i in set(range(nb)) - named:
        assert np.array_equal(dst[i * K:(i + 1) * K], orig[i * K:(i + 1) * K]), i
    A.release_xfer_handle(h)


def test_two_clients_of_one_daemon_write_read_and_notify(daemons):
    """The plain client: a descriptor of this node is a same-node copy with a notification for
    the other client's subscribers, READ as well, and a bad range refused naming the field."""
    a, _ = daemons
    with tcpxd.Client(a.endpoint) as c1, tcpxd.Client(a.endpoint) as c2:
        src = c1.register_host(8 << 20, label="sn-src")
        dst = c2.register_host(8 << 20, label="sn-dst")
        try:
            src.fill(seed=5)
            sub = c2.subscribe()
            r = c1.write(src, dst.descriptor, notification=b"same node", timeout=30)
            assert r.bytes_done == 8 << 20
            assert src.checksum() == dst.checksum()
            n = sub.next(timeout=10)
            assert (n.payload, n.buffer_ids) == (b"same node", [dst.id])
            sub.close()
            dst.fill(seed=6)
            c1.read(dst.descriptor, src, 4096, remote_offset=4096, timeout=30)
            assert src.checksum(0, 4096) == dst.checksum(4096, 4096)
            # The client's memory is the buffer's: the copy is visible without a call.
            assert bytes(src.numpy()[:4096]) == bytes(dst.numpy()[4096:8192])
            with pytest.raises(tcpxd.TcpxdError, match=r"entries\[0\]\.remote_offset"):
                c1.write(src, dst.descriptor, 4096, remote_offset=(8 << 20) - 100, timeout=30)
        finally:
            src.release()
            dst.release()


def test_a_session_that_ended_is_closed_when_the_agent_opens_its_next(agents):
    """An agent whose session ended (its daemon restarted: the connection shut down) opens a new
    one for its next transfer and closes the old one's descriptor then, not whenever the garbage
    collector gets to it: benches/restart_loop.py --series saw the puller hold one more unix socket
    per restart of its own daemon, up to +7, between two collections."""
    A, B = agents
    nb = 8
    amem, bmem = host_array(nb * K), host_array(nb * K)
    bmem[:] = np.arange(bmem.nbytes, dtype=np.uint64).astype(np.uint8)
    A.register_memory([(int(amem.ctypes.data), amem.nbytes, 0, "")], "DRAM")
    B.register_memory([(int(bmem.ctypes.data), bmem.nbytes, 0, "")], "DRAM")
    A.add_remote_agent(B.get_agent_metadata())
    local = A.prep_xfer_dlist("NIXL_INIT_AGENT", [(int(amem.ctypes.data) + i * K, K, 0) for i in range(nb)], "DRAM")
    remote = A.prep_xfer_dlist("sn-B", [(int(bmem.ctypes.data) + i * K, K, 0) for i in range(nb)], "DRAM")

    def pull() -> None:
        amem[:] = 0
        h = A.make_prepped_xfer("READ", local, list(range(nb)), remote, list(range(nb)))
        assert A.transfer(h) in ("PROC", "DONE")
        assert _wait(A, h) == "DONE", h.error
        assert np.array_equal(amem, bmem)
        A.release_xfer_handle(h)

    pull()
    old = A._session
    assert old is not None and old._conn is not None
    old._abort("the daemon went away")  # as a restart ends it: shut down, its reader ends
    pull()
    assert A._session is not old
    assert old._conn.sock.fileno() == -1, "the ended session's connection is still open"
