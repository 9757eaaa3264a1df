#!/usr/bin/env python3
"""The Python a waited `tcpxd.Client.read` / `.write` of 4 KiB costs on the local session, the
daemon's answer already waiting on the socket: the client's own part of a small call, with no
daemon, no wake-up and no scheduler in it (docs/BENCHMARKS.md, "Session 23, client-leg").

A socketpair stands in for the daemon's connection: before each call the answer (a SessionEvent
`finished` for the next tag) is written into it, so the call builds and sends its frame, reads the
answer at once and returns. Prints the smallest of ROUNDS rounds' p50 (the cost undisturbed by
other processes: on a shared machine compare packages alternately, in one run each).

    PYTHONPATH=python/src python3 benches/client_python.py [--iters 3000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import socket
import time

import tcpxd
from tcpxd import _local, _proto


class _Buf:
    """A local buffer as the client's Buffer shows one."""

    id = 7
    size = 4096


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    event, finished = _proto.message("SessionEvent"), _proto.message("TransferEvent")
    client = tcpxd.Client("unix:/nonexistent/client-python.sock")
    daemon, ours = socket.socketpair()
    conn = _local.Connection(ours)
    pool = client._local
    assert pool is not None
    pool.available = True
    pool._idle.append(conn)
    remote = "tcpxd1:node-b:1:4096:" + "ab" * 16 + "@127.0.0.1:40000"

    def answer_next() -> None:
        tag = conn.tag + 1
        ev = event(tag=tag, finished=finished(transfer_id=tag, total_bytes=4096, bytes_done=4096,
                                              elapsed_us=100)).SerializeToString()
        daemon.sendall(_local.HEADER.pack(len(ev)) + ev)

    def drain() -> None:
        try:
            while daemon.recv(1 << 16, socket.MSG_DONTWAIT):
                pass
        except BlockingIOError:
            pass

    calls = (("read", lambda: client.read(remote, _Buf, 4096)), ("write", lambda: client.write(_Buf, remote, 4096)))
    for name, call in calls:
        p50s = []
        for _ in range(a.rounds):
            xs = []
            for i in range(a.iters):
                answer_next()
                t = time.perf_counter_ns()
                r = call()
                xs.append(time.perf_counter_ns() - t)
                if i % 64 == 0:
                    drain()
            assert r.total_bytes == 4096
            xs.sort()
            p50s.append(xs[len(xs) // 2])
        print(f"Client.{name} 4 KiB, the answer waiting: p50 {min(p50s) / 1e3:.2f} µs "
              f"(the smallest of {a.rounds} rounds' p50; rounds {', '.join(f'{x / 1e3:.2f}' for x in p50s)})")
    pool._idle.clear()
    conn.close()
    daemon.close()


if __name__ == "__main__":
    main()
