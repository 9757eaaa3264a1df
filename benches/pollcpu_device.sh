#!/usr/bin/env bash
# Session 33, pollcpu (issue #38: 64 KiB at 8-16 in flight at raw's rate), for the 16- or 32-CPU
# H200 host: where each busy daemon thread's CPU goes, by symbol, at 16 in flight.
#   1. the plugin path alone (`tcpxctl bench raw`), 64 KiB at 16 in flight, READ and WRITE: GB/s;
#   2. per variant and op, a run of benches/inflight_threads.py without sampling: GB/s, the steady
#      window's busy share, phases, CPU per thread kind and actions (µs a transfer);
#   3. the same run with --perf-record: `perf record -F $FREQ --call-graph $CALLGRAPH -t TID` on
#      each busy daemon thread over the steady window (at most $PERF_SECS), then per thread its CPU
#      a transfer and `perf report --no-children` top symbols as µs a transfer, the inclusive top
#      and, for the pollers and the sessions thread, the callers of the top self symbols.
# Variants (one build, through wrappers): both = TCPXD_SESSION_THREAD=on TCPXD_LANE_THREAD=on
# (session 32's figures), sess = TCPXD_SESSION_THREAD=on TCPXD_LANE_THREAD=off (the default on
# 8+ CPUs). 64 KiB, 16 in flight, GPU 0 -> GPU $PEER through the framed local session. About
# 4-5 minutes on one H200 with the defaults; the perf data files are deleted once reported.
#
#   benches/pollcpu_device.sh BUILD OUT_DIR
#
# BUILD: a folder with a release build's tcpxd, tcpxctl (symbols kept). Environment: CPU_ITERS
# (120000), PEER (1 where nvidia-smi lists two GPUs, else 0), VARIANTS ("both sess"), OPS
# ("read write"), FREQ (1500), PERF_SECS (2), CALLGRAPH (dwarf,8192), SPIN (host default when
# unset), PYTHON (python3). The per-thread `perf report` lists in full (every symbol, or every
# address where tcpxd is stripped: then resolve them with the unstripped build of the same build id
# and the daemons' saved maps) stay in OUT_DIR/perfdata.
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n 2,24p "$0"
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
D=$(cd "$1" && pwd) out=$2
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
default_peer=1
[ "${gpus:-0}" -lt 2 ] && default_peer=0
peer=${PEER:-$default_peer} iters=${CPU_ITERS:-120000} PY=${PYTHON:-python3}
freq=${FREQ:-1500} secs=${PERF_SECS:-2} cg=${CALLGRAPH:-dwarf,8192}
[ -n "${SPIN:-}" ] && export TCPXD_SPIN=$SPIN
rm -rf "$out" && mkdir -p "$out"
out=$(cd "$out" && pwd)
variant() { # NAME SESSION LANE
    local v=$out/v-$1
    mkdir -p "$v"
    printf '#!/bin/sh\nTCPXD_SESSION_THREAD=%s TCPXD_LANE_THREAD=%s exec %s "$@"\n' "$2" "$3" "$D/tcpxd" >"$v/tcpxd"
    chmod +x "$v/tcpxd"
}
variant both on on
variant sess on off
echo "host: $(nproc) CPUs, ${gpus:-0} GPUs; build $D ($(cat "$D/COMMIT" 2>/dev/null || echo '?')); TCPXD_SPIN=${TCPXD_SPIN:-host default}; GPU 0 -> $peer"
nsym=$(nm "$D/tcpxd" 2>/dev/null | wc -l || true)
echo "tcpxd symbols: $nsym; perf: $(perf --version 2>&1 || echo missing)"
[ "$nsym" -gt 0 ] || echo "WARNING: $D/tcpxd is stripped: the profile shows addresses (stage it with its symbols: strip -d, not strip)"
bench=(--via local --cuda 0 --peer-cuda "$peer" --sizes 64K --concurrency 16 --iters "$iters" --warmup 200)

echo "== 1. raw, 64 KiB at 16 in flight"
for op in ${OPS:-read write}; do
    echo "raw $op: $("$D/tcpxctl" bench raw --cuda 0 --op "$op" --sizes 64K --iters 60000 --warmup 100 \
        --concurrency 16 --json | "$PY" -c 'import json,sys; print(" ".join(str(json.loads(l)["gb_per_s"]) for l in sys.stdin if l.startswith("{")))') GB/s"
done

for op in ${OPS:-read write}; do
    for v in ${VARIANTS:-both sess}; do
        f=$out/plain-$op-$v.txt
        echo "== 2. $op $v, no sampling"
        "$PY" "$here/inflight_threads.py" --tcpxctl "$D/tcpxctl" -- --daemon "$out/v-$v/tcpxd" --op "$op" \
            "${bench[@]}" >"$f" 2>&1 || echo "(failed: see $f)"
        grep -E '^daemon-local' "$f" | head -2 || true
        sed -n '/^Steady window/,$p' "$f"
        f=$out/perf-$op-$v.txt
        echo "== 3. $op $v, perf record"
        "$PY" "$here/inflight_threads.py" --perf-record "$out/perfdata" --perf-freq "$freq" --perf-secs "$secs" \
            --perf-callgraph "$cg" --tcpxctl "$D/tcpxctl" -- --daemon "$out/v-$v/tcpxd" --op "$op" \
            "${bench[@]}" >"$f" 2>&1 || echo "(failed: see $f)"
        grep -E '^daemon-local' "$f" | head -2 || true
        sed -n '/^perf record -F/,$p' "$f"
    done
done
rm -f "$out"/perfdata/*.data
echo "(full outputs in $out)"
