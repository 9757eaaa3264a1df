"""The asyncio client (grpc.aio, and asyncio streams for the daemon's local session): the same calls
as tcpxd.Client, as coroutines."""

from __future__ import annotations

import array
import asyncio
import itertools
import os
import socket
import weakref
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence, Set

import grpc
import grpc.aio

from . import _blocks, _hostmem, _local, _ops, _proto, _tensor
from ._local import local_end, too_large
from ._ops import SESSION_FIELD, BufferLike, NodeInfo, Notification, ReadOp, RemoteLike, TransferResult, WriteOp, settle
from .client import DEFAULT_CALL_TIMEOUT
from .errors import Cancelled, DeadlineExceeded, TcpxdError, Unavailable, from_rpc_error, from_status


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


class AsyncBlockList:
    """As tcpxd.BlockList, for the asyncio client: `async with` releases it."""

    def __init__(self, client: "AsyncClient", msg: Any):
        self._client = client
        self._update(msg)
        self.released = False

    def _update(self, msg: Any) -> None:
        f = _blocks.ListFields.of(msg)
        self.id: int = f.id
        self.buffer_id: int = f.buffer_id
        self.token: str = f.token
        self.count: int = f.count
        self.block_length: int = f.block_length

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        return f"AsyncBlockList(id={self.id}, buffer_id={self.buffer_id}, count={self.count}, block_length={self.block_length})"

    async def refresh(self) -> str:
        msg = await self._client._unary("DescribeBlocks", _proto.message("DescribeBlocksRequest")(list_id=self.id))
        self._update(msg)
        return self.token

    async def release(self) -> None:
        if not self.released:
            await self._client._unary("ReleaseBlocks", _proto.message("ReleaseBlocksRequest")(list_id=self.id))
            self.released = True

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

    async def __aenter__(self) -> "AsyncPreparedList":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.release()


class AsyncSession:
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

    def _submit(self, _shared: Optional[_hostmem.Shared] = None, **op: Any) -> "asyncio.Future[Any]":
        if self._closed:
            raise TcpxdError("the session is closed")
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        tag = next(self._tags)
        self._pending[tag] = fut
        fut.tag = tag  # type: ignore[attr-defined]
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
            fut = self._submit(mem, register_host_fd=_hostmem.register_request(mem, label))
        except BaseException:
            mem.done_sending()
            raise
        return AsyncBuffer(self._client, await fut, keepalive=host, host=host)

    def write(
        self,
        local: BufferLike,
        remote: RemoteLike,
        length: Optional[int] = None,
        *,
        local_offset: int = 0,
        remote_offset: int = 0,
        notification: bytes = b"",
        ready_event: Any = None,
        timeout: Optional[float] = None,
    ) -> "asyncio.Future[TransferResult]":
        op = WriteOp(local, remote, length, local_offset, remote_offset)
        return self._submit(write=_ops.write_request(op, notification, ready_event, timeout, False))

    def read(
        self,
        remote: RemoteLike,
        local: BufferLike,
        length: Optional[int] = None,
        *,
        remote_offset: int = 0,
        local_offset: int = 0,
        timeout: Optional[float] = None,
    ) -> "asyncio.Future[TransferResult]":
        op = ReadOp(remote, local, length, remote_offset, local_offset)
        return self._submit(read=_ops.read_request(op, timeout, False))

    def write_batch(
        self, ops: Sequence[WriteOp], *, notification: bytes = b"", ready_event: Any = None, timeout: Optional[float] = None
    ) -> "asyncio.Future[TransferResult]":
        return self._submit(write_batch=_ops.write_batch_request(ops, notification, ready_event, timeout, False))

    def read_batch(self, ops: Sequence[ReadOp], *, timeout: Optional[float] = None) -> "asyncio.Future[TransferResult]":
        return self._submit(read_batch=_ops.read_batch_request(ops, timeout, False))

    def write_blocks(
        self,
        local_list: Any,
        local_idx: Any,
        remote: Any,
        remote_idx: Any,
        *,
        notification: bytes = b"",
        ready_event: Any = None,
        timeout: Optional[float] = None,
    ) -> "asyncio.Future[TransferResult]":
        req = _blocks.write_request(local_list, local_idx, remote, remote_idx, notification, ready_event, timeout, False)
        return self._submit(write_blocks=req)

    def read_blocks(
        self, local_list: Any, local_idx: Any, remote: Any, remote_idx: Any, *, timeout: Optional[float] = None
    ) -> "asyncio.Future[TransferResult]":
        return self._submit(read_blocks=_blocks.read_request(local_list, local_idx, remote, remote_idx, timeout, False))

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
    """tcpxd.client._OwnStream for asyncio: the client's own `Session` stream for waited transfers
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


async def send_with_fd(writer: asyncio.StreamWriter, frame: bytes, fd: int) -> None:
    """Sends `frame` with `fd` attached (SCM_RIGHTS) on the stream's socket: once what was written
    before has left (the one sender task writes nothing meanwhile), by sendmsg on a duplicate of the
    socket's descriptor (asyncio's transports have no sendmsg)."""
    transport = writer.transport
    while transport.get_write_buffer_size():
        await asyncio.sleep(0.0005)
    sock = socket.socket(fileno=os.dup(transport.get_extra_info("socket").fileno()))
    try:
        while True:
            try:
                sent = sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
                break
            except BlockingIOError:  # the socket's buffer is full: the daemon reads it soon
                await asyncio.sleep(0.0005)
    finally:
        sock.close()
    if sent < len(frame):
        writer.write(frame[sent:])
        await writer.drain()


class _AsyncConnection:
    """tcpxd._local.Connection on asyncio streams: one transfer at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.tag = 0

    async def exchange(self, field: str, req: Any, timeout: Optional[float]) -> Optional[Any]:
        """The daemon's event for the request; None when it is too large for a frame. Raises
        _local.Gone when the connection ended unanswered, asyncio.TimeoutError when `timeout`
        (plus BACKSTOP) passed."""
        self.tag += 1
        frame = _local.request_frame(self.tag, field, req)
        if frame is None:
            return None
        try:
            self.writer.write(frame)
            await self.writer.drain()
        except (BrokenPipeError, ConnectionResetError):
            raise _local.Gone(sent=False) from None
        if timeout is None:
            return await self._receive()
        return await asyncio.wait_for(self._receive(), timeout + _local.BACKSTOP)

    async def _receive(self) -> Any:
        try:
            n = _local.frame_length(await self.reader.readexactly(_local.HEADER.size))
            body = await self.reader.readexactly(n)
        except (asyncio.IncompleteReadError, ConnectionResetError):
            raise _local.Gone(sent=True) from None
        return _proto.message("SessionEvent").FromString(body)

    def close(self) -> None:
        self.writer.close()


async def _handshake(path: str) -> Optional[_AsyncConnection]:
    """tcpxd._local.handshake with asyncio streams."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), _local.HANDSHAKE_TIMEOUT)
    except (OSError, asyncio.TimeoutError):
        return None
    try:
        writer.write(_local.PREFACE)
        got = await asyncio.wait_for(reader.readexactly(len(_local.PREFACE)), _local.HANDSHAKE_TIMEOUT)
    except asyncio.IncompleteReadError as e:
        writer.close()
        raise _local.NotLocal(f"answered {e.partial!r}") from None
    except (OSError, asyncio.TimeoutError) as e:
        writer.close()
        raise _local.NotLocal(f"{type(e).__name__}: {e}") from None
    except BaseException:
        writer.close()
        raise
    if got != _local.PREFACE:
        writer.close()
        raise _local.NotLocal(f"answered {got!r}")
    return _AsyncConnection(reader, writer)


class _AsyncLocalSessions:
    """tcpxd._local.LocalSessions for asyncio: a connection per waited transfer in flight, idle
    ones kept for reuse; a cancelled task closes its connection (the daemon cancels the transfer)."""

    def __init__(self, path: str):
        self.path = path
        self.available: Optional[bool] = None
        self._idle: List[_AsyncConnection] = []
        self._busy: Set[_AsyncConnection] = set()
        self._closed = False

    async def run(self, field: str, req: Any, timeout: Optional[float]) -> Optional[TransferResult]:
        """The transfer's result (or its exception); None when it should go through gRPC."""
        while True:
            conn, reused = self._take(), True
            if conn is None:
                conn, reused = await self._open(), False
                if conn is None:
                    return None
            self._busy.add(conn)
            try:
                ev = await conn.exchange(field, req, timeout)
            except _local.Gone as e:
                self._drop(conn)
                if self._closed:
                    raise Cancelled("the client was closed while the transfer waited") from None
                if not e.sent and reused:
                    continue
                return None
            except asyncio.TimeoutError:
                self._drop(conn)
                raise DeadlineExceeded(
                    f"no answer from the daemon {_local.BACKSTOP} s past the transfer's timeout of {timeout} s "
                    "(the transfer was cancelled)"
                ) from None
            except OSError as e:
                self._drop(conn)
                raise Unavailable(f"local session with {self.path}: {e}") from None
            except BaseException:
                self._drop(conn)  # e.g. the task was cancelled: the daemon cancels the transfer
                raise
            if self._closed or (ev is not None and ev.tag != conn.tag):
                self._drop(conn)  # tag 0: the daemon refused the frame and closes the connection
            else:
                self._busy.discard(conn)
                self._idle.append(conn)
            return None if ev is None else _local.answer(ev, conn.tag)

    def _take(self) -> Optional[_AsyncConnection]:
        while self._idle and not self._closed:
            conn = self._idle.pop()
            if not conn.reader.at_eof():
                return conn
            conn.close()  # the daemon closed it while idle (it restarted)
        return None

    async def _open(self) -> Optional[_AsyncConnection]:
        if self.available is False or self._closed:
            return None
        try:
            conn = await _handshake(self.path)
        except _local.NotLocal:
            self.available = False
            return None
        if conn is not None:
            self.available = True
        return conn

    def _drop(self, conn: _AsyncConnection) -> None:
        self._busy.discard(conn)
        conn.close()

    async def close(self) -> None:
        """Closes every connection: a transfer waiting on one ends Cancelled."""
        self._closed = True
        conns, self._idle = self._idle + list(self._busy), []
        for conn in conns:
            conn.close()
        await asyncio.gather(*(c.writer.wait_closed() for c in conns), return_exceptions=True)


class AsyncClient:
    """tcpxd.Client for asyncio (the same options). Use `async with AsyncClient(...) as c:` or
    `await c.close()`. On the daemon's local session, waited transfers in flight at once each take
    a connection of their own; on gRPC, concurrent ones past the first make unary calls."""

    def __init__(
        self,
        endpoint: Optional[str] = None,
        *,
        token: Optional[str] = None,
        token_file: Optional[str] = None,
        timeout: float = DEFAULT_CALL_TIMEOUT,
        stream: bool = True,
        local: bool = True,
    ):
        self.endpoint = _ops.resolve_endpoint(endpoint)
        self._metadata = _ops.metadata(_ops.resolve_token(self.endpoint, token, token_file))
        self._channel = grpc.aio.insecure_channel(self.endpoint, options=_ops.channel_options())
        self.timeout = timeout
        self._stubs: Dict[str, Any] = {}
        self._own = _AsyncOwnStream(self) if stream and _proto.has_method("Session") else None
        path = _local.socket_path(self.endpoint) if local else None
        self._local: Optional[_AsyncLocalSessions] = _AsyncLocalSessions(path) if path else None
        #: Sessions on the local session (closing the client ends them, as closing the channel ends gRPC's).
        self._sessions: "weakref.WeakSet[AsyncSession]" = weakref.WeakSet()
        unix = _local.socket_path(self.endpoint)
        #: Registers host memory this process shares (blocking: run in a thread).
        self._registrar: Optional[_hostmem.Registrar] = _hostmem.Registrar(unix, self._local) if unix else None

    def _stub(self, name: str, kind: str) -> Any:
        s = self._stubs.get(name)
        if s is None:
            s = getattr(self._channel, kind)(_proto.path(name), **_proto.codecs(name))
            self._stubs[name] = s
        return s

    async def _unary(self, name: str, req: Any, timeout: Optional[float] = -1.0) -> Any:
        t = self.timeout if timeout == -1.0 else timeout
        try:
            return await self._stub(name, "unary_unary")(req, timeout=t, metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, self.endpoint) from None

    def _waited_path(self) -> str:
        """How waited transfers go (after the first one): "local session", "own stream" or "unary"."""
        if self._local is not None and self._local.available:
            return "local session"
        return "own stream" if self._own is not None and not self._own._closed else "unary"

    async def close(self) -> None:
        for session in list(self._sessions):
            session._abort("client closed")
        if self._registrar is not None:
            self._registrar.close()  # the daemon releases the host memory this client shared
        if self._local is not None:
            await self._local.close()
        if self._own is not None:
            self._own.close()
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- buffers

    async def register_host(
        self, memory: Any, label: str = "", *, fd: Optional[int] = None, shared: Optional[bool] = None
    ) -> AsyncBuffer:
        """As Client.register_host (the descriptor passing runs in a thread of the default executor)."""
        if not _hostmem.daemon_allocates(memory, shared, self._registrar):
            got = await asyncio.get_running_loop().run_in_executor(
                None, _hostmem.register, self._registrar, self.endpoint, memory, label, fd, self.timeout, shared
            )
            if got is not None:
                return AsyncBuffer(self, got[0], keepalive=got[1], host=got[1])
        return AsyncBuffer(self, await self._unary("RegisterBuffer", _ops.host_register(memory, label)))

    async def allocate_cuda(self, size: int, device: int = 0, label: str = "") -> AsyncBuffer:
        return AsyncBuffer(self, await self._unary("RegisterBuffer", _ops.cuda_register(size, device, label)))

    async def register_cuda_ipc(
        self, ipc_handle: bytes, size: int, *, offset: int = 0, device: int = 0, label: str = ""
    ) -> AsyncBuffer:
        msg = await self._unary("RegisterBuffer", _ops.ipc_register(ipc_handle, offset, size, device, label))
        return AsyncBuffer(self, msg)

    async def register_tensor(self, tensor: Any, label: str = "") -> AsyncBuffer:
        device, handle, offset, size = _tensor.cuda_ipc_view(tensor)
        msg = await self._unary("RegisterBuffer", _ops.ipc_register(handle, offset, size, device, label))
        return AsyncBuffer(self, msg, keepalive=tensor)

    async def register_blocks(
        self, buffer: BufferLike, offsets: Any = None, lengths: Any = None, *, block_size: Optional[int] = None
    ) -> AsyncBlockList:
        """As tcpxd.Client.register_blocks."""
        offsets = _blocks.tiling(buffer, offsets, block_size)
        req = _blocks.register_request(buffer, offsets, lengths, block_size)
        return AsyncBlockList(self, await self._unary("RegisterBlocks", req))

    async def list_buffers(self) -> List[Any]:
        return list((await self._unary("ListBuffers", _proto.message("ListBuffersRequest")())).buffers)

    # -- peers and node

    async def connect_peer(self, address: str) -> Any:
        return await self._unary("ConnectPeer", _proto.message("ConnectPeerRequest")(address=address))

    async def list_peers(self) -> List[Any]:
        return list((await self._unary("ListPeers", _proto.message("ListPeersRequest")())).peers)

    async def describe_node(self) -> NodeInfo:
        return _ops.node_info(await self._unary("DescribeNode", _proto.message("DescribeNodeRequest")()))

    async def stats(self) -> Any:
        return await self._unary("GetStats", _proto.message("GetStatsRequest")())

    # -- transfers

    async def _start(self, name: str, req: Any, timeout: Optional[float], wait: bool) -> Any:
        # `wait` means nothing in a session; the request's `timeout_ms` is its deadline there.
        if wait and self._local is not None:
            r = await self._local.run(SESSION_FIELD[name], req, timeout)
            if r is not None:
                return r
        if wait and timeout is None and self._own is not None:
            r = await self._own.run(SESSION_FIELD[name], req)
            if r is not None:
                return r
        t = AsyncTransfer(self, await self._unary(name, req, timeout=timeout))
        return await t.result() if wait else t

    async def write(
        self,
        local: BufferLike,
        remote: RemoteLike,
        length: Optional[int] = None,
        *,
        local_offset: int = 0,
        remote_offset: int = 0,
        notification: bytes = b"",
        ready_event: Any = None,
        timeout: Optional[float] = None,
        wait: bool = True,
    ) -> Any:
        req = _ops.write_request(WriteOp(local, remote, length, local_offset, remote_offset), notification, ready_event, timeout, wait)
        return await self._start("Write", req, timeout, wait)

    async def read(
        self,
        remote: RemoteLike,
        local: BufferLike,
        length: Optional[int] = None,
        *,
        remote_offset: int = 0,
        local_offset: int = 0,
        timeout: Optional[float] = None,
        wait: bool = True,
    ) -> Any:
        req = _ops.read_request(ReadOp(remote, local, length, remote_offset, local_offset), timeout, wait)
        return await self._start("Read", req, timeout, wait)

    async def write_batch(
        self,
        ops: Sequence[WriteOp],
        *,
        notification: bytes = b"",
        ready_event: Any = None,
        timeout: Optional[float] = None,
        wait: bool = True,
    ) -> Any:
        req = _ops.write_batch_request(ops, notification, ready_event, timeout, wait)
        return await self._start("WriteBatch", req, timeout, wait)

    async def read_batch(self, ops: Sequence[ReadOp], *, timeout: Optional[float] = None, wait: bool = True) -> Any:
        return await self._start("ReadBatch", _ops.read_batch_request(ops, timeout, wait), timeout, wait)

    async def write_blocks(
        self,
        local_list: Any,
        local_idx: Any,
        remote: Any,
        remote_idx: Any,
        *,
        notification: bytes = b"",
        ready_event: Any = None,
        timeout: Optional[float] = None,
        wait: bool = True,
    ) -> Any:
        """As tcpxd.Client.write_blocks."""
        req = _blocks.write_request(local_list, local_idx, remote, remote_idx, notification, ready_event, timeout, wait)
        return await self._start("WriteBlocks", req, timeout, wait)

    async def read_blocks(
        self,
        local_list: Any,
        local_idx: Any,
        remote: Any,
        remote_idx: Any,
        *,
        timeout: Optional[float] = None,
        wait: bool = True,
    ) -> Any:
        """As tcpxd.Client.read_blocks."""
        req = _blocks.read_request(local_list, local_idx, remote, remote_idx, timeout, wait)
        return await self._start("ReadBlocks", req, timeout, wait)

    async def prepare_blocks(self, lists: Any, entries: Any) -> AsyncPreparedList:
        """As tcpxd.Client.prepare_blocks."""
        return AsyncPreparedList(self, await self._unary("PrepareBlocks", _blocks.prepare_request(lists, entries)))

    async def _release_prepared(self, prepared_id: int) -> None:
        await self._unary("ReleasePrepared", _proto.message("ReleasePreparedRequest")(prepared_id=prepared_id))

    async def write_prepared(
        self,
        local: Any,
        local_idx: Any,
        remote: Any,
        remote_idx: Any,
        *,
        notification: bytes = b"",
        timeout: Optional[float] = None,
        wait: bool = True,
    ) -> Any:
        """As tcpxd.Client.write_prepared."""
        req = _blocks.prepared_request("WRITE", local, local_idx, remote, remote_idx, notification, timeout, wait)
        return await self._start("WritePrepared", req, timeout, wait)

    async def read_prepared(
        self,
        local: Any,
        local_idx: Any,
        remote: Any,
        remote_idx: Any,
        *,
        notification: bytes = b"",
        timeout: Optional[float] = None,
        wait: bool = True,
    ) -> Any:
        """As tcpxd.Client.read_prepared."""
        req = _blocks.prepared_request("READ", local, local_idx, remote, remote_idx, notification, timeout, wait)
        return await self._start("ReadPrepared", req, timeout, wait)

    async def cancel(self, transfer_id: int) -> bool:
        return (await self._unary("Cancel", _proto.message("CancelRequest")(transfer_id=transfer_id))).cancelled

    def session(self, timeout: Optional[float] = None) -> AsyncSession:
        """Call inside a running event loop."""
        return AsyncSession(self, timeout)

    async def subscribe(self) -> AsyncSubscription:
        call = self._stub("Subscribe", "unary_stream")(_proto.message("SubscribeRequest")(), metadata=self._metadata)
        try:
            await call.initial_metadata()
        except grpc.RpcError as e:
            raise from_rpc_error(e, self.endpoint) from None
        return AsyncSubscription(call)
