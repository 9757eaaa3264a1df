#!/usr/bin/env bash
# Session 29, ctlcork (issue #38, 8 and 16 in flight): the direct control connection's messages
# written once per pass per pairing instead of once per batch of actions. Two parts, about 5
# minutes on two H200s:
#   1. daemon ÷ raw at 8 and 16 in flight, 64 KiB WRITE and READ, both builds alternating
#      (benches/inflight_sweep.sh, its table: `d/raw b`, `d/raw a`, `a/b` on the `local` rows);
#   2. per build, 16 in flight, WRITE then READ, through benches/inflight_threads.py --syscalls:
#      both daemons' pollers' busy µs per transfer in the steady window and, with `perf` on the
#      host, their system calls per transfer (`send direct`: the direct connection's `send`s).
#
#   benches/ctlcork_device.sh AFTER_DIR BEFORE_DIR OUT_DIR [ITERS]
#
# AFTER_DIR / BEFORE_DIR hold staged release `tcpxd` and `tcpxctl`. GPU 0 -> GPU 1 when two GPUs
# are visible, else GPU 0 -> GPU 0. TCPXD_SPIN=off in part 2 (the pollers' work alone).
set -euo pipefail
if [ $# -lt 3 ]; then
    sed -n 2,15p "$0"
    exit 2
fi
after=$(realpath "$1") before=$(realpath "$2") out=$3 iters=${4:-60000}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
out=$(realpath "$out")
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
peer=0
[ "${gpus:-1}" -ge 2 ] && peer=1
echo "== part 1: daemon ÷ raw (inflight_sweep.sh, 64K, 8 and 16 in flight, WRITE and READ, 2 rounds)"
"$here/inflight_sweep.sh" "$before" "$after" "$out/sweep" --cuda 0 --peer-cuda "$peer" --conc "8 16" \
    --sizes 64K --ops "write read" --iters 20000 --rounds 2 2>"$out/sweep.err" | tee "$out/sweep.txt" || true
echo "== part 2: the pollers per transfer (inflight_threads.py --syscalls, 16 in flight; B = before, A = after)"
export TCPXD_SPIN=off
n=0
for op in write read; do
    for who in B A A B; do
        n=$((n + 1))
        dir=$before
        [ "$who" = A ] && dir=$after
        f="$out/threads$n-$who-$op.txt"
        python3 "$here/inflight_threads.py" --syscalls --tcpxctl "$dir/tcpxctl" -- --daemon "$dir/tcpxd" \
            --via local --cuda 0 --peer-cuda "$peer" --sizes 64K --concurrency 16 --op "$op" \
            --iters "$iters" --warmup 500 >"$f" 2>&1 || true
        echo "-- run $n: $who $op"
        grep -E '^daemon-local' "$f" || echo "(no bench row: see $f)"
        awk '/^Steady window/{f=1} f' "$f" | grep -E '^(Steady|process|daemon [ab] )' | head -3
        awk '/^Pollers. system calls/{f=1} f' "$f" | head -4
    done
done
echo "(full outputs in $out)"
