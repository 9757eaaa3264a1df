#!/usr/bin/env bash
# Session 32, sendtest (issue #38): the poller's lanes test each send right after posting it (the plugin
# moves a send's bytes only inside `test`: Google's tcpxTest -> tcpxCommProgress; isend only
# queues), so a transfer's first chunk starts while the others are posted. A (this branch)
# against B (main), alternating, in one call. About 2–3 minutes on the H200 host.
#
#   benches/sendtest_device.sh A_DIR B_DIR [OUT_DIR]
#
# A_DIR / B_DIR: staged release binaries (tcpxd, tcpxctl, libnccl_net_tcpxemu.so). GPU 0 -> 1
# (0 -> 0 on a one-GPU host). Rounds (ROUNDS, 3), each in alternating order, of
# `tcpxctl bench transfer --via local`, WRITE and READ:
#   - one at a time: 256K,1M (ITERS, 300 transfers a size);
#   - 8 in flight: 64K,1M (ITERS8, 2000 transfers a size);
# each for the poller's lane pass (B, A) and with the lane threads on (BT, AT: TCPXD_LANE_THREAD=on;
# since the H200 call their `post_held` is main's again, so these rows are a control; LT=0 skips them). Prints p50 µs (one at a time) and GB/s (8 in flight), medians of
# the rounds, A/B = B's p50 ÷ A's (> 1: A faster), and the per-round ratios.
# Then (TRACE=0 skips it) 1 MiB one at a time traced, B and A, WRITE: `lanes.py` (the data phase:
# first isend -> last receive).
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n 2,19p "$0"
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
a=$(cd "$1" && pwd) b=$(cd "$2" && pwd) out=${3:-/tmp/sendtest-device}
rounds=${ROUNDS:-3} iters=${ITERS:-300} iters8=${ITERS8:-2000} warmup=${WARMUP:-20}
for d in "$a" "$b"; do
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
unset TCPXD_LANE_THREAD
echo "GPU 0 -> $peer, $(nproc) CPUs, $rounds rounds; one at a time $iters a size, 8 in flight $iters8 a size" | tee "$out/setup.txt"

declare -A dir=([B]=$b [A]=$a [BT]=$b [AT]=$a)
declare -A venv=([B]="" [A]="" [BT]="TCPXD_LANE_THREAD=on" [AT]="TCPXD_LANE_THREAD=on")
bench() { # round variant op name extra...
    local r=$1 v=$2 op=$3 name=$4
    shift 4
    env ${venv[$v]} "${dir[$v]}/tcpxctl" bench transfer --daemon "${dir[$v]}/tcpxd" --via local \
        --op "$op" --cuda 0 --peer-cuda "$peer" --warmup "$warmup" --json "$@" \
        --out "$out/r$r-$v-$name-$op.jsonl" >/dev/null 2>"$out/r$r-$v-$name-$op.err" ||
        echo "r$r $v $name $op failed (see $out/r$r-$v-$name-$op.err)" >&2
}
run() { # round variant
    for op in write read; do
        bench "$1" "$2" "$op" one --sizes 256K,1M --iters "$iters"
        bench "$1" "$2" "$op" c8 --sizes 64K,1M --concurrency 8 --iters "$iters8"
    done
}
variants=(B A)
[ "${LT:-1}" = 1 ] && variants+=(BT AT)
start=$SECONDS
for ((r = 1; r <= rounds; r++)); do
    order=("${variants[@]}")
    ((r % 2)) || order=($(printf '%s\n' "${variants[@]}" | tac))
    for v in "${order[@]}"; do run "$r" "$v"; done
    echo "round $r done, $((SECONDS - start)) s" >&2
done

python3 - "$out" <<'EOF' | tee "$out/summary.txt"
import glob, json, os, re, statistics, sys
from collections import defaultdict
out = sys.argv[1]
vals = defaultdict(dict)  # (variant, kind, op, size) -> {round: value}
ok = True
for f in sorted(glob.glob(os.path.join(out, "r*.jsonl"))):
    m = re.match(r"r(\d+)-(\w+)-(one|c8)-(\w+)\.jsonl$", os.path.basename(f))
    rnd, v, kind, op = int(m.group(1)), m.group(2), m.group(3), m.group(4)
    for line in open(f):
        r = json.loads(line)
        if "block_size" not in r:
            continue
        ok &= bool(r.get("verified", True))
        if kind == "one" and "p50_lat_us" in r:
            vals[(v, "p50 µs", op, r["block_size"])][rnd] = r["p50_lat_us"]
        elif kind != "one" and "gb_per_s" in r:
            vals[(v, "GB/s, 8 in flight", op, r["block_size"])][rnd] = r["gb_per_s"]
med = statistics.median
def size(n):
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"
print("local session; one at a time: p50 µs; 8 in flight: GB/s; medians over the rounds")
print("A/B > 1: A better (p50: B ÷ A; GB/s: A ÷ B); per round in brackets")
for base, x in (("B", "A"), ("BT", "AT")):
    rows = sorted({(k[1], k[2], k[3]) for k in vals if k[0] == base})
    if not rows:
        continue
    print(f"\n{x} vs {base}" + (" (TCPXD_LANE_THREAD=on)" if base == "BT" else " (the poller's lane pass)"))
    print(f"{'what':<18}{'op':<6}{'size':>5} {base:>9} {x:>9} {x + '/' + base:>6}  per round")
    for what, op, sz in rows:
        b, a = vals[(base, what, op, sz)], vals.get((x, what, op, sz), {})
        if not a:
            continue
        lat = what.startswith("p50")
        rat = (lambda bb, aa: bb / aa) if lat else (lambda bb, aa: aa / bb)
        per = " ".join(f"{rat(b[r], a[r]):.2f}" for r in sorted(b) if r in a)
        print(f"{what:<18}{op:<6}{size(sz):>5} {med(b.values()):>9.2f} {med(a.values()):>9.2f} "
              f"{rat(med(b.values()), med(a.values())):>6.2f}  [{per}]")
print("\nevery row verified" if ok else "\nSOME ROWS NOT VERIFIED")
EOF

if [ "${TRACE:-1}" = 1 ]; then
    {
        for v in B A; do
            t="$out/trace-$v"
            mkdir -p "$t"
            RUST_LOG=tcpxd::hop=trace "${dir[$v]}/tcpxctl" bench transfer --daemon "${dir[$v]}/tcpxd" \
                --via local --op write --cuda 0 --peer-cuda "$peer" --sizes 1M --iters 200 --warmup 20 \
                --keep-dir >"$t/bench.txt" 2>&1 || true
            kept=$(grep -o '/tmp/tcpxd-bench-[0-9]*' "$t/bench.txt" | head -1)
            [ -n "$kept" ] && mv "$kept"/*.log "$t/" && rm -rf "$kept"
            echo "== 1 MiB WRITE, local session, GPU 0 -> $peer ($v), traced"
            tail -n 1 "$t/bench.txt"
            python3 "$here/lanes.py" "$t/bench-a.log" "$t/bench-b.log" || true
            rm -f "$t"/*.log
        done
    } 2>&1 | tee "$out/trace.txt"
fi
echo "all done in $((SECONDS - start)) s" >&2
