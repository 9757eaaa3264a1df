#!/usr/bin/env bash
# Session 32 (ringflake): what handing a framed session's first read to the serving thread costs
# a new session's first request on a host with CPUs to spare (the 2-core VM is too loaded to
# tell with `runtime.spin` on). benches/first_read.py, BEFORE's and AFTER's tcpxd alternating,
# over the built-in emulation (no GPU used): `--spin on` (the 16-core host's default) and `off`,
# sessions on the sessions thread and on the poller's. About a minute.
#
#   benches/ringflake_device.sh BEFORE_DIR AFTER_DIR [OUT_DIR]
#
# Each dir holds a release build's tcpxd and python/src (the tcpxd package, C pass built).
# Environment: N (1000 sessions per binary and row).
set -euo pipefail
if [ $# -lt 2 ]; then
    sed -n 2,12p "$0"
    exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
before=$(cd "$1" && pwd) after=$(cd "$2" && pwd) out=${3:-/tmp/ringflake-device}
mkdir -p "$out"
for d in "$before" "$after"; do
    [ -x "$d/tcpxd" ] || { echo "$d/tcpxd: missing" >&2; exit 2; }
done
n=${N:-1000}
for spin in on off; do
    PYTHONPATH=$after/python/src python3 "$here/first_read.py" --bin "before=$before/tcpxd" \
        --bin "after=$after/tcpxd" -n "$n" --spin "$spin" --modes on,off | tee -a "$out/first_read.txt"
done
echo "nproc $(nproc)" | tee -a "$out/first_read.txt"
