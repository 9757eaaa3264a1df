"""Hand a PyTorch tensor to tcpxd (its own CUDA memory, by IPC handle), WRITE it into a tensor
registered with another daemon, READ it back, and check the bytes.

    python3 examples/tensor_transfer.py --a unix:/tmp/a.sock --b unix:/tmp/b.sock [--b-peer 127.0.0.1:50053]

A CUDA event recorded after the tensor was produced orders the daemon's send after that work, with
no synchronize. --b-peer is needed only with daemons whose descriptors carry no peer address.
"""

import argparse
import time

import torch

import tcpxd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="endpoint of the sending daemon")
    ap.add_argument("--b", required=True, help="endpoint of the receiving daemon")
    ap.add_argument("--b-peer", help="peer address of daemon B (only for descriptors without one)")
    ap.add_argument("--mib", type=int, default=256, help="tensor size in MiB")
    args = ap.parse_args()

    torch.cuda.set_device(0)
    n = args.mib << 20
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")
        ready = tcpxd.ready_event(stream)  # the daemon reads src only after this point of the stream
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda:0")
    back = torch.zeros(n, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()  # dst and back are zeroed before the daemons write them

    with tcpxd.Client(args.a) as a, tcpxd.Client(args.b) as b:
        if args.b_peer:
            a.connect_peer(args.b_peer)
        with a.register_tensor(src, "src") as sbuf, b.register_tensor(dst, "dst") as dbuf, a.register_tensor(
            back, "back"
        ) as bbuf:
            t0 = time.perf_counter()
            r = a.write(sbuf, dbuf.descriptor, ready_event=ready, notification=b"tensor landed")
            secs = time.perf_counter() - t0
            print(f"wrote {r.total_bytes} bytes in {secs:.3f} s ({r.total_bytes / secs / 1e9:.2f} GB/s)")
            a.read(dbuf.descriptor, bbuf)
            torch.cuda.synchronize()
            if not torch.equal(dst, src) or not torch.equal(back, src):
                raise SystemExit("the tensors differ")
            print("B's tensor and the tensor read back equal the source")


if __name__ == "__main__":
    main()
