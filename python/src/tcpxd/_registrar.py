"""The client's connection for registering its host memory with the daemon (`Registrar`): one
local session of its own, kept open while the client lives, its registrations by descriptor and by
address, in batches, pipelined, and (since session 21) sent without waiting for their answers
(`hold_addresses`, `collect`: docs/NIXL.md, "Registration that does not wait"; held back until
the connection's next message or first use since session 22). Split out of
tcpxd._hostmem, which re-exports these names."""

from __future__ import annotations

import array
import collections
import contextlib
import os
import socket
import sys
import threading
from typing import TYPE_CHECKING, Any, Deque, Iterator, List, Optional, Sequence, Tuple

from . import _local, _proto
from ._addresses import _key, _varint, address_entries
from .errors import FailedPrecondition, InvalidArgument, TcpxdError, Unavailable, from_status

if TYPE_CHECKING:
    from ._hostmem import Shared

#: Registrations sent before their answers are read (`Registrar.register_many`): few enough that
#: their answers fit the socket's buffer, so neither side blocks on the other.
PIPELINE = 64
#: `register_batch` and `release_batch` frames of memory by address sent before the first
#: answer is read (`Registrar.register_addresses`, `release_many`): the daemon carries out the
#: next while this process reads the last; their answers (~20 KB a registration frame) fit the
#: socket's buffer together.
FRAMES = 4
#: Bytes of answers held registrations' frames leave unread at most (`Registrar._room`):
#: well under a unix socket's default send buffer (net.core.wmem_default, 208 KiB), which the
#: daemon's answers fill before it blocks; and at most MAX_UNANSWERED frames.
ANSWER_ROOM = 128 << 10
MAX_UNANSWERED = 64

def registered(ev: Any, tag: int) -> Any:
    """The Buffer message the daemon's answer carries; raises its refusal."""
    kind = ev.WhichOneof("event")
    if kind == "refused":
        raise from_status(ev.refused.code, ev.refused.message)
    if ev.tag != tag or kind != "registered":
        raise TcpxdError(f"local session: the daemon answered tag {ev.tag} ({kind}) to registration {tag}")
    return ev.registered


def _registered_each(conn: _local.Connection, tags: Sequence[int]) -> List[Any]:
    """The answers to registrations sent as `tags`, in order: each one's Buffer message, or the
    TcpxdError refusing it."""
    out: List[Any] = []
    for tag in tags:
        try:
            out.append(registered(conn.receive(), tag))
        except TcpxdError as e:
            out.append(e)
    return out


def _unreleased(n: int) -> List[Any]:
    """What release_many answers for ids it did not get to release."""
    return [FailedPrecondition("release: not released by a batch") for _ in range(n)]


class _Known:
    available: Optional[bool] = None


class Pending:
    """Registrations of memory by address held back and sent without waiting for their answers
    (`Registrar.hold_addresses`): per region, once `Registrar.collect` read it, its `Answer`
    or the TcpxdError that refused it."""

    __slots__ = ("addrs", "tails", "got", "frames", "lost", "held")

    def __init__(self, addrs: Any, tails: Sequence[bytes]):
        self.addrs = addrs
        self.tails = tails
        self.got: List[Any] = [None] * len(tails)
        #: Its frames not answered yet.
        self.frames = 0
        #: The local session ended before some of its answers came (they are registered again,
        #: on a new one, by `collect`).
        self.lost: Optional[TcpxdError] = None
        #: Not sent yet (`Registrar.hold_addresses`): it goes with the connection's next
        #: message, or when collected; withdrawn unsent by `Registrar.withdraw`.
        self.held = False


class OldDaemon(FailedPrecondition):
    """The daemon does not speak the local session: it cannot take host memory by descriptor."""


class Registrar:
    """The client's connection for registering its host memory: one local session of its own, kept
    open while the client lives (the daemon releases the buffers registered on it when it closes),
    one registration at a time."""

    def __init__(self, path: str, known: Any = None):
        self.path = path
        self._lock = threading.Lock()
        self._conn: Optional[_local.Connection] = None
        self._closed = False
        self._pid = os.getpid()
        #: False once the daemon turned out not to know `register_batch` (registrations then go
        #: one request each, pipelined).
        self._batches: Optional[bool] = None
        #: Whether the daemon registered memory of this process by address on this connection:
        #: it may attach to it (ptrace access), known once a session (`_flush`).
        self._attach_ok = False
        #: The largest answer a registration has had, in bytes (frame overhead included).
        self._entry_bytes = 0
        #: `register_batch` frames sent of held registrations and not answered yet, in order:
        #: (tag, first region, end, the Pending they belong to).
        self._unanswered: Deque[Tuple[int, int, int, Pending]] = collections.deque()
        #: Registrations held back (`hold_addresses`), not sent yet, in order.
        self._held: Deque[Pending] = collections.deque()
        #: What the client found out about the daemon's local session (`available`): its pool of
        #: local sessions, shared so the daemon is asked once; else this registrar's own.
        self._known = known if known is not None else _Known()

    @property
    def available(self) -> Optional[bool]:
        """False once the daemon turned out not to speak the local session (it predates it)."""
        return self._known.available

    @available.setter
    def available(self, value: Optional[bool]) -> None:
        self._known.available = value

    @contextlib.contextmanager
    def _talking(self, what: str, timeout: Optional[float]) -> Iterator[None]:
        """The local session's silence or end while doing `what` (`register_host`, `release`): the
        connection is dropped (the next call opens one) and Unavailable says which."""
        try:
            yield
        except socket.timeout:
            self._drop()
            raise Unavailable(f"{what}: no answer from the daemon at {self.path} within {timeout} s") from None
        except (_local.Gone, OSError) as e:
            self._drop()
            raise Unavailable(f"{what}: the local session with {self.path} ended: {e!r}") from None

    def register(self, shared: Shared, label: str, timeout: Optional[float]) -> Any:
        """Registers the memory; returns the daemon's Buffer message."""
        try:
            with self._lock:
                conn = self._connection()
                with self._talking("register_host", timeout):
                    self._settle(conn, timeout)
                    [(field, req)] = shared.session_op(label).items()
                    ev = conn.exchange(field, req, timeout, fd=shared.sent_fd)
                return registered(ev, conn.tag)
        finally:
            shared.done_sending()

    def register_many(self, items: Sequence[Tuple[Shared, Sequence[Any]]], label: str, timeout: Optional[float]) -> List[Any]:
        """Registers each memory with its block lists (StridedBlocks, made by the daemon on the new
        buffer): the daemon's Buffer message, or the TcpxdError refusing it, per memory in order.
        PIPELINE at a time go in one `register_batch` frame, their descriptors with it; to a
        daemon without it, PIPELINE requests go out before their answers are read (one round trip
        for each PIPELINE, not each memory, either way)."""
        try:
            with self._lock:
                conn = self._connection()
                with self._talking("register_host", timeout):
                    self._settle(conn, timeout)
                    return self._many_now(conn, items, label, timeout)
        finally:
            for shared, _ in items:
                shared.done_sending()

    def _many_now(self, conn: _local.Connection, items: Sequence[Tuple[Shared, Sequence[Any]]], label: str,
                  timeout: Optional[float]) -> List[Any]:
        """`register_many` on `conn`, nothing else unanswered on it (the lock held)."""
        out: List[Any] = []
        start = 0
        while self._batches is not False and start < len(items):
            got = self._batch(conn, items[start : start + PIPELINE], label, timeout)
            if got is None:
                self._batches = False  # the daemon predates register_batch
                break
            self._batches = True
            out.extend(got)
            start += len(got)
        for at in range(start, len(items), PIPELINE):
            tags = []
            for shared, lists in items[at : at + PIPELINE]:
                [(field, req)] = shared.session_op(label).items()
                req.block_lists.extend(lists)
                try:
                    if not conn.send(field, req, timeout, fd=shared.sent_fd):
                        raise InvalidArgument("register_host: the registration is too large for a frame")
                finally:
                    shared.done_sending()
                tags.append(conn.tag)
            out.extend(_registered_each(conn, tags))
        return out

    def _batch(self, conn: _local.Connection, items: Sequence[Tuple[Shared, Sequence[Any]]], label: str,
               timeout: Optional[float]) -> Optional[List[Any]]:
        """One `register_batch` of `items`: per memory, its Buffer message or the TcpxdError
        refusing it; None when the daemon does not know the request (it refused the frame's op)."""
        try:
            _send_batch(conn, items, label, timeout)
        finally:
            for shared, _ in items:
                shared.done_sending()
        return _batch_answer(conn, len(items), conn.tag)

    def register_addresses(self, addrs: Any, tails: Sequence[bytes], timeout: Optional[float]) -> List[Any]:
        """Registers memory of this process by address, region i at `addrs[i]` (u64s: an
        array.array("Q") or a numpy array) with the rest of its request serialized in `tails[i]` (`address_tail`): per
        region, its `Answer` or the TcpxdError refusing it. As `register_many`, PIPELINE to a
        `register_batch` frame, its entries written without a message object each
        (`address_entries`), answered as arrays (`packed_answer`: `unpack`); to a daemon without
        it, one request each, pipelined."""
        with self._lock:
            conn = self._connection()
            with self._talking("register_host", timeout):
                self._settle(conn, timeout)
                return self._addresses_now(conn, addrs, tails, timeout)

    def _addresses_now(self, conn: _local.Connection, addrs: Any, tails: Sequence[bytes],
                       timeout: Optional[float]) -> List[Any]:
        """`register_addresses` on `conn`, nothing else unanswered on it (the lock held)."""
        out: List[Any] = []
        n = len(tails)
        start = 0
        sent: List[Tuple[int, int, int]] = []  # (first region, end, tag) of frames unanswered
        key = _key("SessionRequest", "register_batch")
        while self._batches is not False and (start < n or sent):
            while start < n and len(sent) < FRAMES:
                end = min(n, start + PIPELINE)
                body = address_entries(addrs[start:end], list(tails[start:end])) + PACKED
                if not conn.send_body(key, body, timeout):
                    raise InvalidArgument("register_host: the registrations are too large for a frame")
                sent.append((start, end, conn.tag))
                start = end
            first, end, tag = sent.pop(0)
            got = _address_answers(conn, end - first, tag, self)
            if got is None:  # the daemon predates register_batch: it refuses every frame
                for _ in sent:
                    _batch_answer(conn, 0, 0)
                self._batches, start = False, first
                break
            self._batches = True
            self._attach_ok = self._attach_ok or any(not isinstance(g, TcpxdError) for g in got)
            out.extend(got)
        R = _proto.message("RegisterClientMemoryRequest")
        for at in range(start, n, PIPELINE):
            tags = []
            for j in range(at, min(n, at + PIPELINE)):
                req = R.FromString(b"\x08" + _varint(int(addrs[j])) + tails[j])
                if not conn.send("register_client_memory", req, timeout):
                    raise InvalidArgument("register_host: the registration is too large for a frame")
                tags.append(conn.tag)
            out.extend(e if isinstance(e, TcpxdError) else answer_of(e) for e in _registered_each(conn, tags))
        return out

    def hold_addresses(self, addrs: Any, tails: Sequence[bytes]) -> Optional[Pending]:
        """`register_addresses` held back (since session 22): nothing is sent now. The
        registrations go out with the connection's next message (any call of this registrar sends
        what is held first, in order) or when `collect` wants their answers; `withdraw` takes them
        back unsent (a deregistration before any use: the daemon never hears of them). Sent as
        `register_batch` frames whose answers are read later (at most as many unanswered as their
        answers fit the socket's buffer: neither side blocks on the other) where the connection
        is known to take them and, for memory by address, the daemon to be allowed to attach to
        this process (a registration by address answered on it); else registered and answered
        there and then, which finds those out. None once closed (the caller's
        `register_addresses` says so)."""
        pending = Pending(addrs, tails)
        return pending if self.hold(pending) else None

    def hold(self, pending: Pending) -> bool:
        """`hold_addresses` of a Pending made by the caller (tcpxd.nixl's record of a
        `register_memory` call is one, so a lone region's makes one object); False once closed
        (nothing held)."""
        with self._lock:  # (a forked child's: sent on a connection of its own, `_connection`)
            if self._closed:
                return False
            pending.held = True
            self._held.append(pending)
        return True

    def withdraw(self, pending: Pending) -> bool:
        """Takes back registrations held and not sent yet (True: the daemon never heard of them;
        False: already sent, so they are answered and released as any)."""
        with self._lock:
            if not pending.held:
                return False
            self._held.remove(pending)
            pending.held = False
        return True

    def send_held(self, timeout: Optional[float]) -> None:
        """Sends what is held now (their answers read later, by `collect`)."""
        with self._lock:
            if not self._held:
                return
            conn = self._connection()
            with self._talking("register_host", timeout):
                self._flush(conn, timeout)

    def _flush(self, conn: _local.Connection, timeout: Optional[float]) -> None:
        """Sends every held registration, oldest first (the lock held)."""
        while self._held:
            pending = self._held[0]
            if self._batches is not True or not self._attach_ok:
                # Not known yet whether the daemon takes them so: registered now, answered here.
                while self._unanswered:
                    self._read_one(conn)
                self._held.popleft()
                pending.held = False
                try:
                    pending.got = self._addresses_now(conn, pending.addrs, pending.tails, timeout)
                except BaseException as e:
                    pending.lost = e if isinstance(e, TcpxdError) else Unavailable(f"register_host: {e!r}")
                    raise
                continue
            self._held.popleft()
            pending.held = False
            n = len(pending.tails)
            key = _key("SessionRequest", "register_batch")
            try:
                for start in range(0, n, PIPELINE):
                    while len(self._unanswered) >= self._room():
                        self._read_one(conn)
                    end = min(n, start + PIPELINE)
                    body = address_entries(pending.addrs[start:end], list(pending.tails[start:end])) + PACKED
                    if not conn.send_body(key, body, timeout):
                        raise InvalidArgument("register_host: the registrations are too large for a frame")
                    self._unanswered.append((conn.tag, start, end, pending))
                    pending.frames += 1
            except BaseException as e:  # (what was not sent is registered again by `collect`)
                if pending.lost is None:
                    pending.lost = e if isinstance(e, TcpxdError) else Unavailable(f"register_host: {e!r}")
                raise

    def collect(self, pending: Pending, timeout: Optional[float]) -> List[Any]:
        """The answers to held registrations (`hold_addresses`), sent now if they were not and
        read now if they were not: per region, its `Answer` or the TcpxdError refusing it. Where
        the local session ended before they came (the daemon released what it registered on it),
        they are registered again on a new one; raises what that raises (Unavailable: no
        daemon)."""
        with self._lock:
            try:
                tries = 2
                while pending.held:
                    tries -= 1
                    try:
                        opened = self._connection()
                        with self._talking("register_host", timeout):
                            self._flush(opened, timeout)
                    except Unavailable:
                        if not pending.held:
                            break  # (sent; or lost on the way: registered again below)
                        if not tries:
                            raise
                        # (a connection found gone, e.g. a daemon restart not noticed yet: once
                        # more, on a new one)
            finally:
                if pending.held:  # (not sent: what stopped it is raised for it)
                    self._held.remove(pending)
                    pending.held = False
            conn = self._conn
            if pending.frames and pending.lost is None and conn is not None:
                try:
                    with self._talking("register_host", timeout):
                        while pending.frames and pending.lost is None:
                            self._read_one(conn)
                except Unavailable:
                    pass  # (`pending.lost` says so: registered again below)
        if pending.lost is not None:
            redo = [i for i, g in enumerate(pending.got) if g is None]
            got = self.register_addresses(array.array("Q", [pending.addrs[i] for i in redo]),
                                          [pending.tails[i] for i in redo], timeout)
            for i, g in zip(redo, got):
                pending.got[i] = g
            pending.lost = None
        return pending.got

    def _room(self) -> int:
        """How many frames held registrations (`_flush`) may leave unanswered: as many as the
        answers seen so far say fit ANSWER_ROOM (the daemon blocks writing an answer the socket
        has no room for, and reads nothing meanwhile), at least FRAMES."""
        if not self._entry_bytes:
            return FRAMES
        return max(FRAMES, min(MAX_UNANSWERED, ANSWER_ROOM // (self._entry_bytes * PIPELINE)))

    def _answered(self, size: int, n: int) -> None:
        """An answer of `size` bytes to `n` registrations came (what `_room` goes by)."""
        self._entry_bytes = max(self._entry_bytes, -(-size // n) + 16)

    def _read_one(self, conn: _local.Connection) -> None:
        """Reads the answer to the oldest frame `_flush` sent into its Pending."""
        tag, start, end, pending = self._unanswered.popleft()
        pending.frames -= 1
        try:
            got = _address_answers(conn, end - start, tag, self)
        except TcpxdError as e:  # the frame refused whole: each of its regions refused so
            got = [e] * (end - start)
        if got is None:  # (not sent to a daemon without register_batch: never so)
            got = [TcpxdError("register_batch: the daemon refused the op") for _ in range(end - start)]
        pending.got[start:end] = got

    def _settle(self, conn: _local.Connection, timeout: Optional[float]) -> None:
        """Sends what is held, then reads every answer the held registrations' frames still have
        coming (before the answer of a request sent now: the daemon answers in order)."""
        self._flush(conn, timeout)
        while self._unanswered:
            self._read_one(conn)

    def release_many(self, ids: Sequence[int], timeout: Optional[float]) -> Optional[List[Any]]:
        """Releases buffers registered on this connection, PIPELINE to a `release_batch` (FRAMES
        of them sent before the first answer is read): per id,
        None (released) or the TcpxdError the daemon answered (a buffer a transfer still uses is
        not released: FailedPrecondition); None for all when the daemon does not know the request
        or no connection is open (the caller releases them one by one)."""
        if self._batches is False or not ids:
            return None
        out: List[Any] = []
        with self._lock:
            if self._conn is None or self._pid != os.getpid():
                return None
            conn = self._conn
            R = _proto.message("ReleaseBatchRequest")
            with self._talking("release", timeout):
                self._settle(conn, timeout)
                at = 0
                sent: List[Tuple[int, int]] = []  # (ids in the frame, its tag), unanswered
                while at < len(ids) or sent:
                    while at < len(ids) and len(sent) < FRAMES:
                        chunk = list(ids[at : at + PIPELINE])
                        if not conn.send("release_batch", R(buffer_ids=chunk), timeout):
                            raise InvalidArgument("release: the ids are too large for a frame")
                        sent.append((len(chunk), conn.tag))
                        at += len(chunk)
                    count, tag = sent.pop(0)
                    ev = conn.receive()
                    kind = ev.WhichOneof("event")
                    if kind == "refused" and ev.refused.code == 3 and ev.refused.message.startswith("op: set one of"):
                        for _ in sent:  # (refused likewise)
                            conn.receive()
                        self._batches = False  # the daemon predates release_batch
                        return out + _unreleased(len(ids) - len(out)) if out else None
                    if kind != "released_batch" or ev.tag != tag or len(ev.released_batch.statuses) != count:
                        raise TcpxdError(f"local session: the daemon answered tag {ev.tag} ({kind}) to release {tag}")
                    out.extend(None if st.code == 0 else from_status(st.code, st.message) for st in ev.released_batch.statuses)
        return out

    def register_fd(self, fd: int, req: Any, timeout: Optional[float]) -> Any:
        """Sends `req` (a RegisterHostFdRequest) with `fd` (kept open: the caller's); returns the
        daemon's Buffer message. A re-attach after a restart goes this way."""
        with self._lock:
            conn = self._connection()
            with self._talking("register_host", timeout):
                self._settle(conn, timeout)
                ev = conn.exchange("register_host_fd", req, timeout, fd=fd)
            return registered(ev, conn.tag)

    def register_by_address(self, req: Any, timeout: Optional[float]) -> Any:
        """Sends `req` (a RegisterClientMemoryRequest); returns the daemon's Buffer message. A
        re-attach after a restart goes this way."""
        with self._lock:
            conn = self._connection()
            with self._talking("register_host", timeout):
                self._settle(conn, timeout)
                ev = conn.exchange("register_client_memory", req, timeout)
            return registered(ev, conn.tag)

    def reset(self) -> None:
        """Forgets the connection (the daemon it went to is gone): the next registration opens one."""
        with self._lock:
            self._drop()

    def _connection(self) -> _local.Connection:
        if self._closed:
            raise TcpxdError("the client is closed")
        if self._pid != os.getpid():  # a forked child: the parent's connection is not ours
            if self._conn is not None:
                self._conn.close()
            self._conn, self._pid = None, os.getpid()
        if self._conn is None:
            try:
                if self.available is False:
                    raise _local.NotLocal("found out before")
                conn = _local.handshake(self.path)
            except _local.NotLocal as e:
                self.available = False
                raise OldDaemon(
                    f"register_host: the daemon at {self.path} does not speak the local session ({e}); "
                    "it predates host memory registration: upgrade it, or use register_host(size, shared=False)"
                ) from None
            if conn is None:
                raise Unavailable(f"register_host: nothing answers at {self.path}")
            self._conn, self.available = conn, True
        return self._conn

    def speaks_local(self) -> bool:
        """Whether the daemon speaks the local session (connects to find out, once)."""
        if self.available is None:
            try:
                with self._lock:
                    self._connection()
            except OldDaemon:
                pass
        return self.available is not False

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._attach_ok = False
        while self._unanswered:  # (registered again on a new connection by `collect`)
            _, _, _, pending = self._unanswered.popleft()
            pending.frames -= 1
            pending.lost = Unavailable(f"register_host: the local session with {self.path} ended before the daemon answered")

    def close(self) -> None:
        """Closes the connection: the daemon releases the buffers registered on it (what is held
        is never sent)."""
        with self._lock:
            self._closed = True
            self._drop()
            held, self._held = list(self._held), collections.deque()
        for pending in held:
            pending.held = False
            pending.lost = TcpxdError("the client is closed")


#: A region registered by address, as `register_addresses` and `collect` answer it: (buffer id,
#: descriptor, lists), `lists` a tuple of (list id, block count, token, the TcpxdError refusing
#: it or None) per list asked for, in order (empty from a daemon that makes no lists with a
#: registration).
Answer = Tuple[int, str, Tuple[Tuple[int, int, str, Optional[TcpxdError]], ...]]

#: `RegisterBatchRequest.packed_answer = true` (field 420, a varint), appended to a batch's
#: serialized entries: the daemon answers with arrays (`unpack`).
PACKED = _varint(420 << 3) + b"\x01"


def answer_of(b: Any) -> Answer:
    """The `Answer` of a Buffer message (a daemon without the packed answer)."""
    lists = tuple((int(bl.id), int(bl.count), str(bl.token),
                   None if st.code == 0 and bl.id else from_status(st.code, st.message or "the list was not made"))
                  for bl, st in zip(b.block_lists, b.block_list_status))
    return int(b.id), str(b.descriptor), lists


def unpack(p: Any, n: int) -> List[Any]:
    """A PackedRegistrations of `n` entries read into their `Answer`s (or the TcpxdError refusing
    each): its arrays read whole, one string slice a descriptor or token, no message an entry."""
    ids, lids, counts, ends = array.array("Q"), array.array("Q"), array.array("Q"), array.array("I")
    ids.frombytes(p.buffer_ids)
    lids.frombytes(p.list_ids)
    counts.frombytes(p.list_counts)
    ends.frombytes(p.text_ends)
    if sys.byteorder != "little":
        for a in (ids, lids, counts, ends):
            a.byteswap()
    per = p.entry_lists
    if len(ids) != n or len(per) != n or len(lids) != len(counts) or sum(per) != len(lids) or len(ends) != n + len(lids):
        raise TcpxdError(f"local session: the daemon's packed answer does not describe {n} registrations")
    text = p.text.decode("ascii")
    refused = {int(i): st for i, st in zip(p.refused_entries, p.refused)}
    lists_refused = {int(i): st for i, st in zip(p.refused_lists, p.lists_refused)}
    out: List[Any] = []
    at = s = slot = 0
    for i in range(n):
        e = ends[s]
        s += 1
        if not ids[i]:
            st = refused.get(i)
            out.append(from_status(st.code, st.message) if st is not None else TcpxdError(f"register_batch.entries[{i}]: refused"))
            at = e
            continue
        desc = text[at:e]
        at = e
        lists = []
        for _ in range(per[i]):
            e = ends[s]
            s += 1
            st = lists_refused.get(slot)
            lists.append((lids[slot], counts[slot], text[at:e], None if st is None else from_status(st.code, st.message)))
            at = e
            slot += 1
        out.append((ids[i], desc, tuple(lists)))
    return out


def _address_answers(conn: _local.Connection, n: int, tag: int, seen: Optional["Registrar"] = None) -> Optional[List[Any]]:
    """The answer to a `register_batch` of `n` registrations by address sent with `tag` and
    PACKED: per registration, its `Answer` or the TcpxdError refusing it (from Buffer messages
    where the daemon predates the packed answer); None when the daemon does not know the
    request."""
    got = _batch_event(conn, tag)
    if got is None:
        return None
    if seen is not None and n:
        seen._answered(got.ByteSize(), n)
    if got.HasField("packed"):
        return unpack(got.packed, n)
    if len(got.buffers) != n or len(got.statuses) != n:
        raise TcpxdError(f"local session: the daemon answered {len(got.buffers)} registrations of {n}")
    return [answer_of(b) if st.code == 0 else from_status(st.code, st.message) for b, st in zip(got.buffers, got.statuses)]


def _batch_answer(conn: _local.Connection, n: int, tag: int) -> Optional[List[Any]]:
    """The answer to the `register_batch` of `n` registrations sent with `tag`: per registration,
    its Buffer message or the TcpxdError refusing it; None when the daemon does not know the
    request."""
    got = _batch_event(conn, tag)
    if got is None:
        return None
    if len(got.buffers) != n or len(got.statuses) != n:
        raise TcpxdError(f"local session: the daemon answered {len(got.buffers)} registrations of {n}")
    return [b if st.code == 0 else from_status(st.code, st.message) for b, st in zip(got.buffers, got.statuses)]


def _batch_event(conn: _local.Connection, tag: int) -> Any:
    """The RegisteredBatch answering the `register_batch` sent with `tag`; None when the daemon
    does not know the request (it refused the frame's op); raises a refusal of the whole frame."""
    ev = conn.receive()
    kind = ev.WhichOneof("event")
    if kind == "refused":
        if ev.refused.code == 3 and ev.refused.message.startswith("op: set one of"):  # INVALID_ARGUMENT
            return None
        raise from_status(ev.refused.code, ev.refused.message)
    if ev.tag != tag or kind != "registered_batch":
        raise TcpxdError(f"local session: the daemon answered tag {ev.tag} ({kind}) to registration {tag}")
    return ev.registered_batch


def _send_batch(conn: _local.Connection, items: Sequence[Tuple[Shared, Sequence[Any]]], label: str,
                timeout: Optional[float]) -> None:
    """Sends one `register_batch` of `items` (each memory with its block lists), the descriptors
    of those handed over by descriptor with it."""
    entry = _proto.message("RegisterBatchEntry")
    entries, fds = [], []
    for shared, lists in items:
        [(field, req)] = shared.session_op(label).items()
        req.block_lists.extend(lists)
        entries.append(entry(**{"host_fd" if field == "register_host_fd" else "client_memory": req}))
        if shared.sent_fd is not None:
            fds.append(shared.sent_fd)
    batch = _proto.message("RegisterBatchRequest")(entries=entries)
    if not conn.send("register_batch", batch, timeout, fds=fds):
        raise InvalidArgument("register_host: the registrations are too large for a frame")
