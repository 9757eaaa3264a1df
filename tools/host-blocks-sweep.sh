#!/usr/bin/env bash
# Issue 38 point 3: which host block settings bring scattered host blocks nearest contiguous bytes
# on this host. One call, a time budget (default 190 s of rows, then ~30 s of traced runs: fits a
# 4-minute device call on the 16-core host), rows alternating:
#
#   tools/host-blocks-sweep.sh BIN [BASE]
#
# BIN: release `tcpxd` and `tcpxctl` of this tree; BASE: another build's (optional, one "base" row
# per round at its defaults, e.g. /work/before-s24). Each row is one `tcpxctl bench transfer
# --blocks 4096 --block-size 16K --no-batch` (two local daemons on the built-in emulation, host
# memory, TCPXEMU_HOST_RECV=direct as on the real plugin and in the emulation's CUDA mode), WRITE
# then READ, printing scattered/contiguous and how busy the host's CPUs were (all of them,
# /proc/stat).
#
# Rows of session 24 (host-blocks4; the default ROWS): base, default (BIN's defaults: 8 helpers on
# 16 CPUs, 1 spinning, stream, host_gather_ahead 12, scatter_ahead 8), ga0
# (TCPXD_HOST_GATHER_AHEAD=0: session 23's sender, gathers inside the send window), ga16,
# sa16 (TCPXD_SCATTER_AHEAD=16), ga16_sa16, all_nt (TCPXD_HOST_COPY_ROUTINE=stream-all: gathers'
# staging slots and the landing slots' zeroing written non-temporally too), ga16_sa16_all_nt;
# ga6 by name. Session 23's rows stay available by name (h = TCPXD_HOST_COPY_THREADS, s =
# TCPXD_HOST_COPY_SPINNERS, r = TCPXD_HOST_COPY_ROUTINE, split = TCPXD_HOST_COPY_SPLIT): h4_s64,
# h4_s1, h4_s0, h8_s0, h12_s1, h12_s0, h8_s1_prefetch, h8_s1_stream, h8_s1_nosplit.
#
# Rounds go forward then backward (A B C ... C B A) until the budget is spent; the summary gives
# each row's median (and count) per op. Then, unless TRACE=0, one traced WRITE and READ of the
# rows in TRACE_ROWS (default "ga0 default"; "base" traces BASE's build) with the hop trace on (RUST_LOG=tcpxd::hop=trace,
# which costs a few µs an event: read its splits, not its ratio) and benches/chunks.py's table
# for each: per chunk, the gather's and scatter's wait for a helper, copy and unseen end, and per
# lane the slots held and the sends and receives in the plugin (docs/BENCHMARKS.md, session 24).
# Extra arguments for every run: BENCH_ARGS (default "--iters 20 --warmup 3", as
# tools/bench-host-blocks.sh); SWEEP_SECONDS the budget of the rows; ROWS a space-separated subset
# of row names (e.g. ROWS="base default ga0").
set -uo pipefail
if [ $# -lt 1 ] || [ ! -x "$1/tcpxctl" ] || [ ! -x "$1/tcpxd" ]; then
  echo "usage: $0 BIN [BASE]  (directories with tcpxctl and tcpxd)" >&2
  exit 2
fi
bin="$(cd "$1" && pwd)"
base="${2:+$(cd "$2" && pwd)}"
args=(${BENCH_ARGS:---iters 20 --warmup 3})
budget="${SWEEP_SECONDS:-190}"
rows_wanted="${ROWS:-base default ga0 ga16 sa16 ga16_sa16 all_nt ga16_sa16_all_nt}"
here="$(cd "$(dirname "$0")/.." && pwd)"
export TCPXEMU_HOST_RECV=direct
start=$(date +%s)
echo "host: $(nproc) CPUs; BIN $bin; BASE ${base:-none}; budget ${budget}s; bench ${args[*]}"

# name|env assignments (space-separated) -- BIN rows; "base" uses BASE.
all_rows=(
  "base|"
  "default|"
  "h4_s64|TCPXD_HOST_COPY_THREADS=4 TCPXD_HOST_COPY_SPINNERS=64"
  "h4_s1|TCPXD_HOST_COPY_THREADS=4 TCPXD_HOST_COPY_SPINNERS=1"
  "h4_s0|TCPXD_HOST_COPY_THREADS=4 TCPXD_HOST_COPY_SPINNERS=0"
  "h8_s0|TCPXD_HOST_COPY_THREADS=8 TCPXD_HOST_COPY_SPINNERS=0"
  "h12_s1|TCPXD_HOST_COPY_THREADS=12 TCPXD_HOST_COPY_SPINNERS=1"
  "h12_s0|TCPXD_HOST_COPY_THREADS=12 TCPXD_HOST_COPY_SPINNERS=0"
  "h8_s1_prefetch|TCPXD_HOST_COPY_THREADS=8 TCPXD_HOST_COPY_SPINNERS=1 TCPXD_HOST_COPY_ROUTINE=prefetch"
  "h8_s1_stream|TCPXD_HOST_COPY_THREADS=8 TCPXD_HOST_COPY_SPINNERS=1 TCPXD_HOST_COPY_ROUTINE=stream"
  "h8_s1_nosplit|TCPXD_HOST_COPY_THREADS=8 TCPXD_HOST_COPY_SPINNERS=1 TCPXD_HOST_COPY_SPLIT=off"
  "ga0|TCPXD_HOST_GATHER_AHEAD=0"
  "ga6|TCPXD_HOST_GATHER_AHEAD=6"
  "ga16|TCPXD_HOST_GATHER_AHEAD=16"
  "sa16|TCPXD_SCATTER_AHEAD=16"
  "ga16_sa16|TCPXD_HOST_GATHER_AHEAD=16 TCPXD_SCATTER_AHEAD=16"
  "all_nt|TCPXD_HOST_COPY_ROUTINE=stream-all"
  "ga16_sa16_all_nt|TCPXD_HOST_GATHER_AHEAD=16 TCPXD_SCATTER_AHEAD=16 TCPXD_HOST_COPY_ROUTINE=stream-all"
)
rows=()
for r in "${all_rows[@]}"; do
  name="${r%%|*}"
  [ "$name" = base ] && [ -z "$base" ] && continue
  if [[ " $rows_wanted " != *" $name "* ]]; then continue; fi
  rows+=("$r")
done

# The host's busy and total CPU jiffies so far (all CPUs).
jiffies() {
  awk '/^cpu /{ t = 0; for (i = 2; i <= NF; i++) t += $i; print t - $5 - $6, t }' /proc/stat
}

results="$(mktemp)"
trap 'rm -f "$results"' EXIT

# One row: op, name, env. Prints the ratio and the CPUs busy; records "op name ratio".
one() {
  local op="$1" name="$2" envs="$3" dir="$bin" out b0 t0 b1 t1 ratio
  [ "$name" = base ] && dir="$base"
  read -r b0 t0 < <(jiffies)
  if ! out="$(env $envs "$dir/tcpxctl" bench transfer --daemon "$dir/tcpxd" "${args[@]}" \
      --op "$op" --blocks 4096 --block-size 16K --no-batch 2>&1)"; then
    echo "$op $name: FAILED"
    echo "$out" | tail -3
    return 1
  fi
  read -r b1 t1 < <(jiffies)
  local busy=$(( (b1 - b0) * 100 / (t1 - t0 > 0 ? t1 - t0 : 1) ))
  ratio="$(echo "$out" | sed -n 's|^scattered/contiguous: \([0-9.]*\).*|\1|p' | head -1)"
  printf '%-6s %-16s scattered/contiguous %s [CPUs busy %s%%] (%ss)\n' "$op" "$name" "${ratio:-?}" "$busy" "$(( $(date +%s) - start ))"
  [ -n "$ratio" ] && echo "$op $name $ratio" >>"$results"
}

rc=0
round=0
while :; do
  order=("${rows[@]}")
  if [ $((round % 2)) -eq 1 ]; then
    order=()
    for ((i = ${#rows[@]} - 1; i >= 0; i--)); do order+=("${rows[$i]}"); done
  fi
  echo "== round $((round + 1))"
  for r in "${order[@]}"; do
    for op in write read; do
      if [ $(( $(date +%s) - start )) -ge "$budget" ]; then break 3; fi
      one "$op" "${r%%|*}" "$(echo "${r#*|}")" || rc=1
    done
  done
  round=$((round + 1))
done

echo "== summary: median scattered/contiguous per row (runs), $(( $(date +%s) - start ))s"
python3 - "$results" <<'EOF'
import sys, statistics, collections
rows = collections.OrderedDict()
for line in open(sys.argv[1]):
    op, name, r = line.split()
    rows.setdefault(name, {}).setdefault(op, []).append(float(r))
print(f"{'row':<16} {'WRITE':>14} {'READ':>14}")
for name, ops in rows.items():
    cell = lambda op: (f"{statistics.median(ops[op]):.2f} ({len(ops[op])})" if op in ops else "-")
    print(f"{name:<16} {cell('write'):>14} {cell('read'):>14}")
EOF

# Traced runs: where a chunk's time goes, per row (BIN only).
if [ "${TRACE:-1}" != 0 ]; then
  for name in ${TRACE_ROWS:-ga0 default}; do
    envs=""
    for r in "${all_rows[@]}"; do [ "${r%%|*}" = "$name" ] && envs="${r#*|}"; done
    tdir="$bin"
    if [ "$name" = base ]; then
      [ -z "$base" ] && continue
      tdir="$base"
    fi
    for op in write read; do
      out="$(env $envs RUST_LOG=info,tcpxd::hop=trace "$tdir/tcpxctl" bench transfer --daemon "$tdir/tcpxd" \
        --iters 10 --warmup 2 --op "$op" --blocks 4096 --block-size 16K --no-batch --keep-dir 2>&1)"
      dir="$(echo "$out" | sed -n 's|^tcpxctl: kept \(.*\)$|\1|p' | head -1)"
      echo "== traced $op $name: $(echo "$out" | grep '^scattered/' | cut -d'(' -f1)"
      if [ -n "$dir" ] && [ -f "$dir/bench-a.log" ]; then
        python3 "$here/benches/chunks.py" --every 2 "$dir/bench-a.log" "$dir/bench-b.log" || rc=1
        grep -h "host copy helpers" "$dir"/bench-*.log | sed 's/^.*host copy helpers: /  helpers: /' | cut -c1-400
        rm -rf "$dir"
      else
        echo "$out" | tail -3
        rc=1
      fi
    done
  done
fi
exit $rc
