#!/usr/bin/env bash
# Runs a command against Google's real TCPX plugin built by tools/realplugin/build.sh: sets the
# plugin's environment for loopback, starts a fake RxDM (tools/realplugin/fake-rxdm) for the
# command's lifetime, and prints what the fake saw afterwards.
#
#   tools/realplugin/run.sh [--out DIR] [--no-rxdm] [--rxdm-refuse TEXT] [--devmem] -- COMMAND...
#
#   --out DIR          build.sh's output folder (default target/realplugin; env REALPLUGIN_OUT)
#   --no-rxdm          start no RxDM (to see what the plugin does without one)
#   --rxdm-refuse TEXT the fake answers every request with TEXT instead of "Ok."
#   --devmem           the plugin's CUDA path too: COMMAND runs with the devmem shim preloaded
#                      (tools/realplugin/devmem-shim), the fake files every rule under `lo`
#                      (serving all the stand-in's GPUs, `--gpu-nic lo=...`), every GPU imports
#                      its receive memory (no SKIP_ODDS) and tcpxd unpacks with `d2d`
#
# In COMMAND's environment: TCPXD_TEST_PLUGIN and TCPXD_REALPLUGIN = the plugin's path (the
# daemon's integration tests take their plugin from TCPXD_TEST_PLUGIN), TCPXD_FAKE_RXDM_PREFIX =
# the fake's socket folder, TCPXD_FAKE_RXDM_LOG = its request log (one line per request),
# TCPXD_FAKE_RXDM_PID = its pid (kill it to see the plugin lose RxDM mid-run), and the
# plugin's NCCL_GPUDIRECTTCPX_* variables (each kept when already set). Examples:
#
#   tools/realplugin/run.sh -- sh -c 'target/release/tcpxctl conformance --plugin "$TCPXD_REALPLUGIN"'
#   tools/realplugin/run.sh -- cargo nextest run -p tcpxd --test suite daemon_transfers::
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
out="${REALPLUGIN_OUT:-$repo/target/realplugin}"
rxdm=1
refuse=""
devmem=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --no-rxdm) rxdm=0; shift ;;
    --rxdm-refuse) refuse="$2"; shift 2 ;;
    --devmem) devmem=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { echo "run.sh: no command (see --help)" >&2; exit 2; }
plugin="$out/lib/libnccl-net.so"
[ -f "$plugin" ] || { echo "run.sh: $plugin not found: build it with tools/realplugin/build.sh" >&2; exit 1; }

work="$(mktemp -d "${TMPDIR:-/tmp}/tcpxd-realplugin.XXXXXX")"
export TCPXD_TEST_PLUGIN="$plugin" TCPXD_REALPLUGIN="$plugin"
export TCPXD_FAKE_RXDM_PREFIX="$work/rxdm" TCPXD_FAKE_RXDM_LOG="$work/rxdm.log"
# The stand-in sits beside the plugin (found through its RUNPATH); on the library path too, for
# anything else that looks for libcuda.so.1 in this run.
export LD_LIBRARY_PATH="$out/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Loopback for data and control; the fake RxDM's folder; a 1 ms flow-steering wait (default 5 s).
export NCCL_GPUDIRECTTCPX_SOCKET_IFNAME="${NCCL_GPUDIRECTTCPX_SOCKET_IFNAME:-lo}"
export NCCL_GPUDIRECTTCPX_CTRL_DEV="${NCCL_GPUDIRECTTCPX_CTRL_DEV:-lo}"
export NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX="${NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX:-$TCPXD_FAKE_RXDM_PREFIX}"
export NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS="${NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS:-1000}"
# The CUDA stand-in: two devices, the current one 1 for tools that make none current. An odd ordinal
# with SKIP_ODDS keeps the plugin from importing RxDM's GPU receive buffer (get_gpu_fd_<pci>) for
# a receive comm; the daemon makes the NIC's GPU (0, even) current, so the fake RxDM below serves
# that buffer (a3vm mode). Host receives never use it.
export TCPXD_CUDASTUB_DEVICES="${TCPXD_CUDASTUB_DEVICES:-2}"
export TCPXD_CUDASTUB_CURRENT_DEVICE="${TCPXD_CUDASTUB_CURRENT_DEVICE:-1}"
if [ "$devmem" = 1 ]; then
  shim="$out/lib/libtcpxd-devmem-shim.so"
  if [ ! -f "$shim" ] || [ "$here/devmem-shim/devmem_shim.c" -nt "$shim" ]; then
    "$here/devmem-shim/build.sh" "$out/lib" >/dev/null
  fi
  export LD_PRELOAD="$shim${LD_PRELOAD:+:$LD_PRELOAD}"
  export UCCL_TCPX_UNPACK_IMPL="${UCCL_TCPX_UNPACK_IMPL:-d2d}"
  export TCPXD_DEVMEM_NIC_PCI="${TCPXD_DEVMEM_NIC_PCI:-lo=0000:06:00.0}"  # regMr needs a NIC PCI address
else
  export NCCL_TCPX_RXMEM_IMPORT_SKIP_ODDS="${NCCL_TCPX_RXMEM_IMPORT_SKIP_ODDS:-1}"
fi
export NCCL_DYNAMIC_CHUNK_SIZE="${NCCL_DYNAMIC_CHUNK_SIZE:-524288}"
# The conformance suite's nccl_pat case checks that NCCL's PAT algorithm is off for the plugin.
export NCCL_PAT_ENABLE="${NCCL_PAT_ENABLE:-0}"

rxdm_pid=""
cleanup() {
  if [ -n "$rxdm_pid" ]; then
    kill -TERM "$rxdm_pid" 2>/dev/null || true
    wait "$rxdm_pid" 2>/dev/null || true
  fi
  if [ -s "$TCPXD_FAKE_RXDM_LOG" ]; then
    echo "run.sh: the fake RxDM's requests: $(wc -l <"$TCPXD_FAKE_RXDM_LOG") (log kept: $TCPXD_FAKE_RXDM_LOG)" >&2
  else
    rm -rf "$work"
  fi
}
trap cleanup EXIT

if [ "$rxdm" = 1 ]; then
  fake="$repo/target/release/tcpxd-fake-rxdm"
  [ -x "$fake" ] || (cd "$repo" && cargo build --release -q -p tcpxd-fake-rxdm)
  # A newer debug build wins (it has what the sources have now).
  [ "$repo/target/debug/tcpxd-fake-rxdm" -nt "$fake" ] && fake="$repo/target/debug/tcpxd-fake-rxdm"
  # a3vm: the fake serves each GPU's receive memory (get_gpu_fd_<pci>, a memfd the stand-in maps),
  # which the plugin imports at accept under the GPU the daemon makes current (an even ordinal
  # since the topology: SKIP_ODDS no longer spares it). Its filing record counts every loopback
  # flow as mismatched (no NIC owns 127.0.0.1): only tools/realplugin/a3pair.sh's record means
  # anything.
  args=(--prefix "$TCPXD_FAKE_RXDM_PREFIX" --log "$TCPXD_FAKE_RXDM_LOG" --gpu-nic-preset a3vm)
  if [ "$devmem" = 1 ]; then
    gpus=$(for ((i = 0; i < TCPXD_CUDASTUB_DEVICES; i++)); do
      case $i in 0) echo 0000:04:00.0 ;; 1) echo 0000:05:00.0 ;; 2) echo 0000:0a:00.0 ;; 3) echo 0000:0b:00.0 ;;
        4) echo 0000:84:00.0 ;; 5) echo 0000:85:00.0 ;; 6) echo 0000:8a:00.0 ;; 7) echo 0000:8b:00.0 ;; esac
    done | paste -sd,)
    args+=(--gpu-nic "lo=$gpus" --nic lo=127.0.0.1)
  fi
  [ -n "$refuse" ] && args+=(--refuse "$refuse")
  "$fake" "${args[@]}" >/dev/null &
  rxdm_pid=$!
  export TCPXD_FAKE_RXDM_PID="$rxdm_pid"
  for _ in $(seq 100); do
    [ -S "$TCPXD_FAKE_RXDM_PREFIX/rx_rule_uninstall" ] && break
    sleep 0.05
  done
  [ -S "$TCPXD_FAKE_RXDM_PREFIX/rx_rule_uninstall" ] || { echo "run.sh: the fake RxDM did not start" >&2; exit 1; }
fi

echo "run.sh: plugin $plugin; fake RxDM ${rxdm_pid:+pid $rxdm_pid under $TCPXD_FAKE_RXDM_PREFIX}${rxdm_pid:-off}" >&2
set +e
"$@"
rc=$?
set -e
exit "$rc"
