#!/usr/bin/env bash
# Session 32 (lead): should `transfer.spread_min_chunk_bytes` default to 64 KiB instead of 128 KiB?
# With two chunks a lane (the default), the floor decides only transfers from 128 KiB to 256 KiB:
# 128 KiB goes as 2 × 64 KiB instead of one request, 256 KiB as 4 × 64 KiB instead of 2 × 128 KiB;
# 64 KiB and from 512 KiB up are planned alike (session 32, onemib3: 256 KiB 1.18–1.27× faster one
# at a time on one H200, not measured in flight or on two GPUs). This runs one build both ways,
# alternating (D = the default, F = TCPXD_SPREAD_MIN_CHUNK_BYTES=65536), GPU 0 -> 1 (0 -> 0 on one
# GPU): framed local session and gRPC, WRITE and READ, one at a time and 8 in flight, and the raw
# path planned alike each way. About 3 minutes.
#
#   benches/spreadfloor_device.sh BIN_DIR [OUT_DIR [NEW_DIR]]
#
# BIN_DIR (and NEW_DIR) hold tcpxd, tcpxctl and libnccl_net_tcpxemu.so. With NEW_DIR (a build that
# spreads a transfer only while it is alone on the lanes, session 32) two more variants run: I
# (NEW_DIR, the default floor) and J (NEW_DIR, the 64 KiB floor), printed against D. Environment: ROUNDS (3), ITERS (300),
# SIZES (128K,256K,512K). Prints p50 µs (one at a time) and GB/s (8 in flight), medians over the
# rounds, and D ÷ each other variant (> 1: that variant faster).
set -euo pipefail
bin=$(cd "$1" && pwd) out=${2:-/tmp/spreadfloor} new=${3:-}
[ -n "$new" ] && new=$(cd "$new" && pwd)
rounds=${ROUNDS:-3} iters=${ITERS:-300} sizes=${SIZES:-128K,256K,512K}
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
peer=0; [ "${gpus:-0}" -ge 2 ] && peer=1
rm -rf "$out" && mkdir -p "$out"
export TCPXEMU_BOUNCE=cuda NCCL_NSOCKS_PERTHREAD=4 NCCL_SOCKET_NTHREADS=1 NCCL_DYNAMIC_CHUNK_SIZE=524288
unset TCPXD_SPREAD_CHUNKS_PER_LANE TCPXD_SPREAD_MIN_CHUNK_BYTES
echo "GPU 0 -> $peer, $(nproc) CPUs, $rounds rounds, $iters transfers a row, sizes $sizes"
run() { # round variant
    local env=() bin=$bin
    case $2 in F | J) env=(TCPXD_SPREAD_MIN_CHUNK_BYTES=65536) ;; esac
    case $2 in I | J) bin=$new ;; esac
    for op in write read; do
        env "${env[@]}" "$bin/tcpxctl" bench raw --op "$op" --cuda 0 --plugin "$bin/libnccl_net_tcpxemu.so" \
            --sizes "$sizes" --iters "$iters" --warmup 20 --json --out "$out/r$1-$2-raw-c1-$op.jsonl" \
            >/dev/null 2>>"$out/err.txt" || echo "r$1 $2 raw $op failed" >&2
        for via in local grpc; do
            for c in 1 8; do
                [ "$via" = grpc ] && [ "$c" = 8 ] && continue
                env "${env[@]}" "$bin/tcpxctl" bench transfer --daemon "$bin/tcpxd" --via "$via" --op "$op" \
                    --cuda 0 --peer-cuda "$peer" --sizes "$sizes" --concurrency "$c" --iters "$iters" \
                    --warmup 20 --json --out "$out/r$1-$2-$via-c$c-$op.jsonl" >/dev/null 2>>"$out/err.txt" \
                    || echo "r$1 $2 $via c$c $op failed" >&2
            done
        done
    done
}
for ((r = 1; r <= rounds; r++)); do
    variants=(D F)
    [ -n "$new" ] && variants+=(I J)
    if ((r % 2 == 0)); then variants=($(printf '%s\n' "${variants[@]}" | tac)); fi
    for v in "${variants[@]}"; do run "$r" "$v"; done
    echo "round $r done" >&2
done
python3 - "$out" <<'PY' | tee "$out/summary.txt"
import glob, json, os, re, statistics, sys
from collections import defaultdict
out = sys.argv[1]
val = defaultdict(list)
ok = True
for f in sorted(glob.glob(os.path.join(out, "r*.jsonl"))):
    _, v, via, c, op = re.match(r"r(\d+)-(\w)-(\w+)-c(\d)-(\w+)\.jsonl$", os.path.basename(f)).groups()
    for line in open(f):
        x = json.loads(line)
        if "block_size" not in x or "p50_lat_us" not in x:
            continue
        h = str(x.get("harness", ""))
        if via != "raw" and not h.startswith("daemon"):
            continue
        ok &= bool(x.get("verified", True))
        key = (via, c, op, x["block_size"], v)
        val[key].append(x["p50_lat_us"] if c == "1" else x["gb_per_s"])
rows = sorted({k[:4] for k in val}, key=lambda k: (k[0], k[1], k[2], k[3]))
for x in ("F", "I", "J"):
    if not any(k[4] == x for k in val):
        continue
    print(f"== {x} against D (D÷{x} > 1: {x} better)")
    print(f"{'path':6} {'in flight':>9} {'op':5} {'size':>6} {'D':>9} {x:>9} {'D÷' + x:>6}  per round")
    for via, c, op, sz in rows:
        d, f = val.get((via, c, op, sz, "D"), []), val.get((via, c, op, sz, x), [])
        if not d or not f:
            continue
        md, mf = statistics.median(d), statistics.median(f)
        unit = "µs p50" if c == "1" else "GB/s"
        r = (md / mf) if c == "1" else (mf / md)
        per = " ".join(f"{(a / b) if c == '1' else (b / a):.2f}" for a, b in zip(d, f))
        print(f"{via:6} {c:>9} {op:5} {sz >> 10:>5}K {md:9.1f} {mf:9.1f} {r:6.2f}  {per}  ({unit})")
print("every row verified" if ok else "SOME ROW NOT VERIFIED")
PY
