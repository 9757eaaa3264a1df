#!/usr/bin/env bash
# Issue #38 at 1 MiB one at a time (session 32, onemib3): a data phase shorter than raw's — a
# spread transfer cut into more chunks a lane (`transfer.spread_chunks_per_lane`), so 1 MiB goes
# as eight requests of 128 KiB (every data socket of both lanes' comms) or sixteen of 64 KiB
# instead of four of 256 KiB — against main, the raw path planned alike, and NCCL over its own
# sockets, in one call. About 4–5 minutes on the H200 host.
#
#   benches/onemib3_device.sh A_DIR B_DIR [OUT_DIR]
#
# A_DIR: this branch's staged release binaries (tcpxd, tcpxctl, libnccl_net_tcpxemu.so), B_DIR:
# main's. GPU 0 -> 1 (0 -> 0 on a one-GPU host, NCCL under compare.py's --mps there).
# Rounds (ROUNDS, 3) alternate the order of:
#   - NCCL over its own sockets (compare.py --only nccl-socket, send/recv timed to a 1-byte ack);
#   - raw (`tcpxctl bench raw`, both sides in one process): B's defaults (four chunks of 256 KiB
#     at 1 MiB), and A's with 4 and 8 chunks a lane (8 × 128 KiB; 16 × 64 KiB with the floor at
#     64 KiB);
#   - the daemons (`tcpxctl bench transfer`), gRPC and framed local session, WRITE and READ:
#     B, A (defaults), A4 (TCPXD_SPREAD_CHUNKS_PER_LANE=4), A8 (=8 with
#     TCPXD_SPREAD_MIN_CHUNK_BYTES=65536).
# SIZES (256K,1M,16M; 16 MiB is the control: never spread), ITERS (200), WARMUP (20); and B, A4
# at 1 MiB with 8 in flight through the local session (INFLIGHT=0 skips it: the row where more
# chunks a transfer cost the pollers more work).
# Then (TRACE=0 skips it) 1 MiB through the local session traced, A and A4, WRITE and READ:
# `lanes.py` (first isend -> last receive: the data phase) and `hops.py`.
# Prints p50 µs (median over the rounds) and the ratios: X/Y = Y's p50 ÷ X's (> 1: X faster).
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n 2,25p "$0"
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
a=$(cd "$1" && pwd) b=$(cd "$2" && pwd) out=${3:-/tmp/onemib3-device}
rounds=${ROUNDS:-3} iters=${ITERS:-200} warmup=${WARMUP:-20} sizes=${SIZES:-256K,1M,16M}
for d in "$a" "$b"; do
    for f in tcpxd tcpxctl libnccl_net_tcpxemu.so; do
        [ -e "$d/$f" ] || { echo "$d/$f: missing" >&2; exit 2; }
    done
done
gpus=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
[ "$gpus" -ge 1 ] 2>/dev/null || { echo "no GPU (nvidia-smi -L lists none; set GPUS=1 to try anyway)" >&2; exit 2; }
peer=0
[ "$gpus" -ge 2 ] && peer=1
same=()
[ "$peer" = 0 ] && same=(--same-gpu)
# One GPU: NCCL's two ranks share it, and without MPS they time-slice it (the first run here:
# 2.5 ms p50 at 1 MiB), so compare.py's MPS on by default there (MPS=0: off).
[ "$peer" = 0 ] && [ "${MPS:-1}" = 1 ] && same+=(--mps)
rm -rf "$out" && mkdir -p "$out"
export NCCL_NSOCKS_PERTHREAD=4 NCCL_SOCKET_NTHREADS=1 NCCL_DYNAMIC_CHUNK_SIZE=524288 TCPXEMU_BOUNCE=cuda
export NCCL_NVLS_ENABLE=0
unset TCPXD_SPREAD_CHUNKS_PER_LANE TCPXD_SPREAD_MIN_CHUNK_BYTES
echo "GPU 0 -> $peer, $(nproc) CPUs, $rounds rounds of $iters transfers a size ($sizes)" | tee "$out/setup.txt"

# variant -> dir and environment
declare -A dir=([B]=$b [A]=$a [A4]=$a [A8]=$a)
declare -A venv=([B]="" [A]="" [A4]="TCPXD_SPREAD_CHUNKS_PER_LANE=4"
    [A8]="TCPXD_SPREAD_CHUNKS_PER_LANE=8 TCPXD_SPREAD_MIN_CHUNK_BYTES=65536")
declare -A rdir=([rawB]=$b [raw4]=$a [raw8]=$a)
declare -A renv=([rawB]="" [raw4]="TCPXD_SPREAD_CHUNKS_PER_LANE=4"
    [raw8]="TCPXD_SPREAD_CHUNKS_PER_LANE=8 TCPXD_SPREAD_MIN_CHUNK_BYTES=65536")

nccl() { # round
    python3 "$here/compare.py" --bin "$a" --only nccl-socket --sizes "$sizes" --iters "$iters" \
        --warmup "$warmup" --op write "${same[@]}" --out "$out/r$1-nccl.jsonl" \
        --logs "$out/logs-r$1" >"$out/r$1-nccl.txt" 2>&1 || echo "r$1 nccl failed (see $out/r$1-nccl.txt)" >&2
}
raw() { # round variant
    local v=$2
    for op in write read; do
        env ${renv[$v]} "${rdir[$v]}/tcpxctl" bench raw --op "$op" --cuda 0 \
            --plugin "${rdir[$v]}/libnccl_net_tcpxemu.so" --sizes "$sizes" --iters "$iters" \
            --warmup "$warmup" --json --out "$out/r$1-$v-raw-$op.jsonl" >/dev/null \
            2>"$out/r$1-$v-raw-$op.err" || echo "r$1 $v raw $op failed" >&2
    done
}
daemon() { # round variant
    local v=$2
    for via in grpc local; do
        for op in write read; do
            env ${venv[$v]} "${dir[$v]}/tcpxctl" bench transfer --daemon "${dir[$v]}/tcpxd" --via "$via" \
                --op "$op" --cuda 0 --peer-cuda "$peer" --sizes "$sizes" --iters "$iters" \
                --warmup "$warmup" --json --out "$out/r$1-$v-$via-$op.jsonl" >/dev/null \
                2>"$out/r$1-$v-$via-$op.err" || echo "r$1 $v $via $op failed (see $out/r$1-$v-$via-$op.err)" >&2
        done
    done
}
inflight() { # round variant: 1 MiB, 8 in flight, local session (more chunks, more poller work)
    local v=$2
    for op in write read; do
        env ${venv[$v]} "${dir[$v]}/tcpxctl" bench transfer --daemon "${dir[$v]}/tcpxd" --via local \
            --op "$op" --cuda 0 --peer-cuda "$peer" --sizes 1M --concurrency 8 --iters "$iters" \
            --warmup "$warmup" --json --out "$out/r$1-$v-local8-$op.jsonl" >/dev/null \
            2>"$out/r$1-$v-local8-$op.err" || echo "r$1 $v local8 $op failed" >&2
    done
}
start=$SECONDS
for ((r = 1; r <= rounds; r++)); do
    if ((r % 2)); then order=(nccl rawB raw4 raw8 B A A4 A8); else order=(A8 A4 A B raw8 raw4 rawB nccl); fi
    for who in "${order[@]}"; do
        case $who in
        nccl) nccl "$r" ;;
        raw*) raw "$r" "$who" ;;
        *) daemon "$r" "$who" ;;
        esac
        case $who in B | A4) [ "${INFLIGHT:-1}" = 1 ] && inflight "$r" "$who" ;; esac
    done
    echo "round $r done, $((SECONDS - start)) s" >&2
done

python3 - "$out" <<'EOF' | tee "$out/summary.txt"
import glob, json, os, re, statistics, sys
from collections import defaultdict
out = sys.argv[1]
p50 = defaultdict(dict)  # (who, via, op, size) -> {round: p50}
ok = True
for f in sorted(glob.glob(os.path.join(out, "r*.jsonl"))):
    m = re.match(r"r(\d+)-(.+)\.jsonl$", os.path.basename(f))
    rnd, rest = int(m.group(1)), m.group(2)
    for line in open(f):
        r = json.loads(line)
        if "block_size" not in r or "p50_lat_us" not in r:
            continue
        ok &= bool(r.get("verified", True))
        if rest == "nccl":
            if r.get("harness") != "nccl-socket":
                continue
            keys = [("nccl", via, op) for via in ("grpc", "local") for op in ("write", "read")]
        else:
            who, via, op = rest.split("-")
            keys = [(who, v, op) for v in ("grpc", "local")] if via == "raw" else [(who, via, op)]
        for k in keys:
            p50[k + (r["block_size"],)][rnd] = r["p50_lat_us"]
med = statistics.median
def size(n):
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"
def m(who, via, op, sz):
    d = p50.get((who, via, op, sz))
    return med(d.values()) if d else None
def ratio(x, y):  # y's p50 over x's: > 1 when x is faster
    return f"{y / x:.2f}" if x and y else "-"
cols = ["nccl", "rawB", "raw4", "raw8", "B", "A", "A4", "A8"]
print("p50 µs, median over the rounds (NCCL: send/recv to a 1-byte ack; raw: both sides in one process, "
      "its READ and WRITE rows alike for gRPC and local)")
print(f"{'via':<7}{'op':<6}{'size':>5} " + "".join(f"{c:>7}" for c in cols)
      + "  A/B  A4/B  A8/B  A4/nccl A8/nccl B/nccl  A4/raw4 B/rawB  A4/B per round")
for (via, op, sz) in sorted({(k[1], k[2], k[3]) for k in p50 if k[0] not in ("nccl",) and not k[0].startswith("raw")}):
    v = {c: m(c, via, op, sz) for c in cols}
    per = ""
    b, a4 = p50.get(("B", via, op, sz), {}), p50.get(("A4", via, op, sz), {})
    per = " ".join(f"{b[r] / a4[r]:.2f}" for r in sorted(b) if r in a4)
    print(f"{via:<7}{op:<6}{size(sz):>5} " + "".join(f"{v[c]:>7.0f}" if v[c] else f"{'-':>7}" for c in cols)
          + f" {ratio(v['A'], v['B']):>4} {ratio(v['A4'], v['B']):>5} {ratio(v['A8'], v['B']):>5}"
          + f" {ratio(v['A4'], v['nccl']):>7} {ratio(v['A8'], v['nccl']):>7} {ratio(v['B'], v['nccl']):>6}"
          + f" {ratio(v['A4'], v['raw4']):>8} {ratio(v['B'], v['rawB']):>6}  {per}")
print("X/Y = Y's p50 ÷ X's: > 1 means X is faster (X/nccl ≥ 1: the daemon at or above NCCL's sockets)")
gbps = defaultdict(dict)
for f in sorted(glob.glob(os.path.join(out, "r*-local8-*.jsonl"))):
    m = re.match(r"r(\d+)-(\w+)-local8-(\w+)\.jsonl$", os.path.basename(f))
    for line in open(f):
        r = json.loads(line)
        if "gb_per_s" in r:
            gbps[(m.group(2), m.group(3))][int(m.group(1))] = r["gb_per_s"]
for op in ("write", "read"):
    b, a4 = gbps.get(("B", op), {}), gbps.get(("A4", op), {})
    if b and a4:
        per = " ".join(f"{a4[r] / b[r]:.2f}" for r in sorted(b) if r in a4)
        print(f"1 MiB, 8 in flight, local, {op}: GB/s B {med(b.values()):.2f}, A4 {med(a4.values()):.2f}, "
              f"A4 ÷ B {med(a4.values()) / med(b.values()):.2f} (per round {per})")
print("every row verified" if ok else "SOME ROWS NOT VERIFIED")
EOF

if [ "${TRACE:-1}" = 1 ]; then
    {
        for v in A A4; do
            for op in write read; do
                t="$out/trace-$v-$op"
                mkdir -p "$t"
                env ${venv[$v]} RUST_LOG=tcpxd::hop=trace "${dir[$v]}/tcpxctl" bench transfer \
                    --daemon "${dir[$v]}/tcpxd" --via local --op "$op" --cuda 0 --peer-cuda "$peer" \
                    --sizes 1M --iters 200 --warmup 20 --keep-dir >"$t/bench.txt" 2>&1 || true
                kept=$(grep -o '/tmp/tcpxd-bench-[0-9]*' "$t/bench.txt" | head -1)
                [ -n "$kept" ] && mv "$kept"/*.log "$t/" && rm -rf "$kept"
                echo "== 1 MiB $op through the local session, GPU 0 -> $peer ($v: ${venv[$v]:-defaults}), traced"
                tail -n 1 "$t/bench.txt"
                python3 "$here/lanes.py" "$t/bench-a.log" "$t/bench-b.log" || true
                python3 "$here/hops.py" "$t/bench-a.log" "$t/bench-b.log" | tail -n 32 || true
                rm -f "$t"/*.log
            done
        done
    } 2>&1 | tee "$out/trace.txt"
fi
echo "all done in $((SECONDS - start)) s" >&2
