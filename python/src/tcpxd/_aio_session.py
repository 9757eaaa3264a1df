"""The asyncio client's streams of the `Session` RPC: `AsyncSession` (tcpxd.Session's many
transfers in flight, each an asyncio.Future, on a connection of the daemon's local session of its
own or on the gRPC stream) and `_AsyncOwnStream` (the client's own stream for its waited
transfers, one at a time). tcpxd.aio re-exports them (the same objects)."""

from __future__ import annotations

import asyncio
import itertools
from typing import TYPE_CHECKING, Any, AsyncIterator, Dict, Optional, Sequence, cast

import grpc
import grpc.aio

from . import _blocks, _hostmem, _local, _ops, _proto
from ._aio_handles import AsyncBuffer, AsyncPreparedList
from ._aio_local import _AsyncConnection, send_with_fd
from ._local import local_end, too_large
from ._requests import SessionRequests
from ._ops import TransferResult, settle
from .errors import TcpxdError, Unavailable, from_rpc_error, from_status

if TYPE_CHECKING:
    from .aio import AsyncClient

    class _TaggedFuture(asyncio.Future[Any]):
        """What AsyncSession._submit returns: a Future carrying its request's tag (for cancel)."""

        tag: int


class AsyncSession(SessionRequests["asyncio.Future[TransferResult]"]):
    """Many transfers in flight on one stream: each submit returns an asyncio.Future resolved when
    that transfer finishes. `async with client.session() as s: r = await s.write(...)`.

    As tcpxd.Session: a connection of the daemon's local session of its own where the client's
    `local` rules allow it (asyncio streams; its reader task connects first, requests submitted
    meanwhile wait in the queue), else the `Session` RPC."""

    def __init__(self, client: "AsyncClient", timeout: Optional[float]):
        self._client = client
        self._q: "asyncio.Queue[Any]" = asyncio.Queue()
        self._pending: Dict[int, asyncio.Future] = {}
        self._tags = itertools.count(1)
        self._closed = False
        self._timeout = timeout
        self._call: Any = None
        self._conn: Optional[_AsyncConnection] = None
        self._why: Optional[str] = None  # "cancelled", "expired", "client closed": why the client ended it
        #: Its batches go packed once the client knows the daemon reads them (asked now, in the
        #: background: a batch submitted before the answer goes as entries).
        self._learning = asyncio.ensure_future(client._learn_batch_ranges()) if client._batch_ranges is None else None
        if client._local is not None and client._local.available is not False:
            client._sessions.add(self)
            self._reader = asyncio.ensure_future(self._run_local())
        else:
            self._start_grpc()

    def _start_grpc(self) -> None:
        self._call = self._client._stub("Session", "stream_stream")(
            self._requests(), timeout=self._timeout, metadata=self._client._metadata)
        self._reader = asyncio.ensure_future(self._read())

    @property
    def path(self) -> str:
        """How the session reaches the daemon: "local session" or "grpc" (once its reader connected)."""
        return "local session" if self._conn is not None else "grpc"

    async def _requests(self) -> AsyncIterator[Any]:
        while True:
            item = await self._q.get()
            if item is None:
                return
            if isinstance(item, tuple):  # a registration: gRPC cannot carry its descriptor (the daemon says so)
                item[1].done_sending()
                item = item[0]
            yield item

    def _packs(self, ops: Sequence[Any]) -> bool:
        return len(ops) >= 2 and self._client._batch_ranges is True

    def _submit(self, _shared: Optional[_hostmem.Shared] = None, **op: Any) -> _TaggedFuture:
        if self._closed:
            raise TcpxdError("the session is closed")
        fut = cast("_TaggedFuture", asyncio.get_running_loop().create_future())
        tag = next(self._tags)
        self._pending[tag] = fut
        fut.tag = tag
        msg = _proto.message("SessionRequest")(tag=tag, **op)
        self._q.put_nowait(msg if _shared is None else (msg, _shared))
        return fut

    async def register_host(self, memory: Any, label: str = "", *, fd: Optional[int] = None) -> AsyncBuffer:
        """As tcpxd.Session.register_host: on this session's connection, released when it ends."""
        if self._client._registrar is None:
            raise _hostmem.no_unix_socket(self._client.endpoint)
        mem = await asyncio.get_running_loop().run_in_executor(None, _hostmem.prepare, memory, label, fd)
        host = _hostmem.HostMemory(mem)
        try:
            fut = self._submit(mem, **mem.session_op(label))
        except BaseException:
            mem.done_sending()
            raise
        return AsyncBuffer(self._client, await fut, keepalive=host, host=host)

    async def prepare_blocks(self, lists: Any, entries: Any) -> AsyncPreparedList:
        """As tcpxd.Session.prepare_blocks: the list goes with the session."""
        return AsyncPreparedList(self, await self._submit(prepare_blocks=_blocks.prepare_request(lists, entries)))

    async def _release_prepared(self, prepared_id: int) -> None:
        await self._submit(release_prepared=prepared_id)

    def write_prepared(
        self, local: Any, local_idx: Any, remote: Any, remote_idx: Any, *, notification: bytes = b"", timeout: Optional[float] = None
    ) -> "asyncio.Future[TransferResult]":
        req = _blocks.prepared_request("WRITE", local, local_idx, remote, remote_idx, notification, timeout, False)
        return self._submit(write_prepared=req)

    def read_prepared(
        self, local: Any, local_idx: Any, remote: Any, remote_idx: Any, *, notification: bytes = b"", timeout: Optional[float] = None
    ) -> "asyncio.Future[TransferResult]":
        req = _blocks.prepared_request("READ", local, local_idx, remote, remote_idx, notification, timeout, False)
        return self._submit(read_prepared=req)

    def cancel(self, fut: "asyncio.Future[Any]") -> "asyncio.Future[bool]":
        return self._submit(cancel_tag=fut.tag)  # type: ignore[attr-defined]

    async def _read(self) -> None:
        err: TcpxdError = TcpxdError("the session ended with transfers unfinished")
        try:
            async for ev in self._call:
                self._dispatch(ev)
        except grpc.RpcError as e:
            err = from_rpc_error(e, self._client.endpoint)
        except asyncio.CancelledError:
            if self._why is None:
                raise  # this task was cancelled, not the call
            err = local_end(None, self._why, self._closed, self._client.endpoint, self._timeout)  # the call was
        self._end(err)

    def _dispatch(self, ev: Any) -> None:
        fut = self._pending.pop(ev.tag, None)
        if fut is not None and not fut.done():
            settle(fut, ev)

    def _end(self, err: TcpxdError) -> None:
        left, self._pending = self._pending, {}
        for fut in left.values():
            if not fut.done():
                fut.set_exception(err)

    async def _run_local(self) -> None:
        local = self._client._local
        assert local is not None
        conn = await local._open() if self._why is None else None
        if conn is None:  # an older daemon (found out once), nothing listening: the Session RPC
            self._client._sessions.discard(self)
            self._start_grpc()
            if self._why is not None:
                self._call.cancel()
            await self._reader
            return
        self._conn = conn
        if self._why is not None:
            conn.writer.transport.abort()
        timer = None
        if self._timeout is not None:
            timer = asyncio.get_running_loop().call_later(self._timeout, self._abort, "expired")
        sender = asyncio.ensure_future(self._send_local(conn))
        err: Optional[TcpxdError] = None
        try:
            while True:
                try:
                    n = _local.frame_length(await conn.reader.readexactly(_local.HEADER.size))
                    ev = _proto.message("SessionEvent").FromString(await conn.reader.readexactly(n))
                except (asyncio.IncompleteReadError, ConnectionResetError):
                    break
                if ev.tag == 0 and ev.WhichOneof("event") == "refused":  # the daemon refused a frame
                    err = from_status(ev.refused.code, ev.refused.message)
                    break
                self._dispatch(ev)
        except TcpxdError as e:
            err = e
        except OSError as e:
            err = Unavailable(f"local session with {self._client.endpoint}: {e}")
        finally:
            if timer is not None:
                timer.cancel()
            sender.cancel()
            conn.close()
        await conn.closed()
        self._end(local_end(err, self._why, self._closed, self._client.endpoint, self._timeout))

    async def _send_local(self, conn: _AsyncConnection) -> None:
        try:
            while True:
                msg = await self._q.get()
                if msg is None:
                    conn.writer.write_eof()  # the daemon finishes what is in flight, then closes
                    return
                if isinstance(msg, tuple):  # a registration, with its memory's descriptor
                    msg, shared = msg
                    try:
                        if shared.sent_fd is None:  # by address: no descriptor goes with it
                            conn.writer.write(_local.frame(msg) or b"")
                            await conn.writer.drain()
                        else:
                            await send_with_fd(conn.writer, _local.frame(msg) or b"", shared.fd)
                    finally:
                        shared.done_sending()
                    continue
                frame = _local.frame(msg)
                if frame is None:
                    fut = self._pending.pop(msg.tag, None)
                    if fut is not None and not fut.done():
                        fut.set_exception(too_large(msg))
                    continue
                conn.writer.write(frame)
                await conn.writer.drain()
        except OSError:
            pass  # the connection ended: the reader fails the pending futures

    def _abort(self, why: str) -> None:
        """Ends the stream: the daemon cancels what is in flight; the futures fail (`why`)."""
        if self._why is None:
            self._why = why
        if self._call is not None:
            self._call.cancel()
        elif self._conn is not None:
            self._conn.writer.transport.abort()

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._q.put_nowait(None)
        await self._reader

    async def __aenter__(self) -> "AsyncSession":
        return self

    async def __aexit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:
            self._abort("cancelled")
        await self.close()


class _AsyncOwnStream:
    """tcpxd._session._OwnStream for asyncio: the client's own `Session` stream for waited transfers
    without `timeout`, one at a time (a coroutine that finds it busy makes the unary call)."""

    def __init__(self, client: "AsyncClient"):
        self._client = client
        self._busy = False
        self._call: Any = None
        self._tag = 0
        self._closed = False

    async def run(self, field: str, req: Any) -> Optional[TransferResult]:
        """The transfer's result (or its exception); None when the unary call should be made."""
        if self._busy or self._closed:
            return None
        self._busy = True
        try:
            ev = await self._exchange(field, req)
        finally:
            self._busy = False
        if ev is None:
            return None
        if ev.WhichOneof("event") == "refused":
            raise from_status(ev.refused.code, ev.refused.message)
        return _ops.result(ev.finished)

    async def _exchange(self, field: str, req: Any) -> Any:
        if self._call is not None and self._call.done():
            self._drop(cancel=False)  # ended while idle (the daemon restarted or drained)
        if self._call is None:
            self._call = self._client._stub("Session", "stream_stream")(metadata=self._client._metadata)
        self._tag += 1
        tag = self._tag
        try:
            await self._call.write(_proto.message("SessionRequest")(tag=tag, **{field: req}))
        except (grpc.RpcError, asyncio.InvalidStateError):
            self._drop(cancel=True)  # the stream is gone: the daemon cancels anything it read
            return None
        try:
            while True:
                ev = await self._call.read()
                if ev is grpc.aio.EOF:
                    self._drop(cancel=False)  # the daemon (draining) never read the request
                    return None
                if ev.tag == tag:
                    return ev
        except grpc.RpcError as e:
            self._drop(cancel=False)
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # a daemon without Session: unary calls
                self._closed = True
                return None
            raise from_rpc_error(e) from None
        except BaseException:
            self._drop(cancel=True)  # e.g. the task was cancelled: the daemon cancels the transfer
            raise

    def _drop(self, cancel: bool) -> None:
        if cancel and self._call is not None:
            self._call.cancel()
        self._call = None

    def close(self) -> None:
        self._closed = True
        self._drop(cancel=True)
