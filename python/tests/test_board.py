"""The local session's completion board (tcpxd._board; the daemon's side crates/tcpxd/src/api/local/board.rs):
a session attaches one when it opens, and a poll or a wait settles a transfer's OK end from it
before the socket's event; what the board settles is what the event says (ids, sizes, entries),
failures and refusals still come as events, bytes are compared. The same through tcpxd.nixl's
agent (with and without the C pass). Without a board — the daemon's `runtime.shared_completions`
off (as an older daemon refuses the request), TCPXD_BOARD_SLOTS=0, no memfd here — every end comes
as an event, as before, and the refusal is said once in the log. A client that scribbles on its
own board only sends its ends the socket's way."""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest

import tcpxd
from tcpxd import _board
from tcpxd.nixl import nixl_agent, nixl_agent_config

from conftest import start_daemon, stop_daemon
from test_nixl_transfers import pair, regions

KIB = 1 << 10


@pytest.fixture(autouse=True)
def boards(monkeypatch):
    """Boards on whatever the CPUs (unset, a client below 8 CPUs makes none)."""
    monkeypatch.setenv("TCPXD_BOARD_SLOTS", str(_board.SLOTS))


def _reads(s, src, dst, n, size=4 * KIB):
    """`n` 4 KiB WRITEs one at a time on session `s`, each polled until done; their results."""
    out = []
    for i in range(n):
        f = s.write(src, dst, size, local_offset=i * size, remote_offset=i * size)
        deadline = time.monotonic() + 30
        while not f.done():
            assert time.monotonic() < deadline, "not done within 30 s"
        out.append(f.result())
    return out


def test_a_sessions_ok_ends_are_settled_from_its_board_as_their_events_say(peered):
    a, b = peered
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(1 << 20) as src, cb.register_host(1 << 20) as dst:
            src.fill(seed=11)
            with ca.session() as s:
                board = s._board
                assert board is not None and board.slots == _board.SLOTS
                settled = []
                from_board = s._from_board

                def counting(new):
                    got = from_board(new)
                    settled.append(got)
                    return got

                s._from_board = counting  # type: ignore[method-assign]
                results = _reads(s, src, dst, 64)
                assert any(settled), "no end was settled from the board"
                assert board.seen >= 1
                assert all(r.total_bytes == r.bytes_done == 4 * KIB and r.entries == [(0, "")] for r in results)
                assert len({r.transfer_id for r in results}) == 64
                # Many in flight, waited with result(): the board and the events agree.
                futs = [s.write(src, dst, 16 * KIB, local_offset=i * 16 * KIB, remote_offset=i * 16 * KIB) for i in range(48)]
                assert [f.result(timeout=60).total_bytes for f in futs] == [16 * KIB] * 48
                # A refusal still comes as its event (nothing on the board for it).
                bad = s.write(src, dst, 4 * KIB, remote_offset=(1 << 20) - 10)
                with pytest.raises(tcpxd.InvalidArgument, match="remote_offset"):
                    bad.result(timeout=30)
                # Every slot the session settled is free again (by the board or by the event).
                time.sleep(0.05)
                s.poll()
                mem = board.mem
                assert all(int.from_bytes(mem[64 * (i + 1) : 64 * (i + 1) + 8], "little") == 0 for i in range(board.slots))
            assert src.read_bytes()[: 48 * 16 * KIB] == dst.read_bytes()[: 48 * 16 * KIB]


def test_a_client_scribbling_on_its_board_still_gets_every_end(peered):
    a, b = peered
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(1 << 20) as src, cb.register_host(1 << 20) as dst:
            src.fill(seed=12)
            with ca.session() as s:
                board = s._board
                assert board is not None
                board.mem[:] = b"\xa5" * len(board.mem)  # every slot "taken" by garbage
                results = _reads(s, src, dst, 40)  # each settled by its event
                assert [r.total_bytes for r in results] == [4 * KIB] * 40
            assert src.read_bytes()[: 40 * 4 * KIB] == dst.read_bytes()[: 40 * 4 * KIB]


@pytest.mark.parametrize("native", ["C pass", "no C pass"])
def test_a_tight_nixl_loop_sees_done_on_the_board(daemons, native):
    a, b = daemons
    A, B = pair(a, b)
    if native == "no C pass":
        A._outer_native = False
    try:
        amem, ablocks = regions(A, 8)
        bmem, bblocks = regions(B, 8)
        A.add_remote_agent(B.get_agent_metadata())
        bmem[:] = np.random.default_rng(3).integers(0, 256, bmem.nbytes, dtype=np.uint8)
        local = A.prep_xfer_dlist("NIXL_INIT_AGENT", ablocks, "DRAM")
        remote = A.prep_xfer_dlist("xf-B", bblocks, "DRAM")
        session = A._session_now()
        assert session._board is not None
        before = session._board.seen
        for i in range(40):
            h = A.make_prepped_xfer("READ", local, [i % 8], remote, [(i + 3) % 8])
            A.transfer(h)
            deadline = time.monotonic() + 30
            while (state := A.check_xfer_state(h)) == "PROC":
                assert time.monotonic() < deadline
            assert state == "DONE", h.error
            A.release_xfer_handle(h)
        assert session._board.seen > before, "no end was seen on the board"
        blk = bmem.nbytes // 8
        for i in range(8):
            j = (i + 3) % 8
            assert bytes(amem[i * blk : (i + 1) * blk]) == bytes(bmem[j * blk : (j + 1) * blk])
    finally:
        A.close()
        B.close()


def test_without_a_board_every_end_comes_as_an_event_and_it_is_said_once(tmp_root, caplog, monkeypatch):
    off_a = start_daemon(tmp_root, "brd-off-a", ["--shared-completions", "off"])
    off_b = start_daemon(tmp_root, "brd-off-b")
    monkeypatch.setattr(_board, "_told", False)
    try:
        with caplog.at_level(logging.INFO, logger="tcpxd"):
            with tcpxd.Client(off_a.endpoint) as ca, tcpxd.Client(off_b.endpoint) as cb:
                with ca.register_host(1 << 20) as src, cb.register_host(1 << 20) as dst:
                    src.fill(seed=13)
                    for _ in range(2):
                        with ca.session() as s:
                            assert s.path == "local session" and s._board is None
                            assert [r.total_bytes for r in _reads(s, src, dst, 8)] == [4 * KIB] * 8
                    assert src.read_bytes()[: 8 * 4 * KIB] == dst.read_bytes()[: 8 * 4 * KIB]
        said = [r.getMessage() for r in caplog.records if "completion board" in r.getMessage()]
        assert len(said) == 1 and "runtime.shared_completions off" in said[0], said
        # No board wanted, or none can be made here: the same, on a daemon that offers one.
        monkeypatch.setenv("TCPXD_BOARD_SLOTS", "0")
        with tcpxd.Client(off_b.endpoint) as cb:
            with cb.session() as s:
                assert s._board is None
        monkeypatch.setenv("TCPXD_BOARD_SLOTS", "64")

        def no_memfd(*_a):
            raise OSError(38, "Function not implemented")

        monkeypatch.setattr(os, "memfd_create", no_memfd)
        monkeypatch.setattr(_board, "_told", False)
        with caplog.at_level(logging.INFO, logger="tcpxd"):
            with tcpxd.Client(off_b.endpoint) as cb:
                with cb.session() as s:
                    assert s._board is None
        assert any("no sealed memfd" in r.getMessage() for r in caplog.records)
    finally:
        stop_daemon(off_a)
        stop_daemon(off_b)


def test_slots_wanted_reads_the_environment(monkeypatch):
    monkeypatch.delenv("TCPXD_BOARD_SLOTS")
    assert _board.slots_wanted() == (256 if (os.cpu_count() or 1) >= 8 else 0)
    for v, want in [("0", 0), ("64", 64), ("4096", 4096), ("8192", 256), ("100", 256), ("32", 256), ("x", 256)]:
        monkeypatch.setenv("TCPXD_BOARD_SLOTS", v)
        assert _board.slots_wanted() == want, v


def test_a_nixl_agent_on_a_daemon_without_boards_works_as_before(tmp_root):
    a = start_daemon(tmp_root, "brd-nx-a", ["--shared-completions", "off"])
    b = start_daemon(tmp_root, "brd-nx-b")
    A = nixl_agent("xf-A", nixl_agent_config(endpoint=a.endpoint))
    B = nixl_agent("xf-B", nixl_agent_config(endpoint=b.endpoint))
    try:
        A.add_remote_agent(B.get_agent_metadata())
        amem, ablocks = regions(A, 4)
        bmem, bblocks = regions(B, 4)
        A.add_remote_agent(B.get_agent_metadata())
        amem[:] = 7
        local = A.prep_xfer_dlist("NIXL_INIT_AGENT", ablocks, "DRAM")
        remote = A.prep_xfer_dlist("xf-B", bblocks, "DRAM")
        assert A._session_now()._board is None
        h = A.make_prepped_xfer("WRITE", local, [0, 1], remote, [2, 3])
        A.transfer(h)
        deadline = time.monotonic() + 30
        while A.check_xfer_state(h) == "PROC":
            assert time.monotonic() < deadline
        assert A.check_xfer_state(h) == "DONE", h.error
        blk = amem.nbytes // 4
        assert bytes(bmem[2 * blk : 4 * blk]) == bytes(amem[:2 * blk])
    finally:
        A.close()
        B.close()
        stop_daemon(a)
        stop_daemon(b)


@pytest.mark.parametrize("spin_s", [0.0, 0.02])
def test_the_plain_clients_waits_read_the_board(peered, monkeypatch, spin_s):
    """`Client.read` / `write` (waited, on the pool's connections): with a spin the OK end is taken
    from the board and the event that follows is dropped by the next call; without one the event
    settles it and frees the slot. Either way every result is what the event says."""
    from tcpxd import _local, _ops

    a, b = peered
    monkeypatch.setattr(_local, "SPIN_S", spin_s)
    from_board = []
    done_result = _ops.done_result

    def counting(*fields):
        from_board.append(fields)
        return done_result(*fields)

    monkeypatch.setattr(_ops, "done_result", counting)
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(1 << 20) as src, cb.register_host(1 << 20) as dst, ca.register_host(1 << 20) as back:
            src.fill(seed=14)
            ids = set()
            for i in range(30):
                w = ca.write(src, dst, 4 * KIB, local_offset=i * 4 * KIB, remote_offset=i * 4 * KIB)
                r = ca.read(dst, back, 4 * KIB, remote_offset=i * 4 * KIB, local_offset=i * 4 * KIB)
                assert (w.total_bytes, r.total_bytes, w.bytes_done, r.bytes_done) == (4 * KIB,) * 4
                assert w.entries == r.entries == [(0, "")]
                ids |= {w.transfer_id, r.transfer_id}
            assert len(ids) == 60
            # A refusal after ends the board gave: its own event, not a stale one.
            with pytest.raises(tcpxd.InvalidArgument, match="remote_offset"):
                ca.write(src, dst, 4 * KIB, remote_offset=(1 << 20) - 10)
            assert back.read_bytes()[: 30 * 4 * KIB] == src.read_bytes()[: 30 * 4 * KIB]
            pool = ca._local
            conns = pool._idle + list(pool._busy)
            assert conns and all(c.board is not None for c in conns)
            if spin_s:
                assert from_board, "no waited call took its end from the board"
            else:
                assert not from_board
                for c in conns:  # every slot freed by the events that settled them
                    mem = c.board.mem
                    assert all(int.from_bytes(mem[64 * (i + 1) : 64 * (i + 1) + 8], "little") == 0
                               for i in range(c.board.slots))


@pytest.mark.parametrize("notes", [64, 4])
def test_notifications_come_from_the_feeds_board_in_order(daemons, monkeypatch, notes):
    """A tcpxd.nixl agent's feed attaches a board with notification slots: a notification's
    payload is read there before its event (which is then dropped); too long ones, and those that
    found the slots full (4 slots, ten sent before a look), come by their events, in order."""
    from tcpxd.nixl import _notify

    monkeypatch.setattr(_notify, "FEED_NOTES", notes)
    a, b = daemons
    A, B = pair(a, b)
    try:
        B.add_remote_agent(A.get_agent_metadata())
        feed = B._inbox._feed
        assert feed is not None and feed.board is not None and feed.board.notes == notes
        taken = []
        take_notes = _board.Board.take_notes

        def counting(self):
            got = take_notes(self)
            if self is feed.board:
                taken.extend(got)
            return got

        monkeypatch.setattr(_board.Board, "take_notes", counting)
        msgs = [f"n{i}".encode() for i in range(10)] + [b"L" * 300] + [b"after the long one"]
        for m in msgs:
            A.send_notif("xf-B", m)
        got: list = []
        deadline = time.monotonic() + 30
        while len(got) < len(msgs):
            assert time.monotonic() < deadline, got
            got += B.get_new_notifs().get("xf-A", [])
        assert got == msgs
        assert taken, "no notification was read from the board"
        assert b"L" * 300 not in taken  # (too long for a slot: its event)
        if notes == 4:
            assert len(taken) < len(msgs)
        # A notification round trip after all that: still in order, still from the board.
        A.send_notif("xf-B", b"ping")
        deadline = time.monotonic() + 30
        while not (n := B.get_new_notifs()):
            assert time.monotonic() < deadline
        assert n == {"xf-A": [b"ping"]}
    finally:
        A.close()
        B.close()


def test_a_polling_loop_reads_the_feeds_board_and_no_socket_until_something_is_not_there(daemons, monkeypatch):
    """A get_new_notifs loop on a feed with notification slots reads the board alone while it
    says nothing new (no `recv`, no decode: `_Feed.noted`), takes a notification from its slot and
    settles a send_notif's answer from the board; the socket is read when the board says a
    notification is not in its slot (too long), at the poll after one that took something from the
    board (its events, a few at a time: session 27), and every DRAIN_S (the events left behind are
    dropped, never delivered twice). A loop that waits on the socket (below 8 CPUs) reads it after
    each wait, as before."""
    from tcpxd import _local
    from tcpxd.nixl import _notify

    monkeypatch.setattr(_notify, "DRAIN_S", 3600.0)  # (only what the board says reads the socket)
    monkeypatch.setattr(_notify, "TIGHT_SPIN_S", float("inf"))  # (spinning, as with 8 CPUs: no wait on the socket)
    monkeypatch.setattr(_notify, "SENT_SPIN_S", 30.0)  # (a loaded machine may publish an answer late)
    a, b = daemons
    A, B = pair(a, b)
    try:
        A.add_remote_agent(B.get_agent_metadata())
        B.add_remote_agent(A.get_agent_metadata())
        fa, fb = A._inbox._feed, B._inbox._feed
        assert fa is not None and fa.noting and fb is not None and fb.noting
        for f in (fa, fb):  # what the subscription left unread, read once
            f.drain_at = 0.0
        A.get_new_notifs()
        B.get_new_notifs()
        reads = {"n": 0}
        ready = _local.Connection.ready

        def counting(self, readable=False, keep=None):
            reads["n"] += 1
            return ready(self, readable, keep)

        monkeypatch.setattr(_local.Connection, "ready", counting)
        for _ in range(1000):
            assert B.get_new_notifs() == {}
        assert reads["n"] == 0, "an empty poll read the socket"
        for i in range(20):  # round trips, each side polling tight
            A.send_notif("xf-B", b"ping%d" % i)
            deadline = time.monotonic() + 30
            while not (got := B.get_new_notifs()):
                assert time.monotonic() < deadline
            assert got == {"xf-A": [b"ping%d" % i]}
            B.send_notif("xf-A", b"pong%d" % i)
            while not (got := A.get_new_notifs()):
                assert time.monotonic() < deadline
            assert got == {"xf-B": [b"pong%d" % i]}
        # Each answer (the send_notif's WRITE) settled from the board, each payload from its slot
        # (the values above came before any read of their events); the socket read only by the
        # poll after one that took something (at most one read per take: 2 a round a side).
        assert 0 < reads["n"] <= 2 * 2 * 20, reads
        # Once the last answers are settled (from the board) and those events read by the poll
        # after, empty polls read nothing again.
        deadline = time.monotonic() + 30
        while A._inbox._feed.sent or B._inbox._feed.sent:
            assert A.get_new_notifs() == {} and B.get_new_notifs() == {}
            assert time.monotonic() < deadline, "an answer never came"
        A.get_new_notifs()
        B.get_new_notifs()
        before = reads["n"]
        for _ in range(200):
            assert A.get_new_notifs() == {} and B.get_new_notifs() == {}
        assert reads["n"] == before, "an empty poll read the socket"
        assert not A._inbox._feed.sent or len(A._inbox._feed.sent) == 1  # (the last may be on its way)
        # Too long for a slot: `notified` passes `consumed`, the event is read, in order.
        long = b"L" * 300
        A.send_notif("xf-B", long)
        A.send_notif("xf-B", b"after")
        got_all: list = []
        deadline = time.monotonic() + 30
        while len(got_all) < 2:
            assert time.monotonic() < deadline
            got_all += B.get_new_notifs().get("xf-A", [])
        assert got_all == [long, b"after"] and reads["n"] > 0
        # The events the board's notifications left behind: dropped when read, none again.
        fb.drain_at = 0.0
        assert B.get_new_notifs() == {}
        assert B.get_new_notifs() == {}
    finally:
        A.close()
        B.close()
