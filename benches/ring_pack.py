"""What packing a prepared request's indices into the index ring costs, against a private copy
(tcpxd.nixl's `Windows.pack`; issue #24): 32,768 int64 indices of vLLM's form cast to u32, the
destination a slot of a shared memfd that a second process (standing in for the daemon) reads
after every write, as the daemon copies a window out when it takes the request. No daemon needed.

    python3 benches/ring_pack.py [--writer-cpu N] [--reader-cpu M] [--rounds R]

Prints medians (µs) of: the cast into a private array; into the ring with nobody reading it; into
one slot the reader read last (today's order: the slot freed last is taken first); into the 32
slots in turn; into a private scratch then a plain copy into the slot; the int64 indices copied
as they are (what a daemon reading int64 windows would need); and the range check (one
reduction). Pin the reader to another core (another socket, where the host has two) to see what
the cache lines' trip back costs."""

from __future__ import annotations

import argparse
import mmap
import os
import time

import numpy as np

N = 32768
SLOTS = 32


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cpus = sorted(os.sched_getaffinity(0))
    ap.add_argument("--writer-cpu", type=int, default=cpus[0])
    ap.add_argument("--reader-cpu", type=int, default=cpus[-1])
    ap.add_argument("--rounds", type=int, default=400)
    args = ap.parse_args()
    fd = os.memfd_create("ring-pack")
    os.ftruncate(fd, SLOTS * 8 * N)
    ring = np.frombuffer(mmap.mmap(fd, SLOTS * 8 * N), dtype=np.uint32)
    ring[:] = 0
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:  # the daemon's stand-in: copies a window out when told where
        os.sched_setaffinity(0, {args.reader_cpu})
        seen = np.frombuffer(mmap.mmap(fd, SLOTS * 8 * N), dtype=np.uint8)
        out = np.empty(8 * N, np.uint8)
        while True:
            b = os.read(r1, 12)
            if not b or b == b"quit":
                os._exit(0)
            at, nbytes = int.from_bytes(b[:8], "little"), int.from_bytes(b[8:], "little")
            if nbytes:
                out[:nbytes] = seen[at:at + nbytes]
            os.write(w2, b"k")
    os.sched_setaffinity(0, {args.writer_cpu})
    rng = np.random.default_rng(0)
    priv = np.empty(N, np.uint32)
    scratch = np.empty(N, np.uint32)
    ring64 = ring.view(np.uint64)
    umax = np.maximum.reduce

    def slot_u32(s: int) -> np.ndarray:
        return ring[2 * s * N:2 * s * N + N]

    def cases():
        yield "cast into a private array", lambda i, a: priv.__setitem__(slice(None), a), None
        yield "into the ring, nobody reading", lambda i, a: slot_u32(0).__setitem__(slice(None), a), None
        yield "into the slot read last (LIFO)", lambda i, a: slot_u32(0).__setitem__(slice(None), a), (0, 4 * N)
        yield "into the 32 slots in turn", lambda i, a: slot_u32(i % SLOTS).__setitem__(slice(None), a), "turn"
        yield "private scratch, then copy in", lambda i, a: (np.copyto(scratch, a, casting="unsafe"), np.copyto(slot_u32(0), scratch)), (0, 4 * N)
        yield "int64 as is (slot read last)", lambda i, a: ring64[:N].__setitem__(slice(None), a), (0, 8 * N)
        yield "range check (umax of the int64)", lambda i, a: umax(a.view(np.uint64)), None

    print(f"writer on cpu {args.writer_cpu}, reader on cpu {args.reader_cpu}; medians of {args.rounds} (µs):")
    for name, f, read in cases():
        ts = []
        for i in range(args.rounds + 50):
            a = (np.arange(64)[:, None] * 4096 + rng.choice(4096, 512, replace=False)[None, :]).reshape(-1)
            t0 = time.perf_counter()
            f(i, a)
            ts.append(time.perf_counter() - t0)
            at, nbytes = (0, 0) if read is None else ((i % SLOTS) * 8 * N, 4 * N) if read == "turn" else read
            os.write(w1, at.to_bytes(8, "little") + nbytes.to_bytes(4, "little"))
            os.read(r2, 1)
        print(f"  {name:34s} {np.median(ts[50:]) * 1e6:7.1f}")
    os.write(w1, b"quit")
    os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
