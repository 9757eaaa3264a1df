#!/usr/bin/env python3
"""Per-transfer timelines from two daemons' hop traces, one-at-a-time transfers (block or
contiguous WRITEs, e.g. `tcpxctl bench transfer --blocks N --block-size S --keep-dir` with
RUST_LOG=info,tcpxd::hop=trace,tcpxd::blocks=debug):

    python3 benches/transfer_timeline.py DIR/bench-a.log DIR/bench-b.log

One row per transfer of A (the sender), times in µs from the poller taking the command: the offer
out and in, the accept, the first receive posted (B), the first gather batch seen done and the
first send posted (A), the first and last receive completed (B), the last send done (A), the last
receive consumed and the done message (B), the transfer finished (A); then the gather and scatter
batches in the transfer's window. Both logs share the host's clock. benches/hops.py splits small
transfers hop by hop; this one shows where a large one's time goes.
"""
import re, sys, datetime as dt, statistics
ANSI = re.compile(r"\x1b\[[0-9;]*m")
def parse(p):
    out = []
    for raw in open(p, errors="replace"):
        s = ANSI.sub("", raw)
        if "tcpxd::hop" not in s and "batch done" not in s: continue
        ts = s.split()[0]
        try: t = dt.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() * 1e6
        except Exception: continue
        hop = re.search(r'hop="([^"]+)"', s); kind = re.search(r'kind="([^"]+)"', s); i = re.search(r' id=(\d+)', s)
        name = hop.group(1) if hop else ("gather" if "gather batch" in s else "scatter")
        us = re.search(r' us=(\d+)', s)
        out.append((t, name, kind.group(1) if kind else None, int(i.group(1)) if i else None, int(us.group(1)) if us else None))
    return out
a, b = parse(sys.argv[1]), parse(sys.argv[2])
cmds = [(t, i, k) for t, n, k, i, _ in a if n == "poller.cmd"]
rows = []
for j, (t0, tid, kind) in enumerate(cmds):
    t1 = cmds[j + 1][0] if j + 1 < len(cmds) else 1e30
    def first(ev, name, k=None, by_id=False, last=False):
        xs = [t for t, n, kk, i, _ in ev if n == name and (k is None or kk == k) and (i == tid if by_id else t0 - 50 <= t < t1)]
        return (max(xs) if last else min(xs)) - t0 if xs else float("nan")
    def cnt(ev, name):
        return [u for t, n, k, i, u in ev if n == name and t0 <= t < t1]
    r = dict(kind=kind, id=tid,
        A_offer_out=first(a, "wire.out", "offer", True), B_offer_in=first(b, "wire.in", "offer", True),
        B_accept_out=first(b, "wire.out", "accept", True), B_irecv1=first(b, "lane.irecv"),
        A_accept_in=first(a, "wire.in", "accept", True), A_gather1=first(a, "gather"), A_isend1=first(a, "lane.isend"),
        B_recv1=first(b, "poller.received"), A_sent_last=first(a, "poller.sent", last=True),
        B_recv_last=first(b, "poller.received", last=True), B_cons_last=first(b, "poller.consumed", last=True),
        B_done_out=first(b, "wire.out", "done", True), A_fin=first(a, "poller.finished", by_id=True))
    g, s = cnt(a, "gather"), cnt(b, "scatter")
    r["gathers"] = f"{len(g)}x p50 {statistics.median(g) if g else 0:.0f}"
    r["scatters"] = f"{len(s)}x p50 {statistics.median(s) if s else 0:.0f}"
    rows.append(r)
keys = [k for k in rows[0] if k not in ("kind", "id")]
print("kind id " + " ".join(keys))
for r in rows:
    print(r["kind"], r["id"], " ".join(f"{r[k]:.0f}" if isinstance(r[k], float) else r[k] for k in keys))
