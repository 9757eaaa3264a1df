#!/usr/bin/env python3
"""NCCL collectives through the emulation plugin, every result checked exactly (issue #14).

all_reduce, all_gather, reduce_scatter, broadcast and send/recv (NCCL through PyTorch, two ranks,
one process each), from one element to 256 MiB with odd counts, for each configuration given with
--config, by default the emulation plugin in both fragment modes and NCCL's own sockets:

  --config LABEL=socket[,KEY=VAL...]        NCCL_NET=Socket over loopback
  --config LABEL=PATH.so[,KEY=VAL...]       the emulation plugin at PATH as NCCL's net plugin;
                                            expanded into LABEL-page and LABEL-odd
                                            (TCPXEMU_FRAGMENTS) unless KEY=VAL names it

KEY=VAL pairs are extra environment for that configuration only (NCCL_ALGO=Ring,
TCPXEMU_PAT_GUARD=0, ...). Every configuration gets the same NCCL settings: P2P, SHM and NVLS
off, NCCL_PROTO=Simple, NCCL_NET_GDR_LEVEL=SYS, 4 MiB buffers, 512 KiB plugin chunks, 4 data
sockets per connection. NCCL_ALGO is left to NCCL unless a configuration sets it.

Each (operation, size) runs once on fresh inputs (small integers in float32, so sums are exact)
and is compared element by element with the expected result, on both ranks; then it is timed
(--iters after --warmup, CUDA events around the loop) and the outputs of the idempotent
operations are compared again. Prints one nccl-tests-like table per configuration
(size count type redop root time algbw busbw #wrong; time is the slower rank's), the bus bandwidth of each configuration
beside the first socket one, and NCCL INFO lines (each rank's full log is under --out-dir) that
show which network carried the traffic and which algorithm NCCL chose. Exit status 1 on any
mismatch, failed or timed-out configuration.

--same-gpu runs both ranks on GPU 0, each with its own NCCL_HOSTID so that NCCL's duplicate-GPU
check does not fire and the traffic crosses the network plugin (a one-GPU machine). There a
broadcast is timed over at least 50 iterations: at a few, both nets read erratic.
"""

import argparse
import json
import os
import re
import sys
import time

# A broadcast's timed iterations at least, with --same-gpu (docs/BENCHMARKS.md, session 28).
BROADCAST_SAME_GPU_MIN_ITERS = 50
OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv"]
# Elements of float32 per operation (for all_gather/reduce_scatter: in all, over both ranks),
# from one element to 256 MiB, odd counts included.
DEFAULT_COUNTS = [1, 3, 17, 1001, 4097, 65537, 262143, 1048577, 4194303, 16777217, 67108864]
BUSBW = {  # nccl-tests' bus bandwidth factors for n ranks
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send_recv": lambda n: 1.0,
}
NRANKS = 2


def op_counts(op, counts):
    """The element counts `op` runs (for all_gather/reduce_scatter: per rank), one per size."""
    seen, out = set(), []
    for c in counts:
        per = c
        if op in ("all_gather", "reduce_scatter"):
            per = max(1, c // NRANKS)
            per |= c % 2  # an odd total keeps an odd count per rank
        if per not in seen:
            seen.add(per)
            out.append(per)
    return out


def base_env(args):
    return {
        "NCCL_P2P_DISABLE": "1",
        "NCCL_SHM_DISABLE": "1",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
        "NCCL_IB_DISABLE": "1",
        "NCCL_PROTO": "Simple",
        "NCCL_NET_GDR_LEVEL": "SYS",
        "NCCL_BUFFSIZE": "4194304",
        "NCCL_P2P_NET_CHUNKSIZE": "524288",
        "NCCL_NSOCKS_PERTHREAD": str(args.sockets),
        "NCCL_SOCKET_NTHREADS": "1",
        "NCCL_SOCKET_IFNAME": "lo",
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": args.debug_subsys,
    }


def parse_configs(args):
    specs = args.config or [
        "emu=" + os.path.join(os.path.dirname(__file__), "..", "target", "release", "libnccl_net_tcpxemu.so"),
        "socket=socket",
    ]
    out = []
    for spec in specs:
        label, _, rest = spec.partition("=")
        parts = rest.split(",")
        target, extra = parts[0], dict(p.split("=", 1) for p in parts[1:] if p)
        if target == "socket":
            out.append({"label": label, "net": "socket", "env": extra})
            continue
        if not os.path.exists(target):
            sys.exit(f"--config {spec}: no plugin at {target}")
        modes = [extra["TCPXEMU_FRAGMENTS"]] if "TCPXEMU_FRAGMENTS" in extra else args.fragments.split(",")
        for m in modes:
            env = dict(extra, TCPXEMU_FRAGMENTS=m)
            name = label if "TCPXEMU_FRAGMENTS" in extra else f"{label}-{m}"
            out.append({"label": name, "net": "plugin", "plugin": os.path.abspath(target), "env": env})
    return out


def plugin_env(cfg, tmp):
    if cfg["net"] == "socket":
        return {"NCCL_NET": "Socket"}
    # NCCL finds plugins as libnccl-net-<name>.so on the library path: link ours under that name.
    d = os.path.join(tmp, "plugin-" + cfg["label"])
    os.makedirs(d, exist_ok=True)
    link = os.path.join(d, "libnccl-net-tcpxemu.so")
    if os.path.lexists(link):
        os.unlink(link)
    os.symlink(cfg["plugin"], link)
    return {
        "NCCL_NET_PLUGIN": "tcpxemu",
        "NCCL_NET": "tcpxemu_v7",  # fail rather than fall back to sockets
        "LD_LIBRARY_PATH": d + ":" + os.environ.get("LD_LIBRARY_PATH", ""),
        "NCCL_DYNAMIC_CHUNK_SIZE": "524288",
    }


def worker(rank, args, cfg, env, port, log_path, q):
    # Everything this process and NCCL print goes to its log file.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(env)
    gpu = 0 if args.same_gpu else rank
    if args.same_gpu:
        os.environ["NCCL_HOSTID"] = f"tcpxd-bench-rank{rank}"
    try:
        rows = run_rank(rank, gpu, args, port)
        q.put((rank, "ok", rows))
    except BaseException as e:  # report, then die
        import traceback

        traceback.print_exc()
        q.put((rank, "error", repr(e)))
        sys.stdout.flush()
        os._exit(1)


def run_rank(rank, gpu, args, port):
    import torch
    import torch.distributed as dist

    if args.backend == "gloo":  # a CPU dry run of this script's own logic (no NCCL, no GPU)
        dev = torch.device("cpu")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=NRANKS)

        def sync():
            pass

        def barrier():
            dist.barrier()
    else:
        torch.cuda.set_device(gpu)
        dev = torch.device("cuda", gpu)
        dist.init_process_group(
            "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=NRANKS, device_id=dev
        )

        def sync():
            torch.cuda.synchronize()

        def barrier():
            dist.barrier(device_ids=[dev.index])

    n = NRANKS
    peer = 1 - rank

    def values(count, r, salt):
        i = torch.arange(count, dtype=torch.int64, device=dev)
        return (((i * 7 + r * 13 + salt) % 251) - 125).to(torch.float32)

    def make(op, count):
        """(run() -> output, expected output, idempotent, nccl-tests bytes, output buffer, timed run)."""
        if op == "all_reduce":
            x = values(count, rank, count)
            expect = sum(values(count, r, count) for r in range(n))
            buf = torch.empty_like(x)

            def run():
                buf.copy_(x)
                dist.all_reduce(buf)
                return buf

            # Timed in place, as nccl-tests does (the sums grow; only the checked run is compared).
            return run, expect, False, count * 4, buf, lambda: dist.all_reduce(buf)
        if op == "all_gather":
            per = count
            x = values(per, rank, count)
            out = torch.empty(per * n, device=dev)
            expect = torch.cat([values(per, r, count) for r in range(n)])
            run = lambda: (dist.all_gather_into_tensor(out, x), out)[1]
            return run, expect, True, per * n * 4, out, run
        if op == "reduce_scatter":
            per = count
            x = values(per * n, rank, count)
            out = torch.empty(per, device=dev)
            full = sum(values(per * n, r, count) for r in range(n))
            expect = full[rank * per : (rank + 1) * per]
            run = lambda: (dist.reduce_scatter_tensor(out, x), out)[1]
            return run, expect, True, per * n * 4, out, run
        if op == "broadcast":
            x = values(count, 0, count)
            buf = x.clone() if rank == 0 else torch.empty(count, device=dev)
            run = lambda: (dist.broadcast(buf, 0), buf)[1]
            return run, x, True, count * 4, buf, run
        if op == "send_recv":
            x = values(count, rank, count)
            out = torch.empty(count, device=dev)
            expect = values(count, peer, count)

            def run():
                ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, out, peer)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
                return out

            return run, expect, True, count * 4, out, run
        raise ValueError(op)

    def wrong(out, expect):
        return int((out != expect).sum().item())

    rows = []
    # Connections and first-use costs outside every figure.
    t = torch.ones(1, device=dev)
    dist.all_reduce(t)
    sync()
    for op in args.ops:
        for count in op_counts(op, args.counts):
            fn, expect, idem, nbytes, out, timed = make(op, count)
            if not (op == "broadcast" and rank == 0):
                out.fill_(float("nan"))  # poison: an element nobody wrote compares unequal
            got = fn()
            sync()
            bad = wrong(got, expect)
            first_bad = None
            if bad:
                idx = (got != expect).nonzero()[0].item()
                first_bad = (idx, float(got[idx].item()), float(expect[idx].item()))
            us = None
            if args.iters > 0:
                iters = max(2, min(args.iters, int(args.budget_bytes // max(nbytes, 1))))
                if op == "broadcast" and args.same_gpu and args.iters > 0:
                    # One-directional on one GPU: at 5-10 iterations both nets read erratic
                    # (session 28: sockets 70-550 µs an operation); 50 give steady figures.
                    iters = max(iters, BROADCAST_SAME_GPU_MIN_ITERS)
                for _ in range(args.warmup):
                    timed()
                barrier()
                sync()
                if op == "broadcast":
                    # One-directional: the receiver's clock would start when it leaves the
                    # barrier, the root's first send may come hundreds of µs later (its own exit
                    # and launch), and that lag divided by a few iterations was session 27's
                    # "erratic broadcast" on both nets. One untimed broadcast first starts the
                    # receiver's clock after the root's data has begun to arrive.
                    timed()
                    sync()
                if dev.type == "cuda":
                    s = torch.cuda.Event(enable_timing=True)
                    e = torch.cuda.Event(enable_timing=True)
                    s.record()
                    for _ in range(iters):
                        timed()
                    e.record()
                    e.synchronize()
                    us = s.elapsed_time(e) * 1000.0 / iters
                else:
                    t0 = time.perf_counter()
                    for _ in range(iters):
                        timed()
                    us = (time.perf_counter() - t0) * 1e6 / iters
                if idem:
                    bad += wrong(out, expect)
            rows.append(
                {
                    "op": op,
                    "count": (nbytes // 4),
                    "bytes": nbytes,
                    "rank": rank,
                    "time_us": us,
                    "wrong": bad,
                    "first_wrong": first_bad,
                }
            )
            del fn, expect, out, timed, got
    barrier()
    dist.destroy_process_group()
    return rows


def run_config(args, cfg, env, out_dir, idx):
    import torch.multiprocessing as mp

    port = 29500 + os.getpid() % 1000 + 11 * idx
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    logs = [os.path.join(out_dir, f"{cfg['label']}.rank{r}.log") for r in range(NRANKS)]
    procs = [ctx.Process(target=worker, args=(r, args, cfg, env, port, logs[r], q)) for r in range(NRANKS)]
    start = time.time()
    # The children must start with the configuration's environment: the dynamic loader reads
    # LD_LIBRARY_PATH (where NCCL finds libnccl-net-tcpxemu.so) only at process start.
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results, status = {}, "ok"
    deadline = start + args.timeout
    while len(results) < NRANKS:
        left = deadline - time.time()
        if left <= 0:
            status = "timeout"
            break
        try:
            rank, st, payload = q.get(timeout=min(left, 5))
        except Exception:
            if all(not p.is_alive() for p in procs) and q.empty():
                status = "died"
                break
            continue
        results[rank] = payload
        if st != "ok":
            status = f"error on rank {rank}: {payload}"
            break
    for p in procs:
        p.join(timeout=10 if status == "ok" else 1)
        if p.is_alive():
            p.kill()
            p.join()
    return status, results, logs, time.time() - start


PROOF = [
    ("plugin", re.compile(r"NET/Plugin: Loaded net plugin|Using network")),
    ("channel", re.compile(r"Channel \d+/\d+ : .* via NET/")),
    ("nodes", re.compile(r"nNodes \d+")),
    ("pat-guard", re.compile(r"NCCL_PAT_ENABLE")),
    ("emulation", re.compile(r"tcpxemu: \d+ device\(s\)")),
]
ALGO = re.compile(r"(AllReduce|AllGather|ReduceScatter|Broadcast): \d+ Bytes -> Algo (\w+)")


def proof(logs):
    lines, algos = [], {}
    for path in logs[:1]:
        try:
            text = open(path, errors="replace").read().splitlines()
        except OSError:
            continue
        for name, rx in PROOF:
            hits = [l for l in text if rx.search(l)]
            for l in hits[:2]:
                lines.append(f"  [{name}] {l.strip()[:220]}")
            if len(hits) > 2:
                lines.append(f"  [{name}] ... {len(hits)} such lines")
        for l in text:
            m = ALGO.search(l)
            if m:
                algos[(m.group(1), m.group(2))] = algos.get((m.group(1), m.group(2)), 0) + 1
    if algos:
        lines.append("  [algorithms] " + ", ".join(f"{c} {a}: {k}" for (c, a), k in sorted(algos.items())))
    return lines


def fmt_table(label, rows):
    out = [f"# {label}", "#" + " " * 9 + "size         count    type   redop    root     time   algbw   busbw  #wrong"]
    out.append("#" + " " * 9 + " (B)    (elements)                               (us)  (GB/s)  (GB/s)")
    cur = None
    for r in rows:
        if r["op"] != cur:
            cur = r["op"]
            out.append(f"# {cur}")
        t = r["time_us"]
        algbw = r["bytes"] / (t * 1e3) if t else 0.0
        busbw = algbw * BUSBW[r["op"]](NRANKS)
        redop = "sum" if r["op"] in ("all_reduce", "reduce_scatter") else "none"
        root = "0" if r["op"] == "broadcast" else "-1"
        ts = f"{t:8.1f}" if t else "       -"
        out.append(
            f"{r['bytes']:>14} {r['count']:>13} {'float':>7} {redop:>7} {root:>7} {ts} {algbw:7.2f} {busbw:7.2f} {r['wrong']:>7}"
        )
    return out


def merge(results):
    """The slower rank's time (a broadcast root or a sender can finish long before its peer),
    both ranks' #wrong."""
    r0 = results.get(0, [])
    by = {(r["op"], r["bytes"]): dict(r) for r in r0}
    for r in results.get(1, []):
        k = (r["op"], r["bytes"])
        if k in by:
            by[k]["wrong"] += r["wrong"]
            by[k]["first_wrong"] = by[k]["first_wrong"] or r["first_wrong"]
            if by[k]["time_us"] is not None and r["time_us"] is not None:
                by[k]["time_us"] = max(by[k]["time_us"], r["time_us"])
        else:
            by[k] = dict(r)
    return sorted(by.values(), key=lambda r: (OPS.index(r["op"]), r["bytes"]))


def compare(configs, by_label):
    """Bus bandwidth of every timed configuration beside the first socket one."""
    ref = next((c["label"] for c in configs if c["net"] == "socket"), None)
    timed = [c["label"] for c in configs if any(r["time_us"] for r in by_label[c["label"]])]
    if not timed:
        return
    print()
    print("# busbw GB/s" + (f" (ratio to {ref})" if ref else ""))
    print(f"{'op':<15}{'bytes':>12} " + " ".join(f"{l:>16}" for l in timed))
    keys = sorted({(r["op"], r["bytes"]) for l in timed for r in by_label[l]}, key=lambda k: (OPS.index(k[0]), k[1]))
    for op, nb in keys:
        vals = {}
        for l in timed:
            r = next((x for x in by_label[l] if x["op"] == op and x["bytes"] == nb), None)
            vals[l] = (nb / (r["time_us"] * 1e3)) * BUSBW[op](NRANKS) if r and r["time_us"] else None
        refbw = vals.get(ref) if ref else None
        cells = []
        for l in timed:
            bw = vals[l]
            if bw is None:
                cells.append(f"{'-':>16}")
            elif refbw and l != ref:
                cells.append(f"{bw:9.2f} ({bw / refbw:4.2f})")
            else:
                cells.append(f"{bw:16.2f}")
        print(f"{op:<15}{nb:>12} " + " ".join(cells))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", help="LABEL=socket|PATH.so[,KEY=VAL...] (repeatable)")
    ap.add_argument("--fragments", default="page,odd", help="fragment modes for each plugin config")
    ap.add_argument("--only", default=",".join(OPS), help="operations: " + ",".join(OPS))
    ap.add_argument("--counts", default=",".join(map(str, DEFAULT_COUNTS)), help="float32 element counts")
    ap.add_argument("--max-bytes", type=int, default=1 << 28, help="drop counts above this many bytes")
    ap.add_argument("--iters", type=int, default=10, help="timed iterations (0: check only)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget-bytes", type=float, default=2e9, help="fewer timed iterations for big sizes")
    ap.add_argument("--check-only", default="", help="comma list of labels (prefixes) that skip timing")
    ap.add_argument("--sockets", type=int, default=4, help="data sockets per connection (both nets)")
    ap.add_argument("--same-gpu", action="store_true", help="both ranks on GPU 0, each its own NCCL_HOSTID")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per configuration")
    ap.add_argument("--debug-subsys", default="INIT,NET,TUNING")
    ap.add_argument("--out-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "nccl-collectives"))
    ap.add_argument("--json-out", help="append one JSON line per (config, op, size)")
    ap.add_argument("--backend", default="nccl", choices=["nccl", "gloo"],
                    help="gloo: a CPU dry run of the script itself (tests; no NCCL, no GPU)")
    args = ap.parse_args()
    args.ops = [o for o in args.only.split(",") if o]
    for o in args.ops:
        if o not in OPS:
            sys.exit(f"--only: unknown operation {o} (known: {', '.join(OPS)})")
    args.counts = [c for c in (int(x) for x in args.counts.split(",") if x) if c * 4 <= args.max_bytes]
    os.makedirs(args.out_dir, exist_ok=True)
    configs = parse_configs(args)
    check_only = [p for p in args.check_only.split(",") if p]

    summary, tables, by_label, failed = [], [], {}, []
    for idx, cfg in enumerate(configs):
        env = base_env(args)
        env.update(plugin_env(cfg, args.out_dir))
        env.update(cfg["env"])
        a = argparse.Namespace(**vars(args))
        if any(cfg["label"].startswith(p) for p in check_only):
            a.iters = 0
        print(f"=== {cfg['label']}: {cfg.get('plugin', 'NCCL_NET=Socket')} "
              f"{' '.join(f'{k}={v}' for k, v in cfg['env'].items())}", flush=True)
        status, results, logs, secs = run_config(a, cfg, env, args.out_dir, idx)
        rows = merge(results)
        by_label[cfg["label"]] = rows
        nwrong = sum(r["wrong"] for r in rows)
        bad_cases = [r for r in rows if r["wrong"]]
        expected = sum(len(op_counts(o, args.counts)) for o in args.ops)
        ok = status == "ok" and nwrong == 0 and len(rows) == expected
        if not ok:
            failed.append(cfg["label"])
        line = (f"{cfg['label']}: {status}, {len(rows)} cases, {len(bad_cases)} with wrong elements "
                f"({nwrong} elements), {secs:.0f}s")
        summary.append(line)
        print(line, flush=True)
        for r in bad_cases[:12]:
            print(f"  WRONG {r['op']} {r['bytes']} B: {r['wrong']} elements, first (index, got, expected) "
                  f"{r['first_wrong']}", flush=True)
        for l in proof(logs):
            print(l, flush=True)
        if status != "ok":
            for path in logs:
                try:
                    tail = open(path, errors="replace").read().splitlines()[-8:]
                except OSError:
                    tail = []
                for l in tail:
                    print(f"  [{os.path.basename(path)}] {l[:220]}", flush=True)
        tables.append(fmt_table(cfg["label"], rows))
        if args.json_out:
            with open(args.json_out, "a") as f:
                for r in rows:
                    f.write(json.dumps(dict(r, config=cfg["label"], status=status, same_gpu=args.same_gpu)) + "\n")

    for t in tables:
        print()
        print("\n".join(t))
    compare(configs, by_label)
    print()
    print("\n".join(summary))
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        sys.exit(1)
    print("all results exact")


if __name__ == "__main__":
    main()
