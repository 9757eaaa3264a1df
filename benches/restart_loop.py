#!/usr/bin/env python3
"""Many daemon restarts in a row under load (issue #40's 100-restart target), and what leaked.

    cargo build && python3 benches/restart_loop.py --restarts 100 [--kinds holder-sigkill,puller-sigkill,holder-sigterm]

Two supervised daemons on the built-in emulation (python/tests/supervisor.py stands in for
systemd's Restart=always), a vLLM-pattern pull loop through tcpxd.nixl in two processes
(python/tests/restart_roles.py: every byte of every successful transfer checked), and the restarts
cycling through the kinds given. After each restart it waits for the loop's first successful
transfer after the daemon's start, then for a few more. It prints, per kind, the time from the
restart to that first success (p50 / p90 / max) and, at the start and the end: the open
descriptors of both client processes, the daemons' resident memory after a restart, and the files
in both state directories. A count that grows with the restarts is a leak.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python" / "tests"))

import restart_roles as roles  # noqa: E402
from conftest import tcpxd_bin  # noqa: E402
from supervisor import Supervised, supervised  # noqa: E402
from test_restart import SHAPE, Role, endpoint, free_port, pull_until  # noqa: E402


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def files(d: Path) -> int:
    return sum(len(fs) for _, _, fs in os.walk(d))


def snapshot(a: Supervised, b: Supervised, holder: Role, puller: Role, d: Path) -> Dict[str, int]:
    assert a.proc is not None and b.proc is not None
    return {
        "holder fds": fds(holder.proc.pid or 0),
        "puller fds": fds(puller.proc.pid or 0),
        "daemon a RSS KiB": rss_kib(a.proc.pid),
        "daemon b RSS KiB": rss_kib(b.proc.pid),
        "state files a": files(d / "ra.state"),
        "state files b": files(d / "rb.state"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--restarts", type=int, default=100)
    ap.add_argument("--kinds", default="holder-sigkill,puller-sigkill,holder-sigterm")
    ap.add_argument("--after", type=int, default=5, help="successful transfers wanted after each restart")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    d = Path(tempfile.mkdtemp(prefix="tcpxd-rl-"))
    sups: List[Supervised] = []
    try:
        for name in ("ra", "rb"):
            sups.append(supervised(str(tcpxd_bin()), d, name, free_port(), {"RUST_LOG": "warn"}))
        a, b = sups
        holder = Role(roles.holder, endpoint(b), SHAPE, 11)
        md = holder.recv()
        puller = Role(roles.puller, endpoint(a), SHAPE, 11, md[1])
        log: list = []
        pull_until(puller, args.after, log)
        # The first restart of each daemon opens what later ones reuse: measure from there.
        first: Dict[str, int] = {}
        times: Dict[str, List[float]] = {k: [] for k in kinds}
        t0 = time.monotonic()
        for i in range(args.restarts):
            kind = kinds[i % len(kinds)]
            target = b if kind.startswith("holder") else a
            sig = signal.SIGKILL if kind.endswith("sigkill") else signal.SIGTERM
            n = target.signal(sig)
            started = target.wait_serving(n + 1)
            mark = len(log)
            pull_until(puller, args.after, log, since=started.began)
            times[kind].append(next(m[1] for m in log[mark:] if m[0] == "ok" and m[1] > started.began) - started.began)
            if i == len(kinds) - 1:
                first = snapshot(a, b, holder, puller, d)
        last = snapshot(a, b, holder, puller, d)
        elapsed = time.monotonic() - t0
        pulled, held = puller.finish(), holder.finish()
    finally:
        for s in sups:
            s.close()
        shutil.rmtree(d, ignore_errors=True)
    print(f"{args.restarts} restarts in {elapsed:.1f} s; the loop: {pulled['ok']} transfers ok (bytes checked), "
          f"{pulled['errors']} failed around the restarts, {pulled['hangs']} hung; holder's memory intact: {held['intact']}; "
          f"re-attached: holder {held['reattached']}, puller {pulled['reattached']}")
    print("restart -> first successful transfer (s):")
    for kind, ts in times.items():
        if ts:
            q = sorted(ts)
            p90 = q[min(len(q) - 1, math.ceil(0.9 * len(q)) - 1)]  # nearest rank
            print(f"  {kind:16} n={len(ts):3}  p50 {statistics.median(q):.3f}  p90 {p90:.3f}  max {q[-1]:.3f}")
    print(f"{'':24}{'after restart ' + str(len(kinds)):>22}{'after restart ' + str(args.restarts):>22}")
    for k in last:
        print(f"  {k:22}{first.get(k, 0):>22}{last[k]:>22}")


if __name__ == "__main__":
    main()
