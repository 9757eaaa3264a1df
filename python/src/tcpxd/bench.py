"""`python -m tcpxd.bench`: what the Python client costs, next to `tcpxctl bench transfer` on the same
daemons in the same run.

Measures, through the package (one call per transfer: `Client.write`, which waits in the same call
when the daemon supports it): the p50/p99 latency of 4 KiB WRITEs from host memory, and the GB/s of
1 GiB WRITEs from host memory and (with --tensor, on a GPU) from a PyTorch CUDA tensor into a tensor
of the other daemon. Then runs `tcpxctl bench transfer` against the same two daemons for the same
sizes and prints the ratios (python ÷ tcpxctl). Without --endpoint it starts two local daemons on
the built-in emulation.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from . import Client, _tensor

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


def _find(name: str, explicit: Optional[str]) -> Optional[str]:
    if explicit:
        return explicit
    for base in (Path.cwd() / "target/release", Path.cwd() / "target/debug"):
        if (base / name).exists():
            return str(base / name)
    return shutil.which(name)


def _start(tcpxd: str, dir: Path, name: str) -> Tuple[subprocess.Popen, Dict[str, Any]]:
    ready = dir / f"{name}.ready"
    proc = subprocess.Popen(
        [tcpxd, "--node-id", name, "--builtin-emulation", "--api-socket", str(dir / f"{name}.sock"),
         "--peer-listen", "127.0.0.1:0", "--ready-file", str(ready)],
        stdout=subprocess.DEVNULL, stderr=open(dir / f"{name}.log", "wb"),
    )
    for _ in range(600):
        if ready.exists() and ready.stat().st_size:
            return proc, json.loads(ready.read_text())
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    raise SystemExit(f"tcpxd {name} did not start; see {dir / (name + '.log')}")


def _pct(xs: List[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def small_writes(a: Client, b: Client, size: int, iters: int, warmup: int) -> Dict[str, float]:
    with a.register_host(size) as src, b.register_host(size) as dst:
        src.fill(seed=1)
        lat = []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            a.write(src, dst.descriptor, size)
            if i >= warmup:
                lat.append(time.perf_counter() - t0)
        assert dst.checksum() == src.checksum(), "bytes differ"
    return {"p50_us": _pct(lat, 50) * 1e6, "p99_us": _pct(lat, 99) * 1e6, "avg_us": statistics.mean(lat) * 1e6}


def big_write(a: Client, src: Any, dst_descriptor: str, size: int, iters: int) -> float:
    a.write(src, dst_descriptor, size)  # warm-up
    t0 = time.perf_counter()
    for _ in range(iters):
        a.write(src, dst_descriptor, size)
    return size * iters / (time.perf_counter() - t0) / 1e9


def host_big(a: Client, b: Client, size: int, iters: int) -> float:
    with a.register_host(size) as src, b.register_host(size) as dst:
        src.fill(seed=2)
        g = big_write(a, src, dst.descriptor, size, iters)
        assert dst.checksum() == src.checksum(), "bytes differ"
    return g


def tensor_big(a: Client, b: Client, size: int, iters: int) -> float:
    import torch

    src = torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros(size, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    with a.register_tensor(src) as s, b.register_tensor(dst) as d:
        ev = _tensor.ready_event()
        a.write(s, d.descriptor, size, ready_event=ev)
        g = big_write(a, s, d.descriptor, size, iters)
    torch.cuda.synchronize()
    assert torch.equal(src, dst), "tensor bytes differ"
    return g


def tcpxctl_rows(tcpxctl: str, ea: str, eb: str, sizes: str, iters: int, cuda: bool) -> List[Dict[str, Any]]:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "rows.jsonl"
        cmd = [tcpxctl, "bench", "transfer", "--endpoint", ea, "--peer-endpoint", eb, "--sizes", sizes,
               "--iters", str(iters), "--warmup", "10", "--out", str(out)]
        if cuda:
            cmd += ["--cuda", "0"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tcpxd.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--endpoint", help="sending daemon (default: start two local daemons)")
    ap.add_argument("--peer-endpoint", help="receiving daemon (already connected to --endpoint's)")
    ap.add_argument("--tcpxd", help="tcpxd binary for local daemons (default: target/release, target/debug, PATH)")
    ap.add_argument("--tcpxctl", help="tcpxctl binary for the comparison (default: as --tcpxd); 'none' skips it")
    ap.add_argument("--iters", type=int, default=1000, help="measured 4 KiB writes")
    ap.add_argument("--big", type=int, default=1024, help="size of the large writes, MiB")
    ap.add_argument("--big-iters", type=int, default=5)
    ap.add_argument("--tensor", action="store_true", help="also 1 GiB tensor writes (needs torch and a GPU)")
    ap.add_argument("--json", help="append the results to this file as one JSON line")
    args = ap.parse_args(argv)

    procs: List[subprocess.Popen] = []
    tmp = None
    try:
        if args.endpoint:
            ea, eb = args.endpoint, args.peer_endpoint
            if not eb:
                ap.error("--endpoint needs --peer-endpoint")
        else:
            tcpxd = _find("tcpxd", args.tcpxd)
            if not tcpxd:
                ap.error("no tcpxd binary found: build it or give --tcpxd")
            tmp = Path(tempfile.mkdtemp(prefix="tcpxd-bench-"))
            pa, ra = _start(tcpxd, tmp, "bench-a")
            pb, rb = _start(tcpxd, tmp, "bench-b")
            procs = [pa, pb]
            ea, eb = f"unix:{ra['api_socket']}", f"unix:{rb['api_socket']}"
            with Client(ea) as c:
                c.connect_peer(str(rb["peer_address"]))
        big = args.big * MIB
        res: Dict[str, Any] = {"endpoint": ea, "peer_endpoint": eb}
        with Client(ea) as a, Client(eb) as b:
            res["python_4k"] = small_writes(a, b, 4 * KIB, args.iters, 50)
            res["python_host_big_gbps"] = host_big(a, b, big, args.big_iters)
            if args.tensor:
                res["python_tensor_big_gbps"] = tensor_big(a, b, big, args.big_iters)
        tcpxctl = None if args.tcpxctl == "none" else _find("tcpxctl", args.tcpxctl)
        if tcpxctl:
            sizes = f"4K,{big}"
            rows = tcpxctl_rows(tcpxctl, ea, eb, sizes, args.iters, False)
            res["tcpxctl_4k_p50_us"] = next(r["p50_lat_us"] for r in rows if r["block_size"] == 4 * KIB)
            res["tcpxctl_4k_p99_us"] = next(r["p99_lat_us"] for r in rows if r["block_size"] == 4 * KIB)
            res["tcpxctl_host_big_gbps"] = next(r["gb_per_s"] for r in rows if r["block_size"] == big)
            if args.tensor:
                rows = tcpxctl_rows(tcpxctl, ea, eb, str(big), args.big_iters, True)
                res["tcpxctl_cuda_big_gbps"] = rows[0]["gb_per_s"]
        p = res["python_4k"]
        print(f"python  4 KiB write   p50 {p['p50_us']:8.1f} us   p99 {p['p99_us']:8.1f} us   ({args.iters} writes)")
        print(f"python  {args.big} MiB write host    {res['python_host_big_gbps']:.3f} GB/s")
        if "python_tensor_big_gbps" in res:
            print(f"python  {args.big} MiB write tensor  {res['python_tensor_big_gbps']:.3f} GB/s")
        if "tcpxctl_4k_p50_us" in res:
            print(f"tcpxctl 4 KiB write   p50 {res['tcpxctl_4k_p50_us']:8.1f} us   p99 {res['tcpxctl_4k_p99_us']:8.1f} us")
            print(f"tcpxctl {args.big} MiB write host    {res['tcpxctl_host_big_gbps']:.3f} GB/s")
            r50 = p["p50_us"] / res["tcpxctl_4k_p50_us"]
            rg = res["python_host_big_gbps"] / res["tcpxctl_host_big_gbps"]
            res["ratio_4k_p50"], res["ratio_host_big_gbps"] = r50, rg
            print(f"ratio   4 KiB p50 python/tcpxctl {r50:.2f}x (target <= 1.5x); {args.big} MiB GB/s {rg:.2f}x")
            if "tcpxctl_cuda_big_gbps" in res:
                rt = res["python_tensor_big_gbps"] / res["tcpxctl_cuda_big_gbps"]
                res["ratio_tensor_big_gbps"] = rt
                print(f"tcpxctl {args.big} MiB write cuda    {res['tcpxctl_cuda_big_gbps']:.3f} GB/s; tensor/cuda {rt:.2f}x (target >= 0.95x)")
        if args.json:
            with open(args.json, "a", encoding="utf-8") as f:
                f.write(json.dumps(res) + "\n")
    finally:
        for pr in procs:
            pr.terminate()
            try:
                pr.wait(10)
            except subprocess.TimeoutExpired:
                pr.kill()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
