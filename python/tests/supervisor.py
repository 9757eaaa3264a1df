"""A stand-in for systemd in the restart tests: runs one tcpxd daemon and starts it again, with the
same arguments, whenever it exits — as deploy/systemd/tcpxd.service's `Restart=always` with
`RestartSec=100ms` does (the kubelet restarts a DaemonSet's container the same way, with a
back-off). Each start is recorded: when it began, when the daemon served (its ready
file), and how the previous process ended."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

#: systemd's RestartSec in deploy/systemd/tcpxd.service.
RESTART_SEC = 0.1


@dataclass
class Start:
    #: time.monotonic() (CLOCK_MONOTONIC, the same in every process of the machine) at the start.
    began: float
    #: When the daemon wrote its ready file (serving), or 0.
    serving: float = 0.0
    instance_id: str = ""
    #: How the process ended: its exit status, or -signal.
    ended: Optional[int] = None


@dataclass
class Supervised:
    args: List[str]
    ready: Path
    log: Path
    env: Dict[str, str]
    starts: List[Start] = field(default_factory=list)
    proc: Optional[subprocess.Popen] = None
    _stop: bool = False
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _thread: Optional[threading.Thread] = None

    def run(self) -> "Supervised":
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        self.wait_serving(1)
        return self

    def _loop(self) -> None:
        while not self._stop:
            if self.starts:
                time.sleep(RESTART_SEC)
            if self.ready.exists():
                self.ready.unlink()
            start = Start(time.monotonic())
            with open(self.log, "ab") as log:
                proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=log, env=self.env)
            with self._cond:
                self.proc = proc
                self.starts.append(start)
                self._cond.notify_all()
            while proc.poll() is None and not start.serving:
                if self.ready.exists() and self.ready.stat().st_size > 0:
                    try:
                        info = json.loads(self.ready.read_text())
                    except ValueError:
                        continue  # being written
                    with self._cond:
                        start.serving = time.monotonic()
                        start.instance_id = str(info.get("instance_id", ""))
                        self._cond.notify_all()
                    break
                time.sleep(0.005)
            proc.wait()
            with self._cond:
                start.ended = proc.returncode
                self._cond.notify_all()

    def wait_serving(self, n: int, timeout: float = 60.0) -> Start:
        """Waits until the n-th start (from 1) serves."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (len(self.starts) >= n and self.starts[n - 1].serving):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"start {n} of {self.args[0]} did not serve within {timeout} s:\n{self.log_tail()}")
                self._cond.wait(left)
            return self.starts[n - 1]

    def signal(self, sig: int) -> int:
        """Sends `sig` to the running daemon; returns how many starts there were before."""
        with self._cond:
            assert self.proc is not None
            n = len(self.starts)
            self.proc.send_signal(sig)
            return n

    def close(self) -> None:
        self._stop = True
        with self._cond:
            proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self._thread is not None:
            self._thread.join(15)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def supervised(bin: str, dir: Path, name: str, peer_port: int, env: Optional[Dict[str, str]] = None,
               extra: Optional[List[str]] = None) -> Supervised:
    """A daemon with a state directory and a fixed peer port (descriptors carry it: a restarted
    daemon must be found where its descriptors say), kept running."""
    e = dict(os.environ)
    e.setdefault("RUST_LOG", "info")
    e.update(env or {})
    args = [
        bin,
        "--node-id", name,
        "--builtin-emulation",
        "--api-socket", str(dir / f"{name}.sock"),
        "--peer-listen", f"127.0.0.1:{peer_port}",
        "--ready-file", str(dir / f"{name}.ready"),
        "--state-dir", str(dir / f"{name}.state"),
        "--shutdown-grace-s", "2",
    ] + (extra or [])
    return Supervised(args, dir / f"{name}.ready", dir / f"{name}.log", e).run()
