#!/usr/bin/env bash
# Issue 38 points 3 and 4 in one run: scattered blocks against contiguous bytes, and plain batches
# (packed ranges) against block lists, on host memory and, with a GPU, on GPU memory.
#
#   tools/bench-host-blocks.sh BIN_DIR [GPU]
#
# BIN_DIR holds release binaries `tcpxctl` and `tcpxd` (e.g. target/release), and, when built,
# `tcpxd-host-copy-bench` (its rows come first: the host copies alone). Each row is one
# `tcpxctl bench transfer --blocks N --block-size S` (two local daemons on the built-in emulation,
# the block transfer, the contiguous transfer of the same bytes and the same pairs as one packed
# WriteBatch / ReadBatch alternating transfer by transfer), whose ratios it prints:
#   1. point 3: 4096 x 16 KiB on host memory, WRITE and READ, with the daemons' host copies on the
#      poller alone (TCPXD_HOST_COPY_THREADS=0) and split across 2 and 4 helper threads:
#      scattered/contiguous (target >= 0.9 on a 16-core host);
#   2. point 4: 64, 2048, 8192 x 16 KiB and 65536 x 4 KiB, WRITE and READ, host memory (default
#      helpers): batch/blocks (target >= 0.9);
#   3. with GPU given: the same as 2 with --cuda GPU --peer-cuda GPU (the emulation in CUDA mode).
# Extra arguments for every run: BENCH_ARGS (default "--iters 20 --warmup 3").
set -euo pipefail
if [ $# -lt 1 ] || [ ! -x "$1/tcpxctl" ] || [ ! -x "$1/tcpxd" ]; then
  echo "usage: $0 BIN_DIR [GPU]  (BIN_DIR with tcpxctl and tcpxd)" >&2
  exit 2
fi
bin="$(cd "$1" && pwd)"
gpu="${2:-}"
args=(${BENCH_ARGS:---iters 20 --warmup 3})
echo "host: $(nproc) CPUs; binaries: $bin"

# One bench run; prints its two ratio lines prefixed with $1.
run() {
  local label="$1"
  shift
  local out
  if ! out="$("$bin/tcpxctl" bench transfer --daemon "$bin/tcpxd" "${args[@]}" "$@" 2>&1)"; then
    echo "$label: FAILED"
    echo "$out" | tail -5
    return 1
  fi
  echo "$out" | grep -E '^(scattered/contiguous|batch/blocks)' | sed "s|^|$label: |"
}

rc=0
if [ -x "$bin/tcpxd-host-copy-bench" ]; then
  # The receiver's copies alone (no plugin): do helpers scale them on this host? (poller alone,
  # fork-and-join as in session 18, queued whole per chunk as since session 19.)
  echo "== host copies alone: 512 KiB chunks of 16 KiB pieces, slot zeroed after"
  "$bin/tcpxd-host-copy-bench" --threads 1,2,4,8 || rc=1
fi
echo "== point 3: host copies, 4096 x 16 KiB, scattered/contiguous"
for op in write read; do
  for t in 0 2 4; do
    TCPXD_HOST_COPY_THREADS=$t run "$op helpers=$t" --op "$op" --blocks 4096 --block-size 16K --no-batch || rc=1
  done
done
echo "== point 4: packed batches against block lists, host memory"
for op in write read; do
  for nb in "64 16K" "2048 16K" "8192 16K" "65536 4K"; do
    set -- $nb
    run "$op $1 x $2" --op "$op" --blocks "$1" --block-size "$2" || rc=1
  done
done
if [ -n "$gpu" ]; then
  echo "== point 4 on GPU $gpu"
  for op in write read; do
    for nb in "64 16K" "2048 16K" "8192 16K" "65536 4K"; do
      set -- $nb
      run "gpu $op $1 x $2" --cuda "$gpu" --peer-cuda "$gpu" --op "$op" --blocks "$1" --block-size "$2" || rc=1
    done
  done
fi
exit $rc
