#!/usr/bin/env bash
# Small transfers inline on the control connection (session 23, `transfer.inline_*`) on a GPU
# host, with the lead's staged release binaries:
#
#   benches/inline_device.sh BIN_DIR [BEFORE_BIN_DIR] [GPU]
#
# BIN_DIR: this tree's release `tcpxctl` and `tcpxd`; BEFORE_BIN_DIR: main's (optional: its
# `tcpxd`, run in the same rounds). GPU: the CUDA device for part 3 (default 0).
#   1. host memory, ABBA rounds (A = inline on, the default 64 KiB; B = TCPXD_INLINE_MAX_BYTES=0,
#      the lanes; C = main when given), WRITE and READ at 4K,16K,64K: p50 / p99 per round.
#   2. hop traces of an inline 4 KiB WRITE and READ (RUST_LOG=tcpxd::hop=trace, benches/hops.py):
#      the steps between the two daemons' events.
#   3. GPU memory (both daemons' buffers on GPU, one GPU under MPS), 4K and 16K WRITE and READ:
#      TCPXD_INLINE_GPU=on against off (on is the default, one GPU transfer inline per pairing at a
#      time: benches/inline_gpu_window.sh checks it with 8 in flight between two GPUs).
# Rounds: ROUNDS (default 2); iterations ITERS (default 500).
set -euo pipefail
if [ $# -lt 1 ] || [ ! -x "$1/tcpxctl" ] || [ ! -x "$1/tcpxd" ]; then
  echo "usage: $0 BIN_DIR [BEFORE_BIN_DIR] [GPU]  (BIN_DIR with tcpxctl and tcpxd)" >&2
  exit 2
fi
here="$(cd "$(dirname "$0")/.." && pwd)"
bin="$(cd "$1" && pwd)"
before="${2:-}"
gpu="${3:-0}"
rounds="${ROUNDS:-2}"
iters="${ITERS:-500}"
echo "host: $(nproc) CPUs; binaries: $bin${before:+; before: $before}; GPU $gpu"

# One run: label, daemon binary, op, sizes, then extra tcpxctl arguments; prints p50 / p99 rows.
run() {
  local label="$1" daemon="$2" op="$3" sizes="$4"
  shift 4
  echo "-- $label $op"
  "$bin/tcpxctl" bench transfer --daemon "$daemon" --op "$op" --sizes "$sizes" \
    --iters "$iters" --warmup 50 "$@" 2>&1 | grep -E "^(harness|daemon)" || true
}

echo "== 1. host memory, alternating (A inline, B lanes${before:+, C main})"
for r in $(seq 1 "$rounds"); do
  for op in write read; do
    echo "== round $r"
    run "A inline" "$bin/tcpxd" "$op" 4K,16K,64K
    TCPXD_INLINE_MAX_BYTES=0 run "B lanes" "$bin/tcpxd" "$op" 4K,16K,64K
    [ -n "$before" ] && run "C main" "$before/tcpxd" "$op" 4K,16K,64K
    TCPXD_INLINE_MAX_BYTES=0 run "B lanes" "$bin/tcpxd" "$op" 4K,16K,64K
    run "A inline" "$bin/tcpxd" "$op" 4K,16K,64K
  done
done

hops() {
  local op="$1" size="$2"
  shift 2
  local out dir
  out="$(RUST_LOG=tcpxd::hop=trace "$bin/tcpxctl" bench transfer --daemon "$bin/tcpxd" --op "$op" \
    --sizes "$size" --iters 300 --warmup 30 --keep-dir "$@" 2>&1)"
  dir="$(echo "$out" | sed -n 's/^tcpxctl: kept //p' | tail -1)"
  echo "== 2. hops of $op $size $* (logs in $dir)"
  echo "$out" | tail -1
  python3 "$here/benches/hops.py" "$dir/bench-a.log" "$dir/bench-b.log"
}
hops write 4K
hops read 4K

echo "== 3. GPU $gpu: inline_gpu on against off (two daemons on one GPU under MPS)"
export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
root="$(mktemp -d)"
CUDA_MPS_PIPE_DIRECTORY="$root/pipe"
CUDA_MPS_LOG_DIRECTORY="$root/log"
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d
trap 'echo quit | nvidia-cuda-mps-control || true' EXIT
for r in $(seq 1 "$rounds"); do
  for op in write read; do
    echo "== round $r"
    TCPXD_INLINE_GPU=on run "gpu inline" "$bin/tcpxd" "$op" 4K,16K --cuda "$gpu" --peer-cuda "$gpu"
    TCPXD_INLINE_GPU=off run "gpu lanes" "$bin/tcpxd" "$op" 4K,16K --cuda "$gpu" --peer-cuda "$gpu"
    TCPXD_INLINE_GPU=off run "gpu lanes" "$bin/tcpxd" "$op" 4K,16K --cuda "$gpu" --peer-cuda "$gpu"
    TCPXD_INLINE_GPU=on run "gpu inline" "$bin/tcpxd" "$op" 4K,16K --cuda "$gpu" --peer-cuda "$gpu"
  done
done
hops write 4K --cuda "$gpu" --peer-cuda "$gpu"
