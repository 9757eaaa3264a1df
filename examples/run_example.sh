#!/usr/bin/env bash
# Starts two daemons on the built-in emulation (CUDA mode where a GPU exists) and runs an example
# between them: `run_example.sh [tensor|host] [--mib N]` (default: tensor).
# TCPXD: the tcpxd binary (default target/release/tcpxd). Needs `pip install ./python`.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
which=tensor
case "${1:-}" in tensor|host) which=$1; shift ;; esac
tcpxd="${TCPXD:-$here/../target/release/tcpxd}"
dir="$(mktemp -d)"
cleanup() { kill -TERM "${pa:-}" "${pb:-}" 2>/dev/null || true; wait 2>/dev/null || true; }
trap cleanup EXIT
"$tcpxd" --node-id ex-a --builtin-emulation --api-socket "$dir/a.sock" --peer-listen 127.0.0.1:0 \
  --ready-file "$dir/a.ready" 2>"$dir/a.log" & pa=$!
"$tcpxd" --node-id ex-b --builtin-emulation --api-socket "$dir/b.sock" --peer-listen 127.0.0.1:0 \
  --ready-file "$dir/b.ready" 2>"$dir/b.log" & pb=$!
for _ in $(seq 200); do [ -s "$dir/a.ready" ] && [ -s "$dir/b.ready" ] && break; sleep 0.05; done
# No --b-peer: B's descriptors carry its peer address, and A pairs with B on the first write.
python3 "$here/${which}_transfer.py" --a "unix:$dir/a.sock" --b "unix:$dir/b.sock" "$@" \
  || { echo "--- daemon logs"; tail -n 30 "$dir/a.log" "$dir/b.log"; exit 1; }
