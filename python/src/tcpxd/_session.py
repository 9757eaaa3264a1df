"""The synchronous client's streams of the `Session` RPC.

`Session`: many transfers in flight on one stream, each a concurrent.futures.Future that a reader
thread resolves. On the daemon's local session its requests are framed here: `_submit_encoded` and
`_submit_frame` take bodies already serialized (tcpxd.nixl encodes in bulk) and send every frame's
pieces as they are, in one sendmsg (`_send_pieces`), so large bodies are not copied again;
`_submit_joined` takes a body in pieces and joins it with its frame header in one C call
(`_native.frame`, where the package's C pass is built).

`_OwnStream` (tcpxd._own_stream, re-exported here): the client's own stream for its waited
transfers, one at a time on the caller's thread (a segregated call of grpcio's cygrpc layer, no
helper threads).

tcpxd.client re-exports these names (the same objects: patching one patches what the client uses).
"""

from __future__ import annotations

import concurrent.futures
from array import array
import functools
import itertools
import queue
import select
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple, cast

import grpc

from . import _blocks, _board, _hostmem, _local, _ops, _proto, _ring
from ._handles import Buffer, PreparedList
from ._local import local_end, too_large
from ._native_gate import native as _native
from ._own_stream import _OP, _OwnStream  # noqa: F401 (re-exported, as tcpxd.client imports them from here)
from ._requests import SessionRequests
from ._ops import TransferResult, settle
from .errors import Cancelled, FailedPrecondition, ResourceExhausted, TcpxdError, Unavailable, from_rpc_error, from_status

if TYPE_CHECKING:
    from .client import Client

    class _TaggedFuture(concurrent.futures.Future[Any]):
        """What Session._submit returns: a Future carrying its request's tag (for cancel)."""

        tag: int



class _SessionFuture(concurrent.futures.Future):
    """A session request's future, resolved in the thread that looks at it (`done()`, `result()`)
    when that thread can read the session's connection (`Session.poll`, `Session._wait`): a
    caller polling or waiting does not wait for the reader thread to be given the GIL."""

    def __init__(self, session: "Session"):
        super().__init__()
        self._session = session

    def done(self) -> bool:
        if not super().done():
            self._session.poll()
        return super().done()

    def result(self, timeout: Optional[float] = None) -> Any:
        if not super().done():
            self._session._wait(self, timeout)
        return super().result(timeout)

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        if not super().done():
            self._session._wait(self, timeout)
        return super().exception(timeout)



_SMALL_VARINTS = [bytes([i]) for i in range(128)]

#: A local session frame joined in one C call (`_native.frame`), where the C pass is built.
_frame = _native.frame if _native is not None else None


def _varint(v: int) -> bytes:
    """A varint: one step for values below 2**21 (a session's tags and small bodies' lengths)."""
    if v < 128:
        return _SMALL_VARINTS[v]
    if v < 16384:
        return bytes((v & 0x7F | 0x80, v >> 7))
    if v < 2097152:
        return bytes((v & 0x7F | 0x80, (v >> 7) & 0x7F | 0x80, v >> 14))
    out = bytearray()
    while v > 0x7F:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


@functools.lru_cache(maxsize=None)
def _field_key(field: str) -> bytes:
    """The key byte(s) of a length-delimited field of SessionRequest."""
    num = _proto.message("SessionRequest").DESCRIPTOR.fields_by_name[field].number
    return _varint((num << 3) | 2)


def _forward(sink: Any, fut: concurrent.futures.Future) -> None:
    if fut.cancelled():
        sink.set_exception(Cancelled("the transfer was cancelled"))
    elif fut.exception() is not None:
        sink.set_exception(fut.exception())
    else:
        sink.set_result(fut.result())


def _send_pieces(sock: socket.socket, pieces: List[Any], total: int) -> None:
    """Sends the pieces (bytes-like, `total` bytes together) in order without joining them first
    (large bodies are not copied again): one sendmsg, resumed where a partial send stopped."""
    if len(pieces) <= 1024:  # IOV_MAX
        sent = sock.sendmsg(pieces)
        if sent == total:
            return
    else:
        sent = 0
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    while views:
        while sent:
            n = views[0].nbytes
            if sent >= n:
                sent -= n
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0
        if views:
            sent = sock.sendmsg(views[:1024])


def _body_size(body: Any) -> int:
    """The bytes of a body: bytes, or a list of pieces (bytes or byte views)."""
    return len(body) if isinstance(body, bytes) else sum(map(len, body))


#: The largest body `Session._submit_frame` frames itself (joined with its header: one copy;
#: tcpxd.nixl's outer sums, a few KiB, included).
_FRAME_ONE = 32768

#: How long a closing client waits for an aborted session's reader before it closes the session's
#: connection (longer, and the connection is left to the session: its reader may still use it).
RELEASE_WAIT_S = 5.0

#: While a caller has polled a session (`poll()`, a future's `done()` or `result()`) within this
#: long, the session's reader thread leaves its connection to that caller: it sleeps instead of
#: waiting on the socket, so an event does not wake it just when the polling thread is about to
#: read that event itself (the reader would then want the GIL the polling thread holds, and the
#: two hand it back and forth: on the 2-core VM that doubled a tight check_xfer_state loop's wait).
#: What no one polls for is read at most this late after the last poll. 0: the reader always waits
#: on the socket (as before session 21). Where the C pass is built, the reader sleeps through the
#: caller's polling without the GIL (`_native.quiet_wait`): it takes the GIL only once the caller
#: has stopped polling, not every READER_QUIET_S (each time forcing the polling thread to hand the
#: GIL over and wait two thread wake-ups for it back: session 27, the tight loop's p99).
READER_QUIET_S = 0.002

#: The send buffer asked for a session's local-session socket (the kernel caps it at wmem_max):
#: requests written at once are not held up while the daemon starts the earlier ones.
SESSION_SNDBUF = 4 << 20


class Session(SessionRequests["concurrent.futures.Future[TransferResult]"]):
    """Many transfers in flight on one stream: each submit returns a concurrent.futures.Future
    resolved when that transfer finishes, in completion order. `close()` (or leaving the `with`
    block) waits for the unfinished ones; leaving it by an exception cancels them.

    On a unix endpoint whose daemon speaks it (the client's `local` rules), the stream is a
    connection of the daemon's local session of its own (tcpxd._local: the Session RPC framed
    plainly, no gRPC); else the `Session` RPC. Either way a reader thread resolves the futures."""

    #: Why the client ended it ("cancelled", "expired", "client closed"), on the local session.
    _why: Optional[str] = None
    #: When a caller last polled or waited (time.monotonic(), in [0]): the reader thread stays
    #: quiet for READER_QUIET_S after it. A buffer, not an attribute: the C pass's quiet_wait
    #: reads it without the GIL. Made in __init__.
    _polled: "array[float]"
    #: wait_readable's poll objects, one a thread (made on first use).
    _ready_polls: Any = None
    #: The local session's completion board (tcpxd._board), where the daemon gives it one: a poll
    #: or a wait reads the OK ends of transfers there before it looks at the socket.
    _board: Optional[_board.Board] = None

    def __init__(self, client: "Client", timeout: Optional[float]):
        self._polled = array("d", [0.0])
        self._client = client
        self._pending: Dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._tags = itertools.count(1)
        self._closed = False
        self._ended: Optional[TcpxdError] = None  # what unfinished futures got once the stream ended
        self._timeout = timeout
        self._conn = client._local.connect() if client._local is not None else None
        if self._conn is not None:
            try:
                self._board = _board.attach(self._conn, _local.HANDSHAKE_TIMEOUT)
                if self._board is not None:  # its request ring where the board is (tcpxd._ring)
                    self._conn.ring = _ring.attach(self._conn, _local.HANDSHAKE_TIMEOUT)
            except (_local.Gone, OSError):
                pass  # the connection failed: the reader finds it so and ends the session
            try:  # room for a burst of requests (tcpxd.nixl posts a transfer's parts in one write)
                self._conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SESSION_SNDBUF)
            except OSError:
                pass
            client._sessions.add(self)
            self._call: Any = None
            self._send_lock = threading.Lock()
            #: What the daemon sent, read by whichever thread holds `_read_lock` (the reader
            #: thread, or a caller polling: `poll()`), and why the reading ended (`_read_end`).
            self._read_lock = threading.Lock()
            self._read_end: Optional[Tuple[Optional[TcpxdError]]] = None
            self._why = None
            self._timer: Optional[threading.Timer] = None
            if timeout is not None:
                self._timer = threading.Timer(timeout, self._abort, ("expired",))
                self._timer.daemon = True
                self._timer.start()
            target = self._read_local
        else:
            self._q: "queue.Queue[Any]" = queue.Queue()
            self._call = client._stream_stream("Session", self._requests(), timeout=timeout)
            target = self._read
        self._reader = threading.Thread(target=target, name="tcpxd-session", daemon=True)
        self._reader.start()

    @property
    def path(self) -> str:
        """How the session reaches the daemon: "local session" or "grpc"."""
        return "local session" if self._conn is not None else "grpc"

    def _requests(self) -> Iterator[Any]:
        while True:
            item = self._q.get()
            if item is None:
                return
            yield item

    def _packs(self, ops: Sequence[Any]) -> bool:
        return self._client._packs(ops)

    def _submit(self, _fd: Optional[int] = None, **op: Any) -> _TaggedFuture:
        if self._closed:
            raise TcpxdError("the session is closed")
        fut = cast("_TaggedFuture", _SessionFuture(self) if self._conn is not None else concurrent.futures.Future())
        with self._lock:
            tag = next(self._tags)
            ended = self._ended
            if ended is None:
                self._pending[tag] = fut
        fut.tag = tag
        msg = _proto.message("SessionRequest")(tag=tag, **op)
        if ended is not None:  # the stream had ended: nothing would answer
            fut.set_exception(ended)
        elif self._conn is None:
            self._q.put(msg)
        else:
            self._send(tag, fut, msg, _fd)
        return fut

    def _submit_encoded(self, field: str, bodies: Sequence[Any], sinks: Sequence[Any]) -> None:
        """Submits requests already serialized: `bodies[i]`, the bytes of the message in `field`
        of a SessionRequest (or a list of pieces, bytes or byte views, whose concatenation they
        are), resolved through `sinks[i]` (anything with set_result/set_exception, as a Future;
        its `tag` is set here, for cancel). On the local session every frame goes in one sendmsg,
        the pieces as they are; over gRPC each is parsed and queued. For callers that encode in
        bulk (tcpxd.nixl)."""
        if self._closed:
            raise TcpxdError("the session is closed")
        if self._conn is None:
            cls = type(getattr(_proto.message("SessionRequest")(), field))
            for body, sink in zip(bodies, sinks):
                data = body if isinstance(body, bytes) else b"".join(body)
                fut = self._submit(**{field: cls.FromString(data)})
                sink.tag = fut.tag
                fut.add_done_callback(functools.partial(_forward, sink))
            return
        key = _field_key(field)
        if len(bodies) == 1:  # one request (tcpxd.nixl's prepared path): one frame, its pieces joined when small
            self._submit_one(key, bodies[0], sinks[0])
            return
        pieces: List[Any] = []  # every frame's pieces, sent as they are
        total = 0
        big = False
        pack = _local.HEADER.pack
        with self._lock:
            ended = self._ended
            for body, sink in zip(bodies, sinks):
                tag = next(self._tags)
                sink.tag = tag
                if ended is None:
                    self._pending[tag] = sink
                    whole = isinstance(body, bytes)
                    blen = len(body) if whole else _body_size(body)
                    t, n = _varint(tag), _varint(blen)
                    size = 1 + len(t) + len(key) + len(n) + blen
                    big = big or size > _local.MAX_FRAME
                    pieces.append(pack(size) + b"\x08" + t + key + n)
                    if whole:
                        pieces.append(body)
                    else:
                        pieces += body
                    total += _local.HEADER.size + size
        if ended is not None:
            for sink in sinks:
                sink.set_exception(ended)
            return
        if big:
            with self._lock:
                for sink in sinks:
                    self._pending.pop(sink.tag, None)
            for body, sink in zip(bodies, sinks):
                sink.set_exception(ResourceExhausted(
                    f"session request: {_body_size(body)} bytes is over the local session's {_local.MAX_FRAME}-byte frame limit"))
            return
        with self._send_lock:
            try:
                _send_pieces(self._conn.sock, pieces, total)
                self._counted(len(bodies))
            except OSError:
                pass  # the connection ended: the reader fails the pending futures

    def _submit_frame(self, field: str, body: bytes, sink: Any) -> None:
        """`_submit_encoded` of one body serialized whole (tcpxd.nixl's prepared path, a hundred
        bytes or so): on the local session one frame, its header made in one step, one send; else
        the general way."""
        if self._closed:
            raise TcpxdError("the session is closed")
        if self._conn is None or len(body) > _FRAME_ONE:
            self._submit_encoded(field, [body], [sink])
            return
        tag = self._enlist(sink)
        if tag is None:
            return
        blen = len(body)
        head = b"\x08" + _varint(tag) + _field_key(field) + (_SMALL_VARINTS[blen] if blen < 128 else _varint(blen))
        size = len(head) + blen
        with self._send_lock:
            try:
                if blen < 1024:
                    self._sendall(_local.HEADER.pack(size) + head + body)
                else:  # (a few KiB of outer sums: the body goes as it is, not copied again)
                    _send_pieces(self._conn.sock, [_local.HEADER.pack(size) + head, body], 4 + size)
                    self._counted(1)
            except OSError:
                pass  # the connection ended: the reader fails the pending futures

    def _submit_joined(self, field: str, key: bytes, pieces: Tuple[bytes, ...], sink: Any) -> None:
        """`_submit_frame` of a body given as `pieces` (bytes) whose concatenation it is, `key`
        its field's key bytes (`_field_key(field)`): on the local session with the C pass built,
        tag, frame header and pieces joined in one call (`_native.frame`) and sent in one send;
        else as `_submit_frame`."""
        conn = self._conn
        if conn is None or _frame is None or self._closed:
            self._submit_frame(field, b"".join(pieces), sink)
            return
        tag = self._enlist(sink)
        if tag is None:
            return
        frame = _frame(tag, key, *pieces)
        if len(frame) > _local.MAX_FRAME:
            self._oversized(tag, sink, len(frame) - _local.HEADER.size)
            return
        with self._send_lock:
            try:
                self._sendall(frame)
            except OSError:
                pass  # the connection ended: the reader fails the pending futures

    def _oversized(self, tag: int, sink: Any, blen: int) -> None:
        """A request of `blen` bytes, past the local session's frame limit: no longer pending,
        its sink failed with why (nothing was sent)."""
        with self._lock:
            self._pending.pop(tag, None)
        sink.set_exception(ResourceExhausted(
            f"session request: {blen} bytes is over the local session's {_local.MAX_FRAME}-byte frame limit"))

    def _enlist(self, sink: Any) -> Optional[int]:
        """Gives `sink` its tag and makes it pending, so the reader resolves it; None when the
        session has ended (the sink is failed with why)."""
        with self._lock:
            tag = sink.tag = next(self._tags)
            ended = self._ended
            if ended is None:
                self._pending[tag] = sink
        if ended is not None:
            sink.set_exception(ended)
            return None
        return tag

    def _submit_one(self, key: bytes, body: Any, sink: Any) -> None:
        """`_submit_encoded` of one body on the local session."""
        blen = len(body) if type(body) is bytes else _body_size(body)
        tag = self._enlist(sink)
        if tag is None:
            return
        t, n = _varint(tag), _varint(blen)
        size = 1 + len(t) + len(key) + len(n) + blen
        if size > _local.MAX_FRAME:
            self._oversized(tag, sink, blen)
            return
        head = _local.HEADER.pack(size) + b"\x08" + t + key + n
        if type(body) is bytes:
            pieces = [head + body] if blen <= 4096 else [head, body]
        elif len(body) == 1 and type(body[0]) is bytes and blen <= 4096:
            pieces = [head + body[0]]
        else:
            pieces = [head, *body]
        with self._send_lock:
            try:
                if len(pieces) == 1:
                    self._sendall(pieces[0])
                else:
                    _send_pieces(self._conn.sock, pieces, _local.HEADER.size + size)  # type: ignore[union-attr]
                    self._counted(1)
            except OSError:
                pass  # the connection ended: the reader fails the pending futures

    def _send(self, tag: int, fut: concurrent.futures.Future, msg: Any, fd: Optional[int] = None) -> None:
        frame = _local.frame(msg)
        if frame is None:
            with self._lock:
                self._pending.pop(tag, None)
            fut.set_exception(too_large(msg))
            return
        with self._send_lock:
            try:
                if fd is None:
                    self._sendall(frame)
                else:
                    _local.send_with_fd(self._conn.sock, frame, fd)  # type: ignore[union-attr]
                    self._counted(1)
            except OSError:
                pass  # the connection ended: the reader fails the pending futures

    def _sendall(self, frame: bytes) -> None:
        """Sends one frame (the send lock held): on the connection's request ring when it takes it
        (the doorbell rung where the daemon's poller may be parked), else on the socket, counted
        (tcpxd._ring)."""
        conn = self._conn
        assert conn is not None
        ring = conn.ring
        if ring is None:
            conn.sock.sendall(frame)
            return
        bell = ring.put(frame)
        if bell is None:
            conn.sock.sendall(frame)
            ring.sent += 1
        elif bell:
            conn.sock.sendall(_ring.DOORBELL)

    def _counted(self, frames: int) -> None:
        """`frames` went on the socket (the send lock held): counted for the request ring's order."""
        ring = self._conn.ring if self._conn is not None else None
        if ring is not None:
            ring.sent += frames

    def prepare_blocks(self, lists: Any, entries: Any) -> PreparedList:
        """As Client.prepare_blocks, on this session: the list goes with the session. Waits for
        the daemon's answer."""
        return PreparedList(self, self._submit(prepare_blocks=_blocks.prepare_request(lists, entries)).result())

    def _release_prepared(self, prepared_id: int) -> None:
        self._submit(release_prepared=prepared_id).result()

    def write_prepared(
        self, local: Any, local_idx: Any, remote: Any, remote_idx: Any, *, notification: bytes = b"", timeout: Optional[float] = None
    ) -> "concurrent.futures.Future[TransferResult]":
        """As Client.write_prepared, in this session."""
        req = _blocks.prepared_request("WRITE", local, local_idx, remote, remote_idx, notification, timeout, False)
        return self._submit(write_prepared=req)

    def read_prepared(
        self, local: Any, local_idx: Any, remote: Any, remote_idx: Any, *, notification: bytes = b"", timeout: Optional[float] = None
    ) -> "concurrent.futures.Future[TransferResult]":
        """As Client.read_prepared, in this session."""
        req = _blocks.prepared_request("READ", local, local_idx, remote, remote_idx, notification, timeout, False)
        return self._submit(read_prepared=req)

    def register_host(self, memory: Any, label: str = "", *, fd: Optional[int] = None) -> Buffer:
        """As Client.register_host, on this session's connection: the buffer belongs to the session
        and is released when it ends (or by `release()`). Waits for the daemon's answer. Needs the
        local session (a unix endpoint): a gRPC stream cannot carry the descriptor."""
        if self._conn is None:
            if self._client._registrar is None:
                raise _hostmem.no_unix_socket(self._client.endpoint)
            raise FailedPrecondition(
                "register_host: this session runs over gRPC (local=False, or a daemon without the local session), "
                "which cannot carry a file descriptor; register with Client.register_host instead"
            )
        mem = _hostmem.prepare(memory, label, fd)
        host = _hostmem.HostMemory(mem)
        try:
            fut = self._submit(mem.sent_fd, **mem.session_op(label))
        finally:
            mem.done_sending()
        return Buffer(self._client, fut.result(), keepalive=host, host=host)

    def cancel(self, fut: concurrent.futures.Future) -> "concurrent.futures.Future[bool]":
        """Cancels the transfer behind `fut` (it then fails with tcpxd.Cancelled); the returned
        future gives True, or fails with tcpxd.FailedPrecondition when the transfer had already
        finished (nothing changes)."""
        return self._submit(cancel_tag=fut.tag)  # type: ignore[attr-defined]

    def _wanted(self, tag: int, _field: int) -> bool:
        """`ready`'s `keep`: an event whose tag is no longer pending (an end the board gave, a
        request that failed to send) would be dropped by `_dispatch`: it is skipped undecoded.
        Tag 0 (a refused frame: the session's end) always decoded."""
        return tag == 0 or tag in self._pending

    def _dispatch(self, ev: Any) -> None:
        board = self._board
        with self._lock:
            fut = self._pending.pop(ev.tag, None)
            if fut is not None and board is not None:
                board.forget(ev.tag)  # (an end published there too: its slot is free again)
        if fut is not None:
            settle(fut, ev)

    def _from_board(self, new: int) -> bool:
        """Settles the pending requests whose OK end the board holds (`_board.settle`); whether
        it settled any. Their events, read later, find nothing pending and are dropped."""
        assert self._board is not None
        return _board.settle(self._board, self._lock, self._pending, new)

    def _end(self, err: TcpxdError) -> None:
        with self._lock:
            left, self._pending = self._pending, {}
            self._ended = err
        for fut in left.values():
            fut.set_exception(err)

    def _read(self) -> None:
        try:
            for ev in self._call:
                self._dispatch(ev)
            err: TcpxdError = TcpxdError("the session ended with transfers unfinished")
        except grpc.RpcError as e:
            err = from_rpc_error(e, self._client.endpoint)
        self._end(err)

    def _read_local(self) -> None:
        """The reader thread: waits (without the GIL) until the connection has something, then
        reads what is there as `poll()` does; a caller polling may have read it first."""
        conn = self._conn
        assert conn is not None
        waiter = select.poll()
        waiter.register(conn.sock.fileno(), select.POLLIN)
        polled = self._polled
        quiet_wait = getattr(_native, "quiet_wait", None)  # (None: not built, or built before it)
        while self._read_end is None:
            quiet = polled[0] + READER_QUIET_S - time.monotonic()
            if quiet > 0:  # a caller polls: it reads the connection itself
                if quiet_wait is not None:
                    quiet_wait(polled, READER_QUIET_S)  # (until it stops polling; no GIL till then)
                else:
                    time.sleep(quiet)
                continue
            try:
                waiter.poll()
            except InterruptedError:
                continue
            if polled[0] + READER_QUIET_S > time.monotonic():
                continue  # a caller polls (began while this waited): it reads what came
            with self._read_lock:
                if self._read_end is None:
                    self._drain(True)
        conn.shutdown()
        self._end(local_end(self._read_end[0], self._why, self._closed, self._client.endpoint, self._timeout))

    def poll(self, readable: bool = False) -> None:
        """Reads what the daemon has sent on this session, without blocking, and resolves the
        futures it finishes in the calling thread (nothing when another thread is reading): a
        caller polling a transfer learns it finished without waiting for the reader thread, which
        would need the GIL the polling loop holds. `readable`: `wait_readable` just found
        something there (read without looking first). gRPC sessions: nothing (their reader
        resolves)."""
        lock = getattr(self, "_read_lock", None)
        self._polled[0] = time.monotonic()
        board = self._board
        if board is not None and (new := board.news()) and self._from_board(new) and not readable:
            # (the socket's copy of those ends is read by a later poll, and dropped; a caller that
            # waited for the socket reads it now: it is there, and a wait must not wake for it)
            return
        if lock is not None and self._read_end is None and lock.acquire(blocking=False):
            try:
                if self._read_end is None:
                    self._drain(readable)
                    if self._read_end is not None:
                        self._conn.shutdown()  # (the reader thread ends the session)
            finally:
                lock.release()

    def wait_readable(self, ms: int) -> bool:
        """Waits until the daemon has sent something on this session (or `ms` passed), the GIL
        released; at once on a gRPC session. For a loop polling without a pause (tcpxd.nixl's
        check_xfer_state): the CPU it would spin on goes to the daemons, and `poll()` after it
        reads what came (the reader thread stays quiet meanwhile: READER_QUIET_S). Whether
        something came (`poll(readable=...)`)."""
        if self._conn is None or self._read_end is not None:
            return False
        self._polled[0] = time.monotonic()
        mine = self._ready_polls
        if mine is None:
            mine = self._ready_polls = threading.local()
        waiter = getattr(mine, "poll", None)
        if waiter is None:  # (a poll object is not for two threads at once: one a thread)
            waiter = mine.poll = select.poll()
            waiter.register(self._conn.sock.fileno(), select.POLLIN)
        try:
            return bool(waiter.poll(ms))
        except InterruptedError:
            return False

    def _wait(self, fut: concurrent.futures.Future, timeout: Optional[float]) -> None:
        """Waits until `fut` is done (or `timeout` passed), reading the connection in this thread
        while no other thread is (the GIL released while it waits for the connection), else
        waiting for the one that is."""
        lock = self._read_lock
        deadline = None if timeout is None else time.monotonic() + timeout
        waiter: Optional[Any] = None
        board = self._board
        while not concurrent.futures.Future.done(fut) and self._read_end is None:
            if board is not None and (new := board.news()) and self._from_board(new):
                continue
            self._polled[0] = now = time.monotonic()
            left = None if deadline is None else deadline - now
            if left is not None and left <= 0:
                return
            if lock.acquire(blocking=False):
                try:
                    if self._read_end is None:
                        self._drain()
                    if concurrent.futures.Future.done(fut) or self._read_end is not None:
                        if self._read_end is not None:
                            self._conn.shutdown()  # (the reader thread ends the session)
                        return
                finally:
                    lock.release()
                if waiter is None:
                    waiter = select.poll()
                    waiter.register(self._conn.sock.fileno(), select.POLLIN)  # type: ignore[union-attr]
                ms = 50 if left is None else max(0, min(50, int(left * 1000) + 1))
                try:
                    waiter.poll(ms)  # (bounded: the reader thread may take what arrives)
                except InterruptedError:
                    pass
            else:  # the reader thread is reading: it resolves the future
                concurrent.futures.wait([fut], timeout=0.001 if left is None else min(left, 0.001))

    def _drain(self, readable: bool = False) -> None:
        """Reads what the connection holds, without blocking, and dispatches each whole event in
        order; sets `_read_end` at the connection's end or a refusal. Called under `_read_lock`.
        `readable`: a poll just found the connection readable (`Connection.ready`)."""
        try:
            # (with a board, the ends it gave are skipped undecoded; without, every event is wanted)
            events = self._conn.ready(readable, None if self._board is None else self._wanted)  # type: ignore[union-attr]
        except _local.Gone:
            self._read_end = (None,)
            return
        except OSError as e:
            self._read_end = (Unavailable(f"local session with {self._client.endpoint}: {e}"),)
            return
        except TcpxdError as e:  # (a frame over the limit: not this protocol)
            self._read_end = (e,)
            return
        for ev in events:
            if ev.tag == 0 and ev.WhichOneof("event") == "refused":  # the daemon refused a frame
                self._read_end = (from_status(ev.refused.code, ev.refused.message),)
                return
            self._dispatch(ev)

    def _abort(self, why: str) -> None:
        """Ends the connection: the daemon cancels what is in flight; the futures fail (`why`)."""
        if self._why is None:
            self._why = why
        if self._conn is None:  # on gRPC (the local session could not be reached when it opened)
            self._call.cancel()
            return
        self._conn.shutdown()  # wakes the reader, which closes nothing

    def _release(self) -> None:
        """After `_abort` (its client closed): waits for the reader, which the abort woke, and
        closes the connection; as `close()` would, which may follow. Nothing on the reader's own
        thread (a future's callback closing the client): the connection goes with the session."""
        if self._reader is threading.current_thread():
            return
        self._reader.join(RELEASE_WAIT_S)
        if self._reader.is_alive():  # (still in a future's callback: it may use the connection)
            return
        if self._conn is not None:
            if self._timer is not None:
                self._timer.cancel()
            self._conn.close()
            if self._board is not None:
                self._board.close()

    def close(self) -> None:
        """Half-closes the stream: the daemon finishes what is in flight, then the stream ends."""
        if not self._closed:
            self._closed = True
            if self._conn is None:
                self._q.put(None)
            else:
                with self._send_lock:
                    self._conn.half_close()
        self._reader.join()
        if self._conn is not None:
            if self._timer is not None:
                self._timer.cancel()
            self._conn.close()  # the reader has ended: the descriptor is not in use
            if self._board is not None:
                self._board.close()  # (a poll after this finds nothing there)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:  # the caller failed: cancel the in-flight transfers
            if self._conn is None:
                self._call.cancel()
            else:
                self._abort("cancelled")
        self.close()
