#!/usr/bin/env python3
"""Addressed feeds and undecoded board ends (session 31, feeds; #39 point 5), before and after,
alternating: two NIXL agents on ONE daemon (NIXL's own one-machine run), in two processes, the
4 KiB READ polled tight (`check_xfer_state`) and the notification round trip polled tight
(`get_new_notifs`), as benches/tail.py --one-node runs them; per row p50 / p99 (µs) and the
session events each agent's process DECODED per iteration (`tcpxd._local.Connection.ready` /
`_receive` counted in both trees: protobuf decodes on the polling thread).

A = the after tree (`--after-bin`, `--after-py`), B = the before tree (`--before-bin`,
`--before-py`); each round runs A B B A; ratios A ÷ B are per round, then their median. The
completion board is on (`--board 256`, as with 8 CPUs or more; 0: off, as below 8).

    python3 benches/feeds_ab.py --after-bin target/release/tcpxd --before-bin /work/main/target/release/tcpxd \\
        --before-py /work/main/python/src --rounds 3 --iters 1000
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parent.parent
SMALL = 4096
WARMUP = 50


def _count_decodes() -> List[int]:
    """Counts the SessionEvents this process decodes (both trees have these two readers)."""
    from tcpxd import _local

    n = [0]
    ready, receive = _local.Connection.ready, _local.Connection._receive

    def counted_ready(self, *a, **k):  # type: ignore[no-untyped-def]
        out = ready(self, *a, **k)
        n[0] += len(out)
        if os.environ.get("FEEDS_KINDS"):
            for ev in out:
                print(os.getpid(), ev.tag, ev.WhichOneof("event"), file=sys.stderr)
        return out

    def counted_receive(self):  # type: ignore[no-untyped-def]
        n[0] += 1
        return receive(self)

    _local.Connection.ready = counted_ready  # type: ignore[method-assign]
    _local.Connection._receive = counted_receive  # type: ignore[method-assign]
    return n


def _agent(name: str, endpoint: str) -> Any:
    os.environ["TCPXD_ENDPOINT"] = endpoint
    from tcpxd.nixl import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(backends=["UCX"]))


def target_main(endpoint: str, conn: Any) -> None:
    from tcpxd.nixl import _utils

    decoded = _count_decodes()
    agent = _agent("target", endpoint)
    addr = _utils.malloc_passthru(1 << 20)
    agent.register_memory(agent.get_reg_descs([(addr, 1 << 20, 0, "")], "DRAM"))
    conn.send((agent.get_agent_metadata(), addr))
    agent.add_remote_agent(conn.recv())
    while True:
        cmd = conn.recv()
        if cmd[0] == "count":
            conn.send(decoded[0])
        elif cmd[0] == "pong":
            for _ in range(cmd[1]):
                while not agent.get_new_notifs().get("initiator"):
                    pass
                agent.send_notif("initiator", b"pong")
            conn.send(decoded[0])
        else:
            break
    agent.close()
    conn.send("bye")


def initiator_main(endpoint: str, conn: Any, out: Any, iters: int) -> None:
    from tcpxd.nixl import _utils

    decoded = _count_decodes()
    agent = _agent("initiator", endpoint)
    tmd, taddr = conn.recv()
    addr = _utils.malloc_passthru(1 << 20)
    agent.register_memory(agent.get_reg_descs([(addr, 1 << 20, 0, "")], "DRAM"))
    agent.add_remote_agent(tmd)
    conn.send(agent.get_agent_metadata())
    sl = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(addr, SMALL, 0)], "DRAM")
    sr = agent.prep_xfer_dlist("target", [(taddr, SMALL, 0)], "DRAM")
    ctypes.memset(addr, 0, SMALL)
    res: Dict[str, Any] = {}
    n = iters + WARMUP
    tns = time.perf_counter_ns
    # The READ, polled tight.
    conn.send(("count",))
    t_before, i_before = conn.recv(), decoded[0]
    lat = []
    for k in range(n):
        if k == WARMUP:
            conn.send(("count",))
            t_before, i_before = conn.recv(), decoded[0]
        t0 = tns()
        h = agent.make_prepped_xfer("READ", sl, [0], sr, [0])
        agent.transfer(h)
        while (st := agent.check_xfer_state(h)) == "PROC":
            pass
        lat.append((tns() - t0) / 1e3)
        if st != "DONE":
            raise RuntimeError(f"the READ ended in {st}")
        agent.release_xfer_handle(h)
    conn.send(("count",))
    res["read"] = (lat[WARMUP:], (decoded[0] - i_before) / iters, (conn.recv() - t_before) / iters)
    # The round trip, polled tight on both sides.
    conn.send(("count",))
    t_before = conn.recv()
    conn.send(("pong", n))
    lat = []
    for k in range(n):
        if k == WARMUP:
            i_before = decoded[0]
        t0 = tns()
        agent.send_notif("target", b"ping")
        while not agent.get_new_notifs().get("target"):
            pass
        lat.append((tns() - t0) / 1e3)
    t_after = conn.recv()
    # (the target's count covers its warm-up too: per iteration over all n)
    res["notif"] = (lat[WARMUP:], (decoded[0] - i_before) / iters, (t_after - t_before) / n)
    conn.send(("quit",))
    conn.recv()
    agent.release_dlist_handle(sl)
    agent.release_dlist_handle(sr)
    agent.close()
    out.send(res)


def run_once(tcpxd_bin: str, iters: int) -> Dict[str, Any]:
    from tcpxd.bench import _start

    d = Path(tempfile.mkdtemp(prefix="tcpxd-feeds-"))
    proc = _start(tcpxd_bin, d, "fa")[0]
    try:
        ep = f"unix:{d}/fa.sock"
        ctx = mp.get_context("spawn")
        p1, p2 = ctx.Pipe()
        rx, tx = ctx.Pipe(duplex=False)
        target = ctx.Process(target=target_main, args=(ep, p1))
        init = ctx.Process(target=initiator_main, args=(ep, p2, tx, iters))
        target.start()
        init.start()
        deadline = time.monotonic() + 600
        while not rx.poll(1.0):
            if not init.is_alive() or time.monotonic() > deadline:
                raise SystemExit(f"no result: initiator exit {init.exitcode}, target exit {target.exitcode}")
        res = rx.recv()
        for p in (init, target):
            p.join(30)
            if p.is_alive():
                p.kill()
    finally:
        proc.terminate()
        proc.wait()
    out = {}
    for row, (lat, dec_i, dec_t) in res.items():
        s = sorted(lat)
        out[row] = {"p50": s[len(s) // 2], "p99": s[min(len(s) - 1, int(0.99 * len(s)))],
                    "dec_init": dec_i, "dec_target": dec_t}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run", action="store_true", help="(one run, in the tree on PYTHONPATH)")
    ap.add_argument("--bin")
    ap.add_argument("--after-bin")
    ap.add_argument("--after-py", default=str(ROOT / "python/src"))
    ap.add_argument("--before-bin")
    ap.add_argument("--before-py")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--board", default="256", help="TCPXD_BOARD_SLOTS for the agents (0: none)")
    a = ap.parse_args()
    if a.run:
        print(json.dumps(run_once(a.bin, a.iters)))
        return 0
    labels = {"A": (a.after_bin, a.after_py), "B": (a.before_bin, a.before_py)}
    runs: Dict[str, List[Dict[str, Any]]] = {"A": [], "B": []}
    per_round: List[Dict[str, Any]] = []
    for r in range(a.rounds):
        got: Dict[str, List[Dict[str, Any]]] = {"A": [], "B": []}
        for lab in "ABBA":
            b, py = labels[lab]
            env = {**os.environ, "PYTHONPATH": py, "TCPXD_BOARD_SLOTS": a.board}
            cp = subprocess.run([sys.executable, __file__, "--run", "--bin", b, "--iters", str(a.iters)],
                                env=env, capture_output=True, text=True, timeout=900)
            if cp.returncode:
                raise SystemExit(f"{lab}: {cp.stderr[-3000:]}")
            res = json.loads(cp.stdout.strip().splitlines()[-1])
            got[lab].append(res)
            runs[lab].append(res)
            print(f"round {r + 1} {lab}: " + "; ".join(
                f"{row} p50 {v['p50']:.0f} p99 {v['p99']:.0f} µs, decoded/iter {v['dec_init']:.2f} + {v['dec_target']:.2f}"
                for row, v in res.items()), flush=True)
        per_round.append(got)
    print(f"\n{a.rounds} rounds × {a.iters} iterations, one daemon, TCPXD_BOARD_SLOTS={a.board}, {os.cpu_count()} CPUs")
    for row in ("read", "notif"):
        for k in ("p50", "p99"):
            ratios = [statistics.median([x[row][k] for x in g["A"]]) / statistics.median([x[row][k] for x in g["B"]])
                      for g in per_round]
            am = statistics.median([x[row][k] for x in runs["A"]])
            bm = statistics.median([x[row][k] for x in runs["B"]])
            print(f"  {row:5} {k}: A {am:.0f} µs, B {bm:.0f} µs; A/B per round "
                  + ", ".join(f"{q:.2f}" for q in ratios) + f" (median {statistics.median(ratios):.2f})")
        for who in ("dec_init", "dec_target"):
            am = statistics.median([x[row][who] for x in runs["A"]])
            bm = statistics.median([x[row][who] for x in runs["B"]])
            print(f"  {row:5} events decoded per iteration, {who[4:]}: A {am:.2f}, B {bm:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
