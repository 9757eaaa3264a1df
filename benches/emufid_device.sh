#!/usr/bin/env bash
# Session 33, emufid: the baselines again on the faithful emulation. Since session 33 the
# emulation's `test` moves one more request per call, as Google's plugin's (a send: at most one
# chunk per data socket per call; TCPXEMU_PROGRESS=eager is the old emulation), and the raw bench
# tests after each post. A = this branch, B = main; compare.py on one GPU (--same-gpu --mps), rows
# raw / daemon / nccl-plugin / nccl-socket at 64K,256K,1M,16M, WRITE, one at a time and 8 in
# flight; each round B A then A B (one at a time), A B then B A (8 in flight), the next round the
# other way. nccl-socket does not use the emulation: its A/B is the noise. About 2 minutes a
# round on the H200 host (NCCL's start-up is most of it).
#
#   benches/emufid_device.sh A_DIR B_DIR [OUT_DIR]
#
# A_DIR / B_DIR: staged release binaries (tcpxd, tcpxctl, libnccl_net_tcpxemu.so). Environment:
# ROUNDS (1), ITERS (30), ITERS8 (30, groups/transfers of 8), SIZES (64K,256K,1M,16M), TIMEOUT
# (90 s a harness), MPS (1). Prints GB/s per harness and variant (medians over the rounds), A ÷ B
# per harness (with each round's in brackets), and daemon ÷ raw, ÷ nccl-plugin, ÷ nccl-socket
# for each variant.
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n 2,16p "$0"
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
a=$(cd "$1" && pwd) b=$(cd "$2" && pwd) out=${3:-/tmp/emufid-device}
rounds=${ROUNDS:-1} iters=${ITERS:-30} iters8=${ITERS8:-30} sizes=${SIZES:-64K,256K,1M,16M} timeout=${TIMEOUT:-90}
for d in "$a" "$b"; do
    for f in tcpxd tcpxctl libnccl_net_tcpxemu.so; do
        [ -e "$d/$f" ] || { echo "$d/$f: missing" >&2; exit 2; }
    done
done
rm -rf "$out" && mkdir -p "$out"
unset TCPXEMU_PROGRESS
mps=()
[ "${MPS:-1}" = 1 ] && mps=(--mps)
echo "$(nproc) CPUs, $(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true) GPU(s); sizes $sizes; iters $iters / $iters8 (8 in flight); $rounds round(s)" | tee "$out/setup.txt"
declare -A dir=([A]=$a [B]=$b)
start=$SECONDS
for ((r = 1; r <= rounds; r++)); do
    steps=("B 1" "A 1" "A 8" "B 8")
    ((r % 2)) || steps=("A 1" "B 1" "B 8" "A 8")
    for step in "${steps[@]}"; do
        read -r v c <<<"$step"
        it=$iters
        [ "$c" = 8 ] && it=$iters8
        python3 "$here/compare.py" --bin "${dir[$v]}" --same-gpu "${mps[@]}" --sizes "$sizes" --iters "$it" \
            --warmup 5 --concurrency "$c" --only nccl-socket,nccl-plugin,raw,daemon --timeout "$timeout" \
            --logs "$out/logs-$v-c$c-r$r" --out "$out/$v-c$c-r$r.jsonl" >"$out/$v-c$c-r$r.txt" 2>&1 ||
            echo "$v c$c round $r: compare.py failed (see $out/$v-c$c-r$r.txt)" >&2
        echo "round $r: $v, $c in flight done, $((SECONDS - start)) s" >&2
    done
done

python3 - "$out" <<'PY' | tee "$out/summary.txt"
import glob, json, os, re, statistics, sys
from collections import defaultdict
out = sys.argv[1]
H = ["raw", "daemon", "nccl-plugin", "nccl-socket"]
gb = defaultdict(dict)  # (variant, c, harness, size) -> {round: GB/s}
ok = True
for f in glob.glob(os.path.join(out, "*-c*-r*.jsonl")):
    v, c, r = re.match(r"(\w)-c(\d+)-r(\d+)\.jsonl$", os.path.basename(f)).groups()
    for line in open(f):
        d = json.loads(line)
        if d.get("harness") in H and "block_size" in d and "round" not in d:
            ok &= bool(d.get("verified", d.get("bytes_ok", True)))
            gb[(v, int(c), d["harness"], int(d["block_size"]))][int(r)] = d["gb_per_s"]
med = statistics.median
def m(v, c, h, s):
    x = gb.get((v, c, h, s))
    return med(x.values()) if x else None
def size(n):
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"
def f2(x, w):
    return f"{x:>{w}.2f}" if x is not None else f"{'-':>{w}}"
for c in (1, 8):
    sizes = sorted({k[3] for k in gb if k[1] == c})
    if not sizes:
        continue
    print(f"\n{'one at a time' if c == 1 else '8 in flight'}: GB/s (median of rounds), B = main's emulation, "
          f"A = faithful; A÷B, each round's in brackets")
    for h in H:
        print(f"  {h}")
        for s in sizes:
            a, b = m("A", c, h, s), m("B", c, h, s)
            ra, rb = gb.get(("A", c, h, s), {}), gb.get(("B", c, h, s), {})
            per = " ".join(f"{ra[r] / rb[r]:.2f}" for r in sorted(ra) if r in rb and rb[r])
            print(f"    {size(s):>4}  B {f2(b, 6)}  A {f2(a, 6)}  A÷B {f2(a / b if a and b else None, 5)}  [{per}]")
    print(f"  daemon ÷ other (medians):  {'size':>4} " + " ".join(f"{o + ' B':>14} {o + ' A':>14}" for o in ("raw", "nccl-plugin", "nccl-socket")))
    for s in sizes:
        cells = []
        for o in ("raw", "nccl-plugin", "nccl-socket"):
            for v in "BA":
                d, x = m(v, c, "daemon", s), m(v, c, o, s)
                cells.append(f2(d / x if d and x else None, 14))
        print(f"  {'':<26}{size(s):>4} " + " ".join(cells))
print("\nevery row verified" if ok else "\nSOME ROWS NOT VERIFIED")
PY
