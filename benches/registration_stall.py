#!/usr/bin/env python3
"""How long a daemon's other calls wait while one client registers a large host buffer.

    python3 benches/registration_stall.py --bin target/release/tcpxd [--bin OTHER] [--size 3G]

For each binary (alternating, `--rounds` times) the script starts one daemon over the built-in
emulation, has one client register `--size` bytes of daemon-allocated host memory (every page is
faulted in at registration), and meanwhile has a second client loop on two calls until the big
one returns: `stats()` (no memory mapped) and a 1 MiB host registration and release (a new
mapping, as any allocation of the daemon's may need). It prints how many such calls ran
meanwhile, their median and their worst latency.

Before 6f443c0 the daemon populated with `MAP_POPULATE`, which holds the process's mmap lock
for the whole region: a 1 MiB registration waited out all of a 3 GiB one (2.1–3.0 s).
Needs the `tcpxd` Python package (`pip install ./python`).
"""

import argparse
import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import tcpxd


def size_arg(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def start(binary: str, root: Path, name: str) -> "tuple[subprocess.Popen, str]":
    sock, ready = root / f"{name}.sock", root / f"{name}.ready"
    args = [binary, "--node-id", name, "--builtin-emulation", "--api-socket", str(sock),
            "--peer-listen", "127.0.0.1:0", "--ready-file", str(ready)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "RUST_LOG": "warn"})
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if ready.exists() and ready.stat().st_size > 0:
            json.loads(ready.read_text())
            return proc, f"unix:{sock}"
        if proc.poll() is not None:
            raise SystemExit(f"{binary} exited with {proc.returncode}")
        time.sleep(0.02)
    proc.kill()
    raise SystemExit(f"{binary} did not become ready")


def one(binary: str, size: int, root: Path, n: int) -> None:
    proc, endpoint = start(binary, root, f"stall-{n}")
    try:
        big, small = tcpxd.Client(endpoint), tcpxd.Client(endpoint)
        small.register_host(1 << 20, shared=False).release()  # warm
        done = threading.Event()
        took = []

        def register_big() -> None:
            t = time.perf_counter()
            buf = big.register_host(size, shared=False)
            took.append(time.perf_counter() - t)
            done.set()
            buf.release()

        th = threading.Thread(target=register_big)
        th.start()
        time.sleep(0.05)
        lat: "dict[str, list[float]]" = {"stats": [], "1 MiB register+release": []}
        while not done.is_set():
            t = time.perf_counter()
            small.stats()
            lat["stats"].append(time.perf_counter() - t)
            t = time.perf_counter()
            small.register_host(1 << 20, shared=False).release()
            lat["1 MiB register+release"].append(time.perf_counter() - t)
        th.join()
        print(f"{binary}: {size >> 20} MiB registered in {took[0]:.2f} s")
        for name, values in lat.items():
            values.sort()
            print(f"  {name}: {len(values)} calls meanwhile, median {values[len(values) // 2] * 1e3:.1f} ms,"
                  f" worst {values[-1] * 1e3:.1f} ms")
        big.close()
        small.close()
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", action="append", required=True, help="a tcpxd binary (repeat to compare)")
    ap.add_argument("--size", type=size_arg, default=3 << 30, help="the big registration (default 3G)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tcpxd-stall-") as d:
        n = 0
        for _ in range(args.rounds):
            for binary in args.bin:
                one(binary, args.size, Path(d), n)
                n += 1


if __name__ == "__main__":
    main()
