#!/usr/bin/env bash
# Session 33, emufid: the baselines again on the faithful emulation. Since session 33 the
# emulation's `test` moves one more request per call, as Google's plugin's (a send: at most one
# chunk per data socket per call; TCPXEMU_PROGRESS=eager is the old emulation), and the raw bench
# tests after each post. A = this branch, B = main; compare.py on one GPU (--same-gpu --mps), rows
# raw / daemon / nccl-plugin / nccl-socket at 64K,256K,1M,16M, WRITE, one at a time and 8 in
# flight, B A then A B. nccl-socket does not use the emulation: its A/B is the noise. About 5
# minutes on the H200 host.
#
#   benches/emufid_device.sh A_DIR B_DIR [OUT_DIR]
#
# A_DIR / B_DIR: staged release binaries (tcpxd, tcpxctl, libnccl_net_tcpxemu.so). Environment:
# ITERS (30), ITERS8 (30, groups/transfers of 8), SIZES (64K,256K,1M,16M), TIMEOUT (90 s a
# harness), MPS (1). Prints GB/s per harness and variant, A ÷ B per harness, and daemon ÷ raw,
# ÷ nccl-plugin, ÷ nccl-socket for each variant.
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n 2,16p "$0"
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
a=$(cd "$1" && pwd) b=$(cd "$2" && pwd) out=${3:-/tmp/emufid-device}
iters=${ITERS:-30} iters8=${ITERS8:-30} sizes=${SIZES:-64K,256K,1M,16M} timeout=${TIMEOUT:-90}
for d in "$a" "$b"; do
    for f in tcpxd tcpxctl libnccl_net_tcpxemu.so; do
        [ -e "$d/$f" ] || { echo "$d/$f: missing" >&2; exit 2; }
    done
done
rm -rf "$out" && mkdir -p "$out"
unset TCPXEMU_PROGRESS
mps=()
[ "${MPS:-1}" = 1 ] && mps=(--mps)
echo "$(nproc) CPUs, $(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true) GPU(s); sizes $sizes; iters $iters / $iters8 (8 in flight)" | tee "$out/setup.txt"
declare -A dir=([A]=$a [B]=$b)
start=$SECONDS
for step in "B 1" "A 1" "A 8" "B 8"; do
    read -r v c <<<"$step"
    it=$iters
    [ "$c" = 8 ] && it=$iters8
    python3 "$here/compare.py" --bin "${dir[$v]}" --same-gpu "${mps[@]}" --sizes "$sizes" --iters "$it" \
        --warmup 5 --concurrency "$c" --only nccl-socket,nccl-plugin,raw,daemon --timeout "$timeout" \
        --logs "$out/logs-$v-c$c" --out "$out/$v-c$c.jsonl" >"$out/$v-c$c.txt" 2>&1 ||
        echo "$v c$c: compare.py failed (see $out/$v-c$c.txt)" >&2
    echo "$v, $c in flight done, $((SECONDS - start)) s" >&2
done

python3 - "$out" <<'PY' | tee "$out/summary.txt"
import json, os, sys
out = sys.argv[1]
H = ["raw", "daemon", "nccl-plugin", "nccl-socket"]
def load(v, c):
    rows = {}
    p = os.path.join(out, f"{v}-c{c}.jsonl")
    if os.path.exists(p):
        for line in open(p):
            r = json.loads(line)
            if r.get("harness") in H and "block_size" in r and "round" not in r:
                rows[(r["harness"], int(r["block_size"]))] = r["gb_per_s"]
    return rows
def size(n):
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"
for c in (1, 8):
    A, B = load("A", c), load("B", c)
    sizes = sorted({s for (_, s) in list(A) + list(B)})
    print(f"\n{'one at a time' if c == 1 else '8 in flight'}: GB/s, B (main's emulation) / A (faithful); A÷B")
    print(f"{'size':>5} " + " ".join(f"{h + ' B':>14} {h + ' A':>14} {'A÷B':>5}" for h in H))
    for s in sizes:
        cells = []
        for h in H:
            b, a = B.get((h, s)), A.get((h, s))
            cells.append(f"{b if b is not None else float('nan'):>14.2f} {a if a is not None else float('nan'):>14.2f} "
                         + (f"{a / b:>5.2f}" if a and b else f"{'-':>5}"))
        print(f"{size(s):>5} " + " ".join(cells))
    print(f"{'size':>5} " + " ".join(f"{'daemon÷' + o + ' ' + v:>20}" for o in ("raw", "nccl-plugin", "nccl-socket") for v in "BA"))
    for s in sizes:
        cells = []
        for o in ("raw", "nccl-plugin", "nccl-socket"):
            for v, rows in (("B", B), ("A", A)):
                d, x = rows.get(("daemon", s)), rows.get((o, s))
                cells.append(f"{d / x:>20.2f}" if d and x else f"{'-':>20}")
        print(f"{size(s):>5} " + " ".join(cells))
PY
