"""`python -m tcpxd.bench`: what the Python client costs, next to `tcpxctl bench transfer` on the same
daemons in the same run.

Each round measures, through the package (one round trip per transfer), the p50/p99 latency of
4 KiB WRITEs from host memory with `Client.write` as it comes (the daemon's local session on a unix
socket that speaks it: one frame each way, no gRPC), then the same with `Client(local=False)` (a
request on the client's own gRPC Session stream) and `Client(local=False, stream=False)` (a unary
`Write` with `wait` each), then `tcpxctl bench transfer` on the same two daemons for the same size;
each line names the path its client took. Then the GB/s of large WRITEs (default 1 GiB) from host
memory, then tcpxctl's for that size; with --tensor, PyTorch CUDA tensor into tensor against
tcpxctl's `--cuda 0`. It prints the medians over the rounds and the median per-round ratios (python
÷ tcpxctl) against the targets (4 KiB p50 ≤ 1.5x, large GB/s ≥ 0.95x). Without --endpoint it
starts two local daemons on the built-in emulation. The daemons are paired by the first write (a
descriptor carries its daemon's peer address): no ConnectPeer.

With --blocks N --block-size S it measures block transfers instead: N blocks of S bytes per
`Client.write_blocks`, both sides scattered by seeded permutations, beside a contiguous `Client.write`
of the same N x S bytes in the same round: posting time (until `write_blocks(wait=False)` returned),
latency, GB/s and their ratio, next to `tcpxctl bench transfer --blocks N --block-size S`.

With --batch as well (N at most 65,536) it measures, alternating transfer by transfer, a contiguous
transfer, the block transfer, and the same pairs as `Client.write_batch` / `read_batch` of WriteOps
/ ReadOps with offsets (one buffer pair, as a user without block lists writes scattered KV blocks)
in both request forms: packed ranges (what the package sends) and one entry message each (what it
sent before); `--read` for READs. Per kind: the time to make the ops (the user's code, after a
garbage collection outside every timing; not in the latency), the request's build time, posting time, latency from the
build, GB/s; then batch / blocks and batch / contiguous (issue 38, point 4).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import Client, _tensor

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30

#: What each path a client's waited transfers take (Client._waited_path()) is.
PATH_NAMES = {
    "local session": "the daemon's local session, framed on its unix socket",
    "own stream": "a request on the client's own gRPC Session stream",
    "unary": "a unary gRPC Write with wait",
}


def _find(name: str, explicit: Optional[str]) -> Optional[str]:
    if explicit:
        return explicit
    for base in (Path.cwd() / "target/release", Path.cwd() / "target/debug"):
        if (base / name).exists():
            return str(base / name)
    return shutil.which(name)


def _start(tcpxd: str, dir: Path, name: str, extra: Sequence[str] = ()) -> Tuple[subprocess.Popen, Dict[str, Any]]:
    ready = dir / f"{name}.ready"
    proc = subprocess.Popen(
        [tcpxd, "--node-id", name, "--builtin-emulation", "--api-socket", str(dir / f"{name}.sock"),
         "--peer-listen", "127.0.0.1:0", "--ready-file", str(ready), *extra],
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


def noop_calls(a: Client, iters: int) -> Dict[str, float]:
    """The gRPC floor: p50 of a call that does nothing in the daemon (DescribeBuffer), and the
    client process's CPU time and voluntary context switches per call (grpcio's own cost)."""
    import resource

    from . import _proto

    with a.register_host(4 * KIB) as buf:
        req = _proto.message("DescribeBufferRequest")(buffer_id=buf.id)
        for _ in range(50):
            a._unary("DescribeBuffer", req)
        lat = []
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        for _ in range(iters):
            t0 = time.perf_counter()
            a._unary("DescribeBuffer", req)
            lat.append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime) / iters
    return {"p50_us": _pct(lat, 50) * 1e6, "cpu_us": cpu * 1e6, "vcsw": (r1.ru_nvcsw - r0.ru_nvcsw) / iters}


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


def tcpxctl_row(tcpxctl: str, ea: str, eb: str, size: int, iters: int, warmup: int, cuda: bool) -> Dict[str, Any]:
    """One `tcpxctl bench transfer` row: `iters` WRITEs of `size` bytes from A to B."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "rows.jsonl"
        cmd = [tcpxctl, "bench", "transfer", "--endpoint", ea, "--peer-endpoint", eb, "--sizes", str(size),
               "--iters", str(iters), "--warmup", str(warmup), "--out", str(out)]
        if cuda:
            cmd += ["--cuda", "0"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        return next(r for r in rows if r["block_size"] == size)


def blocks_round(a: Client, b: Client, n: int, bs: int, iters: int, seed: int) -> Dict[str, Any]:
    """`iters` block WRITEs of `n` blocks of `bs` bytes (both sides permuted by `seed`), then
    `iters` contiguous WRITEs of the same bytes: posting and latency p50 (us) and GB/s each."""
    import numpy as np

    size = n * bs
    rng = np.random.default_rng(seed)
    li, ri = rng.permutation(n).astype(np.uint32), rng.permutation(n).astype(np.uint32)
    out: Dict[str, Any] = {}
    with a.register_host(size, shared=False) as src, b.register_host(size, shared=False) as dst:
        src.fill(seed=seed)
        with a.register_blocks(src, block_size=bs) as sl, b.register_blocks(dst, block_size=bs) as dl:
            for kind in ("blocks", "contiguous"):
                post: List[float] = []
                lat: List[float] = []
                for k in range(iters + 1):  # the first is a warm-up
                    t0 = time.perf_counter()
                    if kind == "blocks":
                        t = a.write_blocks(sl, li, dl.token, ri, wait=False)
                    else:
                        t = a.write(src, dst.descriptor, size, wait=False)
                    t1 = time.perf_counter()
                    t.result()
                    t2 = time.perf_counter()
                    if k:
                        post.append(t1 - t0)
                        lat.append(t2 - t0)
                    if kind == "blocks" and k == 0:
                        sd, dd = src.read_bytes(), dst.read_bytes()
                        bad = [j for j in range(0, n, max(1, n // 4096))
                               if sd[li[j] * bs:(li[j] + 1) * bs] != dd[ri[j] * bs:(ri[j] + 1) * bs]]
                        assert not bad, f"block pair {bad[0]} differs"
                out[kind] = {"posting_p50_us": _pct(post, 50) * 1e6, "p50_us": _pct(lat, 50) * 1e6,
                             "gbps": size * iters / sum(lat) / 1e9}
            assert dst.checksum() == src.checksum(), "bytes differ after the contiguous writes"
    out["ratio"] = out["blocks"]["gbps"] / out["contiguous"]["gbps"]
    return out


def tcpxctl_blocks_row(tcpxctl: str, ea: str, eb: str, n: int, bs: int, iters: int, seed: int) -> Dict[str, Any]:
    """`tcpxctl bench transfer --blocks n --block-size bs` on the same daemons: its JSON row."""
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "rows.jsonl"
        cmd = [tcpxctl, "bench", "transfer", "--endpoint", ea, "--peer-endpoint", eb, "--blocks", str(n),
               "--block-size", str(bs), "--iters", str(iters), "--warmup", "1", "--seed", str(seed), "--out", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text().splitlines()[-1])


def blocks_main(args: argparse.Namespace, a: Client, b: Client, tcpxctl: Optional[str], ea: str, eb: str) -> Dict[str, Any]:
    n, bs = args.blocks, args.block_size
    rounds = []
    for i in range(args.rounds):
        r: Dict[str, Any] = {"python": blocks_round(a, b, n, bs, args.big_iters, args.seed + i)}
        if tcpxctl:
            r["tcpxctl"] = tcpxctl_blocks_row(tcpxctl, ea, eb, n, bs, args.big_iters, args.seed + i)
        rounds.append(r)
    res: Dict[str, Any] = {"blocks": n, "block_size": bs, "rounds": rounds}
    print(f"{args.rounds} rounds of {args.big_iters} writes; {n} blocks of {bs} bytes ({n * bs / MIB:.1f} MiB), both sides permuted")
    for kind in ("blocks", "contiguous"):
        g = _median([r["python"][kind]["gbps"] for r in rounds])
        p = _median([r["python"][kind]["posting_p50_us"] for r in rounds])
        l50 = _median([r["python"][kind]["p50_us"] for r in rounds])
        res[f"python_{kind}_gbps"] = g
        print(f"python  {kind:<10}  {g:8.3f} GB/s   posting p50 {p:9.1f} us   p50 {l50:9.1f} us")
    ratio = _median([r["python"]["ratio"] for r in rounds])
    res["python_ratio"] = ratio
    print(f"python  scattered/contiguous {ratio:.2f}")
    if tcpxctl:
        for kind, key in (("blocks", "scattered"), ("contiguous", "contiguous")):
            g = _median([r["tcpxctl"][key]["gbps"] for r in rounds])
            p = _median([r["tcpxctl"][key]["posting_p50_us"] for r in rounds])
            res[f"tcpxctl_{kind}_gbps"] = g
            print(f"tcpxctl {kind:<10}  {g:8.3f} GB/s   posting p50 {p:9.1f} us")
        tr = _median([r["tcpxctl"]["ratio"] for r in rounds])
        res["tcpxctl_ratio"] = tr
        print(f"tcpxctl scattered/contiguous {tr:.2f}")
    return res


def batch_round(a: Client, b: Client, n: int, bs: int, iters: int, seed: int, read: bool) -> Dict[str, Any]:
    """Alternating, `iters` times (after one warm-up): a contiguous transfer, the block transfer
    and the same pairs as a plain batch of WriteOps / ReadOps, packed and as entries. Per kind:
    request build, posting and latency p50 (us), GB/s; the pairs are checked after each kind's
    warm-up."""
    import numpy as np

    from . import _ops
    from ._ops import ReadOp, WriteOp

    size = n * bs
    rng = np.random.default_rng(seed)
    li, ri = rng.permutation(n).astype(np.uint32), rng.permutation(n).astype(np.uint32)
    kinds = ("contiguous", "blocks", "batch", "batch_entries")
    times: Dict[str, Dict[str, List[float]]] = {k: {"make": [], "build": [], "post": [], "lat": []} for k in kinds}
    lo, ro = (li.astype(np.int64) * bs).tolist(), (ri.astype(np.int64) * bs).tolist()
    with a.register_host(size, shared=False) as mine, b.register_host(size, shared=False) as theirs:
        (theirs if read else mine).fill(seed=seed)
        with a.register_blocks(mine, block_size=bs) as ml, b.register_blocks(theirs, block_size=bs) as tl:
            for k in range(iters + 1):  # the first is a warm-up
                for kind in kinds:
                    # The last transfers' garbage collected before every kind's clock starts, so
                    # that a collection the fresh ops call for falls in no kind's transfer.
                    gc.collect()
                    t0 = time.perf_counter()
                    req = None
                    if kind.startswith("batch"):
                        if read:
                            rops: List[Any] = [ReadOp(theirs, mine, bs, remote_offset=r, local_offset=x) for x, r in zip(lo, ro)]
                        else:
                            rops = [WriteOp(mine, theirs, bs, local_offset=x, remote_offset=r) for x, r in zip(lo, ro)]
                        t1 = time.perf_counter()
                        pack = kind == "batch"
                        if read:
                            req = _ops.read_batch_request(rops, None, False, pack=pack)
                        else:
                            req = _ops.write_batch_request(rops, b"", None, None, False, pack=pack)
                    else:
                        t1 = time.perf_counter()
                    t2 = time.perf_counter()
                    if kind == "contiguous":
                        t = (a.read(theirs.descriptor, mine, size, wait=False) if read
                             else a.write(mine, theirs.descriptor, size, wait=False))
                    elif kind == "blocks":
                        t = (a.read_blocks(ml, li, tl.token, ri, wait=False) if read
                             else a.write_blocks(ml, li, tl.token, ri, wait=False))
                    else:
                        t = a._start("ReadBatch" if read else "WriteBatch", req, None, False)
                    t3 = time.perf_counter()
                    t.result()
                    t4 = time.perf_counter()
                    if k:
                        times[kind]["make"].append(t1 - t0)
                        times[kind]["build"].append(t2 - t1)
                        times[kind]["post"].append(t3 - t1)
                        times[kind]["lat"].append(t4 - t1)
                    elif kind != "contiguous":
                        src, dst = (theirs, mine) if read else (mine, theirs)
                        si, di = (ri, li) if read else (li, ri)
                        sd, dd = src.read_bytes(), dst.read_bytes()
                        bad = [j for j in range(0, n, max(1, n // 4096))
                               if sd[si[j] * bs:(si[j] + 1) * bs] != dd[di[j] * bs:(di[j] + 1) * bs]]
                        assert not bad, f"{kind}: block pair {bad[0]} differs"
    out: Dict[str, Any] = {}
    for kind in kinds:
        tk = times[kind]
        out[kind] = {"make_p50_us": _pct(tk["make"], 50) * 1e6, "build_p50_us": _pct(tk["build"], 50) * 1e6,
                     "posting_p50_us": _pct(tk["post"], 50) * 1e6, "p50_us": _pct(tk["lat"], 50) * 1e6,
                     "gbps": size * iters / sum(tk["lat"]) / 1e9}
    for kind in ("batch", "batch_entries"):
        out[f"{kind}_over_blocks"] = out[kind]["gbps"] / out["blocks"]["gbps"]
        out[f"{kind}_over_contiguous"] = out[kind]["gbps"] / out["contiguous"]["gbps"]
    out["blocks_over_contiguous"] = out["blocks"]["gbps"] / out["contiguous"]["gbps"]
    return out


def batch_main(args: argparse.Namespace, a: Client, b: Client) -> Dict[str, Any]:
    n, bs = args.blocks, args.block_size
    rounds = [batch_round(a, b, n, bs, args.big_iters, args.seed + i, args.read) for i in range(args.rounds)]
    op = "READ" if args.read else "WRITE"
    res: Dict[str, Any] = {"op": op, "blocks": n, "block_size": bs, "rounds": rounds}
    print(f"{op}: {args.rounds} rounds of {args.big_iters} transfers of each kind, alternating; {n} blocks of {bs} bytes "
          f"({n * bs / MIB:.1f} MiB), both sides permuted; medians over rounds (the latency runs from the request's build)")
    names = {"contiguous": "contiguous", "blocks": "block lists", "batch": "batch, packed",
             "batch_entries": "batch, entries"}
    for kind, name in names.items():
        m = {f: _median([r[kind][f] for r in rounds]) for f in ("gbps", "make_p50_us", "build_p50_us", "posting_p50_us", "p50_us")}
        res[kind] = m
        print(f"{name:<15} {m['gbps']:8.3f} GB/s   WriteOps {m['make_p50_us']:9.1f} us   request {m['build_p50_us']:9.1f} us"
              f"   posting {m['posting_p50_us']:9.1f} us   p50 {m['p50_us']:9.1f} us")
    for key in ("blocks_over_contiguous", "batch_over_blocks", "batch_entries_over_blocks",
                "batch_over_contiguous", "batch_entries_over_contiguous"):
        res[key] = _median([r[key] for r in rounds])
        print(f"{key.replace('_', ' '):<30} {res[key]:.2f}")
    return res


def _median(xs: List[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tcpxd.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--endpoint", help="sending daemon (default: start two local daemons)")
    ap.add_argument("--peer-endpoint", help="receiving daemon (its descriptors reach it: no connect needed)")
    ap.add_argument("--tcpxd", help="tcpxd binary for local daemons (default: target/release, target/debug, PATH)")
    ap.add_argument("--tcpxctl", help="tcpxctl binary for the comparison (default: as --tcpxd); 'none' skips it")
    ap.add_argument("--iters", type=int, default=1000, help="measured 4 KiB writes per round")
    ap.add_argument("--big", type=int, default=1024, help="size of the large writes, MiB")
    ap.add_argument("--big-iters", type=int, default=5, help="measured large writes per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each python then tcpxctl; medians reported")
    ap.add_argument("--tensor", action="store_true", help="also large tensor writes (needs torch and a GPU)")
    ap.add_argument("--json", help="append the results to this file as one JSON line")
    ap.add_argument("--blocks", type=int, help="measure block transfers of N blocks instead (with --block-size)")
    ap.add_argument("--block-size", type=int, default=4096, help="bytes per block with --blocks")
    ap.add_argument("--seed", type=int, default=1, help="the permutations' seed with --blocks")
    ap.add_argument("--batch", action="store_true",
                    help="with --blocks: also the same pairs as plain batches (packed and as entries), alternating")
    ap.add_argument("--read", action="store_true", help="with --blocks --batch: READs instead of WRITEs")
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
        tcpxctl = None if args.tcpxctl == "none" else _find("tcpxctl", args.tcpxctl)
        if args.blocks:
            with Client(ea) as a, Client(eb) as b:
                if args.batch:
                    res = batch_main(args, a, b)
                else:
                    res = blocks_main(args, a, b, tcpxctl, ea, eb)
            if args.json:
                with open(args.json, "a", encoding="utf-8") as f:
                    f.write(json.dumps(res) + "\n")
            return
        big = args.big * MIB
        res = {"endpoint": ea, "peer_endpoint": eb, "rounds": []}
        with Client(ea) as a, Client(eb) as b, Client(ea, local=False) as ao, Client(ea, local=False, stream=False) as au:
            # The first write pairs the daemons (B's descriptors carry its peer address) and tells
            # each client which path its waited transfers take.
            with a.register_host(4 * KIB) as s, b.register_host(4 * KIB) as d:
                for c in (a, ao, au):
                    c.write(s.id, d.descriptor, 4 * KIB)
            paths = {"python_4k": a._waited_path(), "python_4k_stream": ao._waited_path(), "python_4k_unary": au._waited_path()}
            res["paths"] = paths
            for _ in range(args.rounds):
                r: Dict[str, Any] = {"python_noop": noop_calls(a, args.iters)}
                r["python_4k"] = small_writes(a, b, 4 * KIB, args.iters, 50)
                r["python_4k_stream"] = small_writes(ao, b, 4 * KIB, args.iters, 50)
                r["python_4k_unary"] = small_writes(au, b, 4 * KIB, args.iters, 50)
                if tcpxctl:
                    r["tcpxctl_4k"] = tcpxctl_row(tcpxctl, ea, eb, 4 * KIB, args.iters, 50, False)
                r["python_host_big_gbps"] = host_big(a, b, big, args.big_iters)
                if tcpxctl:
                    r["tcpxctl_host_big"] = tcpxctl_row(tcpxctl, ea, eb, big, args.big_iters, 1, False)
                if args.tensor:
                    r["python_tensor_big_gbps"] = tensor_big(a, b, big, args.big_iters)
                    if tcpxctl:
                        r["tcpxctl_cuda_big"] = tcpxctl_row(tcpxctl, ea, eb, big, args.big_iters, 1, True)
                res["rounds"].append(r)
        rounds = res["rounds"]
        p50 = _median([r["python_4k"]["p50_us"] for r in rounds])
        p99 = _median([r["python_4k"]["p99_us"] for r in rounds])
        hg = _median([r["python_host_big_gbps"] for r in rounds])
        res.update(python_4k_p50_us=p50, python_4k_p99_us=p99, python_host_big_gbps=hg)
        print(f"{args.rounds} rounds; medians over rounds ({args.iters} 4 KiB writes, {args.big_iters} x {args.big} MiB a round)")
        noop = _median([r["python_noop"]["p50_us"] for r in rounds])
        cpu = _median([r["python_noop"]["cpu_us"] for r in rounds])
        vcsw = _median([r["python_noop"]["vcsw"] for r in rounds])
        res.update(python_noop_p50_us=noop, python_noop_cpu_us=cpu, python_noop_vcsw=vcsw)
        print(f"python  no-op call    p50 {noop:8.1f} us   (DescribeBuffer; grpcio: {cpu:.0f} us client CPU, {vcsw:.1f} context switches a call)")
        o50 = _median([r["python_4k_stream"]["p50_us"] for r in rounds])
        o99 = _median([r["python_4k_stream"]["p99_us"] for r in rounds])
        u50 = _median([r["python_4k_unary"]["p50_us"] for r in rounds])
        u99 = _median([r["python_4k_unary"]["p99_us"] for r in rounds])
        res.update(python_4k_stream_p50_us=o50, python_4k_stream_p99_us=o99, python_4k_unary_p50_us=u50, python_4k_unary_p99_us=u99)
        print(f"python  4 KiB write   p50 {p50:8.1f} us   p99 {p99:8.1f} us   (Client.write: {PATH_NAMES[paths['python_4k']]})")
        print(f"python  4 KiB write   p50 {o50:8.1f} us   p99 {o99:8.1f} us   (Client(local=False): {PATH_NAMES[paths['python_4k_stream']]})")
        print(f"python  4 KiB write   p50 {u50:8.1f} us   p99 {u99:8.1f} us   (Client(local=False, stream=False): {PATH_NAMES[paths['python_4k_unary']]})")
        print(f"python  {args.big} MiB write host    {hg:.3f} GB/s")
        if args.tensor:
            tg = _median([r["python_tensor_big_gbps"] for r in rounds])
            res["python_tensor_big_gbps"] = tg
            print(f"python  {args.big} MiB write tensor  {tg:.3f} GB/s")
        if tcpxctl:
            c50 = _median([r["tcpxctl_4k"]["p50_lat_us"] for r in rounds])
            c99 = _median([r["tcpxctl_4k"]["p99_lat_us"] for r in rounds])
            cg = _median([r["tcpxctl_host_big"]["gb_per_s"] for r in rounds])
            # Ratios per round (python and tcpxctl side by side in time), then their median.
            r50 = _median([r["python_4k"]["p50_us"] / r["tcpxctl_4k"]["p50_lat_us"] for r in rounds])
            rg = _median([r["python_host_big_gbps"] / r["tcpxctl_host_big"]["gb_per_s"] for r in rounds])
            res.update(tcpxctl_4k_p50_us=c50, tcpxctl_4k_p99_us=c99, tcpxctl_host_big_gbps=cg,
                       ratio_4k_p50=r50, ratio_host_big_gbps=rg)
            print(f"tcpxctl 4 KiB write   p50 {c50:8.1f} us   p99 {c99:8.1f} us")
            print(f"tcpxctl {args.big} MiB write host    {cg:.3f} GB/s")
            ro = _median([r["python_4k_stream"]["p50_us"] / r["tcpxctl_4k"]["p50_lat_us"] for r in rounds])
            ru = _median([r["python_4k_unary"]["p50_us"] / r["tcpxctl_4k"]["p50_lat_us"] for r in rounds])
            res.update(ratio_4k_stream_p50=ro, ratio_4k_unary_p50=ru)
            print(f"ratio   4 KiB p50 python/tcpxctl {r50:.2f}x (target <= 1.5x): {'met' if r50 <= 1.5 else 'MISSED'}"
                  f"   ({paths['python_4k']}; own stream {ro:.2f}x, unary {ru:.2f}x)")
            print(f"ratio   {args.big} MiB GB/s python/tcpxctl {rg:.3f}x (target >= 0.95x): {'met' if rg >= 0.95 else 'MISSED'}")
            if args.tensor:
                ct = _median([r["tcpxctl_cuda_big"]["gb_per_s"] for r in rounds])
                rt = _median([r["python_tensor_big_gbps"] / r["tcpxctl_cuda_big"]["gb_per_s"] for r in rounds])
                res.update(tcpxctl_cuda_big_gbps=ct, ratio_tensor_big_gbps=rt)
                print(f"tcpxctl {args.big} MiB write cuda    {ct:.3f} GB/s")
                print(f"ratio   {args.big} MiB GB/s tensor/cuda {rt:.3f}x (target >= 0.95x): {'met' if rt >= 0.95 else 'MISSED'}")
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
