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
