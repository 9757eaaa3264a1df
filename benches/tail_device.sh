#!/bin/sh
# Session 31, tail, for the 16-CPU H200 host: where the slowest 1% of issue #39 point 5's small
# rows go (the 4 KiB READ / WRITE polled tight, the notification round trip), iteration by
# iteration, with benches/tail.py: each iteration's client facts (the GC inside it, the polling
# thread switched out, its longest gap between polls) and, recorded in the daemons' memory
# (TCPXD_HOP_RECORD, no write on the daemon's path), both daemons' hop events placed in it: which leg grew in
# each slow iteration, and the slowest ones' timelines.
#
#   benches/tail_device.sh A B OUT [ITERS]
#
# A / B: folders with a release `tcpxd` and `python/src` (C pass built): A this branch, B main
# (B's daemon has no recorder: its runs are the client's view only). OUT: where each run's
# output goes (also printed). ITERS: iterations a row (5000). About 4 minutes. Runs, in order:
#   1. A recorded, two daemons, then one daemon (both agents on it), the sessions thread on and
#      spin on (the host's default: TCPXD_SESSION_THREAD=on TCPXD_SPIN=on); then A's daemon
#      with B's package (main's client: the GC's share before this branch);
#   2. the same with the sessions thread off (TCPXD_SESSION_THREAD=off);
#   3. not recorded (the tail as a user sees it), two daemons then one: A, B, A with the GC off
#      in both agents, A with gc.freeze() after set-up, A with the daemons on half the CPUs and
#      the agents on the other half (--pin), A's daemon with B's package (Adaemon: the daemon's
#      share of A ÷ B); then A and B once more (the order's effect);
#   4. the host: CPUs, threads a core, the governor, the kernel's tick.
set -u
A=$1
B=$2
OUT=$3
ITERS=${4:-5000}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
export TCPXD_BOARD_SLOTS=${TCPXD_BOARD_SLOTS:-256}
mkdir -p "$OUT"
for d in "$A" "$B"; do
    [ -x "$d/tcpxd" ] || { echo "no tcpxd in $d" >&2; exit 2; }
    [ -f "$d/python/src/tcpxd/__init__.py" ] || { echo "no python/src/tcpxd in $d" >&2; exit 2; }
done

run() { # label daemon-dir package-dir [tail.py args...] (environment from the caller)
    label=$1; dir=$2; pydir=$3; shift 3
    echo "==== $label"
    PYTHONPATH="$pydir/python/src" timeout 120 $PY "$HERE/tail.py" --tcpxd "$dir/tcpxd" --iters "$ITERS" "$@" \
        > "$OUT/$label.txt" 2>&1
    echo "(rc $?)" >> "$OUT/$label.txt"
    cat "$OUT/$label.txt"
}

echo "host: $(nproc) CPUs; $(lscpu 2>/dev/null | grep -E '^(Thread|Core|Model name)' | tr -s ' ' | tr '\n' ';')"
echo "governor: $(cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>/dev/null || echo '?');" \
    "tick: $(grep -m1 -E '^CONFIG_HZ=' /boot/config-"$(uname -r)" 2>/dev/null || echo '?'); load: $(cat /proc/loadavg)"

export TCPXD_SPIN=on
export TCPXD_SESSION_THREAD=on
run 1a-A-rec-two "$A" "$A" --record --show 4
run 1b-A-rec-one "$A" "$A" --record --show 4 --one-node
run 1c-Bpy-rec-two "$A" "$B" --record --show 3
run 1d-Bpy-rec-one "$A" "$B" --record --show 3 --one-node
TCPXD_SESSION_THREAD=off run 2a-A-rec-two-nothread "$A" "$A" --record --show 3
TCPXD_SESSION_THREAD=off run 2b-A-rec-one-nothread "$A" "$A" --record --show 3 --one-node

echo "==== 3. not recorded: p50 / p99 / p99.9 of each row (µs)"
summary() { # label file
    printf '%-22s' "$1"
    sed -n 's/^== \([^:]*\): [0-9]* iterations, p50 \([0-9.]*\) µs, p90 [0-9.]*, p99 \([0-9.]*\), p99.9 \([0-9.]*\),.*/\1 \2 \/ \3 \/ \4;/p' "$2" | tr '\n' ' '
    echo
}
for node in two one; do
    flag=""; [ $node = one ] && flag="--one-node"
    for v in A B Adaemon Agcoff Afreeze Apin A2 B2; do
        py=""
        case $v in
            A|A2) dir=$A; extra="" ;;
            Apin) dir=$A; extra="--pin" ;;
            B|B2) dir=$B; extra="" ;;
            Adaemon) dir=$A; py=$B; extra="" ;;
            Agcoff) dir=$A; extra="--gc off" ;;
            Afreeze) dir=$A; extra="--gc freeze" ;;
        esac
        [ -n "$py" ] || py=$dir
        # shellcheck disable=SC2086
        PYTHONPATH="$py/python/src" timeout 120 $PY "$HERE/tail.py" --tcpxd "$dir/tcpxd" --iters "$ITERS" \
            --show 2 $flag $extra > "$OUT/3-$node-$v.txt" 2>&1
        summary "$node $v" "$OUT/3-$node-$v.txt"
    done
done
for f in "$OUT"/3-*.txt; do echo "---- $f"; cat "$f"; done
