#!/usr/bin/env python3
"""Where a small transfer's time goes between the client's call and the daemon (and back): the
client-to-daemon legs of issues #38 / #39, beside the daemons' own part.

Starts two daemons on the built-in emulation with the hop trace on (`RUST_LOG=tcpxd::hop=trace`),
then, each call stamped on the client's wall clock (the daemons' log lines share it):

- `tcpxd.Client.read` and `.write` of 4 KiB, a → b (waited, on the local session);
- the same READ with both buffers on daemon a (api/same_node.rs: no peer, no poller);
- a `tcpxd.nixl` 4 KiB READ (prepared lists), polled with `check_xfer_state` in a tight loop and
  with `time.sleep(0)` between polls, and the same range WRITTEN back, polled tight;
- a notification round trip (send_notif, the target agent in another process polling
  get_new_notifs tight and answering, the initiator polling tight), split across both daemons'
  traces and both processes' stamps: the ping's way to daemon b and its target, the target's
  answer, the pong's way back (`NOTIF_LEGS`).

For each call it places daemon a's hop events inside the call's window and prints the p50 of each
leg: the call → `api.in` (the client's Python, the socket, the daemon's task woken and the frame
decoded), `api.in` → `poller.cmd` (the command to the poller thread), `poller.cmd` →
`poller.finished` (the daemons' part: peer legs and data), `poller.finished` → `api.woken` (the
transfer's waiter woken), `api.woken` → `api.out` (the session's task sends the event), `api.out`
→ the client sees DONE (the socket, the client's thread woken, its Python). The trace costs a few
µs an event (a log write): read the split, and compare totals only between runs traced alike.

    PYTHONPATH=python/src python3 benches/api_legs.py --tcpxd target/release/tcpxd --iters 300

`--no-trace` runs the same calls without the trace (the totals as a user sees them). `--tail N`
(session 27) adds each leg's median over the slowest 1% of calls beside its p50, and the N slowest
calls' timelines (every hop of both daemons, µs from the call) after the median call's: what a
p99 is made of, structural (one leg, the same each time: a timer, a fallback) or not.
"""

from __future__ import annotations

import argparse
import bisect
import multiprocessing as mp
import os
import sys
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hops  # noqa: E402  (the hop trace's log format, parsed once)

SMALL = 4096


def now_us() -> float:
    return time.time_ns() / 1e3


def parse(path: Path) -> List[Tuple[float, Dict[str, str]]]:
    return hops.parse(path)


def pct(xs: List[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


LEGS = [
    ("call → posted (the client's Python until its request is sent; nixl only)", "call", "posted"),
    ("posted → api.in (socket, daemon task woken, frame decoded)", "posted", "api.in"),
    ("call → api.in (client Python, socket, daemon task woken, frame decoded)", "call", "api.in"),
    ("api.in → poller.cmd (the command to the poller thread)", "api.in", "poller.cmd"),
    ("poller.cmd → poller.finished (the daemons' part: peer legs, data)", "poller.cmd", "poller.finished"),
    ("poller.finished → api.woken (the transfer's waiter woken)", "poller.finished", "api.woken"),
    ("api.woken → api.out (the session's task sends the event)", "api.woken", "api.out"),
    ("api.in → api.out (same node: the copy and the event)", "api.in", "api.out"),
    ("api.out → DONE seen (socket, client thread woken, Python)", "api.out", "done"),
]


def split(windows: List[Tuple[float, ...]], events: List[Tuple[float, Dict[str, str]]], skip: int) -> Dict[str, Any]:
    """Legs of each call: the first event of each hop inside its window (api.out: the last)."""
    times = [t for t, _ in events]

    legs: Dict[str, List[float]] = {name: [] for name, _, _ in LEGS}
    totals = []
    rows: List[Tuple[float, Dict[str, float], Tuple[float, float]]] = []
    for i, w in enumerate(windows):
        if i < skip:
            continue
        t0, t1 = w[0], w[1]
        lo, hi = bisect.bisect_left(times, t0), bisect.bisect_right(times, t1)
        seen: Dict[str, float] = {"call": t0, "done": t1}
        if len(w) > 2:
            seen["posted"] = w[2]
        for t, f in events[lo:hi]:
            hop = f.get("hop", "")
            if hop == "api.out":
                seen[hop] = t
            else:
                seen.setdefault(hop, t)
        totals.append(t1 - t0)
        mine: Dict[str, float] = {}
        for name, a, b in LEGS:
            if a in seen and b in seen and seen[b] >= seen[a]:
                if name.startswith("api.in → api.out") and "poller.cmd" in seen:
                    continue
                legs[name].append(seen[b] - seen[a])
                mine[name] = seen[b] - seen[a]
        rows.append((t1 - t0, mine, (t0, t1)))
    return {"total": totals, "legs": legs, "rows": rows}


def report(title: str, s: Dict[str, Any], tail: int = 0,
           both: Optional[List[Tuple[float, Dict[str, str]]]] = None) -> None:
    """The legs' p50 / p90; with `tail`, also each leg's median over the slowest 1% of calls (by
    their total: what the p99 is made of) beside the median call's, and the `tail` slowest
    calls' timelines, every hop event of both daemons (`both`: node-tagged) with its µs from the
    call's start."""
    tot = s["total"]
    if not tot:
        print(f"\n{title}: no calls")
        return
    print(f"\n{title}: {len(tot)} calls, p50 {pct(tot, 50):.0f} µs, p90 {pct(tot, 90):.0f}, p99 {pct(tot, 99):.0f}")
    rows = sorted(s.get("rows", []), key=lambda r: r[0])
    slow = rows[-max(1, len(rows) // 100):] if tail and rows else []
    for name, xs in s["legs"].items():
        if xs:
            extra = ""
            if slow:
                ys = [r[1][name] for r in slow if name in r[1]]
                if ys:
                    extra = f"  slowest 1%: {statistics.median(ys):7.1f} (n={len(ys)})"
            print(f"  {name:78} p50 {pct(xs, 50):7.1f}  p90 {pct(xs, 90):7.1f}  (n={len(xs)}){extra}")
    if slow and both is not None:
        times = [t for t, _ in both]
        picks = [("median", rows[len(rows) // 2])] + [(f"slow #{k + 1}", r) for k, r in enumerate(reversed(rows[-tail:]))]
        for label, (total, _, (t0, t1)) in picks:
            lo, hi = bisect.bisect_left(times, t0), bisect.bisect_right(times, t1)
            line = " ".join(f"{f.get('node', 'a')}:{f.get('hop', '?')}+{t - t0:.0f}" for t, f in both[lo:hi])
            print(f"    {label} ({total:.0f} µs): {line} done+{t1 - t0:.0f}")


NOTIF_LEGS = [
    ("the call → a: api.in (the initiator's send_notif: Python, socket, decoded)", "call", "a:api.in"),
    ("a: api.in → a: poller.cmd", "a:api.in", "a:poller.cmd"),
    ("a: poller.cmd → b: api.notify (the ping between the daemons, delivered)", "a:poller.cmd", "b:api.notify"),
    ("b: api.notify → the target sees it (its feed, its Python)", "b:api.notify", "seen"),
    ("the target sees it → b: api.in (its send_notif: Python, socket, decoded)", "seen", "b:api.in"),
    ("b: api.in → b: poller.cmd", "b:api.in", "b:poller.cmd"),
    ("b: poller.cmd → a: api.notify (the pong between the daemons, delivered)", "b:poller.cmd", "a:api.notify"),
    ("a: api.notify → the initiator sees it (its feed, its Python)", "a:api.notify", "done"),
    ("(the call → the initiator's send_notif returned)", "call", "returned"),
    ("(the target sees it → its send_notif returned)", "seen", "sent"),
]


def split_notif(windows: List[Tuple[float, ...]], stamps: List[Tuple[float, float]],
                events: List[Tuple[float, Dict[str, str]]], skip: int) -> Dict[str, Any]:
    """The round trip's legs across both daemons' traces (events' fields carry `node`: a or b)
    and both processes' stamps (the initiator's call, send_notif returned, the answer seen; the
    target's ping seen and its send_notif returned), each window's first event of each hop
    (a's api.notify: the last, the pong's)."""

    times = [t for t, _ in events]
    legs: Dict[str, List[float]] = {name: [] for name, _, _ in NOTIF_LEGS}
    totals = []
    rows: List[Tuple[float, Dict[str, float], Tuple[float, float]]] = []
    for i, w in enumerate(windows):
        if i < skip:
            continue
        t0, t1 = w[0], w[1]
        seen: Dict[str, float] = {"call": t0, "done": t1, "returned": w[2]}
        if i < len(stamps) and t0 <= stamps[i][0] <= t1:
            seen["seen"], seen["sent"] = stamps[i]
        lo, hi = bisect.bisect_left(times, t0), bisect.bisect_right(times, t1)
        for t, f in events[lo:hi]:
            key = f"{f['node']}:{f.get('hop', '')}"
            if key == "a:api.notify":
                seen[key] = t
            else:
                seen.setdefault(key, t)
        totals.append(t1 - t0)
        mine: Dict[str, float] = {}
        for name, x, y in NOTIF_LEGS:
            if x in seen and y in seen and seen[y] >= seen[x]:
                legs[name].append(seen[y] - seen[x])
                mine[name] = seen[y] - seen[x]
        rows.append((t1 - t0, mine, (t0, t1)))
    return {"total": totals, "legs": legs, "rows": rows}


def _target(endpoint: str, conn: Any, mib: int) -> None:
    """The target agent (its own loop, so that main's package runs it too): answers the
    initiator's pings, stamping when it saw each and when its send_notif returned."""
    sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    import ctypes

    os.environ["TCPXD_ENDPOINT"] = endpoint
    from tcpxd.nixl import _utils, nixl_agent, nixl_agent_config

    big = mib << 20
    agent = nixl_agent("target", nixl_agent_config(backends=["UCX"]))
    addr = _utils.malloc_passthru(big)
    mem = (ctypes.c_uint8 * big).from_address(addr)
    ctypes.memmove(mem, os.urandom(big), big)
    agent.register_memory(agent.get_reg_descs([(addr, big, 0, "")], "DRAM"))
    conn.send((agent.get_agent_metadata(), addr))
    agent.add_remote_agent(conn.recv())
    while True:
        cmd = conn.recv()
        if cmd[0] == "pong":  # answer cmd[1] pings, polling tight; then the stamps
            stamps = []
            for _ in range(cmd[1]):
                while not agent.get_new_notifs().get("initiator"):
                    pass
                ts = now_us()
                agent.send_notif("initiator", b"pong")
                stamps.append((ts, now_us()))
            conn.send(("ok", stamps))
        elif cmd[0] == "checksum":
            conn.send(bytes(mem[: cmd[1]]))
        else:
            break
    agent.close()
    conn.send("bye")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tcpxd", required=True, help="the daemon binary")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--no-trace", action="store_true", help="daemons without the hop trace")
    ap.add_argument("--keep", action="store_true", help="keep the daemons' logs (the directory is printed)")
    ap.add_argument("--only", default="", help="comma-separated subset: read,write,same,nixl,notif")
    ap.add_argument("--tail", type=int, default=0,
                    help="also each leg over the slowest 1%% of calls, and the N slowest calls' timelines (both daemons)")
    a = ap.parse_args()

    import numpy as np

    import tcpxd
    from tcpxd.bench import _start
    from tcpxd.nixl import nixl_agent, nixl_agent_config
    from tcpxd.nixl import _utils

    only = set(filter(None, a.only.split(","))) or {"read", "write", "same", "nixl", "notif"}
    d = Path(tempfile.mkdtemp(prefix="tcpxd-api-legs-"))
    if not a.no_trace:
        os.environ["RUST_LOG"] = "tcpxd::hop=trace,info"
    procs = [_start(a.tcpxd, d, n)[0] for n in ("legs-a", "legs-b")]
    os.environ.pop("RUST_LOG", None)
    ea, eb = f"unix:{d}/legs-a.sock", f"unix:{d}/legs-b.sock"
    print(f"tcpxd {tcpxd.__file__}, daemon {a.tcpxd}, logs {d}", file=sys.stderr)
    runs: Dict[str, List[Tuple[float, ...]]] = {}
    n = a.warmup + a.iters
    try:
        ca, cb = tcpxd.Client(ea), tcpxd.Client(eb)
        src, dst, near = ca.register_host(SMALL), cb.register_host(SMALL), ca.register_host(SMALL)
        dst.fill(seed=3)
        near.fill(seed=4)
        for kind in ("read", "write", "same"):
            if kind not in only:
                continue
            w = []
            for _ in range(n):
                t0 = now_us()
                if kind == "read":
                    ca.read(dst.descriptor, src, SMALL)
                elif kind == "write":
                    ca.write(src, dst.descriptor, SMALL)
                else:
                    ca.read(near.descriptor, src, SMALL)
                w.append((t0, now_us()))
            runs[kind] = w
        if "read" in only or "same" in only:
            want = near if "same" in only else dst
            assert src.checksum() == want.checksum(), "the READ's bytes differ"
        if only & {"nixl", "notif"}:
            ctx = mp.get_context("spawn")
            p1, p2 = ctx.Pipe()
            target = ctx.Process(target=_target, args=(eb, p1, 1))
            target.start()
            agent = nixl_agent("initiator", nixl_agent_config(backends=["UCX"], endpoint=ea))
            tmd, taddr = p2.recv()
            addr = _utils.malloc_passthru(1 << 20)
            agent.register_memory(agent.get_reg_descs([(addr, 1 << 20, 0, "")], "DRAM"))
            agent.add_remote_agent(tmd)
            p2.send(agent.get_agent_metadata())
            sl = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(addr, SMALL, 0)], "DRAM")
            sr = agent.prep_xfer_dlist("target", [(taddr, SMALL, 0)], "DRAM")
            if "nixl" in only:
                def timed(op: str, tight: bool) -> list:
                    """n `op`s of the range, each polled until DONE: (start, end, posted) µs."""
                    w = []
                    for _ in range(n):
                        t0 = now_us()
                        h = agent.make_prepped_xfer(op, sl, [0], sr, [0])
                        agent.transfer(h)
                        tp = now_us()
                        while True:
                            st = agent.check_xfer_state(h)
                            if st == "DONE":
                                break
                            if st != "PROC":
                                raise RuntimeError(f"the {op} ended in {st}")
                            if not tight:
                                time.sleep(0)
                        w.append((t0, now_us(), tp))
                        agent.release_xfer_handle(h)
                    return w

                for tight in (True, False):
                    runs["nixl tight" if tight else "nixl sleep(0)"] = timed("READ", tight)
                got = np.ctypeslib.as_array((__import__("ctypes").c_uint8 * SMALL).from_address(addr)).tobytes()
                p2.send(("checksum", SMALL))
                assert p2.recv() == got, "the nixl READ's bytes differ"
                # The same range WRITTEN back (its bytes equal now: nothing changes), polled tight.
                runs["nixl WRITE tight"] = timed("WRITE", True)
            if "notif" in only:
                p2.send(("pong", n))
                w = []
                for _ in range(n):
                    t0 = now_us()
                    agent.send_notif("target", b"ping")
                    tr = now_us()
                    while not agent.get_new_notifs().get("target"):
                        pass
                    w.append((t0, now_us(), tr))
                ok, stamps = p2.recv()
                assert ok == "ok"
                runs["notification round trip"] = w
            p2.send(("quit",))
            p2.recv()
            target.join(30)
            agent.release_dlist_handle(sl)
            agent.release_dlist_handle(sr)
            agent.close()
        ca.close()
        cb.close()
    finally:
        for p in procs:
            p.terminate()
            p.wait()
    ev = [] if a.no_trace else parse(d / "legs-a.log")
    both = [] if a.no_trace else sorted(
        [(t, {**f, "node": "a"}) for t, f in ev] + [(t, {**f, "node": "b"}) for t, f in parse(d / "legs-b.log")],
        key=lambda e: e[0])
    for kind, w in runs.items():
        if kind == "notification round trip":
            report(kind, split_notif(w, stamps, both, a.warmup), a.tail, both)
            continue
        report(f"{kind} (4 KiB)", split(w, ev, a.warmup), a.tail, both)
    if not a.keep:
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
