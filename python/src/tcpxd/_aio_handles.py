"""The asyncio client's handles: tcpxd._handles' `Buffer`, `Transfer`, `Subscription`, `BlockList`
and `PreparedList` as coroutines (`AsyncBuffer`, ...; `async with` releases them). tcpxd.aio
re-exports them."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

import grpc
import grpc.aio

from . import _blocks, _hostmem, _ops, _proto
from ._ops import Notification, TransferResult
from .errors import TcpxdError, from_rpc_error, from_status

if TYPE_CHECKING:
    from .aio import AsyncClient


class AsyncBuffer(_hostmem.HostView):
    """A buffer registered with a daemon. `async with` releases it. Host memory this process shares
    with the daemon (`shared`) is also seen here: `numpy()`, `tensor()`."""

    def __init__(self, client: "AsyncClient", msg: Any, keepalive: Any = None, host: Optional[_hostmem.HostMemory] = None):
        self._client = client
        self._keepalive = keepalive
        self._host = host
        self._update(msg)
        self.released = False

    def _update(self, msg: Any) -> None:
        self.id: int = msg.id
        self.kind: str = _ops.kind_name(msg.kind)
        self.size: int = msg.size
        self.label: str = msg.label
        self.descriptor: str = msg.descriptor
        self.device: int = msg.device

    def __repr__(self) -> str:
        return f"AsyncBuffer(id={self.id}, kind={self.kind}, size={self.size}, label={self.label!r})"

    async def release(self) -> None:
        if not self.released:
            await self._client._unary("ReleaseBuffer", _proto.message("ReleaseBufferRequest")(buffer_id=self.id))
            self.released = True
            self._keepalive = None
            self._client._reattach.forget("b", self.id)

    async def rekey(self) -> str:
        self._update(await self._client._unary("RekeyBuffer", _proto.message("RekeyBufferRequest")(buffer_id=self.id)))
        return self.descriptor

    async def write_bytes(self, data: bytes, offset: int = 0) -> None:
        for req in _ops.fill_requests(self.id, offset, data):
            await self._client._unary("FillBuffer", req)

    async def read_bytes(self, offset: int = 0, length: Optional[int] = None) -> bytes:
        length = self.size - offset if length is None else length
        R = _proto.message("ReadBufferRequest")
        parts = [
            (await self._client._unary("ReadBuffer", R(buffer_id=self.id, offset=o, length=n))).data
            for o, n in _ops.read_ranges(offset, length)
        ]
        return b"".join(parts)

    async def fill(self, *, byte: Optional[int] = None, seed: Optional[int] = None, offset: int = 0, length: int = 0) -> None:
        await self._client._unary("FillBuffer", _ops.fill_pattern(self.id, offset, length, byte, seed))

    async def checksum(self, offset: int = 0, length: int = 0) -> int:
        R = _proto.message("ChecksumBufferRequest")
        return (await self._client._unary("ChecksumBuffer", R(buffer_id=self.id, offset=offset, length=length))).crc32c

    async def __aenter__(self) -> "AsyncBuffer":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.release()


class AsyncTransfer:
    """A transfer started without waiting: `await t.result()`, `await t.cancel()`; also awaitable."""

    def __init__(self, client: "AsyncClient", started: Any):
        self._client = client
        self.id: int = started.transfer_id
        self.total_bytes: int = started.total_bytes
        self._final: Optional[Any] = _ops.final_event(started)

    async def result(self, timeout: Optional[float] = None) -> TransferResult:
        if self._final is None:
            req = _proto.message("WaitTransferRequest")(transfer_id=self.id)
            self._final = await self._client._unary("WaitTransfer", req, timeout=timeout)
        return _ops.result(self._final)

    def __await__(self) -> Any:
        return self.result().__await__()

    async def cancel(self) -> bool:
        return await self._client.cancel(self.id)


class AsyncSubscription:
    """`async for n in sub`: notifications in the order their transfers completed."""

    def __init__(self, call: Any):
        self._call = call
        self._closed = False

    def __aiter__(self) -> AsyncIterator[Notification]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[Notification]:
        try:
            async for n in self._call:
                yield _ops.notification(n)
        except grpc.RpcError as e:
            if self._closed:
                return
            raise from_rpc_error(e) from None

    async def next(self, timeout: Optional[float] = None) -> Notification:
        try:
            n = await asyncio.wait_for(self._call.read(), timeout)
        except asyncio.TimeoutError:
            raise from_status(4, f"no notification within {timeout} s") from None
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        if n is grpc.aio.EOF:
            raise TcpxdError("the subscription ended")
        return _ops.notification(n)

    def close(self) -> None:
        self._closed = True
        self._call.cancel()

    async def __aenter__(self) -> "AsyncSubscription":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()


class AsyncBlockList(_blocks.ListState):
    """As tcpxd.BlockList, for the asyncio client: `async with` releases it."""

    async def refresh(self) -> str:
        msg = await self._client._unary("DescribeBlocks", _proto.message("DescribeBlocksRequest")(list_id=self.id))
        self._update(msg)
        return self.token

    async def release(self) -> None:
        if not self.released:
            await self._client._unary("ReleaseBlocks", _proto.message("ReleaseBlocksRequest")(list_id=self.id))
            self.released = True
            self._client._reattach.forget("l", self.id)

    async def __aenter__(self) -> "AsyncBlockList":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.release()


class AsyncPreparedList(_blocks.PreparedFields):
    """As tcpxd.PreparedList, for the asyncio client: `async with` releases it."""

    async def release(self) -> None:
        if not self.released:
            await self._owner._release_prepared(self.id)
            self.released = True
            reattach = getattr(self._owner, "_reattach", None)  # (a session's goes with it)
            if reattach is not None:
                reattach.forget("p", self.id)

    async def __aenter__(self) -> "AsyncPreparedList":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.release()
