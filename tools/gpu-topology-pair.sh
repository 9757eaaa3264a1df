#!/usr/bin/env bash
# Two daemons on one host with two or more GPUs, each on the emulation in CUDA mode with one emulated
# NIC per two GPUs (at least two NICs), bound by the topology map: WRITE and READ between every pair
# of (GPU 0..N-1, host) memories of the two daemons, CRC-32C of both ends compared, then each
# daemon's per-lane bytes (`tcpxctl stats --json`) so each GPU pair's bytes can be seen on its
# NICs only, and the unpacker the log names per GPU.
#
#   tools/gpu-topology-pair.sh BIN_DIR [SIZE] [OUT_DIR]
#
# BIN_DIR holds tcpxd, tcpxctl and libnccl_net_tcpxemu.so (a release or debug build). Reports only.
set -u
BIN=$(cd "$1" && pwd); SIZE=${2:-64M}; OUT=${3:-$(mktemp -d)}
mkdir -p "$OUT"
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
NICS=$(( NGPU / 2 )); [ "$NICS" -lt 2 ] && NICS=2
MAP=""; for g in $(seq 0 $((NGPU-1))); do MAP="$MAP$g=$(( g * NICS / NGPU ));"; done; MAP=${MAP%;}
BOUNCE=cuda; TOPO=(--topology "$MAP"); [ "$NGPU" = 0 ] && { BOUNCE=host; TOPO=(); }   # no GPU: host memory only (a dry run of the script)
echo "GPUs $NGPU, emulated NICs per daemon $NICS, map $MAP, size $SIZE"
D=$(mktemp -d /tmp/topo.XXXX)
export TCPXEMU_DEVICES=$NICS TCPXEMU_BOUNCE=$BOUNCE TCPXEMU_BOUNCE_PAGES=8192 RUST_LOG=${RUST_LOG:-info}
start() { # name port
  "$BIN/tcpxd" --node-id "$1" --api-socket "$D/$1.sock" --peer-listen "127.0.0.1:$2" \
    --plugin "$BIN/libnccl_net_tcpxemu.so" "${TOPO[@]}" >"$OUT/$1.log" 2>&1 &
  echo $! >"$D/$1.pid"
}
P=$(( 30000 + RANDOM % 20000 )); start a $P; start b $((P+1))
trap 'kill $(cat $D/a.pid) $(cat $D/b.pid) 2>/dev/null; wait 2>/dev/null' EXIT
A="$BIN/tcpxctl --endpoint unix:$D/a.sock"; B="$BIN/tcpxctl --endpoint unix:$D/b.sock"
$A health --wait 30 >/dev/null && $B health --wait 30 >/dev/null || { echo "daemons did not start"; tail -20 "$OUT"/*.log; exit 1; }
$A describe > "$OUT/describe_a.txt" 2>&1; cat "$OUT/describe_a.txt" | sed -n 1,40p
reg() { # ctl kind -> "id descriptor"
  local ctl=$1 kind=$2 j
  if [ "$kind" = host ]; then j=$($ctl --json buffer register --host "$SIZE"); else j=$($ctl --json buffer register --cuda "$kind" "$SIZE"); fi
  python3 -c 'import json,sys; b=json.loads(sys.argv[1]); b=b.get("buffer",b); print(b["id"], b["descriptor"])' "$j"
}
MEMS="host"; [ "$NGPU" -gt 0 ] && MEMS="host $(seq -s' ' 0 $((NGPU-1)))"
declare -A AID ADESC BID BDESC
for m in $MEMS; do
  read -r AID[$m] ADESC[$m] < <(reg "$A" $m); read -r BID[$m] BDESC[$m] < <(reg "$B" $m)
done
pass=0; fail=0; seed=1
for src in $MEMS; do for dst in $MEMS; do
  for op in write read; do
    seed=$((seed+1))
    if [ $op = write ]; then
      $A buffer fill ${AID[$src]} --seed $seed >/dev/null
      $A --json write --local ${AID[$src]} --remote "${BDESC[$dst]}" --length "$SIZE" > "$D/t.json" 2>&1; rc=$?
      c1=$($A buffer checksum ${AID[$src]} 2>&1 | tail -1); c2=$($B buffer checksum ${BID[$dst]} 2>&1 | tail -1)
      what="a:$src -> b:$dst WRITE"
    else
      $B buffer fill ${BID[$dst]} --seed $seed >/dev/null
      $A --json read --local ${AID[$src]} --remote "${BDESC[$dst]}" --length "$SIZE" > "$D/t.json" 2>&1; rc=$?
      c1=$($B buffer checksum ${BID[$dst]} 2>&1 | tail -1); c2=$($A buffer checksum ${AID[$src]} 2>&1 | tail -1)
      what="b:$dst -> a:$src READ"
    fi
    if [ $rc = 0 ] && [ "$c1" = "$c2" ]; then pass=$((pass+1)); r=ok; else fail=$((fail+1)); r="FAIL rc=$rc $(tail -c 300 $D/t.json)"; fi
    echo "$what: $r ($c1 / $c2)"
  done
done; done
echo "transfers byte-exact: $pass, failed: $fail"
$A --json stats > "$OUT/stats_a.json" 2>&1; $B --json stats > "$OUT/stats_b.json" 2>&1
python3 - "$OUT/stats_a.json" "$OUT/stats_b.json" <<'PY'
import json, sys
for path in sys.argv[1:]:
    try: s = json.load(open(path))
    except Exception as e: print(path, "unreadable:", e); continue
    print("==", path)
    for p in s.get("peers", []):
        for l in p.get("lanes", []):
            sent, recv = int(l.get("bytesSent", l.get("bytes_sent", 0)) or 0), int(l.get("bytesReceived", l.get("bytes_received", 0)) or 0)
            if sent or recv:
                print(f"  lane {l['lane']:>2} {l.get('send_kind','')}/{l.get('recv_kind','')}: send nic {l.get('send_device')} gpu {l.get('send_gpu')} [{l.get('send_memory') or 'layout'}] "
                      f"sent {sent>>20} MiB; recv nic {l.get('recv_device')} gpu {l.get('recv_gpu')} [{l.get('recv_memory') or 'layout'}] received {recv>>20} MiB")
PY
grep -h -E "unpack stage ready|NOT served|rx no cmsg|panicked|ERROR" "$OUT"/a.log "$OUT"/b.log | sort | uniq -c | head -20
