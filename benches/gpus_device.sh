#!/usr/bin/env bash
# Every GPU of a host at once through one daemon pair: does the daemon's work scale with the GPUs?
#
#   benches/gpus_device.sh BIN_DIR OUT_DIR
#
# Two daemons on the emulation in CUDA mode, one emulated NIC per two GPUs (as A3: RxDM lets a NIC
# receive for two GPUs), bound by a topology map. For each `runtime.lane_thread` setting (off, on)
# and each row (64 KiB WRITE and READ at 16 in flight; 16 MiB WRITE at 2), it runs GPU 0 → GPU 0
# alone, then every GPU g → GPU g at once (one `tcpxctl bench transfer` per GPU against the same two
# daemons, framed local sessions), and prints each run's GB/s, the sum, and all ÷ one.
# Environment: ITERS (64 KiB transfers a run, default 20000), BIG_ITERS (16 MiB, default 200),
# SETTINGS (default "off on"). BIN_DIR holds tcpxd, tcpxctl and libnccl_net_tcpxemu.so. Reports only.
set -u
BIN=$(cd "$1" && pwd); OUT=${2:-$(mktemp -d)}; mkdir -p "$OUT"
ITERS=${ITERS:-20000}; BIG_ITERS=${BIG_ITERS:-200}; SETTINGS=${SETTINGS:-off on}
NGPU=${NGPU:-$(nvidia-smi -L 2>/dev/null | wc -l)}
[ "$NGPU" -ge 1 ] || { echo "no GPU: nothing to measure"; exit 0; }
NICS=$(( NGPU / 2 )); [ "$NICS" -lt 1 ] && NICS=1
MAP=""; for g in $(seq 0 $((NGPU-1))); do MAP="$MAP$g=$(( g * NICS / NGPU ));"; done; MAP=${MAP%;}
echo "GPUs $NGPU, emulated NICs per daemon $NICS, map $MAP, $(nproc) CPUs"
export TCPXEMU_DEVICES=$NICS TCPXEMU_BOUNCE=cuda TCPXEMU_BOUNCE_PAGES=${TCPXEMU_BOUNCE_PAGES:-8192} RUST_LOG=${RUST_LOG:-warn}
D=$(mktemp -d /tmp/gpus.XXXX)
start() { # name port lane_thread
  TCPXD_LANE_THREAD=$3 "$BIN/tcpxd" --node-id "$1" --api-socket "$D/$1.sock" --peer-listen "127.0.0.1:$2" \
    --plugin "$BIN/libnccl_net_tcpxemu.so" --topology "$MAP" >"$OUT/$1-$3.log" 2>&1 &
  echo $! >"$D/$1.pid"
}
stop() { kill "$(cat "$D/a.pid")" "$(cat "$D/b.pid")" 2>/dev/null; wait 2>/dev/null; }
trap stop EXIT
bench() { # gpu op size conc iters -> GB/s
  "$BIN/tcpxctl" bench transfer --endpoint "unix:$D/a.sock" --peer-endpoint "unix:$D/b.sock" \
    --peer-address "127.0.0.1:$PB" --via local --cuda "$1" --peer-cuda "$1" --op "$2" --sizes "$3" \
    --concurrency "$4" --iters "$5" --warmup 100 --json 2>"$D/err.$1" \
    | python3 -c 'import json,sys
rows=[json.loads(l) for l in sys.stdin if l.strip().startswith("{")]
rows=[x for x in rows if str(x.get("harness","")).startswith("daemon") and x.get("verified", True)]
print("%.2f" % rows[-1]["gb_per_s"] if rows else "nan")' 2>/dev/null || echo nan
}
for lt in $SETTINGS; do
  PA=$(( 30000 + RANDOM % 20000 )); PB=$((PA+1))
  start a $PA "$lt"; start b $PB "$lt"
  "$BIN/tcpxctl" --endpoint "unix:$D/a.sock" health --wait 30 >/dev/null && "$BIN/tcpxctl" --endpoint "unix:$D/b.sock" health --wait 30 >/dev/null \
    || { echo "daemons did not start"; for f in "$OUT"/*.log; do echo "== $f"; tail -n 20 "$f"; done; exit 1; }
  for row in "write 64K 16 $ITERS" "read 64K 16 $ITERS" "write 16M 2 $BIG_ITERS"; do
    set -- $row
    one=$(bench 0 "$1" "$2" "$3" "$4")
    pids=""; for g in $(seq 0 $((NGPU-1))); do bench "$g" "$1" "$2" "$3" "$4" > "$D/all.$g" & pids="$pids $!"; done
    wait $pids
    each=""; sum=0
    for g in $(seq 0 $((NGPU-1))); do v=$(cat "$D/all.$g"); each="$each $v"; sum=$(python3 -c "print(round($sum + (0 if '$v'=='nan' else $v), 2))"); done
    ratio=$(python3 -c "print('%.2f' % ($sum / $one) if '$one' not in ('nan','0.00') else 'nan')")
    echo "lane_thread=$lt $1 $2 c$3: one GPU $one GB/s; all $NGPU at once [$each ] sum $sum GB/s; all ÷ one $ratio"
    for g in $(seq 0 $((NGPU-1))); do [ -s "$D/err.$g" ] && grep -iE "error|fail" "$D/err.$g" | head -2; done
  done
  grep -h -E "panicked|ERROR|rx no cmsg" "$OUT"/a-"$lt".log "$OUT"/b-"$lt".log | sort | uniq -c | head -5
  stop
done
