"""A daemon restart costs only what was in flight (issue #40): a vLLM-pattern pull loop through
tcpxd.nixl, in two processes on two supervised daemons (tests/supervisor.py stands in for systemd's
Restart=always), keeps running across each kind of restart — SIGKILL of the holder's daemon, of the
puller's own, SIGTERM (an upgrade) — with no call from the application beyond retrying: the
transfer in flight ends in "ERR" (never hangs), the next ones succeed, every byte checked — and the
plugin's own exit(1) on a fail-stop path (the emulation's TCPXEMU_FAILSTOP=exit, on the CUDA
stand-in), which the supervisor restarts like any other exit. Each
test prints the time from the restarted daemon's start to the loop's first successful transfer
(benches/restart_loop.py runs many restarts in a row)."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import socket
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest

import restart_roles as roles
from conftest import ROOT, tcpxd_bin
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


def pull_until(puller: Role, oks: int, log: List[Tuple[Any, ...]], since: float = 0.0) -> None:
    """Reads the loop's reports until `oks` more transfers succeeded (that ended after `since`)."""
    deadline = time.monotonic() + DEADLINE_S
    got = 0
    while got < oks:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"the loop made {got} of {oks} transfers in {DEADLINE_S} s; last reports: {log[-5:]}")
        msg = puller.recv(left)
        log.append(msg)
        got += msg[0] == "ok" and msg[1] > since


def cuda_stand_in(d: Path) -> Dict[str, str]:
    """The environment giving a daemon the CUDA stand-in (tools/realplugin/cudastub, eight "GPUs"
    over host memory) as its libcuda.so.1, with the emulation in its CUDA mode, one NIC serving
    only GPU 7 and the real plugin's exit(1) on its fail-stop paths (TCPXEMU_FAILSTOP=exit): a
    CUDA receive into GPU 0 is then the plugin's "rx no cmsg", and the process exits."""
    # `cargo build` puts it in target/<profile>/, the test command's workspace run in its deps/.
    found = [
        p
        for profile in ("debug", "release")
        for p in (ROOT / "target" / profile / "libtcpxd_cudastub.so", ROOT / "target" / profile / "deps/libtcpxd_cudastub.so")
        if p.exists()
    ]
    if not found:
        pytest.skip("the CUDA stand-in is not built (cargo build -p tcpxd-cudastub; CI's workspace build makes it)")
    lib = d / "cudastub"
    lib.mkdir()
    for name in ("libcuda.so.1", "libcuda.so"):
        (lib / name).symlink_to(max(found, key=lambda p: p.stat().st_mtime))
    return {
        "LD_LIBRARY_PATH": f"{lib}:{os.environ.get('LD_LIBRARY_PATH', '')}".rstrip(":"),
        "TCPXD_CUDASTUB_DEVICES": "8",
        "TCPXEMU_BOUNCE": "cuda",
        "TCPXEMU_BOUNCE_PAGES": "2048",
        "UCCL_TCPX_UNPACK_IMPL": "d2d",
        "TCPXEMU_DEVICES": "1",
        "TCPXEMU_DEV0_GPUS": "7",
        "TCPXEMU_FAILSTOP": "exit",
    }


def endpoint(s: Supervised) -> str:
    return f"unix:{s.args[s.args.index('--api-socket') + 1]}"


def plugin_exit(a: Supervised, b: Supervised) -> None:
    """A CUDA WRITE from b into GPU 0 of a: a's plugin receives it on a NIC that does not serve
    GPU 0 and calls exit(1), as Google's plugin does on "rx no cmsg"."""
    import tcpxd

    with tcpxd.Client(endpoint(a)) as ca, tcpxd.Client(endpoint(b)) as cb:
        dst = ca.allocate_cuda(1 << 20, device=0)
        src = cb.allocate_cuda(1 << 20, device=0)
        with pytest.raises(tcpxd.TcpxdError):
            cb.write(src, dst.descriptor, timeout=DEADLINE_S)


KINDS = ["holder-sigkill", "puller-sigkill", "holder-sigterm", "puller-plugin-exit"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_pull_loop_keeps_running_across_a_restart(kind: str) -> None:
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="tcpxd-rs-"))  # short: unix socket paths fit 108 bytes
    env = cuda_stand_in(d) if kind.endswith("plugin-exit") else {}
    sups: List[Supervised] = []
    try:
        for name in ("ra", "rb"):
            sups.append(supervised(str(tcpxd_bin()), d, name, free_port(), env))
        pull_across_a_restart(sups[0], sups[1], kind)
    finally:
        for s in sups:
            s.close()
        shutil.rmtree(d, ignore_errors=True)


def pull_across_a_restart(a: Supervised, b: Supervised, kind: str) -> None:
    """a: the puller's daemon; b: the holder's."""
    holder = Role(roles.holder, endpoint(b), SHAPE, 11)
    md = holder.recv()
    assert md[0] == "metadata"
    puller = Role(roles.puller, endpoint(a), SHAPE, 11, md[1])
    log: List[Tuple[Any, ...]] = []
    try:
        pull_until(puller, BEFORE, log)
        target = b if kind.startswith("holder") else a
        if kind.endswith("plugin-exit"):
            n = len(target.starts)
            plugin_exit(a, b)
            expect = 1
        else:
            sig = signal.SIGKILL if kind.endswith("sigkill") else signal.SIGTERM
            n = target.signal(sig)
            # SIGKILL ends the process by the signal; SIGTERM drains, then exits 0.
            expect = -sig if sig == signal.SIGKILL else 0
        restarted = target.wait_serving(n + 1)
        mark = len(log)
        pull_until(puller, AFTER, log, since=restarted.began)
        after = log[mark:]
        first_ok = next(m[1] for m in after if m[0] == "ok" and m[1] > restarted.began)
        errs = [m for m in log if m[0] == "err"]
        print(f"\n{kind}: restart to serving {restarted.serving - restarted.began:.3f} s, restart to the first "
              f"successful transfer {first_ok - restarted.began:.3f} s; {len(errs)} transfers failed meanwhile: "
              f"{[m[2] for m in errs][:3]}")
        assert target.starts[n - 1].ended == expect, (target.starts[n - 1], target.log_tail())
    finally:
        pulled = puller.finish()
        held = holder.finish()
    assert pulled["hangs"] == 0, pulled
    assert held["intact"], "the holder's KV cache changed"
    # The restarted side's client re-attached once (and only it: the other daemon did not restart).
    assert (held["reattached"], pulled["reattached"]) == ((1, 0) if kind.startswith("holder") else (0, 1))
