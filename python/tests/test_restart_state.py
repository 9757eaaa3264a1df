"""What a daemon keeps across a restart (runtime.state_dir; docs/OPERATIONS.md, "Restarts"):
daemon-allocated host memory with its bytes, ids that are never handed out again, a rotated key
that stays rotated, descriptors and block-list tokens that work again unchanged on the other node;
what a client that died meanwhile registered is forgotten once the grace period ends; restarts
leak no descriptors in the client nor files in the state directory."""

from __future__ import annotations

import gc
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import grpc
import pytest

import tcpxd
from conftest import tcpxd_bin
from supervisor import Supervised, supervised
from test_restart import endpoint, free_port

CTX = multiprocessing.get_context("spawn")
GRACE_S = 2


@pytest.fixture
def nodes() -> Iterator[Tuple[Supervised, Supervised, Path]]:
    yield from two_nodes(GRACE_S)


@pytest.fixture
def patient_nodes() -> Iterator[Tuple[Supervised, Supervised, Path]]:
    """As `nodes`, with a grace period no loaded machine outlasts (for tests that do not wait for it)."""
    yield from two_nodes(30)


def two_nodes(grace_s: int) -> Iterator[Tuple[Supervised, Supervised, Path]]:
    d = Path(tempfile.mkdtemp(prefix="tcpxd-rt-"))
    conf = d / "tcpxd.toml"
    conf.write_text(f"[runtime]\nreattach_grace_s = {grace_s}\n")
    sups = []
    try:
        for name in ("sa", "sb"):
            sups.append(supervised(str(tcpxd_bin()), d, name, free_port(), extra=["--config", str(conf)]))
        yield sups[0], sups[1], d
    finally:
        for s in sups:
            s.close()
        shutil.rmtree(d, ignore_errors=True)


def restart(s: Supervised, sig: int = signal.SIGKILL) -> None:
    s.wait_serving(s.signal(sig) + 1)


def retry(fn: Any, what: str, deadline_s: float = 30.0) -> Any:
    """`fn()` until it succeeds: the application's only part in a restart."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return fn()
        except tcpxd.TcpxdError as e:
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: still failing after {deadline_s} s: {e}") from None
            time.sleep(0.02)


def fds() -> int:
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def regs(d: Path, name: str) -> int:
    return len(os.listdir(d / f"{name}.state" / "regs"))


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_registrations_keys_and_daemon_memory_come_back(nodes: Any, sig: int) -> None:
    a, b, d = nodes
    with tcpxd.Client(endpoint(a)) as ca, tcpxd.Client(endpoint(b)) as cb:
        kept = cb.register_host(3 << 20, shared=False, label="kept")  # the daemon's memory
        kept.fill(seed=42)
        crc = kept.checksum()
        shared = cb.register_host(1 << 20)  # this process's memory
        shared.numpy()[:] = 9
        blocks = cb.register_blocks(shared, block_size=4096)
        stale = shared.descriptor
        fresh = shared.rekey()  # rotated before the restart: stays rotated
        local = ca.register_host(3 << 20)
        ca.read(kept.descriptor, local)
        ids = (kept.id, shared.id, blocks.id)
        before_fds, before_regs = 0, regs(d, "sb")

        for i in range(3):
            restart(b, sig)
            # Descriptors and tokens handed out before: unchanged, working again.
            local.numpy()[:] = 0
            retry(lambda: ca.read(kept.descriptor, local), "READ of the daemon's memory")
            # (A call right after a restart may still meet gRPC's reconnect backoff: retried.)
            assert retry(kept.checksum, "ChecksumBuffer") == crc, "daemon-allocated host memory lost bytes"
            assert local.checksum() == crc, "the READ brought other bytes"
            retry(lambda: ca.read(fresh, local, 1 << 20), "READ by the rotated key")
            assert (local.numpy()[: 1 << 20] == 9).all()
            dst = ca.register_blocks(local, block_size=4096)
            retry(lambda: ca.read_blocks(dst, [0, 1], blocks.token, [5, 6]), "READ by block-list token")
            dst.release()
            with pytest.raises(tcpxd.TcpxdError) as e:
                ca.read(stale, local, 4096)
            assert e.value.code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.NOT_FOUND), e.value
            assert cb._reattach.wait(30)
            if i == 0:  # after a first restart: what a restart opens for good is open now
                before_fds = fds()
        assert (shared.descriptor, blocks.id) == (fresh, ids[2])
        assert cb._reattach.restarts == 3
        # Three restarts leaked no descriptor here, no registration file there.
        assert fds() == before_fds, (before_fds, fds())
        assert regs(d, "sb") == before_regs
        # New registrations never take an id handed out before.
        extra = cb.register_host(4096)
        assert extra.id > max(ids)
        extra.release()


def died(conn: Any, ep: str) -> None:
    c = tcpxd.Client(ep)
    buf = c.register_host(1 << 20)
    c.register_blocks(buf, block_size=4096)
    conn.send(buf.descriptor)
    conn.recv()  # killed here


def test_a_client_that_died_meanwhile_has_its_registrations_released(nodes: Any) -> None:
    a, b, d = nodes
    parent, child = CTX.Pipe()
    p = CTX.Process(target=died, args=(child, endpoint(b)), daemon=True)
    p.start()
    desc = parent.recv()
    with tcpxd.Client(endpoint(a)) as ca:
        local = ca.register_host(1 << 20)
        ca.read(desc, local)
        b.signal(signal.SIGKILL)
        p.kill()  # the client dies while its daemon is down: nobody re-attaches its memory
        p.join()
        started = b.wait_serving(2)
        assert regs(d, "sb") == 2  # still waiting for their client
        deadline = started.began + GRACE_S + 10
        while regs(d, "sb") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert regs(d, "sb") == 0, "forgotten once runtime.reattach_grace_s passed"
        with pytest.raises(tcpxd.TcpxdError) as e:
            ca.read(desc, local, timeout=10)
        assert e.value.code == grpc.StatusCode.NOT_FOUND, e.value


def test_the_asyncio_client_re_attaches_too(nodes: Any) -> None:
    import asyncio

    from tcpxd.aio import AsyncClient

    a, b, _ = nodes

    async def main() -> None:
        async with AsyncClient(endpoint(b)) as cb:
            shared = await cb.register_host(1 << 20)
            shared.numpy()[:] = 3
            blocks = await cb.register_blocks(shared, block_size=4096)
            with tcpxd.Client(endpoint(a)) as ca:
                local = ca.register_host(1 << 20)
                dst = ca.register_blocks(local, block_size=4096)
                restart(b)
                retry(lambda: ca.read(shared.descriptor, local), "READ by the old descriptor")
                assert (local.numpy() == 3).all()
                local.numpy()[:] = 0
                retry(lambda: ca.read_blocks(dst, [7], blocks.token, [9]), "READ by the old token")
                assert (local.numpy()[7 * 4096 : 8 * 4096] == 3).all()
            assert cb._reattach.restarts == 1
            await shared.release()

    asyncio.run(main())


def test_a_re_attach_that_does_not_match_is_refused_and_changes_nothing(nodes: Any, daemons: Any) -> None:
    from tcpxd import _proto

    a, b, d = nodes
    with tcpxd.Client(endpoint(b)) as cb:
        buf = cb.register_host(1 << 20)
        lst = cb.register_blocks(buf, block_size=4096)
        key = bytes.fromhex(buf.descriptor.split("@")[0].split(":")[4])
        cb._reattach.close()  # this test re-attaches by hand
        restart(b)
        cb._registrar.reset()  # type: ignore[union-attr]  # its connection went with the old process
        pending = regs(d, "sb")
        R = _proto.message("RegisterBlocksRequest")
        S = _proto.message("StridedBlocks")
        cases = [
            # (call, request, code, words)
            ("RegisterBlocks", R(buffer_id=buf.id, strided=S(first=0, stride=4096, length=4096, count=256), reattach_id=lst.id),
             grpc.StatusCode.NOT_FOUND, "buffer_id"),  # its buffer is not back yet
            ("RegisterBlocks", R(buffer_id=buf.id, strided=S(first=0, stride=4096, length=4096, count=256), reattach_id=999_999),
             grpc.StatusCode.NOT_FOUND, "buffer_id"),
            ("PrepareBlocks", _proto.message("PrepareBlocksRequest")(local_list_ids=[lst.id], entries=b"\0" * 8 + b"\1\0\0\0", reattach_id=777),
             grpc.StatusCode.FAILED_PRECONDITION, "prepared list 777 is not waiting to be re-attached"),
            ("RegisterBuffer", _proto.message("RegisterBufferRequest")(host=_proto.message("HostAllocation")(size=4096), reattach_id=buf.id),
             grpc.StatusCode.INVALID_ARGUMENT, "reattach_id: only a cuda_ipc import"),
        ]
        for call, req, code, words in cases:
            with pytest.raises(tcpxd.TcpxdError) as e:
                cb._unary(call, req)
            assert e.value.code == code and words in str(e.value), (call, e.value)
        # A host-memory re-attach with another key, or another size: refused, naming why.
        fd = buf._host.reattach[0]  # type: ignore[union-attr]
        F = _proto.message("RegisterHostFdRequest")
        for req, words in [
            (F(size=1 << 20, reattach_id=buf.id, reattach_key=bytes(16)), "reattach_key is not its access key"),
            (F(size=1 << 19, reattach_id=buf.id, reattach_key=key), "it was 1048576 bytes, this is 524288"),
            (F(size=1 << 20, reattach_id=lst.id + 10_000, reattach_key=key), "not waiting to be re-attached"),
        ]:
            with pytest.raises(tcpxd.TcpxdError) as e:
                cb._registrar.register_fd(fd, req, 10)  # type: ignore[union-attr]
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and words in str(e.value), e.value
        assert regs(d, "sb") == pending, "the refusals changed nothing"
        # The right one is taken back, once.
        cb._registrar.register_fd(fd, F(size=1 << 20, reattach_id=buf.id, reattach_key=key), 10)  # type: ignore[union-attr]
        with pytest.raises(tcpxd.TcpxdError) as e:
            cb._registrar.register_fd(fd, F(size=1 << 20, reattach_id=buf.id, reattach_key=key), 10)  # type: ignore[union-attr]
        assert "not waiting to be re-attached" in str(e.value), e.value
        # A list re-attach the engine refuses (blocks past the buffer's end) puts its claim back:
        # the right one is then taken.
        with pytest.raises(tcpxd.TcpxdError) as e:
            cb._unary("RegisterBlocks", R(buffer_id=buf.id, strided=S(first=1 << 20, stride=4096, length=4096, count=256),
                                          reattach_id=lst.id))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, e.value
        got = cb._unary("RegisterBlocks", R(buffer_id=buf.id, strided=S(first=0, stride=4096, length=4096, count=256),
                                            reattach_id=lst.id))
        assert (got.id, got.token) == (lst.id, lst.token)
    # A daemon without a state directory says so.
    with tcpxd.Client(daemons[0].endpoint) as c:
        assert c.describe_node().raw.reattach_grace_s == 0
        with pytest.raises(tcpxd.TcpxdError) as e:
            c._unary("PrepareBlocks", _proto.message("PrepareBlocksRequest")(local_list_ids=[1], entries=b"\0" * 12, reattach_id=1))
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "keeps no state directory" in str(e.value), e.value


def test_memory_registered_by_address_is_registered_again(patient_nodes: Any) -> None:
    """A plain numpy array has no file to hand over: the daemon reads and writes it in this process
    (docs/API.md, "Client host memory"). After a restart the client registers the same address again
    under its id and key; the daemon takes it back only from the process that registered it (the
    session's peer credentials), at the same address and size."""
    import numpy as np

    from tcpxd import _proto
    from tcpxd._reattach import descriptor_key

    a, b, d = patient_nodes
    with tcpxd.Client(endpoint(a)) as ca, tcpxd.Client(endpoint(b)) as cb:
        assert "reattach_client_memory" in cb.describe_node().features
        mine = np.random.default_rng(40).integers(0, 256, 1 << 20, dtype=np.uint8)
        buf = cb.register_host(mine)  # anonymous memory: by address
        assert buf.kind == "host_attached"
        blocks = cb.register_blocks(buf, block_size=4096)
        desc, token = buf.descriptor, blocks.token
        local = ca.register_host(1 << 20)
        dst = ca.register_blocks(local, block_size=4096)
        for sig in (signal.SIGKILL, signal.SIGTERM):
            restart(b, sig)
            local.numpy()[:] = 0
            retry(lambda: ca.read(desc, local), "READ of memory registered by address, by its old descriptor")
            assert np.array_equal(local.numpy(), mine)
            local.numpy()[:4096] = sig
            retry(lambda: ca.write(local, desc, 4096), "WRITE into it")
            assert (mine[:4096] == sig).all(), "the WRITE landed in this process's array"
            retry(lambda: ca.read_blocks(dst, [3], token, [5]), "READ by the old block-list token")
            assert np.array_equal(local.numpy()[3 * 4096 : 4 * 4096], mine[5 * 4096 : 6 * 4096])
            assert cb._reattach.wait(30)
        assert (buf.descriptor, blocks.token) == (desc, token)
        assert regs(d, "sb") == 2

        # Once more with the client's re-attacher stopped: the registration waits, and another
        # address of this process is refused with its id and key, naming why; the same address is
        # taken back.
        # (The other process of the check below starts now, its imports paid before the restart.)
        parent, child = CTX.Pipe()
        p = CTX.Process(target=claims_by_address, args=(child, endpoint(b)), daemon=True)
        p.start()
        assert parent.recv() == "ready"
        cb._reattach.close()
        restart(b)
        cb._registrar.reset()  # type: ignore[union-attr]
        other = np.zeros(1 << 20, dtype=np.uint8)
        R = _proto.message("RegisterClientMemoryRequest")
        key = descriptor_key(desc)
        with pytest.raises(tcpxd.TcpxdError) as e:
            cb._registrar.register_by_address(  # type: ignore[union-attr]
                R(address=other.ctypes.data, size=1 << 20, reattach_id=buf.id, reattach_key=key), 10)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "it was at address" in str(e.value), e.value
        # Another process, with the id and key: refused, naming the process it was of.
        parent.send((buf.id, key))
        answer = parent.recv()
        p.join()
        assert "FAILED_PRECONDITION" in answer and f"it was memory of process {os.getpid()}" in answer, answer
        cb._registrar.register_by_address(  # type: ignore[union-attr]
            R(address=mine.ctypes.data, size=1 << 20, reattach_id=buf.id, reattach_key=key), 10)
        local.numpy()[:] = 0
        retry(lambda: ca.read(desc, local), "READ after the re-attach by hand")
        assert np.array_equal(local.numpy(), mine)


def claims_by_address(conn: Any, ep: str) -> None:
    """Another process presenting a registration by address's id and key (sent once its daemon
    restarted), with memory of its own."""
    import numpy as np

    from tcpxd import _proto

    with tcpxd.Client(ep) as c:
        theirs = np.zeros(1 << 20, dtype=np.uint8)
        R = _proto.message("RegisterClientMemoryRequest")
        conn.send("ready")
        buffer_id, key = conn.recv()
        try:
            c._registrar.register_by_address(  # type: ignore[union-attr]
                R(address=theirs.ctypes.data, size=1 << 20, reattach_id=buffer_id, reattach_key=key), 10)
            conn.send("accepted")
        except tcpxd.TcpxdError as e:
            conn.send(f"{e.code.name}: {e}")


def keeper_names(sock: Path) -> List[str]:
    """The names a `tcpxd fd-keeper` holds (its LISTEN=1 request; the duplicates are closed)."""
    import array
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(10)
        s.connect(str(sock))
        s.send(b"LISTEN=1\n")
        names = []
        while True:
            msg, anc, _, _ = s.recvmsg(4096, socket.CMSG_SPACE(4 * 4))
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    a = array.array("i")
                    a.frombytes(data[: len(data) - len(data) % a.itemsize])
                    for fd in a:
                        os.close(fd)
            text = msg.decode()
            if text.startswith("END=1"):
                return names
            names.append(text.strip().split("=", 1)[1])


@pytest.mark.parametrize(
    "gpu,store",
    [("stand-in", "systemd"), ("stand-in", "fd-keeper"),
     pytest.param("real", "systemd", marks=pytest.mark.gpu), pytest.param("real", "fd-keeper", marks=pytest.mark.gpu)],
)
def test_daemon_allocated_cuda_memory_keeps_its_bytes_in_the_descriptor_store(gpu: str, store: str) -> None:
    """A CUDA buffer the daemon allocated (RegisterBuffer cuda) where its fd is kept across the
    restart: by systemd's file-descriptor store (FDSTORE; here supervisor.FdStore), or by a
    `tcpxd fd-keeper` (runtime.fd_keeper; GKE's sidecar). VMM memory mapped again by the next
    process under the same id and key, every byte there (ReadBuffer, and a READ by the other node
    with the descriptor handed out before); a release takes the fd out of the store.
    `stand-in`: the CUDA stand-in's VMM over a memfd; `real`: a GPU (`pytest -m gpu`)."""
    import subprocess

    import numpy as np

    from test_restart import cuda_stand_in

    d = Path(tempfile.mkdtemp(prefix="tcpxd-rtc-"))
    sups: List[Supervised] = []
    keeper = None
    try:
        env: Dict[str, str] = {}
        device = 0
        if gpu == "stand-in":
            env = cuda_stand_in(d)
            # One NIC serving every GPU, no fail-stop: this test restarts by signals only.
            for k in ("TCPXEMU_DEV0_GPUS", "TCPXEMU_FAILSTOP"):
                env.pop(k)
            device = 5
        conf = d / "tcpxd.toml"
        conf.write_text("[runtime]\nreattach_grace_s = 30\n")
        extra = ["--config", str(conf)]
        a = supervised(str(tcpxd_bin()), d, "ca", free_port(), env=env, extra=extra)
        sups.append(a)
        if store == "fd-keeper":
            sock = d / "fd-keeper.sock"
            with open(d / "keeper.log", "ab") as log:
                keeper = subprocess.Popen([str(tcpxd_bin()), "fd-keeper", "--socket", str(sock)], stderr=log)
            deadline = time.monotonic() + 30
            while not sock.exists():
                assert time.monotonic() < deadline and keeper.poll() is None, "the fd keeper serves"
                time.sleep(0.01)
            b = supervised(str(tcpxd_bin()), d, "cb", free_port(), env=env, extra=extra + ["--fd-keeper", str(sock)])

            def names() -> List[str]:
                return keeper_names(sock)
        else:
            b = supervised(str(tcpxd_bin()), d, "cb", free_port(), env=env, extra=extra, fd_store=True)
            systemd = b.fd_store
            assert systemd is not None

            def names() -> List[str]:
                systemd.drain()
                return systemd.names()

        sups.append(b)
        size = 3 << 20  # not a multiple of the 2 MiB granularity: the buffer is its first 3 MiB
        data = np.random.default_rng(40).integers(0, 256, size, dtype=np.uint8).tobytes()
        with tcpxd.Client(endpoint(a)) as ca, tcpxd.Client(endpoint(b)) as cb:
            kept = cb.allocate_cuda(size, device=device, label="kv")
            kept.write_bytes(data)
            assert names() == [f"tcpxd-cuda-b{kept.id}"], names()
            local = ca.register_host(size)
            ca.read(kept.descriptor, local)
            assert local.numpy().tobytes() == data
            desc = kept.descriptor
            for i, sig in enumerate((signal.SIGKILL, signal.SIGTERM, signal.SIGKILL)):
                restart(b, sig)
                got = retry(lambda: kept.read_bytes(), "ReadBuffer of the kept CUDA buffer")
                assert got == data, f"restart {i + 1}: the CUDA buffer lost bytes"
                local.numpy()[:] = 0
                retry(lambda: ca.read(desc, local), "READ of the kept CUDA buffer by its old descriptor")
                assert local.numpy().tobytes() == data
                # What is written after a restart is kept over the next one.
                patch = bytes([i + 1]) * 4096
                kept.write_bytes(patch, offset=i * 4096)
                data = data[: i * 4096] + patch + data[(i + 1) * 4096 :]
            from tcpxd import _proto

            described = cb._unary("DescribeBuffer", _proto.message("DescribeBufferRequest")(buffer_id=kept.id))
            assert (described.label, described.size, described.descriptor) == ("kv", size, desc)
            kept.release()
            deadline = time.monotonic() + 10
            while names() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert names() == [], "a release takes the descriptor out of the store"
            assert regs(d, "cb") == 0
            with pytest.raises(tcpxd.TcpxdError) as e:
                ca.read(desc, local, 4096, timeout=10)
            assert e.value.code == grpc.StatusCode.NOT_FOUND, e.value
    finally:
        for s in sups:
            s.close()
        if keeper is not None:
            keeper.terminate()
            keeper.wait(10)
        shutil.rmtree(d, ignore_errors=True)


def test_nixl_regions_registered_by_address_are_registered_again(patient_nodes: Any) -> None:
    """tcpxd.nixl's DRAM regions of plain numpy arrays (registered by address, many at once) come
    back after a restart of their daemon, under their ids, keys and granule lists: a peer agent's
    READ by the old metadata, plain and by prepared lists (the lists' tokens), lands their bytes;
    a region deregistered before the restart is not registered again."""
    import numpy as np

    from tcpxd.nixl import nixl_agent, nixl_agent_config

    a, b, d = patient_nodes
    K = 1 << 16
    holder = nixl_agent("holder", nixl_agent_config(endpoint=endpoint(b)))
    puller = nixl_agent("puller", nixl_agent_config(endpoint=endpoint(a)))
    try:
        arrays = [np.random.default_rng(i).integers(0, 256, K, dtype=np.uint8) for i in range(6)]
        before = regs(d, "sb")  # (the agent's own buffers)
        holder.register_memory(holder.get_reg_descs([(x.ctypes.data, K, 0, "") for x in arrays], "DRAM"))
        gone = holder.get_reg_descs([(arrays[5].ctypes.data, K, 0, "")], "DRAM")
        holder.deregister_memory(gone)
        assert regs(d, "sb") == before + 5, "one record a region, its lists named in it"
        assert puller.add_remote_agent(holder.get_agent_metadata()) in ("holder", b"holder")
        mine = np.zeros(5 * K, dtype=np.uint8)
        puller.register_memory(puller.get_reg_descs([(mine.ctypes.data, 5 * K, 0, "")], "DRAM"))
        remote = [(x.ctypes.data + j * 4096, 4096, 0) for x in arrays[:5] for j in range(K // 4096)]
        local = [(mine.ctypes.data + i * 4096, 4096, 0) for i in range(len(remote))]
        want = np.concatenate(arrays[:5])

        def pull(prepared: bool) -> None:
            mine[:] = 0
            if prepared:
                lp = puller.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
                rp = puller.prep_xfer_dlist("holder", remote, "DRAM")
                idx = np.random.default_rng(1).permutation(len(local))
                h = puller.make_prepped_xfer("READ", lp, idx, rp, idx)
            else:
                h = puller.initialize_xfer("READ", puller.get_xfer_descs(local, "DRAM"),
                                           puller.get_xfer_descs(remote, "DRAM"), "holder")
            try:
                state = puller.transfer(h)
                deadline = time.monotonic() + 30
                while state == "PROC" and time.monotonic() < deadline:
                    state = puller.check_xfer_state(h)
                if state != "DONE":
                    raise tcpxd.TcpxdError(f"the READ ended {state}")
            finally:
                puller.release_xfer_handle(h)
            assert np.array_equal(mine, want)

        pull(False)
        restart(b)
        retry(lambda: pull(False), "READ of regions registered by address, by the old metadata")
        retry(lambda: pull(True), "READ by prepared lists over their granule lists")
        assert holder._client._reattach.wait(30)
        buffers = [f for f in os.listdir(d / "sb.state" / "regs") if f.startswith("b")]
        assert len(buffers) == before + 5, "the deregistered region is not registered again"
    finally:
        puller.close()
        holder.close()


def test_a_clean_stop_gives_lists_named_in_their_region_records_of_their_own(patient_nodes: Any) -> None:
    """tcpxd.nixl registers a region with its granule lists in one step, one state file a region
    naming its lists; at a clean stop (SIGTERM) the daemon writes each such list a record of its
    own too, the form daemons before session 20 read, so a downgrade finds them
    (docs/OPERATIONS.md, "Downgrading"); the restarted daemon reads both forms."""
    import json

    import numpy as np

    from tcpxd.nixl import nixl_agent, nixl_agent_config

    a, b, d = patient_nodes
    K = 1 << 16
    regs_dir = d / "sb.state" / "regs"

    def records() -> Dict[str, Any]:
        return {f: json.loads((regs_dir / f).read_text()) for f in os.listdir(regs_dir) if not f.endswith(".tmp")}

    holder = nixl_agent("holder", nixl_agent_config(endpoint=endpoint(b)))
    try:
        arrays = [np.random.default_rng(i).integers(0, 256, K, dtype=np.uint8) for i in range(3)]
        holder.register_memory(holder.get_reg_descs([(x.ctypes.data, K, 0, "") for x in arrays], "DRAM"))
        holder.get_agent_metadata()  # (held until a first use: answered here)
        named = {lst: int(f[1:]) for f, r in records().items() if f.startswith("b") for lst in r.get("lists", [])}
        assert len(named) >= 3, f"each region names its granule lists: {records()}"
        assert not any(f"l{lst}" in records() for lst in named), "one file a region while it runs"
        restart(b, signal.SIGTERM)
        after = records()
        for lst, buffer in named.items():
            assert after.get(f"l{lst}") == {"t": "list", "buffer": buffer}, (lst, after)
        assert holder._client._reattach.wait(30), "the regions and their lists re-attached"
    finally:
        holder.close()
