#!/bin/sh
# Session 32, rt2, for the 16-CPU H200 host: issue #39 point 5's notification round trip between
# TWO daemons (one per agent), A (this branch) against B (main), and what its client legs are made
# of; `runtime.warm_worker` off (TCPXD_WARM_WORKER=off: the runtime's worker no longer kept awake
# by a yielding task, which keeps both of a spinning daemon's workers busy) against on. Runs, in
# order (~5 minutes; spin on, as the host's auto):
#   1. benches/notif_send.py with A's and B's package: send_notif's and the finding poll's Python
#      alone, no daemon (the client legs' own CPU, against tail.py's `call → posted` below);
#   2. tail.py --rows notif, not recorded, two daemons, the sessions thread on (the host's
#      default): A B B A, twice;
#   3. A with the warm worker off (W) against A, all three rows (4 KiB READ / WRITE tight and the
#      round trip), two daemons then one daemon: W A A W each;
#   4. the sessions thread off (TCPXD_SESSION_THREAD=off), round trip, two daemons: A, W, B;
#      then --pin (the daemons and the agents on separate halves of the CPUs): A, W;
#   5. A and W recorded (TCPXD_HOP_RECORD), two daemons: the legs;
#   6. real NIXL 1.5.1 (nixl_compare --impl nixl), when NIXL_SITE is given.
#
#   benches/rt2_device.sh A B OUT [NIXL_SITE] [ITERS]
#
# A / B: folders with a release `tcpxd` and `python/src` (C pass built). OUT: each run's output
# (the summary is printed). NIXL_SITE: real NIXL's site folder (`-` or none: step 6 left out).
# ITERS: iterations a row and run (3000).
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

summary() { # label file: each row's p50 / p99 / p99.9; for the round trip also the p50s of
            # call → posted, the pong's way back seen, the ping's way seen, the target's send
    printf '%-22s' "$1"
    sed -n 's/^== \([^:]*\): [0-9]* iterations, p50 \([0-9.]*\) µs, p90 [0-9.]*, p99 \([0-9.]*\), p99.9 \([0-9.]*\),.*/\1 \2 \/ \3 \/ \4;/p' "$2" \
        | sed 's/4 KiB \(READ\|WRITE\), tight/\1/; s/notification round trip/rt/' | tr '\n' ' '
    grep -E '^  (call → posted|done ← t:sent|posted → t:seen|t:seen → t:sent)' "$2" | awk '{printf " %s", $(NF-4)}'
    grep -E "threads over" "$2" | grep -o 'tokio-rt-worker [0-9.]*' | awk '{s += $2} END {printf "  [runtime workers %.2f CPU-s]", s}'
    echo
}
run() { # label dir [tail.py args...]
    label=$1; dir=$2; shift 2
    PYTHONPATH="$dir/python/src" timeout 150 $PY "$HERE/tail.py" --tcpxd "$dir/tcpxd" --iters "$ITERS" "$@" \
        > "$OUT/$label.txt" 2>&1
    echo "(rc $?)" >> "$OUT/$label.txt"
    summary "$label" "$OUT/$label.txt"
}

echo "== 2. round trip, two daemons, p50 / p99 / p99.9 µs; the client legs' p50s; the runtime workers' CPU"
for r in 1 2; do
    run "2-$r-A" "$A" --rows notif --show 1
    run "2-$r-B" "$B" --rows notif --show 1
    run "2-$r-B'" "$B" --rows notif --show 1
    run "2-$r-A'" "$A" --rows notif --show 1
done
echo "== 3. the warm worker off (W) against on (A): two daemons, then one"
for node in two one; do
    flag=""; [ $node = one ] && flag="--one-node"
    # shellcheck disable=SC2086
    TCPXD_WARM_WORKER=off run "3-$node-W" "$A" --show 1 $flag
    # shellcheck disable=SC2086
    run "3-$node-A" "$A" --show 1 $flag
    # shellcheck disable=SC2086
    run "3-$node-A'" "$A" --show 1 $flag
    # shellcheck disable=SC2086
    TCPXD_WARM_WORKER=off run "3-$node-W'" "$A" --show 1 $flag
done
echo "== 3b. the gRPC path (tcpxctl bench transfer: the Session RPC, tonic on the runtime) one at a time, A (warm on: 'daemon') against W ('before'), alternating, beside raw"
AABS=$(cd "$A" && pwd)
mkdir -p "$OUT/warmoff"
printf '#!/bin/sh\nTCPXD_WARM_WORKER=off exec %s/tcpxd "$@"\n' "$AABS" > "$OUT/warmoff/tcpxd"
chmod +x "$OUT/warmoff/tcpxd"
(cd "$OUT" && timeout 200 $PY "$HERE/small_latency.py" --bin "$AABS" --bin-before "$OUT/warmoff" --sizes 4K,64K \
    --ops write,read --iters 500 --rounds 2 --out "$OUT/small_latency.jsonl" 2>&1 | tail -8 | tee "$OUT/3b-small_latency.txt")
echo "== 4. the sessions thread off; pinned"
TCPXD_SESSION_THREAD=off run "4-nothread-A" "$A" --rows notif --show 1
TCPXD_SESSION_THREAD=off TCPXD_WARM_WORKER=off run "4-nothread-W" "$A" --rows notif --show 1
TCPXD_SESSION_THREAD=off run "4-nothread-B" "$B" --rows notif --show 1
run "4-pin-A" "$A" --rows notif --show 1 --pin
TCPXD_WARM_WORKER=off run "4-pin-W" "$A" --rows notif --show 1 --pin

echo "== 5. recorded, two daemons: A, W"
run "5-rec-A" "$A" --rows notif --record --show 2
TCPXD_WARM_WORKER=off run "5-rec-W" "$A" --rows notif --record --show 2
for f in "$OUT"/5-rec-A.txt "$OUT"/5-rec-W.txt; do echo "---- $f"; cut -c1-400 "$f"; done

if [ "$NIXL_SITE" != "-" ]; then
    echo "== 6. real NIXL 1.5.1 (nixl_compare --impl nixl, 2 rounds)"
    env -u UCX_TLS PYTHONPATH="$A/python/src:$NIXL_SITE" timeout 240 $PY -m tcpxd.nixl_compare --impl nixl \
        --rounds 2 --small-iters 2000 2>&1 | tee "$OUT/6-nixl.txt" | grep -E -i "round trip|4 KiB|p50" | head -20
fi
