#!/usr/bin/env bash
# Issue #38 at 1 MiB one at a time (session 26, onemib): daemon ÷ raw on the GPU lanes, READ and
# WRITE, GPU 0 -> 0 and 0 -> 1 where a second GPU exists, three variants alternating
# (A B C C B A ...):
#   A  BEFORE's binaries (their default: spread on at 131072 since session 26);
#   B  AFTER's binaries with spread off (TCPXD_SPREAD_MIN_CHUNK_BYTES=0; on by default since session 26);
#   C  AFTER's binaries with TCPXD_SPREAD_MIN_CHUNK_BYTES=$SPREAD (default 131072): a transfer of
#      fewer than two chunks per lane goes in smaller chunks (1 MiB over two lanes: four of 256
#      KiB instead of two of 512 KiB, on four of the plugin's data sockets instead of two). The
#      raw bench reads the same variable, so C's raw rows plan their chunks the same way.
# Each run has its own raw rows (`tcpxctl bench raw` on GPU 0, its own binaries). Prints p50 µs
# per row (median over the rounds) and the ratios: after ÷ before, daemon ÷ raw (raw p50 ÷
# daemon p50: > 1 means the daemon is faster) for A, B and C, C against both raws (the raw path as
# it stands, 512 KiB chunks, and raw spread the same way), C ÷ B, and A ÷ C (before ÷ after, both
# spread: session 27's credits riding with the `Done`). About 4 minutes on the H200 host.
#
#   benches/onemib_device.sh BEFORE_DIR AFTER_DIR [OUT_DIR]
#
# Each dir holds a release build's staged binaries: tcpxd, tcpxctl, libnccl_net_tcpxemu.so.
# Environment: ROUNDS (2), ITERS (300), WARMUP (30), SIZES (64K,256K,1M,16M), SPREAD (131072),
# GPUS (default what nvidia-smi lists, at most 2), MPS=1 (the one-GPU rows under a private MPS
# control daemon, as compare.py --mps). Rows go to OUT_DIR (default /tmp/onemib-device).
#
# Then (TRACE=0 skips it, ~2 minutes) lane by lane (benches/lanes.py): AFTER's raw path spread
# off and on, and the daemons, 1 MiB WRITE and READ on the last path, BEFORE spread on, AFTER
# spread on and off, traced (RUST_LOG=tcpxd::hop=trace): when each chunk was posted, sent and
# received, how far apart the lanes' receives completed, the receiver's steps from the last
# receive to the end ("last received → end"), and the `Credits` messages sent before a
# transfer's end (session 27: 0 after, with spread on) — to set the daemon's lanes beside raw's.
# A last table sets "last received → end" and those counts side by side.
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n 2,30p "$0"
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
before=$(cd "$1" && pwd) after=$(cd "$2" && pwd) out=${3:-/tmp/onemib-device}
rounds=${ROUNDS:-2} iters=${ITERS:-300} warmup=${WARMUP:-30} sizes=${SIZES:-64K,256K,1M,16M}
spread=${SPREAD:-131072}
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
# 64 KiB would otherwise go inline on the control connection and skip the lanes compared here.
export TCPXD_INLINE_GPU=off NCCL_NVLS_ENABLE=0
unset TCPXD_SPREAD_MIN_CHUNK_BYTES
if [ "${MPS:-0}" = 1 ]; then
    mps_root=$(mktemp -d /tmp/onemib-mps.XXXXXX)
    export CUDA_MPS_PIPE_DIRECTORY=$mps_root/pipe CUDA_MPS_LOG_DIRECTORY=$mps_root/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d
    trap 'echo quit | nvidia-cuda-mps-control || true' EXIT
fi
order=()
for ((r = 0; r < rounds; r++)); do
    if ((r % 2 == 0)); then order+=(A B C); else order+=(C B A); fi
done
common=(--sizes "$sizes" --iters "$iters" --warmup "$warmup" --json)
start=$SECONDS
n=0
for who in "${order[@]}"; do
    n=$((n + 1))
    dir=$after
    [ "$who" = A ] && dir=$before
    env=()
    [ "$who" = B ] && env=(TCPXD_SPREAD_MIN_CHUNK_BYTES=0)
    [ "$who" = C ] && env=(TCPXD_SPREAD_MIN_CHUNK_BYTES="$spread")
    # Raw: one process on GPU 0 (it refuses --peer-cuda); READ and WRITE are the same path.
    env "${env[@]}" "$dir/tcpxctl" bench raw --cuda 0 --plugin "$dir/libnccl_net_tcpxemu.so" "${common[@]}" \
        --out "$out/run$n-$who-raw.jsonl" >/dev/null
    for peer in "${peers[@]}"; do
        for op in write read; do
            env "${env[@]}" "$dir/tcpxctl" bench transfer --daemon "$dir/tcpxd" --op "$op" --cuda 0 \
                --peer-cuda "$peer" "${common[@]}" --out "$out/run$n-$who-daemon-$op-0to$peer.jsonl" >/dev/null
        done
    done
    echo "run $n ($who) done, $((SECONDS - start)) s" >&2
done
python3 - "$out" <<'EOF' | tee "$out/summary.txt"
import glob, json, os, re, statistics, sys
from collections import defaultdict
out = sys.argv[1]
raw = defaultdict(dict)       # (who, size) -> {run: p50}
daemon = defaultdict(dict)    # (who, op, path, size) -> {run: p50}
ok = True
for f in sorted(glob.glob(os.path.join(out, "run*.jsonl"))):
    m = re.match(r"run(\d+)-(\w)-(raw|daemon-(\w+)-(0to\d))\.jsonl", os.path.basename(f))
    run, who, kind, op, path = int(m.group(1)), m.group(2), m.group(3), m.group(4), m.group(5)
    for line in open(f):
        r = json.loads(line)
        ok &= bool(r.get("verified", True))
        if kind == "raw":
            raw[(who, r["block_size"])][run] = r["p50_lat_us"]
        else:
            daemon[(who, op, path, r["block_size"])][run] = r["p50_lat_us"]
def size(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"
med = statistics.median
print("p50 µs, medians over the runs. A before, B after, C after with spread; raw: the raw path's rows")
print("(raw: A's and B's raw runs, 512 KiB chunks; rawC: C's, spread the same way). Every ratio X/Y is")
print("X's p50 ÷ Y's p50, so > 1 means Y is faster: raw/B is daemon ÷ raw as compare.py's GB/s ratio.")
print(f"{'path':<6} {'op':<5} {'size':>7} {'raw':>7} {'rawC':>7} {'A':>7} {'B':>7} {'C':>7} "
      f"{'A/B':>6} {'raw/A':>6} {'raw/B':>6} {'raw/C':>6} {'rawC/C':>7} {'B/C':>6} {'A/C':>6}")
for (path, op, sz) in sorted({(k[2], k[1], k[3]) for k in daemon}):
    a, b, c = (daemon.get((w, op, path, sz), {}) for w in "ABC")
    r_old = list(raw.get(("A", sz), {}).values()) + list(raw.get(("B", sz), {}).values())
    r_c = list(raw.get(("C", sz), {}).values())
    if not (a and b and c and r_old and r_c):
        continue
    ma, mb, mc, ro, rc = med(a.values()), med(b.values()), med(c.values()), med(r_old), med(r_c)
    print(f"{path:<6} {op:<5} {size(sz):>7} {ro:>7.0f} {rc:>7.0f} {ma:>7.0f} {mb:>7.0f} {mc:>7.0f} "
          f"{ma / mb:>6.2f} {ro / ma:>6.2f} {ro / mb:>6.2f} {ro / mc:>6.2f} {rc / mc:>7.2f} {mb / mc:>6.2f} "
          f"{ma / mc:>6.2f}")
print("every row verified" if ok else "SOME ROWS NOT VERIFIED")
EOF

if [ "${TRACE:-1}" = 1 ]; then
    peer=${peers[-1]}
    {
        for variant in off on; do
            env=(TCPXD_SPREAD_MIN_CHUNK_BYTES=0)
            [ "$variant" = on ] && env=(TCPXD_SPREAD_MIN_CHUNK_BYTES="$spread")
            t="$out/trace-raw-spread-$variant"
            mkdir -p "$t"
            env "${env[@]}" RUST_LOG=tcpxd::hop=trace "$after/tcpxctl" bench raw --cuda 0 \
                --plugin "$after/libnccl_net_tcpxemu.so" --sizes 1M --iters 200 --warmup 20 \
                >"$t/bench.txt" 2>"$t/raw.log" || true
            echo "== raw path, 1 MiB, GPU 0, spread $variant (AFTER)"
            python3 "$here/lanes.py" "$t/raw.log" || true
        done
        # BEFORE and AFTER with spread on alternate, then AFTER with spread off.
        for who_variant in before-on after-on after-off; do
            who=${who_variant%-*} variant=${who_variant#*-}
            dir=$after
            [ "$who" = before ] && dir=$before
            env=(TCPXD_SPREAD_MIN_CHUNK_BYTES=0)
            [ "$variant" = on ] && env=(TCPXD_SPREAD_MIN_CHUNK_BYTES="$spread")
            for op in write read; do
                t="$out/trace-daemon-$who-$op-0to$peer-spread-$variant"
                mkdir -p "$t"
                env "${env[@]}" RUST_LOG=tcpxd::hop=trace "$dir/tcpxctl" bench transfer --daemon "$dir/tcpxd" \
                    --op "$op" --cuda 0 --peer-cuda "$peer" --sizes 1M --iters 200 --warmup 20 --keep-dir \
                    >"$t/bench.txt" 2>&1 || true
                kept=$(grep -o '/tmp/tcpxd-bench-[0-9]*' "$t/bench.txt" | head -1)
                [ -n "$kept" ] && mv "$kept"/*.log "$t/" && rm -rf "$kept"
                echo "== daemons, 1 MiB $op, GPU 0 -> $peer, spread $variant (${who^^})"
                python3 "$here/lanes.py" "$t/bench-a.log" "$t/bench-b.log" | tee "$t/lanes.txt" || true
            done
        done
        # Side by side: the receiver's end and the Credits messages sent mid-transfer.
        echo "== 1 MiB, GPU 0 -> $peer: last received → end (p50 / p90 µs), Credits messages before the end"
        for t in "$out"/trace-daemon-*; do
            [ -e "$t/lanes.txt" ] || continue
            end=$(grep -m1 '^last received → end' "$t/lanes.txt" | awk '{print $(NF-1) " / " $NF}')
            mid=$(grep -m1 '^Credits messages before the end' "$t/lanes.txt" | sed 's/ (a receiver.*//; s/^Credits messages before the end: //')
            printf '  %-44s %16s   %s\n' "${t##*/trace-daemon-}" "${end:-?}" "${mid:-?}"
        done
    } 2>&1 | tee "$out/trace.txt"
fi
