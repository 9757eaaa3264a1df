#!/bin/sh
# Session 32, rt2, for the 16-CPU H200 host: issue #39 point 5's notification round trip between
# TWO daemons (one per agent), A (this branch) against B (main), and what its client legs are made
# of. Runs, in order (~4 minutes):
#   1. benches/notif_send.py with A's and B's package: send_notif's and the finding poll's Python
#      alone, no daemon (the client legs' own CPU, against tail.py's `call → posted` below);
#   2. tail.py --rows notif, not recorded, two daemons, the host's default (spin on, sessions
#      thread on): A B B A, twice (p50 / p99 / p99.9 and the client legs);
#   3. the same, A and B, with the sessions thread off (TCPXD_SESSION_THREAD=off: the framed
#      sessions on the poller), A B B A; then A with the daemons and agents on separate halves of
#      the CPUs (--pin), and one daemon (both agents on it) A B;
#   4. A recorded (TCPXD_HOP_RECORD), two daemons, sessions thread on then off: the legs;
#   5. real NIXL 1.5.1's round trip (nixl_compare --impl nixl), when NIXL_SITE is given.
#
#   benches/rt2_device.sh A B OUT [NIXL_SITE] [ITERS]
#
# A / B: folders with a release `tcpxd` and `python/src` (C pass built). OUT: each run's output
# (the summary is printed). NIXL_SITE: real NIXL's site folder (`-` or none: step 5 left out).
# ITERS: round trips a run (3000).
set -u
A=$1
B=$2
OUT=$3
NIXL_SITE=${4:--}
ITERS=${5:-3000}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
export TCPXD_BOARD_SLOTS=${TCPXD_BOARD_SLOTS:-256}
export TCPXD_SPIN=${TCPXD_SPIN:-on}
mkdir -p "$OUT"
for d in "$A" "$B"; do
    [ -x "$d/tcpxd" ] || { echo "no tcpxd in $d" >&2; exit 2; }
    [ -f "$d/python/src/tcpxd/__init__.py" ] || { echo "no python/src/tcpxd in $d" >&2; exit 2; }
done
echo "host: $(nproc) CPUs; $(lscpu 2>/dev/null | grep -E '^(Thread|Core|Socket|Model name|NUMA node\(s\))' | tr -s ' ' | tr '\n' ';') load: $(cat /proc/loadavg)"

echo "== 1. the client's Python alone (no daemon)"
for l in A B; do
    eval dir=\$$l
    echo "-- $l"
    TCPXD_NIXL_TIGHT_SPIN_US=inf PYTHONPATH="$dir/python/src" timeout 60 $PY "$HERE/notif_send.py" --rounds 5 2>&1 | tail -3
done

summary() { # label file
    printf '%-24s' "$1"
    sed -n 's/^== notification round trip: [0-9]* iterations, p50 \([0-9.]*\) µs, p90 [0-9.]*, p99 \([0-9.]*\), p99.9 \([0-9.]*\),.*/\1 \/ \2 \/ \3;/p' "$2" | tr '\n' ' '
    grep -E '^  (call → posted|done ← t:sent|posted → t:seen|t:seen → t:sent)' "$2" | awk '{printf " %s", $(NF-4)}'
    echo
}
run() { # label dir [tail.py args...]
    label=$1; dir=$2; shift 2
    PYTHONPATH="$dir/python/src" timeout 120 $PY "$HERE/tail.py" --tcpxd "$dir/tcpxd" --iters "$ITERS" --rows notif \
        "$@" > "$OUT/$label.txt" 2>&1
    echo "(rc $?)" >> "$OUT/$label.txt"
    summary "$label" "$OUT/$label.txt"
}

echo "== 2-3. round trip p50 / p99 / p99.9 µs; then the p50s of: call → posted, the pong's way back seen, the ping's way seen, the target's send"
export TCPXD_SESSION_THREAD=on
for r in 1 2; do
    run "2-$r-A" "$A" --show 1
    run "2-$r-B" "$B" --show 1
    run "2-$r-B'" "$B" --show 1
    run "2-$r-A'" "$A" --show 1
done
export TCPXD_SESSION_THREAD=off
run "3-nothread-A" "$A" --show 1
run "3-nothread-B" "$B" --show 1
run "3-nothread-B'" "$B" --show 1
run "3-nothread-A'" "$A" --show 1
export TCPXD_SESSION_THREAD=on
run "3-pin-A" "$A" --show 1 --pin
run "3-one-A" "$A" --show 1 --one-node
run "3-one-B" "$B" --show 1 --one-node

echo "== 4. A recorded, two daemons: sessions thread on, off"
run "4-rec-A" "$A" --record --show 2
TCPXD_SESSION_THREAD=off run "4-rec-A-nothread" "$A" --record --show 2
for f in "$OUT"/4-rec-A.txt "$OUT"/4-rec-A-nothread.txt; do echo "---- $f"; cut -c1-400 "$f"; done

if [ "$NIXL_SITE" != "-" ]; then
    echo "== 5. real NIXL 1.5.1 (nixl_compare --impl nixl, 2 rounds)"
    env -u UCX_TLS PYTHONPATH="$A/python/src:$NIXL_SITE" timeout 200 $PY -m tcpxd.nixl_compare --impl nixl \
        --rounds 2 --small-iters 2000 2>&1 | tee "$OUT/5-nixl.txt" | grep -E -i "round trip|4 KiB|p50" | head -20
fi
