#!/bin/sh
# Session 33, rt3, for the 16-CPU H200 host: issue #39 point 5's notification round trip between
# TWO daemons (one per agent), A (this branch) against B (main), beside real NIXL. Runs, in order
# (~4 minutes; spin on and the sessions thread on, as the host's auto; board 256):
#   1. benches/notif_send.py with A's and B's package: send_notif's and the finding poll's Python
#      alone, no daemon (A writes send_notif's request into the ring's slot in C);
#   2. tail.py --rows notif, not recorded: A B B A, twice (p50 / p99 / p99.9; the client legs);
#   3. the package and the daemon apart: A's package on B's daemon (P), B's package on A's
#      daemon (D), P D D P;
#   4. recorded (TCPXD_HOP_RECORD): A, B (each leg's p50);
#   5. real NIXL 1.5.1 (nixl_compare --impl nixl), when NIXL_SITE is given.
#
#   sh benches/rt3_device.sh A B OUT [NIXL_SITE] [ITERS]
#
# A / B: folders with a release `tcpxd` and `python/src` (C pass built). OUT: each run's output
# (the summary is printed). NIXL_SITE: real NIXL's site folder (`-` or none: step 5 left out).
# ITERS: iterations a run (3000).
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
export TCPXD_SESSION_THREAD=on
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
    TCPXD_NIXL_TIGHT_SPIN_US=inf PYTHONPATH="$dir/python/src" timeout 60 $PY "$HERE/notif_send.py" --rounds 5 2>&1 \
        | tail -3 | tee "$OUT/1-notif_send-$l.txt"
done

summary() { # label file: p50 / p99 / p99.9; the p50s of call → posted, the pong's way back seen,
            # the ping's way seen, the target's send
    printf '%-14s' "$1"
    sed -n 's/^== \([^:]*\): [0-9]* iterations, p50 \([0-9.]*\) µs, p90 [0-9.]*, p99 \([0-9.]*\), p99.9 \([0-9.]*\),.*/\2 \/ \3 \/ \4;/p' "$2" | tr '\n' ' '
    grep -E '^  (call → posted|done ← t:sent|posted → t:seen|t:seen → t:sent)' "$2" | awk '{printf " %s", $(NF-4)}'
    echo
}
run() { # label daemon-dir package-dir [tail.py args...]
    label=$1; dd=$2; pd=$3; shift 3
    PYTHONPATH="$pd/python/src" timeout 150 $PY "$HERE/tail.py" --tcpxd "$dd/tcpxd" --iters "$ITERS" --rows notif "$@" \
        > "$OUT/$label.txt" 2>&1
    echo "(rc $?)" >> "$OUT/$label.txt"
    summary "$label" "$OUT/$label.txt"
}

echo "== 2. round trip, two daemons: p50 / p99 / p99.9 µs; p50s of call → posted, pong back seen, ping seen, target's send"
for r in 1 2; do
    run "2-$r-A" "$A" "$A" --show 1
    run "2-$r-B" "$B" "$B" --show 1
    run "2-$r-B'" "$B" "$B" --show 1
    run "2-$r-A'" "$A" "$A" --show 1
done
echo "== 3. the package apart from the daemon: P = A's package on B's daemon, D = B's package on A's daemon"
run "3-P" "$B" "$A" --show 1
run "3-D" "$A" "$B" --show 1
run "3-D'" "$A" "$B" --show 1
run "3-P'" "$B" "$A" --show 1

echo "== 4. recorded, two daemons: A, B"
run "4-rec-A" "$A" "$A" --record --show 2
run "4-rec-B" "$B" "$B" --record --show 2
for f in "$OUT"/4-rec-A.txt "$OUT"/4-rec-B.txt; do echo "---- $f"; grep -E '→ .* p50' "$f" | cut -c1-110 | head -50; done

if [ "$NIXL_SITE" != "-" ]; then
    echo "== 5. real NIXL 1.5.1 (nixl_compare --impl nixl, 2 rounds)"
    env -u UCX_TLS PYTHONPATH="$A/python/src:$NIXL_SITE" timeout 240 $PY -m tcpxd.nixl_compare --impl nixl \
        --rounds 2 --small-iters 2000 2>&1 | tee "$OUT/5-nixl.txt" | grep -E -i "round trip|4 KiB|p50" | head -20
fi
