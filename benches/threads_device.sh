#!/usr/bin/env bash
# Session 30, for the 16- or 32-CPU H200 host: one build, its poller's work split over threads or not
# (issue #38: 8-16 in flight at raw's rate). Four variants of the same binaries, alternating:
#   off   runtime.session_thread = off, runtime.lane_thread = off (one poller does it all)
#   sess  the framed sessions on their own thread (tcpxd-sessions)
#   lane  the lanes' plugin calls on lane threads (tcpxd-lanes-<gpu>): the send lanes' (session
#         30) and, from session 31 (lanerecv), the receive lanes' with their unpacks and consumes
#   both  both
# 1. 64 KiB, 16 and 8 in flight, WRITE then READ, GPU 0 -> GPU $PEER through the framed local
#    session (`tcpxctl bench transfer --via local`), the variants in the order off sess lane both,
#    then backwards, ROUNDS times; the raw plugin path (`tcpxctl bench raw`) once per row. Prints
#    GB/s per variant (median of the runs), ÷ off and ÷ raw.
# 2. 4 KiB one at a time as a user sees it: benches/board_ab.py with A = both, B = off (the same
#    build), p50 / p99 and A ÷ B per round.
# 3. (THREADS_CPU=1) where each daemon's CPU goes, thread by thread: benches/inflight_threads.py
#    at 16 in flight, READ and WRITE, variants sess and both alternating (sess both both sess),
#    CPU_ITERS transfers a run; prints each run's GB/s, its steady window's busy and per-thread
#    CPU (µs a transfer) and the actions.
# Everything it writes goes to OUT_DIR; about 4 minutes at the defaults on two H200s.
#
#   benches/threads_device.sh BUILD [OUT_DIR]
#
# BUILD: a folder with a release build's tcpxd, tcpxctl and python/src (its C pass built in
# place). Environment: ITERS (30000), ROUNDS (2), PEER (1 where nvidia-smi lists two GPUs, else 0),
# SMALL_ITERS (1000; 0 skips part 2), THREADS_CPU (0), CPU_ITERS (100000), SPIN (left to the host
# when unset), PYTHON (python3).
set -euo pipefail
if [ $# -lt 1 ]; then
    sed -n 2,20p "$0"
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
D=$(cd "$1" && pwd) out=${2:-/tmp/threads-device}
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
default_peer=1
[ "${gpus:-0}" -lt 2 ] && default_peer=0
iters=${ITERS:-30000} rounds=${ROUNDS:-2} peer=${PEER:-$default_peer} small=${SMALL_ITERS:-1000}
PY=${PYTHON:-python3}
[ -n "${SPIN:-}" ] && export TCPXD_SPIN=$SPIN
rm -rf "$out" && mkdir -p "$out"
variant() { # NAME SESSION LANE: a folder whose tcpxd runs BUILD's with those keys
    local v=$out/v-$1
    mkdir -p "$v"
    printf '#!/bin/sh\nTCPXD_SESSION_THREAD=%s TCPXD_LANE_THREAD=%s exec %s "$@"\n' "$2" "$3" "$D/tcpxd" >"$v/tcpxd"
    chmod +x "$v/tcpxd"
}
variant off off off
variant sess on off
variant lane off on
variant both on on
echo "host: $(nproc) CPUs, ${gpus:-0} GPUs; build $D ($(cat "$D/COMMIT" 2>/dev/null || echo '?')); TCPXD_SPIN=${TCPXD_SPIN:-host default}"

echo "== 1. 64 KiB through the framed session, GPU 0 -> $peer, $iters transfers a run"
for op in write read; do
    for c in 16 8; do
        f=$out/$op-c$c.txt
        "$D/tcpxctl" bench raw --cuda 0 --op "$op" --sizes 64K --iters "$iters" --warmup 100 \
            --concurrency "$c" --json | sed 's/^/raw /' >>"$f"
        for ((r = 0; r < rounds; r++)); do
            for v in off sess lane both both lane sess off; do
                "$D/tcpxctl" bench transfer --daemon "$out/v-$v/tcpxd" --via local --cuda 0 \
                    --peer-cuda "$peer" --op "$op" --sizes 64K --iters "$iters" --warmup 200 \
                    --concurrency "$c" --json | sed "s/^/$v /" >>"$f"
            done
        done
    done
done
"$PY" - "$out" <<'EOF'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'op':<6}{'C':>4} {'raw':>6} | " + " ".join(f"{v:>6}" for v in ("off", "sess", "lane", "both"))
      + " | " + " ".join(f"{v + '/off':>9}" for v in ("sess", "lane", "both")) + " | " + " ".join(f"{v + '/raw':>9}" for v in ("off", "both")))
for op in ("write", "read"):
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
        print(f"{op:<6}{c:>4} {g('raw'):>6.2f} | " + " ".join(f"{g(v):>6.2f}" for v in ("off", "sess", "lane", "both"))
              + " | " + " ".join(f"{g(v) / g('off'):>9.2f}" for v in ("sess", "lane", "both"))
              + " | " + " ".join(f"{g(v) / g('raw'):>9.2f}" for v in ("off", "both")))
        print("      runs: " + "; ".join(f"{k} " + " ".join(f"{x:.2f}" for x in v) for k, v in rows.items()))
EOF

if [ "$small" -gt 0 ]; then
    echo "== 2. 4 KiB one at a time: A = both, B = off (board_ab.py --variants B)"
    "$PY" "$here/board_ab.py" --after-bin "$out/v-both/tcpxd" --after-py "$D/python/src" \
        --before-bin "$out/v-off/tcpxd" --before-py "$D/python/src" --variants B --rounds 2 \
        --iters "$small" --only read,write,nixl,notif 2>&1 | tail -14
fi

if [ "${THREADS_CPU:-0}" -gt 0 ]; then
    echo "== 3. per-thread CPU, 64 KiB at 16 in flight (inflight_threads.py), GPU 0 -> $peer"
    for op in read write; do
        n=0
        for v in sess both both sess; do
            n=$((n + 1))
            f=$out/cpu-$op-$n-$v.txt
            "$PY" "$here/inflight_threads.py" --tcpxctl "$D/tcpxctl" -- --daemon "$out/v-$v/tcpxd" \
                --via local --cuda 0 --peer-cuda "$peer" --sizes 64K --concurrency 16 --op "$op" \
                --iters "${CPU_ITERS:-100000}" --warmup 200 >"$f" 2>&1 || true
            echo "-- $op $v: $(sed -n 2p "$f" | awk '{print $8}') GB/s"
            sed -n '/^Steady window/,$p' "$f" | sed -n '2,4p;/cpu:/p;/actions:/p'
        done
    done
fi
