#!/usr/bin/env bash
# Session 28, hostorder (issue #38 point 3): host blocks scattered ÷ contiguous, this branch (A)
# against main (B), rows alternating, then one traced WRITE and READ of each build with
# benches/chunks.py's table — its session-28 rows split a finished gather's wait to be posted
# into the plugin's window full ("window"), an older gather of the lane not done ("older": the
# ring order the plugin's FIFO matching imposes) and the poller ("poller"), and say what share of
# the data phase a lane had room, a gather done and an older one holding it ("send held by ring
# order per lane"). About 4 minutes on the 16-CPU H200 host (no GPU used).
#
#   benches/hostorder_device.sh A B [OUT]
#
# A, B: folders with release tcpxd and tcpxctl. Environment: SWEEP_SECONDS (150).
set -uo pipefail
if [ $# -lt 2 ]; then
  sed -n 2,13p "$0"
  exit 2
fi
here=$(cd "$(dirname "$0")/.." && pwd)
a=$(cd "$1" && pwd) b=$(cd "$2" && pwd) out=${3:-/tmp/hostorder-device}
mkdir -p "$out"
SWEEP_SECONDS=${SWEEP_SECONDS:-150} ROWS="base default" TRACE_ROWS="base default" \
  "$here/tools/host-blocks-sweep.sh" "$a" "$b" 2>&1 | tee "$out/sweep.txt"
