#!/usr/bin/env bash
# Many transfers in flight: daemon ÷ raw, 1 and 8 in flight, for two daemon binaries alternating
# (rounds A B B A ...), each round with its own raw rows, so every ratio is taken within a round.
#
#   benches/inflight_device.sh TCPXCTL BEFORE_TCPXD AFTER_TCPXD OUT_DIR [options]
#
#   --memory host|gpu|stand-in   what the buffers are (default gpu): host memory; a GPU (the
#                                emulation in CUDA mode); or the CUDA stand-in's eight "GPUs"
#                                over host memory (no GPU needed: LD_LIBRARY_PATH must hold
#                                libcuda.so.1 from target/<profile>/cudastub, as the suite's)
#   --peer-cuda N                two GPUs: the peer daemon's buffers on GPU N (the raw rows stay on
#                                --cuda's GPU: raw is one process on one device)
#   --cuda N                     the GPU (default 0)
#   --rounds N                   rounds per binary (default 2: A B B A)
#   --sizes LIST                 default 4K,64K,1M
#   --iters N                    measured transfers per row (default 400; more than 128 needs the
#                                fixed raw bench of session 23, whose wall time no longer wraps)
#   --op write|read              default write (raw rows are the same path either way)
#
# On the H200 (one GPU, `--same-gpu`'s case), with this tree's release build and main's:
#   benches/inflight_device.sh target/release/tcpxctl BEFORE/tcpxd target/release/tcpxd OUT
# On two H200s, GPU 0 -> GPU 1:
#   benches/inflight_device.sh target/release/tcpxctl BEFORE/tcpxd target/release/tcpxd OUT --peer-cuda 1
# The same tcpxctl drives both daemons (the bench client is not what is compared).
set -euo pipefail
if [ $# -lt 4 ]; then
    sed -n 2,24p "$0"
    exit 2
fi
ctl=$1 before=$2 after=$3 out=$4
shift 4
memory=gpu cuda=0 peer_cuda="" rounds=2 sizes=4K,64K,1M iters=400 op=write
while [ $# -gt 0 ]; do
    case $1 in
        --memory) memory=$2; shift 2 ;;
        --cuda) cuda=$2; shift 2 ;;
        --peer-cuda) peer_cuda=$2; shift 2 ;;
        --rounds) rounds=$2; shift 2 ;;
        --sizes) sizes=$2; shift 2 ;;
        --iters) iters=$2; shift 2 ;;
        --op) op=$2; shift 2 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
mkdir -p "$out"
where=()
case $memory in
    host) ;;
    gpu) where=(--cuda "$cuda") ;;
    stand-in)
        where=(--cuda "$cuda")
        export TCPXD_CUDASTUB_DEVICES=${TCPXD_CUDASTUB_DEVICES:-8} TCPXEMU_BOUNCE=cuda
        export TCPXEMU_BOUNCE_PAGES=${TCPXEMU_BOUNCE_PAGES:-2048} UCCL_TCPX_UNPACK_IMPL=${UCCL_TCPX_UNPACK_IMPL:-d2d}
        export TCPXEMU_DEVICES=${TCPXEMU_DEVICES:-1}
        ;;
    *) echo "--memory: host, gpu or stand-in" >&2; exit 2 ;;
esac
peer=()
[ -n "$peer_cuda" ] && peer=(--peer-cuda "$peer_cuda")
order=()
for ((r = 0; r < rounds; r++)); do
    if ((r % 2 == 0)); then order+=(A B); else order+=(B A); fi
done
n=0
for who in "${order[@]}"; do
    n=$((n + 1))
    bin=$before
    [ "$who" = B ] && bin=$after
    for c in 1 8; do
        f="$out/run$n-$who-c$c.jsonl"
        "$ctl" bench raw "${where[@]}" --sizes "$sizes" --iters "$iters" --concurrency "$c" --json --out "$f" >/dev/null
        "$ctl" bench transfer --daemon "$bin" --op "$op" "${where[@]}" "${peer[@]}" --sizes "$sizes" \
            --iters "$iters" --concurrency "$c" --json --out "$f" >/dev/null
    done
    echo "round $n ($who) done" >&2
done
python3 - "$out" <<'EOF'
import glob, json, os, re, sys
from collections import defaultdict
out = sys.argv[1]
rows = defaultdict(dict)  # (who, c, size) -> {run: ratio}
for f in sorted(glob.glob(os.path.join(out, "run*-c*.jsonl"))):
    run, who, c = re.match(r"run(\d+)-(\w)-c(\d+)", os.path.basename(f)).groups()
    got = defaultdict(dict)
    for line in open(f):
        r = json.loads(line)
        got[r["block_size"]][r["harness"]] = r
    for size, h in got.items():
        if "raw" in h and "daemon" in h and h["raw"]["gb_per_s"] > 0:
            ok = h["raw"]["verified"] and h["daemon"]["verified"]
            rows[(who, int(c), size)][int(run)] = (h["daemon"]["gb_per_s"] / h["raw"]["gb_per_s"], h["daemon"]["p50_lat_us"], ok)
print("daemon ÷ raw (GB/s) per run, and the daemon's p50 µs; A = before, B = after")
print(f"{'binary':<7} {'in flight':>9} {'size':>9}  runs")
for (who, c, size) in sorted(rows):
    runs = rows[(who, c, size)]
    cells = "  ".join(f"r{k}: {v[0]:.2f} ({v[1]:.0f} µs){'' if v[2] else ' NOT VERIFIED'}" for k, v in sorted(runs.items()))
    print(f"{who:<7} {c:>9} {size:>9}  {cells}")
EOF
