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
#      poller alone (TCPXD_HOST_COPY_THREADS=0) and on 2, 4 and 8 helper threads (8 also with
#      helpers that never spin, TCPXD_HOST_COPY_SPIN_US=0), and 2 MiB chunks with 4 helpers:
#      scattered/contiguous (target >= 0.9 on a 16-core host), with the host's CPUs busy (%, all
#      of them, from /proc/stat) during the run: near 100 the host is the bound, not the daemon;
#   1a. (session 22, a build with --scatter-ahead) the same rows with block receives posted
#      ahead off (TCPXD_SCATTER_AHEAD=0), at the default (8) and with sends gathered ahead too
#      (TCPXD_GATHER_AHEAD=8), alternating A B C C B A, two rounds per op;
#   1b. where the time goes (session 21): one traced WRITE and READ run each (RUST_LOG=tcpxd::hop=trace),
#      (and, session 22, with TCPXD_SCATTER_AHEAD=0 and with TCPXD_GATHER_AHEAD=8),
#      split chunk by chunk by benches/chunks.py (gather, send in the plugin, receive in the
#      plugin, scatter: each step's p50 and how many chunks sat in it at once, contiguous against
#      block transfers), then each daemon's helper line (jobs, bytes, busy ms, GB/s, spun ms);
#   2. point 4: 64, 2048, 8192 x 16 KiB and 65536 x 4 KiB, WRITE and READ, host memory (default
#      helpers): batch/blocks (target >= 0.9);
#   3. with GPU given: the same as 2 with --cuda GPU --peer-cuda GPU (the emulation in CUDA mode).
# Extra arguments for every run: BENCH_ARGS (default "--iters 20 --warmup 3"). ONLY=3 runs point 3's
# rows alone (no trace: for an older build), ONLY=4 point 4's.
set -euo pipefail
if [ $# -lt 1 ] || [ ! -x "$1/tcpxctl" ] || [ ! -x "$1/tcpxd" ]; then
  echo "usage: $0 BIN_DIR [GPU]  (BIN_DIR with tcpxctl and tcpxd)" >&2
  exit 2
fi
bin="$(cd "$1" && pwd)"
here="$(cd "$(dirname "$0")" && pwd)"
gpu="${2:-}"
args=(${BENCH_ARGS:---iters 20 --warmup 3})
echo "host: $(nproc) CPUs; binaries: $bin"

# The host's busy and total CPU jiffies so far (all CPUs).
jiffies() {
  awk '/^cpu /{ t = 0; for (i = 2; i <= NF; i++) t += $i; print t - $5 - $6, t }' /proc/stat
}

# One bench run; prints its ratio lines prefixed with $1, and how busy the host's CPUs were.
run() {
  local label="$1"
  shift
  local out b0 t0 b1 t1
  read -r b0 t0 < <(jiffies)
  if ! out="$("$bin/tcpxctl" bench transfer --daemon "$bin/tcpxd" "${args[@]}" "$@" 2>&1)"; then
    echo "$label: FAILED"
    echo "$out" | tail -5
    return 1
  fi
  read -r b1 t1 < <(jiffies)
  local busy=$(( (b1 - b0) * 100 / (t1 - t0 > 0 ? t1 - t0 : 1) ))
  echo "$out" | grep -E '^(scattered/contiguous|batch/blocks)' | sed "s|^|$label: |; s|\$| [CPUs busy ${busy}%]|"
}

# One traced run: the chunk-by-chunk split of its transfers (benches/chunks.py) and the helpers'
# lines of both daemons.
traced() {
  local label="$1"
  shift
  local out dir
  if ! out="$(RUST_LOG=tcpxd::hop=trace,info "$bin/tcpxctl" bench transfer --daemon "$bin/tcpxd" "${args[@]}" "$@" --keep-dir 2>&1)"; then
    echo "$label: FAILED"
    echo "$out" | tail -5
    return 1
  fi
  dir="$(echo "$out" | sed -n 's|^tcpxctl: kept ||p' | tail -1)"
  echo "-- $label: $(echo "$out" | grep -E '^scattered/contiguous')"
  python3 "$here/../benches/chunks.py" "$dir/bench-a.log" "$dir/bench-b.log" || return 1
  grep -h "host copy helpers" "$dir/bench-a.log" "$dir/bench-b.log" | sed 's|^.*host copy helpers|  helpers|' | cut -c1-1400
  rm -rf "$dir"
}

rc=0
if [ -x "$bin/tcpxd-host-copy-bench" ]; then
  # The receiver's copies alone (no plugin): do helpers scale them on this host? (poller alone,
  # fork-and-join as in session 18, queued whole per chunk as since session 19.)
  echo "== host copies alone: 512 KiB chunks of 16 KiB pieces, slot zeroed after"
  "$bin/tcpxd-host-copy-bench" --threads 1,2,4,8 || rc=1
fi
only="${ONLY:-}"
if [ "$only" != 4 ]; then
echo "== point 3: host copies, 4096 x 16 KiB, scattered/contiguous"
for op in write read; do
  for t in 0 2 4 8; do
    TCPXD_HOST_COPY_THREADS=$t run "$op helpers=$t" --op "$op" --blocks 4096 --block-size 16K --no-batch || rc=1
  done
  TCPXD_HOST_COPY_THREADS=8 TCPXD_HOST_COPY_SPIN_US=0 run "$op helpers=8 spin=0" --op "$op" --blocks 4096 --block-size 16K --no-batch || rc=1
  TCPXD_HOST_COPY_THREADS=4 run "$op helpers=4 chunk=2M" --op "$op" --blocks 4096 --block-size 16K --no-batch --chunk-bytes 2097152 || rc=1
done
fi
if [ "$only" != 4 ] && "$bin/tcpxd" --help | grep -q -- --scatter-ahead; then
# Session 22: block receives posted ahead of recv_window (a direct receive's plugin slot given
# back while its scatter runs) and sends gathered ahead, default helpers, the same binary:
# scatter_ahead 0 (session 21's path) / 8 (the default) / 8 with gather_ahead 8, rounds of
# A B C C B A.
echo "== point 3b: receives and gathers ahead, 4096 x 16 KiB, scattered/contiguous (A B C C B A)"
for op in write read; do
  for round in 1 2; do
    for cfg in "0 0" "8 0" "8 8" "8 8" "8 0" "0 0"; do
      set -- $cfg
      TCPXD_SCATTER_AHEAD=$1 TCPXD_GATHER_AHEAD=$2 run "$op scatter_ahead=$1 gather_ahead=$2" \
        --op "$op" --blocks 4096 --block-size 16K --no-batch || rc=1
    done
  done
done
fi
if [ -z "$only" ]; then
echo "== point 3: where the time goes, chunk by chunk (default helpers)"
for op in write read; do
  traced "$op" --op "$op" --blocks 4096 --block-size 16K --no-batch || rc=1
  if "$bin/tcpxd" --help | grep -q -- --scatter-ahead; then
    TCPXD_SCATTER_AHEAD=0 traced "$op scatter_ahead=0" --op "$op" --blocks 4096 --block-size 16K --no-batch || rc=1
    TCPXD_GATHER_AHEAD=8 traced "$op gather_ahead=8" --op "$op" --blocks 4096 --block-size 16K --no-batch || rc=1
  fi
done
fi
[ "$only" = 3 ] && exit $rc
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
