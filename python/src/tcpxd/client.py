"""The synchronous client."""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import queue
import socket
import threading
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set

import grpc
from grpc._cython import cygrpc  # the segregated call of _OwnStream (grpcio's own layer)

from . import _blocks, _hostmem, _local, _ops, _proto, _tensor
from ._local import local_end, too_large
from ._ops import SESSION_FIELD, BufferLike, NodeInfo, Notification, ReadOp, RemoteLike, TransferResult, WriteOp, settle
from .errors import Cancelled, FailedPrecondition, ResourceExhausted, TcpxdError, Unavailable, from_rpc_error, from_status

#: Deadline of calls that are not transfers (registration, peers, ...), in seconds.
DEFAULT_CALL_TIMEOUT = 60.0

_OP = cygrpc.OperationType


class Buffer(_hostmem.HostView):
    """A buffer registered with a daemon. A context manager: leaving it releases the buffer. Host
    memory this process shares with the daemon (`shared`) is also seen here: `numpy()`, `tensor()`."""

    def __init__(self, client: "Client", msg: Any, keepalive: Any = None, host: Optional[_hostmem.HostMemory] = None):
        self._client = client
        self._keepalive = keepalive  # e.g. the tensor whose memory the daemon imported
        self._host = host
        self._update(msg)
        self.released = False

    def _update(self, msg: Any) -> None:
        self.id: int = msg.id
        self.kind: str = _ops.kind_name(msg.kind)
        self.size: int = msg.size
        self.label: str = msg.label
        #: What another node needs to address this buffer (give it to its writers and readers).
        self.descriptor: str = msg.descriptor
        self.device: int = msg.device

    def __repr__(self) -> str:
        return f"Buffer(id={self.id}, kind={self.kind}, size={self.size}, label={self.label!r})"

    def release(self) -> None:
        """Releases the buffer (its descriptor stops working). Idempotent."""
        if not self.released:
            self._client._unary("ReleaseBuffer", _proto.message("ReleaseBufferRequest")(buffer_id=self.id))
            self.released = True
            self._keepalive = None

    def rekey(self) -> str:
        """A new access key: every descriptor handed out before stops working. Returns the new one."""
        self._update(self._client._unary("RekeyBuffer", _proto.message("RekeyBufferRequest")(buffer_id=self.id)))
        return self.descriptor

    def write_bytes(self, data: bytes, offset: int = 0) -> None:
        """Copies `data` into the buffer at `offset` (through the API: for small data and tests)."""
        for req in _ops.fill_requests(self.id, offset, data):
            self._client._unary("FillBuffer", req)

    def read_bytes(self, offset: int = 0, length: Optional[int] = None) -> bytes:
        """The buffer's bytes `[offset, offset + length)` (default: to the end), through the API."""
        length = self.size - offset if length is None else length
        R = _proto.message("ReadBufferRequest")
        return b"".join(
            self._client._unary("ReadBuffer", R(buffer_id=self.id, offset=o, length=n)).data
            for o, n in _ops.read_ranges(offset, length)
        )

    def fill(self, *, byte: Optional[int] = None, seed: Optional[int] = None, offset: int = 0, length: int = 0) -> None:
        """Fills `[offset, offset + length)` (0: to the end) with a byte or a seeded pseudo-random stream."""
        self._client._unary("FillBuffer", _ops.fill_pattern(self.id, offset, length, byte, seed))

    def checksum(self, offset: int = 0, length: int = 0) -> int:
        """CRC-32C of `[offset, offset + length)` (0: to the end), computed by the daemon."""
        R = _proto.message("ChecksumBufferRequest")
        return self._client._unary("ChecksumBuffer", R(buffer_id=self.id, offset=offset, length=length)).crc32c

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class BlockList:
    """A list of blocks inside a registered buffer (`Client.register_blocks`), moved by index with
    `write_blocks` / `read_blocks`. `token` names it to other nodes (a secret, as a descriptor is).
    `len()` is its block count. A context manager: leaving it releases the list; releasing its
    buffer releases it too."""

    def __init__(self, client: "Client", msg: Any):
        self._client = client
        self._update(msg)
        self.released = False

    def _update(self, msg: Any) -> None:
        f = _blocks.ListFields.of(msg)
        self.id: int = f.id
        self.buffer_id: int = f.buffer_id
        self.token: str = f.token
        self.count: int = f.count
        #: Every block's length when they are all equal, else 0.
        self.block_length: int = f.block_length

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        return f"BlockList(id={self.id}, buffer_id={self.buffer_id}, count={self.count}, block_length={self.block_length})"

    def refresh(self) -> str:
        """Asks the daemon for the list's token again (after its buffer was re-keyed); returns it."""
        self._update(self._client._unary("DescribeBlocks", _proto.message("DescribeBlocksRequest")(list_id=self.id)))
        return self.token

    def release(self) -> None:
        """Releases the list (its token stops working). Idempotent."""
        if not self.released:
            self._client._unary("ReleaseBlocks", _proto.message("ReleaseBlocksRequest")(list_id=self.id))
            self.released = True

    def __enter__(self) -> "BlockList":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()



class PreparedList(_blocks.PreparedFields):
    """A prepared list held by the daemon (`prepare_blocks`): entries, each a range of blocks of
    one block list, named by index in `write_prepared` / `read_prepared`, what NIXL calls a
    prepared descriptor list. `len()` is its entry count. A context manager: leaving it releases
    it. One prepared on a Session goes with the session."""

    def release(self) -> None:
        """Releases it in the daemon (transfers already started keep their plans). Idempotent."""
        if not self.released:
            self._owner._release_prepared(self.id)
            self.released = True

    def __enter__(self) -> "PreparedList":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


class Transfer:
    """A transfer started without waiting: `result()` waits for it, `cancel()` stops it."""

    def __init__(self, client: "Client", started: Any):
        self._client = client
        self.id: int = started.transfer_id
        self.total_bytes: int = started.total_bytes
        self._final: Optional[Any] = _ops.final_event(started)

    def result(self, timeout: Optional[float] = None) -> TransferResult:
        """Waits until the bytes landed; raises the exception of the transfer's status if it failed
        (tcpxd.DeadlineExceeded when `timeout` passes first; the transfer goes on)."""
        if self._final is None:
            req = _proto.message("WaitTransferRequest")(transfer_id=self.id)
            self._final = self._client._unary("WaitTransfer", req, timeout=timeout)
        return _ops.result(self._final)

    def cancel(self) -> bool:
        """Cancels the transfer on both sides; False when it had already ended."""
        return self._client.cancel(self.id)

    def events(self) -> Iterator[Any]:
        """The transfer's progress events (tcpxd.v1.TransferEvent), ending with the final one."""
        call = self._client._stream("Watch", _proto.message("WatchRequest")(transfer_id=self.id))
        try:
            for ev in call:
                yield ev
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None


class Subscription:
    """Notifications, in the order their transfers completed. Iterate it; `close()` ends it."""

    def __init__(self, call: Any):
        self._call = call

    def __iter__(self) -> Iterator[Notification]:
        try:
            for n in self._call:
                yield _ops.notification(n)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and self._closed:
                return
            raise from_rpc_error(e) from None

    _closed = False

    def next(self, timeout: Optional[float] = None) -> Notification:
        """The next notification; tcpxd.DeadlineExceeded when none comes within `timeout` seconds."""
        box: "queue.Queue[Any]" = queue.Queue()

        def take() -> None:
            try:
                box.put(_ops.notification(next(self._call)))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box.put(e)

        threading.Thread(target=take, daemon=True).start()
        try:
            got = box.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise from_status(4, f"no notification within {timeout} s") from None
        if isinstance(got, grpc.RpcError):
            raise from_rpc_error(got) from None
        if isinstance(got, BaseException):
            raise got
        return got

    def close(self) -> None:
        self._closed = True
        self._call.cancel()

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_SMALL_VARINTS = [bytes([i]) for i in range(128)]


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

#: The send buffer asked for a session's local-session socket (the kernel caps it at wmem_max):
#: requests written at once are not held up while the daemon starts the earlier ones.
SESSION_SNDBUF = 4 << 20


class Session:
    """Many transfers in flight on one stream: each submit returns a concurrent.futures.Future
    resolved when that transfer finishes, in completion order. `close()` (or leaving the `with`
    block) waits for the unfinished ones; leaving it by an exception cancels them.

    On a unix endpoint whose daemon speaks it (the client's `local` rules), the stream is a
    connection of the daemon's local session of its own (tcpxd._local: the Session RPC framed
    plainly, no gRPC); else the `Session` RPC. Either way a reader thread resolves the futures."""

    #: Why the client ended it ("cancelled", "expired", "client closed"), on the local session.
    _why: Optional[str] = None

    def __init__(self, client: "Client", timeout: Optional[float]):
        self._client = client
        self._pending: Dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._tags = itertools.count(1)
        self._closed = False
        self._ended: Optional[TcpxdError] = None  # what unfinished futures got once the stream ended
        self._timeout = timeout
        self._conn = client._local.connect() if client._local is not None else None
        if self._conn is not None:
            try:  # room for a burst of requests (tcpxd.nixl posts a transfer's parts in one write)
                self._conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SESSION_SNDBUF)
            except OSError:
                pass
            client._sessions.add(self)
            self._call: Any = None
            self._send_lock = threading.Lock()
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

    def _submit(self, _fd: Optional[int] = None, **op: Any) -> concurrent.futures.Future:
        if self._closed:
            raise TcpxdError("the session is closed")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            tag = next(self._tags)
            ended = self._ended
            if ended is None:
                self._pending[tag] = fut
        fut.tag = tag  # type: ignore[attr-defined]
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
                _send_pieces(self._conn.sock, pieces, total)  # type: ignore[union-attr]
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
        with self._send_lock:
            try:
                self._conn.sock.sendall(_local.HEADER.pack(len(head) + blen) + head + body)
            except OSError:
                pass  # the connection ended: the reader fails the pending futures

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
            with self._lock:
                self._pending.pop(tag, None)
            sink.set_exception(ResourceExhausted(
                f"session request: {blen} bytes is over the local session's {_local.MAX_FRAME}-byte frame limit"))
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
                _send_pieces(self._conn.sock, pieces, _local.HEADER.size + size)  # type: ignore[union-attr]
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
                    self._conn.sock.sendall(frame)  # type: ignore[union-attr]
                else:
                    _local.send_with_fd(self._conn.sock, frame, fd)  # type: ignore[union-attr]
            except OSError:
                pass  # the connection ended: the reader fails the pending futures

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
    ) -> "concurrent.futures.Future[TransferResult]":
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
    ) -> "concurrent.futures.Future[TransferResult]":
        op = ReadOp(remote, local, length, remote_offset, local_offset)
        return self._submit(read=_ops.read_request(op, timeout, False))

    def write_batch(
        self, ops: Sequence[WriteOp], *, notification: bytes = b"", ready_event: Any = None, timeout: Optional[float] = None
    ) -> "concurrent.futures.Future[TransferResult]":
        return self._submit(write_batch=_ops.write_batch_request(ops, notification, ready_event, timeout, False))

    def read_batch(self, ops: Sequence[ReadOp], *, timeout: Optional[float] = None) -> "concurrent.futures.Future[TransferResult]":
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
    ) -> "concurrent.futures.Future[TransferResult]":
        """As Client.write_blocks, in this session."""
        req = _blocks.write_request(local_list, local_idx, remote, remote_idx, notification, ready_event, timeout, False)
        return self._submit(write_blocks=req)

    def read_blocks(
        self, local_list: Any, local_idx: Any, remote: Any, remote_idx: Any, *, timeout: Optional[float] = None
    ) -> "concurrent.futures.Future[TransferResult]":
        """As Client.read_blocks, in this session."""
        return self._submit(read_blocks=_blocks.read_request(local_list, local_idx, remote, remote_idx, timeout, False))

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
            fut = self._submit(mem.fd, register_host_fd=_hostmem.register_request(mem, label))
        finally:
            mem.done_sending()
        return Buffer(self._client, fut.result(), keepalive=host, host=host)

    def cancel(self, fut: concurrent.futures.Future) -> "concurrent.futures.Future[bool]":
        """Cancels the transfer behind `fut` (it then fails with tcpxd.Cancelled); the returned
        future says whether it was still unfinished."""
        return self._submit(cancel_tag=fut.tag)  # type: ignore[attr-defined]

    def _dispatch(self, ev: Any) -> None:
        with self._lock:
            fut = self._pending.pop(ev.tag, None)
        if fut is not None:
            settle(fut, ev)

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
        conn = self._conn
        assert conn is not None
        err: Optional[TcpxdError] = None
        try:
            for ev in conn.events():
                if ev.tag == 0 and ev.WhichOneof("event") == "refused":  # the daemon refused a frame
                    err = from_status(ev.refused.code, ev.refused.message)
                    break
                self._dispatch(ev)
        except TcpxdError as e:
            err = e
        except OSError as e:
            err = Unavailable(f"local session with {self._client.endpoint}: {e}")
        conn.shutdown()
        self._end(local_end(err, self._why, self._closed, self._client.endpoint, self._timeout))

    def _abort(self, why: str) -> None:
        """Ends the connection: the daemon cancels what is in flight; the futures fail (`why`)."""
        if self._why is None:
            self._why = why
        self._conn.shutdown()  # type: ignore[union-attr]  # wakes the reader, which closes nothing

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

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:  # the caller failed: cancel the in-flight transfers
            if self._conn is None:
                self._call.cancel()
            else:
                self._abort("cancelled")
        self.close()


class _OwnStream:
    """The client's own `Session` stream for `write()`/`read()` and the batch forms with `wait` and no
    `timeout`: one transfer at a time, sent and answered on the caller's thread.

    grpcio's public streaming calls hand every message to two threads of their own (one consuming
    the request iterator, one polling the channel's completion queue); this stream is a
    *segregated* call (grpcio's `cygrpc` layer, as its own single-threaded unary-stream option
    uses): the caller queues the send and the receive and polls the call's own completion queue
    itself. Against a unary `Write` per transfer the daemon also skips a new HTTP/2 stream and its
    headers. The 4 KiB figures: docs/BENCHMARKS.md ("The Python client").

    Whatever this cannot do falls back to the unary call: another thread's transfer on it (busy),
    a grpcio without the segregated-call API, a daemon without `Session`, a stream found dead when
    the request could not be sent (the daemon restarted). A caller interrupted while waiting
    cancels the stream, and with it its transfer, as a unary call that goes away does."""

    def __init__(self, client: "Client"):
        self._client = client
        self._lock = threading.Lock()
        self._call: Any = None
        self._pending: Set[Any] = set()  # operation types of batches not completed yet
        self._tag = 0
        self._closed = False

    def run(self, field: str, req: Any) -> Optional[TransferResult]:
        """The transfer's result (or its exception); None when the unary call should be made."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if self._closed:
                return None
            ev = self._exchange(field, req)
        finally:
            self._lock.release()
        if ev is None:
            return None
        if ev.WhichOneof("event") == "refused":
            raise from_status(ev.refused.code, ev.refused.message)
        return _ops.result(ev.finished)

    def _operate(self, op: Any) -> bool:
        self._pending.add(op.type())
        if self._call.operate((op,), None):
            return True
        self._pending.discard(op.type())
        return False

    def _open(self) -> bool:
        md = self._client._metadata
        try:
            ops = (
                ((cygrpc.SendInitialMetadataOperation(md, 0),), None),
                ((cygrpc.ReceiveInitialMetadataOperation(0),), None),
                ((cygrpc.ReceiveStatusOnClientOperation(0),), None),
            )
            channel = self._client._channel._channel
            args = (cygrpc.PropagationConstants.GRPC_PROPAGATE_DEFAULTS, _proto.path("Session").encode(),
                    None, None, md, None, ops, cygrpc.build_census_context())
            try:
                self._call = channel.segregated_call(*args, None)  # newer grpcio: a registered-call handle
            except TypeError:
                self._call = channel.segregated_call(*args)  # e.g. grpcio 1.60 (tested)
        except (AttributeError, TypeError):  # not the cygrpc this was written against: unary calls
            self._closed = True
            return False
        self._pending = {_OP.receive_initial_metadata, _OP.receive_status_on_client}
        return True

    def _exchange(self, field: str, req: Any) -> Any:
        if self._call is None and not self._open():
            return None
        self._tag += 1
        msg = _proto.message("SessionRequest")(tag=self._tag, **{field: req})
        if not self._operate(cygrpc.SendMessageOperation(msg.SerializeToString(), 0)):
            self._teardown()  # the call had ended (while idle): the request was not sent
            return None
        sent: Optional[bool] = None
        got: Optional[bytes] = None
        status: Any = None
        try:
            if not self._operate(cygrpc.ReceiveMessageOperation(0)):
                raise TcpxdError("the client's stream refused a receive")
            # Until the send's outcome is known, and the answer or the stream's end.
            while sent is None or (got is None and status is None):
                event = self._next_event()
                for op in event.batch_operations:
                    t = op.type()
                    self._pending.discard(t)
                    if t == _OP.send_message:
                        sent = bool(event.success)
                    elif t == _OP.receive_message:
                        got = op.message()  # None: the stream ended, its status is to come
                    elif t == _OP.receive_status_on_client:
                        status = op
        except BaseException:
            self._teardown()  # e.g. KeyboardInterrupt: the daemon cancels the transfer
            raise
        if got is not None:
            if status is not None:
                self._teardown()  # answered, then ended (the daemon drains)
            ev = _proto.message("SessionEvent").FromString(got)
            if ev.tag == self._tag:
                return ev
            self._teardown()
            raise TcpxdError(f"the client's stream answered tag {ev.tag}, not {self._tag}")
        code, details = status.code(), status.details()
        unimplemented = code == grpc.StatusCode.UNIMPLEMENTED.value[0]
        self._closed = self._closed or unimplemented
        self._teardown()
        if not sent or code == 0 or unimplemented:
            # Not sent (it had ended), ended OK unread (the daemon drains), or no Session at all.
            return None
        raise from_status(code, details)

    def _next_event(self) -> Any:
        try:
            return self._call.next_event()
        except BaseException:
            # Interrupted (KeyboardInterrupt): grpcio has released the call, which cancels it.
            self._call = None
            self._pending.clear()
            raise

    def _teardown(self) -> None:
        """Cancels the stream and takes its outstanding batches off its completion queue."""
        if self._call is None:
            return
        self._call.cancel(cygrpc.StatusCode.cancelled, "tcpxd client: stream closed")
        while self._pending:
            for op in self._next_event().batch_operations:
                self._pending.discard(op.type())
        self._call = None

    def close(self) -> None:
        """Ends the stream if idle; a transfer waiting on it ends with the channel (Cancelled)."""
        self._closed = True
        if self._lock.acquire(blocking=False):
            try:
                self._teardown()
            finally:
                self._lock.release()


class Client:
    """A connection to one tcpxd daemon.

    `endpoint`: "unix:/path" or "host:port" (default: $TCPXD_ENDPOINT, else
    unix:/run/tcpxd/tcpxd.sock). A TCP endpoint sends the API token (`token`, the file `token_file`,
    else the file $TCPXD_API_TOKEN_FILE names). `timeout`: the deadline, in seconds, of calls that
    are not transfers. `local` (default True): on a `unix:` endpoint, `write()`, `read()` and the
    batch forms with `wait` go over the daemon's local session (the Session RPC framed plainly on
    its unix socket, without gRPC: one connection per thread in flight, kept for reuse) when the
    daemon speaks it, which the first transfer finds out; False, or a TCP endpoint, or an older
    daemon: gRPC. `stream` (default True): on gRPC, those with no `timeout` go as requests on one
    Session stream the client keeps open (faster than a unary call each); False makes every
    transfer its own unary call. A context manager: leaving it closes the channel."""

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
        self._channel = grpc.insecure_channel(self.endpoint, options=_ops.channel_options())
        self.timeout = timeout
        self._stubs: Dict[str, Callable[..., Any]] = {}
        self._own: Optional[_OwnStream] = _OwnStream(self) if stream and _proto.has_method("Session") else None
        path = _local.socket_path(self.endpoint) if local else None
        self._local: Optional[_local.LocalSessions] = _local.LocalSessions(path) if path else None
        #: Sessions on the local session (closing the client ends them, as closing the channel ends gRPC's).
        self._sessions: "weakref.WeakSet[Session]" = weakref.WeakSet()
        unix = _local.socket_path(self.endpoint)
        #: Registers host memory this process shares (its connection holds those buffers).
        self._registrar: Optional[_hostmem.Registrar] = _hostmem.Registrar(unix, self._local) if unix else None

    # -- plumbing

    def _stub(self, name: str, kind: str) -> Callable[..., Any]:
        s = self._stubs.get(name)
        if s is None:
            s = getattr(self._channel, kind)(_proto.path(name), **_proto.codecs(name))
            self._stubs[name] = s
        return s

    def _unary(self, name: str, req: Any, timeout: Optional[float] = -1.0) -> Any:
        t = self.timeout if timeout == -1.0 else timeout
        try:
            return self._stub(name, "unary_unary")(req, timeout=t, metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, self.endpoint) from None

    def _stream(self, name: str, req: Any, timeout: Optional[float] = None) -> Any:
        return self._stub(name, "unary_stream")(req, timeout=timeout, metadata=self._metadata)

    def _stream_stream(self, name: str, reqs: Iterator[Any], timeout: Optional[float] = None) -> Any:
        return self._stub(name, "stream_stream")(reqs, timeout=timeout, metadata=self._metadata)

    def _waited_path(self) -> str:
        """How waited transfers go (after the first one): "local session", "own stream" or "unary"."""
        if self._local is not None and self._local.available:
            return "local session"
        return "own stream" if self._own is not None and not self._own._closed else "unary"

    def close(self) -> None:
        for session in list(self._sessions):
            session._abort("client closed")
        if self._registrar is not None:
            self._registrar.close()  # the daemon releases the host memory this client shared
        if self._local is not None:
            self._local.close()
        if self._own is not None:
            self._own.close()
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- buffers

    def register_host(self, memory: Any, label: str = "", *, fd: Optional[int] = None, shared: Optional[bool] = None) -> Buffer:
        """A host buffer whose memory this process sees (`numpy()`, `tensor()`), no copy either side.

        `memory`: a size in bytes (the package maps a new memfd of that size), or memory of this
        process's own backed by a file mapped shared: a torch CPU tensor after `share_memory_()`, a
        numpy array or `mmap.mmap` over a memfd or a file on /dev/shm (`fd=`: a descriptor of that file,
        when this process holds none open). The descriptor goes to the daemon over its unix socket; the
        buffer lives until `release()` or until the client closes. With a size, `shared=False` (or a TCP
        endpoint, unless `shared=True`) has the daemon allocate the memory instead, as before: it
        outlives the client, and this process reaches it only by read_bytes()/write_bytes().
        Raises InvalidArgument/FailedPrecondition for memory that cannot be shared, saying what to do."""
        if not _hostmem.daemon_allocates(memory, shared, self._registrar):
            got = _hostmem.register(self._registrar, self.endpoint, memory, label, fd, self.timeout, shared)
            if got is not None:
                return Buffer(self, got[0], keepalive=got[1], host=got[1])
        return Buffer(self, self._unary("RegisterBuffer", _ops.host_register(memory, label)))

    def allocate_cuda(self, size: int, device: int = 0, label: str = "") -> Buffer:
        """A CUDA buffer the daemon allocates on GPU `device`."""
        return Buffer(self, self._unary("RegisterBuffer", _ops.cuda_register(size, device, label)))

    def register_cuda_ipc(self, ipc_handle: bytes, size: int, *, offset: int = 0, device: int = 0, label: str = "") -> Buffer:
        """CUDA memory of another process, by its 64-byte cudaIpcMemHandle_t (offset and size of the range)."""
        return Buffer(self, self._unary("RegisterBuffer", _ops.ipc_register(ipc_handle, offset, size, device, label)))

    def register_tensor(self, tensor: Any, label: str = "") -> Buffer:
        """A PyTorch CUDA tensor's own memory, imported by the daemon by IPC handle (no copy). The
        buffer keeps the tensor alive until released; release it before freeing the tensor's memory."""
        device, handle, offset, size = _tensor.cuda_ipc_view(tensor)
        msg = self._unary("RegisterBuffer", _ops.ipc_register(handle, offset, size, device, label))
        return Buffer(self, msg, keepalive=tensor)

    def register_blocks(
        self, buffer: BufferLike, offsets: Any = None, lengths: Any = None, *, block_size: Optional[int] = None
    ) -> BlockList:
        """A list of blocks inside `buffer`, for `write_blocks` / `read_blocks`. `offsets` (numpy
        array, torch tensor, list or range) with `lengths` (one per block, or one int for all) or
        `block_size=`; with `block_size` alone the blocks tile the whole buffer. Sent as compactly as
        the blocks allow (evenly spaced: four numbers). The daemon checks every block once: inside
        the buffer, not empty, none overlapping (InvalidArgument naming the first bad one)."""
        offsets = _blocks.tiling(buffer, offsets, block_size)
        req = _blocks.register_request(buffer, offsets, lengths, block_size)
        return BlockList(self, self._unary("RegisterBlocks", req))

    def describe_buffer(self, buffer: BufferLike) -> Any:
        return self._unary("DescribeBuffer", _proto.message("DescribeBufferRequest")(buffer_id=_ops.buffer_id(buffer)))

    def list_buffers(self) -> List[Any]:
        return list(self._unary("ListBuffers", _proto.message("ListBuffersRequest")()).buffers)

    # -- peers and node

    def connect_peer(self, address: str) -> Any:
        """Connects to another daemon's peer address (not needed for descriptors carrying one)."""
        return self._unary("ConnectPeer", _proto.message("ConnectPeerRequest")(address=address))

    def list_peers(self) -> List[Any]:
        return list(self._unary("ListPeers", _proto.message("ListPeersRequest")()).peers)

    def describe_node(self) -> NodeInfo:
        """The daemon's node id, peer address(es), version, plugin, devices and GPUs."""
        return _ops.node_info(self._unary("DescribeNode", _proto.message("DescribeNodeRequest")()))

    def stats(self) -> Any:
        return self._unary("GetStats", _proto.message("GetStatsRequest")())

    # -- transfers

    def _start(self, name: str, req: Any, timeout: Optional[float], wait: bool) -> Any:
        # `wait` means nothing in a session; the request's `timeout_ms` is its deadline there.
        if wait and self._local is not None:
            r = self._local.run(SESSION_FIELD[name], req, timeout)
            if r is not None:
                return r
        if wait and timeout is None and self._own is not None:
            r = self._own.run(SESSION_FIELD[name], req)
            if r is not None:
                return r
        started = self._unary(name, req, timeout=timeout)
        t = Transfer(self, started)
        return t.result() if wait else t

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
        wait: bool = True,
    ) -> Any:
        """WRITE `length` bytes (default: the rest of `local`) from `local` into the remote buffer a
        descriptor names. `ready_event` (a torch.cuda.Event(interprocess=True), or its IPC handle)
        orders the send after the GPU work recorded before it. With `wait` (default) returns a
        TransferResult once the bytes landed; else a Transfer to wait on or cancel. `timeout`
        (seconds) is the transfer's deadline (default: the daemon's)."""
        req = _ops.write_request(WriteOp(local, remote, length, local_offset, remote_offset), notification, ready_event, timeout, wait)
        return self._start("Write", req, timeout, wait)

    def read(
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
        """READ `length` bytes (default: the rest of `local`) of a remote buffer into `local`."""
        req = _ops.read_request(ReadOp(remote, local, length, remote_offset, local_offset), timeout, wait)
        return self._start("Read", req, timeout, wait)

    def write_batch(
        self,
        ops: Sequence[WriteOp],
        *,
        notification: bytes = b"",
        ready_event: Any = None,
        timeout: Optional[float] = None,
        wait: bool = True,
    ) -> Any:
        """Several WRITE entries as one transfer (one id; per-entry statuses in the result)."""
        return self._start("WriteBatch", _ops.write_batch_request(ops, notification, ready_event, timeout, wait), timeout, wait)

    def read_batch(self, ops: Sequence[ReadOp], *, timeout: Optional[float] = None, wait: bool = True) -> Any:
        """Several READ entries as one transfer."""
        return self._start("ReadBatch", _ops.read_batch_request(ops, timeout, wait), timeout, wait)

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
        wait: bool = True,
    ) -> Any:
        """WRITE blocks `local_idx` of a local BlockList (or its id) into blocks `remote_idx` of a
        remote list (its token, or a BlockList), pair by pair: block k of one selection into block
        k of the other, equal in length. Indices: numpy arrays, torch tensors, lists or ranges
        (runs are sent as ranges). Otherwise as `write`."""
        req = _blocks.write_request(local_list, local_idx, remote, remote_idx, notification, ready_event, timeout, wait)
        return self._start("WriteBlocks", req, timeout, wait)

    def read_blocks(
        self,
        local_list: Any,
        local_idx: Any,
        remote: Any,
        remote_idx: Any,
        *,
        timeout: Optional[float] = None,
        wait: bool = True,
    ) -> Any:
        """READ blocks `remote_idx` of a remote list into blocks `local_idx` of a local one, pair by
        pair. Otherwise as `write_blocks`."""
        req = _blocks.read_request(local_list, local_idx, remote, remote_idx, timeout, wait)
        return self._start("ReadBlocks", req, timeout, wait)

    def prepare_blocks(self, lists: Any, entries: Any) -> PreparedList:
        """A prepared list in the daemon: `lists`, this node's block lists (BlockLists or ids) or
        one other node's (their tokens); `entries`, an N×3 array (numpy, torch, nested lists) of
        (position in `lists`, first block, block count). Transfers then name entries by index
        (`write_prepared` / `read_prepared`): nothing per block crosses the API. The daemon checks
        every entry once (InvalidArgument naming the first bad one). Lives until released."""
        return PreparedList(self, self._unary("PrepareBlocks", _blocks.prepare_request(lists, entries)))

    def _release_prepared(self, prepared_id: int) -> None:
        self._unary("ReleasePrepared", _proto.message("ReleasePreparedRequest")(prepared_id=prepared_id))

    def write_prepared(
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
        """WRITE entries `local_idx` of a local PreparedList into entries `remote_idx` of a remote
        one (prepared here from the other node's tokens), pair by pair, as one transfer: the
        notification reaches the other node once every byte landed. Otherwise as `write`."""
        req = _blocks.prepared_request("WRITE", local, local_idx, remote, remote_idx, notification, timeout, wait)
        return self._start("WritePrepared", req, timeout, wait)

    def read_prepared(
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
        """READ entries `remote_idx` of a remote PreparedList into entries `local_idx` of a local
        one; the notification reaches the other node once every byte landed here."""
        req = _blocks.prepared_request("READ", local, local_idx, remote, remote_idx, notification, timeout, wait)
        return self._start("ReadPrepared", req, timeout, wait)

    def cancel(self, transfer_id: int) -> bool:
        """Cancels a transfer on both sides; False when it had already ended."""
        return self._unary("Cancel", _proto.message("CancelRequest")(transfer_id=transfer_id)).cancelled

    def session(self, timeout: Optional[float] = None) -> Session:
        """A stream for many transfers in flight (`timeout` bounds the whole session): a connection
        of the daemon's local session of its own where waited transfers would take it (`local`),
        else the `Session` RPC."""
        return Session(self, timeout)

    def subscribe(self) -> Subscription:
        """Notifications other nodes attach to transfers into this node's buffers. Returns once the
        subscription is in place: notifications of transfers finishing after that are delivered."""
        call = self._stream("Subscribe", _proto.message("SubscribeRequest")())
        try:
            call.initial_metadata()  # the daemon answers headers once it has subscribed
        except grpc.RpcError as e:
            raise from_rpc_error(e, self.endpoint) from None
        return Subscription(call)
