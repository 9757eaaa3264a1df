"""Fixtures: two real tcpxd daemons on the built-in emulation plugin, unix API sockets in a temp dir.

The daemon binary: $TCPXD_BIN, else the newer of target/debug/tcpxd and target/release/tcpxd (the
README's test command builds target/debug/tcpxd first). GPU tests (`-m gpu`) need torch with CUDA
and are skipped, reported as not run, without them.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]


def tcpxd_bin() -> Path:
    env = os.environ.get("TCPXD_BIN")
    if env:
        return Path(env)
    found = [p for p in (ROOT / "target/debug/tcpxd", ROOT / "target/release/tcpxd") if p.exists()]
    if not found:
        pytest.fail("no tcpxd binary: run `cargo build` (or set TCPXD_BIN)")
    return max(found, key=lambda p: p.stat().st_mtime)


@dataclass
class Daemon:
    node_id: str
    socket: str
    peer_address: str
    ready: Dict[str, object]
    proc: subprocess.Popen
    log: Path

    @property
    def endpoint(self) -> str:
        return f"unix:{self.socket}"

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def start_daemon(dir: Path, name: str, extra: Optional[List[str]] = None, env: Optional[Dict[str, str]] = None) -> Daemon:
    sock, ready, log = dir / f"{name}.sock", dir / f"{name}.ready", dir / f"{name}.log"
    args = [
        str(tcpxd_bin()),
        "--node-id", name,
        "--builtin-emulation",
        "--api-socket", str(sock),
        "--peer-listen", "127.0.0.1:0",
        "--ready-file", str(ready),
    ] + (extra or [])
    e = dict(os.environ)
    e.setdefault("RUST_LOG", "warn")
    e.update(env or {})
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(log, "wb"), env=e)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if ready.exists() and ready.stat().st_size > 0:
            info = json.loads(ready.read_text())
            return Daemon(name, str(sock), str(info["peer_address"]), info, proc, log)
        if proc.poll() is not None:
            raise RuntimeError(f"tcpxd {name} exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError(f"tcpxd {name} did not become ready:\n{log.read_text(errors='replace')}")


def stop_daemon(d: Daemon) -> None:
    if d.proc.poll() is None:
        d.proc.terminate()
        try:
            d.proc.wait(10)
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait()


@pytest.fixture(scope="session")
def tmp_root() -> Iterator[Path]:
    # Short paths: a unix socket path must fit in 108 bytes.
    d = Path(tempfile.mkdtemp(prefix="tcpxd-py-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def daemons(tmp_root: Path) -> Iterator[tuple]:
    """Two daemons, a and b (not connected: descriptors or connect_peer connect them)."""
    a = start_daemon(tmp_root, "pa")
    b = start_daemon(tmp_root, "pb")
    yield a, b
    for d in (a, b):
        stop_daemon(d)


@pytest.fixture(scope="session")
def peered(daemons: tuple) -> tuple:
    """The two daemons with a connected to b (and b to a)."""
    import tcpxd

    a, b = daemons
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        ca.connect_peer(b.peer_address)
        cb.connect_peer(a.peer_address)
    return a, b


@pytest.fixture
def sigint() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt in the test, whatever SIGINT's disposition pytest started
    with (a shell starting it in the background without job control, as `cmd &` in a script,
    makes it ignore SIGINT, and Python then installs no handler)."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


@pytest.fixture(scope="session")
def slow(tmp_root: Path) -> Iterator[tuple]:
    """Two connected daemons whose emulated NICs run at 1 Gbit/s: transfers stay in flight (a
    test that must act before one ends holds it with `slow_gate` too)."""
    import tcpxd

    env = {"TCPXEMU_RATE_GBPS": "1", "TCPXEMU_HOLD_FILE": str(tmp_root / "slow.hold")}
    a = start_daemon(tmp_root, "sa", env=env)
    b = start_daemon(tmp_root, "sb", env=env)
    with tcpxd.Client(a.endpoint) as ca:
        ca.connect_peer(b.peer_address)
    yield a, b
    for d in (a, b):
        stop_daemon(d)


_GENERATIONS = itertools.count(1)


class Gate:
    """The `slow` daemons' hold gate (the emulation's TCPXEMU_HOLD_FILE, docs/EMULATION.md): while
    closed, their senders write 16 MiB more and then wait until it opens, so a transfer posted
    after `close()` moves its first bytes and cannot end, however loaded the machine, before the
    test has acted (cancelled it, let its deadline pass, interrupted its wait) and opened it."""

    def __init__(self, path: Path):
        self.path = path

    def close(self) -> None:
        self.path.write_text(f"{next(_GENERATIONS)}\n")  # new contents: a fresh budget

    def open(self) -> None:
        self.path.unlink(missing_ok=True)

    @contextlib.contextmanager
    def closed(self) -> Iterator[None]:
        self.close()
        try:
            yield
        finally:
            self.open()


@pytest.fixture
def slow_gate(slow: tuple, tmp_root: Path) -> Iterator[Gate]:
    gate = Gate(tmp_root / "slow.hold")
    yield gate
    gate.open()


def when_in_flight(endpoint: str, action: Callable[[], None], deadline_s: float = 60.0) -> threading.Thread:
    """Runs `action` on a thread of its own once the daemon at `endpoint` has a transfer active
    (its GetStats, through a client of the thread's own): for a test that acts on a transfer it
    posts next and waits for, held by `slow_gate`, instead of acting after a fixed delay. Call it
    just before posting: it first waits here until the daemon has none active."""
    import tcpxd

    c = tcpxd.Client(endpoint)
    end = time.monotonic() + deadline_s
    while c.stats().active_transfers != 0:
        assert time.monotonic() < end, "a transfer still active on the daemon"
        time.sleep(0.005)

    def run() -> None:
        try:
            while c.stats().active_transfers == 0 and time.monotonic() < end:
                time.sleep(0.005)
        finally:
            c.close()
        action()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="GPU test: needs PyTorch with CUDA and a GPU (run with -m gpu on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
