#!/usr/bin/env bash
# Session 29, readside, for the 16- or 32-CPU H200 host: where a READ's initiating poller spends
# more than a WRITE's (issue #38), this branch (A) against main (B).
#   64 KiB at 16 in flight, WRITE then READ, GPU 0 -> GPU $PEER, runs alternating A B B A, each
#   through benches/inflight_threads.py --syscalls (perf stat on the pollers, when `perf` runs):
#   per run the bench row, both pollers' CPU µs per transfer, and the steady window of BOTH
#   daemons (phases and actions): a READ's daemon a does the receiving work that daemon b does
#   in a WRITE, so compare "READ, daemon a" with "WRITE, daemon a" + "WRITE, daemon b"'s
#   test_lanes / consume. With PERF=1 (and `perf` there), one more READ and WRITE run of A with
#   each poller recorded for 3 s mid-run (perf-{read,write}-{a,b}.data, `perf report -i ...`).
# About 3 minutes at the defaults.
#
#   benches/readside_device.sh A B [OUT_DIR]
#
# A / B: folders with a release build's tcpxd and tcpxctl. Environment: ITERS (100000), PEER (the
# peer daemon's GPU: 1 where nvidia-smi lists two GPUs, else 0), PERF (0), PYTHON (python3).
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n 2,17p "$0"
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
A=$(cd "$1" && pwd) B=$(cd "$2" && pwd) out=${3:-/tmp/readside-device}
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
default_peer=1
[ "${gpus:-0}" -lt 2 ] && default_peer=0
iters=${ITERS:-100000} peer=${PEER:-$default_peer}
PY=${PYTHON:-python3}
sys=()
perf stat -e task-clock true >/dev/null 2>&1 && sys=(--syscalls)
rm -rf "$out" && mkdir -p "$out"
echo "host: $(nproc) CPUs, ${gpus:-0} GPUs; A=$A B=$B; ${sys[*]:-no perf: no syscall counts}"

run() { # who op file [perf tag]
    local d=$A
    [ "$1" = B ] && d=$B
    TCPXD_SPIN=off $PY "$here/inflight_threads.py" "${sys[@]}" --tcpxctl "$d/tcpxctl" -- --daemon "$d/tcpxd" \
        --via local --cuda 0 --peer-cuda "$peer" --sizes 64K --iters "$iters" --concurrency 16 --op "$2" >"$3" 2>&1 || true
}

echo "== 64 KiB, 16 in flight, GPU 0 -> $peer (TCPXD_SPIN=off: the pollers' work, not their polling)"
for op in write read; do
    n=0
    for who in A B B A; do
        n=$((n + 1))
        f="$out/$op-run$n-$who.txt"
        run "$who" "$op" "$f"
        echo "-- $op, run $n ($who)"
        grep -E '^daemon-local' "$f" || echo "(no bench row: see $f)"
        grep -E '^daemon [ab] +tcpxd-poller' "$f" || true
        sed -n '/^Steady window/,/^$/p' "$f"
        sed -n '/^Pollers. system calls/,/^$/p' "$f"
    done
done

if [ "${PERF:-0}" = 1 ] && [ ${#sys[@]} -gt 0 ]; then
    echo "== perf record of both pollers, 3 s mid-run (A)"
    for op in write read; do
        run A "$op" "$out/perf-$op.txt" &
        bench=$!
        sleep 4
        for node in a b; do
            pid=$(pgrep -f "tcpxd.*--node-id bench-$node" | head -1 || true)
            [ -n "$pid" ] || continue
            tid=$(grep -l '^tcpxd-poller$' /proc/"$pid"/task/*/comm | head -1 | cut -d/ -f5)
            perf record -q --call-graph dwarf,16384 -F 2000 -t "$tid" -o "$out/perf-$op-$node.data" -- sleep 3 \
                >/dev/null 2>&1 &
        done
        wait
        echo "-- $op: $(ls "$out"/perf-"$op"-*.data 2>/dev/null | tr '\n' ' ')"
    done
fi
