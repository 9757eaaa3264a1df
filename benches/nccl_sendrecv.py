#!/usr/bin/env python3
"""NCCL send/recv between two GPUs of one host, one process per GPU (PyTorch), timed like
`tcpxctl bench transfer`: per message size, warm-up, then iterations with per-message latency
(CUDA events on the receiver), and the bytes of the last message checked on the receiver.

Two network set-ups (NVLink, P2P and shared memory are always off, so bytes cross a network):

  --net socket   NCCL's own TCP sockets over loopback (NCCL_NET=Socket).
  --net plugin   The emulation plugin as NCCL's net plugin (NCCL_NET_PLUGIN), TCPX-style: CUDA
                 bounce pages + NCCL's unpack kernel when NCCL enables GPUDirect for it, else host
                 buffers. Every checked byte is a conformance check of the emulation under NCCL.

With --concurrency N, each timed step is a group of N messages in flight at once (one
batch_isend_irecv of N ops on N distinct ranges), like `tcpxctl bench transfer --concurrency N`:
the latency is the group's, GB/s counts the N messages.

Prints a table (nixlbench-like columns) and writes JSON lines (--out). Reports only.
"""

import argparse
import json
import os
import sys
import time


def parse_size(s: str) -> int:
    s = s.strip().upper().replace("IB", "").replace("B", "")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if s and s[-1] in mult:
        return int(float(s[:-1]) * mult[s[-1]])
    return int(s)


def fmt_size(n: int) -> str:
    for unit, v in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= v and n % v == 0:
            return f"{n // v}{unit}"
    return str(n)


def worker(rank: int, args, env: dict, port: int, q):
    os.environ.update(env)
    gpu = 0 if args.same_gpu else rank
    if args.same_gpu:
        # Both ranks on one GPU: a host id of its own per rank makes NCCL see two nodes (its
        # duplicate-GPU check compares host hash and bus id), so the traffic takes the net plugin.
        os.environ["NCCL_HOSTID"] = f"tcpxd-bench-rank{rank}"
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(gpu)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        device_id=torch.device("cuda", gpu),
    )
    rows = []
    peer = 1 - rank
    max_size = max(args.sizes)
    depth = args.concurrency
    # Without --ack the receiver times each recv; with it the sender times send + reply.
    reporter = 0 if args.ack else 1
    buf = torch.empty(max_size * depth, dtype=torch.uint8, device="cuda")
    # One tiny exchange each way first, so that no timing includes connection set-up: NCCL
    # connects a direction's channels at its first message, and with --ack the replies go the
    # other way (before, the first timed message's reply paid for connecting 1 -> 0).
    t = torch.ones(1, device="cuda")
    for src in (0,) if args.connect_late else (0, 1):
        if rank == src:
            dist.send(t, peer)
        else:
            dist.recv(t, peer)
        torch.cuda.synchronize()
    ack = torch.zeros(1, dtype=torch.uint8, device="cuda")

    def step(size):
        """One timed step: one message, or a group of `depth` messages in flight at once; with
        --ack, then a 1-byte reply from the receiver once the message(s) landed."""
        if depth == 1:
            if rank == 0:
                dist.send(buf[:size], peer)
            else:
                dist.recv(buf[:size], peer)
        else:
            fn = dist.isend if rank == 0 else dist.irecv
            ops = [dist.P2POp(fn, buf[j * size : (j + 1) * size], peer) for j in range(depth)]
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        if args.ack:
            if rank == 0:
                dist.recv(ack, peer)
            else:
                dist.send(ack, peer)

    for size in args.sizes:
        view = buf[: size * depth]
        lat = []
        total = args.warmup + args.iters
        for it in range(total):
            last = it == total - 1
            if rank == 0 and last:
                # The checked message(s): a pattern that depends on the size.
                g = torch.arange(size * depth, dtype=torch.int64, device="cuda")
                view.copy_(((g * 131 + size) % 251).to(torch.uint8))
            if args.sync_each:
                dist.barrier(device_ids=[gpu])
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            step(size)
            end.record()
            end.synchronize()
            if it >= args.warmup:
                lat.append(start.elapsed_time(end) * 1000.0)  # µs
        ok = True
        if rank == 1:
            g = torch.arange(size * depth, dtype=torch.int64, device="cuda")
            expect = ((g * 131 + size) % 251).to(torch.uint8)
            ok = bool(torch.equal(view, expect))
        if args.ack:
            # The sender reports (its timer saw the reply): it learns the receiver's check.
            flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device="cuda")
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            ok = bool(flag.item())
        # Steady-state bandwidth: `iters` messages back to back, one timing around all of them.
        dist.barrier(device_ids=[gpu])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.iters):
            step(size)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        if rank == reporter:
            lat.sort()
            pick = lambda q: lat[min(len(lat) - 1, int(round((len(lat) - 1) * q)))]
            rows.append(
                {
                    # The fields of `tcpxctl bench` rows, so the tables line up.
                    "harness": f"nccl-{args.net}",
                    "op": "send/recv",
                    "memory": "cuda:0->cuda:0" if args.same_gpu else "cuda:0->cuda:1",
                    "block_size": size,
                    "batch_size": 1,
                    "concurrency": depth,
                    "iterations": args.iters,
                    "warmup": args.warmup,
                    # One message at a time (as tcpxctl bench measures), and back to back.
                    "gb_per_s": size * depth * len(lat) / (sum(lat) / 1e6) / 1e9,
                    "stream_gb_per_s": size * depth * args.iters / wall / 1e9,
                    "avg_lat_us": sum(lat) / len(lat),
                    "p50_lat_us": pick(0.5),
                    "p99_lat_us": pick(0.99),
                    "min_lat_us": lat[0],
                    "max_lat_us": lat[-1],
                    "verified": ok,
                }
            )
    dist.barrier(device_ids=[gpu])
    dist.destroy_process_group()
    if rank == reporter:
        q.put(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--net", choices=["socket", "plugin"], required=True)
    ap.add_argument("--plugin", help="path to libnccl_net_tcpxemu.so (--net plugin)")
    ap.add_argument("--sizes", default="4K,16K,64K,256K,1M,4M,16M,64M,256M")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--sockets", type=int, default=4, help="data sockets per connection (both nets)")
    ap.add_argument("--sync-each", action="store_true", help="barrier before each timed message")
    ap.add_argument("--ack", action="store_true",
                    help="the sender times each message (group) until a 1-byte reply from the receiver "
                    "says it landed, as a daemon WRITE completes; without it the receiver times its recv, "
                    "and a sender that runs ahead makes that little more than the unpack")
    ap.add_argument("--concurrency", type=int, default=1, help="messages in flight per timed step (a group)")
    ap.add_argument("--connect-late", action="store_true",
                    help="connect the 1 -> 0 direction at the first --ack reply, while the first message may still "
                    "be in flight, instead of up front (the reproducer of docs/EMULATION.md's known problem)")
    ap.add_argument("--out", help="append JSON lines here")
    ap.add_argument("--same-gpu", action="store_true",
                    help="both ranks on GPU 0 (a host with one GPU), each with its own NCCL_HOSTID")
    args = ap.parse_args()
    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    if args.concurrency < 1:
        sys.exit("--concurrency must be at least 1")

    env = {
        "NCCL_P2P_DISABLE": "1",
        "NCCL_SHM_DISABLE": "1",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NCCL_IB_DISABLE": "1",
        # GCP's TCPX settings (TCPX needs the Simple protocol: received bytes must go through
        # NCCL's unpack, which only Simple does); both nets use them so they compare.
        "NCCL_PROTO": "Simple",
        "NCCL_ALGO": "Ring",
        "NCCL_P2P_NET_CHUNKSIZE": "524288",
        "NCCL_BUFFSIZE": "4194304",
        "NCCL_NSOCKS_PERTHREAD": str(args.sockets),
        "NCCL_SOCKET_NTHREADS": "1",
        "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "INFO"),
        "NCCL_DEBUG_SUBSYS": os.environ.get("NCCL_DEBUG_SUBSYS", "INIT,NET"),
    }
    if args.net == "socket":
        env.update({"NCCL_NET": "Socket", "NCCL_SOCKET_IFNAME": "lo"})
    else:
        if not args.plugin or not os.path.exists(args.plugin):
            sys.exit("--net plugin needs --plugin PATH to libnccl_net_tcpxemu.so")
        # NCCL finds plugins as libnccl-net-<name>.so on the library path: link ours under that name.
        d = os.path.join(os.environ.get("TMPDIR", "/tmp"), "tcpxd-nccl-plugin")
        os.makedirs(d, exist_ok=True)
        link = os.path.join(d, "libnccl-net-tcpxemu.so")
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(os.path.abspath(args.plugin), link)
        env.update(
            {
                "NCCL_NET_PLUGIN": "tcpxemu",
                "NCCL_NET": "tcpxemu_v7",  # fail rather than fall back to sockets
                "LD_LIBRARY_PATH": d + ":" + os.environ.get("LD_LIBRARY_PATH", ""),
                "NCCL_DYNAMIC_CHUNK_SIZE": "524288",
                "NCCL_NET_GDR_LEVEL": "SYS",
                "NCCL_SOCKET_IFNAME": "lo",
            }
        )
    # The plugin and NCCL read the environment at load: set it before the workers start.
    os.environ.update(env)

    import torch.multiprocessing as mp

    port = 29500 + (os.getpid() % 1000)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, args, env, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    rows = q.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    print()
    print(
        f"{'harness':<14} {'block':>6} {'batch':>5} {'GB/s':>8} {'stream':>8} {'avg_us':>10} {'p50_us':>10} "
        f"{'p99_us':>10} {'bytes ok':>8}"
    )
    for r in rows:
        print(
            f"{r['harness']:<14} {fmt_size(r['block_size']):>6} {r['batch_size']:>5} {r['gb_per_s']:>8.2f} "
            f"{r['stream_gb_per_s']:>8.2f} {r['avg_lat_us']:>10.1f} {r['p50_lat_us']:>10.1f} "
            f"{r['p99_lat_us']:>10.1f} {str(r['verified']):>8}"
        )
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    if bad or not all(r["verified"] for r in rows):
        sys.exit(f"failed: exit codes {bad}, verified {[r['verified'] for r in rows]}")


if __name__ == "__main__":
    main()
