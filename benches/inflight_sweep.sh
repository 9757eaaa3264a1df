#!/usr/bin/env bash
# Transfers in flight, C = 1/2/4/8/16: GB/s of two daemon builds (before, after) through both bench
# paths (a gRPC Session, rows `grpc`; the framed local session, rows `local`, as the Python package's
# client) beside the raw plugin path, WRITE and READ, 16 KiB and 64 KiB. Prints one row per (op,
# size, C): GB/s of each and daemon ÷ raw, after ÷ before.
#
#   benches/inflight_sweep.sh BEFORE_DIR AFTER_DIR OUT_DIR [options]
#
# BEFORE_DIR and AFTER_DIR hold a release `tcpxd`; AFTER_DIR also the `tcpxctl` that drives every
# row (it has `bench transfer --via`; the bench client is the same for both daemons, so only the
# daemons are compared). Two daemon pairs (before, after) are started once, one daemon per GPU
# (the emulation in CUDA mode, its bounce pages on its own GPU), and stay up for the whole sweep;
# within each (op, C) the rows run alternating: before, after, after, before, ... and raw once.
#
#   --memory gpu|stand-in|host  default gpu; stand-in: the CUDA stand-in's GPUs over host memory
#                               (LD_LIBRARY_PATH must hold target/<profile>/cudastub's libcuda.so.1)
#   --cuda N / --peer-cuda N    default 0 / 1 (raw runs on --cuda's GPU: one process, one device)
#   --iters N                   measured transfers per row and size (default 2000; warm-up 100)
#   --conc "LIST"               default "1 2 4 8 16"
#   --sizes LIST                default 16K,64K
#   --ops "LIST"                default "write read"
#   --rounds N                  daemon rows per build and path in each (op, C) (default 1)
#
# On two H200s (about 3 minutes):
#   benches/inflight_sweep.sh /work/before-s25 target/release /tmp/sweep
set -euo pipefail
if [ $# -lt 3 ]; then
    sed -n 2,25p "$0"
    exit 2
fi
before_dir=$(realpath "$1") after_dir=$(realpath "$2") out=$3
shift 3
memory=gpu cuda=0 peer_cuda=1 iters=2000 conc="1 2 4 8 16" sizes=16K,64K ops="write read" rounds=1
while [ $# -gt 0 ]; do
    case $1 in
        --memory) memory=$2; shift 2 ;;
        --cuda) cuda=$2; shift 2 ;;
        --peer-cuda) peer_cuda=$2; shift 2 ;;
        --iters) iters=$2; shift 2 ;;
        --conc) conc=$2; shift 2 ;;
        --sizes) sizes=$2; shift 2 ;;
        --ops) ops=$2; shift 2 ;;
        --rounds) rounds=$2; shift 2 ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
done
ctl=$after_dir/tcpxctl
for f in "$before_dir/tcpxd" "$after_dir/tcpxd" "$ctl"; do
    [ -x "$f" ] || { echo "$f: not an executable" >&2; exit 2; }
done
mkdir -p "$out"
out=$(realpath "$out")
rm -f "$out"/*.jsonl "$out"/*.ready "$out"/*.sock
where=() peer=() devs=("" "")
case $memory in
    host) ;;
    gpu) where=(--cuda "$cuda"); peer=(--peer-cuda "$peer_cuda"); devs=("$cuda" "$peer_cuda") ;;
    stand-in)
        where=(--cuda "$cuda"); peer=(--peer-cuda "$peer_cuda"); devs=("$cuda" "$peer_cuda")
        export TCPXD_CUDASTUB_DEVICES=${TCPXD_CUDASTUB_DEVICES:-8} TCPXEMU_BOUNCE=cuda
        export TCPXEMU_BOUNCE_PAGES=${TCPXEMU_BOUNCE_PAGES:-2048} UCCL_TCPX_UNPACK_IMPL=${UCCL_TCPX_UNPACK_IMPL:-d2d}
        ;;
    *) echo "--memory: gpu, stand-in or host" >&2; exit 2 ;;
esac

pids=()
stop() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
}
trap stop EXIT

# start BUILD SIDE: one daemon (side 0 on --cuda's GPU, 1 on --peer-cuda's), as `bench transfer`
# starts its local ones.
start() {
    local build=$1 side=$2 bin node
    bin=$before_dir/tcpxd
    [ "$build" = after ] && bin=$after_dir/tcpxd
    node=sweep-$build-$side
    (
        [ -n "${devs[$side]}" ] && export TCPXEMU_CUDA_DEVICE=${devs[$side]}
        exec env RUST_LOG=${RUST_LOG:-warn} "$bin" --node-id "$node" --builtin-emulation \
            --api-socket "$out/$node.sock" --peer-listen 127.0.0.1:0 --ready-file "$out/$node.ready" \
            --lanes-per-device 2 >"$out/$node.log" 2>&1
    ) &
    pids+=($!)
}
for build in before after; do
    start "$build" 0
    start "$build" 1
done
for node in sweep-before-0 sweep-before-1 sweep-after-0 sweep-after-1; do
    for _ in $(seq 600); do [ -s "$out/$node.ready" ] && break; sleep 0.1; done
    [ -s "$out/$node.ready" ] || { echo "$node never got ready: $out/$node.log" >&2; exit 1; }
done
peer_address() {
    python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["peer_address"])' "$out/sweep-$1-1.ready"
}

# daemon BUILD VIA OP C [extra]: one bench run between BUILD's pair, its JSON rows on stdout.
daemon() {
    local build=$1 via=$2 op=$3 c=$4
    shift 4
    "$ctl" bench transfer --endpoint "unix:$out/sweep-$build-0.sock" \
        --peer-endpoint "unix:$out/sweep-$build-1.sock" "$@" --via "$via" --op "$op" \
        "${where[@]}" "${peer[@]}" --sizes "$sizes" --iters "$iters" --warmup 100 \
        --concurrency "$c" --json
}
# Pair each build's daemons once, with a warm-up run not reported.
for build in before after; do
    daemon "$build" grpc write 4 --peer-address "$(peer_address "$build")" >/dev/null
done
echo "daemons up and paired; sweeping" >&2
t0=$(date +%s)
n=0
for op in $ops; do
    for c in $conc; do
        f="$out/$op-c$c.jsonl"
        "$ctl" bench raw "${where[@]}" --op "$op" --sizes "$sizes" --iters "$iters" --warmup 100 \
            --concurrency "$c" --json | sed 's/^{/{"build":"raw","via":"raw",/' >>"$f"
        for ((r = 0; r < rounds; r++)); do
            order=(before after)
            (((n + r) % 2 == 1)) && order=(after before)
            for via in grpc local; do
                for build in "${order[@]}"; do
                    daemon "$build" "$via" "$op" "$c" |
                        sed "s/^{/{\"build\":\"$build\",\"via\":\"$via\",/" >>"$f"
                done
                order=("${order[1]}" "${order[0]}")
            done
        done
        n=$((n + 1))
        echo "$op c=$c done ($(($(date +%s) - t0)) s)" >&2
    done
done
python3 - "$out" <<'EOF'
import glob, json, os, sys
from collections import defaultdict
rows = defaultdict(list)
for f in glob.glob(os.path.join(sys.argv[1], "*-c*.jsonl")):
    for line in open(f):
        if line.strip():
            r = json.loads(line)
            rows[(r["op"], r["block_size"], r["concurrency"], r["build"], r["via"])].append(r["gb_per_s"])
def gbps(*k):
    v = rows.get(k)
    return sum(v) / len(v) if v else None
keys = sorted({k[:3] for k in rows}, key=lambda k: (k[0], k[1], k[2]))
def f(x, w=6, d=2):
    return f"{x:>{w}.{d}f}" if x is not None else " " * (w - 3) + "n/a"
print("GB/s (mean of the rows); d/raw = daemon ÷ raw; a/b = after ÷ before (same path)")
print(f"{'op':<6}{'size':>6}{'C':>4} {'raw':>6} | {'grpc b':>6} {'grpc a':>6} {'d/raw b':>7} {'d/raw a':>7} {'a/b':>5} | "
      f"{'local b':>7} {'local a':>7} {'d/raw b':>7} {'d/raw a':>7} {'a/b':>5}")
for op, size, c in keys:
    raw = gbps(op, size, c, "raw", "raw")
    cells = []
    for via in ("grpc", "local"):
        b, a = gbps(op, size, c, "before", via), gbps(op, size, c, "after", via)
        ratio = lambda x, y: x / y if x is not None and y else None
        w = 6 if via == "grpc" else 7
        cells.append(f"{f(b, w, 3)} {f(a, w, 3)} {f(ratio(b, raw), 7)} {f(ratio(a, raw), 7)} {f(ratio(a, b), 5)}")
    print(f"{op:<6}{size // 1024:>5}K{c:>4} {f(raw, 6, 3)} | {cells[0]} | {cells[1]}")
EOF
