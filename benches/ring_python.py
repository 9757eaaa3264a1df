#!/usr/bin/env python3
"""What a client pays to hand one small request to the daemon, with no daemon in the way: on the
session's socket (`sendall` of the frame, as tcpxd.Session sends it) against on the request ring
(`_ring.Ring.put`: the slot written in C, the fence, `spinning` read; the daemon's `taken` read
only when the ring looks full). The frame is a tcpxd.nixl prepared READ's (~100 bytes). Each
measured `--iters` times a round, the socket's peer drained between rounds (outside the timing)
and the ring's `taken` advanced as a daemon would; the smallest of `--rounds` rounds' medians and
the median of their p99s printed, in µs. Needs the C pass (`_native`).

    PYTHONPATH=python/src python3 benches/ring_python.py
"""

from __future__ import annotations

import argparse
import socket
import statistics
import struct
import time
from typing import List, Tuple

from tcpxd import _ring


def frame() -> bytes:
    body = bytes(range(96))
    return struct.pack(">I", len(body)) + body


def by_socket(iters: int) -> List[float]:
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
    f = frame()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        a.sendall(f)
        out.append((time.perf_counter_ns() - t0) / 1e3)
    b.setblocking(False)
    try:
        while b.recv(1 << 20):
            pass
    except BlockingIOError:
        pass
    a.close()
    b.close()
    return out


def by_ring(iters: int) -> List[float]:
    ring = _ring.Ring()
    struct.pack_into("<Q", ring.mem, 8, 1)  # the daemon's poller spinning: no doorbell
    f = frame()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        bell = ring.put(f)
        out.append((time.perf_counter_ns() - t0) / 1e3)
        assert bell is False
        struct.pack_into("<Q", ring.mem, 0, ring.written)  # as the daemon takes it
    ring.close()
    return out


def pct(xs: List[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    if not _ring.wanted():
        raise SystemExit("no C pass here (or TCPXD_RING_SLOTS=0): build it, python3 setup.py build_ext --inplace")
    res: dict = {"socket sendall": [], "ring put": []}
    for _ in range(a.rounds):  # alternating
        for name, fn in (("socket sendall", by_socket), ("ring put", by_ring)):
            xs = fn(a.iters)
            res[name].append((statistics.median(xs), pct(xs, 99)))
    for name, rows in res.items():
        best: Tuple[float, float] = min(rows)
        print(f"{name}: p50 {best[0]:.2f} µs (smallest of {a.rounds} rounds' medians), "
              f"p99 {statistics.median(r[1] for r in rows):.2f} µs (median of rounds)")


if __name__ == "__main__":
    main()
