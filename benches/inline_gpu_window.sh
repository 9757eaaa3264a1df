#!/usr/bin/env bash
# GPU memory inline with its per-pairing bound (`transfer.inline_gpu`, on by default, and
# `transfer.inline_gpu_in_flight`, default 1) on two GPUs, with the lead's staged release binaries:
#
#   benches/inline_gpu_window.sh BIN_DIR [GPU] [PEER_GPU]
#
# BIN_DIR: this tree's release `tcpxctl` and `tcpxd`. GPU → PEER_GPU (default 0 → 1). Alternating
# ABBA rounds (A = the defaults: GPU inline on, one in flight per pairing; B = TCPXD_INLINE_GPU=off,
# the lanes), WRITE and READ:
#   1. one at a time, 4K,16K,64K: p50 / p99 (A should keep session 23's win: 4 KiB 65-74 us
#      against 177-210);
#   2. 8 in flight, 16K,64K: GB/s (A should be no worse than B: before the bound, all inline,
#      64 KiB 1.0 against 1.9 GB/s, 16 KiB 0.46 against 0.60);
#   3. the same with TCPXD_INLINE_GPU_IN_FLIGHT=8 (C: the old unbounded behaviour, for reference).
# Rounds: ROUNDS (default 2); iterations ITERS (default 300) and ITERS_8 (default 3000).
set -euo pipefail
if [ $# -lt 1 ] || [ ! -x "$1/tcpxctl" ] || [ ! -x "$1/tcpxd" ]; then
  echo "usage: $0 BIN_DIR [GPU] [PEER_GPU]  (BIN_DIR with tcpxctl and tcpxd)" >&2
  exit 2
fi
bin="$(cd "$1" && pwd)"
gpu="${2:-0}"
peer="${3:-1}"
rounds="${ROUNDS:-2}"
iters="${ITERS:-300}"
iters8="${ITERS_8:-3000}"
echo "host: $(nproc) CPUs; binaries: $bin; GPU $gpu -> $peer"

# One run: label, op, sizes, iterations, then extra tcpxctl arguments.
run() {
  local label="$1" op="$2" sizes="$3" n="$4"
  shift 4
  echo "-- $label $op"
  "$bin/tcpxctl" bench transfer --daemon "$bin/tcpxd" --op "$op" --sizes "$sizes" \
    --iters "$n" --warmup 50 --cuda "$gpu" --peer-cuda "$peer" "$@" 2>&1 | grep -E "^(harness|daemon)" || true
}

for r in $(seq 1 "$rounds"); do
  for op in write read; do
    echo "== 1. round $r, one at a time"
    run "A bounded inline" "$op" 4K,16K,64K "$iters"
    TCPXD_INLINE_GPU=off run "B lanes" "$op" 4K,16K,64K "$iters"
    TCPXD_INLINE_GPU=off run "B lanes" "$op" 4K,16K,64K "$iters"
    run "A bounded inline" "$op" 4K,16K,64K "$iters"
    echo "== 2. round $r, 8 in flight"
    run "A bounded inline" "$op" 16K,64K "$iters8" --concurrency 8
    TCPXD_INLINE_GPU=off run "B lanes" "$op" 16K,64K "$iters8" --concurrency 8
    TCPXD_INLINE_GPU_IN_FLIGHT=8 run "C unbounded inline" "$op" 16K,64K "$iters8" --concurrency 8
    TCPXD_INLINE_GPU=off run "B lanes" "$op" 16K,64K "$iters8" --concurrency 8
    run "A bounded inline" "$op" 16K,64K "$iters8" --concurrency 8
  done
done
