#!/usr/bin/env python3
"""The receiving daemon's reads per framed-session request, counted by `strace -c`.

    python3 benches/session_recvmsg.py --bin target/debug/tcpxd [--bin OTHER] [-n 1000]

For each binary the script starts two daemons over the built-in emulation (a's framed sessions
read on its poller's thread where `runtime.poller_sessions` resolves on, as on a machine without
`runtime.spin`), opens one local session on a, sends 50 small WRITEs to warm it, then attaches
`strace -f -c -e trace=recvmsg,recvfrom,read` to a and sends `-n` 4 KiB WRITEs one at a time
(each waited). It prints a's recvmsg calls and the failed ones (EAGAIN: a read that found
nothing) per request. Session 25 (tidy25): a session waiting for its next request tried again
after storing its waker even when that waker was stored already (3 recvmsg a request, 2
failing); now once (2, 1 failing). Needs strace, ptrace permission and the `tcpxd` package.
"""

import argparse
import json
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import tcpxd


def start(binary: str, root: Path, name: str) -> "tuple[subprocess.Popen, str, str]":
    sock, ready = root / f"{name}.sock", root / f"{name}.ready"
    args = [binary, "--node-id", name, "--builtin-emulation", "--api-socket", str(sock),
            "--peer-listen", "127.0.0.1:0", "--ready-file", str(ready)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if ready.exists() and ready.stat().st_size > 0:
            return proc, f"unix:{sock}", str(json.loads(ready.read_text())["peer_address"])
        time.sleep(0.02)
    proc.kill()
    raise SystemExit(f"{binary} did not become ready")


def count(binary: str, n: int) -> "tuple[int, int]":
    root = Path(tempfile.mkdtemp(prefix="recvmsg-"))
    a, a_ep, _ = start(binary, root, "rm-a")
    b, b_ep, _ = start(binary, root, "rm-b")
    try:
        with tcpxd.Client(a_ep) as ca, tcpxd.Client(b_ep) as cb:
            src, dst = ca.register_host(1 << 20), cb.register_host(1 << 20)
            s = ca.session()
            for _ in range(50):
                s.write(src, dst.descriptor, 4096).result(timeout=30)
            out = root / "strace.txt"
            st = subprocess.Popen(["strace", "-f", "-c", "-e", "trace=recvmsg,recvfrom,read", "-o", str(out),
                                   "-p", str(a.pid)], stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # attached to every thread
            for _ in range(n):
                s.write(src, dst.descriptor, 4096).result(timeout=30)
            time.sleep(0.2)
            st.send_signal(signal.SIGINT)
            st.wait(10)
            s.close()
        row = re.search(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(\d+)?\s*recvmsg$", out.read_text(), re.M)
        if row is None:
            raise SystemExit(f"no recvmsg row in strace's summary:\n{out.read_text()}")
        return int(row.group(1)), int(row.group(2) or 0)
    finally:
        for p in (a, b):
            p.terminate()
            p.wait(10)
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", action="append", required=True, help="a tcpxd binary (repeat to compare)")
    ap.add_argument("-n", type=int, default=1000, help="WRITEs counted")
    args = ap.parse_args()
    for binary in args.bin:
        calls, failed = count(binary, args.n)
        print(f"{binary}: recvmsg {calls / args.n:.2f} a request ({failed / args.n:.2f} finding nothing), "
              f"{args.n} requests")


if __name__ == "__main__":
    main()
