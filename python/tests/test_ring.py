"""The local session's request ring (tcpxd._ring; the daemon's side crates/tcpxd/src/api/local/ring.rs):
a session with a board attaches one when it opens, and its small requests go there instead of the
socket while the daemon's poller spins (`--spin on` here) — the plain client's calls, a Session's
submits, tcpxd.nixl's transfers and send_notif's WRITEs — the rest on the socket, in one order
with them (each entry counts the socket frames before it); where the poller may be parked the
request goes on the socket (or, when it stopped spinning meanwhile, the client rings the
doorbell). Bytes
compared, every end checked. Without a ring — the daemon's `runtime.request_ring` off (as an older
daemon refuses the request), TCPXD_RING_SLOTS=0, no C pass — requests go on the socket as
before, and the refusal is said once. A client that scribbles on its own ring fails only its own
session, with the daemon's reason."""

from __future__ import annotations

import logging
import struct
import time

import numpy as np
import pytest

import tcpxd
from tcpxd import _board, _ring
from tcpxd.nixl import nixl_agent, nixl_agent_config

from conftest import start_daemon, stop_daemon
from test_nixl_transfers import pair, regions

KIB = 1 << 10

pytestmark = pytest.mark.skipif(not _ring.wanted(), reason="no C pass built (the ring needs _native.ring_put)")


@pytest.fixture(autouse=True)
def boards(monkeypatch):
    """Boards (and so rings) on whatever the CPUs (unset, a client below 8 CPUs makes none)."""
    monkeypatch.setenv("TCPXD_BOARD_SLOTS", str(_board.SLOTS))
    monkeypatch.delenv("TCPXD_RING_SLOTS", raising=False)


@pytest.fixture(scope="module")
def spinning(tmp_path_factory):
    """Two daemons whose pollers spin after traffic (`--spin on`, as with 8 CPUs or more), a
    connected to b: where requests go on the ring."""
    root = tmp_path_factory.mktemp("r", numbered=True)
    a = start_daemon(root, "rs-a", ["--spin", "on"])
    b = start_daemon(root, "rs-b", ["--spin", "on"])
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        ca.connect_peer(b.peer_address)
        cb.connect_peer(a.peer_address)
    yield a, b
    stop_daemon(a)
    stop_daemon(b)


def _wait(f, what="the transfer"):
    deadline = time.monotonic() + 30
    while not f.done():
        assert time.monotonic() < deadline, f"{what} not done within 30 s"
    return f.result()


def test_a_sessions_requests_go_on_its_ring_and_the_socket_in_one_order(spinning):
    a, b = spinning
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(4 << 20) as src, cb.register_host(4 << 20) as dst:
            src.fill(seed=21)
            with ca.session() as s:
                ring = s._conn.ring
                assert ring is not None and s._board is not None
                # One at a time, polled: every request on the ring.
                for i in range(32):
                    r = _wait(s.write(src, dst, 4 * KIB, local_offset=i * 4 * KIB, remote_offset=i * 4 * KIB))
                    assert r.total_bytes == r.bytes_done == 4 * KIB
                assert ring.written + ring.sent == 32 and ring.written > 0, (ring.written, ring.sent)
                # A burst past the ring's 64 slots, mixed with batches too large for a slot (the
                # socket's): all in the client's order, all OK, the bytes there.
                futs = []
                for i in range(200):
                    off = (32 + i) * 4 * KIB
                    if i % 50 == 49:  # 4 KiB as 64 entries of 64 bytes: past a slot
                        ops = [tcpxd.WriteOp(src, dst, 64, off + k * 64, off + k * 64) for k in range(64)]
                        futs.append(s.write_batch(ops))
                    else:
                        futs.append(s.write(src, dst, 4 * KIB, local_offset=off, remote_offset=off))
                for f in futs:
                    assert f.result(timeout=60).bytes_done == 4 * KIB
                assert ring.sent >= 4, "the large batches went on the socket"
                assert ring.written + ring.sent == 32 + 200
                assert ring.written > 32, "the burst went on the ring too"
                taken = struct.unpack_from("<Q", ring.mem, 0)[0]
                assert taken == ring.written, "the daemon took every entry"
                # A refusal after it all: its own event, in order.
                with pytest.raises(tcpxd.InvalidArgument, match="remote_offset"):
                    s.write(src, dst, 4 * KIB, remote_offset=(4 << 20) - 10).result(timeout=30)
            n = (32 + 200) * 4 * KIB
            assert dst.read_bytes()[:n] == src.read_bytes()[:n]


def test_the_plain_clients_calls_go_on_its_connections_rings(spinning):
    a, b = spinning
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(1 << 20) as src, cb.register_host(1 << 20) as dst, ca.register_host(1 << 20) as back:
            src.fill(seed=22)
            for i in range(20):
                w = ca.write(src, dst, 4 * KIB, local_offset=i * 4 * KIB, remote_offset=i * 4 * KIB)
                r = ca.read(dst, back, 4 * KIB, remote_offset=i * 4 * KIB, local_offset=i * 4 * KIB)
                assert (w.bytes_done, r.bytes_done) == (4 * KIB, 4 * KIB)
            assert back.read_bytes()[: 20 * 4 * KIB] == src.read_bytes()[: 20 * 4 * KIB]
            pool = ca._local
            conns = pool._idle + list(pool._busy)
            assert conns and all(c.ring is not None for c in conns)
            assert sum(c.ring.written + c.ring.sent for c in conns) == 40
            assert sum(c.ring.written for c in conns) > 0


def test_nixl_transfers_and_send_notif_use_the_ring(spinning):
    a, b = spinning
    A, B = pair(a, b)
    try:
        amem, ablocks = regions(A, 8)
        bmem, bblocks = regions(B, 8)
        A.add_remote_agent(B.get_agent_metadata())
        B.add_remote_agent(A.get_agent_metadata())
        bmem[:] = np.random.default_rng(5).integers(0, 256, bmem.nbytes, dtype=np.uint8)
        local = A.prep_xfer_dlist("NIXL_INIT_AGENT", ablocks, "DRAM")
        remote = A.prep_xfer_dlist("xf-B", bblocks, "DRAM")
        session = A._session_now()
        ring = session._conn.ring
        assert ring is not None
        before = ring.written
        for i in range(30):
            h = A.make_prepped_xfer("READ", local, [i % 8], remote, [(i + 3) % 8])
            A.transfer(h)
            deadline = time.monotonic() + 30
            while (state := A.check_xfer_state(h)) == "PROC":
                assert time.monotonic() < deadline
            assert state == "DONE", h.error
            A.release_xfer_handle(h)
        assert ring.written > before, "the transfers' requests went on the ring"
        blk = bmem.nbytes // 8
        for i in range(8):
            j = (i + 3) % 8
            assert bytes(amem[i * blk : (i + 1) * blk]) == bytes(bmem[j * blk : (j + 1) * blk])
        # Notifications, a round trip each, in order.
        A.send_notif("xf-B", b"first")  # (opens A's feed)
        deadline = time.monotonic() + 30
        while not B.get_new_notifs():
            assert time.monotonic() < deadline
        feed = A._inbox._feed
        assert feed is not None and feed.conn.ring is not None
        sent_before = feed.conn.ring.written
        # (one too long for a slot: on the socket, between entries on the ring, the order kept)
        msgs = [f"m{i}".encode() * (300 if i == 7 else 1) for i in range(20)]
        got: list = []
        for m in msgs:
            A.send_notif("xf-B", m)
            deadline = time.monotonic() + 30
            while not (n := B.get_new_notifs()):
                assert time.monotonic() < deadline
            got += n["xf-A"]
        assert got == msgs
        assert feed.conn.ring.written > sent_before, "send_notif's WRITEs went on the feed's ring"
    finally:
        A.close()
        B.close()


def test_send_notifs_entry_written_in_c_is_the_frame_python_would_put():
    """`Ring.put_notif` (send_notif's request written into the slot by `_native.notif_put`) leaves
    the ring exactly as `Ring.put` of the frame built in Python does — the same bytes, entries
    and doorbells, the same answer (None where it does not fit, the ring is full or `spinning`
    is 0; False where it is set) — over names, messages and tags of every varint length."""
    from tcpxd import _local
    from tcpxd._session import _varint

    if getattr(_ring, "_notif_put", None) is None:
        pytest.skip("a C pass without notif_put")
    rng = np.random.default_rng(33)
    answers = set()
    for _ in range(1500):
        a, b = _ring.Ring(16), _ring.Ring(16)
        spinning = int(rng.integers(0, 4) > 0)
        for r in (a, b):
            struct.pack_into("<Q", r.mem, 8, spinning)
        h0, name, tail, msg = (rng.bytes(int(rng.integers(0, n))) for n in (80, 200, 12, 300))
        tag = int(rng.choice([1, 127, 128, 300, 1 << 20, 1 << 40]))
        a.sent = b.sent = int(rng.integers(0, 1000))
        n = int(rng.integers(0, 20))
        a.written = b.written = n
        a.taken = b.taken = max(0, n - int(rng.integers(0, 18)))
        body = h0 + _varint(len(name) + len(msg)) + name + msg + tail
        head = b"\x08" + _varint(tag) + b"\x12" + _varint(len(body))
        want = a.put(_local.HEADER.pack(len(head) + len(body)) + head + body)
        assert b.put_notif(tag, h0, msg, name, tail) == want
        assert bytes(a.mem) == bytes(b.mem)
        assert (a.written, a.doorbells) == (b.written, b.doorbells)
        answers.add(want)
    assert answers == {None, False}  # (True: `spinning` cleared between the two reads, another thread's doing)


def test_without_a_ring_requests_go_on_the_socket_and_it_is_said_once(tmp_root, caplog, monkeypatch):
    off_a = start_daemon(tmp_root, "ring-off-a", ["--request-ring", "off"])
    off_b = start_daemon(tmp_root, "ring-off-b")
    monkeypatch.setattr(_ring, "_told", False)
    try:
        with tcpxd.Client(off_a.endpoint) as ca, tcpxd.Client(off_b.endpoint) as cb:
            ca.connect_peer(off_b.peer_address)
            with ca.register_host(1 << 20) as src, cb.register_host(1 << 20) as dst:
                src.fill(seed=23)
                with caplog.at_level(logging.INFO, logger="tcpxd"):
                    for _ in range(2):
                        with ca.session() as s:
                            assert s._board is not None and s._conn.ring is None
                            for i in range(8):
                                _wait(s.write(src, dst, 4 * KIB, local_offset=i * 4 * KIB, remote_offset=i * 4 * KIB))
                said = [r.getMessage() for r in caplog.records if "request ring" in r.getMessage()]
                assert len(said) == 1 and "runtime.request_ring off" in said[0], said
                assert dst.read_bytes()[: 8 * 4 * KIB] == src.read_bytes()[: 8 * 4 * KIB]
        # Off on the client's side: no ring asked for, on a daemon that offers one.
        monkeypatch.setenv("TCPXD_RING_SLOTS", "0")
        with tcpxd.Client(off_b.endpoint) as cb:
            with cb.session() as s:
                assert s._board is not None and s._conn.ring is None
        # No board, no ring.
        monkeypatch.setenv("TCPXD_RING_SLOTS", "16")
        monkeypatch.setenv("TCPXD_BOARD_SLOTS", "0")
        with tcpxd.Client(off_b.endpoint) as cb:
            with cb.session() as s:
                assert s._board is None and s._conn.ring is None
    finally:
        stop_daemon(off_a)
        stop_daemon(off_b)


def test_a_client_scribbling_on_its_ring_fails_only_its_own_session(spinning):
    a, b = spinning
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(1 << 20) as src, cb.register_host(1 << 20) as dst:
            with ca.session() as good, ca.session() as bad:
                _wait(good.write(src, dst, 4 * KIB))
                ring = bad._conn.ring
                assert ring is not None
                # The next entry claims a length past its slot.
                k = ring.written + 1
                at = _ring.HEADER_BYTES + (k - 1) % ring.slots * _ring.SLOT_BYTES
                struct.pack_into("<3Q", ring.mem, at, k, 1 << 40, ring.sent)
                ring.written = k
                bad._conn.sock.sendall(_ring.DOORBELL)
                f = bad.write(src, dst, 4 * KIB)
                with pytest.raises(tcpxd.TcpxdError, match="request ring: entry"):
                    f.result(timeout=30)
                # The other session, and new ones, go on.
                assert _wait(good.write(src, dst, 4 * KIB)).bytes_done == 4 * KIB
            with ca.session() as again:
                assert _wait(again.write(src, dst, 4 * KIB)).bytes_done == 4 * KIB


def test_slots_wanted_reads_the_environment(monkeypatch):
    assert _ring.slots_wanted() == _ring.SLOTS
    for v, want in [("0", 0), ("16", 16), ("2048", 2048), ("4096", 64), ("8", 64), ("100", 64), ("x", 64)]:
        monkeypatch.setenv("TCPXD_RING_SLOTS", v)
        assert _ring.slots_wanted() == want, v
    monkeypatch.setattr(_ring, "_put", None)  # no C pass: no ring
    monkeypatch.delenv("TCPXD_RING_SLOTS")
    assert _ring.slots_wanted() == 0 and not _ring.wanted()
