#!/usr/bin/env python3
"""Where the slowest 1% of small operations go (session 31, tail; issue #39 point 5): the 4 KiB
READ and WRITE polled tight and the notification round trip, as `python -m tcpxd.nixl_compare`
runs them (tcpxd.nixl, prepared lists, `check_xfer_state` / `get_new_notifs` in a loop without a
pause), each iteration recorded on its own:

- the client's side, cheaply (every iteration): the call → posted (`transfer` / `send_notif`
  returned) → done stamps on the wall clock, the polls made and the longest gap between two
  (the polling thread off the CPU, or the GIL elsewhere), the µs the Python GC ran inside it
  (`gc.callbacks`), and the polling thread's voluntary / involuntary context switches across
  it (`getrusage(RUSAGE_THREAD)`); for the round trip the target process's the same (its poll
  for the ping, its `send_notif`);
- with `--record`, the daemons' hop events (`TCPXD_HOP_RECORD`, src/hop_record.rs: kept in
  memory, no `write` on the thread that made it: ~1 µs an event on the H200 host, read the legs,
  not the recorded totals) — each iteration's events of both
  daemons (one with `--one-node`) placed in its window, in order, each step between two
  consecutive points (`a:api.in → a:poller.cmd`, `a:poller.flush → b:poller.read`, ...) a leg.

Then, per row: p50 / p99 / p99.9; over the slowest 1% (by total) against all: how many ran the GC
inside and its µs, how many were switched out (involuntarily / voluntarily), the longest poll
gap; the steps' p50 over all beside their median over the slowest 1%, and for each slow
iteration the step that grew most over its p50 (counted: where the tail is made); the gaps
between consecutive slow iterations (a timer shows as a period); the `--show` slowest
iterations' timelines (every point, µs from the call, with its thread and pass).

`--gc off` disables the collector in both agents during the rows (`freeze`: `gc.freeze()` after
set-up, the collector on): whether the GC is what the tail is made of.

    PYTHONPATH=python/src python3 benches/tail.py --tcpxd target/release/tcpxd --record --iters 2000
    PYTHONPATH=python/src python3 benches/tail.py --tcpxd target/release/tcpxd --one-node --gc off
"""

from __future__ import annotations

import argparse
import array
import ctypes
import gc
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hops  # noqa: E402

SMALL = 4096
WARMUP = 50


class GcClock:
    """The ns the collector ran (gc.callbacks), and the highest generation collected."""

    def __init__(self) -> None:
        self.ns = 0
        self.gen = -1
        self._t = 0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: Dict[str, int]) -> None:
        if phase == "start":
            self._t = time.perf_counter_ns()
        else:
            self.ns += time.perf_counter_ns() - self._t
            self.gen = max(self.gen, info.get("generation", 0))


def _gc_mode(mode: str) -> None:
    if mode == "off":
        gc.disable()
    elif mode == "freeze":
        gc.collect()
        gc.freeze()


def _csw() -> Tuple[int, int]:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_nvcsw, r.ru_nivcsw


def _agent(name: str, endpoint: str) -> Any:
    os.environ["TCPXD_ENDPOINT"] = endpoint
    from tcpxd.nixl import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def target_main(endpoint: str, conn: Any, gc_mode: str) -> None:
    from tcpxd.nixl import _utils

    agent = _agent("target", endpoint)
    addr = _utils.malloc_passthru(1 << 20)
    mem = (ctypes.c_uint8 * (1 << 20)).from_address(addr)
    ctypes.memmove(mem, os.urandom(1 << 20), 1 << 20)
    agent.register_memory(agent.get_reg_descs([(addr, 1 << 20, 0, "")], "DRAM"))
    conn.send((agent.get_agent_metadata(), addr))
    agent.add_remote_agent(conn.recv())
    clock = GcClock()
    while True:
        cmd = conn.recv()
        if cmd[0] == "pong":  # answer cmd[1] pings polling tight, each one's facts recorded
            _gc_mode(gc_mode)
            rows = array.array("q")
            tns = time.time_ns
            for _ in range(cmd[1]):
                g0, (v0, i0) = clock.ns, _csw()
                polls, maxgap = 0, 0
                last = tns()
                while True:
                    got = agent.get_new_notifs().get("initiator")
                    now = tns()
                    polls += 1
                    if now - last > maxgap:
                        maxgap = now - last
                    last = now
                    if got:
                        break
                agent.send_notif("initiator", b"pong")
                sent = tns()
                v1, i1 = _csw()
                rows.extend((now, sent, polls, maxgap, clock.ns - g0, v1 - v0, i1 - i0))
            gc.enable()
            gc.unfreeze()
            conn.send([tuple(rows[j:j + 7]) for j in range(0, len(rows), 7)])
        elif cmd[0] == "checksum":
            conn.send(bytes(mem[: cmd[1]]))
        else:
            break
    agent.close()
    conn.send("bye")


def initiator_main(endpoint: str, conn: Any, out: Any, rows: List[str], iters: int, gc_mode: str) -> None:
    from tcpxd.nixl import _utils

    agent = _agent("initiator", endpoint)
    tmd, taddr = conn.recv()
    addr = _utils.malloc_passthru(1 << 20)
    agent.register_memory(agent.get_reg_descs([(addr, 1 << 20, 0, "")], "DRAM"))
    agent.add_remote_agent(tmd)
    conn.send(agent.get_agent_metadata())
    sl = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(addr, SMALL, 0)], "DRAM")
    sr = agent.prep_xfer_dlist("target", [(taddr, SMALL, 0)], "DRAM")
    clock = GcClock()
    tns = time.time_ns
    res: Dict[str, Any] = {}
    n = iters + WARMUP
    for row in rows:
        _gc_mode(gc_mode)
        # Flat, 8 ints an iteration: no object a record for the GC to count (a tuple each
        # would start a collection every 700 iterations of its own).
        recs = array.array("q")
        if row in ("read", "write"):
            op = row.upper()
            for _ in range(n):
                g0, (v0, i0) = clock.ns, _csw()
                t0 = tns()
                h = agent.make_prepped_xfer(op, sl, [0], sr, [0])
                agent.transfer(h)
                posted = tns()
                polls, maxgap, last = 0, 0, posted
                while True:
                    st = agent.check_xfer_state(h)
                    now = tns()
                    polls += 1
                    if now - last > maxgap:
                        maxgap = now - last
                    last = now
                    if st == "DONE":
                        break
                    if st != "PROC":
                        raise RuntimeError(f"the {op} ended in {st}")
                agent.release_xfer_handle(h)
                v1, i1 = _csw()
                recs.extend((t0, posted, now, polls, maxgap, clock.ns - g0, v1 - v0, i1 - i0))
        else:
            conn.send(("pong", n))
            for _ in range(n):
                g0, (v0, i0) = clock.ns, _csw()
                t0 = tns()
                agent.send_notif("target", b"ping")
                posted = tns()
                polls, maxgap, last = 0, 0, posted
                while True:
                    got = agent.get_new_notifs().get("target")
                    now = tns()
                    polls += 1
                    if now - last > maxgap:
                        maxgap = now - last
                    last = now
                    if got:
                        break
                v1, i1 = _csw()
                recs.extend((t0, posted, now, polls, maxgap, clock.ns - g0, v1 - v0, i1 - i0))
            res["notif target"] = conn.recv()
        gc.enable()
        gc.unfreeze()
        res[row] = [tuple(recs[j:j + 8]) for j in range(0, len(recs), 8)]
    if "read" in rows:
        mine = bytes((ctypes.c_uint8 * SMALL).from_address(addr))
        conn.send(("checksum", SMALL))
        if conn.recv() != mine:
            raise RuntimeError("the 4 KiB READ's bytes differ")
    conn.send(("quit",))
    conn.recv()
    agent.release_dlist_handle(sl)
    agent.release_dlist_handle(sr)
    agent.close()
    out.send(res)


def pct(xs: List[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] if s else float("nan")


def med(xs: List[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def timeline(rec: Tuple, target: Any, events: List[Tuple[float, Dict[str, str]]], times: List[float]) -> List[Tuple[str, float, str]]:
    """(point, µs, where) of one iteration, in order: the client's stamps, the target's, and
    each daemon event in its window (a hop seen again in it numbered: `a:poller.read#2`)."""
    import bisect

    t0, posted, done = rec[0] / 1e3, rec[1] / 1e3, rec[2] / 1e3
    pts = [("call", t0, ""), ("posted", posted, ""), ("done", done, "")]
    if target is not None:
        pts += [("t:seen", target[0] / 1e3, ""), ("t:sent", target[1] / 1e3, "")]
    lo, hi = bisect.bisect_left(times, t0), bisect.bisect_right(times, done)
    seen: Dict[str, int] = {}
    # Nothing this iteration asked for happens before daemon a took its request (`api.in`; a
    # notification alone on one daemon: `api.notify`, delivered at once): events before it are
    # the previous iteration's last (a `Done` read late, an answer's event), named apart.
    first = next((t for t, f in events[lo:hi] if f["node"] == "a" and f.get("hop") in ("api.in", "api.notify")), None)
    for t, f in events[lo:hi]:
        key = f"{f['node']}:{f.get('hop', '?')}"
        if first is not None and t < first:
            key = "prev " + key
        k = seen.get(key, 0) + 1
        seen[key] = k
        where = f.get("thread", "")
        if "pass" in f:
            where += f" p{f['pass']}"
        pts.append((key if k == 1 else f"{key}#{k}", t, where))
    pts.sort(key=lambda p: p[1])
    return pts


def analyse(name: str, recs: List[Tuple], targets: List[Tuple] | None, events: List, slow_frac: float, show: int) -> None:
    recs = recs[WARMUP:]
    if targets is not None:
        targets = targets[WARMUP:]
    tot = [(r[2] - r[0]) / 1e3 for r in recs]
    n = len(recs)
    order = sorted(range(n), key=lambda i: tot[i])
    k = max(1, int(round(n * slow_frac)))
    slow = order[-k:]
    print(f"\n== {name}: {n} iterations, p50 {pct(tot, 50):.1f} µs, p90 {pct(tot, 90):.1f}, p99 {pct(tot, 99):.1f}, "
          f"p99.9 {pct(tot, 99.9):.1f}, max {max(tot):.0f}; the slowest {k} from {tot[slow[0]]:.1f} µs")

    def facts(who: str, rows: List[Tuple], at: int) -> None:
        # rows: (.., polls, maxgap, gc_ns, nvcsw, nivcsw) from index `at`
        def line(ix: List[int], label: str) -> str:
            gcs = [rows[i][at + 2] / 1e3 for i in ix]
            with_gc = [g for g in gcs if g > 0]
            vol = sum(1 for i in ix if rows[i][at + 3] > 0)
            inv = sum(1 for i in ix if rows[i][at + 4] > 0)
            gaps = [rows[i][at + 1] / 1e3 for i in ix]
            return (f"    {label:9} GC ran in {len(with_gc) / len(ix):6.1%} (median {med(with_gc):6.1f} µs when it did); "
                    f"switched out: involuntarily {inv / len(ix):6.1%}, voluntarily {vol / len(ix):6.1%}; "
                    f"longest poll gap p50 {med(gaps):6.1f} µs; polls p50 {med([rows[i][at] for i in ix]):.0f}")

        print(f"  {who}:")
        print(line(list(range(n)), "all"))
        print(line(slow, "slowest"))

    facts("the initiator (its call and polls)", recs, 3)
    if targets is not None:
        facts("the target (its poll for the ping, its send_notif)", targets, 2)
    # Periodicity: the gaps between consecutive slow iterations (ms).
    starts = sorted(recs[i][0] / 1e6 for i in slow)
    if len(starts) > 2:
        d = [b - a for a, b in zip(starts, starts[1:])]
        print(f"  between slow iterations: ms p10 {pct(d, 10):.2f}, p50 {pct(d, 50):.2f}, p90 {pct(d, 90):.2f} "
              f"(run {(recs[-1][2] - recs[0][0]) / 1e6:.0f} ms)")
    # The client's own legs.
    legs = {"call → posted (Python, the request out)": (0, 1), "posted → done (the wait, polled)": (1, 2)}
    for label, (x, y) in legs.items():
        allv = [(r[y] - r[x]) / 1e3 for r in recs]
        print(f"  {label:52} p50 {pct(allv, 50):7.1f}   slowest 1% median {med([allv[i] for i in slow]):7.1f}")
    if targets is not None:
        for label, f in (("done ← t:sent (the pong's way back, seen)", lambda i: (recs[i][2] - targets[i][1]) / 1e3),
                         ("posted → t:seen (the ping's way, seen)", lambda i: (targets[i][0] - recs[i][1]) / 1e3),
                         ("t:seen → t:sent (the target's send_notif)", lambda i: (targets[i][1] - targets[i][0]) / 1e3)):
            allv = [f(i) for i in range(n)]
            print(f"  {label:52} p50 {pct(allv, 50):7.1f}   slowest 1% median {med([allv[i] for i in slow]):7.1f}")
    if not events:
        return
    times = [t for t, _ in events]
    lines = [timeline(recs[i], targets[i] if targets is not None else None, events, times) for i in range(n)]
    steps: Dict[str, List[float]] = {}
    at: Dict[str, List[float]] = {}  # each step's start, µs from the call: the order printed
    per: List[Dict[str, float]] = []
    for pts in lines:
        mine: Dict[str, float] = {}
        for (x, tx, _), (y, ty, _) in zip(pts, pts[1:]):
            s = f"{x} → {y}"
            mine[s] = ty - tx
            at.setdefault(s, []).append(tx - pts[0][1])
        per.append(mine)
        for s, v in mine.items():
            steps.setdefault(s, []).append(v)
    p50 = {s: pct(v, 50) for s, v in steps.items()}
    grew: Dict[str, int] = {}
    for i in slow:
        excess = {s: v - p50[s] for s, v in per[i].items()}
        if excess:
            s = max(excess, key=lambda x: excess[x])
            grew[s] = grew.get(s, 0) + 1
    common = [s for s, v in steps.items() if len(v) >= n // 2 and "prev " not in s]
    print("  steps seen in ≥ half the iterations (p50 over all; median over the slowest; slow iterations where it grew most):")
    ordered = sorted(common, key=lambda s: statistics.median(at[s]))
    for s in ordered:
        sv = [per[i][s] for i in slow if s in per[i]]
        print(f"    {s:58} p50 {p50[s]:7.1f}  slowest {med(sv):7.1f} (n={len(sv)})  grew most in {grew.get(s, 0)}")
    rare = {s: c for s, c in grew.items() if s not in common}
    if rare:
        print("    grew most in a step of fewer than half the iterations: "
              + ", ".join(f"{s} ({c})" for s, c in sorted(rare.items(), key=lambda x: -x[1])))
    picks = [("median", order[n // 2])] + [(f"slow #{j + 1}", i) for j, i in enumerate(reversed(order[-show:]))]
    for label, i in picks:
        pts = lines[i]
        t0 = pts[0][1]
        r = recs[i]
        desc = " ".join(f"{p}+{t - t0:.1f}" + (f"[{w}]" if w else "") for p, t, w in pts)
        extra = f" gc {r[5] / 1e3:.0f}µs csw {r[6]}/{r[7]} gap {r[4] / 1e3:.0f}µs"
        if targets is not None:
            tr = targets[i]
            extra += f"; target gc {tr[4] / 1e3:.0f}µs csw {tr[5]}/{tr[6]} gap {tr[3] / 1e3:.0f}µs"
        print(f"    {label} ({tot[i]:.1f} µs;{extra}): {desc}")


def daemon_threads(pid: int) -> List[Tuple[str, float, int, int]]:
    """Each thread of a daemon: its name, CPU seconds, voluntary and involuntary switches, the
    busiest first (a spinning thread's CPU is the run's time; involuntary switches: it was
    preempted, a CPU short)."""
    out = []
    tick = os.sysconf("SC_CLK_TCK")
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (t / "stat").read_text()
            status = dict(line.split(":", 1) for line in (t / "status").read_text().splitlines() if ":" in line)
        except OSError:
            continue
        name = stat[stat.index("(") + 1: stat.rindex(")")]
        f = stat[stat.rindex(")") + 2:].split()
        cpu = (int(f[11]) + int(f[12])) / tick
        out.append((name.replace(" ", "_"), cpu, int(status["voluntary_ctxt_switches"]),
                    int(status["nonvoluntary_ctxt_switches"])))
    out.sort(key=lambda x: -x[1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tcpxd", required=True, help="the daemon binary")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--rows", default="read,write,notif")
    ap.add_argument("--one-node", action="store_true", help="both agents on one daemon")
    ap.add_argument("--record", action="store_true", help="the daemons record their hop events (TCPXD_HOP_RECORD)")
    ap.add_argument("--gc", choices=["on", "off", "freeze"], default="on")
    ap.add_argument("--slow", type=float, default=1.0, help="the slowest this many percent")
    ap.add_argument("--show", type=int, default=3, help="timelines of this many of the slowest")
    ap.add_argument("--json", default=None, help="also write the raw records here")
    ap.add_argument("--pin", action="store_true",
                    help="the daemons on the first half of the CPUs, the two agents on the other half "
                         "(whether the tail is where the threads meet on a CPU)")
    a = ap.parse_args()
    import tcpxd
    from tcpxd.bench import _start

    d = Path(tempfile.mkdtemp(prefix="tcpxd-tail-"))
    names = ["tail-a"] if a.one_node else ["tail-a", "tail-b"]
    procs = []
    cpus = sorted(os.sched_getaffinity(0))
    if a.pin:  # (threads inherit their creator's CPUs: the daemons now, the agents below)
        os.sched_setaffinity(0, cpus[: len(cpus) // 2])
    try:
        for nm in names:
            if a.record:
                os.environ["TCPXD_HOP_RECORD"] = str(d / f"{nm}.hops")
            procs.append(_start(a.tcpxd, d, nm)[0])
        os.environ.pop("TCPXD_HOP_RECORD", None)
        if a.pin:
            os.sched_setaffinity(0, cpus[len(cpus) // 2:])
        ea = f"unix:{d}/tail-a.sock"
        eb = ea if a.one_node else f"unix:{d}/tail-b.sock"
        rows = [r for r in a.rows.split(",") if r]
        ctx = mp.get_context("spawn")
        p1, p2 = ctx.Pipe()
        rx, tx = ctx.Pipe(duplex=False)
        target = ctx.Process(target=target_main, args=(eb, p1, a.gc))
        init = ctx.Process(target=initiator_main, args=(ea, p2, tx, rows, a.iters, a.gc))
        target.start()
        init.start()
        deadline = time.monotonic() + 900
        while not rx.poll(1.0):
            if not init.is_alive() or not target.is_alive() or time.monotonic() > deadline:
                raise SystemExit(f"no result: initiator exit {init.exitcode}, target exit {target.exitcode}")
        res = rx.recv()
        init.join(30)
        target.join(30)
        for p in (init, target):
            if p.is_alive():
                p.kill()
        threads = [daemon_threads(p.pid) for p in procs]
    finally:
        time.sleep(0.3)
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
    print(f"tcpxd {tcpxd.__file__}, daemon {a.tcpxd}, {'one daemon' if a.one_node else 'two daemons'}, "
          f"gc {a.gc}, {'hops recorded' if a.record else 'no hop record'}, {os.cpu_count()} CPUs"
          f"{' (daemons and agents on halves)' if a.pin else ''}, "
          f"TCPXD_SESSION_THREAD={os.environ.get('TCPXD_SESSION_THREAD', '(auto)')} "
          f"TCPXD_SPIN={os.environ.get('TCPXD_SPIN', '(auto)')}")
    for nm, ts in zip(names, threads):
        print(f"  {nm}'s threads over the run (CPU s, switches voluntary / involuntary): "
              + ", ".join(f"{c} {cpu:.2f} {v}/{i}" for c, cpu, v, i in ts))
    events: List = []
    if a.record:
        for nm, tag in zip(names, "ab"):
            events += [(t, {**f, "node": tag}) for t, f in hops.parse(d / f"{nm}.hops")]
        events.sort(key=lambda e: e[0])
    if a.json:
        Path(a.json).write_text(json.dumps(res))
    titles = {"read": "4 KiB READ, tight", "write": "4 KiB WRITE, tight", "notif": "notification round trip"}
    for row in rows:
        analyse(titles[row], res[row], res.get("notif target") if row == "notif" else None, events, a.slow / 100, a.show)
    for f in d.iterdir():
        f.unlink()
    d.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
