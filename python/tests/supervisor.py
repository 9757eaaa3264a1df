"""A stand-in for systemd in the restart tests: runs one tcpxd daemon and starts it again, with the
same arguments, whenever it exits — as deploy/systemd/tcpxd.service's `Restart=always` with
`RestartSec=100ms` does (the kubelet restarts a DaemonSet's container the same way, with a
back-off). Each start is recorded: when it began, when the daemon served (its ready
file), and how the previous process ended.

With `fd_store=True` it also keeps systemd's file-descriptor store (`FileDescriptorStoreMax=`):
the daemon's `sd_notify` datagrams (`NOTIFY_SOCKET`) with `FDSTORE=1`/`FDNAME=` and a descriptor
(SCM_RIGHTS) put it in the store, `FDSTOREREMOVE=1` takes it out, and every start gets the stored
descriptors as fds 3.. with `LISTEN_FDS`, `LISTEN_FDNAMES` and `LISTEN_PID`, as systemd passes
them. Notifications are read before each start (systemd handles its notification socket before
a process's exit, so nothing the dead process sent is lost)."""

from __future__ import annotations

import array
import fcntl
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

#: systemd's RestartSec in deploy/systemd/tcpxd.service.
RESTART_SEC = 0.1
#: FileDescriptorStoreMax= of the fake store (the daemon reads it from $FDSTORE).
FD_STORE_MAX = 16

#: Puts the stored descriptors (passed at 100 and above) at 3.. and execs the daemon with
#: LISTEN_PID set to its own pid, as systemd does between fork and exec.
_EXEC_WITH_FDS = """
import os, sys
high = [int(f) for f in os.environ.pop("SUPERVISOR_FDS").split(",") if f]
for i, fd in enumerate(high):
    os.dup2(fd, 3 + i, inheritable=True)
    os.close(fd)
os.environ["LISTEN_PID"] = str(os.getpid())
os.execv(sys.argv[1], sys.argv[1:])
"""


class FdStore:
    """systemd's file-descriptor store: named descriptors the service hands over, kept across its
    restarts."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if path.exists():
            path.unlink()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.fds: List[Tuple[str, int]] = []
        self.lock = threading.Lock()

    def drain(self) -> None:
        """Handles every notification waiting on the socket."""
        with self.lock:
            while True:
                try:
                    msg, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(16 * 4))
                except (BlockingIOError, InterruptedError):
                    return
                got: List[int] = []
                for level, kind, data in anc:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        a = array.array("i")
                        a.frombytes(data[: len(data) - len(data) % a.itemsize])
                        got.extend(a)
                fields = dict(line.split("=", 1) for line in msg.decode().splitlines() if "=" in line)
                name = fields.get("FDNAME", "stored")
                if fields.get("FDSTORE") == "1":
                    for fd in got:
                        if len(self.fds) < FD_STORE_MAX:
                            self.fds.append((name, fd))
                        else:
                            os.close(fd)
                    got = []
                elif fields.get("FDSTOREREMOVE") == "1":
                    for n, fd in [x for x in self.fds if x[0] == name]:
                        os.close(fd)
                        self.fds.remove((n, fd))
                for fd in got:  # descriptors sent with anything else are not kept
                    os.close(fd)

    def names(self) -> List[str]:
        with self.lock:
            return [n for n, _ in self.fds]

    def close(self) -> None:
        with self.lock:
            for _, fd in self.fds:
                os.close(fd)
            self.fds = []
            self.sock.close()


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
    fd_store: Optional[FdStore] = None

    def run(self) -> "Supervised":
        if self.fd_store is not None:
            threading.Thread(target=self._notifications, daemon=True).start()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        self.wait_serving(1)
        return self

    def _notifications(self) -> None:
        store = self.fd_store
        assert store is not None
        while not self._stop:
            try:
                select.select([store.sock], [], [], 0.2)
                store.drain()
            except (OSError, ValueError):
                return  # closed

    def _popen(self, log: object) -> subprocess.Popen:
        store = self.fd_store
        if store is None:
            return subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=log, env=self.env)  # type: ignore[arg-type]
        store.drain()
        with store.lock:
            stored = list(store.fds)
        # Duplicates at 100 and above (clear of 3..3+n), which the wrapper moves to 3..
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for _, fd in stored]
        env = dict(self.env, NOTIFY_SOCKET=str(store.path), FDSTORE=str(FD_STORE_MAX),
                   LISTEN_FDS=str(len(stored)), LISTEN_FDNAMES=":".join(n for n, _ in stored),
                   SUPERVISOR_FDS=",".join(map(str, high)))
        try:
            return subprocess.Popen([sys.executable, "-c", _EXEC_WITH_FDS] + self.args, stdout=subprocess.DEVNULL,
                                    stderr=log, env=env, pass_fds=high)  # type: ignore[arg-type]
        finally:
            for fd in high:
                os.close(fd)

    def _loop(self) -> None:
        while not self._stop:
            if self.starts:
                time.sleep(RESTART_SEC)
            if self.ready.exists():
                self.ready.unlink()
            start = Start(time.monotonic())
            with open(self.log, "ab") as log:
                proc = self._popen(log)
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
        if self.fd_store is not None:
            self.fd_store.close()

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def supervised(bin: str, dir: Path, name: str, peer_port: int, env: Optional[Dict[str, str]] = None,
               extra: Optional[List[str]] = None, fd_store: bool = False) -> Supervised:
    """A daemon with a state directory and a fixed peer port (descriptors carry it: a restarted
    daemon must be found where its descriptors say), kept running; with `fd_store`, under a fake
    systemd descriptor store (FdStore)."""
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
    store = FdStore(dir / f"{name}.notify") if fd_store else None
    return Supervised(args, dir / f"{name}.ready", dir / f"{name}.log", e, fd_store=store).run()
