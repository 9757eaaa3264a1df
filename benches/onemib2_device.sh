#!/usr/bin/env bash
# Issue #38 at 1 MiB one at a time (session 31, onemib2): the legs after the last receive, before
# and after, then compare.py's ratios against NCCL over its own sockets. About 5 minutes on the
# H200 host.
#
#   benches/onemib2_device.sh BEFORE_DIR AFTER_DIR [OUT_DIR]
#
# Each dir holds a release build's staged binaries: tcpxd, tcpxctl, libnccl_net_tcpxemu.so.
#
# 1. A/B: `tcpxctl bench transfer` GPU 0 -> 1 (0 -> 0 on a one-GPU host), the defaults of each
#    build, through the gRPC session (`--via grpc`, compare.py's `daemon` row) and the framed
#    local session (`--via local`, the Python package's crossing), WRITE and READ, SIZES (64K,
#    256K,1M,16M), ROUNDS (3) rounds alternating A B / B A; prints p50 µs (median over the rounds)
#    and before ÷ after (> 1: after faster), per round too.
# 2. Traced (TRACE=0 skips it): 1 MiB WRITE and READ through the local session, BEFORE and AFTER,
#    `benches/hops.py`: the receiver's consume → `Done` → the sender's end, leg by leg;
#    `benches/done_leg.py`: the WRITE receiver's last consume → `Done` on the wire.
# 3. compare.py on AFTER (COMPARE=0 skips it): `--sizes 64K,1M,16M --iters 30`, WRITE then READ;
#    its table has daemon/nccl-socket (gRPC) and local/nccl-socket (#38: the daemon ≥ NCCL over
#    its own sockets at every size).
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n 2,22p "$0"
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
before=$(cd "$1" && pwd) after=$(cd "$2" && pwd) out=${3:-/tmp/onemib2-device}
rounds=${ROUNDS:-3} iters=${ITERS:-300} warmup=${WARMUP:-30} sizes=${SIZES:-64K,256K,1M,16M}
for d in "$before" "$after"; do
    for f in tcpxd tcpxctl libnccl_net_tcpxemu.so; do
        [ -e "$d/$f" ] || { echo "$d/$f: missing" >&2; exit 2; }
    done
done
gpus=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
[ "$gpus" -ge 1 ] 2>/dev/null || { echo "no GPU (nvidia-smi -L lists none; set GPUS=1 to try anyway)" >&2; exit 2; }
peer=0
[ "$gpus" -ge 2 ] && peer=1
rm -rf "$out" && mkdir -p "$out"
export NCCL_NSOCKS_PERTHREAD=4 NCCL_SOCKET_NTHREADS=1 NCCL_DYNAMIC_CHUNK_SIZE=524288 TCPXEMU_BOUNCE=cuda
export NCCL_NVLS_ENABLE=0
start=$SECONDS
for ((r = 1; r <= rounds; r++)); do
    if ((r % 2)); then order=(A B); else order=(B A); fi
    for who in "${order[@]}"; do
        dir=$before
        [ "$who" = B ] && dir=$after
        for via in grpc local; do
            for op in write read; do
                "$dir/tcpxctl" bench transfer --daemon "$dir/tcpxd" --via "$via" --op "$op" --cuda 0 \
                    --peer-cuda "$peer" --sizes "$sizes" --iters "$iters" --warmup "$warmup" --json \
                    --out "$out/r$r-$who-$via-$op.jsonl" >/dev/null 2>"$out/r$r-$who-$via-$op.err" \
                    || echo "r$r $who $via $op failed (see $out/r$r-$who-$via-$op.err)" >&2
            done
        done
        echo "round $r ($who) done, $((SECONDS - start)) s" >&2
    done
done
python3 - "$out" "$peer" <<'EOF' | tee "$out/summary.txt"
import glob, json, os, re, statistics, sys
from collections import defaultdict
out, peer = sys.argv[1], sys.argv[2]
p50 = defaultdict(dict)  # (who, via, op, size) -> {round: p50}
ok = True
for f in sorted(glob.glob(os.path.join(out, "r*.jsonl"))):
    m = re.match(r"r(\d+)-(\w)-(\w+)-(\w+)\.jsonl", os.path.basename(f))
    rnd, who, via, op = int(m.group(1)), m.group(2), m.group(3), m.group(4)
    for line in open(f):
        r = json.loads(line)
        ok &= bool(r.get("verified", True))
        p50[(who, via, op, r["block_size"])][rnd] = r["p50_lat_us"]
def size(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
med = statistics.median
print(f"GPU 0 -> {peer}, p50 µs (median over the rounds); A before, B after; A/B > 1: after faster")
print(f"{'via':<6} {'op':<6} {'size':>7} {'A':>8} {'B':>8} {'A/B':>6}   A/B per round")
for (via, op, sz) in sorted({(k[1], k[2], k[3]) for k in p50}):
    a, b = p50.get(("A", via, op, sz), {}), p50.get(("B", via, op, sz), {})
    if not (a and b):
        continue
    per = " ".join(f"{a[r] / b[r]:.2f}" for r in sorted(a) if r in b)
    print(f"{via:<6} {op:<6} {size(sz):>7} {med(a.values()):>8.0f} {med(b.values()):>8.0f} "
          f"{med(a.values()) / med(b.values()):>6.2f}   {per}")
print("every row verified" if ok else "SOME ROWS NOT VERIFIED")
EOF

if [ "${TRACE:-1}" = 1 ]; then
    {
        for who in before after; do
            dir=$after
            [ "$who" = before ] && dir=$before
            for op in write read; do
                t="$out/trace-$who-$op"
                mkdir -p "$t"
                RUST_LOG=tcpxd::hop=trace "$dir/tcpxctl" bench transfer --daemon "$dir/tcpxd" --via local \
                    --op "$op" --cuda 0 --peer-cuda "$peer" --sizes 1M --iters 200 --warmup 20 --keep-dir \
                    >"$t/bench.txt" 2>&1 || true
                kept=$(grep -o '/tmp/tcpxd-bench-[0-9]*' "$t/bench.txt" | head -1)
                [ -n "$kept" ] && mv "$kept"/*.log "$t/" && rm -rf "$kept"
                echo "== 1 MiB $op through the local session, GPU 0 -> $peer (${who^^}), traced"
                python3 "$here/hops.py" "$t/bench-a.log" "$t/bench-b.log" | tail -n 40 || true
                python3 "$here/lanes.py" "$t/bench-a.log" "$t/bench-b.log" || true
                if [ "$op" = write ]; then python3 "$here/done_leg.py" "$t/bench-b.log" || true; fi
            done
        done
    } 2>&1 | tee "$out/trace.txt"
fi

if [ "${COMPARE:-1}" = 1 ]; then
    same=()
    [ "$peer" = 0 ] && same=(--same-gpu)
    for op in write read; do
        echo "== compare.py AFTER, $op" | tee -a "$out/compare.txt"
        python3 "$here/compare.py" --bin "$after" --sizes 64K,1M,16M --iters 30 --op "$op" "${same[@]}" \
            --out "$out/compare-$op.jsonl" --logs "$out/compare-logs-$op" 2>&1 | tee -a "$out/compare.txt" || true
    done
fi
echo "all done in $((SECONDS - start)) s" >&2
