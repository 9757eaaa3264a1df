#!/usr/bin/env bash
# Two A3-shaped nodes on one machine, on Google's real TCPX plugin (issue #37): two network
# namespaces joined by five veth pairs (eth0 control, eth1..eth4 data, each pair its own subnet,
# 10.100.K.1 on node a and 10.100.K.2 on node b), in each a fake RxDM in RxDM's `a3vm` mode
# (tools/realplugin/fake-rxdm: every flow-steering rule filed under the NIC serving the GPU it
# names, and recorded with whether that NIC is the one the flow's destination address belongs
# to; each GPU's receive memory a file), and a tcpxd on the plugin built by build.sh with the CUDA
# stand-in presenting A3's eight GPUs (their real PCI bus ids) and the devmem shim
# (tools/realplugin/devmem-shim: the plugin's devmem-tcp receive and dma-buf send, in user space;
# a flow's bytes land in a GPU's receive memory only when a rule filed under the NIC it arrives
# on steers it there). The daemons pair, move host memory both ways byte-checked, and
# (--gpu-pairs) WRITE and READ CUDA buffers GPU s (a) <-> GPU d (b) for every GPU and a few cross
# pairs; then the script prints each node's rules, how many were filed under another NIC than
# the one their flow arrives on (mismatches: on A3 each of those comms' first CUDA receive kills
# the process, "rx no cmsg"), the bytes each GPU's receive memory took, and the daemons'
# per-lane statistics.
#
#   sudo tools/realplugin/a3pair.sh [--out DIR] [--bin DIR] [--size SIZE] [--gpu-pairs [--gpu-size SIZE]] [--misbind] [--kill-restart [--restarts N]] [--keep]
#
#   --out DIR   build.sh's output folder (default target/realplugin; env REALPLUGIN_OUT); the
#               shim is built into OUT/lib when missing (devmem-shim/build.sh)
#   --bin DIR   where tcpxd, tcpxctl and tcpxd-fake-rxdm are (default target/release, else
#               target/debug)
#   --size      bytes per host transfer (default 64M)
#   --gpu-pairs also WRITE (a -> b) and READ (b -> a) CUDA buffers for the GPU pairs
#               0:0 1:1 ... 7:7, the cross pairs 0:5 3:6 6:1, and host:2 / 7:host, checksums
#               compared (env A3PAIR_GPU_PAIRS: a list of S:D, S and D a GPU or `host`;
#               A3PAIR_PARALLEL=1: every pair's WRITE at once, then every READ)
#   --gpu-size  bytes per GPU transfer (default 4M)
#   --misbind   the negative run: node b's daemon gets a wrong GPU -> NIC map (TCPXD_TOPOLOGY:
#               every GPU on another NIC than RxDM's), so its GPU receive lanes are listened for
#               on NICs that do not serve their GPU; one GPU 0 -> GPU 0 WRITE must end node b's
#               daemon as A3 would ("fatal, ... no cmsg", exit status 1). Exit status 0 only then
#   --kill-restart  after the transfers, SIGKILL node b's daemon (its comms never close: their
#               rules stay in b's RxDM), start it again on the same state directory (it removes
#               them, src/rx_rules.rs) and move the bytes again; b's rules left must be 0
#   --restarts N  do --kill-restart's kill, start and checked WRITE N times in a row (default 1),
#               printing after each the rules each fake RxDM holds (installs answered OK less
#               uninstalls, per flow, as fake-rxdm's rules_left) and node a's daemon's open fds:
#               both must stay bounded (b's new instance removes what the killed one left); each
#               round also READs b -> a (a's rules for b's flows: a removes them when b dies)
#   --under-load  kill b while WRITEs a -> b run back to back (the one under way must fail, not
#               hang: 60 s bound each)
#   --keep      keep the work folder (logs, sockets) and print it
#
# Needs root (ip netns), iproute2, jq, a C compiler (for the shim), and the plugin from build.sh.
# Everything it makes (namespaces, veths, processes) goes when it exits. Exit status 0 only when
# every transfer was byte-exact and no rule was mismatched (--misbind: only when the mis-bound
# daemon died as A3's would). A3PAIR_WRAP runs each tcpxd under a wrapper (e.g. gdb's --args).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="${REALPLUGIN_OUT:-$repo/target/realplugin}"
bin=""
size="64M"
gpu_pairs=0
gpu_size="4M"
misbind=0
kill_restart=0
restarts=1
under_load=0
keep=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --bin) bin="$2"; shift 2 ;;
    --size) size="$2"; shift 2 ;;
    --gpu-pairs) gpu_pairs=1; shift ;;
    --gpu-size) gpu_size="$2"; shift 2 ;;
    --misbind) misbind=1; shift ;;
    --kill-restart) kill_restart=1; shift ;;
    --restarts) restarts="$2"; shift 2 ;;
    --under-load) under_load=1; shift ;;
    --keep) keep=1; shift ;;
    -h|--help) sed -n '2,52p' "$0"; exit 0 ;;
    *) echo "a3pair.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
die() { echo "a3pair.sh: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "needs root (network namespaces)"
plugin="$out/lib/libnccl-net.so"
[ -f "$plugin" ] || die "$plugin not found: build it with tools/realplugin/build.sh"
if [ -z "$bin" ]; then
  if [ -x "$repo/target/release/tcpxd" ]; then bin="$repo/target/release"; else bin="$repo/target/debug"; fi
fi
shim="$out/lib/libtcpxd-devmem-shim.so"
if [ ! -f "$shim" ] || [ "$here/devmem-shim/devmem_shim.c" -nt "$shim" ]; then
  "$here/devmem-shim/build.sh" "$out/lib" >/dev/null || die "building the devmem shim failed"
fi
for b in tcpxd tcpxctl tcpxd-fake-rxdm; do
  [ -x "$bin/$b" ] || die "$bin/$b not found: cargo build --release (-p tcpxd-fake-rxdm for the fake)"
done

tag="$$"
ns_a="tcpxa3a-$tag" ns_b="tcpxa3b-$tag"
work="$(mktemp -d "${TMPDIR:-/tmp}/tcpxd-a3pair.XXXXXX")"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  ip netns del "$ns_a" 2>/dev/null || true
  ip netns del "$ns_b" 2>/dev/null || true
  if [ "$keep" = 1 ]; then echo "a3pair.sh: work folder kept: $work" >&2; else rm -rf "$work"; fi
}
trap cleanup EXIT

# The two nodes and their five links.
ip netns add "$ns_a"
ip netns add "$ns_b"
for ns in "$ns_a" "$ns_b"; do ip -n "$ns" link set lo up; done
for k in 0 1 2 3 4; do
  ip link add "ta$k-$tag" type veth peer name "tb$k-$tag"
  ip link set "ta$k-$tag" netns "$ns_a"
  ip link set "tb$k-$tag" netns "$ns_b"
  ip -n "$ns_a" link set "ta$k-$tag" name "eth$k"
  ip -n "$ns_b" link set "tb$k-$tag" name "eth$k"
  ip -n "$ns_a" addr add "10.100.$k.1/24" dev "eth$k"
  ip -n "$ns_b" addr add "10.100.$k.2/24" dev "eth$k"
  ip -n "$ns_a" link set "eth$k" up
  ip -n "$ns_b" link set "eth$k" up
done

start_node() { # name ns host-octet
  local name="$1" ns="$2" n="$3"
  mkdir -p "$work/$name"
  ip netns exec "$ns" "$bin/tcpxd-fake-rxdm" --prefix "$work/$name/rxdm" --log "$work/$name/rules.log" \
    --gpu-nic-preset a3vm >/dev/null 2>"$work/$name/rxdm.err" &
  pids+=($!)
  for _ in $(seq 100); do [ -S "$work/$name/rxdm/rx_rule_uninstall" ] && break; sleep 0.05; done
  [ -S "$work/$name/rxdm/rx_rule_uninstall" ] || die "node $name: the fake RxDM did not start ($(cat "$work/$name/rxdm.err"))"
  start_tcpxd "$@"
}
# The negative run's map for node b: every GPU on a NIC RxDM does not file its rules under.
misbound_map="0=eth3;1=eth3;2=eth4;3=eth4;4=eth1;5=eth1;6=eth2;7=eth2"
start_tcpxd() { # name ns host-octet: the daemon (its state directory kept across restarts)
  local name="$1" ns="$2" n="$3"
  local topo="${TCPXD_TOPOLOGY:-}"
  if [ "$misbind" = 1 ] && [ "$name" = b ]; then topo="$misbound_map"; fi
  ip netns exec "$ns" env \
    LD_LIBRARY_PATH="$out/lib" \
    LD_PRELOAD="$shim" \
    ${topo:+TCPXD_TOPOLOGY="$topo"} \
    UCCL_TCPX_UNPACK_IMPL="${UCCL_TCPX_UNPACK_IMPL:-d2d}" \
    NCCL_GPUDIRECTTCPX_SOCKET_IFNAME=eth1,eth2,eth3,eth4 \
    NCCL_GPUDIRECTTCPX_CTRL_DEV=eth0 \
    NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX="$work/$name/rxdm" \
    NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS=1000 \
    TCPXD_CUDASTUB_DEVICES=8 \
    TCPXD_CUDASTUB_CURRENT_DEVICE="${A3PAIR_CURRENT_DEVICE:-1}" \
    NCCL_DYNAMIC_CHUNK_SIZE=524288 \
    NCCL_PAT_ENABLE=0 \
    RUST_LOG="${RUST_LOG:-info}" \
    ${A3PAIR_WRAP:-} "$bin/tcpxd" --node-id "a3$name" --plugin "$plugin" --api-socket "$work/$name/api.sock" \
    --peer-listen "10.100.0.$n:7$n$n$n" --ready-file "$work/$name/ready.json" --state-dir "$work/$name/state" \
    2>>"$work/$name/tcpxd.log" &
  pids+=($!)
}
start_node a "$ns_a" 1
start_node b "$ns_b" 2
A="unix:$work/a/api.sock" B="unix:$work/b/api.sock"
ctl() { "$bin/tcpxctl" "$@"; }
crc() { "$bin/tcpxctl" --endpoint "$1" buffer checksum "$2" --json | sed -nE 's/.*"crc32c": *"([0-9a-f]+)".*/\1/p'; }
ctl --endpoint "$A" health --wait 60 >/dev/null || die "node a did not serve (see $work/a/tcpxd.log; --keep)"
ctl --endpoint "$B" health --wait 60 >/dev/null || die "node b did not serve (see $work/b/tcpxd.log; --keep)"
ctl --endpoint "$A" describe

failed=0
# Host memory both ways, byte-checked by checksum.
src=$(ctl --endpoint "$A" buffer register --host "$size" --label src --quiet)
src_id=${src#*:*:}; src_id=${src_id%%:*}
ctl --endpoint "$A" buffer fill "$src_id" --seed 37 >/dev/null
dst=$(ctl --endpoint "$B" buffer register --host "$size" --label dst --quiet)
dst_id=${dst#*:*:}; dst_id=${dst_id%%:*}
if ctl --endpoint "$A" write --local "$src_id" --remote "$dst" --length "$size"; then
  ca=$(crc "$A" "$src_id")
  cb=$(crc "$B" "$dst_id")
  if [ -n "$ca" ] && [ "$ca" = "$cb" ]; then echo "host WRITE a -> b: byte-exact ($ca)"; else echo "host WRITE a -> b: checksums differ ($ca / $cb)"; failed=1; fi
else
  echo "host WRITE a -> b failed"; failed=1
fi
back=$(ctl --endpoint "$A" buffer register --host "$size" --label back --quiet)
back_id=${back#*:*:}; back_id=${back_id%%:*}
if ctl --endpoint "$A" read --local "$back_id" --remote "$dst" --length "$size"; then
  cc=$(crc "$A" "$back_id")
  if [ "$cc" = "${ca:-}" ]; then echo "host READ b -> a: byte-exact"; else echo "host READ b -> a: checksum differs"; failed=1; fi
else
  echo "host READ b -> a failed"; failed=1
fi

# A buffer on a node: `host` or a GPU ordinal; prints its descriptor.
reg() { # endpoint where label
  if [ "$2" = host ]; then ctl --endpoint "$1" buffer register --host "$gpu_size" --label "$3" --quiet
  else ctl --endpoint "$1" buffer register --cuda "$2" "$gpu_size" --label "$3" --quiet; fi
}
id_of() { local d="${1#*:*:}"; echo "${d%%:*}"; }
# The SHA-256 of a buffer's first --gpu-size bytes, read out through the daemon (tcpxd's CUDA
# checksum runs a GPU kernel, which the stand-in has not; reading copies to the host).
sum_of() { # endpoint id
  rm -f "$work/sum.bin"
  "$bin/tcpxctl" --endpoint "$1" buffer read "$2" --length "$gpu_size" --out "$work/sum.bin" >/dev/null 2>&1 || return 0
  sha256sum "$work/sum.bin" | cut -c1-16
}
if [ "$gpu_pairs" = 1 ] || [ "$misbind" = 1 ]; then
  pairs="${A3PAIR_GPU_PAIRS:-0:0 1:1 2:2 3:3 4:4 5:5 6:6 7:7 0:5 3:6 6:1 host:2 7:host}"
  [ "$misbind" = 1 ] && pairs="${A3PAIR_GPU_PAIRS:-0:0}"
  # Every pair's three buffers first: src (a, S), dst (b, D), back (a, S).
  declare -A SRC DST DSTD BACK
  gpu_n=0
  for pair in $pairs; do
    s_=${pair%%:*} d_=${pair##*:}
    gpu_n=$((gpu_n + 1))
    gs=$(reg "$A" "$s_" "src$pair" 2>&1) || { echo "$pair: register on a ($s_): $gs"; failed=1; continue; }
    ctl --endpoint "$A" buffer fill "$(id_of "$gs")" --seed "$gpu_n" >/dev/null
    gd=$(reg "$B" "$d_" "dst$pair" 2>&1) || { echo "$pair: register on b ($d_): $gd"; failed=1; continue; }
    gb=$(reg "$A" "$s_" "back$pair" 2>&1) || { echo "$pair: register on a ($s_): $gb"; failed=1; continue; }
    SRC[$pair]=$(id_of "$gs"); DST[$pair]=$(id_of "$gd"); DSTD[$pair]=$gd; BACK[$pair]=$(id_of "$gb")
  done
  # One step (WRITE a -> b, or READ b -> a) for every pair: one after another, or with
  # A3PAIR_PARALLEL=1 all at once (every GPU moving at the same time).
  step() { # write|read
    local pids_=() pair
    for pair in "${!SRC[@]}"; do
      if [ "$1" = write ]; then
        args=(write --local "${SRC[$pair]}" --remote "${DSTD[$pair]}")
      else
        args=(read --local "${BACK[$pair]}" --remote "${DSTD[$pair]}")
      fi
      if [ "${A3PAIR_PARALLEL:-0}" = 1 ]; then
        ctl --endpoint "$A" "${args[@]}" --length "$gpu_size" >"$work/$1.$pair.out" 2>&1 &
        pids_+=("$!:$pair")
      else
        ctl --endpoint "$A" "${args[@]}" --length "$gpu_size" >"$work/$1.$pair.out" 2>&1 || echo "$pair $1 failed: $(tail -1 "$work/$1.$pair.out")"
      fi
    done
    for p_ in "${pids_[@]}"; do
      wait "${p_%%:*}" || echo "${p_#*:} $1 failed: $(tail -1 "$work/$1.${p_#*:}.out")"
    done
  }
  t0=$(date +%s.%N)
  step write
  t1=$(date +%s.%N)
  step read
  t2=$(date +%s.%N)
  gpu_ok=0
  for pair in $pairs; do
    [ -n "${SRC[$pair]:-}" ] || continue
    s_=${pair%%:*} d_=${pair##*:}
    c1=$(sum_of "$A" "${SRC[$pair]}"); c2=$(sum_of "$B" "${DST[$pair]}"); c3=$(sum_of "$A" "${BACK[$pair]}")
    if [ -z "$c1" ] || [ "$c1" != "$c2" ]; then echo "$pair WRITE a:$s_ -> b:$d_: differs (sha256 $c1 / $c2)"; failed=1; continue; fi
    if [ "$c3" != "$c1" ]; then echo "$pair READ b:$d_ -> a:$s_: differs (sha256 $c3 / $c1)"; failed=1; continue; fi
    echo "$pair WRITE a:$s_ -> b:$d_ and READ back: byte-exact (sha256 $c1…, $gpu_size each way)"
    gpu_ok=$((gpu_ok + 1))
  done
  [ "$gpu_ok" = "$gpu_n" ] || failed=1
  echo "GPU pairs: $gpu_ok of $gpu_n byte-exact both ways ($([ "${A3PAIR_PARALLEL:-0}" = 1 ] && echo 'all at once' || echo 'one after another'): WRITEs $(echo "$t1 - $t0" | bc) s, READs $(echo "$t2 - $t1" | bc) s)"
fi

# The rules a fake RxDM holds now, from its log (fake-rxdm's rules_left: one per flow).
live_rules() { awk '$1 == "install" && / ok( |$)/ { r[$2 " " $3 " " $5] = 1 } $1 == "uninstall" { delete r[$2 " " $3 " " $5] } END { n = 0; for (k in r) n++; print n }' "$1" 2>/dev/null || echo 0; }
if [ "$kill_restart" = 1 ]; then
  echo "before any restart: rules held: a $(live_rules "$work/a/rules.log"), b $(live_rules "$work/b/rules.log"); node a's daemon fds $(ls /proc/${pids[1]}/fd | wc -l)"
  for r in $(seq "$restarts"); do
  if [ "$under_load" = 1 ]; then
    rm -f "$work/stop-load" "$work/load.log"
    ( while [ ! -e "$work/stop-load" ]; do
        timeout 60 "$bin/tcpxctl" --endpoint "$A" write --local "$src_id" --remote "$dst" --length "$size" >>"$work/load.log" 2>&1 && st=0 || st=$?  # (set -e)
        printf '\nrc=%s\n' "$st" >>"$work/load.log"  # (an error line may lack its newline)
      done ) &
    inflight=$!
    sleep 0.5
  fi
  # pids: a's fake RxDM, a's daemon, b's fake RxDM, b's daemon.
  kill -KILL "${pids[3]}"; wait "${pids[3]}" 2>/dev/null || true
  if [ "$under_load" = 1 ]; then
    touch "$work/stop-load"; wait "$inflight" || true
    n_ok=$(grep -c '^rc=0$' "$work/load.log" || true); n_hung=$(grep -c '^rc=124$' "$work/load.log" || true)
    n_err=$(grep -c '^rc=' "$work/load.log" || true); n_err=$((n_err - ${n_ok:-0} - ${n_hung:-0}))
    echo "restart $r: the load: ${n_ok:-0} WRITEs ok before the kill, $n_err failed around it, ${n_hung:-0} hung ($(grep -v -e '^rc=' -e '^transfer' -e '^$' "$work/load.log" | tail -1 | cut -c1-160))"
    [ "${n_hung:-0}" = 0 ] || failed=1
  fi
  left=$(grep -c '^install' "$work/b/rules.log" || true); gone=$(grep -c '^uninstall' "$work/b/rules.log" || true)
  held_kill=$(live_rules "$work/b/rules.log")
  echo "restart $r: node b's daemon killed: its RxDM saw ${left:-0} installs, ${gone:-0} uninstalls, holds $held_kill rules"
  rm -f "$work/b/api.sock"
  start_tcpxd b "$ns_b" 2
  pids[3]=${pids[-1]}; unset 'pids[-1]'
  ctl --endpoint "$B" health --wait 60 >/dev/null || die "node b did not serve again (see $work/b/tcpxd.log; --keep)"
  grep -h "flow-steering rules the previous instance left" "$work/b/tcpxd.log" | tail -1 || true
  # The descriptor handed out before works again (b's daemon-allocated host memory came back).
  ok=0
  for _ in 1 2 3 4 5; do  # (a's first WRITE may meet the pairing the kill broke)
    if ctl --endpoint "$A" write --local "$src_id" --remote "$dst" --length "$size" >/dev/null 2>>"$work/writes.err"; then ok=1; break; fi
    sleep 0.2
  done
  if [ "$ok" = 1 ]; then
    cb=$(crc "$B" "$dst_id")
    if [ "$cb" = "${ca:-}" ]; then echo "restart $r: host WRITE a -> b after b's restart: byte-exact"; else echo "restart $r: host WRITE a -> b after b's restart: checksum differs"; failed=1; fi
  else
    echo "restart $r: host WRITE a -> b after b's restart failed ($(tail -1 "$work/writes.err"))"; failed=1
  fi
  if [ "$restarts" -gt 1 ]; then
    if ctl --endpoint "$A" read --local "$back_id" --remote "$dst" --length "$size" >/dev/null 2>>"$work/writes.err" &&
       [ "$(crc "$A" "$back_id")" = "${ca:-}" ]; then :; else echo "restart $r: host READ b -> a after b's restart failed or differs"; failed=1; fi
  fi
  echo "restart $r: rules held: a $(live_rules "$work/a/rules.log"), b $(live_rules "$work/b/rules.log") (b's at the kill: $held_kill); node a's daemon fds $(ls /proc/${pids[1]}/fd | wc -l)"
  done
fi

# Each GPU's bytes by NIC, from `tcpxctl stats --json`'s lanes: a lane's send half carries its
# local GPU's bytes (send_memory "gpuS>..."), its receive half those landing in a local GPU
# ("...>gpuD"). With RxDM's a3vm binding GPU g belongs on NIC g/2 (eth1..eth4 are devices 0..3).
gpu_nics() { # endpoint node
  ctl --endpoint "$1" stats --json 2>/dev/null | jq -r '
    [.. | objects | select(has("send_memory") and has("send_device"))] as $l
    | [($l[] | select(.bytes_sent > 0 and ((.send_memory // "") | test("^gpu[0-9]+>")))
         | {dir: "sent", gpu: (.send_memory | capture("^gpu(?<g>[0-9]+)>").g | tonumber), nic: .send_device, bytes: .bytes_sent}),
       ($l[] | select(.bytes_received > 0 and ((.recv_memory // "") | test(">gpu[0-9]+$")))
         | {dir: "received", gpu: (.recv_memory | capture(">gpu(?<g>[0-9]+)$").g | tonumber), nic: .recv_device, bytes: .bytes_received})]
    | group_by([.gpu, .dir, .nic])[] | "\(.[0].gpu) \(.[0].dir) \(.[0].nic) \(map(.bytes) | add)"' |
  while read -r g dir nic bytes; do
    own=$((g / 2)); verdict="its own NIC"
    if [ "$nic" != "$own" ]; then verdict="NOT its NIC (eth$((own + 1)))"; fi
    echo "  node $2: GPU $g $dir $bytes bytes on NIC $nic (eth$((nic + 1))): $verdict"
  done
}
if [ "$gpu_pairs" = 1 ] && [ "$misbind" = 0 ]; then
  echo "== GPU bytes per NIC (tcpxctl stats)"
  per_nic="$( { gpu_nics "$A" a; gpu_nics "$B" b; } )"
  echo "$per_nic"
  off=$(grep -c "NOT its NIC" <<<"$per_nic" || true)
  gpus_seen=$(grep -oE 'node [ab]: GPU [0-9]+ (sent|received)' <<<"$per_nic" | sort -u | wc -l)
  echo "GPU bytes per NIC: $gpus_seen (node, GPU, direction) with bytes, ${off:-0} of them on another NIC"
  [ "${off:-0}" = 0 ] && [ "$gpus_seen" -gt 0 ] || failed=1
fi
b_died=""
if [ "$misbind" = 1 ]; then
  # The mis-bound daemon must die as on A3: the plugin's exit(1) at its first GPU receive.
  for _ in $(seq 100); do kill -0 "${pids[3]}" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "${pids[3]}" 2>/dev/null; then
    b_died="no"
  else
    st=0; wait "${pids[3]}" || st=$?
    b_died="exit status $st"
  fi
fi
echo "== node a stats"; ctl --endpoint "$A" stats || true
echo "== node b stats"; ctl --endpoint "$B" stats 2>&1 || true
# Daemons first (SIGTERM, 40 s, then SIGKILL: seen 2026-11-29, a daemon on the real plugin whose
# peer stopped at the same moment spun in its drain for minutes), then the fake RxDMs, whose
# exit summaries count the rules.
for i in 1 3; do kill -TERM "${pids[$i]}" 2>/dev/null || true; done
for i in 1 3; do
  for _ in $(seq 400); do kill -0 "${pids[$i]}" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "${pids[$i]}" 2>/dev/null; then
    echo "a3pair.sh: tcpxd pid ${pids[$i]} still running 40 s after SIGTERM: killed"
    kill -KILL "${pids[$i]}" 2>/dev/null || true
  fi
done
for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
pids=()
for name in a b; do tail -2 "$work/$name/rxdm.err" | sed "s/^/node $name: /"; done
mism=0
for name in a b; do
  log="$work/$name/rules.log"
  total=$(grep -c '^install' "$log" 2>/dev/null || true)
  bad=$(grep -c 'MISMATCH' "$log" 2>/dev/null || true)
  echo "== node $name: ${total:-0} rules installed, ${bad:-0} filed under another NIC than their flow's"
  grep '^install' "$log" 2>/dev/null | sed -E 's/([0-9]+\.[0-9]+\.[0-9]+\.[0-9]+):[0-9]+/\1/g' | sort | uniq -c | sort -rn | head -20 || true
  mism=$((mism + ${bad:-0}))
done
for name in a b; do
  echo "== node $name: GPU receive memory (the devmem shim, per daemon instance: bytes landed per GPU, dma-buf bytes sent per GPU)"
  for f in "$work/$name"/rxdm/devmem-stats.*; do [ -f "$f" ] && sed "s/^/  /" "$f"; done
  grep -h '^devmem-shim: flow' "$work/$name/tcpxd.log" | sed -E 's/:[0-9]+ -> ([0-9.]+):[0-9]+/ -> \1/; s/^devmem-shim: flow //' | sort | uniq -c | sed 's/^/  /' || true
done
if [ "$misbind" = 1 ]; then
  why=$(grep -h -m1 -E 'fatal, .*no cmsg' "$work/b/tcpxd.log" || true)
  echo "a3pair.sh: mis-bound node b: $mism mismatched rules; its daemon: ${b_died:-?}; the plugin said: ${why:-nothing about cmsgs}"
  if [ "$mism" -gt 0 ] && [ "$b_died" = "exit status 1" ] && [ -n "$why" ]; then
    echo "a3pair.sh: the mis-bound daemon died as on A3 (rx no cmsg)"; exit 0
  fi
  echo "a3pair.sh: the mis-bound daemon did NOT die as on A3"; exit 1
fi
[ "$mism" = 0 ] || failed=1
echo "a3pair.sh: $mism mismatched rules; transfers $([ "$failed" = 0 ] && echo ok || echo 'NOT all ok')"
exit "$failed"
