"""A transfer handle's life: posted as the plan's daemon requests on the agent's session, polled,
re-posted, cancelled on release, timed for telemetry."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, List, Optional, Sequence

from .. import _proto
from ..errors import Cancelled, TcpxdError
from ._errors import nixlNotFoundError, nixlRepostActiveError
from . import _wire


class nixlXferTelemetry:  # noqa: N801 - NIXL's name (nixl._bindings.nixlXferTelemetry)
    """A transfer's telemetry: startTime (µs since the epoch), postDuration and xferDuration (µs:
    the transfer() call, and from the post to completion), totalBytes, descCount."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")

    def __init__(self, startTime: int = 0, postDuration: int = 0, xferDuration: int = 0, totalBytes: int = 0, descCount: int = 0):  # noqa: N803
        self.startTime = startTime
        self.postDuration = postDuration
        self.xferDuration = xferDuration
        self.totalBytes = totalBytes
        self.descCount = descCount

    def __repr__(self) -> str:
        return (f"nixlXferTelemetry(startTime={self.startTime}, postDuration={self.postDuration}, "
                f"xferDuration={self.xferDuration}, totalBytes={self.totalBytes}, descCount={self.descCount})")


class _Part:
    """One daemon request of a transfer, as the session resolves it (duck-typed as a Future:
    set_result / set_exception from the session's reader; `tag` for cancel)."""

    __slots__ = ("tag", "xfer", "gen", "finished", "answered")

    #: The session settles it with None for a transfer that finished OK (`_ops.settle`): only
    #: whether it did matters here.
    skips_result = True

    def __init__(self, xfer: "Xfer", gen: int, answered: Optional[Callable[[], None]] = None):
        self.tag = 0
        self.xfer = xfer
        self.gen = gen
        self.finished = False
        #: Called once the daemon answered the request (its index window is free again).
        self.answered = answered

    def done(self) -> bool:
        return self.finished

    def _answer(self) -> None:
        cb, self.answered = self.answered, None
        if cb is not None:
            cb()

    def set_result(self, _result: Any) -> None:
        self.finished = True
        self._answer()
        self.xfer._done(self.gen, None)

    def set_exception(self, err: BaseException) -> None:
        self.finished = True
        self._answer()
        self.xfer._done(self.gen, err)


class Xfer:
    """What a nixl_xfer_handle stands for. States: "INIT" (never posted), "PROC", "DONE", "ERR".

    A transfer of several daemon requests (parts) is DONE when every part is, ERR as soon as one
    fails (the others are cancelled); a notification that rides none of them goes once all are
    done (`followup`).

    Made once a request (vLLM makes one a transfer): what only a post changes is read from the
    class until then (no __slots__: the constructor sets four attributes, not fifteen)."""

    #: `notif` framed for the remote agent (by the agent, on the first post that sends it).
    framed: Optional[bytes] = None
    #: The same as a prepared request's notification field (the lane's outer-sum requests).
    note_field: Optional[bytes] = None
    state = "INIT"
    #: Why it ended in "ERR" (a tcpxd exception naming the daemon's reason).
    error: Optional[BaseException] = None
    released = False
    _gen = 0
    _parts: Sequence[_Part] = ()
    _left = 0
    _session: Any = None
    _followup: Optional[Callable[[Any, Any], None]] = None
    #: Whether it is timed for telemetry (the agent captures it): else no clock is read.
    timed = False
    #: The last post's start (perf_counter) and, in µs, its start since the epoch (worked out
    #: from the wall clock when first asked: no second clock read in the post), the post's
    #: duration and the transfer's (`telemetry`).
    _t0 = 0.0
    _start_us = 0
    _post_us = 0
    _xfer_us = 0

    def __init__(self, plan: Any, remote: str, notif: bytes, timed: bool = True):
        #: A Plan, or a _plan.Prepared (the prepared path's request, bound to a session when posted).
        self.plan = plan
        self.remote = remote
        self.notif = notif
        self._lock = threading.Lock()
        if timed:
            self.timed = True

    @property
    def telemetry(self) -> Optional[nixlXferTelemetry]:
        """Its telemetry as it stands (a new object each time, as NIXL returns a copy), when timed;
        else None."""
        if not self.timed:
            return None
        start = self._start_us
        if not start and self._t0:  # the wall clock now, less the post's age on the monotonic one
            start = self._start_us = time.time_ns() // 1000 - int((time.perf_counter() - self._t0) * 1e6)
        plan = self.plan
        post, xfer = self._post_us, self._xfer_us
        if xfer and post and xfer < post:  # done before transfer() returned: as NIXL, seen done once it had
            xfer = post
        return nixlXferTelemetry(start, post, xfer, plan.total_bytes, plan.desc_count)

    def _begin(self, session: Any, followup: Optional[Callable[[Any, Any], None]], parts: int,
               answered: Optional[Callable[[], None]]) -> List[_Part]:
        """A post's start, under the lock: refuses a released handle or one still in progress;
        else the next generation in "PROC", its parts (the first calls `answered`)."""
        if self.released:
            raise nixlNotFoundError("handle: released")
        if self.state == "PROC":
            raise nixlRepostActiveError("handle: its previous transfer is still in progress (check_xfer_state says PROC)")
        gen = self._gen = self._gen + 1
        first = _Part(self, gen, answered)
        self._parts = [first] if parts == 1 else [first] + [_Part(self, gen) for _ in range(parts - 1)]
        self.state, self.error, self._session, self._followup, self._left = "PROC", None, session, followup, parts
        if self.timed:
            self._t0 = time.perf_counter()
            self._start_us = self._post_us = self._xfer_us = 0
        return self._parts

    def post_one(self, session: Any, field: str, body: Any, answered: Optional[Callable[[], None]],
                 key: Optional[bytes] = None) -> str:
        """`post` of one request serialized whole (the prepared path's, bound to the session, its
        notification in it), as one frame: `body` bytes (`Session._submit_frame`), or a tuple of
        bytes whose concatenation it is, with its field's `key` (`Session._submit_joined`)."""
        with self._lock:
            part = self._begin(session, None, 1, answered)[0]
        try:
            if key is None:
                session._submit_frame(field, body, part)
            else:
                session._submit_joined(field, key, body, part)
        except TcpxdError as e:  # the session was closed under us: nothing was sent
            self._unsent(part, e)
            raise
        if self.timed or part.gen != self._gen:  # telemetry to record, or released while posting
            return self._posted(session, part.gen)
        return self.state

    def post(self, session: Any, ride: bytes, followup: Optional[Callable[[Any, Any], None]],
             bodies: Optional[List[Any]] = None, answered: Optional[Callable[[], None]] = None) -> str:
        """Submits the plan's requests (or `bodies`, the prepared path's one request, bound to
        the session): `ride`, the framed notification the (single) WRITE request carries;
        `followup(session, sink)`, what sends the notification once every request finished, when
        it rides none of them; `answered()`, called once the daemon answered the first request
        (not when this raises: nothing was sent then)."""
        if bodies is None:
            bodies = self.plan.bodies
        with self._lock:
            parts = self._begin(session, followup, len(bodies), answered)
        if ride:
            note = self.plan.notif_key + _wire.varint(len(ride)) + ride
            bodies = [bodies[0] + note if isinstance(bodies[0], bytes) else [*bodies[0], note]]
        try:
            session._submit_encoded(self.plan.field, bodies, parts)
        except TcpxdError as e:  # the session was closed under us: nothing was sent
            self._unsent(parts[0], e)
            raise
        return self._posted(session, parts[0].gen)

    def _unsent(self, first: _Part, err: TcpxdError) -> None:
        """A post whose requests could not be sent: ERR (nothing calls `answered`)."""
        first.answered = None
        with self._lock:
            if first.gen == self._gen and self.state == "PROC":
                self._end("ERR", err)

    def _posted(self, session: Any, gen: int) -> str:
        """A post's end: its telemetry's postDuration; its parts cancelled if the handle was
        released while posting (an int read: no lock)."""
        if self.timed:
            self._post_us = int((time.perf_counter() - self._t0) * 1e6)
        if gen != self._gen:
            for p in self._parts:
                if not p.finished:
                    _cancel(session, p)
        return self.state

    def _done(self, gen: int, err: Optional[BaseException]) -> None:
        followup = None
        others: List[_Part] = []
        with self._lock:
            if gen != self._gen or self.state != "PROC":
                return
            if err is not None:
                self._end("ERR", err)
                others = [p for p in self._parts if not p.finished]
            else:
                self._left -= 1
                if self._left == 0:
                    if self._followup is None:
                        self._end("DONE", None)
                    else:
                        followup = self._followup
            session = self._session
        for p in others:
            _cancel(session, p)
        if followup is not None:
            sink = _Notified(self, gen)
            try:
                followup(session, sink)
            except TcpxdError as e:
                sink.set_exception(e)

    def _notified(self, gen: int, err: Optional[BaseException]) -> None:
        with self._lock:
            if gen == self._gen and self.state == "PROC":
                self._end("ERR" if err is not None else "DONE", err)

    def _end(self, state: str, err: Optional[BaseException]) -> None:
        self.state = state
        self.error = err
        if self.timed:
            self._xfer_us = int((time.perf_counter() - self._t0) * 1e6)

    def release(self) -> None:
        """Releases the handle; an unfinished transfer is cancelled on both sides."""
        with self._lock:
            if self.released:
                return
            self.released = True
            self._gen += 1
            active = self.state == "PROC"
            if active:
                self._end("ERR", Cancelled("the handle was released while the transfer was in progress"))
            parts, session = list(self._parts), self._session
            if not active:
                # Its parts point back at it (`_Part.xfer`): a cycle only the GC would free, five
                # objects a transfer — a collection every ~140 transfers in a tight loop, in the
                # slowest 1% (session 31, tail). Nothing reads them once it is over and released
                # (a post still under way, released meanwhile, is "PROC": kept for `_posted`).
                self._parts = ()
        if active:
            for p in parts:
                if not p.finished:
                    _cancel(session, p)


class _Notified(_Part):
    """The followup notification's request."""

    __slots__ = ()

    def set_result(self, _result: Any) -> None:
        self.finished = True
        self.xfer._notified(self.gen, None)

    def set_exception(self, err: BaseException) -> None:
        self.finished = True
        self.xfer._notified(self.gen, err)


def _cancel(session: Any, part: Any) -> None:
    try:
        session.cancel(part)
    except TcpxdError:
        pass  # the session ended: its transfers were cancelled with it


#: DescribeNode's feature of a daemon that takes a notification alone: a WRITE of one zero-byte
#: entry carrying a notification, control messages only between daemons (peer protocol 10).
NOTIFICATION_ALONE = "notification_alone"


def mailbox_entry(mailbox_id: int, remote_mailbox: str, alone: bool) -> bytes:
    """WriteRequest's `entry` field (1) of the WRITE between mailboxes that carries a notification
    alone, encoded once per remote agent: of zero bytes where the daemon takes a notification alone
    (`alone`: NOTIFICATION_ALONE in its features; nothing touches a lane, the receiving daemon
    checks the mailbox's key and delivers it), else of one byte (a whole WRITE of a byte nobody
    reads)."""
    entry = _proto.message("WriteEntry")(
        local_buffer_id=mailbox_id, local_offset=0, remote_descriptor=remote_mailbox, remote_offset=0,
        length=0 if alone else 1,
    ).SerializeToString()
    return b"\x0a" + _wire.varint(len(entry)) + entry


def mailbox_write(entry: bytes, framed: bytes, timeout_ms: int) -> bytes:
    """The WriteRequest (serialized) of the WRITE between mailboxes that carries a notification
    alone: `entry` from mailbox_entry, notification (2), timeout_ms (3)."""
    return entry + b"\x12" + _wire.varint(len(framed)) + framed + mailbox_timeout(timeout_ms)


def mailbox_timeout(timeout_ms: int) -> bytes:
    """mailbox_write's last field, timeout_ms (3); nothing for the daemon's default (0)."""
    return b"\x18" + _wire.varint(timeout_ms) if timeout_ms else b""
