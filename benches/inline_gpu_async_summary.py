#!/usr/bin/env python3
"""Summary of benches/inline_gpu_async.sh's rows (OUT_DIR/<label>.r<round>.jsonl).

One at a time (concurrency 1): p50 in us, lower is better. 8 in flight: GB/s, higher is better.
For each op, mode and size: each configuration's median over its runs, then per round the
ratios A / B, A / C and A / raw (each configuration's runs in that round averaged first, so every
ratio is taken within one alternating round)."""
import collections
import glob
import json
import os
import re
import statistics
import sys


def main(out):
    runs = collections.defaultdict(list)  # (op, conc, size, label, round) -> values
    for path in sorted(glob.glob(os.path.join(out, "*.r*.jsonl"))):
        m = re.match(r"(.+)\.r(\d+)\.jsonl$", os.path.basename(path))
        if not m:
            continue
        label, rnd = m.group(1), int(m.group(2))
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                conc = r.get("concurrency", 1)
                value = r["p50_lat_us"] if conc == 1 else r["gb_per_s"]
                runs[(r["op"], conc, r["block_size"], label, rnd)].append(value)
    keys = sorted({k[:3] for k in runs})
    labels = ["A", "A1", "B", "C", "raw"]
    rounds = sorted({k[4] for k in runs})
    for op, conc, size in keys:
        unit = "p50 us" if conc == 1 else "GB/s"
        cells = []
        for label in labels:
            vals = [v for r in rounds for v in runs.get((op, conc, size, label, r), [])]
            if vals:
                cells.append(f"{label} {statistics.median(vals):.3g}")
        ratios = []
        for r in rounds:
            mean = lambda label: (statistics.mean(runs[(op, conc, size, label, r)])
                                  if runs.get((op, conc, size, label, r)) else None)
            a = mean("A")
            for other in ["B", "C", "raw"]:
                o = mean(other)
                if a and o:
                    ratios.append(f"r{r} A/{other} {a / o:.2f}")
        print(f"{op:5} {conc}x {size // 1024:>3}K {unit:6} | " + "  ".join(cells)
              + " | " + "  ".join(ratios))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
