#!/usr/bin/env python3
"""Runs NIXL's own Python examples and tests against tcpxd.nixl, with only the import swapped.

    tools/nixl-upstream/run.py /path/to/nixl-checkout [--tcpxd target/debug/tcpxd] [--python PY]

It fetches nothing: give it a checkout of ai-dynamo/nixl (docs/NIXL.md names the commit these
results are for). It starts two tcpxd daemons on the built-in emulation in a temporary directory,
writes the `nixl` shim there (`python -m tcpxd.nixl install-shim`), puts it first on PYTHONPATH
(then this checkout's python/src), and runs, with the Python given (it needs numpy, pytest and,
for two examples and the API tests, torch):

- the examples that move DRAM over a network backend (UCX): basic_two_peers.py and
  expanded_two_peers.py as a target process on daemon a and an initiator on daemon b, the
  metadata exchanged through their listeners; partial_md_example.py (two agents, one process);
- test/python's scripts desc_perf.py and prep_xfer_perf.py (list and array);
- test/python's pytest files (test_nixl_api.py, test_nixl_bindings.py), test by test.

It prints PASS / FAIL / SKIP per script and per test (a script passes when it exits 0 within the
time limit and printed no NIXL ERROR line; a failure's last lines follow it) and exits 1 if any
failed. The examples it does not run (storage plugins, the telemetry reader) are listed with why.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[2]

#: Examples not run, and why.
NOT_RUN = {
    "examples/python/nixl_gds_example.py": "GPUDirect Storage (GDS plugin): storage, which tcpxd does not move",
    "examples/python/query_mem_example.py": "queries files through a storage plugin (POSIX)",
    "examples/python/telemetry_reader.py": "reads NIXL's telemetry shared-memory ring of a running agent",
    "examples/python/remote_storage_example/": "a storage pipeline over NIXL's storage plugins",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daemon:
    def __init__(self, binary: Path, dir: Path, name: str):
        self.sock = dir / f"{name}.sock"
        ready, self.log = dir / f"{name}.ready", dir / f"{name}.log"
        env = dict(os.environ, RUST_LOG=os.environ.get("RUST_LOG", "warn"))
        self.proc = subprocess.Popen(
            [str(binary), "--node-id", name, "--builtin-emulation", "--api-socket", str(self.sock),
             "--peer-listen", "127.0.0.1:0", "--ready-file", str(ready)],
            stdout=subprocess.DEVNULL, stderr=open(self.log, "wb"), env=env)
        deadline = time.monotonic() + 30
        while not (ready.exists() and ready.stat().st_size > 0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"tcpxd {name} did not start:\n{self.log.read_text(errors='replace')}")
            time.sleep(0.05)
        json.loads(ready.read_text())

    @property
    def endpoint(self) -> str:
        return f"unix:{self.sock}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Runner:
    def __init__(self, args: argparse.Namespace, dir: Path, a: Daemon, b: Daemon):
        self.args = args
        self.dir = dir
        self.a, self.b = a, b
        self.results: List[Tuple[str, str, str]] = []
        shim = dir / "shim"
        subprocess.run([args.python, "-m", "tcpxd.nixl", "install-shim", str(shim)], check=True,
                       env=self.env(a), stdout=subprocess.DEVNULL)
        self.shim = shim

    def env(self, d: Daemon, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        paths = [str(self.dir / "shim"), str(ROOT / "python/src")]
        if os.environ.get("PYTHONPATH"):
            paths.append(os.environ["PYTHONPATH"])
        e = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), TCPXD_ENDPOINT=d.endpoint, PYTHONUNBUFFERED="1")
        e.update(extra or {})
        return e

    def record(self, name: str, outcome: str, detail: str = "") -> None:
        self.results.append((name, outcome, detail))
        line = f"{outcome:4}  {name}"
        print(line + (f"  ({detail})" if detail and outcome != "FAIL" else ""), flush=True)
        if outcome == "FAIL" and detail:
            print("      " + "\n      ".join(detail.splitlines()[-self.args.tail:]), flush=True)

    def _judge(self, name: str, procs: Sequence[Tuple[str, subprocess.Popen]], outs: Sequence[Path]) -> None:
        deadline = time.monotonic() + self.args.timeout
        timed_out = False
        for _, p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
        for _, p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        texts = [o.read_text(errors="replace") for o in outs]
        bad = [f"{role} exited {p.returncode}" for role, p in procs if p.returncode != 0]
        errs = [ln for t in texts for ln in t.splitlines() if " NIXL ERROR " in ln]
        detail = "\n".join(f"--- {role}\n{t}" for (role, _), t in zip(procs, texts))
        if timed_out:
            self.record(name, "FAIL", f"did not finish within {self.args.timeout:.0f} s\n{detail}")
        elif bad or errs:
            self.record(name, "FAIL", "; ".join(bad + errs[:1]) + "\n" + detail)
        else:
            self.record(name, "PASS")

    def script(self, name: str, path: Path, argv: Sequence[str], extra: Optional[Dict[str, str]] = None) -> None:
        out = self.dir / (name.replace("/", "_").replace(" ", "_") + ".out")
        p = subprocess.Popen([self.args.python, str(path), *argv], cwd=self.dir, env=self.env(self.a, extra),
                             stdout=open(out, "wb"), stderr=subprocess.STDOUT)
        self._judge(name, [("process", p)], [out])

    def two_peers(self, name: str, path: Path, extra_argv: Sequence[str] = ()) -> None:
        port = free_port()
        outs = [self.dir / f"{path.stem}.{role}.out" for role in ("target", "initiator")]
        target = subprocess.Popen([self.args.python, str(path), "--mode", "target", "--ip", "127.0.0.1", "--port", str(port),
                                   *extra_argv], cwd=self.dir, env=self.env(self.a), stdout=open(outs[0], "wb"),
                                  stderr=subprocess.STDOUT)
        init = subprocess.Popen([self.args.python, str(path), "--mode", "initiator", "--ip", "127.0.0.1", "--port", str(port),
                                 *extra_argv], cwd=self.dir, env=self.env(self.b), stdout=open(outs[1], "wb"),
                                stderr=subprocess.STDOUT)
        self._judge(name, [("target", target), ("initiator", init)], outs)

    def pytest_file(self, path: Path) -> None:
        xml = self.dir / f"{path.stem}.xml"
        out = self.dir / f"{path.stem}.out"
        p = subprocess.Popen([self.args.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                              "--rootdir", str(path.parent), str(path)], cwd=self.dir, env=self.env(self.a),
                             stdout=open(out, "wb"), stderr=subprocess.STDOUT)
        try:
            p.wait(self.args.timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            self.record(f"test/python/{path.name}", "FAIL", f"pytest did not finish within {self.args.timeout:.0f} s\n"
                        + out.read_text(errors="replace"))
            return
        if not xml.exists():
            self.record(f"test/python/{path.name}", "FAIL", out.read_text(errors="replace"))
            return
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"test/python/{path.name}::{case.get('name')}"
            failed = case.find("failure") if case.find("failure") is not None else case.find("error")
            skipped = case.find("skipped")
            if failed is not None:
                self.record(name, "FAIL", (failed.get("message") or "") + "\n" + (failed.text or ""))
            elif skipped is not None:
                self.record(name, "SKIP", (skipped.get("message") or "").splitlines()[0] if skipped.get("message") else "")
            else:
                self.record(name, "PASS")


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("nixl", type=Path, help="a checkout of ai-dynamo/nixl (its examples/python and test/python)")
    p.add_argument("--tcpxd", type=Path, default=None,
                   help="the daemon binary (default: the newer of target/debug/tcpxd and target/release/tcpxd)")
    p.add_argument("--python", default=sys.executable, help="the Python to run them with (default: this one)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds each script or test file may take")
    p.add_argument("--only", action="append", default=[], help="run only names containing this (repeatable)")
    p.add_argument("--tail", type=int, default=12, help="lines of a failure's output to print")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (outputs, daemon logs)")
    args = p.parse_args(argv)
    ex, tp = args.nixl / "examples/python", args.nixl / "test/python"
    if not ex.is_dir() or not tp.is_dir():
        raise SystemExit(f"{args.nixl}: no examples/python and test/python (a checkout of ai-dynamo/nixl is needed)")
    binary = args.tcpxd
    if binary is None:
        found = [b for b in (ROOT / "target/debug/tcpxd", ROOT / "target/release/tcpxd") if b.exists()]
        if not found:
            raise SystemExit("no tcpxd binary: run `cargo build` (or give --tcpxd)")
        binary = max(found, key=lambda b: b.stat().st_mtime)
    rev = subprocess.run(["git", "-C", str(args.nixl), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"NIXL checkout {args.nixl} at {rev or 'unknown commit'}; tcpxd {binary}; python {args.python}", flush=True)

    dir = Path(tempfile.mkdtemp(prefix="tcpxd-nixl-up-"))
    a = b = None
    try:
        a, b = Daemon(binary, dir, "nixl-up-a"), Daemon(binary, dir, "nixl-up-b")
        r = Runner(args, dir, a, b)

        def want(name: str) -> bool:
            return not args.only or any(o in name for o in args.only)

        for name in ("basic_two_peers.py", "expanded_two_peers.py"):
            if want(name):
                r.two_peers(f"examples/python/{name}", ex / name, ("--backend", "UCX") if name.startswith("expanded") else ())
        if want("partial_md_example.py"):
            r.script("examples/python/partial_md_example.py", ex / "partial_md_example.py",
                     ["--init-port", str(free_port()), "--target-port", str(free_port())], {"NIXL_ETCD_ENDPOINTS": ""})
        if want("desc_perf.py"):
            r.script("test/python/desc_perf.py", tp / "desc_perf.py", [])
        for mode in ("list", "array"):
            if want(f"prep_xfer_perf.py {mode}"):
                r.script(f"test/python/prep_xfer_perf.py {mode}", tp / "prep_xfer_perf.py", [mode])
        for name in ("test_nixl_api.py", "test_nixl_bindings.py"):
            if want(name):
                r.pytest_file(tp / name)
        for name, why in NOT_RUN.items():
            if want(name):
                print(f"{'-':4}  {name}  (not run: {why})")
        counts = {k: sum(1 for _, o, _ in r.results if o == k) for k in ("PASS", "FAIL", "SKIP")}
        print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
        return 1 if counts["FAIL"] else 0
    finally:
        for d in (a, b):
            if d is not None:
                d.stop()
        if args.keep:
            print(f"kept {dir}")
        else:
            shutil.rmtree(dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
