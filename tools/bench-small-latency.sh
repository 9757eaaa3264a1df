#!/usr/bin/env bash
# Issue #38's small-transfer targets (daemon ÷ raw ≥ 0.95 from 64 KiB, 4 KiB p50 ≤ 1.15× raw) and
# where a small transfer's time goes, in one run:
#
#   tools/bench-small-latency.sh BIN_DIR [GPU] [BEFORE_BIN_DIR]
#
# BIN_DIR holds release binaries `tcpxctl` and `tcpxd` (e.g. target/release); BEFORE_BIN_DIR, if
# given, another tree's `tcpxd`, run beside BIN_DIR's in every round (ABBA). With GPU, both sides'
# buffers are on that CUDA device (two daemons on one GPU, under a private MPS daemon; the
# emulation in CUDA mode, GPU credits on), else host memory.
#   1. benches/small_latency.py: raw and daemon (and before) alternating, WRITE and READ, 4K-16M,
#      three rounds: p50s, GB/s and the ratios;
#   2. hop traces (RUST_LOG=tcpxd::hop=trace, benches/hops.py) of 4 KiB and 64 KiB WRITEs and a
#      4 KiB READ: the p50 of each step between the two daemons' events.
# Extra arguments for step 1: SMALL_ARGS (default "--iters 200 --warmup 20 --rounds 3").
set -euo pipefail
if [ $# -lt 1 ] || [ ! -x "$1/tcpxctl" ] || [ ! -x "$1/tcpxd" ]; then
  echo "usage: $0 BIN_DIR [GPU] [BEFORE_BIN_DIR]  (BIN_DIR with tcpxctl and tcpxd)" >&2
  exit 2
fi
here="$(cd "$(dirname "$0")/.." && pwd)"
bin="$(cd "$1" && pwd)"
gpu="${2:-}"
before="${3:-}"
echo "host: $(nproc) CPUs; binaries: $bin${before:+; before: $before}"

mem=()
py=()
if [ -n "$gpu" ]; then
  mem=(--cuda "$gpu" --peer-cuda "$gpu")
  py=(--cuda "$gpu" --mps)
fi
if [ -n "$before" ]; then
  py+=(--bin-before "$(cd "$before" && pwd)")
fi

echo "== 1. daemon ÷ raw, alternating"
python3 "$here/benches/small_latency.py" --bin "$bin" --sizes 4K,64K,1M,16M ${SMALL_ARGS:---iters 200 --warmup 20 --rounds 3} \
  "${py[@]}" --out small_latency.jsonl

# One hop trace: prints the split of the most common order of events.
hops() {
  local op="$1" size="$2"
  local out dir
  out="$(RUST_LOG=tcpxd::hop=trace "$bin/tcpxctl" bench transfer --daemon "$bin/tcpxd" --op "$op" "${mem[@]}" \
    --sizes "$size" --iters 300 --warmup 30 --keep-dir 2>&1)"
  dir="$(echo "$out" | sed -n 's/^tcpxctl: kept //p' | tail -1)"
  echo "== 2. hops of $op $size (logs in $dir)"
  echo "$out" | tail -1
  python3 "$here/benches/hops.py" "$dir/bench-a.log" "$dir/bench-b.log"
}
if [ -n "$gpu" ]; then
  # Two daemons on one GPU time-slice it without MPS (benches/compare.py, --mps).
  export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  root="$(mktemp -d)"
  CUDA_MPS_PIPE_DIRECTORY="$root/pipe"
  CUDA_MPS_LOG_DIRECTORY="$root/log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d
  trap 'echo quit | nvidia-cuda-mps-control || true' EXIT
fi
hops write 4K
hops write 64K
hops read 4K
