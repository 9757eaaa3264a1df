#!/usr/bin/env bash
# Issue 38 point 4: plain batches of one buffer pair (packed `BatchRanges`) against the same pairs
# as block lists, from 64 to 65,536 entries, host memory or GPU memory, optionally alternating
# with a second build (ABBA) in one run.
#
#   tools/bench-batch-blocks.sh BIN_DIR [BASE_DIR] [--cuda GPU]
#
# BIN_DIR (and BASE_DIR) hold release binaries `tcpxctl` and `tcpxd` (e.g. target/release, and
# main's built elsewhere). Each row is one `tcpxctl bench transfer --blocks N --block-size S`
# (two local daemons on the built-in emulation; the block transfer, a contiguous transfer of the
# same bytes and the same pairs as one packed WriteBatch / ReadBatch alternate transfer by
# transfer; every pair byte-checked), of which the `batch/blocks` ratio is printed (target:
# >= 0.9). With BASE_DIR, each row runs BIN_DIR, BASE_DIR, BASE_DIR, BIN_DIR back to back, so a
# drift of the machine weighs on both builds alike. With `--cuda GPU` both daemons' buffers are
# on that GPU (`--cuda GPU --peer-cuda GPU`: the emulation in CUDA mode).
#
# ROWS (default "64:16K:60 2048:16K:20 8192:16K:8 65536:16K:3 65536:4K:6": entries, block
# size, measured iterations), OPS (default "write read"), WARMUP (default 2) and BENCH_ARGS
# (extra arguments for every run) change what runs.
set -euo pipefail
usage() {
  echo "usage: $0 BIN_DIR [BASE_DIR] [--cuda GPU]  (each DIR with tcpxctl and tcpxd)" >&2
  exit 2
}
[ $# -ge 1 ] || usage
dirs=()
gpu=()
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda)
      [ $# -ge 2 ] || usage
      gpu=(--cuda "$2" --peer-cuda "$2")
      shift 2
      ;;
    *)
      [ -x "$1/tcpxctl" ] && [ -x "$1/tcpxd" ] || usage
      dirs+=("$(cd "$1" && pwd)")
      shift
      ;;
  esac
done
[ ${#dirs[@]} -ge 1 ] && [ ${#dirs[@]} -le 2 ] || usage
rows=(${ROWS:-64:16K:60 2048:16K:20 8192:16K:8 65536:16K:3 65536:4K:6})
ops=(${OPS:-write read})
warmup="${WARMUP:-2}"
extra=(${BENCH_ARGS:-})
order=("${dirs[0]}")
labels=("A")
if [ ${#dirs[@]} -eq 2 ]; then
  order=("${dirs[0]}" "${dirs[1]}" "${dirs[1]}" "${dirs[0]}")
  labels=("A" "B" "B" "A")
fi
echo "host: $(nproc) CPUs; A = ${dirs[0]}${dirs[1]:+; B = ${dirs[1]}}; ${gpu[*]:-host memory}"

rc=0
for op in "${ops[@]}"; do
  for row in "${rows[@]}"; do
    IFS=: read -r n size iters <<<"$row"
    line="$op $n x $size:"
    for k in "${!order[@]}"; do
      bin="${order[$k]}"
      if out="$("$bin/tcpxctl" bench transfer --daemon "$bin/tcpxd" --op "$op" --blocks "$n" \
          --block-size "$size" --iters "$iters" --warmup "$warmup" "${gpu[@]}" "${extra[@]}" 2>&1)"; then
        ratio="$(echo "$out" | sed -n 's|^batch/blocks: \([0-9.]*\).*|\1|p')"
        checked="$(echo "$out" | grep -q 'checked: all pairs\|sampled pairs' && echo "" || echo " (unchecked)")"
        line="$line ${labels[$k]} ${ratio:-?}$checked"
      else
        line="$line ${labels[$k]} FAILED"
        echo "$out" | tail -5 >&2
        rc=1
      fi
    done
    echo "$line"
  done
done
exit $rc
