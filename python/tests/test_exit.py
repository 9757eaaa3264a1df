"""A process exits within seconds whatever its clients and agents are doing (issue #39 point 6).

Each test runs a script that leaves things alive at interpreter exit (NIXL agents with memory,
listeners, remote agents, prepared lists and a transfer in flight; plain clients with a
subscription read by a thread, a session with a transfer in flight; a daemon that stopped
answering) and requires the process to end, with status 0, well within EXIT_WITHIN_S.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from conftest import ROOT, start_daemon, stop_daemon

#: Generous for a loaded 2-core CI machine; a hang is forever.
EXIT_WITHIN_S = 15.0

PRELUDE = """
import sys, threading
import numpy as np
A, B = sys.argv[1], sys.argv[2]
"""


def run_script(body: str, *args: str) -> float:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python/src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body), *args], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=EXIT_WITHIN_S * 4)
    took = time.monotonic() - t0
    out = p.stdout.decode(errors="replace")
    assert p.returncode == 0, out
    assert "LEFT ALIVE" in out, out  # the script got to its end (then the interpreter exits)
    assert took < EXIT_WITHIN_S, f"the process took {took:.1f} s to exit:\n{out}"
    return took


def test_nixl_agents_with_memory_listeners_and_a_transfer_in_flight_exit(slow):
    a, b = slow
    run_script("""
        from tcpxd.nixl import nixl_agent, nixl_agent_config, host_array
        one = nixl_agent("one", nixl_agent_config(endpoint=A, enable_listen_thread=True, listen_port=0))
        two = nixl_agent("two", nixl_agent_config(endpoint=B))
        n = 64 << 20
        m1, m2 = host_array(n), host_array(n)
        one.register_memory([(m1.ctypes.data, n, 0, "")], "DRAM")
        two.register_memory([(m2.ctypes.data, n, 0, "")], "DRAM")
        one.add_remote_agent(two.get_agent_metadata())
        local = one.prep_xfer_dlist("NIXL_INIT_AGENT", [(m1.ctypes.data, n, 0)], "DRAM")
        remote = one.prep_xfer_dlist("two", [(m2.ctypes.data, n, 0)], "DRAM")
        h = one.make_prepped_xfer("WRITE", local, [0], remote, [0], b"bye")
        assert one.transfer(h) in ("PROC", "DONE")
        print("LEFT ALIVE", one.check_xfer_state(h), flush=True)
    """, a.endpoint, b.endpoint)


def test_plain_clients_with_a_subscription_and_a_session_in_flight_exit(slow):
    a, b = slow
    run_script("""
        import tcpxd
        ca, cb = tcpxd.Client(A), tcpxd.Client(B)
        src = ca.register_host(32 << 20)
        dst = cb.register_host(32 << 20)
        sub = cb.subscribe()
        threading.Thread(target=lambda: [None for _ in sub], daemon=True).start()
        s = ca.session()
        s.write(src, dst.descriptor, 32 << 20)   # in flight at exit (1 Gbit/s emulated NICs)
        print("LEFT ALIVE", flush=True)
    """, a.endpoint, b.endpoint)


def test_agents_whose_daemon_stopped_answering_exit(tmp_root: Path):
    d = start_daemon(tmp_root, "exit-stopped")
    try:
        script = """
            from tcpxd.nixl import nixl_agent, nixl_agent_config, host_array
            import os, signal
            agent = nixl_agent("frozen", nixl_agent_config(endpoint=A))
            m = host_array(1 << 20)
            agent.register_memory([(m.ctypes.data, 1 << 20, 0, "")], "DRAM")
            os.kill(int(B), signal.SIGSTOP)   # the daemon stops answering
            print("LEFT ALIVE", flush=True)
        """
        run_script(script, d.endpoint, str(d.proc.pid))
    finally:
        d.proc.send_signal(signal.SIGCONT)
        stop_daemon(d)
