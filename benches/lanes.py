#!/usr/bin/env python3
"""Lane by lane: when each chunk of a one-at-a-time transfer was posted, sent and received, for the
raw plugin path and for a daemon pair alike (issue #38: do the lanes of a 1 MiB transfer finish
apart, and does the daemon's plan, posting or polling make them finish further apart than raw's?).

    # raw: one process, its trace on stderr
    RUST_LOG=tcpxd::hop=trace tcpxctl bench raw --cuda 0 --sizes 1M --iters 200 2>raw.log
    python3 benches/lanes.py raw.log
    # a daemon pair: both daemons' logs (they share the host's clock)
    RUST_LOG=tcpxd::hop=trace tcpxctl bench transfer --cuda 0 --peer-cuda 1 --sizes 1M --keep-dir ...
    python3 benches/lanes.py /tmp/tcpxd-bench-PID/bench-a.log /tmp/tcpxd-bench-PID/bench-b.log

The events are the lane pass's own (`tcpxd::lanes`, the same code in the daemon's poller and in
the raw bench): `lane.isend` (a send posted), `lane.sent` (its `test` done), `lane.recvd` (a
receive's `test` done), each naming its comm. A transfer starts at `raw.start` (the raw sender
planned it) or `poller.cmd` (the daemon's poller took the client's command) and ends at `raw.end`
(the raw receiver consumed its last chunk) or at the daemon's `Done` out (a WRITE's receiver) /
`poller.finished` (the READ's reader). All times are µs after the transfer's first `lane.isend`;
p50 / p90 over the transfers (after --skip). Last, how many `Credits` messages (`poller.out
kind=credits`) went out before a transfer's end: credits returned mid-transfer, not in its `Done`.
"""

import argparse
import datetime as dt
import re
import statistics
import sys
from collections import Counter

LINE = re.compile(r"^(\S+)\s+TRACE\s+.*?tcpxd::hop:\s*(.*)$")
FIELD = re.compile(r'(\w+)=("([^"]*)"|\S+)')
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse(paths):
    out = []
    for path in paths:
        with open(path, errors="replace") as f:
            for raw in f:
                m = LINE.match(ANSI.sub("", raw.rstrip("\n")))
                if not m:
                    continue
                t = dt.datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp() * 1e6
                fields = {k: (q if v.startswith('"') else v) for k, v, q in FIELD.findall(m.group(2))}
                out.append((t, fields))
    out.sort(key=lambda e: e[0])
    return out


def label(f):
    return f.get("hop", "?") + (f" {f['kind']}" if "kind" in f else "")


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(p / 100 * len(xs) + 0.5)) - 1))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--skip", type=int, default=10, help="transfers to leave out at the start (warm-up)")
    args = ap.parse_args()
    events = parse(args.logs)
    starts = [i for i, (_, f) in enumerate(events) if f.get("hop") in ("raw.start", "poller.cmd")]
    if not starts:
        sys.exit("no raw.start / poller.cmd events: run with RUST_LOG=tcpxd::hop=trace")
    rows = []
    for k, i in enumerate(starts):
        j = starts[k + 1] if k + 1 < len(starts) else len(events)
        window = events[i:j]
        isends = [t for t, f in window if f.get("hop") == "lane.isend"]
        if not isends:
            continue
        t0 = isends[0]
        sent = [(t - t0, f.get("comm")) for t, f in window if f.get("hop") == "lane.sent"]
        recvd = [(t - t0, f.get("comm")) for t, f in window if f.get("hop") == "lane.recvd"]
        ends = [
            t - t0
            for t, f in window
            if f.get("hop") in ("raw.end", "poller.finished")
            or (f.get("hop") == "poller.out" and f.get("kind") == "done")
        ]
        if not recvd or not ends or len(sent) != len(isends) or len(recvd) != len(isends):
            continue
        # The end: the first end event after the last receive completed (a WRITE's `Done` out
        # before the sender's `poller.finished`).
        t_last = max(recvd)[0] + t0
        ends = [e for e in ends if e + t0 >= t_last][:1]
        if not ends:
            continue
        # `Credits` messages sent before the end (a daemon's receiver returning credits
        # mid-transfer instead of in the `Done`: session 27, wcredit).
        mid_credits = sum(
            1
            for t, f in window
            if f.get("hop") == "poller.out" and f.get("kind") == "credits" and t - t0 < ends[-1]
        )
        # What followed the last receive's completion, up to the end: the receiver's steps.
        tail = [
            (t - t0, label(f))
            for t, f in window
            if t_last <= t <= ends[-1] + t0 and f.get("hop") not in ("lane.sent", "lane.isend")
        ]
        rows.append(
            {
                "chunks": len(isends),
                "posted last": isends[-1] - t0,
                "first sent": min(sent)[0],
                "last sent": max(sent)[0],
                "first received": min(recvd)[0],
                "last received": max(recvd)[0],
                "received apart (last − first)": max(recvd)[0] - min(recvd)[0],
                "last received → end": ends[-1] - max(recvd)[0],
                "first isend → end": ends[-1],
                "first comm": min(recvd)[1],
                "mid credits": mid_credits,
                "tail": tail,
            }
        )
    rows = rows[args.skip :]
    if not rows:
        sys.exit("no complete transfer found (every chunk posted, sent and received)")
    print(f"{len(rows)} transfers, chunks per transfer: {dict(Counter(r['chunks'] for r in rows))}")
    print(f"{'µs after the first lane.isend':36} {'p50':>8} {'p90':>8}")
    for key in rows[0]:
        if key in ("chunks", "first comm", "tail", "mid credits"):
            continue
        xs = [r[key] for r in rows]
        print(f"{key:36} {statistics.median(xs):8.1f} {pct(xs, 90):8.1f}")
    # The receiver's steps from the last receive's completion to the end, in the most common order.
    orders = Counter(tuple(l for _, l in r["tail"]) for r in rows)
    order, n = orders.most_common(1)[0]
    print(f"from the last lane.recvd to the end ({n} of {len(rows)} transfers in this order):")
    same = [r["tail"] for r in rows if tuple(l for _, l in r["tail"]) == order]
    for k in range(1, len(order)):
        xs = [tail[k][0] - tail[k - 1][0] for tail in same]
        print(f"  {order[k - 1] + '  →  ' + order[k]:52} {statistics.median(xs):8.1f} {pct(xs, 90):8.1f}")
    mid = [r["mid credits"] for r in rows]
    print(
        f"Credits messages before the end: {sum(mid)} in {sum(1 for m in mid if m)} of {len(rows)} transfers"
        " (a receiver returning credits mid-transfer, not in its Done)"
    )
    firsts = Counter(r["first comm"] for r in rows)
    print("comm whose receive completed first:", ", ".join(f"{c}: {n}" for c, n in firsts.most_common()))


if __name__ == "__main__":
    main()
