"""`python -m tcpxd.nixl_bench`: vLLM's NIXL pull pattern through tcpxd.nixl, against the same bytes
as one contiguous tcpxd READ, and the Python cost of a request.

The pattern (issue 24's targets; defaults): a prefill agent and a decode agent, each with 32 layers
× 2 regions (K, V) of 4096 blocks of 16 KiB, per-block prepared lists on both sides as vLLM's
NixlConnector prepares them; each request READs 512 blocks of every layer region (32,768
descriptors, 512 MiB) by block indices (random distinct blocks, or --ids contiguous) with a
notification, polled with check_xfer_state to DONE. The baseline READs the same number of bytes in
one contiguous tcpxd READ between the same two daemons (Client.read, same memory kind). Printed:
the GB/s of each (median of the requests), their ratio (target ≥ 0.9x), and the Python time per
request spent in make_prepped_xfer + transfer + one check_xfer_state (target ≤ 100 µs), for the
full request and for a small one (one block per region); then all the requests posted at once,
against as many contiguous READs in flight.

Host memory by default (shared with the daemons by file descriptor); --cuda puts both sides' KV in
GPU memory (torch; decode on --cuda-device, prefill on --peer-cuda-device). The prefill agent
runs in a process of its own (as vLLM's does: its session reader and notification threads would
otherwise take this process's GIL as each request ends; --peer-in-process puts it here, as before
helper session 10). Without --endpoint it
starts two daemons on the built-in emulation (--tcpxd, else target/{release,debug}/tcpxd). Small
sizes for a CI machine: --layers 2 --blocks 256 --block-kib 4 --req-blocks 64 --requests 3.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

try:
    import resource
except ImportError:  # not on every platform
    resource = None  # type: ignore[assignment]

from . import Client
from .bench import _find, _start
from .nixl import _indices, host_array, nixl_agent, nixl_agent_config

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


class Side:
    """One agent's KV cache: per layer one [2, blocks, block_len] allocation, K and V its regions
    (host memory: `caches` if given)."""

    def __init__(self, name: str, endpoint: str, layers: int, blocks: int, block_len: int, cuda: Optional[int],
                 caches: Optional[List[Any]] = None):
        self.blocks, self.block_len = blocks, block_len
        mem = "VRAM" if cuda is not None else "DRAM"
        if cuda is None:
            self.caches = caches or [host_array(2 * blocks * block_len).reshape(2, blocks, block_len) for _ in range(layers)]
            bases = [int(c[kv].ctypes.data) for c in self.caches for kv in (0, 1)]
        else:
            import torch

            self.caches = [torch.empty((2, blocks, block_len), dtype=torch.uint8, device=f"cuda:{cuda}") for _ in range(layers)]
            bases = [int(c[kv].data_ptr()) for c in self.caches for kv in (0, 1)]
        self.bases, self.mem, self.dev = bases, mem, cuda or 0
        self.agent = nixl_agent(name, nixl_agent_config(capture_telemetry=True, endpoint=endpoint))
        self.reg = self.agent.register_memory([(b, blocks * block_len, self.dev, "") for b in bases], mem)
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self.blocks_data(bases, self.dev), mem)

    def blocks_data(self, bases: List[int], dev: int) -> np.ndarray:
        starts = (np.array(bases, dtype=np.uint64)[:, None]
                  + np.arange(self.blocks, dtype=np.uint64)[None, :] * np.uint64(self.block_len)).reshape(-1)
        return np.stack([starts, np.full_like(starts, self.block_len), np.full_like(starts, dev)], axis=1)

    def desc_ids(self, block_ids: np.ndarray) -> np.ndarray:
        return (np.arange(len(self.bases))[:, None] * self.blocks + block_ids[None, :]).reshape(-1)

    def close(self) -> None:
        self.agent.release_dlist_handle(self.local)
        self.agent.deregister_memory(self.reg)
        self.agent.close()


class Peer:
    """The prefill side in a process of its own, as vLLM's is (its agent's session reader and
    notification threads do not compete with the decode side's for this process's GIL): forked on
    host memory (its caches allocated here first, shared pages, so the bytes read can be checked),
    spawned on GPU memory. `.agent` stays None; `metadata`, `bases`, `dev`, `mem` are its agent's."""

    def __init__(self, endpoint: str, layers: int, blocks: int, block_len: int, cuda: Optional[int], rng: Any):
        import multiprocessing as mp

        self.caches: Optional[List[Any]] = None
        if cuda is None:
            self.caches = [host_array(2 * blocks * block_len).reshape(2, blocks, block_len) for _ in range(layers)]
            for c in self.caches:
                c[:] = rng.integers(0, 256, c.shape, dtype=np.uint8)
        ctx = mp.get_context("spawn") if cuda is not None else mp.get_context("fork")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_peer_main, args=(child, endpoint, layers, blocks, block_len, cuda, self.caches),
                                 name="nixl-bench-prefill", daemon=True)
        self._proc.start()
        child.close()
        if not self._conn.poll(300):
            raise SystemExit("the prefill process did not start its agent in 300 s")
        try:
            got = self._conn.recv()
        except EOFError:
            raise SystemExit(f"the prefill process ended before its agent started (exit code {self._proc.exitcode})") from None
        if isinstance(got, str):
            raise SystemExit(f"the prefill process failed: {got}")
        self.metadata, self.bases, self.dev, self.mem = got

    def close(self) -> None:
        try:
            self._conn.send("close")
            self._conn.recv()
        except (EOFError, OSError):
            pass
        self._proc.join(30)


def _peer_main(conn: Any, endpoint: str, layers: int, blocks: int, block_len: int, cuda: Optional[int],
               caches: Optional[List[Any]]) -> None:
    try:
        side = Side("bench-prefill", endpoint, layers, blocks, block_len, cuda, caches)
    except BaseException as e:  # noqa: BLE001 - told to the parent
        conn.send(f"{type(e).__name__}: {e}")
        return
    conn.send((side.agent.get_agent_metadata(), side.bases, side.dev, side.mem))
    conn.recv()
    side.close()
    conn.send("closed")


class InProcessPeer:
    """The prefill side in this process (--peer-in-process)."""

    def __init__(self, endpoint: str, layers: int, blocks: int, block_len: int, cuda: Optional[int], rng: Any):
        self.side = Side("bench-prefill", endpoint, layers, blocks, block_len, cuda)
        self.caches = self.side.caches if cuda is None else None
        if cuda is None:
            for c in self.side.caches:
                c[:] = rng.integers(0, 256, c.shape, dtype=np.uint8)
        self.metadata = self.side.agent.get_agent_metadata()
        self.bases, self.dev, self.mem = self.side.bases, self.side.dev, self.side.mem

    def close(self) -> None:
        self.side.close()


def _thread_usage() -> Tuple[int, int, int]:
    """This thread's (minor page faults, voluntary context switches, involuntary ones) so far;
    zeros where the platform does not count them per thread."""
    who = getattr(resource, "RUSAGE_THREAD", None) if resource is not None else None
    if who is None:
        return 0, 0, 0
    r = resource.getrusage(who)
    return r.ru_minflt, r.ru_nvcsw, r.ru_nivcsw


def request(d: Side, remote: Any, local_ids: np.ndarray, remote_ids: np.ndarray, notif: bytes) -> Dict[str, Any]:
    """One vLLM READ request; the seconds spent in each call and until DONE (the descriptor ids
    are computed before: that is vLLM's work, not the agent's), and the page faults, voluntary
    context switches (the GIL handed to another thread and waited for, a blocked send) and
    involuntary ones (preempted: a busy machine) of make_prepped_xfer + transfer + the first
    check_xfer_state."""
    lids, rids = d.desc_ids(local_ids), d.desc_ids(remote_ids)
    u0 = _thread_usage()
    cpu0 = time.thread_time()
    t0 = time.perf_counter()
    h = d.agent.make_prepped_xfer("READ", d.local, lids, remote, rids, notif_msg=notif)
    t1 = time.perf_counter()
    d.agent.transfer(h)
    t2 = time.perf_counter()
    state = d.agent.check_xfer_state(h)
    check_s = time.perf_counter() - t2
    cpu = time.thread_time() - cpu0
    u1 = _thread_usage()
    checks = 1
    while state == "PROC":
        time.sleep(0)  # yield the GIL: the session's reader thread resolves the transfer
        c0 = time.perf_counter()
        state = d.agent.check_xfer_state(h)
        check_s += time.perf_counter() - c0
        checks += 1
    t3 = time.perf_counter()
    if state != "DONE":
        raise SystemExit(f"request failed: {state}: {h.error}")
    plan = h._xfer.plan
    d.agent.release_xfer_handle(h)
    return {"make": t1 - t0, "post": t2 - t1, "check": check_s / checks, "total": t3 - t0,
            "cpu": cpu, "faults": u1[0] - u0[0], "switches": u1[1] - u0[1], "preempted": u1[2] - u0[2],
            "path": plan.path, "parts": plan.parts, "entries": plan.entries,
            "outer": 0 if plan.prepared is None else (plan.prepared.lo is not None) + (plan.prepared.ro is not None),
            "ring": 0 if plan.prepared is None else plan.prepared.windowed}


def remake(d: Side, remote: Any, local_ids: np.ndarray, remote_ids: np.ndarray, notif: bytes) -> Tuple[float, float]:
    """A request, then make_prepped_xfer of its arrays again, twice (each released unposted): the
    seconds the first took, right after the request (the caches as the request left them), and
    the second (the same calls at once: warm)."""
    request(d, remote, local_ids, remote_ids, notif)
    lids, rids = d.desc_ids(local_ids), d.desc_ids(remote_ids)
    took = []
    for _ in range(2):
        t0 = time.perf_counter()
        h = d.agent.make_prepped_xfer("READ", d.local, lids, remote, rids, notif_msg=notif)
        took.append(time.perf_counter() - t0)
        d.agent.release_xfer_handle(h)
    return took[0], took[1]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tcpxd.nixl_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", help="the decode side's daemon (default: start two daemons)")
    p.add_argument("--peer-endpoint", help="the prefill side's daemon")
    p.add_argument("--tcpxd", help="the daemon binary to start (default target/{release,debug}/tcpxd)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks", type=int, default=4096, help="blocks per region")
    p.add_argument("--block-kib", type=int, default=16)
    p.add_argument("--req-blocks", type=int, default=512, help="blocks READ per region per request")
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--ids", choices=("random", "contiguous"), default="random")
    p.add_argument("--cuda", action="store_true", help="KV caches in GPU memory (torch)")
    p.add_argument("--cuda-device", type=int, default=0)
    p.add_argument("--peer-cuda-device", type=int, default=None, help="default: 1 if there are two GPUs, else 0")
    p.add_argument("--peer-in-process", action="store_true",
                   help="run the prefill agent in this process (default: a process of its own, as vLLM's)")
    p.add_argument("--packed-indices", action="store_true",
                   help="send every index array packed in the request, never as outer sums or through the index ring "
                        "(the request as before; for comparison)")
    p.add_argument("--json", help="append the results as one JSON line to this file")
    a = p.parse_args(argv)
    block_len = a.block_kib * KIB
    if a.packed_indices:
        _indices.OUTER_MIN = _indices.WINDOW_MIN = 1 << 62
    if a.req_blocks > a.blocks:
        raise SystemExit("--req-blocks cannot exceed --blocks")
    procs = []
    if a.endpoint is None:
        tcpxd = _find("tcpxd", a.tcpxd)
        if tcpxd is None:
            raise SystemExit("no tcpxd binary: build it (cargo build --release) or pass --tcpxd / --endpoint")
        tmp = Path(tempfile.mkdtemp(prefix="tcpxd-nixl-bench-"))
        for name in ("decode", "prefill"):
            procs.append(_start(tcpxd, tmp, name)[0])
        a.endpoint, a.peer_endpoint = f"unix:{tmp}/decode.sock", f"unix:{tmp}/prefill.sock"
    elif a.peer_endpoint is None:
        raise SystemExit("--peer-endpoint is needed with --endpoint")
    dcuda = pcuda = None
    if a.cuda:
        import torch

        dcuda = a.cuda_device
        pcuda = a.peer_cuda_device if a.peer_cuda_device is not None else (1 if torch.cuda.device_count() > 1 else 0)
    try:
        return run(a, block_len, dcuda, pcuda)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def run(a: argparse.Namespace, block_len: int, dcuda: Optional[int], pcuda: Optional[int]) -> int:
    rng = np.random.default_rng(0)
    # The prefill side first: forked before this process has a gRPC channel or a CUDA context.
    prefill = (InProcessPeer if a.peer_in_process else Peer)(a.peer_endpoint, a.layers, a.blocks, block_len, pcuda, rng)
    decode = Side("bench-decode", a.endpoint, a.layers, a.blocks, block_len, dcuda)
    name = decode.agent.add_remote_agent(prefill.metadata)
    t0 = time.perf_counter()
    remote = decode.agent.prep_xfer_dlist(name, decode.blocks_data(prefill.bases, prefill.dev), prefill.mem)
    prep_s = time.perf_counter() - t0
    regions = 2 * a.layers
    req_bytes = regions * a.req_blocks * block_len

    def ids() -> np.ndarray:
        if a.ids == "contiguous":
            start = int(rng.integers(0, a.blocks - a.req_blocks + 1))
            return np.arange(start, start + a.req_blocks)
        return rng.choice(a.blocks, a.req_blocks, replace=False)

    request(decode, remote, ids(), ids(), b"warm:1")  # pairs the nodes
    rows = []
    for i in range(a.requests):
        li, ri = ids(), ids()
        rows.append(request(decode, remote, li, ri, f"req-{i}:1".encode()))
        if prefill.caches is not None and i == 0:  # bytes checked once
            for r in range(regions):
                got = decode.caches[r // 2][r % 2][li]
                want = prefill.caches[r // 2][r % 2][ri]
                if not np.array_equal(got, want):
                    raise SystemExit(f"region {r}: the blocks read differ from the prefill side's")
    small = [request(decode, remote, ids()[:1], ids()[:1], f"small-{i}:1".encode()) for i in range(max(3, a.requests))]
    # Apart from the timed requests (it would warm the next one): make_prepped_xfer of a request's
    # arrays again right after the request finished, then once more at once, both released unposted.
    remakes = [remake(decode, remote, ids(), ids(), f"remake-{i}:1".encode()) for i in range(max(3, a.requests // 3))]
    # All the requests in flight at once (as a decode step posts every ready request, then polls).
    t0 = time.perf_counter()
    hs = [decode.agent.make_prepped_xfer("READ", decode.local, decode.desc_ids(ids()), remote, decode.desc_ids(ids()),
                                         notif_msg=f"many-{i}:1".encode()) for i in range(a.requests)]
    for h in hs:
        decode.agent.transfer(h)
    while any(decode.agent.check_xfer_state(h) == "PROC" for h in hs):
        time.sleep(0)
    many_s = time.perf_counter() - t0
    if any(decode.agent.check_xfer_state(h) != "DONE" for h in hs):
        raise SystemExit(f"a request in flight failed: {[h.error for h in hs if h.error]}")
    for h in hs:
        decode.agent.release_xfer_handle(h)
    # The baseline: the same bytes in one contiguous READ between the same daemons.
    with Client(a.endpoint) as dc, Client(a.peer_endpoint) as pc:
        if dcuda is None:
            lb, rb = dc.register_host(req_bytes), pc.register_host(req_bytes)
        else:
            lb, rb = dc.allocate_cuda(req_bytes, dcuda), pc.allocate_cuda(req_bytes, pcuda or 0)
        dc.read(rb.descriptor, lb, req_bytes)
        base = []
        for _ in range(a.requests):
            t0 = time.perf_counter()
            dc.read(rb.descriptor, lb, req_bytes)
            base.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for t in [dc.read(rb.descriptor, lb, req_bytes, wait=False) for _ in range(a.requests)]:
            t.result()
        base_many_s = time.perf_counter() - t0
        lb.release()
        rb.release()
    decode.agent.release_dlist_handle(remote)
    decode.close()
    prefill.close()

    med = statistics.median
    nixl_gbps = req_bytes / med([r["total"] for r in rows]) / 1e9
    base_gbps = req_bytes / med(base) / 1e9
    over = med([r["make"] + r["post"] + r["check"] for r in rows]) * 1e6
    over_small = med([r["make"] + r["post"] + r["check"] for r in small]) * 1e6
    mem = "VRAM" if dcuda is not None else "DRAM"
    descs = regions * a.req_blocks
    print(f"pattern   {a.layers} layers x 2 regions x {a.blocks} blocks of {a.block_kib} KiB ({mem}); "
          f"{a.req_blocks} {a.ids} blocks per region per request = {descs} descriptors, {req_bytes / MIB:.0f} MiB")
    print(f"prepare   remote list of {regions * a.blocks} descriptors: {prep_s * 1e3:.1f} ms")
    print("indices   " + ("vLLM's form looked for by the C pass (tcpxd._native)" if _indices._native is not None else
                          "no C pass (tcpxd._native not built, or TCPXD_NATIVE=0): numpy and the index ring"))
    r0 = rows[0]
    what = {"prepared": "prepared-list request", "blocks": "block requests of granule ranges"}.get(r0["path"], "batch requests")
    unit = {"prepared": "indices", "blocks": "ranges"}.get(r0["path"], "entries")
    outer = (f"; {r0['outer']} of 2 sides as outer sums, {r0['ring']} through the index ring"
             if r0["path"] == "prepared" else "")
    print(f"daemon    {r0['parts']} {what} per request ({r0['entries']} {unit}, both sides{outer})")
    print(f"nixl      READ by indices   {nixl_gbps:7.2f} GB/s   (median of {a.requests}; make {med([r['make'] for r in rows]) * 1e3:.2f} ms, "
          f"transfer {med([r['post'] for r in rows]) * 1e3:.2f} ms, check {med([r['check'] for r in rows]) * 1e6:.1f} us)")
    print(f"tcpxd     contiguous READ   {base_gbps:7.2f} GB/s   (median of {a.requests})")
    ratio = nixl_gbps / base_gbps
    print(f"ratio     {ratio:.2f}x (target >= 0.9x): {'met' if ratio >= 0.9 else 'not met'}")
    many_gbps, base_many_gbps = a.requests * req_bytes / many_s / 1e9, a.requests * req_bytes / base_many_s / 1e9
    print(f"in flight {a.requests} requests at once: nixl {many_gbps:.2f} GB/s, contiguous READs {base_many_gbps:.2f} GB/s "
          f"({many_gbps / base_many_gbps:.2f}x)")
    print(f"python    make_prepped_xfer + transfer + check_xfer_state: {over:.0f} us per {descs}-descriptor request, "
          f"{over_small:.0f} us per {regions}-descriptor request (target <= 100 us): {'met' if over <= 100 else 'not met'}")

    def usage(rs: List[Dict[str, Any]]) -> str:
        def share(k: str) -> int:
            return sum(1 for r in rs if r[k]) * 100 // len(rs)
        cpu, faults = med([r["cpu"] for r in rs]) * 1e6, med([r["faults"] for r in rs])
        return (f"{cpu:.0f} us of thread CPU time, {faults:.0f} page faults; context switches in {share('switches')}% "
                f"of them (voluntary: the GIL or a send waited for), preempted in {share('preempted')}%")

    print(f"          in those calls, per {descs}-descriptor request: {usage(rows)}")
    print(f"          per {regions}-descriptor request: {usage(small)}")
    after, again = med([r[0] for r in remakes]) * 1e6, med([r[1] for r in remakes]) * 1e6
    print(f"          make_prepped_xfer alone, {descs} descriptors: {after:.0f} us right after a request, {again:.0f} us "
          f"made again at once (same calls, same arrays: the difference is the cache state the request left)")
    if a.json:
        with open(a.json, "a") as f:
            f.write(json.dumps({"layers": a.layers, "blocks": a.blocks, "block_kib": a.block_kib, "req_blocks": a.req_blocks,
                                "ids": a.ids, "mem": mem, "descriptors": descs, "bytes": req_bytes,
                                "nixl_gbps": nixl_gbps, "contiguous_gbps": base_gbps, "ratio": ratio,
                                "inflight_nixl_gbps": many_gbps, "inflight_contiguous_gbps": base_many_gbps,
                                "python_us": over, "python_us_small": over_small, "prep_ms": prep_s * 1e3,
                                "make_after_us": after, "make_again_us": again,
                                "python_cpu_us": med([r["cpu"] for r in rows]) * 1e6,
                                "python_cpu_us_small": med([r["cpu"] for r in small]) * 1e6,
                                "switches": med([r["switches"] for r in rows]), "switches_small": med([r["switches"] for r in small]),
                                "path": rows[0]["path"], "parts": rows[0]["parts"],
                                "outer_sides": rows[0]["outer"], "ring": rows[0]["ring"],
                                "packed_indices": a.packed_indices}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
