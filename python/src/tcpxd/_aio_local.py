"""The daemon's local session on asyncio streams: tcpxd._local's connection, handshake and pool
(a connection per waited transfer in flight) for the asyncio client, and `send_with_fd` for an
`AsyncSession`'s registrations. The frames and their rules stay in tcpxd._local, which both
clients share. tcpxd.aio re-exports these names."""

from __future__ import annotations

import array
import asyncio
import os
import socket
from typing import Any, List, Optional, Set

from . import _local, _proto
from ._ops import TransferResult
from .errors import Cancelled, DeadlineExceeded, Unavailable


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

    async def closed(self) -> None:
        """Once `close()` (or an abort of its transport) has closed the socket."""
        try:
            await self.writer.wait_closed()
        except OSError:
            pass


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
        await asyncio.gather(*(c.closed() for c in conns))
