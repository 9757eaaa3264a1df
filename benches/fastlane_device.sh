#!/usr/bin/env bash
# Session 24 (fastlane): the framed sessions' requests read on the poller's thread
# (`runtime.poller_sessions`), measured on a host with CPUs to spin (the H200 host: 16 CPUs,
# `runtime.spin` auto = on), as a user sees it and hop by hop:
#
#   benches/fastlane_device.sh AFTER_BIN_DIR BEFORE_BIN_DIR
#
# AFTER_BIN_DIR / BEFORE_BIN_DIR: directories with a release `tcpxd` (this tree's; main's before
# the session, e.g. /work/before-s24). The client package is this tree's (python/src) for every
# run, so only the daemon differs. Three daemons, in ABBA order:
#   A  AFTER's tcpxd with TCPXD_POLLER_SESSIONS=on (what `auto` gives where `runtime.spin` is on)
#   O  AFTER's tcpxd with TCPXD_POLLER_SESSIONS=off (this change alone, the rest of the tree kept)
#   B  BEFORE's tcpxd
#   1. benches/api_legs.py --no-trace --only notif,read,write,nixl: rounds A O B B O A (p50 / p99
#      of each call as a user sees it; the summary prints each label's runs and their median).
#   2. the same traced (RUST_LOG=tcpxd::hop=trace) A B B A: where the µs of each leg go.
#   3. the daemons' part of a traced 4 KiB READ hop by hop (benches/hops.py), A then B: where one
#      control message's way between the two pollers goes (issue #39's 22-23 µs legs).
#   4. python -m tcpxd.nixl_compare --impl tcpxd with A (the issue's table, tcpxd's side).
# ITERS (default 400) calls per kind a run; PYTHON (default python3) with the package's
# dependencies (grpcio, numpy). Takes under 3 minutes on the H200 host (35 s at ITERS=50 on the
# 2-core VM). BEFORE's daemon ignores TCPXD_POLLER_SESSIONS (it has no such key).
set -euo pipefail
if [ $# -lt 2 ] || [ ! -x "$1/tcpxd" ] || [ ! -x "$2/tcpxd" ]; then
  echo "usage: $0 AFTER_BIN_DIR BEFORE_BIN_DIR  (each with a release tcpxd)" >&2
  exit 2
fi
here="$(cd "$(dirname "$0")/.." && pwd)"
after="$(cd "$1" && pwd)/tcpxd"
before="$(cd "$2" && pwd)/tcpxd"
iters="${ITERS:-400}"
export PYTHONPATH="$here/python/src${PYTHONPATH:+:$PYTHONPATH}"
py="${PYTHON:-python3}"
out="$(mktemp -d)"
echo "host: $(nproc) CPUs; after: $after; before: $before; iters $iters; raw output in $out"

# One api_legs run: label, daemon, extra env (k=v or -), then api_legs arguments.
legs() {
  local label="$1" daemon="$2" envset="$3"
  shift 3
  local f="$out/$label.$(date +%s%N).txt"
  echo "-- $label ($daemon${envset:+, $envset})"
  if [ "$envset" = "-" ]; then
    timeout 120 "$py" "$here/benches/api_legs.py" --tcpxd "$daemon" --iters "$iters" "$@" >"$f" 2>&1 || true
  else
    env "$envset" timeout 120 "$py" "$here/benches/api_legs.py" --tcpxd "$daemon" --iters "$iters" "$@" >"$f" 2>&1 || true
  fi
  grep -E "calls, p50|Traceback|Error" "$f" | sed "s/^/   /" || true
}

echo "== 1. untraced, A O B B O A"
for label in A O B B O A; do
  case $label in
    A) legs A "$after" TCPXD_POLLER_SESSIONS=on --no-trace --only notif,read,write,nixl ;;
    O) legs O "$after" TCPXD_POLLER_SESSIONS=off --no-trace --only notif,read,write,nixl ;;
    B) legs B "$before" - --no-trace --only notif,read,write,nixl ;;
  esac
done

echo "== 1. summary: p50 / p99 µs of each run, then the median of the runs' p50"
for label in A O B; do
  cat "$out"/$label.*.txt 2>/dev/null | grep "calls, p50" |
    sed -E 's/^(.*): [0-9]+ calls, p50 ([0-9]+) µs, p90 [0-9]+, p99 ([0-9]+).*/\1|\2|\3/' |
    awk -F'|' -v L="$label" '{ p50[$1] = p50[$1] " " $2; p99[$1] = p99[$1] " " $3; n[$1]++; v[$1, n[$1]] = $2 }
      END { for (k in n) { m = n[k]; for (i = 1; i <= m; i++) a[i] = v[k, i];
              for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
              med = (m % 2) ? a[(m + 1) / 2] : (a[m / 2] + a[m / 2 + 1]) / 2;
              printf "   %s %-32s p50:%s  p99:%s  median p50 %s\n", L, k, p50[k], p99[k], med } }' | sort
done

echo "== 2. traced (RUST_LOG=tcpxd::hop=trace), A B B A: the legs"
for label in A B B A; do
  daemon="$after"
  [ "$label" = B ] && daemon="$before"
  f="$out/traced-$label.$(date +%s%N).txt"
  echo "-- traced $label"
  TCPXD_POLLER_SESSIONS=on timeout 150 "$py" "$here/benches/api_legs.py" --tcpxd "$daemon" --iters "$iters" \
    --only notif,read,nixl >"$f" 2>&1 || true
  grep -vE "^tcpxd |^\s*$" "$f" | sed "s/^/   /" || true
done

echo "== 3. the daemons' part of a 4 KiB Client.read hop by hop (benches/hops.py on the traced logs:"
echo "   a's poller.out -> b's wire.in is one control message's way between the pollers), A then B"
for label in A B; do
  daemon="$after"
  [ "$label" = B ] && daemon="$before"
  f="$out/hops-$label.txt"
  TCPXD_POLLER_SESSIONS=on timeout 150 "$py" "$here/benches/api_legs.py" --tcpxd "$daemon" --iters "$iters" \
    --only read --keep >"$f" 2>&1 || true
  logs="$(sed -n 's/.*, logs \(\S*\)$/\1/p' "$f" | tail -1)"
  echo "-- hops $label (logs in $logs)"
  if [ -n "$logs" ] && [ -f "$logs/legs-a.log" ]; then
    "$py" "$here/benches/hops.py" "$logs/legs-a.log" "$logs/legs-b.log" 2>&1 | sed "s/^/   /" || true
  fi
done

echo "== 4. python -m tcpxd.nixl_compare --impl tcpxd (A)"
(cd "$here" && TCPXD_POLLER_SESSIONS=on timeout 120 "$py" -m tcpxd.nixl_compare --impl tcpxd --tcpxd "$after" --rounds 2 2>&1 | tail -25) || true
echo "raw output: $out"
