#!/usr/bin/env python3
"""Many daemon restarts in a row under load (issue #40's 100-restart target), and what leaked.

    cargo build && python3 benches/restart_loop.py --restarts 100 [--kinds holder-sigkill,puller-sigkill,holder-sigterm] [--series]

Two supervised daemons on the built-in emulation (python/tests/supervisor.py stands in for
systemd's Restart=always), a vLLM-pattern pull loop through tcpxd.nixl in two processes
(python/tests/restart_roles.py: every byte of every successful transfer checked), and the restarts
cycling through the kinds given. After each restart it waits for the loop's first successful
transfer after the daemon's start, then for a few more. It prints, per kind, the time from the
restart to that first success (p50 / p90 / max) and, at the start and the end: the open
descriptors of both client processes, the daemons' resident memory after a restart, and the files
in both state directories. A count that grows with the restarts is a leak.

With --series it also prints both client processes' descriptor counts after every restart, the
growth per restart of a least-squares line through them (from the restart after the first of each
kind), and what the descriptors are at both ends (sockets by family, pipes, eventfds, memfds,
files), with the ones opened in between listed: where a count grows, that names what grows.
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
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python" / "tests"))

import restart_roles as roles  # noqa: E402
from conftest import tcpxd_bin  # noqa: E402
from supervisor import Supervised, supervised  # noqa: E402
from test_restart import SHAPE, Role, endpoint, free_port, pull_until  # noqa: E402


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def fd_kinds(pid: int) -> Dict[str, str]:
    """fd -> what it is: "unix"/"tcp"/"tcp6"/"socket" for sockets, else its link ("pipe:[..]",
    "anon_inode:[eventfd]", "/memfd:... (deleted)", a path)."""
    inodes: Dict[str, str] = {}
    for fam in ("unix", "tcp", "tcp6", "udp", "netlink"):
        try:
            lines = Path(f"/proc/{pid}/net/{fam}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            ino = f[6] if fam == "unix" else (f[9] if fam != "netlink" else f[-1])
            inodes[ino] = fam
    out: Dict[str, str] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            link = f"{inodes.get(link[8:-1], 'socket')} {link}"
        out[fd] = link
    return out


def fd_summary(kinds: Dict[str, str]) -> Dict[str, int]:
    c: Dict[str, int] = {}
    for link in kinds.values():
        k = link.split(" ")[0] if " socket:[" in link else ("pipe" if link.startswith("pipe:") else
                                                             link if link.startswith("anon_inode:") else
                                                             "memfd" if link.startswith("/memfd:") else "file")
        c[k] = c.get(k, 0) + 1
    return dict(sorted(c.items()))


def slope(ys: List[int]) -> float:
    n = len(ys)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in enumerate(ys)) / sum((x - mx) ** 2 for x in range(n))


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
    ap.add_argument("--series", action="store_true", help="print the clients' fds after every restart and what they are")
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
        series: List[Tuple[str, int, int]] = []
        kinds0: Dict[str, Dict[str, str]] = {}
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
            series.append((kind, fds(holder.proc.pid or 0), fds(puller.proc.pid or 0)))
            if i == len(kinds) - 1:
                first = snapshot(a, b, holder, puller, d)
                if args.series:
                    kinds0 = {r: fd_kinds(p.proc.pid or 0) for r, p in (("holder", holder), ("puller", puller))}
        last = snapshot(a, b, holder, puller, d)
        kinds1 = {r: fd_kinds(p.proc.pid or 0) for r, p in (("holder", holder), ("puller", puller))} if args.series else {}
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
    if args.series:
        for j, role in ((1, "holder"), (2, "puller")):
            ys = [s[j] for s in series]
            tail = ys[len(kinds) - 1:]
            print(f"{role} fds after each restart: {' '.join(map(str, ys))}")
            print(f"  growth per restart (least squares, restarts {len(kinds)}..{len(ys)}): {slope(tail):+.4f}; "
                  f"min {min(tail) if tail else 0} max {max(tail) if tail else 0}")
            if kinds0:
                print(f"  after restart {len(kinds)}: {fd_summary(kinds0[role])}")
                print(f"  after restart {args.restarts}: {fd_summary(kinds1[role])}")
                new = {fd: l for fd, l in kinds1[role].items() if kinds0[role].get(fd) != l}
                gone = {fd: l for fd, l in kinds0[role].items() if kinds1[role].get(fd) != l}
                print(f"  opened since (fd: what): {sorted(new.items(), key=lambda x: int(x[0]))}")
                print(f"  closed since (fd: what): {sorted(gone.items(), key=lambda x: int(x[0]))}")


if __name__ == "__main__":
    main()
