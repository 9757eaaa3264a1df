"""A daemon that answers a new connection late (descheduled on a loaded machine, here stopped for
a second) delays the client's first call; it does not fail it. With gRPC's minimum connect
timeout at 100 ms (the channel options before session 24) the call failed UNAVAILABLE,
"connection attempt timed out before receiving SETTINGS frame": the flaky connects of the
replay and bench tests on a busy 2-core machine."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import tcpxd
from conftest import start_daemon, stop_daemon


def test_a_daemon_that_answers_late_delays_the_first_call_and_does_not_fail_it(tmp_root: Path):
    d = start_daemon(tmp_root, "late")
    try:
        os.kill(d.proc.pid, signal.SIGSTOP)
        # The stimulus, not a synchronisation: the daemon answers nothing for a second.
        threading.Timer(1.0, os.kill, (d.proc.pid, signal.SIGCONT)).start()
        with tcpxd.Client(d.endpoint, timeout=60) as c:
            assert c.describe_node().node_id == "late"
        with tcpxd.Client(d.endpoint) as c:
            assert c.describe_node().node_id == "late"
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
        stop_daemon(d)
