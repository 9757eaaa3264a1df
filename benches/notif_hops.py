#!/usr/bin/env python3
"""The notification round trip's daemon-to-daemon legs hop by hop (session 28, ping), from the
two daemons' hop traces that `benches/api_legs.py --only notif --keep` leaves (both logs share the
host's clock). For each direction (the ping a → b, the pong b → a), by the transfer id the header
carries:

    sender:   poller.cmd → poller.out (header framed) → poller.flush (its `send`)
    receiver: poller.read (the `recv` before its wire.in) → wire.in (decoded) → poller.in (the
              engine's key check) → poller.out (Done framed) → api.notify (the notification
              published: the feed's board slot and event follow) → poller.flush (the Done sent)

and prints each step's p50 / p90 (µs) and the whole `poller.cmd → api.notify`, which is
api_legs.py's "the ping between the daemons". Every hop event costs the daemon a formatted log
line (a `write` to its log): `--events` prints how many each round trip has, and with
`--untraced-p50 US` (the round trip's p50 from `api_legs.py --no-trace`, same daemon) the
trace's cost per event, (traced p50 − untraced p50) ÷ events — read each step net of its own
events.

    PYTHONPATH=python/src python3 benches/api_legs.py --tcpxd target/release/tcpxd --only notif --keep
    python3 benches/notif_hops.py /tmp/tcpxd-api-legs-XXXX/legs-a.log /tmp/tcpxd-api-legs-XXXX/legs-b.log
"""

from __future__ import annotations

import argparse
import bisect
import os
import sys
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hops  # noqa: E402  (the hop trace's log format, parsed once)

Events = List[Tuple[float, Dict[str, str]]]

STEPS = [
    "cmd → out (sender: the engine's start, header framed)",
    "out → flush (sender: the rest of the batch, then its send)",
    "flush → peer's read (loopback, the receiver's next look)",
    "read → wire.in (receiver: frame decoded)",
    "wire.in → poller.in (to the engine)",
    "poller.in → Done framed (the key check)",
    "Done framed → api.notify (the broadcast, the inline delivery)",
    "api.notify → Done flushed (board slot, event, the send)",
    "TOTAL cmd → api.notify",
]


def index(ev: Events) -> Tuple[Dict[Tuple[str, Optional[str], Optional[str]], float], List[float], List[float]]:
    """The first time of each (hop, kind, id), and the times of every flush and read."""
    first: Dict[Tuple[str, Optional[str], Optional[str]], float] = {}
    flushes: List[float] = []
    reads: List[float] = []
    for t, f in ev:
        h = f.get("hop", "")
        if h == "poller.flush":
            flushes.append(t)
        elif h == "poller.read":
            reads.append(t)
        first.setdefault((h, f.get("kind"), f.get("id")), t)
    return first, flushes, reads


def after(xs: List[float], t: float) -> Optional[float]:
    i = bisect.bisect_left(xs, t)
    return xs[i] if i < len(xs) else None


def before(xs: List[float], t: float) -> Optional[float]:
    i = bisect.bisect_right(xs, t)
    return xs[i - 1] if i else None


def legs(a: Events, b: Events, skip: int) -> Dict[str, Dict[str, List[float]]]:
    ia, fa, ra = index(a)
    ib, fb, rb = index(b)
    out: Dict[str, Dict[str, List[float]]] = {}
    for name, (sx, sf, rx, rr, rf) in (("ping a → b", (ia, fa, ib, rb, fb)), ("pong b → a", (ib, fb, ia, ra, fa))):
        got: Dict[str, List[float]] = {s: [] for s in STEPS}
        ids = sorted(int(k[2]) for k in sx if k[0] == "poller.cmd" and k[1] == "write" and k[2] is not None)
        for i in ids[skip:]:
            s = str(i)
            cmd, hdr = sx.get(("poller.cmd", "write", s)), sx.get(("poller.out", "header", s))
            win, pin = rx.get(("wire.in", "header", s)), rx.get(("poller.in", "header", s))
            done, note = rx.get(("poller.out", "done", s)), rx.get(("api.notify", None, s))
            if cmd is None or hdr is None or win is None or pin is None or done is None or note is None:
                continue
            fl, rd, fl2 = after(sf, hdr), before(rr, win), after(rf, note)
            if fl is None or rd is None or fl2 is None:
                continue
            for step, v in zip(STEPS, (hdr - cmd, fl - hdr, rd - fl, win - rd, pin - win, done - pin, note - done,
                                       fl2 - note, note - cmd)):
                if 0 <= v < 100_000:
                    got[step].append(v)
        out[name] = got
    return out


def pct(xs: List[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a_log")
    ap.add_argument("b_log")
    ap.add_argument("--skip", type=int, default=50, help="round trips left out at the start (warm-up)")
    ap.add_argument("--traced-p50", type=float, help="the traced run's round trip p50 (µs)")
    ap.add_argument("--untraced-p50", type=float, help="the same daemon's untraced round trip p50 (µs)")
    a = ap.parse_args()
    ea, eb = hops.parse(a.a_log), hops.parse(a.b_log)
    got = legs(ea, eb, a.skip)
    for name, steps in got.items():
        n = len(steps["TOTAL cmd → api.notify"])
        print(f"{name} ({n} round trips)")
        for s in STEPS:
            xs = steps[s]
            if xs:
                print(f"  {s:64s} p50 {pct(xs, 50):7.1f}  p90 {pct(xs, 90):7.1f}")
    trips = max(1, len({f.get("id") for _, f in ea if f.get("hop") == "poller.cmd"}))
    per = (len(ea) + len(eb)) / trips
    print(f"hop events a round trip (both daemons, every call of the run): {per:.1f}")
    if a.traced_p50 is not None and a.untraced_p50 is not None:
        c = (a.traced_p50 - a.untraced_p50) / per
        print(f"the trace's cost an event: ({a.traced_p50:.1f} - {a.untraced_p50:.1f}) / {per:.1f} = {c:.2f} µs")


if __name__ == "__main__":
    main()
