"""AsyncClient.session(): as Client.session() (test_session.py), on asyncio: over the daemon's
local session (asyncio streams) where the client's `local` rules allow it, else the Session RPC."""

from __future__ import annotations

import asyncio
from typing import List

import pytest

import tcpxd
from conftest import Gate
from fakes import OldDaemon

MIB = 1 << 20

PATHS = {"local": {}, "grpc": {"local": False}}


@pytest.fixture(params=list(PATHS))
def path(request) -> str:
    return request.param


def session_stubs(monkeypatch) -> List[str]:
    """The gRPC streaming stubs AsyncClients take from now on."""
    names: List[str] = []
    stub = tcpxd.AsyncClient._stub

    def counting(self, name, kind):
        if kind == "stream_stream":
            names.append(name)
        return stub(self, name, kind)

    monkeypatch.setattr(tcpxd.AsyncClient, "_stub", counting)
    return names


async def cancelled_transfers(c) -> int:
    return sum(x.transfers for x in (await c.stats()).transfer_totals if x.status == "cancelled")


async def settle(c) -> None:
    for _ in range(200):
        if (await c.stats()).active_transfers == 0:
            return
        await asyncio.sleep(0.05)
    pytest.fail("transfers left on the daemon")


def test_async_many_in_flight_byte_exact(peered, path, monkeypatch):
    a, b = peered
    stubs = session_stubs(monkeypatch)

    async def main():
        async with tcpxd.AsyncClient(a.endpoint, **PATHS[path]) as ca, tcpxd.AsyncClient(b.endpoint) as cb:
            src, dst = await ca.register_host(4 * MIB), await cb.register_host(4 * MIB)
            await src.fill(seed=9)
            async with ca.session() as s:
                for _ in range(4):
                    futs = [s.write(src, dst, 65536, local_offset=i * 65536, remote_offset=(63 - i) * 65536) for i in range(64)]
                    results = await asyncio.gather(*futs)
                    assert all(r.bytes_done == 65536 for r in results)
                assert s.path == ("local session" if path == "local" else "grpc")
                with pytest.raises(tcpxd.InvalidArgument, match="past the end"):
                    await s.write(src, dst, 8 * MIB)
                assert (await s.write(src, dst, 16)).bytes_done == 16
            data = await src.read_bytes()
            moved = b"".join(data[(63 - i) * 65536 : (64 - i) * 65536] for i in range(64))
            assert await dst.read_bytes() == data[:16] + moved[16:]  # the last write: its first 16 bytes
            with pytest.raises(tcpxd.TcpxdError, match="closed"):
                s.write(src, dst, 16)

    asyncio.run(main())
    assert "Session" not in stubs if path == "local" else stubs.count("Session") == 1


def test_async_cancel_and_exception_exit_cancel_in_the_daemon(slow, slow_gate: Gate, path):
    a, b = slow

    async def main():
        async with tcpxd.AsyncClient(a.endpoint, **PATHS[path]) as ca, tcpxd.AsyncClient(b.endpoint) as cb:
            src, dst = await ca.register_host(128 * MIB), await cb.register_host(128 * MIB)
            before = await cancelled_transfers(ca)
            # The gate holds each big transfer until it was cancelled, deadline or not; the 4 KiB
            # WRITE meanwhile goes inline on the control connection (transfer.inline_max_bytes),
            # which the gate does not hold.
            slow_gate.close()
            async with ca.session() as s:
                big = s.write(src, dst, 64 * MIB)
                assert (await s.write(src, dst, 4096)).bytes_done == 4096
                assert await s.cancel(big) is True
                with pytest.raises(tcpxd.Cancelled):
                    await big
            assert await cancelled_transfers(ca) == before + 1
            slow_gate.close()
            with pytest.raises(RuntimeError):
                async with ca.session() as s:
                    futs = [s.write(src, dst, 32 * MIB, remote_offset=i * 32 * MIB) for i in range(4)]
                    await asyncio.sleep(0.1)
                    raise RuntimeError("the caller failed")
            for f in futs:
                with pytest.raises(tcpxd.Cancelled):
                    await f
            slow_gate.open()
            await settle(ca)
            await settle(cb)
            assert await cancelled_transfers(ca) > before + 1
            slow_gate.close()
            async with ca.session(timeout=0.3) as s:
                with pytest.raises(tcpxd.DeadlineExceeded):
                    await s.write(src, dst)
            slow_gate.open()
            await settle(ca)

    asyncio.run(main())


def test_async_session_falls_back_to_grpc_on_an_older_daemon(peered, tmp_root, monkeypatch):
    a, b = peered
    stubs = session_stubs(monkeypatch)
    old = OldDaemon(tmp_root / "old-as.sock", a.socket, b"")

    async def main():
        async with tcpxd.AsyncClient(old.endpoint) as c, tcpxd.AsyncClient(b.endpoint) as cb:
            src, dst = await c.register_host(MIB), await cb.register_host(MIB)
            for _ in range(2):
                async with c.session() as s:
                    assert (await s.write(src, dst, 4096)).bytes_done == 4096
                    assert s.path == "grpc"
            assert c._local.available is False and old.prefaces == 1

    try:
        asyncio.run(main())
    finally:
        old.close()
    assert stubs.count("Session") == 2
