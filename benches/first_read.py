#!/usr/bin/env python3
"""A framed session's first request: open, preface and one request in one write, its event back.

    python3 benches/first_read.py --bin A=target/debug/tcpxd --bin B=/path/to/other/tcpxd [-n 300]

For each binary the script starts two daemons over the built-in emulation (a's framed sessions
served on the sessions thread, `--session-thread on`, or on its poller's, `off`; `--spin off` by
default: the serving thread parks between requests, the hand-over's worst case), registers a 1 MiB
buffer on each, pairs them (one WRITE), then `-n` times per binary, alternating binaries: opens
a connection to a, writes the preface and its first requests together (a `cancel_tag` of a tag
never used: refused NOT_FOUND, no transfer; one 4 KiB WRITE to b; a burst of `--burst` 4 KiB
WRITEs), reads the preface's answer and the requests' events, and closes. It prints per binary and mode the median and p90 of the
time from `connect` to the event, a's CPU time per session (its threads' time on a CPU from
/proc/PID/task/*/schedstat, read around each session), and the ratios of B to A.

Session 32 (ringflake): a session's first read used to run on the runtime worker that accepted
the connection (its first request not started fast); since, it is handed to the serving thread
(the socket re-armed, `Watching::hand_over`). This shows what that hop costs a new session's
first request, and what the fast start gives back on a WRITE. Needs the `tcpxd` package
(PYTHONPATH=python/src).
"""

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

import tcpxd
from tcpxd._proto import message

PREFACE = b"TCPXD/1\n"


def start(binary: str, root: Path, name: str, extra: List[str]) -> Tuple[subprocess.Popen, str, str]:
    sock, ready = root / f"{name}.sock", root / f"{name}.ready"
    args = [binary, "--node-id", name, "--builtin-emulation", "--api-socket", str(sock),
            "--peer-listen", "127.0.0.1:0", "--ready-file", str(ready)] + extra
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if ready.exists() and ready.stat().st_size > 0:
            return proc, str(sock), str(json.loads(ready.read_text())["peer_address"])
        time.sleep(0.02)
    proc.kill()
    raise SystemExit(f"{binary} did not become ready")


def cpu_seconds(pid: int) -> float:
    """The process's threads' time on a CPU (schedstat: nanoseconds, unlike stat's ticks)."""
    total = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(open(f"/proc/{pid}/task/{t}/schedstat").read().split()[0])
        except OSError:
            continue
    return total / 1e9


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        got = s.recv(n - len(buf))
        if not got:
            raise EOFError
        buf += got
    return bytes(buf)


def one(path: str, frame: bytes, want: str, events: int) -> float:
    t0 = time.perf_counter()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    s.sendall(PREFACE + frame)
    assert recv_exact(s, 8) == PREFACE
    for _ in range(events):
        (n,) = struct.unpack(">I", recv_exact(s, 4))
        ev = message("SessionEvent").FromString(recv_exact(s, n))
        assert ev.WhichOneof("event") == want, ev
        if want == "finished":
            assert ev.finished.status_code == 0, ev
    dt = time.perf_counter() - t0
    s.close()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", action="append", required=True, help="NAME=PATH (the first is the baseline A)")
    ap.add_argument("-n", type=int, default=300)
    ap.add_argument("--burst", type=int, default=16, help="WRITEs of the burst row, all sent with the preface")
    ap.add_argument("--modes", default="on,off", help="--session-thread values to run")
    ap.add_argument("--spin", default="off", help="a's and b's --spin (off: the serving thread parks between requests)")
    a = ap.parse_args()
    bins = [tuple(b.split("=", 1)) for b in a.bin]
    req, write_req, entry = message("SessionRequest"), message("WriteRequest"), message("WriteEntry")
    for mode in a.modes.split(","):
        root = Path(tempfile.mkdtemp(prefix="first-"))
        daemons: Dict[str, Tuple[subprocess.Popen, str, subprocess.Popen]] = {}
        frames: Dict[str, Dict[str, bytes]] = {}
        clients = []
        try:
            for name, path in bins:
                extra = ["--spin", a.spin, "--session-thread", mode]
                pa, sa, _ = start(path, root, f"{name}a", extra)
                pb, sb, _ = start(path, root, f"{name}b", ["--spin", a.spin])
                daemons[name] = (pa, sa, pb)
                ca, cb = tcpxd.Client(f"unix:{sa}"), tcpxd.Client(f"unix:{sb}")
                clients += [ca, cb]
                src, dst = ca.register_host(1 << 20), cb.register_host(1 << 20)
                with ca.session() as s:
                    s.write(src, dst.descriptor, 4096).result(timeout=30)  # paired
                def write(tag: int) -> bytes:
                    w = req(tag=tag, write=write_req(entry=entry(local_buffer_id=src.id, remote_descriptor=dst.descriptor,
                                                                 local_offset=(tag - 1) * 4096, remote_offset=(tag - 1) * 4096,
                                                                 length=4096), timeout_ms=10000)).SerializeToString()
                    return struct.pack(">I", len(w)) + w
                c = req(tag=1, cancel_tag=99).SerializeToString()
                frames[name] = {"cancel": struct.pack(">I", len(c)) + c, "write": write(1),
                                "burst": b"".join(write(t) for t in range(1, a.burst + 1))}
            for kind, want, events in (("cancel", "refused", 1), ("write", "finished", 1), ("burst", "finished", a.burst)):
                times: Dict[str, List[float]] = {n: [] for n, _ in bins}
                cpu: Dict[str, float] = {n: 0.0 for n, _ in bins}
                for _ in range(20):  # warm-up
                    for name, _ in bins:
                        one(daemons[name][1], frames[name][kind], want, events)
                for _ in range(a.n):
                    for name, _ in bins:
                        pid = daemons[name][0].pid
                        c0 = cpu_seconds(pid)
                        times[name].append(one(daemons[name][1], frames[name][kind], want, events))
                        cpu[name] += cpu_seconds(pid) - c0
                base = bins[0][0]
                for name, _ in bins:
                    t = sorted(times[name])
                    med, p90 = statistics.median(t), t[int(0.9 * (len(t) - 1))]
                    per = cpu[name] / a.n
                    line = (f"spin={a.spin:3} session_thread={mode:3} first={kind:6} {name}: "
                            f"median {med * 1e6:7.1f} us  p90 {p90 * 1e6:7.1f} us  daemon CPU {per * 1e6:6.1f} us/session")
                    if name != base:
                        b = sorted(times[base])
                        line += (f"  ({name}/{base}: median {med / statistics.median(b):.2f}x, "
                                 f"p90 {p90 / b[int(0.9 * (len(b) - 1))]:.2f}x, CPU {per / max(cpu[base] / a.n, 1e-9):.2f}x)")
                    print(line, flush=True)
        finally:
            for c in clients:
                c.close()
            for pa, _, pb in daemons.values():
                for p in (pa, pb):
                    p.terminate()
                    p.wait(10)


if __name__ == "__main__":
    main()
