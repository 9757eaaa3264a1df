"""A polling agent decodes only what is its own (session 31, feeds; #39 point 5).

- Several agents on one daemon: each agent's feed subscribes addressed to its name
  (SubscribeRequest.addressed_to), so another agent's notifications never reach it — its session
  gets no event, its board no slot — while the agent they are addressed to gets each once, and a
  subscriber that names nothing (a plain client, tcpxctl subscribe) still gets every one.
- A session with a completion board skips, undecoded, the socket's copy of the ends the board gave
  (`Connection.ready`'s `keep`): every end settles exactly once; without a board every end is
  decoded from its event, as before."""

from __future__ import annotations

import struct
import time

import pytest

import tcpxd
from tcpxd import _board, _local, _proto
from tcpxd.nixl import nixl_agent, nixl_agent_config
from tcpxd.nixl._notify import frame

KIB = 1 << 10


def _event(**kw):
    return _proto.message("SessionEvent")(**kw).SerializeToString()


def test_peek_reads_the_tag_and_the_event_field_without_decoding():
    ev = _proto.message("SessionEvent")
    fin = _proto.message("TransferEvent")(transfer_id=7, total_bytes=4096)
    note = _proto.message("Notification")(payload=b"x" * 300)
    for tag, body, field in [
        (1, _event(tag=1, finished=fin), _local.FINISHED),
        (300, _event(tag=300, notification=note), _local.NOTIFICATION),
        (2**40 + 5, _event(tag=2**40 + 5, finished=fin), _local.FINISHED),
        (0, _event(notification=note), _local.NOTIFICATION),  # tag 0 is not written
        (9, _event(tag=9), 0),  # no event field
    ]:
        assert ev.FromString(body).tag == tag
        assert _local.peek(body, 0, len(body)) == (tag, field)
        framed = b"\xff" * 4 + body  # an offset into a buffer, as `ready` reads it
        assert _local.peek(framed, 4, len(framed)) == (tag, field)
    assert _local.peek(b"\x08\x85", 0, 2) == (5, 0)  # cut short: nothing past the tag


def _notifs(agent, n, timeout=20.0):
    got: dict = {}
    deadline = time.monotonic() + timeout
    while sum(len(v) for v in got.values()) < n and time.monotonic() < deadline:
        for k, v in agent.get_new_notifs().items():
            got.setdefault(k, []).extend(v)
    return got


@pytest.mark.parametrize("board", ["board", "no board"])
def test_an_agents_feed_gets_nothing_addressed_to_another_agent(daemons, monkeypatch, board):
    monkeypatch.setenv("TCPXD_BOARD_SLOTS", str(_board.SLOTS) if board == "board" else "0")
    a, _ = daemons
    A = nixl_agent("fd-A", nixl_agent_config(endpoint=a.endpoint))
    B = nixl_agent("fd-B", nixl_agent_config(endpoint=a.endpoint))
    C = nixl_agent("fd-C", nixl_agent_config(endpoint=a.endpoint))
    try:
        with tcpxd.Client(a.endpoint) as plain:
            sub = plain.subscribe()  # addressed to no one: every notification of the node
            for other in (B, C):
                A.add_remote_agent(other.get_agent_metadata())
            feed_c = C._inbox._feed
            assert feed_c is not None, "no local feed"
            before = feed_c.conn.decoded + feed_c.conn.skipped
            for i in range(20):
                A.send_notif("fd-B", f"to B {i}".encode())
            A.send_notif("fd-C", b"to C")
            got_b = _notifs(B, 20)
            assert got_b == {"fd-A": [f"to B {i}".encode() for i in range(20)]}
            assert _notifs(C, 1) == {"fd-A": [b"to C"]}
            # C's session carried its own notification and nothing else: not one of B's 20 was
            # sent to it (neither as an event nor on its board).
            assert feed_c.conn.decoded + feed_c.conn.skipped - before <= 1
            if feed_c.board is not None:
                assert struct.unpack_from("<Q", feed_c.board.mem, 16)[0] == 1, "C's board numbered one notification"
            # The unaddressed subscriber got all 21 (each agent's in the order sent).
            seen = [n.payload for n in (sub.next(timeout=20) for _ in range(21))]
            to_b = [frame("fd-A", "fd-B", f"to B {i}".encode()) for i in range(20)]
            assert [p for p in seen if p in to_b] == to_b
            assert sorted(seen) == sorted(to_b + [frame("fd-A", "fd-C", b"to C")])
            sub.close()
        assert B.get_new_notifs() == {} and C.get_new_notifs() == {}
    finally:
        for ag in (A, B, C):
            ag.close()


def _ends(s, src, dst, n, size=4 * KIB):
    """`n` 4 KiB WRITEs one at a time on session `s`, each polled until done; their results."""
    out = []
    for i in range(n):
        f = s.write(src, dst, size, local_offset=i * size, remote_offset=i * size)
        deadline = time.monotonic() + 30
        while not f.done():
            assert time.monotonic() < deadline, "not done within 30 s"
        out.append(f.result())
    return out


@pytest.mark.parametrize("board", ["board", "no board"])
def test_each_end_is_settled_once_and_board_ends_are_not_decoded(peered, monkeypatch, board):
    monkeypatch.setenv("TCPXD_BOARD_SLOTS", str(_board.SLOTS) if board == "board" else "0")
    a, b = peered
    n = 48
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(1 << 20) as src, cb.register_host(1 << 20) as dst:
            src.fill(seed=31)
            with ca.session() as s:
                assert (s._board is not None) == (board == "board")
                conn = s._conn
                start = conn.decoded + conn.skipped
                settled = []
                from_board = s._from_board

                def counting(new):
                    got = from_board(new)
                    settled.append(got)
                    return got

                s._from_board = counting  # type: ignore[method-assign]
                results = _ends(s, src, dst, n)
                assert [r.total_bytes for r in results] == [4 * KIB] * n
                assert len({r.transfer_id for r in results}) == n
                # Every end's event comes (read by the poll or the reader thread): each decoded
                # for its request, or — its end already settled from the board — skipped.
                deadline = time.monotonic() + 30
                while conn.decoded + conn.skipped - start < n:
                    assert time.monotonic() < deadline, (conn.decoded, conn.skipped)
                    s.poll()
                    time.sleep(0.001)
                assert conn.decoded + conn.skipped - start == n
                if board == "board":
                    assert any(settled), "no end was settled from the board"
                    assert conn.skipped >= 1, "the board's ends were decoded from their events too"
                else:
                    assert conn.skipped == 0 and not settled
            assert src.read_bytes()[: n * 4 * KIB] == dst.read_bytes()[: n * 4 * KIB]
