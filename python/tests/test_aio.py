"""The asyncio client: the same operations as coroutines, unwaited transfers as awaitables."""

from __future__ import annotations

import asyncio

import pytest

import tcpxd

MIB = 1 << 20


def run(coro):
    return asyncio.run(coro)


def test_async_write_read_batch_and_notifications(peered):
    a, b = peered

    async def main():
        async with tcpxd.AsyncClient(a.endpoint) as ca, tcpxd.AsyncClient(b.endpoint) as cb:
            sub = await cb.subscribe()
            async with await ca.register_host(MIB) as src, await cb.register_host(4 * MIB) as dst:
                data = bytes(range(256)) * 4096
                await src.write_bytes(data)
                r = await ca.write(src, dst, notification=b"async")
                assert r.bytes_done == MIB
                assert await dst.read_bytes(0, MIB) == data
                n = await sub.next(timeout=10)
                assert n.payload == b"async" and n.buffer_ids == [dst.id]
                # Unwaited transfers are awaitable, many in flight at once.
                ts = [await ca.write(src, dst, remote_offset=i * MIB, wait=False) for i in range(4)]
                results = await asyncio.gather(*ts)
                assert [x.total_bytes for x in results] == [MIB] * 4
                assert await dst.checksum(3 * MIB, MIB) == await src.checksum()
                back = await ca.register_host(MIB)
                await ca.read_batch([tcpxd.ReadOp(dst, back, MIB // 2, remote_offset=MIB // 2 * i, local_offset=MIB // 2 * i) for i in range(2)])
                assert await back.read_bytes() == data
                await back.release()
            sub.close()

    run(main())


def test_async_batches_follow_the_daemons_batch_ranges_feature(peered, monkeypatch):
    """The asyncio client and its sessions send packed batches only to a daemon that lists
    `batch_ranges`; to one that does not (an older daemon), entries, byte-checked."""
    a, b = peered
    from tcpxd import _ops

    real_describe, real_w = tcpxd.AsyncClient.describe_node, _ops.write_batch_request
    sent = []

    async def older(self):
        info = await real_describe(self)
        info.features.remove("batch_ranges")
        self._batch_ranges = _ops.packs_batches(info.features)
        return info

    def spy_w(ops, *a, **k):
        req = real_w(ops, *a, **k)
        sent.append((req.HasField("ranges"), len(req.entries)))
        return req

    monkeypatch.setattr(_ops, "write_batch_request", spy_w)

    async def main():
        async with tcpxd.AsyncClient(a.endpoint) as ca, tcpxd.AsyncClient(b.endpoint) as cb:
            async with await ca.register_host(MIB) as src, await cb.register_host(MIB) as dst:
                data = b"".join(bytes([i]) * 4096 for i in range(256))
                await src.write_bytes(data)
                ops = [tcpxd.WriteOp(src, dst, 4096, local_offset=i * 4096, remote_offset=(7 - i) * 4096) for i in range(8)]
                assert (await ca.write_batch(ops)).entries == []  # the real daemon lists it: packed
                monkeypatch.setattr(tcpxd.AsyncClient, "describe_node", older)
                ca._batch_ranges = None
                assert len((await ca.write_batch(ops)).entries) == 8
                async with ca.session() as s:
                    assert len((await s.write_batch(ops)).entries) == 8
                got = await dst.read_bytes(0, 8 * 4096)
                assert got == b"".join(data[(7 - i) * 4096:(8 - i) * 4096] for i in range(8))
        assert sent == [(True, 0), (False, 8), (False, 8)]

    run(main())


def test_async_errors_are_the_same_exceptions(peered):
    a, _ = peered

    async def main():
        async with tcpxd.AsyncClient(a.endpoint) as ca:
            with pytest.raises(tcpxd.InvalidArgument):
                await ca.register_host(0)
            async with await ca.register_host(4096) as src:
                with pytest.raises(tcpxd.InvalidArgument, match="descriptor"):
                    await ca.write(src, "tcpxd1:bad", 16)
            with pytest.raises(tcpxd.NotFound):
                await ca.cancel(424242)

    run(main())


def test_async_waited_transfers_ride_the_own_stream(peered, monkeypatch):
    """Waited transfers without a timeout go on the client's own Session stream; concurrent ones
    (the stream busy) and ones with a timeout are unary calls; all finish byte-exact."""
    a, b = peered
    calls = []
    unary = tcpxd.AsyncClient._unary

    async def counting(self, name, req, timeout=-1.0):
        calls.append(name)
        return await unary(self, name, req, timeout)

    async def main():
        async with tcpxd.AsyncClient(a.endpoint, local=False) as ca, tcpxd.AsyncClient(b.endpoint) as cb:
            async with await ca.register_host(8 * MIB) as src, await cb.register_host(8 * MIB) as dst:
                await src.fill(seed=3)
                monkeypatch.setattr(tcpxd.AsyncClient, "_unary", counting)
                await ca.write(src, dst, MIB)
                await ca.read(dst, src, 4096, local_offset=MIB)
                assert calls == []
                await asyncio.gather(*(ca.write(src, dst, MIB, local_offset=i * MIB, remote_offset=i * MIB) for i in range(8)))
                assert 1 <= len(calls) <= 7 and set(calls) == {"Write"}
                await ca.write(src, dst, 4096, timeout=30)
                monkeypatch.setattr(tcpxd.AsyncClient, "_unary", unary)
                assert await dst.checksum() == await src.checksum()
                with pytest.raises(tcpxd.InvalidArgument, match="past the end"):
                    await ca.write(src, dst, 16 * MIB)
                ca._own._call.cancel()  # ended while idle: the next transfer reopens it
                await ca.write(src, dst, 4096)

    run(main())


@pytest.mark.parametrize("local", [True, False], ids=["local", "stream"])
def test_async_cancelled_wait_cancels_the_transfer(tmp_root, local):
    """A task cancelled while its write waits on the local session or the client's own stream:
    the daemon cancels the transfer (as for a unary caller that went away) and the next write works."""
    from conftest import start_daemon, stop_daemon

    env = {"TCPXEMU_RATE_GBPS": "1"}
    a, b = start_daemon(tmp_root, f"aca{local:d}", env=env), start_daemon(tmp_root, f"acb{local:d}", env=env)

    async def main():
        async with tcpxd.AsyncClient(a.endpoint, local=local) as ca, tcpxd.AsyncClient(b.endpoint) as cb:
            src, dst = await ca.register_host(128 * MIB), await cb.register_host(128 * MIB)
            await ca.write(src, dst, 4096)
            t = asyncio.ensure_future(ca.write(src, dst))
            await asyncio.sleep(0.15)
            t.cancel()
            with pytest.raises(asyncio.CancelledError):
                await t

            async def cancelled() -> int:
                return sum(x.transfers for x in (await ca.stats()).transfer_totals if x.status == "cancelled")

            for _ in range(100):
                if await cancelled():
                    break
                await asyncio.sleep(0.05)
            assert await cancelled() == 1
            r = await ca.write(src, dst, MIB)
            assert r.bytes_done == MIB
            if local:
                assert ca._waited_path() == "local session"
            else:
                assert ca._own._call is not None

    try:
        run(main())
    finally:
        stop_daemon(a)
        stop_daemon(b)


def test_async_local_session(peered, slow, monkeypatch):
    """Waited transfers over the daemon's local session (asyncio streams): byte-exact, concurrent
    ones on connections of their own, refusals and deadlines as exceptions; no gRPC transfer call."""
    a, b = peered
    calls = []
    unary = tcpxd.AsyncClient._unary

    async def counting(self, name, req, timeout=-1.0):
        if name in ("Write", "Read", "WriteBatch", "ReadBatch", "WaitTransfer"):
            calls.append(name)
        return await unary(self, name, req, timeout)

    monkeypatch.setattr(tcpxd.AsyncClient, "_unary", counting)

    async def main():
        async with tcpxd.AsyncClient(a.endpoint) as ca, tcpxd.AsyncClient(b.endpoint) as cb:
            async with await ca.register_host(8 * MIB) as src, await cb.register_host(8 * MIB) as dst:
                await src.fill(seed=13)
                r = await ca.write(src, dst, MIB)
                assert r.bytes_done == MIB and ca._waited_path() == "local session"
                await ca.read(dst, src, 4096, local_offset=MIB, timeout=30)
                await asyncio.gather(*(ca.write(src, dst, MIB, local_offset=i * MIB, remote_offset=i * MIB) for i in range(8)))
                assert 2 <= len(ca._local._idle) <= 8
                await ca.write_batch([tcpxd.WriteOp(src, dst, 4096, local_offset=i * 4096, remote_offset=i * 4096) for i in range(4)])
                await ca.read_batch([tcpxd.ReadOp(dst, src, 4096)])
                assert await dst.checksum() == await src.checksum()
                with pytest.raises(tcpxd.InvalidArgument, match="past the end"):
                    await ca.write(src, dst, 16 * MIB)
        sa, sb = slow
        async with tcpxd.AsyncClient(sa.endpoint) as ca, tcpxd.AsyncClient(sb.endpoint) as cb:
            async with await ca.register_host(128 * MIB) as src, await cb.register_host(128 * MIB) as dst:
                with pytest.raises(tcpxd.DeadlineExceeded):
                    await ca.write(src, dst, timeout=0.2)
                for _ in range(200):
                    if (await ca.stats()).active_transfers == 0:
                        break
                    await asyncio.sleep(0.05)
                assert (await ca.stats()).active_transfers == 0
        assert calls == []

    run(main())


def test_async_falls_back_when_the_daemon_predates_it(peered, tmp_root):
    from fakes import OldDaemon

    a, b = peered
    old = OldDaemon(tmp_root / "aold.sock", a.socket, b"")

    async def main():
        async with tcpxd.AsyncClient(old.endpoint) as ca, tcpxd.AsyncClient(b.endpoint) as cb:
            async with await ca.register_host(MIB) as src, await cb.register_host(MIB) as dst:
                await src.fill(seed=14)
                for _ in range(3):
                    await ca.write(src, dst)
                assert old.prefaces == 1 and ca._waited_path() == "own stream"
                assert await dst.checksum() == await src.checksum()

    try:
        run(main())
    finally:
        old.close()


def test_async_subscribe_addressed_to_a_name_gets_only_its_own_notifications(peered):
    """`AsyncClient.subscribe(addressed_to=...)`: the daemon's Subscribe RPC keeps only the
    notifications framed to that name (tcpxd.nixl's framing); an unaddressed one gets them all."""
    from tcpxd.nixl._notify import frame

    a, b = peered

    async def main():
        async with tcpxd.AsyncClient(a.endpoint) as ca, tcpxd.AsyncClient(b.endpoint) as cb:
            mine = await cb.subscribe(addressed_to="agent-b")
            every = await cb.subscribe()
            async with await ca.register_host(4096) as src, await cb.register_host(4096) as dst:
                for to, msg in [("agent-c", b"not yours"), ("agent-b", b"yours"), ("agent-c", b"again")]:
                    await ca.write(src, dst, notification=frame("agent-a", to, msg))
                got = await mine.next(timeout=10)
                assert got.payload == frame("agent-a", "agent-b", b"yours")
                with pytest.raises(tcpxd.DeadlineExceeded):
                    await mine.next(timeout=0.5)  # nothing else was addressed to agent-b
                all3 = [(await every.next(timeout=10)).payload for _ in range(3)]
                assert all3 == [frame("agent-a", t, m) for t, m in [("agent-c", b"not yours"), ("agent-b", b"yours"), ("agent-c", b"again")]]
            mine.close()
            every.close()

    run(main())
