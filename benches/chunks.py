#!/usr/bin/env python3
"""Chunk by chunk: where a rendezvous transfer's time goes on the lanes, from both daemons' hop
trace (`RUST_LOG=tcpxd::hop=trace`; both logs share the host's clock). The companion of
`hops.py`, which splits the control path before the first byte; this one follows the data.

    RUST_LOG=tcpxd::hop=trace tcpxctl bench transfer --op write --blocks 4096 --block-size 16K \\
        --no-batch --iters 10 --warmup 2 --keep-dir
    python3 benches/chunks.py --every 2 /tmp/tcpxd-bench-PID/bench-a.log /tmp/tcpxd-bench-PID/bench-b.log

A is the daemon that issues the transfers, B its peer. A's transfers (its `api.in` to its
`poller.finished`) are the windows; with `--every K` kinds alternate transfer by transfer
(`bench transfer --blocks N --no-batch`: 2, the contiguous transfer then the block one, the
default; with the batch: `--every 3 --names contiguous,batch,blocks`) and the script reports
each kind. Every chunk is followed on its comm (a comm's
requests are FIFO, so its k-th post is its k-th completion):

- **gather**: a block send's gather queued (`poller.gather`) → its send posted (`poller.gathered`:
  the gather done, seen by the poller, and the window open);
- **send in plugin**: `lane.isend` → `poller.sent`;
- **recv in plugin**: `lane.irecv` → `poller.received` (or `.dropped`, `.landed`);
- **scatter**: `poller.received` → `poller.consumed` (the scatter, and the zeroing of its landing
  slot, queued, run and seen done; 0 for a contiguous receive straight into its destination).

Per kind: the p50 transfer, the p50 of each step's per-chunk median, and, averaged over each
transfer's data phase (first post to last completion, all lanes together), how many chunks were
in each step at once: a block transfer that holds fewer sends or receives in the plugin than a
contiguous one lost them to its gathers or scatters; one that holds as many but takes longer
lost its time elsewhere (the copies' CPU, the plugin's threads).
"""

import argparse
import bisect
import os
import statistics
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hops  # noqa: E402  (the hop trace's log format, parsed once)


def parse(path, side):
    """`hops.parse`'s events of one daemon's log, each marked with its `side`."""
    return [(t, {**fields, "side": side}) for t, fields in hops.parse(path)]


def pairs(events, start, ends):
    """Per comm, the k-th `start` event with the k-th event in `ends`: [(t0, t1, comm, side)]."""
    posted = defaultdict(list)
    done = defaultdict(list)
    for t, f in events:
        c = f.get("comm")
        if c is None:
            continue
        key = (f["side"], c)
        if f["hop"] == start:
            posted[key].append(t)
        elif f["hop"] in ends:
            done[key].append(t)
    out = []
    for key, ts in posted.items():
        for t0, t1 in zip(ts, done.get(key, [])):
            out.append((t0, t1, key[1], key[0]))
    return out


def occupancy(spans, lo, hi):
    """Time-averaged number of spans open in [lo, hi]."""
    if hi <= lo:
        return 0.0
    total = sum(max(0.0, min(t1, hi) - max(t0, lo)) for t0, t1 in spans)
    return total / (hi - lo)


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a_log")
    ap.add_argument("b_log")
    ap.add_argument("--skip", type=int, default=2, help="transfers to leave out at the start (warm-up)")
    ap.add_argument("--every", type=int, default=2, help="kinds that alternate transfer by transfer")
    ap.add_argument("--names", default="contiguous,blocks", help="names of the kinds, in their order")
    args = ap.parse_args()

    a = parse(args.a_log, "a")
    b = parse(args.b_log, "b")
    events = sorted(a + b, key=lambda e: e[0])

    # A's transfers: api.in → poller.finished, one at a time.
    windows = []
    opened = None
    for t, f in a:
        if f["hop"] == "api.in" and opened is None:
            opened = t
        elif f["hop"] == "poller.finished" and opened is not None:
            windows.append((opened, t))
            opened = None
    starts = [w[0] for w in windows]

    steps = {
        "gather": pairs(events, "poller.gather", {"poller.gathered"}),
        "send in plugin": pairs(events, "lane.isend", {"poller.sent"}),
        "recv in plugin": pairs(events, "lane.irecv", {"poller.received", "poller.dropped", "poller.landed"}),
        "scatter": pairs(events, "poller.received", {"poller.consumed"}),
    }
    # Each chunk step to the window it began in.
    per = defaultdict(lambda: defaultdict(list))
    for name, spans in steps.items():
        for t0, t1, _, _ in spans:
            i = bisect.bisect_right(starts, t0) - 1
            if i < 0 or t0 > windows[i][1]:
                continue
            per[i][name].append((t0, t1))

    names = args.names.split(",")
    kinds = defaultdict(list)
    for i, (lo, hi) in enumerate(windows):
        if i < args.skip:
            continue
        k = (i - args.skip) % args.every
        kind = names[k] if k < len(names) else f"kind {k}"
        spans = per.get(i, {})
        data = [s for v in spans.values() for s in v]
        if not data:
            continue
        d0 = min(s[0] for s in data)
        d1 = max(s[1] for s in data)
        row = {
            "transfer": hi - lo,
            "before data": d0 - lo,
            "data phase": d1 - d0,
            "after data": hi - d1,
            "chunks": len(spans.get("send in plugin", [])),
        }
        for name in steps:
            v = spans.get(name, [])
            row[f"{name} p50"] = med([t1 - t0 for t0, t1 in v]) if v else 0.0
            row[f"{name} at once"] = occupancy(v, d0, d1)
        kinds[kind].append(row)

    if not kinds:
        print("no transfers found (were the daemons run with RUST_LOG=tcpxd::hop=trace?)")
        return
    order = [n for n in names if n in kinds] + [k for k in kinds if k not in names]
    print(f"{'µs (p50 over transfers)':<28}" + "".join(f"{k:>14}" for k in order))
    print(f"{'transfers':<28}" + "".join(f"{len(kinds[k]):>14}" for k in order))
    keys = ["transfer", "before data", "data phase", "after data", "chunks"]
    for name in steps:
        keys += [f"{name} p50", f"{name} at once"]
    for key in keys:
        vals = [med([r[key] for r in kinds[k]]) for k in order]
        fmt = "{:>14.2f}" if key.endswith("at once") else "{:>14.0f}"
        print(f"{key:<28}" + "".join(fmt.format(v) for v in vals))


if __name__ == "__main__":
    main()
