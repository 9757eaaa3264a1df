"""Tensors in, tensors out (run on a GPU machine: `python3 -m pytest -m gpu python/tests`).

Skipped, reported as not run, without PyTorch with CUDA. The daemons run the built-in emulation in
its CUDA mode where a GPU exists (received bytes land in a GPU bounce buffer and the unpack kernel
gathers them)."""

from __future__ import annotations

import pytest

import tcpxd

pytestmark = pytest.mark.gpu
MIB = 1 << 20


@pytest.fixture
def torch():
    import torch

    torch.cuda.set_device(0)
    return torch


@pytest.fixture
def clients(peered):
    a, b = peered
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        yield ca, cb


def test_tensor_in_tensor_out_byte_exact_with_ready_events(torch, clients):
    ca, cb = clients
    n = 64 * MIB
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")
        ready = tcpxd.ready_event(stream)  # recorded after the work that produced src
    dst = torch.zeros(n, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    with ca.register_tensor(src, label="src") as sb, cb.register_tensor(dst, label="dst") as db:
        assert (sb.kind, sb.size) == ("cuda_ipc", n)
        r = ca.write(sb, db, ready_event=ready, notification=b"tensor")
        assert r.bytes_done == n
        assert torch.equal(dst, src)
        # READ it back into a third tensor, at an offset of a larger one.
        back = torch.zeros(n + 4096, dtype=torch.uint8, device="cuda:0")
        with ca.register_tensor(back) as bb:
            ca.read(db, bb, n, local_offset=4096)
        assert torch.equal(back[4096:], src)


def test_tensor_views_and_dtypes(torch, clients):
    ca, cb = clients
    base = torch.arange(1 << 20, dtype=torch.float32, device="cuda:0")
    view = base[4096:8192]  # a view: the descriptor covers only its bytes
    out = torch.zeros(4096, dtype=torch.float32, device="cuda:0")
    torch.cuda.synchronize()
    with ca.register_tensor(view) as vb, cb.register_tensor(out) as ob:
        assert vb.size == 4096 * 4
        ca.write(vb, ob)
    assert torch.equal(out, view)


def test_daemon_cuda_buffer_and_host_buffer_mix(torch, clients):
    ca, cb = clients
    src = torch.randint(0, 256, (4 * MIB,), dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    with ca.register_tensor(src) as sb, cb.allocate_cuda(4 * MIB) as gpu, cb.register_host(4 * MIB) as host:
        ca.write_batch([tcpxd.WriteOp(sb, gpu), tcpxd.WriteOp(sb, host)])
        expect = src.cpu().numpy().tobytes()
        assert host.read_bytes() == expect
        assert gpu.checksum() == host.checksum()


def test_cpu_tensor_is_refused_clearly(torch, clients):
    ca, _ = clients
    with pytest.raises(tcpxd.InvalidArgument, match="CPU tensor"):
        ca.register_tensor(torch.zeros(16))
    with pytest.raises(tcpxd.InvalidArgument, match="contiguous"):
        ca.register_tensor(torch.zeros((64, 64), device="cuda:0").t())


def test_two_clients_of_one_daemon_move_tensors_gpu_to_gpu_and_mixed(torch, daemons):
    """Two clients of one daemon (two agents of one node): the daemon copies between a client's
    imported CUDA memory and another's buffers itself (a device copy), and between GPU and host
    both ways.

    The second client's GPU memory is daemon-allocated: one CUDA allocation is imported once per
    daemon, and two clients of one process (this test) may hold tensors of the same allocation
    (PyTorch 2.11 on the H200 did, at 16 MiB each after empty_cache: ALREADY_EXISTS). Two
    processes never share an allocation."""
    a, _ = daemons
    src = torch.randint(0, 256, (16 * MIB,), dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    expected = src.cpu().numpy().tobytes()
    with tcpxd.Client(a.endpoint) as c1, tcpxd.Client(a.endpoint) as c2:
        with c1.register_tensor(src) as sb, c2.allocate_cuda(16 * MIB) as db, c1.register_host(16 * MIB) as host:
            c1.write(sb, db.descriptor, notification=b"gpu")  # GPU -> GPU: the daemon's device copy
            c1.read(db.descriptor, host)  # GPU -> host
            assert host.read_bytes() == expected
            src.zero_()
            torch.cuda.synchronize()
            c1.read(db.descriptor, sb)  # GPU -> GPU, back into the tensor
            torch.cuda.synchronize()
            assert src.cpu().numpy().tobytes() == expected
            src.zero_()
            torch.cuda.synchronize()
            c1.read(host.descriptor, sb, 4 * MIB)  # host -> GPU, the first 4 MiB
            torch.cuda.synchronize()
            assert src[: 4 * MIB].cpu().numpy().tobytes() == expected[: 4 * MIB]


def test_two_agents_of_one_process_register_one_cuda_allocation(torch, daemons):
    """Two NIXL agents in one process, each registering part of the same CUDA allocation: the
    daemon shares its one import of the allocation between their buffers (a process opens an IPC
    handle once), byte-exact both ways, each agent's deregistration leaving the other's working."""
    from tcpxd.nixl import nixl_agent, nixl_agent_config

    a, _ = daemons
    n = 4 * MIB
    t = torch.zeros(2 * n, dtype=torch.uint8, device="cuda:0")
    t[:n] = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    A = nixl_agent("one-alloc-A", nixl_agent_config(endpoint=a.endpoint))
    B = nixl_agent("one-alloc-B", nixl_agent_config(endpoint=a.endpoint))
    try:
        ra = A.register_memory([(t.data_ptr(), n, 0, "")], "VRAM")
        B.register_memory([(t.data_ptr() + n, n, 0, "")], "VRAM")  # the same allocation's other half
        A.add_remote_agent(B.get_agent_metadata())

        def move(op: str) -> None:
            local = A.get_xfer_descs([(t.data_ptr(), n, 0)], "VRAM")
            remote = A.get_xfer_descs([(t.data_ptr() + n, n, 0)], "VRAM")
            h = A.initialize_xfer(op, local, remote, "one-alloc-B")
            A.transfer(h)
            while (st := A.check_xfer_state(h)) == "PROC":
                pass
            assert st == "DONE", h.error
            A.release_xfer_handle(h)
            torch.cuda.synchronize()

        move("WRITE")
        assert torch.equal(t[n:], t[:n])
        t[:n] = 0
        torch.cuda.synchronize()
        move("READ")
        assert torch.equal(t[:n], t[n:]) and int(t[:n].sum()) != 0
        # A's buffer goes; B's, over the same mapping, still serves a transfer from a new agent.
        A.deregister_memory(ra)
        C = nixl_agent("one-alloc-C", nixl_agent_config(endpoint=a.endpoint))
        try:
            src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0")
            torch.cuda.synchronize()
            C.register_memory([(src.data_ptr(), n, 0, "")], "VRAM")
            C.add_remote_agent(B.get_agent_metadata())
            h = C.initialize_xfer("WRITE", C.get_xfer_descs([(src.data_ptr(), n, 0)], "VRAM"),
                                  C.get_xfer_descs([(t.data_ptr() + n, n, 0)], "VRAM"), "one-alloc-B")
            C.transfer(h)
            while (st := C.check_xfer_state(h)) == "PROC":
                pass
            assert st == "DONE", h.error
            torch.cuda.synchronize()
            assert torch.equal(t[n:], src)
        finally:
            C.close()
    finally:
        A.close()
        B.close()
