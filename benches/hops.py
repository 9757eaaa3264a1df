#!/usr/bin/env python3
"""Splits one-at-a-time transfers between two daemons on one host into hops, from the daemons'
hop trace (`RUST_LOG=tcpxd::hop=trace`; both logs share the host's clock).

    RUST_LOG=tcpxd::hop=trace tcpxctl bench transfer --sizes 4K --iters 300 --warmup 30 --keep-dir
    python3 benches/hops.py /tmp/tcpxd-bench-PID/bench-a.log /tmp/tcpxd-bench-PID/bench-b.log

With `tcpxctl bench transfer --blocks N` three kinds alternate (contiguous, the plain batch, the
block lists): `--every 3 --pick 1` splits the batches, `--every 3 --pick 2` the block transfers.

A is the daemon that issues the transfers (WRITE, eager or rendezvous; or READ), B its peer. For
each transfer of A the script finds, by the transfer id the control messages carry, the events
on both sides, and prints the p50 / p90 of each step between consecutive events (µs), and their
sum against A's own span (the client's call arriving → its answer leaving). The trace itself
costs a few µs per event (one write to the log per event): read the split, not the sum.

An event that happens several times in one transfer (a chunk's `poller.landed`, `poller.consumed`,
`lane.irecv` on each lane) counts once, at its first occurrence: with two chunks, "consumed →
irecv → out done" runs from the *first* chunk's consume, so it holds the other lane's landing and
unpack. `benches/lanes.py` splits a transfer lane by lane, raw beside the daemon.
"""

import argparse
import bisect
import datetime as dt
import re
import statistics
import sys
from collections import Counter, defaultdict

LINE = re.compile(r"^(\S+)\s+TRACE\s+.*?tcpxd::hop:\s*(.*)$")
# The recorder's form (TCPXD_HOP_RECORD, src/hop_record.rs): `<unix ns> HOP <thread> fields`.
REC = re.compile(r"^(\d+) HOP (\S+) (.*)$")
FIELD = re.compile(r'(\w+)=("([^"]*)"|\S+)')
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse(path):
    """(t_us, fields) per hop event, in file order."""
    out = []
    with open(path, errors="replace") as f:
        for raw in f:
            r = REC.match(raw)
            if r:
                fields = {k: (q if q is not None and v.startswith('"') else v) for k, v, q in FIELD.findall(r.group(3))}
                fields["thread"] = r.group(2)
                out.append((int(r.group(1)) / 1e3, fields))
                continue
            m = LINE.match(ANSI.sub("", raw.rstrip("\n")))
            if not m:
                continue
            t = dt.datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp() * 1e6
            fields = {k: (q if q is not None and v.startswith('"') else v) for k, v, q in FIELD.findall(m.group(2))}
            out.append((t, fields))
    return out


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(p / 100 * len(xs) + 0.5)) - 1))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a_log")
    ap.add_argument("b_log")
    ap.add_argument("--skip", type=int, default=10, help="transfers to leave out at the start (warm-up)")
    ap.add_argument(
        "--every",
        type=int,
        default=1,
        help="kinds that alternate transfer by transfer (`bench transfer --blocks N`: 3, contiguous, batch, blocks)",
    )
    ap.add_argument("--pick", type=int, default=0, help="with --every: which of them to split (0-based)")
    args = ap.parse_args()
    a, b = parse(args.a_log), parse(args.b_log)
    if not a or not b:
        sys.exit("no hop events: run the daemons with RUST_LOG=tcpxd::hop=trace")

    # A's transfers: the API's arrival (no id yet) is the last api.in before the poller took it.
    by_id = defaultdict(list)
    last_api_in = None
    loose = []  # events without a transfer id: placed by time below
    for t, f in a:
        hop, ident = f.get("hop"), f.get("id")
        if hop == "api.in":
            last_api_in = t
            continue
        if hop == "poller.cmd" and last_api_in is not None:
            by_id[ident].append(("A api.in", last_api_in))
        if ident is None or ident == "0":
            loose.append(("A " + hop, t))
            continue
        label = f"A {hop}" + (f" {f['kind']}" if "kind" in f and hop != "poller.cmd" else "")
        by_id[ident].append((label, t))
    # B's events about A's transfer ids (for a READ, the read id A sent).
    for t, f in b:
        hop, ident = f.get("hop"), f.get("id")
        if ident is None or ident == "0":
            loose.append(("B " + hop, t))
            continue
        if ident in by_id:
            label = f"B {hop}" + (f" {f['kind']}" if "kind" in f else "")
            by_id[ident].append((label, t))
    # One transfer at a time: an event without an id belongs to the transfer whose window (A's
    # api.in to api.out) holds it; its first such event of each kind is kept.
    windows = []
    for i, ev in by_id.items():
        d = dict(ev)
        if "A api.in" in d and "A api.out" in d:
            windows.append((d["A api.in"], d["A api.out"], i))
    windows.sort()
    starts = [w[0] for w in windows]
    for label, t in loose:
        k = bisect.bisect_right(starts, t) - 1
        if k >= 0 and windows[k][0] <= t <= windows[k][1]:
            i = windows[k][2]
            if label not in {l for l, _ in by_id[i]}:
                by_id[i].append((label, t))

    ids = sorted(by_id, key=lambda i: int(i))
    ids = [i for n, i in enumerate(ids) if n % args.every == args.pick][args.skip:]
    seqs = {i: sorted(by_id[i], key=lambda e: e[1]) for i in ids}
    # The most common order of events is the one split; transfers in another order are counted.
    common = Counter(tuple(l for l, _ in ev) for ev in seqs.values() if any(l == "A api.out" for l, _ in ev))
    if not common:
        sys.exit("no complete transfer found in the logs")
    order = list(common.most_common(1)[0][0])
    steps = defaultdict(list)
    spans = []
    for ev in seqs.values():
        if [l for l, _ in ev] != order:
            continue
        spans.append(dict(ev)["A api.out"] - dict(ev)["A api.in"])
        for (l0, t_0), (l1, t_1) in zip(ev, ev[1:]):
            steps[(l0, l1)].append(t_1 - t_0)
    if not spans:
        sys.exit("no complete transfer found in the logs")
    print(f"{len(spans)} of {len(ids)} transfers (after --skip {args.skip}) in the most common order of events")
    print(f"{'step':64} {'p50 µs':>8} {'p90 µs':>8}")
    total = 0.0
    for l0, l1 in zip(order, order[1:]):
        xs = steps[(l0, l1)]
        total += statistics.median(xs)
        print(f"{l0 + '  →  ' + l1:64} {statistics.median(xs):8.1f} {pct(xs, 90):8.1f}")
    print(f"{'sum of the step medians':64} {total:8.1f}")
    print(f"{'A api.in → A api.out (median)':64} {statistics.median(spans):8.1f} {pct(spans, 90):8.1f}")


if __name__ == "__main__":
    main()
