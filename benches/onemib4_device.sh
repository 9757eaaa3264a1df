#!/usr/bin/env bash
# Issue #38 at 1 MiB one at a time (session 33, onemib4): where the daemon's time over raw's goes,
# leg by leg, raw and the daemon traced alike in one call. About 3–4 minutes on the H200 host.
#
#   benches/onemib4_device.sh A_DIR [B_DIR] OUT_DIR
#
# A_DIR: this branch's staged release binaries (tcpxd, tcpxctl, libnccl_net_tcpxemu.so; its
# tcpxctl records the client's own `bench.send` / `bench.answer`), B_DIR (optional): main's, run
# untraced beside A for the ratio. GPU 0 -> 1 (0 -> 0 on a one-GPU host).
# ROUNDS (3) rounds alternate the order of, 1 MiB, ITERS (200) transfers after WARMUP (20):
#   - traced (RUST_LOG=tcpxd::hop=trace): raw WRITE and READ (`tcpxctl bench raw`), the daemons'
#     framed local session WRITE and READ (`tcpxctl bench transfer --via local`);
#   - untraced: the same four (and, with GRPC=1, the daemons' gRPC WRITE and READ), and B's raw and
#     daemons if given.
#   - A4 (SPREAD4=0 skips it): this branch with TCPXD_SPREAD_CHUNKS_PER_LANE=4, raw and the local
#     session, traced and untraced (1 MiB as eight 128 KiB sends, raw planned alike);
#   - AL (LEAN=0 skips it): this branch's local session with TCPXD_WARM_WORKER=off and
#     TCPXD_SESSION_THREAD=off (two spinning threads fewer beside the emulation's socket threads).
# Prints, per round and pooled, `benches/legs.py`: every leg's p50 for raw and the daemon and the
# difference (start → first isend, the data phase, the unpack, the end), then the daemon's legs
# mark by mark; last, the untraced p50s and daemon ÷ raw (raw's p50 ÷ the daemon's).
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n 2,22p "$0"
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
a=$(cd "$1" && pwd)
if [ $# -ge 3 ]; then b=$(cd "$2" && pwd) out=$3; else b="" out=$2; fi
rounds=${ROUNDS:-3} iters=${ITERS:-200} warmup=${WARMUP:-20} size=${SIZE:-1M}
for d in "$a" $b; do
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
unset RUST_LOG TCPXD_SPREAD_CHUNKS_PER_LANE TCPXD_SPREAD_MIN_CHUNK_BYTES TCPXD_HOP_RECORD
echo "GPU 0 -> $peer, $(nproc) CPUs, $rounds rounds of $iters transfers of $size" | tee "$out/setup.txt"

# A4: this branch with four chunks a lane (1 MiB as eight sends of 128 KiB, raw planned alike).
# AL: this branch with fewer threads spinning beside the emulation's socket threads (no warm
# async worker, the framed sessions served on the poller's thread).
venv() {
    case $1 in
    A4) echo TCPXD_SPREAD_CHUNKS_PER_LANE=4 ;;
    AL) echo TCPXD_WARM_WORKER=off TCPXD_SESSION_THREAD=off ;;
    esac
}
raw() { # round dir name traced op
    local r=$1 d=$2 n=$3 tr=$4 op=$5 f="$out/r$1-$3-raw-$5"
    if [ "$tr" = 1 ]; then
        env $(venv "$n") RUST_LOG=tcpxd::hop=trace "$d/tcpxctl" bench raw --op "$op" --cuda 0 --plugin "$d/libnccl_net_tcpxemu.so" \
            --sizes "$size" --iters "$iters" --warmup "$warmup" --json --out "$f-traced.jsonl" \
            >/dev/null 2>"$f.log" || echo "r$r $n raw $op traced failed (see $f.log)" >&2
    else
        env $(venv "$n") "$d/tcpxctl" bench raw --op "$op" --cuda 0 --plugin "$d/libnccl_net_tcpxemu.so" --sizes "$size" \
            --iters "$iters" --warmup "$warmup" --json --out "$f.jsonl" >/dev/null 2>"$f.err" ||
            echo "r$r $n raw $op failed (see $f.err)" >&2
    fi
}
daemon() { # round dir name traced via op
    local r=$1 d=$2 n=$3 tr=$4 via=$5 op=$6 f="$out/r$1-$3-$5-$6"
    if [ "$tr" = 1 ]; then
        env $(venv "$n") RUST_LOG=tcpxd::hop=trace "$d/tcpxctl" bench transfer --daemon "$d/tcpxd" --via "$via" --op "$op" \
            --cuda 0 --peer-cuda "$peer" --sizes "$size" --iters "$iters" --warmup "$warmup" --keep-dir \
            --json --out "$f-traced.jsonl" >/dev/null 2>"$f.log" || echo "r$r $n $via $op traced failed (see $f.log)" >&2
        kept=$(grep -o '/tmp/tcpxd-bench-[0-9]*' "$f.log" | head -1 || true)
        if [ -n "$kept" ]; then
            mv "$kept/bench-a.log" "$f.a.log" && mv "$kept/bench-b.log" "$f.b.log" && rm -rf "$kept"
        fi
    else
        env $(venv "$n") "$d/tcpxctl" bench transfer --daemon "$d/tcpxd" --via "$via" --op "$op" --cuda 0 --peer-cuda "$peer" \
            --sizes "$size" --iters "$iters" --warmup "$warmup" --json --out "$f.jsonl" >/dev/null 2>"$f.err" ||
            echo "r$r $n $via $op failed (see $f.err)" >&2
    fi
}
start=$SECONDS
for ((r = 1; r <= rounds; r++)); do
    steps=("raw $a A 1 write" "daemon $a A 1 local write" "raw $a A 1 read" "daemon $a A 1 local read"
        "raw $a A 0 write" "raw $a A 0 read" "daemon $a A 0 local write" "daemon $a A 0 local read")
    [ "${GRPC:-0}" = 1 ] && steps+=("daemon $a A 0 grpc write" "daemon $a A 0 grpc read")
    if [ "${SPREAD4:-1}" = 1 ]; then
        steps+=("raw $a A4 1 write" "daemon $a A4 1 local write" "raw $a A4 1 read" "daemon $a A4 1 local read"
            "raw $a A4 0 write" "daemon $a A4 0 local write" "raw $a A4 0 read" "daemon $a A4 0 local read")
    fi
    if [ "${LEAN:-1}" = 1 ]; then
        steps+=("daemon $a AL 1 local write" "daemon $a AL 1 local read" "daemon $a AL 0 local write"
            "daemon $a AL 0 local read")
    fi
    if [ -n "$b" ]; then
        steps+=("raw $b B 0 write" "raw $b B 0 read" "daemon $b B 0 local write" "daemon $b B 0 local read")
        [ "${GRPC:-0}" = 1 ] && steps+=("daemon $b B 0 grpc write" "daemon $b B 0 grpc read")
    fi
    n=${#steps[@]}
    for ((i = 0; i < n; i++)); do
        if ((r % 2)); then s=${steps[i]}; else s=${steps[n - 1 - i]}; fi
        read -r fn d who tr rest <<<"$s"
        # shellcheck disable=SC2086
        $fn "$r" "$d" "$who" "$tr" $rest
    done
    echo "round $r done, $((SECONDS - start)) s" >&2
done

{
    for v in A A4 AL; do
        [ -e "$out/r1-$v-local-write.log" ] || continue
        rv=$v
        [ "$v" = AL ] && rv=A
        for op in write read; do
            for ((r = 1; r <= rounds; r++)); do
                p="$out/r$r-$v"
                echo "== round $r, $v, 1 MiB $op one at a time, GPU 0 -> $peer, traced: raw against the daemons' local session"
                python3 "$here/legs.py" --skip "$warmup" --raw "$out/r$r-$rv-raw-$op.log" --daemon "local-$op" \
                    "$p-local-$op.log" "$p-local-$op.a.log" "$p-local-$op.b.log" || true
            done
            echo "== $v, all rounds pooled, $op"
            pool=()
            for ((r = 1; r <= rounds; r++)); do
                p="$out/r$r-$v"
                pool+=(--raw "$out/r$r-$rv-raw-$op.log" --daemon "local-$op" "$p-local-$op.log" "$p-local-$op.a.log"
                    "$p-local-$op.b.log")
            done
            python3 "$here/legs.py" --skip "$warmup" "${pool[@]}" || true
        done
    done
} 2>&1 | tee "$out/legs.txt"

python3 - "$out" <<'EOF' | tee "$out/summary.txt"
import glob, json, os, re, statistics, sys
from collections import defaultdict
out = sys.argv[1]
p50 = defaultdict(dict)
ok = True
for f in sorted(glob.glob(os.path.join(out, "r*.jsonl"))):
    m = re.match(r"r(\d+)-(\w+)-(\w+)-(\w+?)(-traced)?\.jsonl$", os.path.basename(f))
    if not m:
        continue
    rnd, who, via, op, traced = int(m.group(1)), m.group(2), m.group(3), m.group(4), bool(m.group(5))
    for line in open(f):
        r = json.loads(line)
        if "p50_lat_us" not in r:
            continue
        ok &= bool(r.get("verified", True))
        p50[(who, via, op, traced)][rnd] = r["p50_lat_us"]
med = statistics.median
print("p50 µs per round (median); daemon ÷ raw = raw's p50 ÷ the daemon's, same build, same round")
for traced in (False, True):
    for who in ("A", "A4", "AL", "B"):
        for op in ("write", "read"):
            raw = p50.get(("A" if who == "AL" else who, "raw", op, traced))
            if not raw:
                continue
            for via in ("local", "grpc"):
                d = p50.get((who, via, op, traced))
                if not d:
                    continue
                per = " ".join(f"{raw[r] / d[r]:.2f}" for r in sorted(d) if r in raw)
                print(f"{'traced' if traced else 'untraced':9}{who} {op:6}{via:6} raw {med(raw.values()):7.0f}"
                      f"  daemon {med(d.values()):7.0f}  (+{med(d.values()) - med(raw.values()):.0f})"
                      f"  daemon ÷ raw {med(raw.values()) / med(d.values()):.2f}  per round {per}")
for via in ("local", "grpc"):
    for op in ("write", "read"):
        a, b = p50.get(("A", via, op, False)), p50.get(("B", via, op, False))
        if a and b:
            print(f"A against B, {via} {op}: B/A {med(b.values()) / med(a.values()):.2f} (> 1: A faster)")
print("every row verified" if ok else "SOME ROWS NOT VERIFIED")
EOF
gzip -f "$out"/*.log 2>/dev/null || true
echo "all done in $((SECONDS - start)) s" >&2
