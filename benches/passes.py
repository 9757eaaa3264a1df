#!/usr/bin/env python3
"""Counts poller passes between the steps of each received chunk and each transfer's end, from a
daemon's hop trace (`RUST_LOG=tcpxd::hop=trace`: every poller hop carries `pass`, the number of
the poller's pass it ran in; `stage.submit` / `stage.done` are a GPU unpack batch's launch and the
pass that saw it finished). Pass counts do not depend on how fast the machine is, so they tell
the order apart on a noisy VM where timings cannot.

    RUST_LOG=tcpxd::hop=trace tcpxctl bench transfer --cuda 3 --peer-cuda 5 --sizes 1M --keep-dir
    python3 benches/passes.py /tmp/tcpxd-bench-PID/bench-b.log     # a WRITE's receiver
    python3 benches/passes.py /tmp/tcpxd-bench-PID/bench-a.log     # a READ's receiver (the reader)

Per chunk (a receive landed on a lane, in lane order): `landed` (the plugin's receive completed)
→ `land` (its header said where: `Action::Land`; absent for a rendezvous receive) → `submit`
(its GPU unpack launched) → `done` (seen finished) → `consumed`. Per transfer end on that daemon
(`poller.out kind=done` towards the sender, or `poller.finished` to its own client): the passes
since the last chunk consumed before it. Prints each step's pass deltas (count per delta) and its
median µs (the µs are the trace's own, noisy on a loaded VM).
"""

import argparse
import statistics
import sys
from collections import Counter, defaultdict, deque

sys.path.insert(0, __import__("os").path.dirname(__file__))
from hops import parse  # noqa: E402

STEPS = ["landed>land", "land>submit", "landed>submit", "submit>done", "done>consumed", "landed>consumed"]


def chunks_and_ends(events, skip):
    lanes = defaultdict(deque)  # lane -> chunks not consumed yet, oldest first
    waiting_submit = deque()  # chunks whose unpack is not launched yet, in order
    by_batch = {}  # (gpu, batch) -> chunks launched in it
    done = []
    ends = []
    last_consumed = None
    for t, f in events:
        hop, p = f.get("hop"), f.get("pass")
        if p is None:
            continue
        p = int(p)
        if hop == "poller.landed":
            c = {"landed": (p, t)}
            lanes[f["lane"]].append(c)
        elif hop == "poller.land":
            for c in lanes[f["lane"]]:
                if "land" not in c:
                    c["land"] = (p, t)
                    waiting_submit.append(c)
                    break
        elif hop == "poller.received":
            c = {"landed": (p, t)}
            lanes[f["lane"]].append(c)
            waiting_submit.append(c)
        elif hop == "stage.submit":
            key = (f["gpu"], f["batch"])
            while waiting_submit:
                c = waiting_submit.popleft()
                c["submit"] = (p, t)
                by_batch.setdefault(key, []).append(c)
        elif hop == "stage.done":
            for c in by_batch.pop((f["gpu"], f["batch"]), []):
                c["done"] = (p, t)
        elif hop == "poller.consumed":
            q = lanes[f["lane"]]
            if q:
                c = q.popleft()
                c["consumed"] = (p, t)
                # A chunk unpacked on the host (no GPU batch) is not waiting for one.
                if c in waiting_submit:
                    waiting_submit.remove(c)
                done.append(c)
                last_consumed = (p, t)
        elif (hop == "poller.out" and f.get("kind") == "done") or hop == "poller.finished":
            if last_consumed is not None:
                kind = "Done out" if hop == "poller.out" else "Finished"
                ends.append((kind, p - last_consumed[0], t - last_consumed[1]))
                last_consumed = None
    return done[skip:], ends[skip:]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", help="the receiving daemon's log")
    ap.add_argument("--skip", type=int, default=10, help="chunks and ends to leave out at the start (warm-up)")
    args = ap.parse_args()
    chunks, ends = chunks_and_ends(parse(args.log), args.skip)
    if not chunks:
        sys.exit(f"{args.log}: no chunk with pass numbers (RUST_LOG=tcpxd::hop=trace, a tcpxd with `pass`)")
    print(f"{len(chunks)} chunks, {len(ends)} transfer ends")
    print(f"{'step':<18} {'passes: chunks':<40} {'p50 us':>8}")
    for step in STEPS:
        a, b = step.split(">")
        pairs = [(c[b][0] - c[a][0], c[b][1] - c[a][1]) for c in chunks if a in c and b in c]
        if not pairs:
            continue
        hist = Counter(d for d, _ in pairs)
        shown = " ".join(f"{d}:{n}" for d, n in sorted(hist.items()))
        print(f"{step:<18} {shown:<40} {statistics.median(u for _, u in pairs):>8.0f}")
    for kind in ("Done out", "Finished"):
        xs = [(d, u) for k, d, u in ends if k == kind]
        if xs:
            hist = Counter(d for d, _ in xs)
            shown = " ".join(f"{d}:{n}" for d, n in sorted(hist.items()))
            print(f"{'consumed>' + kind:<18} {shown:<40} {statistics.median(u for _, u in xs):>8.0f}")


if __name__ == "__main__":
    main()
