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

A copy on a helper (session 24: its clock rides `poller.gathered` / `poller.consumed`) splits
into **helper wait** (queued → a helper started it), **copy** (its copying, all parts) and
**unseen** (done → the poller posted the send, or consumed the receive: the window, or an
older chunk of the lane still copying). The gather's **unseen** is split further (session 28, `gather unseen: window / older /
poller`, p50 and mean over chunks): from its gather done to its send posted, the time the plugin
held `--send-window` of the comm's sends (**window**: gathering ahead working as meant), the
time the plugin had room but an older gather of the comm was not done (**older**: sends go in
ring order, the plugin matches the k-th send to the k-th receive), and the rest (**poller**: not
seen yet). **send held by ring order per lane** is the share of the data phase a lane had room in
the plugin and a gather done but held behind an older one: what posting sends in the order
their gathers finish could add at most. **last send done → last received** (µs, p50 over
transfers): how long after the sender's last send completed (the plugin holding its bytes) the
receiver's last receive completed — long, and the transfer is the receiver's (the sender's bytes
wait in the sockets), whatever order the sender posts in. **starved: …** splits the share of the data phase a
lane's plugin held fewer than `--starved` sends by what the lane's next send was doing: nothing
granted (the engine had no chunk for the lane: start and tail), its gather's helper wait, its
copying (of those two, "a later one done": a later gather of the lane was done, which posting in
finishing order would have sent), or done and unseen. Then **per lane** (each comm; the mean over lanes and
the worst lane), over each data phase: the lane's **slots held** (sender: a send granted by the
engine, `poller.gather` or a plain `lane.isend`, until `poller.sent`, of `send_window +
gather_ahead`; receiver: `poller.recv_slot` until `poller.consumed`, of `recv_window +
scatter_ahead`), how many it had **in the plugin**, and the share of the data phase it had
fewer than `--starved` (4: the plugin's sockets per comm, `NCCL_NSOCKS_PERTHREAD`, each
moving whole 512 KiB chunks) in the plugin: sockets with nothing to move.
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


def p90(xs):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))]


def levels(events, side, ups, downs, plain_isend=False):
    """Per comm of `side`, the level (ups seen minus downs seen) as [(t, level after t)], in time
    order. With `plain_isend`, a `lane.isend` counts up only when no `poller.gathered` follows it
    on its comm (a plain send; a staged one was counted at its `poller.gather`)."""
    steps = defaultdict(list)
    last_isend = {}
    for t, f in events:
        if f["side"] != side or f.get("comm") is None:
            continue
        c, h = f["comm"], f["hop"]
        if plain_isend and c in last_isend:
            # Decided at the comm's next event: staged when it is that send's `poller.gathered`.
            t0 = last_isend.pop(c)
            if h != "poller.gathered":
                steps[c].append((t0, 1))
        if plain_isend and h == "lane.isend":
            last_isend[c] = t
            continue
        if h in ups:
            steps[c].append((t, 1))
        elif h in downs:
            steps[c].append((t, -1))
    for c, t0 in last_isend.items():
        steps[c].append((t0, 1))
    out = {}
    for c, st in steps.items():
        st.sort(key=lambda x: x[0])
        lvl, series = 0, []
        for t, d in st:
            lvl += d
            series.append((t, lvl))
        out[c] = series
    return out


def level_stats(series, lo, hi, below):
    """Time-averaged level over [lo, hi] and the share of it spent under `below`."""
    if hi <= lo or not series:
        return None
    times = [t for t, _ in series]
    i = bisect.bisect_right(times, lo) - 1
    lvl = series[i][1] if i >= 0 else 0
    t, area, under = lo, 0.0, 0.0
    for t1, l1 in series[i + 1 :]:
        if t1 >= hi:
            break
        area += lvl * (t1 - t)
        under += (t1 - t) if lvl < below else 0.0
        t, lvl = t1, l1
    area += lvl * (hi - t)
    under += (hi - t) if lvl < below else 0.0
    return area / (hi - lo), under / (hi - lo)


def copy_times(events, hop):
    """(t, wait_us, copy_us, since_us) of each `hop` carrying a helper's clock."""
    out = []
    for t, f in events:
        if f["hop"] != hop or "copy_us" not in f:
            continue
        w, c, u = int(f["wait_us"]), int(f["copy_us"]), int(f["since_us"])
        if w or c or u:
            out.append((t, w, c, u))
    return out


def gather_blame(events, window):
    """Per sending comm, each staged send's wait from its gather done to its post, split by what
    held it at each moment: **window** (the plugin held `window` of the comm's sends), **older**
    (room in the plugin, but an older gather of the comm not done: sends go in ring order) and
    **poller** (nothing held it but the poller not looking yet). Returns ({comm: [(done, posted,
    window_us, older_us, poller_us)]}, {comm: [(t0, t1)] spans where the plugin had room, a
    gather was done and an older one was not: a send that posting in finishing order would have
    added}). Times in µs."""
    plugin = defaultdict(list)  # comm -> [(t, +1/-1)]
    staged = defaultdict(list)  # comm -> [(done, posted)] in posting order
    side_of = {}
    for t, f in events:
        c = f.get("comm")
        if c is None:
            continue
        h = f["hop"]
        if h == "lane.isend":
            plugin[(f["side"], c)].append((t, 1))
        elif h == "poller.sent":
            plugin[(f["side"], c)].append((t, -1))
        elif h == "poller.gathered" and "since_us" in f:
            staged[(f["side"], c)].append((t - int(f["since_us"]), t))
            side_of[c] = f["side"]
    blame, held = {}, {}
    for key, chunks in staged.items():
        steps = sorted(plugin.get(key, []))
        # Every moment where something changes: plugin level steps, gathers done, posts.
        marks = sorted(set([t for t, _ in steps] + [d for d, _ in chunks] + [p for _, p in chunks]))
        lvl_at = []
        lvl, j = 0, 0
        for m in marks:
            while j < len(steps) and steps[j][0] <= m:
                lvl += steps[j][1]
                j += 1
            lvl_at.append(lvl)
        rows, spans = [], []
        for k, (done, posted) in enumerate(chunks):
            w = o = q = 0.0
            i = bisect.bisect_left(marks, done)
            while i + 1 < len(marks) and marks[i] < posted:
                t0, t1 = marks[i], min(marks[i + 1], posted)
                if lvl_at[i] >= window:
                    w += t1 - t0
                elif any(d > t0 and p > t0 for d, p in chunks[max(0, k - 64) : k]):
                    o += t1 - t0
                    spans.append((t0, t1))
                else:
                    q += t1 - t0
                i += 1
            rows.append((done, posted, w, o, q))
        blame[key[1]] = rows
        # Merge overlapping spans (several chunks held at once count once).
        spans.sort()
        merged = []
        for t0, t1 in spans:
            if merged and t0 <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], t1))
            else:
                merged.append((t0, t1))
        held[key[1]] = merged
    return blame, held


STARVED_PARTS = ("nothing granted", "helper wait", "copying", "a later one done", "unseen")


def starved_blame(events, below):
    """Per sending comm, the spans its plugin held fewer than `below` sends, each moment blamed
    on the lane's next send (its oldest staged chunk not posted yet): **nothing granted** (no
    chunk of the lane waiting: the engine had none, a transfer's start or tail), its gather
    waiting for a **helper**, **copying**, done but not posted (**unseen**: the poller), and,
    of the helper wait and copying, the part a later gather of the lane was done already
    (**a later one done**: what posting in finishing order would have filled). Returns {comm:
    [(t0, t1, part)]}."""
    queued = defaultdict(list)
    gathered = defaultdict(list)
    plugin = defaultdict(list)
    for t, f in events:
        c = f.get("comm")
        if c is None:
            continue
        key, h = (f["side"], c), f["hop"]
        if h == "poller.gather":
            queued[key].append(t)
        elif h == "poller.gathered":
            w, cp, u = (int(f.get(x, 0)) for x in ("wait_us", "copy_us", "since_us"))
            gathered[key].append((t, w, cp, u))
        elif h == "lane.isend":
            plugin[key].append((t, 1))
        elif h == "poller.sent":
            plugin[key].append((t, -1))
    out = {}
    for key, qs in queued.items():
        gs = gathered.get(key, [])
        chunks = []  # (queued, started, done, posted)
        for q, (p, w, cp, u) in zip(qs, gs):
            done = p - u
            started = q + w if (w or cp or u) else done
            chunks.append((q, min(started, done), done, p))
        steps = sorted(plugin.get(key, []))
        marks = sorted(set([t for t, _ in steps] + [x for ch in chunks for x in ch]))
        spans = []
        lvl, j, posted = 0, 0, 0
        for i, m in enumerate(marks[:-1]):
            while j < len(steps) and steps[j][0] <= m:
                lvl += steps[j][1]
                j += 1
            while posted < len(chunks) and chunks[posted][3] <= m:
                posted += 1
            if lvl >= below:
                continue
            t1 = marks[i + 1]
            nxt = posted
            if nxt >= len(chunks) or chunks[nxt][0] > m:
                part = "nothing granted"
            else:
                q, st, dn, _ = chunks[nxt]
                later_done = any(c[2] <= m for c in chunks[nxt + 1 : nxt + 64] if c[0] <= m)
                if m < dn and later_done:
                    part = "a later one done"
                elif m < st:
                    part = "helper wait"
                elif m < dn:
                    part = "copying"
                else:
                    part = "unseen"
            spans.append((m, t1, part))
        out[key[1]] = spans
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a_log")
    ap.add_argument("b_log")
    ap.add_argument("--skip", type=int, default=2, help="transfers to leave out at the start (warm-up)")
    ap.add_argument("--every", type=int, default=2, help="kinds that alternate transfer by transfer")
    ap.add_argument("--names", default="contiguous,blocks", help="names of the kinds, in their order")
    ap.add_argument("--starved", type=int, default=4, help="a lane with fewer in the plugin is starved")
    ap.add_argument("--send-window", type=int, default=12, help="the senders' transfer.send_window")
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

    lane_levels = {
        "send slots held": levels(events, "a", {"poller.gather"}, {"poller.sent"}, plain_isend=True),
        "send in plugin": levels(events, "a", {"lane.isend"}, {"poller.sent"}),
        "recv slots held": levels(events, "b", {"poller.recv_slot"}, {"poller.consumed"}),
        "recv in plugin": levels(
            events, "b", {"lane.irecv"}, {"poller.received", "poller.dropped", "poller.landed"}
        ),
    }
    # A READ: A receives, B sends (B posts no data receives, A no data sends).
    for k in ("send slots held", "send in plugin"):
        if not lane_levels[k]:
            lane_levels[k] = levels(
                events, "b", {"poller.gather"} if "slots" in k else {"lane.isend"}, {"poller.sent"},
                plain_isend="slots" in k,
            )
    for k, ups, downs in (
        ("recv slots held", {"poller.recv_slot"}, {"poller.consumed"}),
        ("recv in plugin", {"lane.irecv"}, {"poller.received", "poller.dropped", "poller.landed"}),
    ):
        if not lane_levels[k]:
            lane_levels[k] = levels(events, "a", ups, downs)
    gathered = copy_times(events, "poller.gathered")
    blame, held = gather_blame(events, args.send_window)
    starved = starved_blame(events, args.starved)
    scattered = copy_times(events, "poller.consumed")

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
        # The sender's last send done (the plugin took its bytes) → the receiver's last receive
        # done: how far the receiver trails. Long, and the sender's sends are not what bounds the
        # transfer (its bytes wait in the sockets for the receiver).
        sent = [s[1] for s in spans.get("send in plugin", [])]
        got = [s[1] for s in spans.get("recv in plugin", [])]
        row["last send done → last received"] = (max(got) - max(sent)) if sent and got else 0.0
        for name in steps:
            v = spans.get(name, [])
            row[f"{name} p50"] = med([t1 - t0 for t0, t1 in v]) if v else 0.0
            row[f"{name} at once"] = occupancy(v, d0, d1)
        for what, got in (("gather", gathered), ("scatter", scattered)):
            mine = [x for x in got if d0 <= x[0] <= d1 + 1]
            for j, part in enumerate(("helper wait", "copy", "unseen")):
                xs = [x[1 + j] for x in mine]
                row[f"{what} {part} p50"] = med(xs) if xs else 0.0
                row[f"{what} {part} p90"] = p90(xs) if xs else 0.0
        # A finished gather's wait to be posted, split (see gather_blame), p50 over its chunks;
        # and per lane the share of the data phase a later gather was done, the plugin had
        # room and the ring's order held it back.
        mine = [r for rows in blame.values() for r in rows if d0 <= r[1] <= d1 + 1]
        for j, part in enumerate(("window", "older", "poller")):
            xs = [r[2 + j] for r in mine]
            row[f"gather unseen: {part} p50"] = med(xs) if xs else 0.0
            row[f"gather unseen: {part} mean"] = statistics.mean(xs) if xs else 0.0
        shares = []
        for c, spans_c in held.items():
            if not any(d0 <= r[1] <= d1 for r in blame.get(c, [])):
                continue
            got = sum(max(0.0, min(t1, d1) - max(t0, d0)) for t0, t1 in spans_c)
            shares.append(got / (d1 - d0) if d1 > d0 else 0.0)
        row["send held by ring order per lane"] = statistics.mean(shares) if shares else 0.0
        # A lane's plugin under `--starved` sends: what its next send was doing, share of the
        # data phase (mean over the lanes that sent staged chunks in it).
        per_part = defaultdict(list)
        for c, spans_c in starved.items():
            if not any(d0 <= r[1] <= d1 for r in blame.get(c, [])):
                continue
            got = defaultdict(float)
            for t0, t1, part in spans_c:
                got[part] += max(0.0, min(t1, d1) - max(t0, d0))
            for part in STARVED_PARTS:
                per_part[part].append(got[part] / (d1 - d0) if d1 > d0 else 0.0)
        for part in STARVED_PARTS:
            xs = per_part[part]
            row[f"starved: {part}"] = statistics.mean(xs) if xs else 0.0
        for name, per_comm in lane_levels.items():
            got = [level_stats(sr, d0, d1, args.starved) for sr in per_comm.values()]
            got = [g for g in got if g and g[0] > 0.05]
            row[f"{name} per lane"] = statistics.mean(g[0] for g in got) if got else 0.0
            row[f"{name} worst lane"] = min(g[0] for g in got) if got else 0.0
            if "in plugin" in name:
                row[f"{name} time < {args.starved}"] = max(g[1] for g in got) if got else 0.0
        kinds[kind].append(row)

    if not kinds:
        print("no transfers found (were the daemons run with RUST_LOG=tcpxd::hop=trace?)")
        return
    order = [n for n in names if n in kinds] + [k for k in kinds if k not in names]
    print(f"{'µs (p50 over transfers)':<34}" + "".join(f"{k:>14}" for k in order))
    print(f"{'transfers':<34}" + "".join(f"{len(kinds[k]):>14}" for k in order))
    keys = ["transfer", "before data", "data phase", "after data", "chunks", "last send done → last received"]
    for name in steps:
        keys += [f"{name} p50", f"{name} at once"]
    for what in ("gather", "scatter"):
        for part in ("helper wait", "copy", "unseen"):
            keys += [f"{what} {part} p50", f"{what} {part} p90"]
    for part in ("window", "older", "poller"):
        keys += [f"gather unseen: {part} p50", f"gather unseen: {part} mean"]
    keys.append("send held by ring order per lane")
    keys += [f"starved: {part}" for part in STARVED_PARTS]
    for name in lane_levels:
        keys += [f"{name} per lane", f"{name} worst lane"]
        if "in plugin" in name:
            keys.append(f"{name} time < {args.starved}")
    for key in keys:
        vals = [med([r.get(key, 0.0) for r in kinds[k]]) for k in order]
        fmt = "{:>14.0f}"
        if key.endswith(("at once", "lane")):
            fmt = "{:>14.2f}"
        elif f"< {args.starved}" in key or key.startswith(("send held by ring order", "starved: ")):
            fmt = "{:>13.0f}%"
            vals = [100 * v for v in vals]
        print(f"{key:<34}" + "".join(fmt.format(v) for v in vals))


if __name__ == "__main__":
    main()
