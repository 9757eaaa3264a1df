#!/usr/bin/env bash
# Session 30, sessthread, for the 16- or 32-CPU H200 host: the framed sessions' reads, checks,
# answers and event writes on a thread of their own (`runtime.session_thread=on`,
# `tcpxd-sessions`), this branch (A, the option on) against main (B).
#   1. issue #38: 64 KiB at 16 then 8 in flight, WRITE then READ, GPU 0 -> GPU $PEER, runs
#      alternating A B B A, each through benches/inflight_threads.py: per run the bench row,
#      daemon a's steady window (poller busy µs per transfer and busy share, its phases) and the
#      CPU per transfer of daemon a's threads (tcpxd-poller, tcpxd-sessions); then the raw rows
#      (`tcpxctl bench raw`, the plugin alone, 16 and 8 in flight) for daemon ÷ raw;
#   2. 4 KiB calls through the framed session as a user sees them (benches/board_ab.py
#      --variants B: tcpxd.Client.read / write, tcpxd.nixl READ polled tight and with sleep(0),
#      its WRITE), p50 / p99 and A ÷ B per round: one at a time must not get worse.
# TCPXD_SPIN is left to the host (auto: on with 16 CPUs), as deployed; SPIN=off to see the
# threads' work alone. About 5 minutes at the defaults on two H200s.
#
#   benches/sessthread_device.sh A B [OUT_DIR]
#
# A / B: folders with a release build's tcpxd, tcpxctl, libnccl_net_tcpxemu.so and python/src
# (its C pass built in place). Environment: ITERS (100000), PEER (the peer daemon's GPU: 1 where
# nvidia-smi lists two GPUs, else 0), ROUNDS (2), SMALL_ITERS (2000), SPIN (auto), PYTHON.
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n 2,22p "$0"
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
A=$(cd "$1" && pwd) B=$(cd "$2" && pwd) out=${3:-/tmp/sessthread-device}
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
default_peer=1
[ "${gpus:-0}" -lt 2 ] && default_peer=0
iters=${ITERS:-100000} peer=${PEER:-$default_peer} rounds=${ROUNDS:-2} small=${SMALL_ITERS:-2000}
spin=${SPIN:-auto}
PY=${PYTHON:-python3}
rm -rf "$out" && mkdir -p "$out"
echo "host: $(nproc) CPUs, ${gpus:-0} GPUs; A=$A B=$B; TCPXD_SPIN=$spin"
# (main's daemon does not know TCPXD_SESSION_THREAD: B runs as it always did)
export TCPXD_SESSION_THREAD=on TCPXD_SPIN=$spin

echo "== 1. 64 KiB, GPU 0 -> $peer"
for conc in 16 8; do
    for op in write read; do
        n=0
        for who in A B B A; do
            n=$((n + 1))
            d=$A
            [ "$who" = B ] && d=$B
            f="$out/$op-c$conc-run$n-$who.txt"
            $PY "$here/inflight_threads.py" --tcpxctl "$d/tcpxctl" -- --daemon "$d/tcpxd" --via local \
                --cuda 0 --peer-cuda "$peer" --sizes 64K --iters "$iters" --concurrency "$conc" --op "$op" >"$f" 2>&1 || true
            echo "-- $op, $conc in flight, run $n ($who)"
            grep -E '^daemon-local' "$f" || echo "(no bench row: see $f)"
            grep -E '^daemon a +tcpxd-(poller|sessions)' "$f" || true
            awk '/^Steady window/{print; f=1; next} f&&/^process /{print} f&&/^daemon a /{print; k++} k==2{exit}' "$f"
        done
    done
    "$A/tcpxctl" bench raw --cuda 0 --sizes 64K --iters 4000 --concurrency "$conc" >"$out/raw-c$conc.txt" 2>&1 || true
    echo "-- raw, $conc in flight"
    grep -E '^raw' "$out/raw-c$conc.txt" || cat "$out/raw-c$conc.txt"
done

echo "== 2. 4 KiB through the framed session, A ÷ B (A B B A x $rounds)"
$PY "$here/board_ab.py" --after-bin "$A/tcpxd" --after-py "$A/python/src" --before-bin "$B/tcpxd" \
    --before-py "$B/python/src" --variants B --rounds "$rounds" --iters "$small" --only read,write,nixl \
    2>&1 | tee "$out/small.txt"
