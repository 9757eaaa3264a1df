#!/usr/bin/env bash
# Session 33, alloc: the poller's CPU a transfer, build A against build B, on a CPU-only host
# (the CUDA stand-in, GPU 0 -> 1), 64 KiB at 16 in flight, READ then WRITE, the builds run
# B A A B (ROUNDS times), each run through benches/inflight_threads.py; prints per run the steady
# window's CPU a transfer of each daemon's poller thread and the bench's GB/s, then medians, A/B.
#
#   benches/alloc_ab_vm.sh A B OUT_DIR
#
# A, B: folders with a release build's tcpxd, tcpxctl and libtcpxd_cudastub.so. Environment:
# ITERS (30000), ROUNDS (1), OPS ("read write"), CONC (16), VARIANT env for the daemons
# (default TCPXD_SESSION_THREAD=on TCPXD_LANE_THREAD=off), PYTHON (python3).
set -euo pipefail
[ $# -lt 3 ] && { sed -n 2,12p "$0"; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
A=$(cd "$1" && pwd) B=$(cd "$2" && pwd) out=$3
rm -rf "$out" && mkdir -p "$out" && out=$(cd "$out" && pwd)
iters=${ITERS:-30000} rounds=${ROUNDS:-1} ops=${OPS:-read write} conc=${CONC:-16}
PY=${PYTHON:-python3}
for b in A B; do
    d=$A; [ $b = B ] && d=$B
    mkdir -p "$out/$b/lib"
    ln -sf "$d/libtcpxd_cudastub.so" "$out/$b/lib/libcuda.so.1"
    printf '#!/bin/sh\nexport LD_LIBRARY_PATH=%s\nTCPXD_SESSION_THREAD=on TCPXD_LANE_THREAD=off exec %s "$@"\n' \
        "$out/$b/lib" "$d/tcpxd" >"$out/$b/tcpxd"
    chmod +x "$out/$b/tcpxd"
done
export TCPXD_CUDASTUB_DEVICES=8 TCPXEMU_BOUNCE_PAGES=2048 UCCL_TCPX_UNPACK_IMPL=d2d TCPXD_SPIN=off
for op in $ops; do
    for ((r = 0; r < rounds; r++)); do
        for b in B A A B; do
            f=$out/$op-$b-$r-$RANDOM.txt
            LD_LIBRARY_PATH=$out/$b/lib "$PY" "$here/inflight_threads.py" --tcpxctl "$B/tcpxctl" -- \
                --daemon "$out/$b/tcpxd" --via local --cuda 0 --peer-cuda 1 --sizes 64K \
                --concurrency "$conc" --op "$op" --iters "$iters" --warmup 200 >"$f" 2>&1 || echo "($op $b failed: $f)"
            echo "$op $b: $(grep -A40 '^Steady window (' "$f" | grep ' cpu: ' | sed -E 's/^(daemon .).*cpu: (.*)/\1 \2/' | tr '\n' ';' | cut -c1-200)"
        done
    done
done
