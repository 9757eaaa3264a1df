#!/usr/bin/env bash
# Issue #38, 8 and 16 in flight (session 28, sendlanes): the sending poller's cost per transfer
# before and after the sparse returned credits (peer protocol 12) and the lane tests, GPU 0 -> 1,
# 64 KiB WRITEs, runs alternating A B B A at each depth, each through benches/inflight_threads.py
# (session 27's command: the steady window, the middle 60% of daemon a's transfers). Prints, per
# run, transfers/s and daemon a's busy µs per transfer, busy share and phases; then raw rows
# (`tcpxctl bench raw`, the plugin alone, GPU 0) for daemon ÷ raw. About 3 minutes on two H200s.
#
#   benches/sendlanes_device.sh BEFORE_DIR AFTER_DIR [OUT_DIR]
#
# Each dir holds a release build's staged tcpxd, tcpxctl, libnccl_net_tcpxemu.so.
# Environment: ITERS (100000), CONC ("8 16"), PEER (1: the peer daemon's GPU).
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n 2,14p "$0"
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
before=$(cd "$1" && pwd) after=$(cd "$2" && pwd) out=${3:-/tmp/sendlanes-device}
iters=${ITERS:-100000} conc=${CONC:-8 16} peer=${PEER:-1}
rm -rf "$out" && mkdir -p "$out"
export TCPXD_SPIN=off
for c in $conc; do
    n=0
    for who in A B B A; do
        n=$((n + 1))
        d=$before
        [ "$who" = B ] && d=$after
        f="$out/c$c-run$n-$who.txt"
        python3 "$here/inflight_threads.py" --tcpxctl "$d/tcpxctl" -- --daemon "$d/tcpxd" --via local \
            --cuda 0 --peer-cuda "$peer" --sizes 64K --iters "$iters" --concurrency "$c" --op write >"$f" 2>&1 || true
        steady=$(awk '/^Steady window/{print; f=1; next} f&&/^process /{print} f&&/^daemon a /{print; n++} n==2{exit}' "$f")
        echo "== $c in flight, run $n ($who)"
        grep -E '^daemon-local' "$f" || echo "(no bench row: see $f)"
        echo "$steady"
    done
    "$before/tcpxctl" bench raw --cuda 0 --sizes 64K --iters 4000 --concurrency "$c" >"$out/c$c-raw.txt" 2>&1 || true
    echo "== $c in flight, raw"
    grep -E '^raw' "$out/c$c-raw.txt" || cat "$out/c$c-raw.txt"
done
