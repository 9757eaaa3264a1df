#!/usr/bin/env bash
# Session 28, sendintake: the sending poller's cost per transfer at 8 and 16 in flight, two daemon
# builds alternating (B A A B ...), each run through `benches/inflight_threads.py` (its steady
# window: the poller's busy µs per transfer by phase, and the `finished` action's share).
#
#   benches/sendintake_device.sh AFTER_DIR BEFORE_DIR OUT_DIR [ROUNDS] [ITERS]
#
# AFTER_DIR / BEFORE_DIR hold `tcpxd` and `tcpxctl` (staged release builds). GPU 0 -> GPU 1 when
# two GPUs are visible, else GPU 0 -> GPU 0; 64 KiB WRITEs through the framed local session, with
# TCPXD_SPIN=off (the poller's work alone, as session 27's table). A last pair of runs puts the
# buffers in host memory (64 KiB goes inline there: another path). Prints one line a run and a
# median table; the full outputs stay in OUT_DIR. About 3-4 minutes on the H200 hosts.
set -euo pipefail
if [ $# -lt 3 ]; then
    sed -n 2,13p "$0"
    exit 2
fi
after=$1 before=$2 out=$3 rounds=${4:-2} iters=${5:-60000}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
peer=0
[ "${gpus:-1}" -ge 2 ] && peer=1
export TCPXD_SPIN=off
run() { # who dir conc memory n
    local who=$1 dir=$2 conc=$3 mem=$4 n=$5 where=()
    [ "$mem" = gpu ] && where=(--cuda 0 --peer-cuda "$peer")
    local f="$out/run$n-$who-c$conc-$mem.txt"
    python3 "$here/inflight_threads.py" --tcpxctl "$dir/tcpxctl" -- --daemon "$dir/tcpxd" --via local \
        "${where[@]}" --sizes 64K --concurrency "$conc" --op write --iters "$iters" --warmup 500 >"$f" 2>&1 || true
    python3 - "$f" "$who" "$conc" "$mem" <<'EOF'
import re, sys
f, who, conc, mem = sys.argv[1:]
t = open(f).read()
gbs = re.search(r"^daemon-local\s+WRITE\s+\S+\s+[\d.]+ KiB\s+\d+\s+\d+\s+([\d.]+)", t, re.M)
cpu = re.search(r"^daemon a\s+tcpxd-poller\s+\d+\s+[\d.]+\s+([\d.]+)", t, re.M)
st = t.split("Steady window", 1)
row = fin = None
if len(st) > 1:
    m = re.search(r"^daemon a\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+\s+([\d.]+)\s+([\d.]+)", st[1], re.M)
    row = m and m.groups()
    m = re.search(r"daemon a\s+actions: finished ([\d.]+)", st[1])
    fin = m and m.group(1)
print(f"RESULT {who} c{conc} {mem} GB/s {gbs and gbs.group(1)} poller_cpu_us {cpu and cpu.group(1)} "
      f"steady busy/share/intake/commands/actions/test_lanes {row} finished {fin}")
EOF
}
n=0
order=()
for ((r = 0; r < rounds; r++)); do
    if ((r % 2 == 0)); then order+=(B A); else order+=(A B); fi
done
for who in "${order[@]}"; do
    n=$((n + 1))
    dir=$before
    [ "$who" = A ] && dir=$after
    for conc in 16 8; do
        run "$who" "$dir" "$conc" gpu "$n" | tee -a "$out/results.txt"
    done
done
for who in B A; do
    n=$((n + 1))
    dir=$before
    [ "$who" = A ] && dir=$after
    run "$who" "$dir" 16 host "$n" | tee -a "$out/results.txt"
done
echo "(A = after, B = before; full outputs in $out)"
