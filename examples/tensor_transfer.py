"""Hand a PyTorch tensor to tcpxd through its CUDA IPC handle, WRITE it into a CUDA buffer of
another daemon, and check it there.

    python3 examples/tensor_transfer.py --a unix:/tmp/a.sock --b unix:/tmp/b.sock --b-peer 127.0.0.1:50053

Daemon A imports the tensor's memory (RegisterBuffer with cuda_ipc), daemon B allocates the
destination (RegisterBuffer with cuda). A CUDA event recorded after the tensor was produced orders
the send after that work. The check compares both daemons' CRC-32C of the bytes and samples B's
bytes against the tensor itself.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tcpxd_client import Tcpxd, message  # noqa: E402


def ipc_view(t):
    """(device, 64-byte IPC handle of the allocation, offset of t's bytes in it, size in bytes)."""
    assert t.is_cuda and t.is_contiguous()
    shared = t.untyped_storage()._share_cuda_()
    device, handle, _storage_bytes, storage_offset = shared[0], bytes(shared[1]), shared[2], shared[3]
    offset = storage_offset + t.storage_offset() * t.element_size()
    return device, cuda_ipc_mem_handle(handle), offset, t.numel() * t.element_size()


def cuda_ipc_mem_handle(handle):
    """The 64-byte cudaIpcMemHandle_t inside PyTorch's shared handle.

    Recent PyTorch prefixes it with a version byte and an allocation-type byte: 'c' for memory
    from cudaMalloc (what tcpxd imports), 'e' for expandable segments (not an IPC memory handle).
    """
    if len(handle) == 64:
        return handle
    if len(handle) == 66 and handle[1:2] == b"c":
        return handle[2:]
    if len(handle) == 66 and handle[1:2] == b"e":
        sys.exit(
            "the tensor lives in an expandable segment (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), "
            "which has no cudaIpcMemHandle_t; tcpxd imports memory from cudaMalloc"
        )
    sys.exit(f"unrecognised PyTorch IPC handle ({len(handle)} bytes)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="endpoint of the sending daemon")
    ap.add_argument("--b", required=True, help="endpoint of the receiving daemon")
    ap.add_argument("--b-peer", required=True, help="peer-service address of daemon B (host:port)")
    ap.add_argument("--mib", type=int, default=256, help="tensor size in MiB")
    args = ap.parse_args()

    torch.cuda.set_device(0)
    n = args.mib << 20
    # Produce the data on a side stream, record an interprocess event after it: the daemon's send
    # must wait for that work, not for a synchronize.
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")
        ready = torch.cuda.Event(interprocess=True)
        ready.record(stream)
    device, handle, offset, size = ipc_view(src)

    a, b = Tcpxd(args.a), Tcpxd(args.b)
    sbuf = a.RegisterBuffer(
        cuda_ipc=message("CudaIpcImport")(device=device, ipc_handle=handle, offset=offset, size=size),
        label="torch-src",
    )
    dbuf = b.RegisterBuffer(cuda=message("CudaAllocation")(device=0, size=size), label="torch-dst")
    peer = a.ConnectPeer(address=args.b_peer)
    print(f"A buffer {sbuf.id} (imported tensor, {size} bytes), B buffer {dbuf.id}; peer {peer.node_id}")

    t0 = time.perf_counter()
    started = a.Write(
        entry=message("WriteEntry")(local_buffer_id=sbuf.id, remote_descriptor=dbuf.descriptor, length=size),
        notification=b"tensor landed",
        ready_event_ipc_handle=ready.ipc_handle(),
    )
    done = a.WaitTransfer(transfer_id=started.transfer_id)
    secs = time.perf_counter() - t0
    if done.status_code != 0:
        sys.exit(f"write failed: code {done.status_code}: {done.status_message}")
    print(f"wrote {size} bytes in {secs:.3f} s ({size / secs / 1e9:.2f} GB/s)")

    crc_a = a.ChecksumBuffer(buffer_id=sbuf.id).crc32c
    crc_b = b.ChecksumBuffer(buffer_id=dbuf.id).crc32c
    host = src.cpu().numpy().tobytes()
    for off in (0, 4096 - 7, size // 2 + 13, size - 4096):
        got = b.ReadBuffer(buffer_id=dbuf.id, offset=off, length=4096).data
        if got != host[off : off + 4096]:
            sys.exit(f"bytes at {off} differ on B")
    if crc_a != crc_b:
        sys.exit(f"checksums differ: A {crc_a:08x}, B {crc_b:08x}")
    print(f"checksums match: crc32c {crc_a:08x}; sampled ranges equal the tensor")
    for c, buf in ((a, sbuf), (b, dbuf)):
        c.ReleaseBuffer(buffer_id=buf.id)
    a.close()
    b.close()


if __name__ == "__main__":
    main()
