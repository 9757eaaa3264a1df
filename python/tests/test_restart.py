"""A daemon restart costs only what was in flight (issue #40): a vLLM-pattern pull loop through
tcpxd.nixl, in two processes on two supervised daemons (tests/supervisor.py stands in for systemd's
Restart=always), keeps running across each kind of restart — SIGKILL of the holder's daemon, of the
puller's own, SIGTERM (an upgrade) — with no call from the application beyond retrying: the
transfer in flight ends in "ERR" (never hangs), the next ones succeed, every byte checked. Each
test prints the time from the restarted daemon's start to the loop's first successful transfer
(benches/restart_loop.py runs many restarts in a row)."""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import socket
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

import restart_roles as roles
from conftest import tcpxd_bin
from supervisor import Supervised, supervised

CTX = multiprocessing.get_context("spawn")
#: layers, blocks, block length: 2 layers x K and V, 64 blocks of 16 KiB.
SHAPE = (2, 64, 16384)
#: The loop's successes wanted before a restart and after it.
BEFORE, AFTER = 5, 10
DEADLINE_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Role:
    def __init__(self, fn: Any, *args: Any):
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=roles.run, args=(fn, child) + args, daemon=True)
        self.proc.start()

    def recv(self, timeout: float = DEADLINE_S) -> Tuple[Any, ...]:
        if not self.conn.poll(timeout):
            raise TimeoutError("no word from the role process")
        msg = self.conn.recv()
        if msg[0] == "error":
            raise AssertionError(f"role failed:\n{msg[1]}")
        return tuple(msg)

    def finish(self) -> Dict[str, Any]:
        self.conn.send("stop")
        while True:
            msg = self.recv()
            if msg[0] == "done":
                self.proc.join(30)
                return dict(msg[1])


def pull_until(puller: Role, oks: int, log: List[Tuple[Any, ...]]) -> None:
    """Reads the loop's reports until `oks` more transfers succeeded."""
    deadline = time.monotonic() + DEADLINE_S
    got = 0
    while got < oks:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"the loop made {got} of {oks} transfers in {DEADLINE_S} s; last reports: {log[-5:]}")
        msg = puller.recv(left)
        log.append(msg)
        got += msg[0] == "ok"


@pytest.fixture
def pair(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="tcpxd-rs-"))  # short: unix socket paths fit 108 bytes
    sups: List[Supervised] = []
    try:
        for name in ("ra", "rb"):
            sups.append(supervised(str(tcpxd_bin()), d, name, free_port()))
        yield sups[0], sups[1], d
    finally:
        for s in sups:
            s.close()


@pytest.mark.parametrize("kind", ["holder-sigkill", "puller-sigkill", "holder-sigterm"])
def test_a_pull_loop_keeps_running_across_a_restart(pair: Any, kind: str) -> None:
    a, b, _ = pair  # the puller's daemon, the holder's
    holder = Role(roles.holder, f"unix:{b.args[b.args.index('--api-socket') + 1]}", SHAPE, 11)
    md = holder.recv()
    assert md[0] == "metadata"
    puller = Role(roles.puller, f"unix:{a.args[a.args.index('--api-socket') + 1]}", SHAPE, 11, md[1])
    log: List[Tuple[Any, ...]] = []
    try:
        pull_until(puller, BEFORE, log)
        target = b if kind.startswith("holder") else a
        sig = signal.SIGKILL if kind.endswith("sigkill") else signal.SIGTERM
        n = target.signal(sig)
        restarted = target.wait_serving(n + 1)
        mark = len(log)
        pull_until(puller, AFTER, log)
        after = log[mark:]
        first_ok = next(m[1] for m in after if m[0] == "ok" and m[1] > restarted.began)
        errs = [m for m in log if m[0] == "err"]
        print(f"\n{kind}: restart to serving {restarted.serving - restarted.began:.3f} s, restart to the first "
              f"successful transfer {first_ok - restarted.began:.3f} s; {len(errs)} transfers failed meanwhile: "
              f"{[m[2] for m in errs][:3]}")
        # SIGKILL ends the process by the signal; SIGTERM drains, then exits 0.
        assert target.starts[n - 1].ended == (-sig if sig == signal.SIGKILL else 0), target.starts[n - 1]
    finally:
        pulled = puller.finish()
        held = holder.finish()
    assert pulled["hangs"] == 0, pulled
    assert held["intact"], "the holder's KV cache changed"
    # The restarted side's client re-attached once (and only it: the other daemon did not restart).
    assert (held["reattached"], pulled["reattached"]) == ((1, 0) if kind.startswith("holder") else (0, 1))
