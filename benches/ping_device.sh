#!/bin/sh
# Session 28, ping, for the 16- or 32-CPU H200 host: issue #39 point 5's notification round trip
# and 4 KiB tight rows, this branch against main, as the host runs by default (runtime.spin on,
# tight loops spinning, board and request ring on), and the daemon-to-daemon leg hop by hop.
#
#   benches/ping_device.sh A B NIXL_SITE [ROUNDS] [ITERS]
#
# A / B: folders with a release `tcpxd` and `python/src` (its C pass built in place): A this
# branch, B main. NIXL_SITE: real NIXL 1.5.1's site folder (`-` leaves step 4 out). PYTHON: the
# interpreter (python3). About 5 minutes at the defaults (1 minute on the 2-core VM at 1 round
# of 200, step 4 left out). Prints, in order:
#   1. benches/board_ab.py, rounds of A S B B S A (S = A with TCPXD_POLLER_SESSIONS=on: a ring's
#      request read, checked and started on the poller's thread; this branch's default since
#      fd6d081, so A and S are alike unless the script runs under TCPXD_POLLER_SESSIONS=off, as
#      A was before: the session-28 figures): the 4 KiB tight / sleep(0)
#      READ, the tight WRITE and the round trip, p50 / p99, A ÷ S and A ÷ B per round;
#   2. the round trip traced, A, B and S, each beside an untraced run of the same daemon:
#      api_legs.py's legs, then benches/notif_hops.py's daemon-to-daemon steps (cmd → header
#      framed → sent → the peer's read → decoded → Done framed → api.notify), the hop events a
#      round trip and the trace's cost an event (traced p50 − untraced p50, ÷ events);
#   3. `TCPXD_SPIN=off` A against B, one round (the poller parks between requests; its linger
#      does not apply): A ÷ B where the change should be nothing;
#   4. beside real NIXL 1.5.1: python -m tcpxd.nixl_compare --impl both with A (UCX_TLS as the
#      script picks it), then --impl tcpxd with S.
set -eu
A=$1
B=$2
NIXL_SITE=$3
ROUNDS=${4:-3}
ITERS=${5:-2000}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
export TCPXD_BOARD_SLOTS=${TCPXD_BOARD_SLOTS:-256}
for d in "$A" "$B"; do
    [ -x "$d/tcpxd" ] || { echo "no tcpxd in $d" >&2; exit 2; }
    [ -f "$d/python/src/tcpxd/__init__.py" ] || { echo "no python/src/tcpxd in $d" >&2; exit 2; }
done
echo "host: $(nproc) CPUs; A=$A B=$B"

echo "== 1. A = this branch, S = A with sessions on the poller, B = main (A S B B S A x $ROUNDS)"
$PY "$HERE/board_ab.py" --after-bin "$A/tcpxd" --after-py "$A/python/src" --before-bin "$B/tcpxd" \
    --before-py "$B/python/src" --variants SB --rounds "$ROUNDS" --iters "$ITERS" --only nixl,notif

p50() { sed -n 's/^notification round trip: .* p50 \([0-9.]*\) µs.*/\1/p' "$1" | head -1; }
legs() { # label dir [env...]
    label=$1; dir=$2; shift 2
    tmp=$(mktemp -d)
    env "$@" PYTHONPATH="$dir/python/src" $PY "$HERE/api_legs.py" --tcpxd "$dir/tcpxd" --only notif \
        --iters "$ITERS" --no-trace > "$tmp/untraced" 2>&1 || true
    env "$@" PYTHONPATH="$dir/python/src" $PY "$HERE/api_legs.py" --tcpxd "$dir/tcpxd" --only notif \
        --iters "$ITERS" --keep > "$tmp/traced" 2>&1 || true
    echo "-- $label: untraced $(p50 "$tmp/untraced") µs, traced:"
    grep -v "^tcpxd " "$tmp/traced" || true
    logs=$(sed -n 's/.*, logs \(.*\)$/\1/p' "$tmp/traced" | head -1)
    if [ -n "$logs" ] && [ -f "$logs/legs-a.log" ]; then
        $PY "$HERE/notif_hops.py" "$logs/legs-a.log" "$logs/legs-b.log" \
            --traced-p50 "$(p50 "$tmp/traced")" --untraced-p50 "$(p50 "$tmp/untraced")" || true
        rm -rf "$logs"
    fi
    rm -rf "$tmp"
}
echo "== 2. the round trip, hop by hop: A, B, S (each: untraced p50, traced legs, daemon-to-daemon steps)"
legs A "$A"
legs B "$B"
legs S "$A" TCPXD_POLLER_SESSIONS=on

echo "== 3. runtime.spin off (TCPXD_SPIN=off): A B B A, one round"
TCPXD_SPIN=off $PY "$HERE/board_ab.py" --after-bin "$A/tcpxd" --after-py "$A/python/src" --before-bin "$B/tcpxd" \
    --before-py "$B/python/src" --variants B --rounds 1 --iters "$ITERS" --only nixl,notif

if [ "$NIXL_SITE" != "-" ]; then
    echo "== 4. beside real NIXL 1.5.1 (A), then tcpxd alone with sessions on the poller (S)"
    env -u UCX_TLS PYTHONPATH="$A/python/src:$NIXL_SITE" $PY -m tcpxd.nixl_compare --impl both --tcpxd "$A/tcpxd" \
        --rounds 2 --small-iters 1000
    TCPXD_POLLER_SESSIONS=on PYTHONPATH="$A/python/src" $PY -m tcpxd.nixl_compare --impl tcpxd --tcpxd "$A/tcpxd" \
        --rounds 1 --small-iters 1000
fi
