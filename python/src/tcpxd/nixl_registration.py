"""`python -m tcpxd.nixl_registration`: what `register_memory` and `deregister_memory` cost a region,
on tcpxd.nixl and, when it is installed (`pip install nixl`), on real NIXL, alternating, in one run
(issue #39 point 5: registration at ≤ 2× NIXL's time a region).

For each kind of memory, region size and region count (--memory, --sizes, --counts; combinations
over --max-total bytes are left out), a fresh process allocates the regions, writes every byte
(--fresh: leaves them untouched), then times one `register_memory` of all of them and one
`deregister_memory`, in microseconds a region; then `register_memory` again until its regions
are answered (tcpxd.nixl's `register_memory` holds the regions back and returns before the daemon
has them: the agent's next use of its regions sends them and reads the answers first, timed here
by that use, `_memory.table()`; docs/NIXL.md, "Semantics"; NIXL's returns registered) and
`deregister_memory` after that use ("deregister after use": tcpxd.nixl's plain "deregister"
right after `register_memory` withdraws regions the daemon never had). Each figure is the median
of as many rounds of that as make 64 regions, at least 3, each on new memory (the "answered"
registration is that memory's second, which NIXL answers from what it kept). The "caller's CPU"
rows are the CPU time of the thread calling `register_memory` (on a machine with few cores the
daemon woken by the send can preempt the caller: wall time then includes the daemon's work).
Kinds of memory:

- `numpy`: one numpy array a region (ordinary process memory: tcpxd registers it by address);
- `memfd`: one memfd a region, mapped shared (tcpxd: handed to the daemon by file descriptor).

Each implementation gets the same memory. tcpxd runs on one daemon the script starts on the
built-in emulation (--tcpxd, else target/{release,debug}/tcpxd; --state-dir gives it a restart
journal, as deployments have, on /dev/shm where there is one: tmpfs, as they keep it); real NIXL
with one UCX backend (UCX_TLS=tcp unless set).
--baseline PYTHONPATH:BINARY adds a column for another tcpxd (another checkout's python/src and
daemon: before and after a change in one run). Each measurement runs in a fresh interpreter. Times
are medians over --rounds, each round running every column once, alternating; compare within one
run on a shared machine. --warm times the calls alone: each round registers and deregisters its
regions, nothing between (without it, each round's first use and release come between the timed
calls, as in a program, which leave tcpxd's code and the kernel's cold: the daemon's work and the
first use's Python run in between; NIXL's have neither).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import mmap
import json
import os
import shutil
import statistics
import subprocess
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


def child(impl: str, endpoint: str, cases: List[Case], fresh: bool, warm: bool = False) -> Dict[str, float]:
    """Times every case on a fresh agent of `impl` (run in a process of its own); `warm`: each
    round registers and deregisters only (no first use between the timed calls)."""
    if endpoint:
        os.environ["TCPXD_ENDPOINT"] = endpoint
    agent = _agent(impl)
    res: Dict[str, float] = {}
    # One region registered and released first: what a first registration sets up (the local
    # session, /proc reads' first page cache misses) is not charged to the first case.
    # (And a prepared list made and released: tcpxd.nixl's first opens the agent's session.)
    addrs, keep = _regions("numpy", 1 << 16, 1, False)
    reg = agent.register_memory(agent.get_reg_descs([(addrs[0], 1 << 16, 0, "")], "DRAM"))
    agent.release_dlist_handle(agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(addrs[0], 1 << 16, 0)], "DRAM"))
    agent.deregister_memory(reg)
    _free("numpy", keep)
    for kind, size, count in cases:
        # As many rounds as make 64 regions, at least 3: the median of those (one registration
        # alone is too short to time once on a shared machine). New memory each round (NIXL's
        # UCX keeps what it registered: the same memory again costs it a lookup).
        times: Dict[str, List[float]] = {}
        for _ in range(max(3, 64 // count)):
            addrs, keep = _regions(kind, size, count, fresh)
            descs = agent.get_reg_descs([(a, size, 0, "") for a in addrs], "DRAM")
            # (the CPU clock, a system call, read outside the wall clock's interval)
            c = time.thread_time()
            t = time.perf_counter()
            reg = agent.register_memory(descs)
            t1 = time.perf_counter()
            c1 = time.thread_time()
            agent.deregister_memory(reg)
            t2 = time.perf_counter()
            name = f"{kind} {count} x {_label(size)}"
            if warm:  # (--warm: the calls alone, back to back, round after round)
                for k, v in ((f"register µs/region, {name}", t1 - t), (f"register, caller's CPU µs/region, {name}", c1 - c),
                             (f"deregister µs/region, {name}", t2 - t1)):
                    times.setdefault(k, []).append(v / count * 1e6)
                _free(kind, keep)
                continue
            # Registered and answered: until the regions are in the agent's table, as any first
            # use needs them (tcpxd.nixl's register_memory holds them back: that use sends them
            # and reads the answers; NIXL's returns registered).
            answered = getattr(getattr(agent, "_memory", None), "table", lambda: None)
            t3 = time.perf_counter()
            reg = agent.register_memory(descs)
            answered()
            t4 = time.perf_counter()
            agent.deregister_memory(reg)
            t5 = time.perf_counter()
            for k, v in ((f"register µs/region, {name}", t1 - t), (f"register, caller's CPU µs/region, {name}", c1 - c),
                         (f"register, answered µs/region, {name}", t4 - t3), (f"deregister µs/region, {name}", t2 - t1),
                         (f"deregister after use µs/region, {name}", t5 - t4)):
                times.setdefault(k, []).append(v / count * 1e6)
            _free(kind, keep)
        res.update({k: statistics.median(v) for k, v in times.items()})
        # (and the first round alone: a region size's first registration in the process, code
        # and caches cold, as an application registering its memory once at start-up sees it)
        res[f"register, first round µs/region, {name}"] = times[f"register µs/region, {name}"][0]
    return res


#: How the parent runs `child` in a fresh interpreter: this file by path (not the package's
#: module: a baseline's package, on PYTHONPATH, may predate it), its answer one JSON line.
_RUN_CHILD = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"


def run_once(impl: str, endpoint: str, cases: List[Case], fresh: bool, pythonpath: str = "",
             warm: bool = False) -> Dict[str, float]:
    """`child` in a process of its own (`pythonpath`: where its `tcpxd` package comes from)."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    args = [sys.executable, "-c", _RUN_CHILD, __file__, "--child", impl, "--endpoint", endpoint,
            "--cases", json.dumps(cases)] + (["--fresh"] if fresh else []) + (["--warm"] if warm else [])
    run = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
    if run.returncode != 0:
        raise RuntimeError(f"{impl}: the measuring process failed:\n{run.stdout}{run.stderr}")
    return dict(json.loads(run.stdout.strip().splitlines()[-1]))


def _how_kinds_are_found() -> str:
    """How this package tells memory by address from memory a file backs, here (the kernel's
    PROCMAP_QUERY, Linux 6.11+, needs the C extension; else one read of /proc/self/maps a call)."""
    import array

    from . import _addresses
    from ._native_gate import native

    _addresses.address_kinds(array.array("Q", [id(object())]))
    if _addresses._procmap:
        return f"tcpxd: the kind of each region's memory from PROCMAP_QUERY (kernel {os.uname().release})"
    why = "no C extension (tcpxd._native)" if native is None else f"kernel {os.uname().release} has no PROCMAP_QUERY"
    return f"tcpxd: the kind of each region's memory from /proc/self/maps ({why})"


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
    p.add_argument("--warm", action="store_true",
                   help="each round only registers and deregisters (no first use between the timed calls: their own "
                        "cost, caches warm); no 'answered' or 'after use' rows")
    p.add_argument("--tcpxd", default=None, help="the daemon binary (default target/{release,debug}/tcpxd)")
    p.add_argument("--state-dir", action="store_true", help="run the daemons with a restart journal (--state-dir)")
    p.add_argument("--baseline", default=None, metavar="PYTHONPATH:BINARY",
                   help="a column for another tcpxd: its Python package's directory (python/src of another "
                        "checkout) and daemon binary, e.g. /work/main/python/src:/tmp/tcpxd-main")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    p.add_argument("--cases", default="[]", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        cases = [(str(k), int(s), int(n)) for k, s, n in json.loads(a.cases)]
        print(json.dumps(child(a.child, a.endpoint, cases, a.fresh, a.warm)))
        return 0
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
    # (column, implementation, daemon binary, PYTHONPATH of its package)
    columns: List[Tuple[str, str, str, str]] = []
    if "tcpxd" in impls:
        binary = _find("tcpxd", a.tcpxd)
        if binary is None:
            raise SystemExit("no tcpxd binary (cargo build, or --tcpxd)")
        columns.append(("tcpxd.nixl", "tcpxd", binary, os.environ.get("PYTHONPATH", "")))
        if a.baseline:
            path, _, other = a.baseline.partition(":")
            if not path or not other:
                raise SystemExit(f"--baseline: {a.baseline!r} is not PYTHONPATH:BINARY")
            columns.append(("baseline tcpxd.nixl", "tcpxd", other, path))
    if "nixl" in impls:
        columns.append((f"NIXL (UCX_TLS={os.environ['UCX_TLS']})", "nixl", "", os.environ.get("PYTHONPATH", "")))
    procs = []
    scratch: List[Path] = []
    endpoints: Dict[str, str] = {}
    results: Dict[str, List[Dict[str, float]]] = {c[0]: [] for c in columns}
    try:
        for n, (name, impl, binary, _) in enumerate(columns):
            if impl == "tcpxd":
                d = Path(tempfile.mkdtemp(prefix="tcpxd-nixl-reg-"))
                # On tmpfs where there is one, as deployments keep it (/run/tcpxd/state): a state
                # directory on disk costs the journal's file writes ~1 ms each here.
                shm = Path("/dev/shm")
                state = Path(tempfile.mkdtemp(prefix="tcpxd-nixl-reg-state-", dir=shm if shm.is_dir() else d))
                scratch.append(state)
                extra = ["--state-dir", str(state)] if a.state_dir else []
                procs.append(_start(binary, d, f"reg{n}", extra)[0])
                endpoints[name] = f"unix:{d}/reg{n}.sock"
        for r in range(a.rounds):
            for name, impl, _, path in columns:
                results[name].append(run_once(impl, endpoints.get(name, ""), cases, a.fresh, path, a.warm))
                print(f"round {r + 1} {name}: done", file=sys.stderr, flush=True)
    finally:
        for pr in procs:
            pr.terminate()
            pr.wait()
        for state in scratch:
            shutil.rmtree(state, ignore_errors=True)
    names = [c[0] for c in columns]
    ratio_of = (names[0], names[-1]) if len(columns) > 1 and columns[-1][1] == "nixl" and columns[0][1] == "tcpxd" else None
    written = "never written" if a.fresh else "written"
    print(f"{'(' + written + '; median of ' + str(a.rounds) + ' rounds, range)':44} "
          + " ".join(f"{col:>28}" for col in names) + ("   tcpxd / NIXL" if ratio_of else ""))
    for k in results[names[0]][0]:
        meds: Dict[str, float] = {}
        cells = []
        for col in names:
            xs = [res[k] for res in results[col]]
            meds[col] = statistics.median(xs)
            cells.append(f"{meds[col]:10.3g} [{min(xs):.3g}-{max(xs):.3g}]")
        ratio = f"   {meds[ratio_of[0]] / meds[ratio_of[1]]:.2f}x" if ratio_of and meds[ratio_of[1]] else ""
        print(f"{k:44} " + " ".join(f"{c:>28}" for c in cells) + ratio)
    if "tcpxd" in impls:
        print(_how_kinds_are_found())
    return 0


if __name__ == "__main__":
    sys.exit(main())
