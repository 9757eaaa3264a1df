"""Host memory with no file behind it (a plain numpy array): registered by address, the daemon
reading and writing this process's pages by cross-memory attach (docs/API.md, "Client host
memory"). It moves both ways, byte-checked, within one node (two clients, two NIXL agents of one
daemon) and between two daemons (staged through the lanes' slots), by address on one side or
both; its process killed mid-transfer fails the transfer, not the daemon. The
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


def test_a_plain_numpy_array_moves_both_ways_between_two_daemons(peered):
    """Across nodes the daemon stages each chunk through its lanes' slots (docs/API.md)."""
    a, b = peered
    rng = np.random.default_rng(4)
    size = 3 * MIB + 123
    mine = rng.integers(0, 256, size, dtype=np.uint8)
    theirs = rng.integers(0, 256, size, dtype=np.uint8)
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        buf = ca.register_host(mine)
        far = cb.register_host(size)
        far_np = cb.register_host(theirs)  # by address on both sides
        try:
            assert buf.kind == "host_attached" and far_np.kind == "host_attached"
            ca.write(buf, far.descriptor, timeout=30)
            assert np.array_equal(far.numpy(), mine)
            far.numpy()[:] = rng.integers(0, 256, size, dtype=np.uint8)
            ca.read(far.descriptor, buf, MIB, remote_offset=999, local_offset=5, timeout=30)
            assert np.array_equal(mine[5:5 + MIB], far.numpy()[999:999 + MIB])
            # Started by the other node: it reads the array, and writes into it with a notification.
            cb.read(buf.descriptor, far, timeout=30)
            assert np.array_equal(far.numpy(), mine)
            sub = ca.subscribe()
            cb.write(far_np, buf.descriptor, 4096, notification=b"into numpy", timeout=30)
            assert np.array_equal(mine[:4096], theirs[:4096])
            assert sub.next(timeout=10).payload == b"into numpy"
            sub.close()
            # numpy to numpy, both ways.
            ca.write(buf, far_np.descriptor, timeout=30)
            assert np.array_equal(theirs, mine)
            theirs[:] = rng.integers(0, 256, size, dtype=np.uint8)
            ca.read(far_np.descriptor, buf, timeout=30)
            assert np.array_equal(mine, theirs)
        finally:
            buf.release()
            far.release()
            far_np.release()


HOLDER = """
import sys, numpy as np, tcpxd
c = tcpxd.Client(sys.argv[1])
mem = np.full(int(sys.argv[2]), 7, dtype=np.uint8)
buf = c.register_host(mem)
print(buf.descriptor, flush=True)
sys.stdin.readline()  # killed before this returns
"""


def test_the_client_process_exiting_mid_transfer_fails_the_transfer_not_the_daemon(slow):
    """A READ of a process's numpy array from another node, the process killed while its chunks
    are being sent (1 Gbit/s: the transfer takes about half a second): the READ fails naming the
    buffer, and both daemons go on."""
    import subprocess
    import sys

    a, b = slow
    size = 64 * MIB
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, a.endpoint, str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        descriptor = holder.stdout.readline().strip()
        assert descriptor, "the holder registered nothing"
        with tcpxd.Client(b.endpoint) as cb, cb.register_host(size) as dst:
            with cb.session() as s:
                pending = s.read(descriptor, dst)
                deadline = time.monotonic() + 30
                while dst.read_bytes(0, 1) != b"\x07" and time.monotonic() < deadline:
                    time.sleep(0.005)  # until the first chunk has landed: the transfer is under way
                holder.kill()
                holder.wait(timeout=30)
                with pytest.raises(tcpxd.TcpxdError) as e:
                    pending.result(timeout=30)
                assert "registered by address" in str(e.value) and "gone" in str(e.value), str(e.value)
            # Both daemons still move bytes between them.
            with tcpxd.Client(a.endpoint) as ca, ca.register_host(MIB) as src:
                src.numpy()[:] = 3
                cb.read(src.descriptor, dst, MIB, timeout=30)
                assert dst.read_bytes(0, 4) == b"\x03" * 4
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def _settled(*clients) -> bool:
    """Nothing in flight on either daemon: no transfer, and no chunk posted or queued on a lane
    (a failed transfer's chunks already agreed on still meet their partners)."""
    for c in clients:
        stats = c.stats()
        if stats.active_transfers:
            return False
        for peer in stats.peers:
            for lane in peer.lanes:
                if lane.sends_in_flight or lane.recvs_in_flight or lane.sends_queued or lane.recvs_queued:
                    return False
    return True


@pytest.mark.parametrize("memory", ["numpy", "daemon"])
def test_cancel_and_deadline_of_a_numpy_transfer_across_nodes(slow, slow_gate, memory):
    """At 1 Gbit/s a 64 MiB transfer stays in flight: cancelled (out of the array) and timed out
    (into it) as any transfer, and the array then moves again, byte-checked. A cancelled WRITE
    never writes its source, and from the moment the READ is reported failed no byte of its
    destination changes, though its chunks already agreed on still arrive (docs/API.md,
    "Cancel and deadlines"); the same for a plain host buffer of the daemon's (`daemon`). Before
    session 19 the timed-out READ's emptied chunks were scattered from zeroed landing slots into
    the array after the READ had failed."""
    a, b = slow
    rng = np.random.default_rng(6)
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        if memory == "numpy":
            mine = rng.integers(0, 256, 64 * MIB, dtype=np.uint8)
            buf = ca.register_host(mine)
        else:
            buf = ca.register_host(64 * MIB)
            mine = buf.numpy()
            mine[:] = rng.integers(0, 256, 64 * MIB, dtype=np.uint8)
        original = mine.copy()
        far = cb.register_host(64 * MIB)
        try:
            # Held by the gate (the senders stop after 16 MiB) until cancelled, and until the
            # READ failed and its destination was copied: what arrives after must not land.
            slow_gate.close()
            with ca.session() as s:
                big = s.write(buf, far)
                assert s.cancel(big).result(timeout=30) is True
                with pytest.raises(tcpxd.Cancelled):
                    big.result(timeout=30)
            assert np.array_equal(mine, original), "the cancelled WRITE changed its source"
            slow_gate.close()
            with pytest.raises(tcpxd.DeadlineExceeded):
                ca.read(far.descriptor, buf, timeout=0.05)
            at_failure = mine.copy()
            slow_gate.open()
            end = time.monotonic() + 30
            while not _settled(ca, cb):
                assert time.monotonic() < end, "chunks left in flight after the deadline"
                time.sleep(0.01)
            changed = np.flatnonzero(mine != at_failure)
            assert changed.size == 0, f"{changed.size} bytes of the READ's destination changed after it failed"
            ca.write(buf, far.descriptor, MIB, timeout=30)
            assert np.array_equal(far.numpy()[:MIB], mine[:MIB])
        finally:
            buf.release()
            far.release()


def test_a_cancelled_write_into_a_numpy_array_on_another_node_leaves_old_or_source_bytes(slow, slow_gate):
    """A WRITE into a numpy array of another node, cancelled while its chunks are on the wire:
    once both daemons have nothing in flight, each byte of the array is its old one or the
    source's, never the zeros of a chunk sent empty (the sender sends them only once the
    receiver answered that it discards the offer, peer protocol 7's CancelSeen; before, an
    emptied chunk outrunning the cancel was scattered from its zeroed landing slot into the
    array). The source is never written."""
    a, b = slow
    rng = np.random.default_rng(7)
    mine = rng.integers(0, 256, 64 * MIB, dtype=np.uint8)
    original = mine.copy()
    theirs = np.full(64 * MIB, 0x55, dtype=np.uint8)
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        src = ca.register_host(mine)
        dst = cb.register_host(theirs)
        try:
            with slow_gate.closed(), ca.session() as s:  # held after 16 MiB: it cannot end before the cancel
                big = s.write(src, dst)
                end = time.monotonic() + 30
                while theirs[0] == 0x55:  # until its first chunk landed: the WRITE is under way
                    assert time.monotonic() < end, "nothing landed"
                    time.sleep(0.001)
                assert s.cancel(big).result(timeout=30) is True
                with pytest.raises(tcpxd.Cancelled):
                    big.result(timeout=30)
            end = time.monotonic() + 30
            while not _settled(ca, cb):
                assert time.monotonic() < end, "chunks left in flight after the cancel"
                time.sleep(0.01)
            assert np.array_equal(mine, original), "the cancelled WRITE changed its source"
            foreign = np.flatnonzero((theirs != 0x55) & (theirs != mine))
            assert foreign.size == 0, f"{foreign.size} bytes are neither the old ones nor the source's"
            assert np.count_nonzero(theirs == 0x55) > 0, "the cancel came after the last chunk"
        finally:
            src.release()
            dst.release()


def _wait(agent, h, timeout=30.0):
    deadline = time.monotonic() + timeout
    while agent.check_xfer_state(h) == "PROC" and time.monotonic() < deadline:
        time.sleep(0.001)
    return agent.check_xfer_state(h)


@pytest.mark.parametrize("where", ["one daemon", "two daemons"])
@pytest.mark.parametrize("op", ["WRITE", "READ"])
def test_two_nixl_agents_with_plain_numpy_arrays(peered, op, where):
    """NIXL's two-peer examples register plain numpy arrays: on one daemon or two, they just work
    (prepared lists: block chunks gathered from and scattered into the arrays' pages)."""
    a, b = peered
    tag = where.replace(" ", "")
    A = nixl_agent(f"cm-A-{op}-{tag}", nixl_agent_config(endpoint=a.endpoint))
    B = nixl_agent(f"cm-B-{op}-{tag}", nixl_agent_config(endpoint=(a if where == "one daemon" else b).endpoint))
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
