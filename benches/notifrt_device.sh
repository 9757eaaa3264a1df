#!/bin/sh
# Session 26, notifrt, for the 16-core H200 host: the notification round trip with this branch
# against main, as the host runs by default (runtime.spin on, tight loops spinning, the feed's
# board with notification slots).
#
#   [BEFORE_BIN=DIR] benches/notifrt_device.sh BIN BEFORE_PY [ROUNDS] [ITERS]
#
# BIN: a folder with this branch's release tcpxd; BEFORE_PY: main's python/src before notifrt
# (e.g. `git archive 59ff339 python/src | tar -x -C bench-main`), its C pass built in place as this
# tree's: (cd python && python3 setup.py build_ext --inplace). BEFORE_BIN: a folder with main's
# release tcpxd for B (default BIN: then A and B differ by the package alone; the branch's daemon
# change is the engine's start of a one-entry WRITE, a µs or less).
# About 4 minutes at the defaults. Prints, in order:
#   1. get_new_notifs' own cost, no daemon (benches/notif_python.py), after then before;
#   2. A B B A rounds of api_legs.py --no-trace --only notif,nixl (benches/board_ab.py --no-off):
#      the round trip's p50 / p99 per package and the A ÷ B ratio per round;
#   3. one traced run of this package (the legs: the call → api.in, the daemons, the feed);
#   4. beside real NIXL (python -m tcpxd.nixl_compare --impl both; PYTHON=NIXL's venv's python3).
set -eu
BIN=$1
BEFORE_PY=$2
ROUNDS=${3:-3}
ITERS=${4:-1000}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
PY=${PYTHON:-python3}

echo "== 1. get_new_notifs without a daemon: after, then before"
PYTHONPATH=$ROOT/python/src $PY "$HERE/notif_python.py" --rounds 5
PYTHONPATH=$BEFORE_PY $PY "$HERE/notif_python.py" --rounds 5

BEFORE_BIN=${BEFORE_BIN:-$BIN}
echo "== 2. A = this branch, B = main's package (daemon $BEFORE_BIN/tcpxd); A B B A x $ROUNDS"
$PY "$HERE/board_ab.py" --after-bin "$BIN/tcpxd" --before-bin "$BEFORE_BIN/tcpxd" --before-py "$BEFORE_PY" \
    --rounds "$ROUNDS" --iters "$ITERS" --only notif,nixl --no-off

echo "== 3. the legs, traced (this package)"
PYTHONPATH=$ROOT/python/src $PY "$HERE/api_legs.py" --tcpxd "$BIN/tcpxd" --only notif --iters "$ITERS"

echo "== 4. beside NIXL (tcpxd.nixl alone where nixl is not importable: run it in NIXL's venv)"
PYTHONPATH=$ROOT/python/src $PY -m tcpxd.nixl_compare --impl both --tcpxd "$BIN/tcpxd" --rounds 2
