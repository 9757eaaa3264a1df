"""Client.close() and AsyncClient.close() close every connection the client opened: its sessions'
(one left open included: its unfinished transfers end Cancelled), its local-session pool's, its
registrations' and the gRPC channel's; a second close() does nothing more. Counted as the
process's file descriptors before and after (the buffers' memory descriptors go with them)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import os
import time
from typing import Callable, Dict

import pytest

import tcpxd
import tcpxd.aio

MIB = 1 << 20


def open_fds() -> Dict[str, str]:
    """This process's descriptors: number -> what it is (a socket, a memfd, ...)."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # listdir's own descriptor, closed since
            pass
    return out


def left_open(before: Dict[str, str]) -> Dict[str, str]:
    gc.collect()
    return {fd: what for fd, what in open_fds().items() if before.get(fd) != what}


def sockets_left_open(before: Dict[str, str]) -> Dict[str, str]:
    """As `left_open`, sockets only (the buffers' memory stays while they do)."""
    return {fd: what for fd, what in left_open(before).items() if what.startswith("socket:")}


def once_closed(left: Callable[[Dict[str, str]], Dict[str, str]], before: Dict[str, str]) -> Dict[str, str]:
    """`left(before)` once it is empty, or what it still names after 10 s. grpcio closes a closed
    channel's socket on its own I/O thread, a moment after `close()` returned (on a loaded
    machine, after the first look): waited for, not slept on."""
    end = time.monotonic() + 10
    while True:
        got = left(before)
        if not got or time.monotonic() > end:
            return got
        time.sleep(0.005)


@pytest.fixture
def warm(peered):
    """grpc opens its process-wide descriptors (poller, wake-ups) with the first channel."""
    a, b = peered
    with tcpxd.Client(a.endpoint) as c:
        c.stats()
    return a, b


def test_close_closes_every_connection_of_the_sync_client(warm):
    a, b = warm
    with tcpxd.Client(b.endpoint) as cb:
        remote = cb.register_host(MIB)
        descriptor = remote.descriptor
        before = open_fds()
        c = tcpxd.Client(a.endpoint)
        buf = c.register_host(MIB)  # by the registrations' connection
        c.write(buf, descriptor, 4096)  # waited: the local-session pool
        c.read(descriptor, buf, 4096, local_offset=8192)
        with c.session() as s:  # a session of its own, closed
            s.write(buf, descriptor, 4096).result(timeout=30)
        held = c.session()  # and one left open, a transfer in flight
        fut = held.write(buf, descriptor, MIB)
        c.stats()  # the gRPC channel
        assert left_open(before), "the client opened nothing?"
        c.close()
        assert once_closed(sockets_left_open, before) == {}, "sockets the closed client left open"
        c.close()
        # Finished before the close, or ended by it (Cancelled): either way, ended.
        assert concurrent.futures.wait([fut], timeout=30).not_done == set()
        del buf
        assert once_closed(left_open, before) == {}, "descriptors the closed client left open"
        assert held is not None  # (alive: its connection is closed by the client, not by the GC)


def test_close_closes_every_connection_of_the_asyncio_client(warm):
    a, b = warm

    async def scenario() -> None:
        async with tcpxd.aio.AsyncClient(a.endpoint) as warmup:
            await warmup.stats()
        async with tcpxd.aio.AsyncClient(b.endpoint) as cb:
            remote = await cb.register_host(MIB)
            descriptor = remote.descriptor
            before = open_fds()
            c = tcpxd.aio.AsyncClient(a.endpoint)
            buf = await c.register_host(MIB)
            await c.write(buf, descriptor, 4096)
            await c.read(descriptor, buf, 4096, local_offset=8192)
            async with c.session() as s:
                await s.write(buf, descriptor, 4096)
            held = c.session()
            fut = held.write(buf, descriptor, MIB)
            await c.stats()
            assert left_open(before), "the client opened nothing?"
            await c.close()
            assert once_closed(sockets_left_open, before) == {}, "sockets the closed client left open"
            await c.close()
            await asyncio.wait_for(asyncio.gather(fut, return_exceptions=True), 30)
            del buf
            assert once_closed(left_open, before) == {}, "descriptors the closed client left open"
            assert held is not None

    asyncio.run(scenario())
