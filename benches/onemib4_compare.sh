#!/usr/bin/env bash
# Issue #38's rows one at a time (session 33, onemib4): this branch against main at 256 KiB, 1 MiB
# and 4 MiB — raw, the daemons (gRPC and the framed local session, WRITE and READ) and NCCL over
# its own sockets, every harness in every round. About 4–5 minutes on the H200 host.
#
#   benches/onemib4_compare.sh A_DIR B_DIR [OUT_DIR]
#
# A_DIR: this branch's staged release binaries (tcpxd, tcpxctl, libnccl_net_tcpxemu.so), B_DIR:
# main's. GPU 0 -> 1 (0 -> 0 on a one-GPU host, NCCL under compare.py's --mps there).
# ROUNDS (3) rounds alternate the order of NCCL (compare.py --only nccl-socket: send/recv timed
# to a 1-byte ack), rawA, rawB (`tcpxctl bench raw`, each build's own), A and B (`tcpxctl bench
# transfer`, gRPC and local, WRITE and READ); SIZES (256K,1M,4M), ITERS (200) after WARMUP (20).
# Prints p50 µs (median over the rounds) and the ratios, each "X/Y" = Y's p50 ÷ X's (> 1: X
# faster): A/B, daemon ÷ raw (A/rawA, B/rawB: #38's target ≥ 0.95), daemon ÷ NCCL's sockets
# (A/nccl, B/nccl: ≥ 1), and A/B per round. Then (TRACE=0 skips it) 1 MiB through the local
# session traced, A's tcpxctl driving A's daemons and B's (TROUNDS, 1, alternating), and
# `benches/legs.py` leg by leg: raw, B, A. Before it (INFLIGHT=0 skips it) 64 KiB and 1 MiB with
# 8 in flight through the local session, A against B, two runs each.
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n 2,21p "$0"
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
a=$(cd "$1" && pwd) b=$(cd "$2" && pwd) out=${3:-/tmp/onemib4-compare}
rounds=${ROUNDS:-3} iters=${ITERS:-200} warmup=${WARMUP:-20} sizes=${SIZES:-256K,1M,4M}
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
[ "$peer" = 0 ] && [ "${MPS:-1}" = 1 ] && same+=(--mps)
rm -rf "$out" && mkdir -p "$out"
export NCCL_NSOCKS_PERTHREAD=4 NCCL_SOCKET_NTHREADS=1 NCCL_DYNAMIC_CHUNK_SIZE=524288 TCPXEMU_BOUNCE=cuda
export NCCL_NVLS_ENABLE=0
unset RUST_LOG TCPXD_SPREAD_CHUNKS_PER_LANE TCPXD_SPREAD_MIN_CHUNK_BYTES TCPXD_HOP_RECORD
echo "GPU 0 -> $peer, $(nproc) CPUs, $rounds rounds of $iters transfers a size ($sizes)" | tee "$out/setup.txt"
declare -A dir=([A]=$a [B]=$b [rawA]=$a [rawB]=$b)

nccl() { # round
    python3 "$here/compare.py" --bin "$a" --only nccl-socket --sizes "$sizes" --iters "$iters" \
        --warmup "$warmup" --op write "${same[@]}" --out "$out/r$1-nccl.jsonl" \
        --logs "$out/logs-r$1" >"$out/r$1-nccl.txt" 2>&1 || echo "r$1 nccl failed (see $out/r$1-nccl.txt)" >&2
}
raw() { # round variant
    local d=${dir[$2]}
    for op in write read; do
        "$d/tcpxctl" bench raw --op "$op" --cuda 0 --plugin "$d/libnccl_net_tcpxemu.so" --sizes "$sizes" \
            --iters "$iters" --warmup "$warmup" --json --out "$out/r$1-$2-raw-$op.jsonl" >/dev/null \
            2>"$out/r$1-$2-raw-$op.err" || echo "r$1 $2 raw $op failed" >&2
    done
}
daemon() { # round variant
    local d=${dir[$2]}
    for via in grpc local; do
        for op in write read; do
            "$d/tcpxctl" bench transfer --daemon "$d/tcpxd" --via "$via" --op "$op" --cuda 0 --peer-cuda "$peer" \
                --sizes "$sizes" --iters "$iters" --warmup "$warmup" --json --out "$out/r$1-$2-$via-$op.jsonl" \
                >/dev/null 2>"$out/r$1-$2-$via-$op.err" || echo "r$1 $2 $via $op failed (see $out/r$1-$2-$via-$op.err)" >&2
        done
    done
}
start=$SECONDS
for ((r = 1; r <= rounds; r++)); do
    if ((r % 2)); then order=(nccl rawA rawB A B); else order=(B A rawB rawA nccl); fi
    for who in "${order[@]}"; do
        case $who in
        nccl) nccl "$r" ;;
        raw*) raw "$r" "$who" ;;
        *) daemon "$r" "$who" ;;
        esac
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
def ratio(x, y):
    return f"{y / x:.2f}" if x and y else "-"
cols = ["nccl", "rawA", "rawB", "A", "B"]
print("p50 µs, median over the rounds (NCCL: send/recv to a 1-byte ack, the same row for every via and op; "
      "raw: both sides in one process, the same row for gRPC and local)")
print(f"{'via':<7}{'op':<6}{'size':>5} " + "".join(f"{c:>7}" for c in cols)
      + "   A/B  A/rawA  B/rawB  A/nccl  B/nccl  A/B per round")
for (via, op, sz) in sorted({(k[1], k[2], k[3]) for k in p50 if k[0] in ("A", "B")}):
    v = {c: m(c, via, op, sz) for c in cols}
    b, a = p50.get(("B", via, op, sz), {}), p50.get(("A", via, op, sz), {})
    per = " ".join(f"{b[r] / a[r]:.2f}" for r in sorted(b) if r in a)
    print(f"{via:<7}{op:<6}{size(sz):>5} " + "".join(f"{v[c]:>7.0f}" if v[c] else f"{'-':>7}" for c in cols)
          + f"  {ratio(v['A'], v['B']):>4}  {ratio(v['A'], v['rawA']):>6}  {ratio(v['B'], v['rawB']):>6}"
          + f"  {ratio(v['A'], v['nccl']):>6}  {ratio(v['B'], v['nccl']):>6}  {per}")
print("X/Y = Y's p50 ÷ X's: > 1 means X is faster; A/rawA is #38's daemon ÷ raw (target ≥ 0.95), "
      "A/nccl the daemon against NCCL's sockets (target ≥ 1)")
print("every row verified" if ok else "SOME ROWS NOT VERIFIED")
EOF
# 8 in flight (INFLIGHT=0 skips it): 64 KiB and 1 MiB through the local session, A and B, one
# round each way (B A, then A B), ITERS8 (1000) transfers: GB/s, A ÷ B.
if [ "${INFLIGHT:-1}" = 1 ]; then
    for order in "B A" "A B"; do
        for who in $order; do
            for op in write read; do
                "${dir[$who]}/tcpxctl" bench transfer --daemon "${dir[$who]}/tcpxd" --via local --op "$op" --cuda 0 \
                    --peer-cuda "$peer" --sizes 64K,1M --concurrency 8 --iters "${ITERS8:-1000}" --warmup 100 --json \
                    --out "$out/i-$who-$op-${order// /}.jsonl" >/dev/null 2>"$out/i-$who-$op.err" ||
                    echo "8 in flight $who $op failed" >&2
            done
        done
    done
    python3 - "$out" <<'EOF2' | tee -a "$out/summary.txt"
import glob, json, os, re, statistics, sys
from collections import defaultdict
out = sys.argv[1]
g = defaultdict(list)
for f in glob.glob(os.path.join(out, "i-*.jsonl")):
    who, op = re.match(r"i-(\w+)-(\w+)-", os.path.basename(f)).groups()
    for line in open(f):
        r = json.loads(line)
        if "gb_per_s" in r and "block_size" in r:
            g[(who, op, r["block_size"])].append(r["gb_per_s"])
for op in ("write", "read"):
    for sz in sorted({k[2] for k in g}):
        a, b = g.get(("A", op, sz)), g.get(("B", op, sz))
        if a and b:
            print(f"8 in flight, local, {op} {sz >> 10} KiB: GB/s B {statistics.median(b):.2f} A {statistics.median(a):.2f}"
                  f"  A ÷ B {statistics.median(a) / statistics.median(b):.2f} (runs B {' '.join(f'{x:.2f}' for x in b)},"
                  f" A {' '.join(f'{x:.2f}' for x in a)})")
EOF2
fi
# Traced (TRACE=0 skips it): 1 MiB through the local session, A's tcpxctl driving A's daemons and
# B's, alternating, TROUNDS (1) rounds of ITERS; `legs.py` sets raw (A's, traced) beside both.
if [ "${TRACE:-1}" = 1 ]; then
    trounds=${TROUNDS:-1}
    for ((r = 1; r <= trounds; r++)); do
        if ((r % 2)); then order=(raw A B); else order=(B A raw); fi
        for who in "${order[@]}"; do
            for op in write read; do
                f="$out/t$r-$who-$op"
                if [ "$who" = raw ]; then
                    RUST_LOG=tcpxd::hop=trace "$a/tcpxctl" bench raw --op "$op" --cuda 0 --plugin "$a/libnccl_net_tcpxemu.so" \
                        --sizes 1M --iters "$iters" --warmup "$warmup" >/dev/null 2>"$f.log" || echo "t$r raw $op failed" >&2
                    continue
                fi
                RUST_LOG=tcpxd::hop=trace "$a/tcpxctl" bench transfer --daemon "${dir[$who]}/tcpxd" --via local --op "$op" \
                    --cuda 0 --peer-cuda "$peer" --sizes 1M --iters "$iters" --warmup "$warmup" --keep-dir \
                    >/dev/null 2>"$f.log" || echo "t$r $who $op traced failed (see $f.log)" >&2
                kept=$(grep -o '/tmp/tcpxd-bench-[0-9]*' "$f.log" | head -1 || true)
                if [ -n "$kept" ]; then
                    mv "$kept/bench-a.log" "$f.a.log" && mv "$kept/bench-b.log" "$f.b.log" && rm -rf "$kept"
                fi
            done
        done
    done
    {
        for op in write read; do
            echo "== 1 MiB $op one at a time, local session, traced, $trounds rounds pooled: raw, B's daemons, A's daemons"
            args=()
            for ((r = 1; r <= trounds; r++)); do args+=(--raw "$out/t$r-raw-$op.log"); done
            for who in B A; do
                for ((r = 1; r <= trounds; r++)); do
                    f="$out/t$r-$who-$op"
                    args+=(--daemon "$who" "$f.log" "$f.a.log" "$f.b.log")
                done
            done
            python3 "$here/legs.py" --skip "$warmup" "${args[@]}" || true
        done
    } 2>&1 | tee "$out/legs.txt"
    gzip -f "$out"/t*.log 2>/dev/null || true
fi
echo "all done in $((SECONDS - start)) s" >&2
