#!/usr/bin/env bash
# GPU memory inline with its device copies off the poller (session 24, poller/inline_copies.rs):
# decides whether `transfer.inline_gpu` may default to on, and `transfer.inline_gpu_in_flight`
# to more than 1. With the lead's staged release binaries:
#
#   benches/inline_gpu_async.sh BIN_DIR BEFORE_DIR OUT_DIR [--same-gpu] [GPU] [PEER_GPU]
#
# BIN_DIR: this tree's release `tcpxctl` and `tcpxd`; BEFORE_DIR: main's release `tcpxd` before
# the session (/work/before-s24: GPU inline off by default there). OUT_DIR: the JSON rows and the
# summary. GPU → PEER_GPU (default 0 → 1, two H200s); `--same-gpu`: both daemons on GPU (default
# 0) under a private MPS control daemon (one H200). Configurations, alternating within each round:
#   A   this tree, TCPXD_INLINE_GPU=on, TCPXD_INLINE_GPU_IN_FLIGHT=8 (the candidate default; the
#       inline window stays at its default 256 KiB, so of eight 64 KiB in flight four go inline
#       and four by the lanes: A_WINDOW=1048576 makes all eight inline);
#   A1  this tree, TCPXD_INLINE_GPU=on, in flight 1 (session 23's bound; 8 in flight only);
#   B   this tree, TCPXD_INLINE_GPU=off (the lanes: this tree's default);
#   C   BEFORE_DIR's tcpxd, its defaults;
#   raw `tcpxctl bench raw` on GPU (the plugin driven directly, one process on one GPU).
# Rows: WRITE and READ, (1) one at a time 4K,16K,64K p50 (A B C C B A raw), (2) 8 in flight
# 16K,64K GB/s (A A1 B C C B A1 A raw). The summary prints each configuration's median over
# rounds and, per round, A ÷ B, A ÷ C and A ÷ raw (p50: lower is better for A; GB/s: higher).
# ROUNDS (default 1: each configuration still runs twice a round, A B C C B A), ITERS (default
# 300, one at a time), ITERS_8 (default 3000, 8 in flight). 36 runs of two daemons a round (16 s
# with debug builds on the CUDA stand-in of the 2-core VM; on the H200 the daemons' CUDA start-up
# dominates: expected well under 4 minutes a call).
set -euo pipefail
if [ $# -lt 3 ] || [ ! -x "$1/tcpxctl" ] || [ ! -x "$1/tcpxd" ] || [ ! -x "$2/tcpxd" ]; then
  sed -n 2,26p "$0" >&2
  exit 2
fi
here="$(cd "$(dirname "$0")/.." && pwd)"
bin="$(cd "$1" && pwd)"
before="$(cd "$2" && pwd)"
out="$3"
shift 3
same=0
if [ "${1:-}" = "--same-gpu" ]; then
  same=1
  shift
fi
gpu="${1:-0}"
if [ "$same" = 1 ]; then peer="$gpu"; else peer="${2:-1}"; fi
rounds="${ROUNDS:-1}"
iters="${ITERS:-300}"
iters8="${ITERS_8:-3000}"
mkdir -p "$out"
rm -f "$out"/*.jsonl
echo "host: $(nproc) CPUs; binaries: $bin; before: $before; GPU $gpu -> $peer (same GPU: $same)"

if [ "$same" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  root="$(mktemp -d)"
  CUDA_MPS_PIPE_DIRECTORY="$root/pipe"
  CUDA_MPS_LOG_DIRECTORY="$root/log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d
  trap 'echo quit | nvidia-cuda-mps-control || true' EXIT
fi

# One daemon run: label, daemon binary, op, sizes, iterations, then extra tcpxctl arguments.
# Its rows are appended to OUT_DIR/<label>.r<round>.jsonl.
run() {
  local label="$1" daemon="$2" op="$3" sizes="$4" n="$5"
  shift 5
  echo "-- round $round $label $op $sizes $*"
  "$bin/tcpxctl" bench transfer --daemon "$daemon" --op "$op" --sizes "$sizes" --iters "$n" \
    --warmup 50 --cuda "$gpu" --peer-cuda "$peer" --out "$out/$label.r$round.jsonl" "$@" 2>&1 \
    | grep -E "^(harness|daemon)" || echo "   (no rows: see above)"
}
raw() {
  local op="$1" sizes="$2" n="$3"
  shift 3
  echo "-- round $round raw $op $sizes $*"
  "$bin/tcpxctl" bench raw --op "$op" --sizes "$sizes" --iters "$n" --warmup 50 --cuda "$gpu" \
    --out "$out/raw.r$round.jsonl" "$@" 2>&1 | grep -E "^(harness|raw)" || echo "   (no rows)"
}
A() {
  (export TCPXD_INLINE_GPU=on TCPXD_INLINE_GPU_IN_FLIGHT=8
   if [ -n "${A_WINDOW:-}" ]; then export TCPXD_INLINE_WINDOW_BYTES="$A_WINDOW"; fi
   run A "$bin/tcpxd" "$@")
}
A1() { TCPXD_INLINE_GPU=on TCPXD_INLINE_GPU_IN_FLIGHT=1 run A1 "$bin/tcpxd" "$@"; }
B() { TCPXD_INLINE_GPU=off run B "$bin/tcpxd" "$@"; }
C() { (unset TCPXD_INLINE_GPU TCPXD_INLINE_GPU_IN_FLIGHT; run C "$before/tcpxd" "$@"); }

start=$(date +%s)
for round in $(seq 1 "$rounds"); do
  for op in write read; do
    one=("$op" 4K,16K,64K "$iters")
    A "${one[@]}"; B "${one[@]}"; C "${one[@]}"; C "${one[@]}"; B "${one[@]}"; A "${one[@]}"
    raw "${one[@]}"
    eight=("$op" 16K,64K "$iters8" --concurrency 8)
    A "${eight[@]}"; A1 "${eight[@]}"; B "${eight[@]}"; C "${eight[@]}"
    C "${eight[@]}"; B "${eight[@]}"; A1 "${eight[@]}"; A "${eight[@]}"
    raw "${eight[@]}"
  done
done
echo "== $(($(date +%s) - start)) s"
python3 "$here/benches/inline_gpu_async_summary.py" "$out" | tee "$out/summary.txt"
