#!/usr/bin/env bash
# Issue #38's fixed cost per lanes transfer (session 25, lanepass): one at a time, READ and WRITE,
# 64 KiB / 1 MiB / 16 MiB, two release dirs alternating (A B B A), each round with its own raw
# rows, GPU 0 -> GPU 0 always and GPU 0 -> GPU 1 where a second GPU exists. Prints the p50 µs of
# each row, after ÷ before (p50) and daemon ÷ raw (p50 of raw ÷ p50 of the daemon, so > 1 means
# the daemon is faster, as compare.py's GB/s ratio), medians over the rounds. About 2 minutes on
# the H200 host.
#
#   benches/lanepass_device.sh BEFORE_DIR AFTER_DIR [OUT_DIR]
#
# Each dir holds a release build's staged binaries: tcpxd, tcpxctl, libnccl_net_tcpxemu.so (raw
# drives that plugin, as compare.py does; each dir's tcpxctl drives its own daemons and raw).
# Environment: ROUNDS (default 2: A B B A), ITERS (300), WARMUP (30), SIZES (64K,1M,16M),
# GPUS (how many to use: default what nvidia-smi lists, at most 2), MPS=1 (both daemons of the
# one-GPU rows under a private MPS control daemon, as compare.py --mps).
# The rows go to OUT_DIR (default /tmp/lanepass-device) as JSON lines, one file per run.
#
# The daemons get TCPXD_INLINE_GPU=off: 64 KiB would otherwise go inline on the control
# connection (session 24) and skip the lanes this compares.
#
# Then (TRACE=0 skips it, ~15 s) one traced run of AFTER's daemons, 1 MiB WRITE and READ on the
# last path (RUST_LOG=tcpxd::hop=trace,tcpxd::blocks=debug, logs kept under OUT_DIR/trace-*):
# benches/passes.py counts the passes between a chunk's landing, its unpack's launch, its consume
# and the transfer's end at the receiver; benches/hops.py splits the transfer hop by hop.
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n 2,21p "$0"
    exit 2
fi
before=$(cd "$1" && pwd) after=$(cd "$2" && pwd) out=${3:-/tmp/lanepass-device}
rounds=${ROUNDS:-2} iters=${ITERS:-300} warmup=${WARMUP:-30} sizes=${SIZES:-64K,1M,16M}
for d in "$before" "$after"; do
    for f in tcpxd tcpxctl libnccl_net_tcpxemu.so; do
        [ -e "$d/$f" ] || { echo "$d/$f: missing" >&2; exit 2; }
    done
done
gpus=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
[ "$gpus" -ge 1 ] 2>/dev/null || { echo "no GPU (nvidia-smi -L lists none; set GPUS=1 to try anyway)" >&2; exit 2; }
peers=(0)
[ "$gpus" -ge 2 ] && peers+=(1)
rm -rf "$out" && mkdir -p "$out"
export NCCL_NSOCKS_PERTHREAD=4 NCCL_SOCKET_NTHREADS=1 NCCL_DYNAMIC_CHUNK_SIZE=524288 TCPXEMU_BOUNCE=cuda
export TCPXD_INLINE_GPU=off NCCL_NVLS_ENABLE=0
if [ "${MPS:-0}" = 1 ]; then
    mps_root=$(mktemp -d /tmp/lanepass-mps.XXXXXX)
    export CUDA_MPS_PIPE_DIRECTORY=$mps_root/pipe CUDA_MPS_LOG_DIRECTORY=$mps_root/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d
    trap 'echo quit | nvidia-cuda-mps-control || true' EXIT
fi
order=()
for ((r = 0; r < rounds; r++)); do
    if ((r % 2 == 0)); then order+=(A B); else order+=(B A); fi
done
common=(--sizes "$sizes" --iters "$iters" --warmup "$warmup" --json)
start=$SECONDS
n=0
for who in "${order[@]}"; do
    n=$((n + 1))
    dir=$before
    [ "$who" = B ] && dir=$after
    # Raw: one process on GPU 0 (it refuses --peer-cuda); READ and WRITE are the same path.
    "$dir/tcpxctl" bench raw --cuda 0 --plugin "$dir/libnccl_net_tcpxemu.so" "${common[@]}" \
        --out "$out/run$n-$who-raw.jsonl" >/dev/null
    for peer in "${peers[@]}"; do
        for op in write read; do
            "$dir/tcpxctl" bench transfer --daemon "$dir/tcpxd" --op "$op" --cuda 0 --peer-cuda "$peer" \
                "${common[@]}" --out "$out/run$n-$who-daemon-$op-0to$peer.jsonl" >/dev/null
        done
    done
    echo "round $n ($who) done, $((SECONDS - start)) s" >&2
done
python3 - "$out" <<'EOF' | tee "$out/summary.txt"
import glob, json, os, re, statistics, sys
from collections import defaultdict
out = sys.argv[1]
raw = defaultdict(dict)       # (run, size) -> p50
daemon = defaultdict(dict)    # (who, op, path, size) -> {run: p50}
ok = True
for f in sorted(glob.glob(os.path.join(out, "run*.jsonl"))):
    name = os.path.basename(f)
    m = re.match(r"run(\d+)-(\w)-(raw|daemon-(\w+)-(0to\d))\.jsonl", name)
    run, who, kind, op, path = int(m.group(1)), m.group(2), m.group(3), m.group(4), m.group(5)
    for line in open(f):
        r = json.loads(line)
        ok &= bool(r.get("verified", True))
        if kind == "raw":
            raw[(run, r["block_size"])] = r["p50_lat_us"]
        else:
            daemon[(who, op, path, r["block_size"])][run] = r["p50_lat_us"]
def size(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
med = statistics.median
print("p50 µs, median over the rounds; A = before, B = after; daemon ÷ raw = raw p50 ÷ daemon p50 (> 1: daemon faster)")
print(f"{'path':<6} {'op':<5} {'size':>7} {'raw':>7} {'before':>8} {'after':>8} {'after÷before':>13} {'before÷raw':>11} {'after÷raw':>10}  each run's p50 (A before, B after)")
for (path, op, sz) in sorted({(k[2], k[1], k[3]) for k in daemon}, key=lambda k: (k[0], k[1], k[2])):
    a, b = daemon.get(("A", op, path, sz), {}), daemon.get(("B", op, path, sz), {})
    if not a or not b:
        continue
    raw_all = [raw[(run, sz)] for run in list(a) + list(b) if (run, sz) in raw]
    ra = [raw[(run, sz)] / v for run, v in a.items() if (run, sz) in raw]
    rb = [raw[(run, sz)] / v for run, v in b.items() if (run, sz) in raw]
    rounds = " ".join(f"{'A' if k in a else 'B'}{k}:{v:.0f}" for k, v in sorted({**a, **b}.items()))
    print(f"{path:<6} {op:<5} {size(sz):>7} {med(raw_all):>7.0f} {med(a.values()):>8.0f} {med(b.values()):>8.0f} "
          f"{med(b.values()) / med(a.values()):>13.2f} {med(ra):>11.2f} {med(rb):>10.2f}  {rounds}")
print("every row verified" if ok else "SOME ROWS NOT VERIFIED")
EOF

if [ "${TRACE:-1}" = 1 ]; then
    here=$(cd "$(dirname "$0")" && pwd)
    peer=${peers[-1]}
    for op in write read; do
        t="$out/trace-$op-0to$peer"
        mkdir -p "$t"
        RUST_LOG=tcpxd::hop=trace,tcpxd::blocks=debug "$after/tcpxctl" bench transfer --daemon "$after/tcpxd" \
            --op "$op" --cuda 0 --peer-cuda "$peer" --sizes 1M --iters 200 --warmup 20 --keep-dir >"$t/bench.txt" 2>&1
        kept=$(grep -o '/tmp/tcpxd-bench-[0-9]*' "$t/bench.txt" | head -1)
        mv "$kept"/*.log "$t/" && rm -rf "$kept"
        # The receiver: b for a WRITE, a (the reader) for a READ.
        recv=$t/bench-b.log
        [ "$op" = read ] && recv=$t/bench-a.log
        echo "== traced 1 MiB $op, GPU 0 -> $peer (AFTER): passes at the receiver, then hops"
        python3 "$here/passes.py" "$recv" || true
        python3 "$here/hops.py" "$t/bench-a.log" "$t/bench-b.log" || true
    done 2>&1 | tee "$out/trace.txt"
fi
