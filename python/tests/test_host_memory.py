"""Client host memory without copies (#24) against two real daemons: memory of the client's own (a
memfd the package maps, a numpy array or mmap over a memfd or /dev/shm file, a torch tensor after
share_memory_()) handed to the daemon as a file descriptor over its unix socket. Transfers send what
the client wrote into its array and land bytes the client then reads there, with no ReadBuffer or
FillBuffer call; release semantics; memory that cannot be shared raises what to do."""

from __future__ import annotations

import asyncio
import mmap
import os
import time

import pytest

import tcpxd

np = pytest.importorskip("numpy")

MIB = 1 << 20


class Calls:
    """Records the unary RPCs a client makes."""

    def __init__(self, client):
        self.names = []
        inner = client._unary

        def unary(name, req, timeout=-1.0):
            self.names.append(name)
            return inner(name, req, timeout)

        client._unary = unary


def listed(client, buf) -> bool:
    return buf.id in [b.id for b in client.list_buffers()]


def test_client_arrays_are_sent_and_landed_without_copy_calls(peered):
    a, b = peered
    n = 4 * MIB
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        dst = cb.register_host(n, shared=False)  # the remote side: daemon-allocated
        src, back = ca.register_host(n, label="src"), ca.register_host(n)
        assert (src.kind, src.size, src.label, src.shared) == ("host_shared", n, "src", True)
        calls = Calls(ca)
        arr = src.numpy()
        assert arr.dtype == np.uint8 and arr.shape == (n,)
        rng = np.random.default_rng(24)
        arr[:] = rng.integers(0, 256, n, dtype=np.uint8)
        ca.write(src, dst)
        ca.read(dst, back)
        assert np.array_equal(back.numpy(), arr), "READ landed the WRITE's bytes in the client's array"
        # The client changes its array in place; the next WRITE sends the new bytes.
        arr[1000:2000] = 7
        arr[-1] = 1
        ca.write(src, dst, MIB, local_offset=0, remote_offset=0)
        ca.write(src, dst, MIB, local_offset=n - MIB, remote_offset=n - MIB)
        ca.read(dst, back)
        assert np.array_equal(back.numpy(), arr)
        assert bytes(back.numpy()[1000:1005]) == b"\x07" * 5
        assert not {"ReadBuffer", "FillBuffer", "WriteBuffer"} & set(calls.names), calls.names
        # The daemon sees the same bytes in the client's memory as it landed remotely.
        assert src.checksum() == dst.checksum()
        # A part of a shared buffer's array registers again as a buffer of its own (same memory).
        with ca.register_host(arr[4096:8192]) as part:
            assert part.size == 4096
            part.numpy()[:] = 42
            assert arr[4096] == 42 and src.read_bytes(8191, 1) == b"*"
        dst.release()


def test_existing_memory_is_registered_in_place(peered):
    a, b = peered
    n = MIB
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        dst = cb.register_host(n, shared=False)
        # A numpy array over a memfd of the caller's own (the descriptor found in /proc/self/fd).
        fd = os.memfd_create("caller", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, 2 * n)
        mm = mmap.mmap(fd, 2 * n)
        whole = np.frombuffer(mm, dtype=np.uint8)
        part = whole[n:]  # at an offset in the file
        part[:] = np.arange(n, dtype=np.uint64).astype(np.uint8)
        with ca.register_host(part) as buf:
            assert buf.size == n and buf.kind == "host_shared"
            view = buf.numpy()
            assert np.shares_memory(view, part) or view.ctypes.data == part.ctypes.data
            ca.write(buf, dst)
            assert dst.read_bytes() == part.tobytes()
            part[:10] = 99  # through the caller's own array
            ca.write(buf, dst, 10)
            assert dst.read_bytes(0, 10) == b"\x63" * 10
        os.close(fd)
        # A float32 array: registered as its bytes.
        fd = os.memfd_create("floats", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, n)
        floats = np.frombuffer(mmap.mmap(fd, n), dtype=np.float32)
        floats[:] = 1.5
        with ca.register_host(floats) as buf:
            ca.write(buf, dst)
            assert np.array_equal(np.frombuffer(dst.read_bytes(), dtype=np.float32), floats)
        # An mmap.mmap of a file on /dev/shm, with its descriptor given (fd=); the daemon cannot seal
        # such a file but takes it from a client of its own user.
        path = f"/dev/shm/tcpxd-test-{os.getpid()}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, n)
            shm = mmap.mmap(fd, n)
            shm[:5] = b"hello"
            with ca.register_host(shm, fd=fd) as buf:
                ca.write(buf, dst, 5)
                assert dst.read_bytes(0, 5) == b"hello"
                # Without fd=: found by its path.
                buf2 = ca.register_host(shm)
                buf2.release()
        finally:
            os.close(fd)
            os.unlink(path)
        dst.release()


def test_torch_shared_tensors_and_tensor_views(peered):
    torch = pytest.importorskip("torch")
    a, b = peered
    n = MIB
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        dst = cb.register_host(n, shared=False)
        t = torch.arange(n // 4, dtype=torch.int32).share_memory_()
        with ca.register_host(t) as buf:
            ca.write(buf, dst)
            assert dst.read_bytes() == t.numpy().tobytes()
            assert buf.tensor().data_ptr() == t.data_ptr()
        with ca.register_host(n) as own:
            own.tensor()[:] = 5
            ca.write(own, dst)
            assert dst.read_bytes(0, 4) == b"\x05" * 4
        with pytest.raises(tcpxd.InvalidArgument, match="share_memory_"):
            ca.register_host(torch.zeros(n, dtype=torch.uint8))
        dst.release()


def test_release_and_lifetime(peered):
    a, _ = peered
    with tcpxd.Client(a.endpoint) as watcher:
        c = tcpxd.Client(a.endpoint)
        buf = c.register_host(MIB)
        arr = buf.numpy()
        arr[:4] = 9
        assert listed(watcher, buf)
        buf.release()
        buf.release()  # idempotent
        assert buf.released and not listed(watcher, buf)
        # The memory stays the client's own after release: the daemon no longer touches it.
        assert bytes(arr[:4]) == b"\x09" * 4
        # Buffers a client shared go when it closes; daemon-allocated ones stay.
        kept = c.register_host(MIB, shared=False)
        gone = [c.register_host(MIB) for _ in range(3)]
        assert all(listed(watcher, g) for g in gone)
        c.close()
        for _ in range(500):
            if not any(listed(watcher, g) for g in gone):
                break
            time.sleep(0.01)
        assert not any(listed(watcher, g) for g in gone), "the closed client's shared buffers were released"
        assert listed(watcher, kept)
        watcher._unary("ReleaseBuffer", tcpxd._proto.message("ReleaseBufferRequest")(buffer_id=kept.id))


def test_session_buffers_go_with_the_session(peered):
    a, b = peered
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        dst = cb.register_host(MIB, shared=False)
        with ca.session() as s:
            buf = s.register_host(MIB)
            buf.numpy()[:] = 3
            assert s.write(buf, dst).result().total_bytes == MIB
            assert listed(ca, buf)
        assert dst.read_bytes(0, 8) == b"\x03" * 8
        for _ in range(500):
            if not listed(ca, buf):
                break
            time.sleep(0.01)
        assert not listed(ca, buf), "released when its session ended"
        dst.release()


def test_memory_that_cannot_be_shared_says_what_to_do(peered):
    a, _ = peered
    with tcpxd.Client(a.endpoint) as ca:
        before = len(ca.list_buffers())
        # Anonymous memory has no file to hand over: registered by address (test_client_memory.py).
        with ca.register_host(bytearray(4096)) as anon:
            assert anon.kind == "host_attached"
        ro = np.frombuffer(mmap.mmap(-1, 4096), dtype=np.uint8)
        ro.flags.writeable = False
        with pytest.raises(tcpxd.InvalidArgument, match="read-only"):
            ca.register_host(ro)
        with pytest.raises(tcpxd.InvalidArgument, match="not C-contiguous"):
            ca.register_host(np.zeros((64, 64), dtype=np.uint8)[:, ::2])
        with pytest.raises(tcpxd.InvalidArgument, match="read-only"):
            ca.register_host(b"bytes")
        with pytest.raises(tcpxd.InvalidArgument, match="positive number of bytes"):
            ca.register_host(0)
        # A private mapping of a memfd: the daemon's own mapping would not see the client's writes,
        # so it goes by address too; with fd= it is refused.
        fd = os.memfd_create("private", os.MFD_CLOEXEC)
        os.ftruncate(fd, 4096)
        private = mmap.mmap(fd, 4096, mmap.MAP_PRIVATE)
        with pytest.raises(tcpxd.InvalidArgument, match="fd: this memory is not one shared mapping"):
            ca.register_host(private, fd=fd)
        with ca.register_host(private) as p:
            assert p.kind == "host_attached"
        # The wrong descriptor for the memory.
        other = os.memfd_create("other", os.MFD_CLOEXEC)
        shared = mmap.mmap(fd, 4096)
        with pytest.raises(tcpxd.InvalidArgument, match="fd: not the file"):
            ca.register_host(shared, fd=other)
        os.close(other)
        os.close(fd)

        class FakeCudaTensor:  # what the check looks at, without needing torch
            __module__ = "torch"
            is_cuda = True

            def data_ptr(self) -> int:
                return 0

        with pytest.raises(tcpxd.InvalidArgument, match="register_tensor"):
            ca.register_host(FakeCudaTensor())
        # A daemon-allocated buffer cannot be seen here.
        with ca.register_host(4096, shared=False) as daemons:
            assert daemons.kind == "host" and not daemons.shared
            with pytest.raises(tcpxd.FailedPrecondition, match="read_bytes"):
                daemons.numpy()
        assert len(ca.list_buffers()) == before, "nothing stayed registered"
    # A TCP endpoint cannot carry a descriptor (said before anything is sent).
    tcp = tcpxd.Client("127.0.0.1:9")
    with pytest.raises(tcpxd.FailedPrecondition, match="TCP endpoint cannot carry descriptors"):
        tcp.register_host(4096, shared=True)
    with pytest.raises(tcpxd.FailedPrecondition, match="unix socket"):
        tcp.register_host(np.zeros(4, dtype=np.uint8))
    # A size without shared=True is the daemon-allocated kind there: a RegisterBuffer call (which
    # finds nothing listening), not a refusal.
    tcp.timeout = 2
    with pytest.raises(tcpxd.Unavailable):
        tcp.register_host(4096)
    tcp.close()


def test_asyncio_client_shares_the_same_way(peered):
    a, b = peered

    async def main() -> None:
        async with tcpxd.AsyncClient(a.endpoint) as ca, tcpxd.AsyncClient(b.endpoint) as cb:
            dst = await cb.register_host(MIB, shared=False)
            src = await ca.register_host(MIB)
            back = await ca.register_host(MIB)
            assert src.kind == "host_shared"
            src.numpy()[:] = np.arange(MIB, dtype=np.uint32).astype(np.uint8)
            await ca.write(src, dst)
            await ca.read(dst, back)
            assert np.array_equal(back.numpy(), src.numpy())
            await src.release()
            assert src.id not in [x.id for x in await ca.list_buffers()]
            anon = await ca.register_host(np.zeros(16, dtype=np.uint8))  # by address
            assert anon.kind == "host_attached"
            await anon.release()
            # On a session's own connection: released when the session ends.
            async with ca.session() as s:
                sb = await s.register_host(MIB)
                sb.numpy()[:] = 4
                assert (await s.write(sb, dst)).total_bytes == MIB
                assert sb.kind == "host_shared"
            assert await dst.read_bytes(0, 4) == b"\x04" * 4
            for _ in range(500):
                if sb.id not in [x.id for x in await ca.list_buffers()]:
                    break
                await asyncio.sleep(0.01)
            assert sb.id not in [x.id for x in await ca.list_buffers()], "released when its session ended"
            await dst.release()

    asyncio.run(main())


def test_memory_the_node_does_not_have_is_refused_not_left_to_the_oom_killer(tmp_root):
    """With a reserve no machine has (transfer.host_memory_reserve_bytes), a registration that
    would make the daemon allocate memory is refused with ResourceExhausted naming the field, and
    nothing is registered: daemon-allocated memory, and a client's memfd still all holes. The
    package's own memfd is allocated by the client (`fallocate`) before it is handed over, so
    faulting it in allocates nothing and it is taken."""
    from conftest import start_daemon, stop_daemon

    conf = tmp_root / "headroom.toml"
    conf.write_text("[transfer]\nhost_memory_reserve_bytes = 1125899906842624\n")
    d = start_daemon(tmp_root, "hr", ["--config", str(conf)])
    try:
        with tcpxd.Client(d.endpoint) as c:
            with pytest.raises(tcpxd.errors.ResourceExhausted, match=r"host\.size: faulting in 4194304 bytes"):
                c.register_host(4 * MIB, shared=False)
            fd = os.memfd_create("sparse", os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(fd, 4 * MIB)
                mm = mmap.mmap(fd, 4 * MIB)
                with pytest.raises(tcpxd.errors.ResourceExhausted, match=r"register_host_fd\.size: faulting in 4194304 bytes"):
                    c.register_host(mm, fd=fd)
                assert c.list_buffers() == []
                mm[:] = b"\x07" * (4 * MIB)  # written by the client: nothing left to allocate
                b = c.register_host(mm, fd=fd)
                assert b.numpy()[-1] == 7
                b.release()
            finally:
                os.close(fd)
            own = c.register_host(4 * MIB)  # the package's memfd: allocated here already
            own.numpy()[:] = 3
            assert len(c.list_buffers()) == 1
            own.release()
    finally:
        stop_daemon(d)
