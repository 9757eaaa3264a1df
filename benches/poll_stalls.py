#!/usr/bin/env python3
"""How often a tight polling loop is held up by the package's own threads (session 27, nixltail):
the 4 KiB tight loop's p99 on the H200 was 1.7-2x NIXL's, and a periodic stall of the polling
thread is one structural cause a tail can have.

One daemon (the built-in emulation), one `tcpxd.Client` session; 4 KiB WRITEs between two buffers
of that daemon (same node: no peer), one at a time for --seconds, each polled (`Session.poll()`,
what tcpxd.nixl's check_xfer_state does) in a loop without a pause; it records each WRITE's time
and the gap between consecutive polls, and counts how often the session's reader thread ran Python
meanwhile (its looks at the clock: each one took the GIL from the polling thread). A gap far above
the loop's own (~1 µs) is the polling thread off the CPU or waiting for the GIL: the scheduler's
(noise, on a shared machine) or a thread of the package's that takes the GIL (structural: before
session 27, the session's reader thread woke every READER_QUIET_S and took it, forcing a switch).

With --before-py, the same loop runs on a second package tree too, alternating A B B A per round
(PYTHONPATH switched per run: each run is a child process). Prints per run the gaps over 20 / 50 /
200 µs per second and the largest, and per label the median of its runs.

    python3 benches/poll_stalls.py --tcpxd target/release/tcpxd --before-py BEFORE/python/src --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

CHILD = r"""
import concurrent.futures, json, sys, threading, time
import tcpxd
endpoint, seconds = sys.argv[1], float(sys.argv[2])
done = concurrent.futures.Future.done
with tcpxd.Client(endpoint) as c:
    src, dst = c.register_host(4096), c.register_host(4096)
    src.fill(seed=1)
    looks = [0]
    mono = time.monotonic

    def prof(frame, event, arg):  # the reader thread's looks at the clock: each with the GIL taken
        if event == "c_call" and arg is mono:
            looks[0] += 1

    threading.setprofile(prof)  # (threads started from here on: the session's reader)
    s = c.session()
    threading.setprofile(None)
    s.poll()
    time.sleep(0.05)
    sw0 = looks[0]
    gaps, lat = [], []
    perf = time.perf_counter
    end = perf() + seconds
    while True:
        t0 = perf()
        f = s.write(src, dst.descriptor, 4096)
        last = perf()
        while not done(f):
            s.poll()
            now = perf()
            if now - last > 20e-6:
                gaps.append(now - last)
            last = now
        lat.append(perf() - t0)
        if last > end:
            break
    wakes = looks[0] - sw0
    assert f.result().bytes_done == 4096 and dst.checksum() == src.checksum()
    s.close()
print(json.dumps({"gaps": gaps, "lat": lat, "wakes": wakes, "file": tcpxd.__file__}))
"""


def run(py: str, src: str, endpoint: str, seconds: float) -> dict:
    env = dict(os.environ, PYTHONPATH=src)
    out = subprocess.run([py, "-c", CHILD, endpoint, str(seconds)], env=env, check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    if not os.path.realpath(r["file"]).startswith(os.path.realpath(src) + os.sep):
        raise SystemExit(f"the package imported is {r['file']}, not the one under {src}")
    g, lat = r["gaps"], sorted(r["lat"])

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(round(p / 100 * (len(lat) - 1))))] * 1e6

    return {
        "n": len(lat),
        "reader GIL/s": r["wakes"] / seconds,
        "p50": pct(50),
        "p99": pct(99),
        "p99.9": pct(99.9),
        "20us/s": sum(1 for x in g if x > 20e-6) / seconds,
        "50us/s": sum(1 for x in g if x > 50e-6) / seconds,
        "200us/s": sum(1 for x in g if x > 200e-6) / seconds,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tcpxd", required=True, help="the daemon binary")
    ap.add_argument("--after-py", default=str(ROOT / "python/src"))
    ap.add_argument("--before-py", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--python", default=sys.executable)
    a = ap.parse_args()
    sys.path.insert(0, a.after_py)
    from tcpxd.bench import _start

    d = Path(tempfile.mkdtemp(prefix="tcpxd-poll-stalls-"))
    proc = _start(a.tcpxd, d, "stalls")[0]
    endpoint = f"unix:{d}/stalls.sock"
    labels = {"A": a.after_py} | ({"B": a.before_py} if a.before_py else {})
    runs: dict = {k: [] for k in labels}
    try:
        for r in range(a.rounds):
            order = list(labels) + list(reversed(labels))
            for lab in order:
                res = run(a.python, labels[lab], endpoint, a.seconds)
                runs[lab].append(res)
                print(f"round {r + 1} {lab}: " + ", ".join(f"{k} {v:.0f}" for k, v in res.items()), flush=True)
    finally:
        proc.terminate()
        proc.wait()
    keys = list(runs["A"][0])
    print("label " + " ".join(f"{k:>9}" for k in keys) + "   (median of runs; p: a WRITE's µs; gaps: polls held up, a second)")
    for lab, rs in runs.items():
        print(f"{lab:5} " + " ".join(f"{statistics.median(x[k] for x in rs):9.1f}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
