#!/usr/bin/env python3
"""One run, five harnesses, the same message sizes, on a host with two GPUs:

  nccl-socket  NCCL send/recv between the GPUs over NCCL's own TCP sockets (loopback)
  nccl-plugin  NCCL send/recv with the emulation plugin as NCCL's net plugin (bytes checked)
  raw          the raw plugin bench: the daemon's chunking, windows and unpack, no daemon, no gRPC
  daemon       two tcpxd daemons (one per GPU) on the emulation plugin, `tcpxctl bench transfer`
               (its gRPC `Session` stream, tcpxctl's and any gRPC client's crossing)
  daemon-local the same daemons through a framed local session on the API's unix socket
               (`bench transfer --via local`): the crossing the Python package's client uses

P2P, SHM and NVLink are off everywhere, every harness uses 4 data sockets per connection, and the
emulation plugin is in its CUDA mode (GPU bounce pages + unpack) wherever GPU buffers are used.
Prints one table with the ratios daemon/raw, daemon/nccl-plugin and daemon/nccl-socket (and the
same for daemon-local) and writes every row as JSON lines to --out. Reports only: nothing here
asserts a speed.

  python3 benches/compare.py --bin target/release --sizes 4K,64K,1M,4M,16M,64M,256M
  python3 benches/compare.py --concurrency 8 --sizes 64K,1M,4M   # 8 transfers in flight
  python3 benches/compare.py --same-gpu --mps                     # a host with one GPU
  python3 benches/compare.py --rounds 3 --sizes 64M,256M          # alternate, report the median round

--concurrency N keeps N transfers in flight in every harness: the daemon bench on one Session,
the raw bench as a queue of the same depth, NCCL as groups of N send/recv. GB/s then counts the
N transfers (over the wall time for raw and daemon, over the groups' time for NCCL).

NCCL's rows are timed as a daemon WRITE completes: the sending rank times each message (or group)
until a 1-byte reply from the receiver says it landed (`--ack` of nccl_sendrecv.py). Timed at the
receiver instead (`--nccl-free-running`, the old rows), the sender runs ahead: its send completes
once the plugin took the bytes, so the next message is often in the receiver's bounce pages before
the receiver's timer starts, and the row times little more than the unpack (4 KiB: 14-19 µs on
one H100, with or without a barrier before each message).

--blocks N (with --block-size S) adds a row of block transfers: `tcpxctl bench transfer --blocks N
--block-size S` between the two daemons (N blocks of S bytes per WriteBlocks, both sides scattered
by a seeded permutation) beside one contiguous transfer of the same bytes in the same run: both GB/s,
their ratio and the posting time (until the daemon answered TransferStarted).

--rounds N runs the harnesses N times, alternating (nccl-socket, nccl-plugin, raw, daemon, then
again), so that a burst of host noise lands in one round of one harness rather than in all of one
harness's sizes; each row of the table is then that harness's median round by GB/s, and every
round's GB/s is printed under it and kept in --out (rows marked `"round"`).

On a VM, the hypervisor may take CPU time from the guest while a harness runs (steal time, from
/proc/stat): the run prints it per harness after the table and writes it as `"harness": "machine"`
rows, so a harness slowed by a busy host shows as such rather than as a slow harness.
"""

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
HARNESSES = ["nccl-socket", "nccl-plugin", "raw", "daemon", "daemon-local"]


def fmt_size(n: int) -> str:
    for unit, v in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= v and n % v == 0:
            return f"{n // v}{unit}"
    return str(n)


def cpu_ticks():
    """(steal, all) CPU time summed over the machine's CPUs, in USER_HZ ticks, from /proc/stat's
    first line; None where there is none (not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice: inside user and nice]
    return fields[7], sum(fields[:8])


def run(name, cmd, env, log_dir, timeout, machine):
    """Runs one harness; records in `machine[name]` its wall time and the CPU time the hypervisor
    took from this VM meanwhile (steal), which skews every harness that runs while it happens."""
    log = os.path.join(log_dir, f"{name}.log")
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    t0 = time.time()
    c0 = cpu_ticks()
    with open(log, "w") as f:
        # Its own process group, so that a harness past its time is stopped with every process it
        # started (NCCL's ranks are children of the harness): first SIGABRT, on which Python's
        # fault handler writes each process's stack into the log, then SIGKILL.
        p = subprocess.Popen(cmd, env={**env, "PYTHONFAULTHANDLER": "1"}, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
            time.sleep(1)  # the other processes of the group write their stacks too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    wall = time.time() - t0
    c1 = cpu_ticks()
    steal = None
    if c0 and c1:
        hz = os.sysconf("SC_CLK_TCK")
        steal = {
            "steal_ms": (c1[0] - c0[0]) * 1000 / hz,
            "steal_share": (c1[0] - c0[0]) / max(1, c1[1] - c0[1]),
        }
    machine[name] = {"wall_s": wall, **(steal or {})}
    told = f", steal {steal['steal_ms']:.0f} ms ({steal['steal_share']:.1%} of all CPU time)" if steal else ""
    print(f"   {name}: rc={rc} in {wall:.0f} s{told} (log {log})", flush=True)
    return rc


@contextlib.contextmanager
def mps(on, env):
    """A private CUDA MPS control daemon for this run only (its pipe and log folders in a fresh
    temporary folder, passed to every harness through `env`), quit at the end. With two processes
    on one GPU and no MPS, the GPU time-slices their contexts (~2.4 ms quanta on an H100), and
    NCCL's kernels, which spin while they wait, pay a quantum per message."""
    if not on:
        yield
        return
    ctl = shutil.which("nvidia-cuda-mps-control")
    if ctl is None:
        sys.exit("--mps: nvidia-cuda-mps-control is not on PATH")
    root = tempfile.mkdtemp(prefix="tcpxd-mps-")
    env["CUDA_MPS_PIPE_DIRECTORY"] = os.path.join(root, "pipe")
    env["CUDA_MPS_LOG_DIRECTORY"] = os.path.join(root, "log")
    for d in (env["CUDA_MPS_PIPE_DIRECTORY"], env["CUDA_MPS_LOG_DIRECTORY"]):
        os.makedirs(d)
    subprocess.run([ctl, "-d"], env=env, check=True)
    print(f"== MPS control daemon started (pipe {env['CUDA_MPS_PIPE_DIRECTORY']})", flush=True)
    try:
        yield
    finally:
        subprocess.run([ctl], input=b"quit\n", env=env, check=False)
        print("== MPS control daemon quit", flush=True)


def load_blocks(path):
    """The block row (harness "daemon-blocks") of a run, if any (the median round's with --rounds)."""
    if not os.path.exists(path):
        return None
    found = None
    for line in open(path):
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("harness") == "daemon-blocks" and "round" not in r:
            found = r
    return found


def load(path, harness):
    rows = {}
    if not os.path.exists(path):
        return rows
    for line in open(path):
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("harness") == harness and "round" not in r:
            rows[int(r["block_size"])] = r
    return rows


def combine_rounds(out, rounds):
    """Writes to `out` each harness's median round per size (by GB/s; the lower middle one of an
    even count), with every round's GB/s in `gb_per_s_rounds`, and keeps each round's rows in
    `out` too, marked with their round."""
    per = {}
    blocks = []
    with open(out, "a") as f:
        for rnd in range(1, rounds + 1):
            path = f"{out}.round{rnd}"
            if not os.path.exists(path):
                continue
            for line in open(path):
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if r.get("harness") == "daemon-blocks":
                    blocks.append(r)
                    f.write(json.dumps({**r, "round": rnd}) + "\n")
                    continue
                if r.get("harness") not in HARNESSES:
                    continue
                per.setdefault((r["harness"], int(r["block_size"])), []).append(r)
                f.write(json.dumps({**r, "round": rnd}) + "\n")
            os.unlink(path)
        for (h, size), rs in sorted(per.items()):
            by = sorted(rs, key=lambda r: r["gb_per_s"])
            mid = dict(by[(len(by) - 1) // 2])
            mid["harness"] = h
            mid["rounds"] = len(rs)
            mid["gb_per_s_rounds"] = [r["gb_per_s"] for r in rs]
            mid.pop("round", None)
            f.write(json.dumps(mid) + "\n")
        if blocks:
            by = sorted(blocks, key=lambda r: r["scattered"]["gbps"])
            mid = dict(by[(len(by) - 1) // 2])
            mid["rounds"] = len(blocks)
            mid["scattered_gbps_rounds"] = [r["scattered"]["gbps"] for r in blocks]
            f.write(json.dumps(mid) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default="target/release", help="folder with tcpxd, tcpxctl and libnccl_net_tcpxemu.so")
    ap.add_argument("--sizes", default="4K,64K,1M,4M,16M,64M,256M")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--op", default="write", choices=["write", "read"])
    ap.add_argument("--concurrency", type=int, default=1, help="transfers in flight in every harness")
    ap.add_argument("--only", default=",".join(HARNESSES), help="comma list of harnesses to run")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per harness")
    ap.add_argument("--out", default="compare.jsonl")
    ap.add_argument("--same-gpu", action="store_true",
                    help="a host with one GPU: NCCL's two ranks and both daemons on GPU 0 (still over the network path)")
    ap.add_argument("--logs", default=".", help="folder for each harness's log")
    ap.add_argument("--mps", action="store_true",
                    help="run every harness under a private CUDA MPS control daemon (with --same-gpu: "
                    "else NCCL's two ranks time-slice the GPU)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the harnesses this many times, alternating; each row is then the median "
                    "round (by GB/s), and every round's figures are printed and kept in --out")
    ap.add_argument("--blocks", type=int, default=0,
                    help="also a block-transfer row: N blocks per transfer, both sides scattered (0: none)")
    ap.add_argument("--block-size", default="16K", help="bytes per block with --blocks")
    ap.add_argument("--nccl-free-running", action="store_true",
                    help="time NCCL at the receiver, with no reply (the sender runs ahead; the old rows)")
    args = ap.parse_args()

    bin_dir = os.path.abspath(args.bin)
    plugin = os.path.join(bin_dir, "libnccl_net_tcpxemu.so")
    tcpxctl = os.path.join(bin_dir, "tcpxctl")
    tcpxd = os.path.join(bin_dir, "tcpxd")
    only = [h for h in args.only.split(",") if h]
    os.makedirs(args.logs, exist_ok=True)
    out = os.path.abspath(args.out)
    if os.path.exists(out):
        os.unlink(out)

    env = dict(os.environ)
    env.update(
        {
            # Never NVLink multicast on shared hosts; the rest makes every harness cross a network.
            "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1",
            "NCCL_NSOCKS_PERTHREAD": "4",
            "NCCL_SOCKET_NTHREADS": "1",
            "NCCL_DYNAMIC_CHUNK_SIZE": "524288",
            "TCPXEMU_BOUNCE": "cuda",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if args.concurrency < 1:
        sys.exit("--concurrency must be at least 1")
    if args.rounds < 1:
        sys.exit("--rounds must be at least 1")
    common = [
        "--sizes", args.sizes, "--iters", str(args.iters), "--warmup", str(args.warmup),
        "--concurrency", str(args.concurrency),
    ]
    same_gpu = ["--same-gpu"] if args.same_gpu else []
    nccl_timing = [] if args.nccl_free_running else ["--ack"]
    peer_cuda = "0" if args.same_gpu else "1"
    results = {}
    machine = {}
    with mps(args.mps, env):
        for rnd in range(1, args.rounds + 1):
            # With several rounds the harnesses alternate, round after round, so that a burst of
            # host noise lands in one round of one harness; each round appends to its own file.
            rout = out if args.rounds == 1 else f"{out}.round{rnd}"
            tag = "" if args.rounds == 1 else f"-r{rnd}"
            if os.path.exists(rout) and rout != out:
                os.unlink(rout)
            if "nccl-socket" in only:
                results["nccl-socket" + tag] = run(
                    "nccl-socket" + tag,
                    [sys.executable, os.path.join(HERE, "nccl_sendrecv.py"), "--net", "socket", "--out", rout] + common + same_gpu + nccl_timing,
                    env, args.logs, args.timeout, machine,
                )
            if "nccl-plugin" in only:
                results["nccl-plugin" + tag] = run(
                    "nccl-plugin" + tag,
                    [sys.executable, os.path.join(HERE, "nccl_sendrecv.py"), "--net", "plugin", "--plugin", plugin, "--out", rout]
                    + common + same_gpu + nccl_timing,
                    env, args.logs, args.timeout, machine,
                )
            if "raw" in only:
                results["raw" + tag] = run(
                    "raw" + tag,
                    [tcpxctl, "bench", "raw", "--op", args.op, "--cuda", "0", "--plugin", plugin, "--out", rout] + common,
                    env, args.logs, args.timeout, machine,
                )
            if "daemon" in only:
                results["daemon" + tag] = run(
                    "daemon" + tag,
                    [tcpxctl, "bench", "transfer", "--daemon", tcpxd, "--op", args.op, "--cuda", "0", "--peer-cuda", peer_cuda,
                     "--out", rout] + common,
                    env, args.logs, args.timeout, machine,
                )
            if "daemon-local" in only:
                results["daemon-local" + tag] = run(
                    "daemon-local" + tag,
                    [tcpxctl, "bench", "transfer", "--daemon", tcpxd, "--via", "local", "--op", args.op, "--cuda", "0",
                     "--peer-cuda", peer_cuda, "--out", rout] + common,
                    env, args.logs, args.timeout, machine,
                )
            if args.blocks:
                results["daemon-blocks" + tag] = run(
                    "daemon-blocks" + tag,
                    [tcpxctl, "bench", "transfer", "--daemon", tcpxd, "--op", args.op, "--cuda", "0", "--peer-cuda", peer_cuda,
                     "--blocks", str(args.blocks), "--block-size", args.block_size, "--iters", str(args.iters),
                     "--warmup", str(args.warmup), "--out", rout],
                    env, args.logs, args.timeout, machine,
                )

    if args.rounds > 1:
        combine_rounds(out, args.rounds)
    rows = {h: load(out, h) for h in HARNESSES}
    sizes = sorted({s for r in rows.values() for s in r})
    print()
    print(f"Message sizes {args.sizes}; {args.op.upper()} for the daemon and raw harnesses, send/recv for NCCL;")
    if args.concurrency == 1:
        print("GB/s of one message (transfer) at a time, as tcpxctl bench measures; p50/p99 latency in µs;")
    else:
        print(f"GB/s with {args.concurrency} messages (transfers) in flight; p50/p99 latency in µs;")
    if args.same_gpu:
        print("every harness runs both sides on GPU 0 (--same-gpu), through the network path all the same"
              + (", under MPS." if args.mps else "; no MPS: NCCL's ranks time-slice the GPU (use --mps)."))
    else:
        print("the raw bench runs both sides on GPU 0 (one process), the daemons and NCCL GPU 0 -> GPU 1.")
    if args.nccl_free_running:
        print("NCCL timed at the receiver: its sender runs ahead, so its rows time little more than the unpack.")
    else:
        print("NCCL timed at the sender until a 1-byte reply says the message landed (as a daemon WRITE completes).")
    print("ratio columns: daemon GB/s over the other's.")
    head = f"{'block':>6}"
    for h in HARNESSES:
        head += f" {h + ' GB/s':>17} {'p50':>8} {'p99':>8}"
    head += f" {'daemon/raw':>11} {'daemon/nccl-plugin':>19} {'daemon/nccl-socket':>19}"
    head += f" {'local/raw':>10} {'local/nccl-socket':>18}"
    print(head)
    summary = []
    for s in sizes:
        line = f"{fmt_size(s):>6}"
        for h in HARNESSES:
            r = rows[h].get(s)
            line += (
                f" {r['gb_per_s']:>17.2f} {r['p50_lat_us']:>8.0f} {r['p99_lat_us']:>8.0f}"
                if r
                else f" {'-':>17} {'-':>8} {'-':>8}"
            )
        d, raw, nccl = rows["daemon"].get(s), rows["raw"].get(s), rows["nccl-plugin"].get(s)
        sock, local = rows["nccl-socket"].get(s), rows["daemon-local"].get(s)

        def ratio(a, b):
            return a["gb_per_s"] / b["gb_per_s"] if a and b and b["gb_per_s"] else None

        r1, r2, r3, r4, r5 = ratio(d, raw), ratio(d, nccl), ratio(d, sock), ratio(local, raw), ratio(local, sock)
        for r, w in ((r1, 11), (r2, 19), (r3, 19), (r4, 10), (r5, 18)):
            line += f" {r:>{w}.2f}" if r is not None else f" {'-':>{w}}"
        print(line)
        summary.append(
            {"block_bytes": s, "concurrency": args.concurrency, "daemon_over_raw": r1, "daemon_over_nccl_plugin": r2,
             "daemon_over_nccl_socket": r3, "daemon_local_over_raw": r4, "daemon_local_over_nccl_socket": r5}
        )
    b = load_blocks(out)
    if b:
        sc, co = b["scattered"], b["contiguous"]
        print(f"blocks: {b['blocks']} x {fmt_size(b['block_size'])} per transfer ({fmt_size(b['bytes'])}), both sides "
              f"permuted (seed {b['seed']}), {b['op']}, checked: {b['checked']}")
        print(f"  scattered  {sc['gbps']:8.2f} GB/s   posting p50 {sc['posting_p50_us']:9.0f} us   p50 {sc['latency_p50_us']:9.0f} us")
        print(f"  contiguous {co['gbps']:8.2f} GB/s   posting p50 {co['posting_p50_us']:9.0f} us   p50 {co['latency_p50_us']:9.0f} us")
        print(f"  scattered/contiguous {b['ratio']:.2f}"
              + (f" (median of {b['rounds']} rounds: " + " ".join(f"{g:.2f}" for g in b["scattered_gbps_rounds"]) + " GB/s)"
                 if "rounds" in b else ""))
    if args.rounds > 1:
        print(f"Each row above is the median of {args.rounds} rounds by GB/s; every round's GB/s:")
        for s in sizes:
            parts = []
            for h in HARNESSES:
                r = rows[h].get(s)
                if r and "gb_per_s_rounds" in r:
                    parts.append(f"{h} " + " ".join(f"{g:.2f}" for g in r["gb_per_s_rounds"]))
            print(f"  {fmt_size(s):>6}: " + "; ".join(parts))
    if any("steal_ms" in m for m in machine.values()):
        print("CPU time the hypervisor took from this VM while each harness ran (steal; a share of all CPU")
        print("time above ~1% means the host was busy and every figure of that harness is suspect):")
        for h, m in machine.items():
            if "steal_ms" in m:
                print(f"  {h:>12}: {m['steal_ms']:8.0f} ms over {m['wall_s']:.0f} s, {m['steal_share']:.2%}")
    with open(out, "a") as f:
        for r in summary:
            f.write(json.dumps({"harness": "ratios", **r}) + "\n")
        for h, m in machine.items():
            f.write(json.dumps({"harness": "machine", "of": h, **m}) + "\n")
    failed = {h: rc for h, rc in results.items() if rc != 0}
    if failed:
        print(f"harnesses that failed: {failed} (see their logs)")
        sys.exit(1)


if __name__ == "__main__":
    main()
