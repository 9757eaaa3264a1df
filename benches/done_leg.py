#!/usr/bin/env python3
"""A WRITE receiver's end, from its hop trace (`RUST_LOG=tcpxd::hop=trace`, one transfer at a
time): for each `Done` it sent, µs from the last chunk consumed before it (`poller.consumed`) to
the `Done` framed (`poller.out kind="done"`) and to its write (`poller.flush`), and whether a
credit receive was posted again (`lane.irecv`) in between — issue #38, session 31: the `Done` goes
on the wire before the re-posts.

    python3 benches/done_leg.py DIR/bench-b.log [--skip 10]
"""
import argparse
import datetime as dt
import re
import statistics

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def stamp(line):
    ts = ANSI.sub("", line).split()[0]
    return dt.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log")
    ap.add_argument("--skip", type=int, default=10, help="the first Dones left out (warm-up)")
    args = ap.parse_args()
    framed, wired, behind = [], [], []
    consumed = done = None
    reposted = False
    for line in open(args.log, errors="replace"):
        if "tcpxd::hop" not in line:
            continue
        if 'hop="poller.consumed"' in line:
            consumed, reposted = stamp(line), False
        elif 'hop="lane.irecv"' in line:
            reposted = True
        elif 'hop="poller.out"' in line and 'kind="done"' in line and done is None:
            done = (stamp(line), reposted)
        elif 'hop="poller.flush"' in line and done is not None:
            if consumed is not None:
                framed.append(done[0] - consumed)
                wired.append(stamp(line) - consumed)
                behind.append(done[1] or reposted)
            done = None
    framed, wired, behind = framed[args.skip:], wired[args.skip:], behind[args.skip:]
    if not framed:
        print(f"{args.log}: no Done traced")
        return

    def q(xs, p):
        return sorted(xs)[int(p * (len(xs) - 1))]

    print(f"{args.log}: {len(framed)} Dones; last consume -> Done framed p50 {statistics.median(framed):.1f} "
          f"p90 {q(framed, 0.9):.1f} µs, -> on the wire p50 {statistics.median(wired):.1f} p90 {q(wired, 0.9):.1f} µs; "
          f"behind a re-post: {sum(behind)} of {len(behind)}")


if __name__ == "__main__":
    main()
