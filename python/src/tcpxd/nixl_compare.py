"""`python -m tcpxd.nixl_compare`: one script written against NIXL's Python API, run on tcpxd.nixl
and, when it is installed (`pip install nixl`), on real NIXL, alternating, so the comparison of
issue #39 is one command.

Two processes, as two serving workers are: a target agent and an initiator agent, each with 64 MiB (--mib)
of host memory from `nixl._utils.malloc_passthru` (tcpxd.nixl._utils for tcpxd), metadata
exchanged by pipe. The initiator measures, every byte of the bulk transfers checked:

- `register_memory` of 64 regions (1 MiB each), per region;
- `prep_xfer_dlist` of 2 × 16,384 descriptors (local and remote), per descriptor, the first time
  and again;
- one READ and one WRITE of all of it (GB/s, best of --iters);
- its random 16 KiB blocks (4096 of 64 MiB) READ by prepared lists (GB/s; Python time in make_prepped_xfer +
  transfer, per request);
- a 4 KiB READ polled with check_xfer_state in a tight loop, and with time.sleep(0) between polls
  (p50 / p99 over --small-iters), and a 4 KiB WRITE polled tight;
- a notification round trip: send_notif, the target polls get_new_notifs (tight) and answers, the
  initiator polls (tight) for the answer (p50 / p99).

tcpxd runs on two daemons it starts on the built-in emulation (--tcpxd, else target/{release,
debug}/tcpxd) — the two-node path, daemon to daemon over loopback —, and with --one-node also with
both agents on one of them ("tcpxd.nixl, one daemon": two agents on one node as NIXL's own run
here is, carried by the daemon itself, no daemon-to-daemon leg); real NIXL over UCX, with UCX_TLS=tcp unless UCX_TLS is set (NIXL between two
nodes, without RDMA: the case tcpxd stands in for) — or `tcp,cuda_copy` where UCX_TLS is unset and
a GPU is visible (CUDA's driver counts one): there NIXL's UCX backend refuses plain `tcp` (its
memory queries need the CUDA transport), and the bytes still go over TCP. The choice and why are
printed first. Times are medians over --rounds, each round running every implementation once,
alternating; on a shared machine, compare within one run.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np

MIB = 1 << 20
BIG = 64 * MIB
REGIONS = 64
PREP = 16384
BLOCK = 16 << 10
SMALL = 4096


def _gpu_visible() -> bool:
    """Whether this process would see a GPU: CUDA_VISIBLE_DEVICES does not hide them all and
    CUDA's driver (libcuda) counts at least one; without the driver, whether /dev/nvidia0 exists."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return os.path.exists("/dev/nvidia0")
    n = ctypes.c_int(0)
    return cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(n)) == 0 and n.value > 0


def ucx_tls(env: Optional[Mapping[str, str]] = None, gpu: Optional[bool] = None) -> Tuple[str, str]:
    """The UCX_TLS real NIXL runs with, and why: the environment's where set; else `tcp,cuda_copy`
    where a GPU is visible (NIXL's UCX backend refuses `tcp` alone there), else `tcp`."""
    tls = (os.environ if env is None else env).get("UCX_TLS", "")
    if tls:
        return tls, "UCX_TLS as set"
    if _gpu_visible() if gpu is None else gpu:
        return "tcp,cuda_copy", "UCX_TLS unset and a GPU is visible: NIXL's UCX backend refuses tcp alone there"
    return "tcp", "UCX_TLS unset, no GPU visible"


def _api(impl: str) -> Tuple[Any, Any, Any]:
    """(nixl_agent, nixl_agent_config, the _utils module) of an implementation."""
    if impl.startswith("tcpxd"):
        from .nixl import _utils, nixl_agent, nixl_agent_config

        return nixl_agent, nixl_agent_config, _utils
    api = importlib.import_module("nixl._api")
    return api.nixl_agent, api.nixl_agent_config, importlib.import_module("nixl._utils")


def _array(addr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))


def _wait(agent: Any, h: Any, tight: bool = True) -> None:
    while True:
        st = agent.check_xfer_state(h)
        if st == "DONE":
            return
        if st != "PROC":
            raise RuntimeError(f"transfer ended in {st}")
        if not tight:
            time.sleep(0)


def _pct(xs: List[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def target_main(impl: str, endpoint: str, conn: Any, big: int = BIG) -> None:
    if endpoint:
        os.environ["TCPXD_ENDPOINT"] = endpoint
    nixl_agent, nixl_agent_config, utils = _api(impl)
    agent = nixl_agent("target", nixl_agent_config(backends=["UCX"]))
    addr = utils.malloc_passthru(big)
    _array(addr, big)[:] = np.random.default_rng(7).integers(0, 256, big, dtype=np.uint8)
    agent.register_memory(agent.get_reg_descs([(addr, big, 0, "")], "DRAM"))
    conn.send((agent.get_agent_metadata(), addr))
    agent.add_remote_agent(conn.recv())
    while True:
        cmd = conn.recv()
        if cmd[0] == "pong":  # answer cmd[1] notifications, polling tight
            for _ in range(cmd[1]):
                while True:
                    got = agent.get_new_notifs().get("initiator")
                    if got:
                        break
                agent.send_notif("initiator", b"pong")
            conn.send("ok")
        elif cmd[0] == "checksum":
            conn.send(bytes(_array(addr, big)[: cmd[1]]))
        else:
            break
    conn.send("bye")


def initiator_main(impl: str, endpoint: str, conn: Any, out: Any, iters: int, small_iters: int, big: int = BIG) -> None:
    if endpoint:
        os.environ["TCPXD_ENDPOINT"] = endpoint
    nixl_agent, nixl_agent_config, utils = _api(impl)
    res: Dict[str, float] = {}
    agent = nixl_agent("initiator", nixl_agent_config(backends=["UCX"]))
    tmd, taddr = conn.recv()
    addr = utils.malloc_passthru(big)
    mine = _array(addr, big)
    regs = [utils.malloc_passthru(MIB) for _ in range(REGIONS)]
    t = time.perf_counter()
    rl = agent.register_memory(agent.get_reg_descs([(r, MIB, 0, "") for r in regs], "DRAM"))
    res["register µs/region"] = (time.perf_counter() - t) / REGIONS * 1e6
    agent.deregister_memory(rl)
    agent.register_memory(agent.get_reg_descs([(addr, big, 0, "")], "DRAM"))
    assert agent.add_remote_agent(tmd) in ("target", b"target")
    conn.send(agent.get_agent_metadata())
    # prepared lists of 16,384 descriptors a side
    step = big // PREP
    for again in ("", " (again)"):  # the first pair includes what a first use sets up
        t = time.perf_counter()
        pl = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(addr + i * step, step, 0) for i in range(PREP)], "DRAM")
        pr = agent.prep_xfer_dlist("target", [(taddr + i * step, step, 0) for i in range(PREP)], "DRAM")
        res[f"prep_xfer_dlist µs/desc{again}"] = (time.perf_counter() - t) / (2 * PREP) * 1e6
        agent.release_dlist_handle(pl)
        agent.release_dlist_handle(pr)
    whole_l = agent.get_xfer_descs([(addr, big, 0)], "DRAM")
    whole_r = agent.get_xfer_descs([(taddr, big, 0)], "DRAM")
    for op in ("READ", "WRITE"):
        best = 0.0
        for _ in range(iters):
            h = agent.initialize_xfer(op, whole_l, whole_r, "target")
            t = time.perf_counter()
            agent.transfer(h)
            _wait(agent, h)
            best = max(best, big / (time.perf_counter() - t) / 1e9)
            agent.release_xfer_handle(h)
        res[f"{big >> 20} MiB {op} GB/s"] = best
        conn.send(("checksum", big))
        if conn.recv() != mine.tobytes():
            raise RuntimeError(f"{big >> 20} MiB {op}: the bytes differ")
    # 4096 random 16 KiB blocks, READ by prepared lists
    nb = big // BLOCK
    pl = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(addr + i * BLOCK, BLOCK, 0) for i in range(nb)], "DRAM")
    pr = agent.prep_xfer_dlist("target", [(taddr + i * BLOCK, BLOCK, 0) for i in range(nb)], "DRAM")
    rng = np.random.default_rng(1)
    gbs, py = [], []
    for _ in range(iters):
        li, ri = rng.permutation(nb), rng.permutation(nb)
        t = time.perf_counter()
        h = agent.make_prepped_xfer("READ", pl, li, pr, ri)
        agent.transfer(h)
        t1 = time.perf_counter()
        _wait(agent, h)
        gbs.append(big / (time.perf_counter() - t) / 1e9)
        py.append((t1 - t) * 1e6)
        agent.release_xfer_handle(h)
    res[f"{nb} x 16 KiB random READ GB/s"] = max(gbs)
    res[f"{nb} x 16 KiB: Python µs/request"] = statistics.median(py)
    agent.release_dlist_handle(pl)
    agent.release_dlist_handle(pr)
    # 4 KiB READ latency, polled tight and with sleep(0)
    sl = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(addr, SMALL, 0)], "DRAM")
    sr = agent.prep_xfer_dlist("target", [(taddr, SMALL, 0)], "DRAM")
    for tight in (True, False):
        lat = []
        for i in range(small_iters + 20):
            t = time.perf_counter()
            h = agent.make_prepped_xfer("READ", sl, [0], sr, [0])
            agent.transfer(h)
            _wait(agent, h, tight)
            if i >= 20:
                lat.append((time.perf_counter() - t) * 1e6)
            agent.release_xfer_handle(h)
        how = "tight" if tight else "sleep(0)"
        res[f"4 KiB READ p50 µs ({how})"] = _pct(lat, 50)
        res[f"4 KiB READ p99 µs ({how})"] = _pct(lat, 99)
    lat = []  # the same WRITE, polled tight
    for i in range(small_iters + 20):
        t = time.perf_counter()
        h = agent.make_prepped_xfer("WRITE", sl, [0], sr, [0])
        agent.transfer(h)
        _wait(agent, h)
        if i >= 20:
            lat.append((time.perf_counter() - t) * 1e6)
        agent.release_xfer_handle(h)
    res["4 KiB WRITE p50 µs (tight)"] = _pct(lat, 50)
    res["4 KiB WRITE p99 µs (tight)"] = _pct(lat, 99)
    if impl.startswith("tcpxd"):  # the same READ on tcpxd's own client, no NIXL layer: what the agent adds
        raw = _raw_read_latency(agent, small_iters)
        res["4 KiB READ p50 µs (tcpxd.Client.read)"] = _pct(raw, 50)
        res["4 KiB READ p99 µs (tcpxd.Client.read)"] = _pct(raw, 99)
    # notification round trip
    conn.send(("pong", small_iters + 20))
    rtt = []
    for i in range(small_iters + 20):
        t = time.perf_counter()
        agent.send_notif("target", b"ping")
        while not agent.get_new_notifs().get("target"):
            pass
        if i >= 20:
            rtt.append((time.perf_counter() - t) * 1e6)
    assert conn.recv() == "ok"
    res["notification round trip p50 µs"] = _pct(rtt, 50)
    res["notification round trip p99 µs"] = _pct(rtt, 99)
    conn.send(("quit",))
    conn.recv()
    out.send(res)


def _raw_read_latency(agent: Any, iters: int) -> List[float]:
    """4 KiB READs from the target's memory by tcpxd's plain client (one waited `read` each, on its
    local session): the daemons' round trip, without the NIXL agent's layer."""
    remote = agent._remotes["target"].md.regions[0]
    local = agent._memory.regions()[0]
    client = agent._client
    lat = []
    for i in range(iters + 20):
        t = time.perf_counter()
        client.read(remote.descriptor, local.buffer_id, SMALL, remote_offset=remote.offset)
        if i >= 20:
            lat.append((time.perf_counter() - t) * 1e6)
    return lat


def run_once(impl: str, ea: str, eb: str, iters: int, small_iters: int, big: int = BIG) -> Dict[str, float]:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    rx, tx = ctx.Pipe(duplex=False)
    target = ctx.Process(target=target_main, args=(impl, ea, a, big))
    init = ctx.Process(target=initiator_main, args=(impl, eb, b, tx, iters, small_iters, big))
    target.start()
    init.start()
    try:
        # Wait for the initiator's result, but not for a role that died: say which, at once.
        deadline = time.monotonic() + 600
        while not rx.poll(1.0):
            failed = [
                f"the {name} exited with status {p.exitcode}"
                for name, p in (("target", target), ("initiator", init))
                if p.exitcode not in (None, 0)
            ]
            if not failed and not init.is_alive() and not rx.poll(1.0):
                failed.append("the initiator exited without a result")
            if failed:
                raise RuntimeError(f"{impl}: " + "; ".join(failed))
            if time.monotonic() > deadline:
                raise RuntimeError(f"{impl}: no result within 600 s")
        return dict(rx.recv())
    finally:
        for p in (init, target):
            p.join(30)
            if p.is_alive():
                p.kill()


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tcpxd.nixl_compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", choices=["both", "tcpxd", "nixl"], default="both",
                   help="which to run (both: tcpxd.nixl and, when installed, real NIXL, alternating)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iters", type=int, default=3, help="bulk transfers a round (the best counts)")
    p.add_argument("--small-iters", type=int, default=300, help="4 KiB transfers and round trips a round")
    p.add_argument("--mib", type=int, default=BIG >> 20, help="each side's memory, MiB (the bulk transfers' size)")
    p.add_argument("--tcpxd", default=None, help="the daemon binary (default target/{release,debug}/tcpxd)")
    p.add_argument("--one-node", action="store_true",
                   help="also run tcpxd with both agents on one daemon (two agents on one node), alternating")
    a = p.parse_args(argv)
    from .bench import _find, _start

    impls = ["tcpxd", "nixl"] if a.impl == "both" else [a.impl]
    if a.one_node and "tcpxd" in impls:
        impls.insert(1, "tcpxd-node")
    if "nixl" in impls:
        try:
            importlib.import_module("nixl._api")
        except ImportError as e:
            if a.impl == "nixl":
                raise SystemExit(f"real NIXL is not importable ({e}): pip install nixl")
            print(f"real NIXL is not importable ({e}): tcpxd.nixl only (pip install nixl to compare)")
            impls = ["tcpxd"]
        else:
            nixl = importlib.import_module("nixl")
            if Path(nixl.__file__ or "").read_text().startswith("# written by"):
                raise SystemExit("`nixl` on this path is tcpxd's shim: run without it on PYTHONPATH to compare")
    if "nixl" in impls:
        tls, why = ucx_tls()
        os.environ["UCX_TLS"] = tls
        print(f"NIXL over UCX_TLS={tls} ({why})", flush=True)
    procs = []
    ea = eb = ""
    if "tcpxd" in impls:
        binary = _find("tcpxd", a.tcpxd)
        if binary is None:
            raise SystemExit("no tcpxd binary (cargo build, or --tcpxd)")
        d = Path(tempfile.mkdtemp(prefix="tcpxd-nixl-cmp-"))
        for name in ("cmp-a", "cmp-b"):
            procs.append(_start(binary, d, name)[0])
        ea, eb = f"unix:{d}/cmp-a.sock", f"unix:{d}/cmp-b.sock"
    results: Dict[str, List[Dict[str, float]]] = {i: [] for i in impls}
    try:
        for r in range(a.rounds):
            for impl in impls:
                # (one node: both agents on daemon a)
                e_init = ea if impl == "tcpxd-node" else eb
                results[impl].append(run_once(impl, ea, e_init, a.iters, a.small_iters, a.mib << 20))
                print(f"round {r + 1} {impl}: done", file=sys.stderr, flush=True)
    finally:
        for pr in procs:
            pr.terminate()
            pr.wait()
    keys = list(results[impls[0]][0])
    names = {"tcpxd": "tcpxd.nixl", "tcpxd-node": "tcpxd.nixl, one daemon",
             "nixl": f"NIXL (UCX_TLS={os.environ.get('UCX_TLS', '')})"}
    # the ratio columns: each tcpxd run ÷ NIXL, where NIXL ran
    tcpxds = [i for i in impls if i != "nixl"]
    ratios = "nixl" in impls
    print(f"{'(median of ' + str(a.rounds) + ' rounds; range in brackets)':44} " + " ".join(f"{names[i]:>28}" for i in impls)
          + ("".join(f"   {'two daemons' if i == 'tcpxd' else 'one daemon'} / NIXL" for i in tcpxds) if ratios else ""))
    for k in keys:
        cells = []
        meds = []
        for i in impls:
            xs = [res[k] for res in results[i] if k in res]
            if not xs:  # a row of one implementation's only (tcpxd's own client)
                meds.append(0.0)
                cells.append("-")
                continue
            meds.append(statistics.median(xs))
            cells.append(f"{statistics.median(xs):10.3g} [{min(xs):.3g}-{max(xs):.3g}]")
        ratio = ""
        if ratios:
            n = meds[impls.index("nixl")]
            ratio = "".join(
                f"   {meds[impls.index(i)] / n:>20.2f}x" if n and meds[impls.index(i)] else f"   {'-':>21}" for i in tcpxds
            )
        print(f"{k:44} " + " ".join(f"{c:>28}" for c in cells) + ratio)
    return 0


if __name__ == "__main__":
    sys.exit(main())
