#!/usr/bin/env python3
"""The completion board (session 25, shmring) before and after, alternating: small calls as a user
sees them, three ways in one invocation —

- A: the after tree's package and daemon, the board on (`TCPXD_BOARD_SLOTS=256`: the default
  with 8 CPUs or more, set here so that it is on whatever the machine);
- O: the same package and daemon with the board off on the client (`TCPXD_BOARD_SLOTS=0`: every
  end read from the socket, as before), which isolates the board from everything else;
- R: the same with the board on and the request ring off on the client (`TCPXD_RING_SLOTS=0`:
  every request on the socket, as before session 26), which isolates the ring (session 26, reqring);
- B: the before tree's package and daemon (e.g. /work/before-s25: `tcpxd` and `python/src`);
- S: A with the daemons serving the framed sessions on the poller's thread
  (`TCPXD_POLLER_SESSIONS=on`; `auto` is on since session 28, off where `runtime.spin` was on before): a ring's request is read,
  checked and started there, no runtime worker between (session 27, nixltail).

`--variants` picks the labels beside A (default `OB`; `R`, `RB`, `ORB` ...); each round runs A, the
variants, then the same backwards (A O B B O A), and the ratios are A's ÷ each variant's. Each run is `benches/api_legs.py --no-trace --only read,write,nixl,notif`
(two daemons on the emulation, `tcpxd.Client.read` / `write` 4 KiB, tcpxd.nixl 4 KiB READ polled
tight and with `sleep(0)`, a WRITE polled tight, the notification round trip) and, with
`--compare`, `python -m tcpxd.nixl_compare --impl tcpxd` (its small rows). Prints each row's p50 and
p99 (median of the runs) per label, and per round the A runs' sum ÷ the B runs' (and ÷ O's), with
their median: read the ratios, which are measured within a round.

    python3 benches/board_ab.py --after-bin target/release/tcpxd --before-bin /work/before-s25/tcpxd \\
        --before-py /work/before-s25/python/src --rounds 3 --iters 1000 --compare
    python3 benches/board_ab.py --after-bin target/release/tcpxd --variants R --rounds 3 --iters 1000
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

LEGS = re.compile(r"^(\S.*?): (\d+) calls, p50 ([\d.]+) µs, p90 ([\d.]+), p99 ([\d.]+)")
COMPARE = re.compile(r"^(4 KiB (?:READ|WRITE) p(?:50|99) µs \([^)]*\)|notification round trip p(?:50|99) µs)\s+([\d.]+)")


def run(label: str, py: str, binary: str, env_extra: Dict[str, str], a: argparse.Namespace) -> Dict[str, Tuple[float, float]]:
    """One run: {row: (p50, p99)}."""
    env = dict(os.environ)
    env["PYTHONPATH"] = py
    env.update(env_extra)
    out: Dict[str, Tuple[float, float]] = {}
    cmd = [a.python, str(HERE / "api_legs.py"), "--tcpxd", binary, "--no-trace", "--only", a.only, "--iters", str(a.iters)]
    got = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    for line in got.stdout.splitlines():
        m = LEGS.match(line)
        if m:
            out[m.group(1)] = (float(m.group(3)), float(m.group(5)))
    if got.returncode != 0 or not out:
        print(f"{label}: api_legs failed ({got.returncode}):\n{got.stderr[-2000:]}", file=sys.stderr)
    if a.compare:
        cmd = [a.python, "-m", "tcpxd.nixl_compare", "--impl", "tcpxd", "--rounds", "1", "--iters", "1",
               "--mib", "16", "--small-iters", str(a.iters), "--tcpxd", binary]
        got = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
        p: Dict[str, float] = {}
        for line in got.stdout.splitlines():
            m = COMPARE.match(line.strip())
            if m:
                p[m.group(1)] = float(m.group(2))
        for k, v in p.items():
            if " p50 " in k:
                out["compare: " + k.replace(" p50 µs", "")] = (v, p.get(k.replace(" p50 ", " p99 "), float("nan")))
        if got.returncode != 0 or not p:
            print(f"{label}: nixl_compare failed ({got.returncode}):\n{got.stderr[-2000:]}", file=sys.stderr)
    print(f"{label}: " + ", ".join(f"{k} {v[0]:.1f}/{v[1]:.0f}" for k, v in out.items()), file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--after-bin", required=True)
    ap.add_argument("--after-py", default=str(ROOT / "python/src"))
    ap.add_argument("--before-bin", help="the before tree's daemon (for B)")
    ap.add_argument("--before-py", help="the before tree's python/src (for B)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--only", default="read,write,nixl,notif")
    ap.add_argument("--compare", action="store_true", help="also tcpxd.nixl_compare --impl tcpxd's small rows")
    ap.add_argument("--no-off", action="store_true", help="leave out O (the board off on the client): --variants B")
    ap.add_argument("--variants", default=None,
                    help="the labels beside A: O (board off), R (ring off), B (before), S (sessions on the poller); default OB")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--timeout", type=float, default=900)
    a = ap.parse_args()
    labels = {
        "A": (a.after_py, a.after_bin, {"TCPXD_BOARD_SLOTS": "256"}),
        "O": (a.after_py, a.after_bin, {"TCPXD_BOARD_SLOTS": "0"}),
        "R": (a.after_py, a.after_bin, {"TCPXD_BOARD_SLOTS": "256", "TCPXD_RING_SLOTS": "0"}),
        "B": (a.before_py, a.before_bin, {}),
        # (session 27) the daemons serve the framed sessions on the poller's thread: a request on
        # the ring is read, checked and started there, no runtime worker between (where
        # runtime.spin is on, `auto` leaves it off)
        "S": (a.after_py, a.after_bin, {"TCPXD_BOARD_SLOTS": "256", "TCPXD_POLLER_SESSIONS": "on"}),
    }
    variants = a.variants if a.variants is not None else ("B" if a.no_off else "OB")
    if any(v not in "ORBS" for v in variants) or not variants:
        ap.error(f"--variants {variants!r}: letters of O, R, B, S")
    if "B" in variants and not (a.before_bin and a.before_py):
        ap.error("B needs --before-bin and --before-py")
    for label in "A" + variants:  # (a path without the package would import whatever is installed)
        if not (Path(labels[label][0]) / "tcpxd" / "__init__.py").is_file():
            ap.error(f"{label}: no tcpxd package under {labels[label][0]}")
    order = "A" + variants + variants[::-1] + "A"
    others = [v for v in "ORBS" if v in variants]
    runs: List[List[Tuple[str, Dict[str, Tuple[float, float]]]]] = []
    for r in range(a.rounds):
        this = []
        for label in order:
            py, binary, env = labels[label]
            this.append((label, run(f"round {r + 1} {label}", py, binary, env, a)))
        runs.append(this)
    rows: List[str] = []
    for rnd in runs:
        for _, res in rnd:
            rows += [k for k in res if k not in rows]
    print(f"{'row (p50 / p99 µs, median of runs)':52} " + " ".join(f"{l:>14}" for l in sorted(set(order)))
          + "".join(f"   A÷{o} p50 per round (median)" for o in others))
    for row in rows:
        cells = []
        for label in sorted(set(order)):
            v = [res[row] for rnd in runs for l, res in rnd if l == label and row in res]
            cells.append(f"{statistics.median(x[0] for x in v):.1f} / {statistics.median(x[1] for x in v):.0f}" if v else "-")

        def ratios(other: str) -> str:
            per = []
            for rnd in runs:
                mine = [res[row][0] for l, res in rnd if l == "A" and row in res]
                theirs = [res[row][0] for l, res in rnd if l == other and row in res]
                if mine and theirs:
                    per.append(sum(mine) / sum(theirs))
            return " ".join(f"{x:.2f}" for x in per) + (f" ({statistics.median(per):.2f})" if per else "")

        print(f"{row:52} " + " ".join(f"{c:>14}" for c in cells) + "".join("   " + ratios(o) for o in others))


if __name__ == "__main__":
    main()
