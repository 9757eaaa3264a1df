"""The daemon's local session: the `Session` RPC framed plainly on its API unix socket.

For a local client, grpcio's per-call work costs more than a small transfer. The daemon's API unix
socket also speaks the `Session` RPC without HTTP/2 (docs/API.md, "The framed local session"): the
client sends the 8-byte preface `TCPXD/1\\n`, the daemon answers with the same 8 bytes, then each
side sends frames of a 4-byte big-endian length and that many bytes of protobuf (`SessionRequest`
from the client, `SessionEvent` from the daemon), with the semantics of the `Session` RPC. A daemon
that predates it does not answer the preface (an HTTP/2 server sends its SETTINGS, or closes).

What the sync client uses: a pool of such connections, one per transfer in flight (threads each get
their own, reused after). A waited transfer is one frame out and one back on the caller's thread:
no helper thread, no HTTP/2. The asyncio client's form (asyncio streams) is tcpxd._aio_local's
_AsyncLocalSessions. `Client.session()` takes a connection of its own (LocalSessions.connect) for
its many requests in flight, sent from any thread, the events read by its reader thread
(Connection.events).

What both clients' sessions fail with here: `too_large` (a request over a frame) and `local_end`
(the connection ended with requests unanswered).
"""

from __future__ import annotations

import array
import os
import select
import socket
import struct
import threading
import time
import weakref
from typing import Any, Callable, Iterator, List, Optional, Sequence, Set, Tuple, Union

from . import _board, _ops, _proto, _ring, _waited
from ._ops import TransferResult
from .errors import Cancelled, DeadlineExceeded, ResourceExhausted, TcpxdError, Unavailable, from_status

#: What both sides send first.
PREFACE = b"TCPXD/1\n"
#: The largest frame the daemon takes; a larger request goes through gRPC (16 MiB messages).
MAX_FRAME = 64 << 20
#: How long connecting and the preface exchange may take before the client uses gRPC instead.
HANDSHAKE_TIMEOUT = 5.0
#: How long past a transfer's `timeout=` the client waits for the daemon's answer (which says
#: DEADLINE_EXCEEDED itself) before closing the connection (which cancels the transfer).
BACKSTOP = 1.0

HEADER = struct.Struct(">I")


def _spin_default() -> float:
    """SPIN_S: TCPXD_CLIENT_SPIN_US (µs), else 200 µs with 8 CPUs or more and 0 below (the
    daemon's `runtime.spin auto` rule: on a machine with few cores the daemons need the CPU a
    spinning client would take)."""
    v = os.environ.get("TCPXD_CLIENT_SPIN_US", "")
    if v:
        try:
            return max(0.0, float(v) / 1e6)
        except ValueError:
            pass
    return 200e-6 if (os.cpu_count() or 1) >= 8 else 0.0


#: How long a waited transfer's thread looks at its connection without blocking (`poll(0)`, the
#: GIL released at each look) before it blocks on it: a small transfer's answer, which comes
#: within that, is read without the thread having been put to sleep and woken again. Bounded;
#: 0: block at once.
SPIN_S = _spin_default()


def socket_path(endpoint: str) -> Optional[str]:
    """The filesystem path of a `unix:` endpoint (gRPC's `unix:path` and `unix:///path` forms);
    None for anything else (TCP, `unix-abstract:`)."""
    if not endpoint.startswith("unix:"):
        return None
    path = endpoint[len("unix:") :]
    if path.startswith("//"):  # unix://<authority>/path: gRPC takes only an empty authority
        path = path[2:]
    return path or None


def request_frame(tag: int, field: str, req: Any) -> Optional[bytes]:
    """The frame of a `SessionRequest` carrying `req` in its `field`; None when it is too large."""
    return frame(_proto.message("SessionRequest")(tag=tag, **{field: req}))


_SESSION_KEYS: dict = {}


def body_frame(tag: int, field: str, body: bytes) -> Optional[bytes]:
    """The frame of a `SessionRequest` whose `field` carries `body`, that field's message already
    serialized (tcpxd._waited): the same bytes as `request_frame`, without a message to build and
    copy; None when it is too large."""
    key = _SESSION_KEYS.get(field)
    if key is None:
        num = _proto.message("SessionRequest").DESCRIPTOR.fields_by_name[field].number
        key = _SESSION_KEYS[field] = _waited.varint((num << 3) | 2)
    head = b"\x08" + _waited.varint(tag) + key + _waited.varint(len(body)) if tag else key + _waited.varint(len(body))
    n = len(head) + len(body)
    if n > MAX_FRAME:
        return None
    return HEADER.pack(n) + head + body


def frame(msg: Any) -> Optional[bytes]:
    """The frame of a `SessionRequest`; None when it is over the daemon's limit (MAX_FRAME)."""
    body = msg.SerializeToString()
    if len(body) > MAX_FRAME:
        return None
    return HEADER.pack(len(body)) + body


def frame_length(header: Union[bytes, bytearray]) -> int:
    """The length a frame's 4-byte header says; raises when it is past any the daemon sends."""
    (n,) = HEADER.unpack(header)
    if n > _ops.MAX_MESSAGE:
        raise TcpxdError(f"local session: the daemon sent a {n}-byte frame (the limit is {_ops.MAX_MESSAGE})")
    return int(n)


def answer(ev: Any, tag: int) -> TransferResult:
    """The result the daemon's event for request `tag` says; raises its exception otherwise."""
    kind = ev.WhichOneof("event")
    if kind == "refused":  # with tag 0: the frame itself (too large, undecodable)
        raise from_status(ev.refused.code, ev.refused.message)
    if ev.tag != tag or kind != "finished":
        raise TcpxdError(f"local session: the daemon answered tag {ev.tag} ({kind}) to request {tag}")
    return _ops.result(ev.finished)


def too_large(msg: Any) -> TcpxdError:
    """What a session request too large for the local session's frames fails with."""
    return ResourceExhausted(
        f"session request: {msg.ByteSize()} bytes is over the local session's {MAX_FRAME}-byte frame limit")


def local_end(err: Optional[TcpxdError], why: Optional[str], closed: bool, endpoint: str, timeout: Optional[float]) -> TcpxdError:
    """What a session's unfinished futures fail with once its local-session connection ended: `err`
    (the daemon's refusal of a frame, a broken connection), or why the client ended it."""
    if why == "cancelled":
        return Cancelled("the session was cancelled (its with block raised)")
    if why == "client closed":
        return Cancelled("the client was closed while the session had transfers in flight")
    if why == "expired":
        return DeadlineExceeded(f"the session's timeout of {timeout} s passed")
    if err is not None:
        return err
    if closed:
        return TcpxdError("the session ended with transfers unfinished")
    return Unavailable(f"the daemon at {endpoint} closed the session's connection")


def send_with_fd(sock: socket.socket, frame: bytes, fd: int) -> None:
    """Sends `frame` with the descriptor `fd` attached (SCM_RIGHTS): the daemon gives it to the
    frame whose first byte it came with."""
    sent = sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
    if sent < len(frame):
        sock.sendall(frame[sent:])


def send_with_fds(sock: socket.socket, frame: bytes, fds: Sequence[int]) -> None:
    """Sends `frame` with the descriptors `fds` attached in this order (a `register_batch`)."""
    sent = sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    if sent < len(frame):
        sock.sendall(frame[sent:])


class Gone(Exception):
    """The connection ended before the daemon answered; `sent`: whether the request went out."""

    def __init__(self, sent: bool):
        super().__init__()
        self.sent = sent


#: SessionEvent's oneof fields a reader may skip by number (`peek`): `finished`, `notification`.
FINISHED = 2
NOTIFICATION = 70


def peek(buf: Any, start: int, end: int) -> Tuple[int, int]:
    """A SessionEvent's tag and the number of its event's field, read from its first bytes
    (`buf[start:end]`, the frame's body) without decoding it: the daemon writes `tag` (field 1)
    first, then the event (prost writes fields in order). (0, 0) where the bytes say otherwise."""
    if end - start >= 4 and buf[start] == 0x08:  # the usual frame: a tag under 2**14, a one-byte key
        b1 = buf[start + 1]
        if b1 < 0x80:
            k = buf[start + 2]
            if k < 0x80:
                return b1, k >> 3
        else:
            b2 = buf[start + 2]
            k = buf[start + 3]
            if b2 < 0x80 and k < 0x80:
                return (b1 & 0x7F) | (b2 << 7), k >> 3
    i, tag = start, 0
    if i < end and buf[i] == 0x08:  # tag = 1, varint (absent when 0)
        i += 1
        shift = 0
        while i < end:
            b = buf[i]
            i += 1
            tag |= (b & 0x7F) << shift
            if b < 0x80:
                break
            shift += 7
    key = shift = 0
    while i < end:
        b = buf[i]
        i += 1
        key |= (b & 0x7F) << shift
        if b < 0x80:
            return tag, key >> 3
        shift += 7
        if shift > 28:
            break
    return tag, 0


#: `Connection.ready`'s `keep`: given an event's tag and field number (`peek`), whether to decode it.
Keep = Callable[[int, int], bool]


class Connection:
    """One framed session with the daemon, carrying one transfer at a time on the caller's thread.

    With a completion board (tcpxd._board; the pool's connections attach one when they open), a
    waited transfer's spin looks at the board for its OK end: found there, the call returns without
    reading the socket, and the event, which follows, is dropped when it comes (`_stale`)."""

    #: The connection's completion board, where the daemon gave it one.
    board: Optional[_board.Board] = None
    #: Its request ring (tcpxd._ring), where the daemon took one: `send` puts a request there when
    #: it fits, and counts what it sends on the socket.
    ring: Optional[_ring.Ring] = None

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = bytearray(64 << 10)
        #: Bytes of the next events already received (`pipelined` requests' answers).
        self._ahead = 0
        self._tag = 0
        self._timeout: Optional[float] = None  # the socket's, set only when it changes
        self._poll: Any = None  # `_spin`'s (made on first use; a connection is one thread's at a time)
        self._ready_poll: Any = None  # `ready`'s (its callers hold a lock)
        self._readable = False  # `_spin` saw the answer: `_fill` reads without waiting
        #: Tags settled from the board whose events are still to come (dropped when read).
        self._stale: Set[int] = set()
        #: Events read ahead while spinning (not stale), for `receive` to return first.
        self._early: List[Any] = []
        #: Events decoded, and skipped undecoded (`ready`'s `keep`, stale ends): what a polling
        #: loop spends on the socket (benches/board_ab.py counts them).
        self.decoded = 0
        self.skipped = 0

    def exchange(self, field: str, req: Any, timeout: Optional[float], fd: Optional[int] = None,
                 body: Optional[bytes] = None) -> Optional[Any]:
        """Sends one request (with the file descriptor `fd` attached, for `register_host_fd`; `body`:
        its field's message serialized already, in place of `req`) and returns the daemon's event
        (a SessionEvent); None when the request is too large for a frame. Raises Gone when the
        connection ended unanswered, socket.timeout when `timeout` (plus BACKSTOP) passed."""
        if not self.send(field, req, timeout, fd, body=body):
            return None
        try:
            board = self.board
            if board is not None and SPIN_S > 0 and not self._early:
                got = self._spin_board(board, SPIN_S)
                if got is not None:
                    return got
            elif SPIN_S > 0 and not self._ahead:
                self._readable = self._spin(SPIN_S)
            return self.receive()
        except Gone:
            ring = self.ring
            if ring is not None and ring.dropped():
                raise Gone(sent=False) from None  # (on the ring, never taken: the daemon had ended it)
            raise

    def _spin_board(self, board: _board.Board, budget: float) -> Optional[Any]:
        """`_spin` with a board: up to `budget` seconds, the request's OK end on the board (then
        returned, its slot freed, its event left to drop: a tuple, `_board.Board.take`'s), or
        an event that is not a stale one read (kept for `receive`); None: `receive` next."""
        tag = self._tag
        waiter = self._poller()
        end = time.perf_counter() + budget
        while True:
            got = board.take(tag)
            if got is not None:
                self._stale.add(tag)
                return got
            if self._ahead or waiter.poll(0):
                # Stale events (ends the board gave) are dropped here; anything else is kept.
                early = [ev for ev in self.ready(True) if not self._dropped(ev)]
                if early:
                    self._early = early
                    return None
            elif time.perf_counter() >= end:
                return None

    def _dropped(self, ev: Any) -> bool:
        """Whether `ev` is the event of an end the board gave (dropped); else its slot is freed
        if the board holds it (settled by the event)."""
        tag = ev.tag
        if tag in self._stale:
            self._stale.discard(tag)
            return True
        board = self.board
        if board is not None:
            board.forget(tag)
        return False

    def _poller(self) -> Any:
        waiter = self._poll
        if waiter is None:
            waiter = self._poll = select.poll()
            waiter.register(self.sock.fileno(), select.POLLIN)
        return waiter

    def _spin(self, budget: float) -> bool:
        """Looks for the answer without blocking for up to `budget` seconds (then `receive`
        blocks as ever); whether it came."""
        waiter = self._poller()
        end = time.perf_counter() + budget
        while not waiter.poll(0):
            if time.perf_counter() >= end:
                return False
        return True

    def send(self, field: str, req: Any, timeout: Optional[float], fd: Optional[int] = None,
             fds: Sequence[int] = (), body: Optional[bytes] = None) -> bool:
        """Sends one request without waiting for its answer (`receive`, in order, for requests
        the daemon answers in order: registrations); False when it is too large for a frame.
        `body`: the field's message serialized already (then `req` is not used)."""
        self._tag += 1
        frame = request_frame(self._tag, field, req) if body is None else body_frame(self._tag, field, body)
        if frame is None:
            return False
        wait = None if timeout is None else timeout + BACKSTOP
        if wait != self._timeout:
            self.sock.settimeout(wait)
            self._timeout = wait
        ring = self.ring
        try:
            if fd is not None:
                send_with_fd(self.sock, frame, fd)
            elif fds:
                send_with_fds(self.sock, frame, fds)
            elif ring is not None:
                self._put(ring, frame)
                return True
            else:
                self.sock.sendall(frame)
        except (BrokenPipeError, ConnectionResetError):
            raise Gone(sent=False) from None
        if ring is not None:
            ring.sent += 1
        return True

    def _put(self, ring: _ring.Ring, frame: bytes) -> None:
        """Sends one frame (no descriptors) on the request ring, ringing the doorbell where the
        daemon's poller may be parked, or on the socket (counted) when the ring does not take it."""
        bell = ring.put(frame)
        if bell is None:
            self.sock.sendall(frame)
            ring.sent += 1
        elif bell:
            try:
                self.sock.sendall(_ring.DOORBELL)
            except (BrokenPipeError, ConnectionResetError):
                # (a session the daemon ended says so on its ring: the request was not taken)
                raise Gone(sent=not ring.dropped()) from None

    def send_body(self, key: bytes, body: bytes, timeout: Optional[float]) -> bool:
        """`send` of a request whose one field is serialized already: `key` the field's key bytes
        (its number and wire type), `body` its message's bytes (a register_batch's entries written
        by tcpxd._addresses: no message object to parse and serialize again); False when it is
        too large for a frame."""
        self._tag += 1
        tag = self._tag
        head = bytearray(b"\x08")
        for n in (tag, -1, len(body)):
            if n < 0:
                head += key
                continue
            while n >= 0x80:
                head.append((n & 0x7F) | 0x80)
                n >>= 7
            head.append(n)
        if len(head) + len(body) > MAX_FRAME:
            return False
        wait = None if timeout is None else timeout + BACKSTOP
        if wait != self._timeout:
            self.sock.settimeout(wait)
            self._timeout = wait
        try:
            if self.ring is not None:
                self._put(self.ring, HEADER.pack(len(head) + len(body)) + head + body)
            else:
                self.sock.sendall(HEADER.pack(len(head) + len(body)) + head + body)
        except (BrokenPipeError, ConnectionResetError):
            raise Gone(sent=False) from None
        return True

    @property
    def tag(self) -> int:
        """The tag of the last request."""
        return self._tag

    def receive(self) -> Any:
        """The daemon's next event (never a stale one: `_dropped`). Bytes past it (the next
        pipelined answers) are kept for the next call; a connection carrying one request at a time
        never has any but the events of ends the board gave."""
        while True:
            if self._early:
                ev = self._early.pop(0)
            else:
                ev = self._receive()
            if not self._stale and self.board is None:
                return ev
            if not self._dropped(ev):
                return ev

    def _receive(self) -> Any:
        buf = self._buf
        have = self._ahead
        if have < HEADER.size:
            have = self._fill(HEADER.size, have)
        (n,) = HEADER.unpack_from(buf)
        end = HEADER.size + (n if n <= _ops.MAX_MESSAGE else frame_length(buf[: HEADER.size]))
        if end > have:
            if end > len(buf):
                buf.extend(bytes(end - len(buf)))
            have = self._fill(end, have)
        with memoryview(buf) as view:
            ev = _proto.message("SessionEvent").FromString(view[HEADER.size : end])
        self._ahead = have - end
        if self._ahead:
            self._buf[: self._ahead] = self._buf[end:have]
        return ev

    def ready(self, readable: bool = False, keep: Optional[Keep] = None) -> List[Any]:
        """The events that have arrived, without waiting (MSG_DONTWAIT, on a socket without a
        timeout: Python would wait that long first): none when nothing has. Raises Gone once the
        daemon closed the connection and every event before that was returned. Nothing there is
        found by a `poll(0)` (~0.4 µs), not by a receive that raises (~1.2 µs): a loop polling
        tight mostly finds nothing; `readable`: the caller's own poll just found the connection
        readable (no second look). `keep(tag, field)` (`peek`): False for an event its caller has
        no use for (an end the board gave, a notification whose payload it took from the board),
        which is then skipped without decoding. Called by one thread at a time (its caller's lock)."""
        have, ended = self._ahead, False
        if not have and not readable:
            waiter = self._ready_poll
            if waiter is None:
                waiter = self._ready_poll = select.poll()
                waiter.register(self.sock.fileno(), select.POLLIN)
            if not waiter.poll(0):  # (the end of the connection and errors are reported too)
                return []
        while True:
            if have == len(self._buf):
                self._buf.extend(bytes(len(self._buf)))
            room = len(self._buf) - have
            with memoryview(self._buf) as view:
                try:
                    got = self.sock.recv_into(view[have:], 0, socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    break
                except ConnectionResetError:
                    got = 0
            if got == 0:
                ended = True
                break
            have += got
            if got < room:  # all there was (one syscall saved; a later call reads what follows)
                break
        out, start = [], 0
        decode = _proto.message("SessionEvent").FromString
        buf = self._buf
        while have - start >= HEADER.size:
            end = start + HEADER.size + frame_length(buf[start : start + HEADER.size])
            if end > have:
                if end > len(buf):
                    buf.extend(bytes(end - len(buf)))
                break
            if keep is not None and not keep(*peek(buf, start + HEADER.size, end)):
                self.skipped += 1
            else:
                with memoryview(buf) as view:
                    out.append(decode(view[start + HEADER.size : end]))
            start = end
        self.decoded += len(out)
        self._ahead = have - start
        if start and self._ahead:
            self._buf[: self._ahead] = self._buf[start:have]
        if ended and not out:
            raise Gone(sent=True)
        return out

    def _fill(self, need: int, have: int) -> int:
        """Receives until `need` bytes are in the buffer; returns how many there are.

        On a blocking socket (no timeout) it waits in `poll` for POLLIN, not in `recv`: a thread
        asleep in a unix socket's `recv` is also woken (for nothing) when the daemon reads the
        request this thread just sent — the kernel wakes the socket's waiters for room to write,
        and a `recv`'s wait does not filter that out, `poll`'s does (2 context switches a call
        instead of 1 on the 2-core VM; docs/BENCHMARKS.md, "Session 23, client-leg"). With a
        timeout Python itself polls first."""
        with memoryview(self._buf) as view:
            while have < need:
                if self._timeout is None and not self._readable:
                    self._poller().poll()
                self._readable = False
                try:
                    got = self.sock.recv_into(view[have:])
                except ConnectionResetError:
                    got = 0
                if got == 0:
                    raise Gone(sent=True)
                have += got
        return have

    def events(self) -> Iterator[Any]:
        """The daemon's events (SessionEvent), as they come, until it closes the connection: the
        reading side of a connection carrying many requests at once (tcpxd.client.Session)."""
        buf = bytearray()
        chunk = bytearray(64 << 10)
        decode = _proto.message("SessionEvent").FromString
        with memoryview(chunk) as view:
            while True:
                try:
                    got = self.sock.recv_into(view)
                except ConnectionResetError:
                    got = 0
                if got == 0:
                    return
                buf += view[:got]
                start = 0
                while len(buf) - start >= HEADER.size:
                    end = start + HEADER.size + frame_length(buf[start : start + HEADER.size])
                    if len(buf) < end:
                        break
                    yield decode(bytes(buf[start + HEADER.size : end]))
                    start = end
                if start:
                    del buf[:start]

    def close(self) -> None:
        self.sock.close()
        if self.board is not None:
            self.board.close()
        if self.ring is not None:
            self.ring.close()

    def half_close(self) -> None:
        """Sends no more: the daemon finishes what is in flight, then closes the connection."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def shutdown(self) -> None:
        """Wakes whoever waits on it (the daemon cancels its transfer); close() still follows."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def handshake(path: str) -> Optional[Connection]:
    """A new framed session with the daemon at `path`; None when nothing listens there (the gRPC
    call says why). Raises NotLocal when the daemon does not speak it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(HANDSHAKE_TIMEOUT)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            return None
        try:
            sock.sendall(PREFACE)
            got = b""
            while len(got) < len(PREFACE):
                part = sock.recv(len(PREFACE) - len(got))
                if not part:
                    break
                got += part
        except OSError as e:  # socket.timeout included: it waits for more of an HTTP/2 preface
            raise NotLocal(f"{type(e).__name__}: {e}") from None
        if got != PREFACE:
            raise NotLocal(f"answered {got!r}")
        sock.settimeout(None)
        return Connection(sock)
    except BaseException:
        sock.close()
        raise


class NotLocal(Exception):
    """The daemon does not speak the local session (it predates it)."""


_pools: "weakref.WeakSet[LocalSessions]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for pool in list(_pools):
        pool._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class LocalSessions:
    """A client's local sessions: decides once whether the daemon speaks them, keeps the idle
    connections, and runs waited transfers over one (a new one when every other is busy)."""

    def __init__(self, path: str):
        self.path = path
        #: None until the first connection answered or not; False: the client uses gRPC.
        self.available: Optional[bool] = None
        self._lock = threading.Lock()
        self._idle: List[Connection] = []
        self._busy: Set[Connection] = set()
        self._closed = False
        _pools.add(self)

    def run(self, field: str, req: Any, timeout: Optional[float], body: Optional[bytes] = None) -> Optional[TransferResult]:
        """The transfer's result (or its exception); None when it should go through gRPC. `body`:
        the request serialized already (tcpxd._waited), in place of `req`."""
        reused = True
        while True:
            conn = self._take()
            if conn is None:
                conn, reused = self._open(), False
                if conn is None:
                    return None
            try:
                ev = conn.exchange(field, req, timeout, body=body)
            except Gone as e:
                self._drop(conn)
                if self._closed:
                    raise Cancelled("the client was closed while the transfer waited") from None
                if not e.sent and reused:
                    continue  # an idle connection the daemon had closed (it restarted): a new one
                # Unanswered: the daemon cancels what it had started, or it drains and never read
                # the request: the gRPC call gets its own answer.
                return None
            except socket.timeout:
                self._drop(conn)  # closing it cancels the transfer in the daemon
                raise DeadlineExceeded(
                    f"no answer from the daemon {BACKSTOP} s past the transfer's timeout of {timeout} s "
                    "(the transfer was cancelled)"
                ) from None
            except OSError as e:
                self._drop(conn)
                raise Unavailable(f"local session with {self.path}: {e}") from None
            except BaseException:
                self._drop(conn)  # e.g. KeyboardInterrupt: the daemon cancels the transfer
                raise
            if ev is None:
                self._give_back(conn)
                return None  # too large for a frame
            if type(ev) is tuple:  # its OK end, from the board
                self._give_back(conn)
                return _ops.done_result(*ev)
            if ev.tag == conn.tag:
                self._give_back(conn)
            else:
                self._drop(conn)  # tag 0: the daemon refused the frame and closes the connection
            return answer(ev, conn.tag)

    def _take(self) -> Optional[Connection]:
        with self._lock:
            if self._closed or not self._idle:
                return None
            conn = self._idle.pop()
            self._busy.add(conn)
            return conn

    def connect(self) -> Optional[Connection]:
        """A new connection of the client's own (not the pool's: tcpxd.client.Session takes one);
        None when the client uses gRPC (an older daemon, found out once; nothing listening)."""
        if self.available is False or self._closed:
            return None
        try:
            conn = handshake(self.path)
        except NotLocal:
            self.available = False
            return None
        if conn is not None:
            self.available = True
        return conn

    def _open(self) -> Optional[Connection]:
        conn = self.connect()
        if conn is None:
            return None
        try:  # its completion board (none where the daemon gives none: events alone)
            conn.board = _board.attach(conn, HANDSHAKE_TIMEOUT)
            if conn.board is not None:  # (and its request ring, where the board is: tcpxd._ring)
                conn.ring = _ring.attach(conn, HANDSHAKE_TIMEOUT)
        except (Gone, OSError):
            conn.close()  # (it failed at once: the gRPC call gets its own answer)
            return None
        with self._lock:
            if not self._closed:
                self._busy.add(conn)
                return conn
        conn.close()
        return None

    def _give_back(self, conn: Connection) -> None:
        with self._lock:
            self._busy.discard(conn)
            if not self._closed:
                self._idle.append(conn)
                return
        conn.close()

    def _drop(self, conn: Connection) -> None:
        with self._lock:
            self._busy.discard(conn)
        conn.close()

    def _forget(self) -> None:
        """In a forked child: the parent's connections are not this process's to use."""
        for conn in self._idle + list(self._busy):
            conn.close()  # this process's descriptor only: the parent's connection stays open
        self._idle, self._busy = [], set()
        self._lock = threading.Lock()

    def close(self) -> None:
        """Closes the idle connections; a transfer waiting on a busy one ends Cancelled (the
        daemon cancels it)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            busy = list(self._busy)
        for conn in idle:
            conn.close()
        for conn in busy:
            conn.shutdown()
