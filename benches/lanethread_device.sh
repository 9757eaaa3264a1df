#!/usr/bin/env bash
# Session 30, lanethread, for the 16- or 32-CPU H200 host: the send lanes' plugin calls on the
# lane thread (`runtime.lane_thread` on: TCPXD_LANE_THREAD=on, which main ignores), this branch
# (A) against main (B).
#   1. issue #38: 64 KiB at 8 and 16 in flight, WRITE then READ, GPU 0 -> GPU $PEER, runs
#      alternating A B B A, each through benches/inflight_threads.py: per run the bench row,
#      daemon a's and b's poller and lane thread CPU per transfer, and the steady window (busy
#      µs per transfer, busy share, phases, each thread kind's CPU, actions); then the raw rows
#      (`tcpxctl bench raw`, the plugin alone) at 8 and 16 for daemon ÷ raw;
#   2. one at a time: `tcpxctl bench transfer --sizes 4K|256K --concurrency 1` A B B A (4 KiB
#      goes inline, no lane; 256 KiB crosses to the lane thread and back), and
#      benches/board_ab.py --variants B (tcpxd.Client.read / write, tcpxd.nixl READ polled tight
#      and with sleep(0), its WRITE), p50 / p99 and A ÷ B per round.
# About 5 minutes at the defaults on two H200s.
#
#   benches/lanethread_device.sh A B [OUT_DIR]
#
# A / B: folders with a release build's tcpxd, tcpxctl, libnccl_net_tcpxemu.so and python/src
# (its C pass built in place). Environment: ITERS (100000), PEER (the peer daemon's GPU: 1 where
# nvidia-smi lists two GPUs, else 0), ROUNDS (2), SMALL_ITERS (2000), PYTHON (python3).
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n 2,20p "$0"
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
A=$(cd "$1" && pwd) B=$(cd "$2" && pwd) out=${3:-/tmp/lanethread-device}
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
default_peer=1
[ "${gpus:-0}" -lt 2 ] && default_peer=0
iters=${ITERS:-100000} peer=${PEER:-$default_peer} rounds=${ROUNDS:-2} small=${SMALL_ITERS:-2000}
PY=${PYTHON:-python3}
rm -rf "$out" && mkdir -p "$out"
export TCPXD_LANE_THREAD=on
echo "host: $(nproc) CPUs, ${gpus:-0} GPUs; A=$A B=$B; TCPXD_LANE_THREAD=on (A only)"

echo "== 1. 64 KiB, 8 and 16 in flight, GPU 0 -> $peer (TCPXD_SPIN=off: the threads' work, not their polling)"
for op in write read; do
    for c in 8 16; do
        n=0
        for who in A B B A; do
            n=$((n + 1))
            d=$A
            [ "$who" = B ] && d=$B
            f="$out/$op-c$c-run$n-$who.txt"
            TCPXD_SPIN=off $PY "$here/inflight_threads.py" --tcpxctl "$d/tcpxctl" -- --daemon "$d/tcpxd" --via local \
                --cuda 0 --peer-cuda "$peer" --sizes 64K --iters "$iters" --concurrency "$c" --op "$op" >"$f" 2>&1 || true
            echo "-- $op, $c in flight, run $n ($who)"
            grep -E '^daemon-local' "$f" || echo "(no bench row: see $f)"
            grep -E '^daemon [ab] +tcpxd-(poller|lanes)' "$f" | head -4 || true
            sed -n '/^Steady window/,$p' "$f"
        done
    done
done
for c in 8 16; do
    "$A/tcpxctl" bench raw --cuda 0 --sizes 64K --iters 4000 --concurrency "$c" >"$out/raw-c$c.txt" 2>&1 || true
    echo "-- raw, $c in flight"
    grep -E '^raw' "$out/raw-c$c.txt" || cat "$out/raw-c$c.txt"
done

echo "== 2. one at a time: 4 KiB (inline: no lane) and 256 KiB (the lanes, through the lane thread)"
for sz in 4K 256K; do
    n=0
    for who in A B B A; do
        n=$((n + 1))
        d=$A
        [ "$who" = B ] && d=$B
        for op in write read; do
            f="$out/one-$sz-$op-run$n-$who.txt"
            "$d/tcpxctl" bench transfer --daemon "$d/tcpxd" --via local --cuda 0 --peer-cuda "$peer" --sizes "$sz" \
                --concurrency 1 --op "$op" --iters 5000 >"$f" 2>&1 || true
            echo "-- $sz $op, 1 in flight, run $n ($who)"
            grep -E '^daemon-local' "$f" || tail -3 "$f"
        done
    done
done
$PY "$here/board_ab.py" --after-bin "$A/tcpxd" --after-py "$A/python/src" --before-bin "$B/tcpxd" \
    --before-py "$B/python/src" --variants B --rounds "$rounds" --iters "$small" --only read,write,nixl \
    2>&1 | tee "$out/small.txt"
