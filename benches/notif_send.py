#!/usr/bin/env python3
"""The Python of one way of tcpxd.nixl's notification round trip, no daemon (session 32, rt2):
what the sending agent's `send_notif` and the receiving agent's poll that finds the notification
cost the client's CPU alone, so a device figure of the round trip's client legs (tail.py's
`call → posted` and `t:seen → t:sent`) can be split into the package's own work and the rest
(the cache lines the daemon's threads share with it, scheduling).

- send_notif: `nixl_agent.send_notif` on a stand-in agent (a loaded remote agent, its previous
  notification answered) whose inbox's feed has a request ring the 'daemon' says it spins on (no
  system call: the ring's entry only), its slots taken between calls (untimed);
- the poll that finds a notification in its board slot (benches/notif_python.py's feed on a
  socketpair, the board written as the daemon writes it), the socket drained at the empty poll
  before it (as in a ping-pong, where the drain that a find asks for happens while the next
  notification is on its way); and that empty poll.

Each the smallest of `--rounds` rounds' medians, µs.

    PYTHONPATH=python/src TCPXD_NIXL_TIGHT_SPIN_US=inf python3 benches/notif_send.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import sys
import threading
import time
from typing import Any, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import notif_python as npy  # noqa: E402

from tcpxd import _ring  # noqa: E402
from tcpxd.nixl import _agent, _notify, _remotes  # noqa: E402


class _Md:
    name = npy.SENDER


def _sender() -> Tuple[Any, Any, Any, Any]:
    box, _a, _bd = npy.inbox(True)
    ring = _ring.Ring()
    struct.pack_into("<Q", ring.mem, 8, 1)  # the daemon's `spinning` word: no doorbell
    box._feed.conn.ring = ring
    ag = _agent.nixl_agent.__new__(_agent.nixl_agent)
    ag.name = npy.NAME
    ag._inbox = box
    ag._lock = threading.Lock()
    r = _remotes._Remote.__new__(_remotes._Remote)
    r.md = _Md()
    r.notif_lock = threading.Lock()
    r.notif_sent = None
    r.mailbox_entry = b""
    r.notif_head = (b"\x0a\x05hello\x12", _notify.frame(npy.NAME, npy.SENDER, b""), b"")
    ag._remotes = {npy.SENDER: r}
    return ag, box, ring, r


def send(iters: int) -> float:
    ag, box, ring, r = _sender()
    send_notif = ag.send_notif
    sent = box._feed.sent
    mem = ring.mem
    pc = time.perf_counter_ns
    times = []
    for _ in range(iters):
        t0 = pc()
        send_notif(npy.SENDER, b"pong")
        times.append(pc() - t0)
        s = r.notif_sent
        if hasattr(s, "_done"):
            s._done = True  # answered (as the board's end slot would settle it)
        sent.clear()
        struct.pack_into("<Q", mem, 0, ring.written)  # the daemon's `taken`
    return statistics.median(times) / 1e3


def seen(iters: int) -> Tuple[float, float]:
    box, a, bd = npy.inbox(True)
    d = npy.Daemon(a, bd)
    payload = _notify.frame(npy.SENDER, npy.NAME, b"ping")
    take = box.take
    pc = time.perf_counter_ns
    found, empty = [], []
    for _ in range(iters):
        take()  # drains what the last find left on the socket
        t0 = pc()
        take()
        empty.append(pc() - t0)
        d.notify(payload)
        t0 = pc()
        got = take()
        found.append(pc() - t0)
        assert got == {npy.SENDER: [b"ping"]}, got
    a.close()
    return statistics.median(found) / 1e3, statistics.median(empty) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    s = [send(a.iters) for _ in range(a.rounds)]
    f = [seen(a.iters) for _ in range(a.rounds)]
    import tcpxd

    print(f"package {os.path.dirname(tcpxd.__file__)}")
    print(f"send_notif (ring entry, no system call): {min(s):.2f} µs")
    print(f"the poll that finds a notification (board): {min(x[0] for x in f):.2f} µs; "
          f"an empty poll: {min(x[1] for x in f):.2f} µs")


if __name__ == "__main__":
    main()
