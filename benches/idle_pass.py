#!/usr/bin/env python3
"""What a poller's pass that finds nothing costs (session 28, ping): between two small transfers a
spinning poller (`runtime.spin` on) runs such passes back to back, so a request, a command or a
peer's control message waits on average half of one before it is seen. Two daemons on the
emulation with `TCPXD_SPIN=on` and their metrics served; `tcpxd.Client.write` of 4 KiB a → b
in a loop for `--seconds`; then each daemon's `tcpxd_poller_passes_total` and
`tcpxd_poller_pass_seconds_total` by `progress`: the idle passes a second and the µs of an idle
pass's own body (the clock is read at its start and end: a yield or spin after the pass is not
in it), per daemon. `--after` / `--before` daemons alternate A B B A x `--rounds`.

    PYTHONPATH=python/src python3 benches/idle_pass.py --after target/release/tcpxd --before /tmp/main/tcpxd
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Dict, List, Tuple

import tcpxd
from tcpxd.bench import _start

SERIES = re.compile(r'^(tcpxd_poller_passes_total|tcpxd_poller_pass_seconds_total)\{progress="(yes|no)"\} ([0-9.e+-]+)$')


def scrape(port: int) -> Dict[Tuple[str, str], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: Dict[Tuple[str, str], float] = {}
    for line in text.splitlines():
        m = SERIES.match(line)
        if m:
            out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


def run(binary: str, seconds: float, port: int) -> List[Tuple[float, float, float]]:
    """(idle passes a second, µs an idle pass, transfers a second) per daemon."""
    d = Path(tempfile.mkdtemp(prefix="tcpxd-idle-pass-"))
    procs = []
    try:
        for i, name in enumerate(("pass-a", "pass-b")):
            os.environ["TCPXD_METRICS_LISTEN"] = f"127.0.0.1:{port + i}"
            procs.append(_start(binary, d, name)[0])
        os.environ.pop("TCPXD_METRICS_LISTEN", None)
        ca, cb = tcpxd.Client(f"unix:{d}/pass-a.sock"), tcpxd.Client(f"unix:{d}/pass-b.sock")
        src, dst = ca.register_host(4096), cb.register_host(4096)
        src.fill(seed=1)
        for _ in range(200):
            ca.write(src, dst.descriptor, 4096)
        before = [scrape(port + i) for i in range(2)]
        t0, n = time.monotonic(), 0
        while time.monotonic() - t0 < seconds:
            ca.write(src, dst.descriptor, 4096)
            n += 1
        wall = time.monotonic() - t0
        after = [scrape(port + i) for i in range(2)]
        assert dst.checksum() == src.checksum(), "bytes differ"
        out = []
        for b, a in zip(before, after):
            passes = a[("tcpxd_poller_passes_total", "no")] - b[("tcpxd_poller_passes_total", "no")]
            secs = a[("tcpxd_poller_pass_seconds_total", "no")] - b[("tcpxd_poller_pass_seconds_total", "no")]
            out.append((passes / wall, secs / max(passes, 1) * 1e6, n / wall))
        ca.close()
        cb.close()
        return out
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--after", required=True, help="A: the daemon binary after")
    ap.add_argument("--before", required=True, help="B: the daemon binary before")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--port", type=int, default=19461, help="the metrics ports: this one and the next")
    a = ap.parse_args()
    os.environ.setdefault("TCPXD_SPIN", "on")
    got: Dict[str, List[List[Tuple[float, float, float]]]] = {"A": [], "B": []}
    for r in range(a.rounds):
        for label in ("A", "B", "B", "A"):
            res = run(a.after if label == "A" else a.before, a.seconds, a.port)
            got[label].append(res)
            print(f"round {r + 1} {label}: " + ", ".join(
                f"{n}: {ps:,.0f} idle passes/s, {us:.2f} µs an idle pass" for n, (ps, us, _) in zip("ab", res))
                + f"; {res[0][2]:,.0f} WRITEs/s", flush=True)
    for label, runs in got.items():
        for i, n in enumerate("ab"):
            us = statistics.median(r[i][1] for r in runs)
            ps = statistics.median(r[i][0] for r in runs)
            print(f"{label} daemon {n}: median {us:.2f} µs an idle pass, {ps:,.0f} idle passes/s")


if __name__ == "__main__":
    main()
