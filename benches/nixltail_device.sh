#!/bin/sh
# Session 27, nixltail, for the 16- or 32-CPU H200 host: issue #39 point 5's small rows (the 4 KiB
# tight loop's p99, the notification round trip) with this branch's package against main's, as the
# host runs by default (runtime.spin on, tight loops spinning, board and request ring on).
#
#   benches/nixltail_device.sh BIN BEFORE_PY NIXL_SITE [ROUNDS] [ITERS]
#
# BIN: a folder with the release tcpxd (this branch's daemon is main's: the branch changes the
# package only); BEFORE_PY: main's python/src (7a2dcbe), its C pass built in place as this tree's
# must be too: (cd python && python3 setup.py build_ext --inplace); NIXL_SITE: the site folder of
# the NIXL 1.5.1 wheel (real NIXL; `-` to leave step 5 out). About 8 minutes at the defaults.
# Prints, in order:
#   1. benches/poll_stalls.py A B B A: a tight Session.poll loop of 4 KiB same-node WRITEs, the
#      reader thread's GIL takes a second (A: ~0 expected, B: ~500) and the WRITE's p50/p99/p99.9;
#   2. benches/board_ab.py, A = this package, S = A with TCPXD_POLLER_SESSIONS=on (the ring's
#      requests started on the poller's thread, no runtime worker), B = main's package; rounds of
#      A S B B S A: the tight READ / WRITE and the round trip, p50 / p99, A÷S and A÷B per round;
#   3. the traced legs with the tail (api_legs.py --tail 3): each leg's p50 beside its median
#      over the slowest 1%, and the 3 slowest calls' timelines (both daemons' hops) — read which
#      leg the slow ones share: a structural tail is one leg, alike in each;
#   4. the same traced legs with TCPXD_POLLER_SESSIONS=on;
#   5. beside real NIXL: python -m tcpxd.nixl_compare --impl both (UCX_TLS picked by the script:
#      tcp,cuda_copy where a GPU is visible), then --impl tcpxd with TCPXD_POLLER_SESSIONS=on.
set -eu
BIN=$1
BEFORE_PY=$2
NIXL_SITE=$3
ROUNDS=${4:-3}
ITERS=${5:-2000}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
PY=${PYTHON:-python3}
AFTER_PY=$ROOT/python/src
export TCPXD_BOARD_SLOTS=${TCPXD_BOARD_SLOTS:-256}
[ -f "$BEFORE_PY/tcpxd/__init__.py" ] || { echo "BEFORE_PY: no tcpxd package under $BEFORE_PY" >&2; exit 2; }

echo "== 1. a tight Session.poll loop: A = this package, B = main's (A B B A x $ROUNDS)"
$PY "$HERE/poll_stalls.py" --tcpxd "$BIN/tcpxd" --after-py "$AFTER_PY" --before-py "$BEFORE_PY" \
    --rounds "$ROUNDS" --seconds 4

echo "== 2. A = this package, S = sessions on the poller, B = main's package (A S B B S A x $ROUNDS)"
$PY "$HERE/board_ab.py" --after-bin "$BIN/tcpxd" --before-bin "$BIN/tcpxd" --before-py "$BEFORE_PY" \
    --variants SB --rounds "$ROUNDS" --iters "$ITERS" --only nixl,notif

echo "== 3. the legs, traced, with the slowest 1% (this package)"
PYTHONPATH=$AFTER_PY $PY "$HERE/api_legs.py" --tcpxd "$BIN/tcpxd" --only nixl,notif --iters "$ITERS" --tail 3

echo "== 4. the same with TCPXD_POLLER_SESSIONS=on"
TCPXD_POLLER_SESSIONS=on PYTHONPATH=$AFTER_PY $PY "$HERE/api_legs.py" --tcpxd "$BIN/tcpxd" --only nixl,notif \
    --iters "$ITERS" --tail 3

if [ "$NIXL_SITE" != "-" ]; then
    echo "== 5. beside real NIXL 1.5.1 (UCX_TLS as nixl_compare picks it), then tcpxd with sessions on the poller"
    env -u UCX_TLS PYTHONPATH="$AFTER_PY:$NIXL_SITE" $PY -m tcpxd.nixl_compare --impl both --tcpxd "$BIN/tcpxd" \
        --rounds 2 --small-iters 1000
    TCPXD_POLLER_SESSIONS=on PYTHONPATH="$AFTER_PY" $PY -m tcpxd.nixl_compare --impl tcpxd --tcpxd "$BIN/tcpxd" \
        --rounds 2 --small-iters 1000
fi
