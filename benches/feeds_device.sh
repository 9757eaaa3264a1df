#!/bin/sh
# Session 31, feeds, for the 16-CPU H200 host: two NIXL agents on ONE daemon, the 4 KiB READ and
# the notification round trip polled tight, this branch (A) against main (B), alternating
# (benches/feeds_ab.py: A B B A a round), p50 / p99 and the session events each agent's process
# decodes per iteration; then benches/tail.py --one-node once each (the tail as a user sees it).
#
#   benches/feeds_device.sh A B OUT [ITERS]
#
# A / B: folders with a release `tcpxd` and `python/src` (C pass built). ITERS: a row (3000).
# About 3 minutes.
set -u
A=$1
B=$2
OUT=$3
ITERS=${4:-3000}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
mkdir -p "$OUT"
echo "host: $(nproc) CPUs; load: $(cat /proc/loadavg)"
timeout 300 $PY "$HERE/feeds_ab.py" --after-bin "$A/tcpxd" --after-py "$A/python/src" \
    --before-bin "$B/tcpxd" --before-py "$B/python/src" --rounds 3 --iters "$ITERS" --board 256 \
    2>&1 | tee "$OUT/feeds_ab.txt"
for l in A B; do
    eval dir=\$$l
    echo "==== tail.py --one-node, $l"
    TCPXD_BOARD_SLOTS=256 PYTHONPATH="$dir/python/src" timeout 100 $PY "$HERE/tail.py" --tcpxd "$dir/tcpxd" \
        --iters "$ITERS" --one-node --show 0 > "$OUT/tail-one-$l.txt" 2>&1
    grep -E "^== |one daemon" "$OUT/tail-one-$l.txt"
done
