#!/usr/bin/env python3
"""What a client pays to learn one transfer's OK end, with no daemon in the way: from the session's
socket (the event there already: a poll's look, the `recv`, the decode, the dispatch to its future)
against from the completion board (the end published there already: `published` read, the slot
read and freed, the future settled). Each measured `--iters` times after a warm-up, the smallest of
`--rounds` rounds' medians printed, in µs.

    PYTHONPATH=python/src python3 benches/board_python.py
"""

from __future__ import annotations

import argparse
import socket
import statistics
import struct
import time

from tcpxd import _board, _local, _ops, _proto


class Sink:
    """A nixl part's way of being settled (`skips_result`: only whether it succeeded)."""

    skips_result = True
    done = False

    def set_result(self, _r: object) -> None:
        self.done = True

    def set_exception(self, _e: BaseException) -> None:
        self.done = True


def by_socket(iters: int) -> float:
    a, b = socket.socketpair()
    conn = _local.Connection(b)
    ev = _proto.message("SessionEvent")(tag=1)
    ev.finished.transfer_id = 7
    ev.finished.total_bytes = ev.finished.bytes_done = 4096
    ev.finished.elapsed_us = 55
    ev.finished.state = 3
    body = ev.SerializeToString()
    frame = struct.pack(">I", len(body)) + body
    times = []
    for _ in range(iters):
        a.send(frame)
        sink = Sink()
        t0 = time.perf_counter()
        for got in conn.ready():
            _ops.settle(sink, got)
        times.append(time.perf_counter() - t0)
        assert sink.done
    a.close()
    b.close()
    return statistics.median(times) * 1e6


def by_board(iters: int) -> float:
    board = _board.Board(256)
    board.sent()
    mem = board.mem
    times = []
    n = 0
    for i in range(iters):
        tag = i + 1
        off = ((tag & board.mask) + 1) * 64
        struct.pack_into("<6Q", mem, off, tag, 7, 4096, 4096, 55, 0)  # as the daemon publishes
        n += 1
        struct.pack_into("<Q", mem, 0, n)
        sink = Sink()
        t0 = time.perf_counter()
        if board.news():  # (how many: one here)
            got = board.take(tag)
            if got is not None:
                _ops.settle_done(sink, *got)
        times.append(time.perf_counter() - t0)
        assert sink.done
    board.close()
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    by_socket(2000)
    by_board(2000)
    s = min(by_socket(a.iters) for _ in range(a.rounds))
    bd = min(by_board(a.iters) for _ in range(a.rounds))
    print(f"an OK end learned from the socket: {s:.2f} µs; from the board: {bd:.2f} µs ({bd / s:.2f}x)")


if __name__ == "__main__":
    main()
