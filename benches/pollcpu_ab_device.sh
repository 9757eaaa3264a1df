#!/usr/bin/env bash
# Session 33, pollcpu (issue #38: 64 KiB at 8-16 in flight at raw's rate), for the 16- or 32-CPU
# H200 host: build A (this branch) against build B (main), both ÷ raw.
#   1. 64 KiB, 16 and 8 in flight, READ then WRITE, GPU 0 -> GPU $PEER through the framed local
#      session (`tcpxctl bench transfer --via local`), per variant the builds B A A B, ROUNDS
#      times; the raw plugin path (`tcpxctl bench raw`) once per row. Variants: sess =
#      TCPXD_SESSION_THREAD=on TCPXD_LANE_THREAD=off (the default on 8+ CPUs), both = both threads
#      on. Prints GB/s (median of the runs), A/B and each ÷ raw, and every run.
#   2. (CPU_ITERS > 0) benches/inflight_threads.py, 16 in flight, READ and WRITE, sess, B A A B:
#      each run's GB/s, its steady window's busy share, phases, CPU per thread and actions
#      (µs a transfer).
#   3. (PERF=1) A's READ and WRITE at 16 in flight, sess, with --perf-record (benches/
#      pollcpu_device.sh's part 3): the poller's top symbols after the change.
# About 4-5 minutes at the defaults on one H200.
#
#   benches/pollcpu_ab_device.sh A B OUT_DIR
#
# A, B: folders with a release build's tcpxd, tcpxctl (symbols kept for part 3). Environment:
# ITERS (30000), ROUNDS (1), PEER (1 where nvidia-smi lists two GPUs, else 0), VARIANTS
# ("sess both"), CPU_ITERS (100000; 0 skips part 2), PERF (1), PYTHON (python3).
set -euo pipefail
if [ $# -lt 3 ]; then
    sed -n 2,21p "$0"
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
A=$(cd "$1" && pwd) B=$(cd "$2" && pwd) out=$3
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
default_peer=1
[ "${gpus:-0}" -lt 2 ] && default_peer=0
iters=${ITERS:-30000} rounds=${ROUNDS:-1} peer=${PEER:-$default_peer} cpu_iters=${CPU_ITERS:-100000}
variants=${VARIANTS:-sess both}
PY=${PYTHON:-python3}
rm -rf "$out" && mkdir -p "$out"
out=$(cd "$out" && pwd)
wrap() { # NAME BUILD SESSION LANE
    mkdir -p "$out/v-$1"
    printf '#!/bin/sh\nTCPXD_SESSION_THREAD=%s TCPXD_LANE_THREAD=%s exec %s "$@"\n' "$3" "$4" "$2/tcpxd" >"$out/v-$1/tcpxd"
    chmod +x "$out/v-$1/tcpxd"
}
for b in A B; do
    d=$A
    [ $b = B ] && d=$B
    wrap "sess-$b" "$d" on off
    wrap "both-$b" "$d" on on
done
echo "host: $(nproc) CPUs, ${gpus:-0} GPUs; A $A ($(cat "$A/COMMIT" 2>/dev/null || echo '?')), B $B ($(cat "$B/COMMIT" 2>/dev/null || echo '?')); TCPXD_SPIN=${TCPXD_SPIN:-host default}; GPU 0 -> $peer"

echo "== 1. 64 KiB through the framed session, $iters transfers a run, B A A B x $rounds"
for op in read write; do
    for c in 16 8; do
        f=$out/$op-c$c.txt
        "$B/tcpxctl" bench raw --cuda 0 --op "$op" --sizes 64K --iters "$iters" --warmup 100 \
            --concurrency "$c" --json | sed 's/^/raw /' >>"$f" || echo "(raw $op c$c failed)"
        for ((r = 0; r < rounds; r++)); do
            for v in $variants; do
                for b in B A A B; do
                    "$B/tcpxctl" bench transfer --daemon "$out/v-$v-$b/tcpxd" --via local --cuda 0 \
                        --peer-cuda "$peer" --op "$op" --sizes 64K --iters "$iters" --warmup 200 \
                        --concurrency "$c" --json | sed "s/^/$v-$b /" >>"$f" || echo "($op c$c $v-$b failed)"
                done
            done
        done
    done
done
"$PY" - "$out" "$variants" <<'PYEOF'
import json, statistics, sys
from pathlib import Path
out, variants = Path(sys.argv[1]), sys.argv[2].split()
print(f"{'op':<6}{'C':>4} {'raw':>6} | " + " | ".join(f"{v + ' B':>7} {v + ' A':>7} {'A/B':>5} {'B/raw':>6} {'A/raw':>6}" for v in variants))
for op in ("read", "write"):
    for c in (16, 8):
        rows = {}
        for line in (out / f"{op}-c{c}.txt").read_text().splitlines():
            name, _, js = line.partition(" ")
            try:
                rows.setdefault(name, []).append(json.loads(js)["gb_per_s"])
            except (ValueError, KeyError):
                pass
        m = {k: statistics.median(v) for k, v in rows.items()}
        g = lambda k: m.get(k, float("nan"))
        cells = []
        for v in variants:
            a, b, raw = g(f"{v}-A"), g(f"{v}-B"), g("raw")
            cells.append(f"{b:>7.2f} {a:>7.2f} {a / b:>5.2f} {b / raw:>6.2f} {a / raw:>6.2f}")
        print(f"{op:<6}{c:>4} {g('raw'):>6.2f} | " + " | ".join(cells))
        print("      runs: " + "; ".join(f"{k} " + " ".join(f"{x:.2f}" for x in v) for k, v in rows.items()))
PYEOF

if [ "$cpu_iters" -gt 0 ]; then
    echo "== 2. per-thread CPU, 64 KiB at 16 in flight (inflight_threads.py), sess, B A A B"
    for op in read write; do
        n=0
        for b in B A A B; do
            n=$((n + 1))
            f=$out/cpu-$op-$n-$b.txt
            "$PY" "$here/inflight_threads.py" --tcpxctl "$B/tcpxctl" -- --daemon "$out/v-sess-$b/tcpxd" \
                --via local --cuda 0 --peer-cuda "$peer" --sizes 64K --concurrency 16 --op "$op" \
                --iters "$cpu_iters" --warmup 200 >"$f" 2>&1 || true
            echo "-- $op $b: $(grep -E '^daemon-local' "$f" | awk '{print $8}' | head -1) GB/s"
            sed -n '/^Steady window/,$p' "$f" | sed -n '2,4p;/cpu:/p;/actions:/p'
        done
    done
fi

if [ "${PERF:-1}" -gt 0 ]; then
    echo "== 3. A's profile, 16 in flight, sess (perf record, the pollers and the sessions thread)"
    for op in read write; do
        f=$out/perf-$op-A.txt
        "$PY" "$here/inflight_threads.py" --perf-record "$out/perfdata" --perf-freq 1500 --perf-secs 2 \
            --tcpxctl "$A/tcpxctl" -- --daemon "$out/v-sess-A/tcpxd" --via local --cuda 0 --peer-cuda "$peer" \
            --sizes 64K --concurrency 16 --op "$op" --iters "$cpu_iters" --warmup 200 >"$f" 2>&1 || true
        grep -E '^daemon-local' "$f" | head -1 || true
        # the pollers' sections only (the sessions thread and the workers are in the file)
        awk '/^### /{p = /tcpxd-poller/} /^  inclusive/{p = 0} /^perf record -F/{print} p' "$f" | head -80
    done
    rm -f "$out"/perfdata/*.data
fi
echo "(full outputs in $out)"
