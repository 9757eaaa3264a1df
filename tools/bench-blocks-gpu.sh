#!/usr/bin/env bash
# The block bench on two GPUs, with the GPU block stages' timing lines summarised.
#
#   tools/bench-blocks-gpu.sh BIN_DIR [GPU_A [GPU_B]]
#
# BIN_DIR holds release binaries `tcpxctl` and `tcpxd` (e.g. target/release). For 512 x 64K,
# 2048 x 16K and 8192 x 4K (32 MiB per transfer) it runs `tcpxctl bench transfer --cuda GPU_A
# --peer-cuda GPU_B --blocks N --block-size S` (two local daemons on the emulation in CUDA mode,
# scattered block transfers beside a contiguous one) with RUST_LOG=info,tcpxd::blocks=debug, then
# prints, from the daemons' logs, how long block batches took from launch until the poller saw
# them done (`tcpxd::blocks` lines: "gather batch done" on the sender, "scatter batch done" on
# the receiver; warm-up transfers included): count, mean, p50, p90, max in µs.
# First, if BIN_DIR/deps holds the gpu_blocks test binary, the block kernels' GPU tests.
# Extra arguments for every bench run: BENCH_ARGS (e.g. BENCH_ARGS="--iters 20 --warmup 3").
set -euo pipefail
if [ $# -lt 1 ] || [ ! -x "$1/tcpxctl" ] || [ ! -x "$1/tcpxd" ]; then
  echo "usage: $0 BIN_DIR [GPU_A [GPU_B]]  (BIN_DIR with tcpxctl and tcpxd)" >&2
  exit 2
fi
bin="$(cd "$1" && pwd)"
gpu_a="${2:-0}"
gpu_b="${3:-1}"
work="$(mktemp -d "${TMPDIR:-/tmp}/bbg.XXXXXX")"
echo "logs under $work"

# Prints count, mean, p50, p90 and max of the `us=` fields of the lines matching $2 in files $1...
summary() {
  local what="$1"
  shift
  cat "$@" 2>/dev/null | sed 's/\x1b\[[0-9;]*m//g' | grep -F "$what" | sed -n 's/.*[ \t]us=\([0-9]*\).*/\1/p' |
    sort -n | awk -v what="$what" '
      { v[NR] = $1; s += $1 }
      END {
        if (NR == 0) { printf "  %-20s none\n", what; exit }
        p50 = v[int((NR - 1) * 0.5) + 1]; p90 = v[int((NR - 1) * 0.9) + 1]
        printf "  %-20s n=%d mean=%.1f p50=%d p90=%d max=%d us\n", what, NR, s / NR, p50, p90, v[NR]
      }'
}

rc=0
# The block kernels' GPU tests first, when their binary is there (`cargo build --release -p tcpxd
# --tests` puts it in target/release/deps): byte-exact gathers and scatters, both table paths.
for t in "$bin"/deps/gpu_blocks-*; do
  [ -x "$t" ] && [ -f "$t" ] || continue
  echo "=== $(basename "$t") --ignored"
  CUDA_VISIBLE_DEVICES="$gpu_a" "$t" --ignored --test-threads=1 2>&1 | tail -n 12 || rc=1
done
for spec in "512 64K" "2048 16K" "8192 4K"; do
  read -r n size <<<"$spec"
  dir="$work/$size"
  mkdir -p "$dir"
  echo
  echo "=== $n x $size, GPU $gpu_a -> GPU $gpu_b"
  # shellcheck disable=SC2086
  if ! TMPDIR="$dir" RUST_LOG="${RUST_LOG:-info,tcpxd::blocks=debug}" "$bin/tcpxctl" bench transfer \
      --cuda "$gpu_a" --peer-cuda "$gpu_b" --blocks "$n" --block-size "$size" \
      --daemon "$bin/tcpxd" --keep-dir ${BENCH_ARGS:-} 2>&1 | tee "$dir/bench.out"; then
    rc=1
  fi
  mapfile -t logs < <(find "$dir" -name '*.log' -type f)
  if [ "${#logs[@]}" -eq 0 ]; then
    echo "  (no daemon logs found under $dir)"
    continue
  fi
  echo "--- block batches, launch to seen done (both daemons' logs)"
  summary "gather batch done" "${logs[@]}"
  summary "scatter batch done" "${logs[@]}"
  grep -h -E "WARN|ERROR" "${logs[@]}" | sed 's/\x1b\[[0-9;]*m//g' | head -n 10 || true
done
exit "$rc"
