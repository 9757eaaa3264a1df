#!/usr/bin/env python3
"""Daemon ÷ raw for small transfers, one at a time, alternating in one run (issue #38's 4 KiB–1 MiB
targets): `tcpxctl bench raw` (the plugin driven with the daemon's chunking, windows and unpack)
and `tcpxctl bench transfer` (two local daemons through the client API) for each op, round after
round, so a burst of host noise lands in one harness's round rather than in all of one harness.
With --bin-before, a second daemon build (an older tree) runs beside the first in every round
(ABBA order), so "before" and "after" come from one run too.

    python3 benches/small_latency.py --bin target/release --sizes 4K,64K,1M --rounds 3
    # on the H200 device (GPU 0 to GPU 0, credits into GPU memory, under MPS), before and after:
    python3 benches/small_latency.py --bin target/release --bin-before before/release --cuda 0 --mps \\
        --sizes 4K,64K,1M,16M --rounds 3

Prints, per op and size, each harness's p50 µs and GB/s (median over rounds; every round's p50
listed), daemon ÷ raw by GB/s and the daemon's p50 ÷ raw's p50. Reports only: nothing here
asserts a speed. Each round's rows are kept as JSON lines in --out.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare import mps  # noqa: E402  (a private MPS control daemon for the run, as compare.py's)


def run(cmd, out, env):
    """Runs one harness; returns its rows by block size (from its --out file)."""
    if os.path.exists(out):
        os.unlink(out)
    p = subprocess.run(cmd + ["--out", out], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-4000:])
        sys.exit(f"{' '.join(cmd)}: exit {p.returncode}")
    rows = {}
    for line in open(out):
        r = json.loads(line)
        rows[int(r["block_size"])] = r
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="target/release", help="folder with tcpxd and tcpxctl (the tree measured)")
    ap.add_argument("--bin-before", help="a second folder with tcpxd (an older tree), run beside --bin's in every round")
    ap.add_argument("--sizes", default="4K,64K,1M")
    ap.add_argument("--ops", default="write,read")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cuda", help="both sides' buffers on this CUDA device (host memory by default)")
    ap.add_argument("--mps", action="store_true", help="run under a private CUDA MPS daemon (two daemons on one GPU)")
    ap.add_argument("--out", default="small_latency.jsonl")
    args = ap.parse_args()

    tcpxctl = os.path.join(args.bin, "tcpxctl")
    daemons = {"daemon": os.path.join(args.bin, "tcpxd")}
    if args.bin_before:
        daemons["before"] = os.path.join(args.bin_before, "tcpxd")
    mem = ["--cuda", args.cuda, "--peer-cuda", args.cuda] if args.cuda is not None else []
    raw_mem = ["--cuda", args.cuda] if args.cuda is not None else []
    common = ["--sizes", args.sizes, "--iters", str(args.iters), "--warmup", str(args.warmup)]
    env = dict(os.environ)
    tmp = tempfile.mkdtemp(prefix="small-latency-")
    results = {}  # (op, harness) -> [rows by size, per round]
    with mps(args.mps, env), open(args.out, "a") as log:
        for rnd in range(1, args.rounds + 1):
            for op in args.ops.split(","):
                order = ["raw"] + list(daemons)
                if rnd % 2 == 0:
                    order = ["raw"] + list(reversed(list(daemons)))
                for h in order:
                    out = os.path.join(tmp, f"{op}-{h}.jsonl")
                    if h == "raw":
                        cmd = [tcpxctl, "bench", "raw", "--op", op] + raw_mem + common
                    else:
                        cmd = [tcpxctl, "bench", "transfer", "--daemon", daemons[h], "--op", op] + mem + common
                    rows = run(cmd, out, env)
                    results.setdefault((op, h), []).append(rows)
                    for s, r in rows.items():
                        log.write(json.dumps({**r, "harness": h, "round": rnd}) + "\n")
                    p50s = " ".join(f"{r['p50_lat_us']:.0f}" for _, r in sorted(rows.items()))
                    print(f"round {rnd} {op} {h:7} p50 µs {p50s}", flush=True)

    def med(op, h, size, key):
        return statistics.median(r[size][key] for r in results[(op, h)])

    print()
    print(f"one at a time, {'GPU ' + args.cuda if args.cuda is not None else 'host memory'}, "
          f"{args.iters} iters, median of {args.rounds} alternating rounds")
    harnesses = ["raw"] + list(daemons)
    head = f"{'op':6}{'size':>9}" + "".join(f"{h + ' p50 µs':>16}{h + ' GB/s':>14}" for h in harnesses)
    head += "".join(f"{h + '÷raw GB/s':>16}{h + ' p50÷raw':>15}" for h in daemons)
    print(head)
    for op in args.ops.split(","):
        for size in sorted(results[(op, "raw")][0]):
            line = f"{op:6}{size:>9}"
            for h in harnesses:
                line += f"{med(op, h, size, 'p50_lat_us'):>16.0f}{med(op, h, size, 'gb_per_s'):>14.3f}"
            for h in daemons:
                # Ratios per round (the harnesses ran next to each other), then their median.
                g = statistics.median(r[size]["gb_per_s"] / q[size]["gb_per_s"]
                                      for r, q in zip(results[(op, h)], results[(op, "raw")]))
                p = statistics.median(r[size]["p50_lat_us"] / q[size]["p50_lat_us"]
                                      for r, q in zip(results[(op, h)], results[(op, "raw")]))
                line += f"{g:>16.2f}{p:>15.2f}"
            print(line)


if __name__ == "__main__":
    main()
