#!/usr/bin/env python3
"""What the topology buys (issue #37 point 6): one GPU pair against all eight, on paced NICs.

    cargo build --workspace && python3 benches/topology_scale.py [--rate-gbps 2] [--size-mib 64] [--seconds 4]

Two tcpxd daemons on the built-in emulation with four emulated NICs (`TCPXEMU_DEVICES=4`, each
paced at `--rate-gbps` Gbit/s: `TCPXEMU_RATE_GBPS`) and the CUDA stand-in presenting eight GPUs
(`libtcpxd_cudastub.so` as `libcuda.so.1`, `TCPXD_CUDASTUB_DEVICES=8`; `TCPXEMU_BOUNCE=cuda`,
`UCCL_TCPX_UNPACK_IMPL=d2d`), each node on its default GPU -> NIC map (DescribeNode's gpu_nics).
Then, one WRITE of `--size-mib` at a time per pair, each phase for `--seconds`:

1. GPU 0 of a -> GPU 0 of b alone: its GB/s (its NIC's rate);
2. GPU g of a -> GPU g of b for all eight g at once (a thread and a client each): the aggregate
   GB/s and its ratio to (1) (target ~4x, >= 3.5x: four NICs, two GPUs each).

From GetStats' lanes of both daemons it prints the bytes each NIC sent (a) and received (b) in
phase 2 (equal per NIC), and for each pair the NICs and GPUs of the lanes its bytes went on
(lanes are per (NIC, GPU): a lane's send_gpu names the pair): only its GPUs' own NICs, else the
script says which and exits 1. Binaries: --bin-dir (default target/debug of this checkout), the
stand-in from --cudastub-dir (default <bin-dir>/cudastub, which the Rust tests' testkit makes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "python" / "src"))

import tcpxd  # noqa: E402

MIB = 1 << 20


def start(bin_dir: Path, d: Path, name: str, env: Dict[str, str]) -> Tuple[subprocess.Popen, str, str]:
    sock, ready, log = d / f"{name}.sock", d / f"{name}.ready", d / f"{name}.log"
    e = dict(os.environ)
    e["RUST_LOG"] = "warn"
    e.update(env)
    args = [str(bin_dir / "tcpxd"), "--node-id", name, "--builtin-emulation", "--api-socket", str(sock),
            "--peer-listen", "127.0.0.1:0", "--ready-file", str(ready)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(log, "wb"), env=e)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if ready.exists() and ready.stat().st_size > 0:
            try:
                info = json.loads(ready.read_text())
            except ValueError:
                time.sleep(0.02)
                continue
            return proc, f"unix:{sock}", str(info["peer_address"])
        if proc.poll() is not None:
            sys.exit(f"tcpxd {name} exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        time.sleep(0.02)
    proc.kill()
    sys.exit(f"tcpxd {name} did not become ready:\n{log.read_text(errors='replace')}")


def lanes(c: tcpxd.Client) -> List:
    s = c.stats()
    return list(s.peers[0].lanes) if s.peers else []


def grown(before: List, after: List, sent: bool) -> List[Tuple[Any, int]]:
    """(lane, bytes since `before`) for the lanes whose sent (or received) bytes grew."""
    old = {l.lane: (l.bytes_sent if sent else l.bytes_received) for l in before}
    out = []
    for l in after:
        n = (l.bytes_sent if sent else l.bytes_received) - old.get(l.lane, 0)
        if n > 0:
            out.append((l, n))
    return out


def run_pairs(endpoint: str, pairs: List[Tuple[Any, Any]], size: int, seconds: float) -> Tuple[List[int], float]:
    """Each pair WRITEs `size` bytes at a time for `seconds` (its own thread and client), all
    starting together; returns the bytes each moved and the wall time to the last one's end."""
    moved = [0] * len(pairs)
    errors: List[str] = []
    go = threading.Barrier(len(pairs) + 1)

    def one(i: int) -> None:
        src, dst = pairs[i]
        with tcpxd.Client(endpoint) as c:
            go.wait()
            end = time.monotonic() + seconds
            try:
                while time.monotonic() < end:
                    c.write(src.id, dst.descriptor, size)
                    moved[i] += size
            except Exception as e:  # reported below
                errors.append(f"pair {i}: {e}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(pairs))]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.monotonic()
    for t in threads:
        t.join()
    if errors:
        sys.exit("transfers failed: " + "; ".join(errors))
    return moved, time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate-gbps", type=float, default=2.0, help="each emulated NIC's pace (TCPXEMU_RATE_GBPS)")
    ap.add_argument("--size-mib", type=int, default=64, help="each WRITE's size")
    ap.add_argument("--seconds", type=float, default=4.0, help="each phase's length")
    ap.add_argument("--bin-dir", type=Path, default=ROOT / "target" / "debug")
    ap.add_argument("--cudastub-dir", type=Path, default=None)
    args = ap.parse_args()
    gpus, nics = 8, 4
    bin_dir = args.bin_dir.resolve()
    stub = (args.cudastub_dir or bin_dir / "cudastub").resolve()
    if not (stub / "libcuda.so.1").exists():
        sys.exit(f"no {stub}/libcuda.so.1: link it to libtcpxd_cudastub.so (the Rust tests' testkit does)")
    env = {
        "LD_LIBRARY_PATH": f"{stub}:{os.environ['LD_LIBRARY_PATH']}" if os.environ.get("LD_LIBRARY_PATH") else str(stub),
        "TCPXD_CUDASTUB_DEVICES": str(gpus),
        "TCPXEMU_DEVICES": str(nics),
        "TCPXEMU_RATE_GBPS": f"{args.rate_gbps:g}",
        "TCPXEMU_BOUNCE": "cuda",
        "TCPXEMU_BOUNCE_PAGES": "2048",
        "UCCL_TCPX_UNPACK_IMPL": "d2d",
    }
    size = args.size_mib * MIB
    d = Path(tempfile.mkdtemp(prefix="tcpxd-topo-"))
    procs: List[subprocess.Popen] = []
    try:
        pa, ea, peer_a = start(bin_dir, d, "ta", env)
        procs.append(pa)
        pb, eb, peer_b = start(bin_dir, d, "tb", env)
        procs.append(pb)
        with tcpxd.Client(ea) as ca, tcpxd.Client(eb) as cb:
            na, nb = ca.describe_node(), cb.describe_node()
            nic_a = {g.gpu_ordinal: g.nic_devices for g in na.gpu_nics}
            nic_b = {g.gpu_ordinal: g.nic_devices for g in nb.gpu_nics}
            print(f"a: {len(na.gpus)} GPUs, {len(na.devices)} NICs, map {na.topology_source}: "
                  + " ".join(f"GPU{g}->NIC{','.join(map(str, n))}" for g, n in sorted(nic_a.items())))
            print(f"b: {len(nb.gpus)} GPUs, {len(nb.devices)} NICs, map {nb.topology_source}")
            if len(na.gpus) != gpus or len(na.devices) != nics:
                sys.exit("the daemons do not see 8 GPUs and 4 NICs: is the stand-in on LD_LIBRARY_PATH?")
            ca.connect_peer(peer_b)
            pairs = [(ca.allocate_cuda(size, g, f"src{g}"), cb.allocate_cuda(size, g, f"dst{g}")) for g in range(gpus)]
            # Open every pair's lanes (on first use) before timing.
            for src, dst in pairs:
                ca.write(src.id, dst.descriptor, size)

            a0, b0 = lanes(ca), lanes(cb)
            moved1, t1 = run_pairs(ea, pairs[:1], size, args.seconds)
            a1, b1 = lanes(ca), lanes(cb)
            one = moved1[0] / t1 / 1e9
            moved8, t8 = run_pairs(ea, pairs, size, args.seconds)
            a2, b2 = lanes(ca), lanes(cb)
            agg = sum(moved8) / t8 / 1e9

        nic_rate = args.rate_gbps / 8
        print(f"NICs paced at {args.rate_gbps:g} Gbit/s each ({nic_rate:.3f} GB/s); WRITEs of {args.size_mib} MiB, one at a time per pair")
        print(f"1 pair  (GPU 0 -> GPU 0): {moved1[0] / MIB:8.0f} MiB in {t1:5.2f} s = {one:.3f} GB/s")
        print(f"8 pairs (GPU g -> GPU g): {sum(moved8) / MIB:8.0f} MiB in {t8:5.2f} s = {agg:.3f} GB/s aggregate")
        ratio = agg / one if one else 0.0
        print(f"ratio 8 pairs / 1 pair: {ratio:.2f}x (target ~4x, >= 3.5x)")

        bad: List[str] = []
        # Phase 1: GPU 0's bytes only on lanes NIC(a, 0) -> (NIC(b, 0), GPU 0).
        for l, n in grown(a0, a1, True):
            if (l.send_gpu, l.send_device, l.recv_gpu, l.recv_device) != (0, nic_a[0][0], 0, nic_b[0][0]):
                bad.append(f"phase 1: {n} bytes on lane {l.lane} (NIC {l.send_device} GPU {l.send_gpu} -> NIC {l.recv_device} GPU {l.recv_gpu})")
        # Phase 2: bytes per NIC, and per pair (the lanes' send_gpu) the NICs they took.
        sent_nic: Dict[int, int] = defaultdict(int)
        recv_nic: Dict[int, int] = defaultdict(int)
        per_pair: Dict[int, Dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for l, n in grown(a1, a2, True):
            sent_nic[l.send_device] += n
            per_pair[l.send_gpu][f"NIC{l.send_device}/GPU{l.send_gpu}->NIC{l.recv_device}/GPU{l.recv_gpu}"] += n
            g = l.send_gpu
            if g < 0 or l.send_device not in nic_a.get(g, []) or l.recv_gpu != g or l.recv_device not in nic_b.get(g, []):
                bad.append(f"phase 2: {n} bytes sent on lane {l.lane} (NIC {l.send_device} GPU {l.send_gpu} -> NIC {l.recv_device} GPU {l.recv_gpu})")
        for l, n in grown(b1, b2, False):
            recv_nic[l.recv_device] += n
            if l.recv_gpu < 0 or l.recv_device not in nic_b.get(l.recv_gpu, []):
                bad.append(f"phase 2: {n} bytes received on b's lane {l.lane} (NIC {l.recv_device} GPU {l.recv_gpu})")
        print("phase 2 bytes per NIC (GetStats lanes):")
        for nic in range(nics):
            print(f"  NIC {nic}: a sent {sent_nic.get(nic, 0) / MIB:8.1f} MiB, b received {recv_nic.get(nic, 0) / MIB:8.1f} MiB")
        vals = [sent_nic.get(n, 0) for n in range(nics)]
        if max(vals):
            print(f"  spread (max-min)/max: {(max(vals) - min(vals)) / max(vals):.1%}")
        print("phase 2 per pair: moved by the client, and the lanes its bytes went on:")
        for g in range(gpus):
            routes = ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in sorted(per_pair.get(g, {}).items())) or "none"
            print(f"  GPU {g}: {moved8[g] / MIB:7.0f} MiB; {routes}")
        if bad:
            print("BYTES OFF THEIR PAIR'S NICs:\n  " + "\n  ".join(bad))
            sys.exit(1)
        print("every pair's bytes went only on its own GPUs' NICs (a's send, b's receive)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
