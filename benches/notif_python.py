#!/usr/bin/env python3
"""What tcpxd.nixl's `get_new_notifs` costs the polling process, with no daemon in the way: an
agent's inbox (tcpxd.nixl._notify.Inbox) on a feed whose socket is one end of a socketpair and
whose completion board has notification slots (tcpxd._board), written here as the daemon writes
them (the payload in its slot, `notified` raised, then the event on the socket).

- an empty poll: `take()` when nothing has arrived (what a tight loop repeats while it waits);
- a notification: its slot and its event written, then `take()` until it returns it (the poll that
  sees it, and the event it drops);
- a notification read from its event alone (no board), for comparison;
- send_notif's post (`Inbox.post`: its pre-encoded WriteRequest framed and sent on the feed).

Each measured `--iters` times after a warm-up, the smallest of `--rounds` rounds' medians printed,
in µs.

    PYTHONPATH=python/src python3 benches/notif_python.py
"""

from __future__ import annotations

import argparse
import socket
import statistics
import struct
import time
from typing import Any, Optional, Tuple

from tcpxd import _board, _local, _proto
from tcpxd.nixl import _notify

SENDER, NAME = "initiator", "target"


def inbox(board: bool) -> Tuple[Any, socket.socket, Optional[_board.Board]]:
    """An Inbox reading a feed on a socketpair (the other end returned, for the 'daemon')."""
    a, b = socket.socketpair()
    b.setblocking(False)
    bd = _board.Board(64, _notify.FEED_NOTES) if board else None
    if bd is not None:
        bd.sent()
    feed = _notify._Feed(_local.Connection(b), bd)
    box = _notify.Inbox.__new__(_notify.Inbox)
    import threading

    box._client = None
    box._name = NAME
    box._lock = threading.Lock()
    box._arrived = threading.Condition(box._lock)
    box._waiting = threading.Lock()
    box._new = {}
    box._closed = False
    box._feed = feed
    box._path = "unused"
    box._retry_at = 0.0
    box._quiet = False
    box._empty_at = 0.0
    box._spin_from = 0.0
    box._sub = None
    if hasattr(_notify.Inbox, "_setup"):
        _notify.Inbox._setup(box)
    return box, a, bd


def event_frame(payload: bytes) -> bytes:
    ev = _proto.message("SessionEvent")(tag=1)
    ev.notification.from_node = "a"
    ev.notification.transfer_id = 7
    ev.notification.payload = payload
    body = ev.SerializeToString()
    return struct.pack(">I", len(body)) + body


class Daemon:
    """Writes notifications as the daemon does (api/local/board.rs, `Outbox::note` then `push`)."""

    def __init__(self, sock: socket.socket, board: Optional[_board.Board]):
        self.sock, self.board, self.k = sock, board, 0

    def notify(self, payload: bytes) -> None:
        self.k += 1
        bd = self.board
        if bd is not None and len(payload) <= _board.NOTE_BYTES:
            at = bd.notes_at + ((self.k - 1) % bd.notes) * _board.NOTE_SLOT
            struct.pack_into("<2Q", bd.mem, at, 0, len(payload))
            bd.mem[at + 16 : at + 16 + len(payload)] = payload
            struct.pack_into("<Q", bd.mem, at, self.k)
        if bd is not None:
            struct.pack_into("<Q", bd.mem, 16, self.k)  # `notified`
        self.sock.send(event_frame(payload))


def empty(iters: int, board: bool) -> float:
    box, a, bd = inbox(board)
    take = box.take
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        take()
        times.append(time.perf_counter() - t0)
    a.close()
    return statistics.median(times) * 1e6


def one(iters: int, board: bool) -> float:
    box, a, bd = inbox(board)
    d = Daemon(a, bd)
    payload = _notify.frame(SENDER, NAME, b"ping")
    take = box.take
    times = []
    for _ in range(iters):
        d.notify(payload)
        t0 = time.perf_counter()
        while True:
            got = take()
            if got:
                break
        times.append(time.perf_counter() - t0)
        assert got == {SENDER: [b"ping"]}, got
    # What the board gave is never given twice: the events left behind are dropped.
    time.sleep(0.01)
    assert not box.take()
    a.close()
    return statistics.median(times) * 1e6


def post(iters: int, board: bool) -> float:
    """send_notif's post: its WriteRequest (pre-encoded, as the agent's) sent on the feed, its
    answer left for a later read (the other end drained between calls, untimed)."""
    box, a, bd = inbox(board)
    a.setblocking(False)
    body = b"\x0a" + bytes(60)  # (the size of send_notif's WriteRequest; never decoded here)
    times = []
    for i in range(iters):
        t0 = time.perf_counter()
        box.post(body, SENDER)
        times.append(time.perf_counter() - t0)
        if i % 64 == 63:
            box._feed.sent.clear()
            try:
                while a.recv(1 << 16):
                    pass
            except BlockingIOError:
                pass
    a.close()
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    rows = [
        ("empty poll, board", lambda n: empty(n, True)),
        ("empty poll, no board", lambda n: empty(n, False)),
        ("a notification, board", lambda n: one(n, True)),
        ("a notification, its event alone", lambda n: one(n, False)),
        ("send_notif's post (Inbox.post: the frame sent on the feed)", lambda n: post(n, True)),
    ]
    for _, f in rows:
        f(2000)
    for name, f in rows:
        print(f"{name}: {min(f(a.iters) for _ in range(a.rounds)):.2f} µs")


if __name__ == "__main__":
    main()
