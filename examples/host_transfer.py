"""Move bytes between two daemons' host buffers with the tcpxd package, no GPU needed.

    python3 examples/host_transfer.py --a unix:/tmp/a.sock --b unix:/tmp/b.sock [--b-peer 127.0.0.1:50053]

Registers a buffer on each daemon, subscribes to B's notifications, WRITEs a pattern from A to B with
a notification, READs it back into another buffer of A, and compares checksums and bytes.
"""

import argparse
import time

import tcpxd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="endpoint of the sending daemon")
    ap.add_argument("--b", required=True, help="endpoint of the receiving daemon")
    ap.add_argument("--b-peer", help="peer address of daemon B (only for descriptors without one)")
    ap.add_argument("--mib", type=int, default=256)
    args = ap.parse_args()
    n = args.mib << 20

    with tcpxd.Client(args.a) as a, tcpxd.Client(args.b) as b:
        if args.b_peer:
            a.connect_peer(args.b_peer)
        with a.register_host(n, "src") as src, b.register_host(n, "dst") as dst, a.register_host(n, "back") as back:
            src.fill(seed=42)
            with b.subscribe() as sub:
                t0 = time.perf_counter()
                r = a.write(src, dst.descriptor, notification=b"host bytes landed")
                secs = time.perf_counter() - t0
                note = sub.next(timeout=10)
            print(f"wrote {r.total_bytes} bytes in {secs:.3f} s ({n / secs / 1e9:.2f} GB/s); B was told {note.payload!r}")
            a.read(dst.descriptor, back)
            if not (src.checksum() == dst.checksum() == back.checksum()):
                raise SystemExit("checksums differ")
            if back.read_bytes(n - 4096, 4096) != src.read_bytes(n - 4096, 4096):
                raise SystemExit("bytes differ")
            print(f"checksums match: crc32c {src.checksum():08x}")


if __name__ == "__main__":
    main()
