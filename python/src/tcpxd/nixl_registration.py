"""`python -m tcpxd.nixl_registration`: what `register_memory` and `deregister_memory` cost a region,
on tcpxd.nixl and, when it is installed (`pip install nixl`), on real NIXL, alternating, in one run
(issue #39 point 5: registration at ≤ 2× NIXL's time a region).

For each kind of memory, region size and region count (--memory, --sizes, --counts; combinations
over --max-total bytes are left out), a fresh process allocates the regions, writes every byte
(--fresh: leaves them untouched), then times one `register_memory` of all of them and one
`deregister_memory`, in microseconds a region. Kinds of memory:

- `numpy`: one numpy array a region (ordinary process memory: tcpxd registers it by address);
- `memfd`: one memfd a region, mapped shared (tcpxd: handed to the daemon by file descriptor).

Each implementation gets the same memory. tcpxd runs on one daemon the script starts on the
built-in emulation (--tcpxd, else target/{release,debug}/tcpxd; --state-dir gives it a restart
journal, as deployments have); real NIXL with one UCX backend (UCX_TLS=tcp unless set). Times are
medians over --rounds, each round running every implementation once, alternating; compare within
one run on a shared machine.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import mmap
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

Case = Tuple[str, int, int]  # (memory kind, region size, region count)


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(t[:-1]) * units[t[-1]] if t and t[-1] in units else int(t)


def _label(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _agent(impl: str) -> Any:
    api: Any = importlib.import_module("tcpxd.nixl" if impl == "tcpxd" else "nixl._api")
    return api.nixl_agent("registrar", api.nixl_agent_config(backends=["UCX"]))


def _regions(kind: str, size: int, count: int, fresh: bool) -> Tuple[List[int], List[Any]]:
    """Addresses of `count` regions of `size` bytes and what keeps them alive."""
    import numpy as np

    keep: List[Any] = []
    addrs: List[int] = []
    for _ in range(count):
        if kind == "numpy":
            a = np.empty(size, dtype=np.uint8)
            if not fresh:
                a.fill(1)
            keep.append(a)
            addrs.append(int(a.ctypes.data))
        else:
            fd = os.memfd_create("tcpxd-reg-bench", os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 2))
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if not fresh:
                ctypes.memset(ctypes.addressof(ctypes.c_char.from_buffer(mm)), 1, size)
            view = np.frombuffer(mm, dtype=np.uint8)
            keep.append((fd, mm, view))
            addrs.append(int(view.ctypes.data))
    return addrs, keep


def _free(kind: str, keep: List[Any]) -> None:
    if kind == "memfd":
        for fd, _, _ in keep:
            os.close(fd)
    keep.clear()


def child(impl: str, endpoint: str, cases: List[Case], fresh: bool, out: Any) -> None:
    if endpoint:
        os.environ["TCPXD_ENDPOINT"] = endpoint
    agent = _agent(impl)
    res: Dict[str, float] = {}
    # One region registered and released first: what a first registration sets up (the local
    # session, /proc reads' first page cache misses) is not charged to the first case.
    addrs, keep = _regions("numpy", 1 << 16, 1, False)
    agent.deregister_memory(agent.register_memory(agent.get_reg_descs([(addrs[0], 1 << 16, 0, "")], "DRAM")))
    _free("numpy", keep)
    for kind, size, count in cases:
        addrs, keep = _regions(kind, size, count, fresh)
        descs = agent.get_reg_descs([(a, size, 0, "") for a in addrs], "DRAM")
        t = time.perf_counter()
        reg = agent.register_memory(descs)
        t1 = time.perf_counter()
        agent.deregister_memory(reg)
        t2 = time.perf_counter()
        name = f"{kind} {count} x {_label(size)}"
        res[f"register µs/region, {name}"] = (t1 - t) / count * 1e6
        res[f"deregister µs/region, {name}"] = (t2 - t1) / count * 1e6
        _free(kind, keep)
    out.send(res)


def run_once(impl: str, endpoint: str, cases: List[Case], fresh: bool) -> Dict[str, float]:
    ctx = mp.get_context("spawn")
    rx, tx = ctx.Pipe(duplex=False)
    p = ctx.Process(target=child, args=(impl, endpoint, cases, fresh, tx))
    p.start()
    try:
        if not rx.poll(900):
            raise RuntimeError(f"{impl}: no result within 900 s")
        return dict(rx.recv())
    finally:
        p.join(30)
        if p.is_alive():
            p.kill()


def cases_of(memory: List[str], sizes: List[int], counts: List[int], max_total: int) -> List[Case]:
    return [(k, s, n) for k in memory for n in counts for s in sizes if s * n <= max_total]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tcpxd.nixl_registration", description=__doc__.split("\n\n")[0])
    p.add_argument("--impl", choices=["both", "tcpxd", "nixl"], default="both")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--memory", default="numpy,memfd", help="kinds of memory, of numpy and memfd")
    p.add_argument("--sizes", default="64K,1M,16M", help="region sizes")
    p.add_argument("--counts", default="1,64,1024", help="regions registered together")
    p.add_argument("--max-total", default="1G", help="leave out combinations of more bytes than this")
    p.add_argument("--fresh", action="store_true", help="register memory never written (its pages not allocated yet)")
    p.add_argument("--tcpxd", default=None, help="the daemon binary (default target/{release,debug}/tcpxd)")
    p.add_argument("--state-dir", action="store_true", help="run the daemon with a restart journal (--state-dir)")
    a = p.parse_args(argv)
    from .bench import _find, _start

    memory = [m.strip() for m in a.memory.split(",") if m.strip()]
    if any(m not in ("numpy", "memfd") for m in memory):
        raise SystemExit(f"--memory: {a.memory!r}: kinds are numpy and memfd")
    cases = cases_of(memory, [_size(s) for s in a.sizes.split(",")], [int(c) for c in a.counts.split(",")],
                     _size(a.max_total))
    if not cases:
        raise SystemExit("no combination of --sizes and --counts fits --max-total")
    impls = ["tcpxd", "nixl"] if a.impl == "both" else [a.impl]
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
    os.environ.setdefault("UCX_TLS", "tcp")
    proc = None
    endpoint = ""
    if "tcpxd" in impls:
        binary = _find("tcpxd", a.tcpxd)
        if binary is None:
            raise SystemExit("no tcpxd binary (cargo build, or --tcpxd)")
        d = Path(tempfile.mkdtemp(prefix="tcpxd-nixl-reg-"))
        extra = ["--state-dir", str(d / "state")] if a.state_dir else []
        proc = _start(binary, d, "reg", extra)[0]
        endpoint = f"unix:{d}/reg.sock"
    results: Dict[str, List[Dict[str, float]]] = {i: [] for i in impls}
    try:
        for r in range(a.rounds):
            for impl in impls:
                results[impl].append(run_once(impl, endpoint, cases, a.fresh))
                print(f"round {r + 1} {impl}: done", file=sys.stderr, flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    names = {"tcpxd": "tcpxd.nixl", "nixl": f"NIXL (UCX_TLS={os.environ['UCX_TLS']})"}
    written = "never written" if a.fresh else "written"
    print(f"{'(' + written + '; median of ' + str(a.rounds) + ' rounds, range)':44} "
          + " ".join(f"{names[i]:>28}" for i in impls) + ("   tcpxd / NIXL" if len(impls) == 2 else ""))
    for k in results[impls[0]][0]:
        meds, cells = [], []
        for i in impls:
            xs = [res[k] for res in results[i]]
            meds.append(statistics.median(xs))
            cells.append(f"{statistics.median(xs):10.3g} [{min(xs):.3g}-{max(xs):.3g}]")
        ratio = f"   {meds[0] / meds[1]:.2f}x" if len(impls) == 2 and meds[1] else ""
        print(f"{k:44} " + " ".join(f"{c:>28}" for c in cells) + ratio)
    return 0


if __name__ == "__main__":
    sys.exit(main())
