#!/usr/bin/env python3
"""Issue #38 at 1 MiB one at a time (session 33, onemib4): the raw plugin path and a daemon pair
split into the same legs, and the difference leg by leg — where the daemon's time over raw's goes.

    # raw (one process, its hop trace on stderr)
    RUST_LOG=tcpxd::hop=trace tcpxctl bench raw --cuda 0 --sizes 1M --iters 200 2>raw.log
    # a daemon pair, the client's own `bench.send` / `bench.answer` on tcpxctl's stderr
    RUST_LOG=tcpxd::hop=trace tcpxctl bench transfer --via local --op write --cuda 0 --peer-cuda 1 \\
        --sizes 1M --iters 200 --keep-dir 2>write.log
    python3 benches/legs.py --raw raw.log --daemon write write.log DIR/bench-a.log DIR/bench-b.log \\
        [--daemon read read.log DIR2/bench-a.log DIR2/bench-b.log]

Each transfer runs from its start (raw: `raw.start`, the sender planned it; daemon: the client's
`bench.send`, its request handed to the session) to its end (raw: `raw.end`, the receiver consumed
its last chunk; daemon: `bench.answer`, the client read its answer): the span both benches time.
Marks in between, µs after the start, p50 over the transfers (after --skip):
  first isend, last isend (posted), first / last sent (the send's `test` done), first / last recvd
  (the receive's `test` done), last unpacked (the last `stage.done`, or the last consumed chunk),
and the daemon's own (api.in, poller.cmd, the READ's request out and in, the receiver's `Done` out,
the initiator's `poller.finished`, api.out). The legs table prints each leg's p50 for raw and each
daemon run and the difference; the legs' p50s need not add to the whole's p50 (medians).
A leg is the time between consecutive marks of one transfer. All logs share the host's clock.
"""

import argparse
import datetime as dt
import gzip
import re
import statistics
import sys

LINE = re.compile(r"^(\S+)\s+TRACE\s+.*?tcpxd::hop:\s*(.*)$")
REC = re.compile(r"^(\d+) HOP (\S+) (.*)$")
FIELD = re.compile(r'(\w+)=("([^"]*)"|\S+)')
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse(paths):
    out = []
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", errors="replace") as f:
            for raw in f:
                r = REC.match(raw)
                if r:
                    t, body = int(r.group(1)) / 1e3, r.group(3)
                else:
                    m = LINE.match(ANSI.sub("", raw.rstrip("\n")))
                    if not m:
                        continue
                    t = dt.datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp() * 1e6
                    body = m.group(2)
                fields = {k: (q if v.startswith('"') else v) for k, v, q in FIELD.findall(body)}
                out.append((t, fields))
    out.sort(key=lambda e: e[0])
    return out


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(round(p / 100 * len(xs) + 0.5)) - 1))]


def first(window, hop, kind=None, after=None):
    for t, f in window:
        if f.get("hop") == hop and (kind is None or f.get("kind") == kind) and (after is None or t >= after):
            return t
    return None


def last(window, hop, kind=None):
    ts = [t for t, f in window if f.get("hop") == hop and (kind is None or f.get("kind") == kind)]
    return ts[-1] if ts else None


def transfers(events, start_hop, end_hop, key):
    """(start time, window of events up to and including the end) per transfer."""
    starts = {}
    out = []
    idx = {}
    for i, (t, f) in enumerate(events):
        h = f.get("hop")
        if h == start_hop:
            starts[f.get(key)] = i
        elif h == end_hop and f.get(key) in starts:
            i0 = starts.pop(f.get(key))
            idx[f.get(key)] = (i0, i)
    for k in sorted(idx, key=lambda k: idx[k][0]):
        i0, i1 = idx[k]
        out.append(events[i0 : i1 + 1])
    return out


def marks(window, daemon):
    """Named marks (µs after the start) of one transfer, in order; None where one is missing."""
    t0 = window[0][0]
    isends = [t for t, f in window if f.get("hop") == "lane.isend"]
    sent = [t for t, f in window if f.get("hop") == "lane.sent"]
    recvd = [t for t, f in window if f.get("hop") == "lane.recvd"]
    if not isends or not recvd:
        return None
    t_last_recvd = recvd[-1]
    after = [(t, f) for t, f in window if t >= t_last_recvd]
    unpacked = last(after, "stage.done") or last(after, "poller.consumed") or last(after, "lanes.consumed")
    m = {}
    if daemon:
        m["api.in"] = first(window, "api.in")
        m["poller.cmd"] = first(window, "poller.cmd")
        rr = first(window, "poller.out", "read_request")
        if rr is not None:
            m["read_request out"] = rr
            m["read_request in"] = first(window, "poller.in", "read_request", after=rr)
    m["first isend"] = isends[0]
    m["last isend"] = isends[-1]
    if sent:
        m["first sent"] = min(sent)
        m["last sent"] = max(sent)
    m["first recvd"] = recvd[0]
    m["last recvd"] = t_last_recvd
    m["last unpacked"] = unpacked if unpacked is not None else t_last_recvd
    if daemon and m.get("read_request out") is None:
        # A WRITE's receiver tells the initiator its bytes are in place (a READ's initiator is
        # the receiver: its `Done` to the peer follows its own `poller.finished`).
        done = first(window, "poller.out", "done", after=t_last_recvd)
        if done is not None:
            m["done out"] = done
            m["done in"] = first(window, "poller.in", "done", after=done)
    if daemon:
        m["poller.finished"] = first(window, "poller.finished", after=t_last_recvd)
        m["api.out"] = first(window, "api.out", after=t_last_recvd)
    m["end"] = window[-1][0]
    return {k: (v - t0 if v is not None else None) for k, v in m.items()}, len(isends)


# The legs both paths have, each from one mark to the next (the daemon's own marks inside).
COMMON = [
    ("start → first isend", "start", "first isend"),
    ("first isend → last isend (posting)", "first isend", "last isend"),
    ("first isend → last sent", "first isend", "last sent"),
    ("first isend → first recvd", "first isend", "first recvd"),
    ("first isend → last recvd (data phase)", "first isend", "last recvd"),
    ("last recvd → last unpacked", "last recvd", "last unpacked"),
    ("last unpacked → end", "last unpacked", "end"),
    ("whole (start → end)", "start", "end"),
]


def legs_of(rows, a, b):
    xs = []
    for m in rows:
        ta = 0.0 if a == "start" else m.get(a)
        tb = m.get(b)
        if ta is not None and tb is not None:
            xs.append(tb - ta)
    return xs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--raw", action="append", default=[], help="a raw bench's trace (several: pooled)")
    ap.add_argument(
        "--daemon",
        nargs="+",
        action="append",
        default=[],
        metavar=("NAME", "LOG"),
        help="a name, then the client's trace and both daemons' logs (repeat for more runs)",
    )
    ap.add_argument(
        "--skip", type=int, default=20, help="transfers to leave out at each trace's start (the bench's --warmup)"
    )
    args = ap.parse_args()
    runs = []  # (name, rows)
    if args.raw:
        rows = []
        for path in args.raw:
            ev = parse([path])
            got = [marks(w, False) for w in transfers(ev, "raw.start", "raw.end", "id")]
            rows += [g[0] for g in got if g][args.skip :]
        runs.append(("raw", rows))
    # Runs given the same name are pooled (each parsed apart: rounds of one kind).
    pooled = {}
    for spec in args.daemon:
        name, paths = spec[0], spec[1:]
        ev = parse(paths)
        got = [marks(w, True) for w in transfers(ev, "bench.send", "bench.answer", "tag")]
        pooled.setdefault(name, []).extend([g[0] for g in got if g][args.skip :])
    runs += list(pooled.items())
    if not runs or not any(rows for _, rows in runs):
        sys.exit("no complete transfer found (run with RUST_LOG=tcpxd::hop=trace)")
    names = [n for n, _ in runs]
    base = runs[0][1] if names[0] == "raw" else None
    print("transfers: " + ", ".join(f"{n} {len(r)}" for n, r in runs))
    w = max(10, 2 + max(len(n) for n in names))
    head = f"{'leg (p50 µs)':40}" + "".join(f"{n:>{w}}" for n in names)
    if base is not None:
        head += "".join(f"{n + ' − raw':>{w + 6}}" for n in names[1:])
    print(head)
    for label, a, b in COMMON:
        p = []
        for _, rows in runs:
            xs = legs_of(rows, a, b)
            p.append(statistics.median(xs) if xs else None)
        line = f"{label:40}" + "".join(f"{x:{w}.1f}" if x is not None else f"{'-':>{w}}" for x in p)
        if base is not None:
            line += "".join(
                f"{x - p[0]:+{w + 6}.1f}" if x is not None and p[0] is not None else f"{'-':>{w + 6}}"
                for x in p[1:]
            )
        print(line)
    # The daemon's own marks, consecutive legs in the order they happen.
    for name, rows in runs:
        if name == "raw" or not rows:
            continue
        keys = {k for m in rows for k in m if m[k] is not None}
        at_p50 = {k: statistics.median([m[k] for m in rows if m.get(k) is not None]) for k in keys}
        order = sorted(keys, key=lambda k: at_p50[k])
        print(f"{name}: consecutive marks (p50 / p90 µs of each leg; p50 of the mark after the start)")
        prev = "start"
        for k in order:
            xs = legs_of(rows, prev, k)
            at = [m[k] for m in rows if m.get(k) is not None]
            if xs:
                print(
                    f"  {prev + ' → ' + k:44} {statistics.median(xs):8.1f} {pct(xs, 90):8.1f}"
                    f"   at {statistics.median(at):8.1f}"
                )
            prev = k


if __name__ == "__main__":
    main()
