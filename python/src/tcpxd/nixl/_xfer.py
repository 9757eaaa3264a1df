"""A transfer handle's life: posted as the plan's daemon requests on the agent's session, polled,
re-posted, cancelled on release, timed for telemetry."""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
from typing import Any, Callable, List, Optional

from .. import _proto
from ..errors import Cancelled, TcpxdError
from ._errors import nixlNotFoundError, nixlRepostActiveError
from ._plan import Plan


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


class Xfer:
    """What a nixl_xfer_handle stands for. States: "INIT" (never posted), "PROC", "DONE", "ERR"."""

    def __init__(self, plan: Plan, remote: str, notif: bytes):
        self.plan = plan
        self.remote = remote
        self.notif = notif
        self.state = "INIT"
        #: Why it ended in "ERR" (a tcpxd exception naming the daemon's reason).
        self.error: Optional[BaseException] = None
        self.released = False
        self._lock = threading.Lock()
        self._gen = 0
        self._futs: List[concurrent.futures.Future] = []
        self._left = 0
        self._session: Any = None
        self._followup: Optional[Callable[[], concurrent.futures.Future]] = None
        self._t0 = 0.0
        self.telemetry = nixlXferTelemetry(totalBytes=plan.total_bytes, descCount=plan.desc_count)

    def post(self, session: Any, ride: bytes, followup: Optional[Callable[[Any], concurrent.futures.Future]]) -> str:
        """Submits the plan's requests: `ride`, the framed notification the (single) WRITE request
        carries; `followup`, what sends the notification once every request finished, when it
        rides none of them."""
        with self._lock:
            if self.released:
                raise nixlNotFoundError("handle: released")
            if self.state == "PROC":
                raise nixlRepostActiveError("handle: its previous transfer is still in progress (check_xfer_state says PROC)")
            self._gen += 1
            gen = self._gen
            self.state = "PROC"
            self.error = None
            self._session = session
            self._followup = None if followup is None else _bind(followup, session)
            self._left = len(self.plan.requests)
        t0 = time.perf_counter()
        self.telemetry.startTime = time.time_ns() // 1000
        name = self.plan.field
        futs: List[concurrent.futures.Future] = []
        try:
            for req in self.plan.requests:
                if self.plan.op == "WRITE":
                    req.notification = ride
                futs.append(session._submit(**{name: req}))
        except TcpxdError as e:  # the session was closed under us: what went out is cancelled
            with self._lock:
                if gen == self._gen:
                    self._t0 = t0
                    self._end("ERR", e)
            for f in futs:
                _cancel(session, f)
            raise
        with self._lock:
            self._futs = futs
            self._t0 = t0
            stale = gen != self._gen  # released while posting
        if stale:
            for f in futs:
                _cancel(session, f)
            return self.state
        self.telemetry.postDuration = int((time.perf_counter() - t0) * 1e6)
        for f in futs:
            f.add_done_callback(functools.partial(self._done, gen))
        return self.state

    def _done(self, gen: int, fut: concurrent.futures.Future) -> None:
        err = _error(fut)
        followup = None
        others: List[concurrent.futures.Future] = []
        with self._lock:
            if gen != self._gen or self.state != "PROC":
                return
            if err is not None:
                self._end("ERR", err)
                others = [f for f in self._futs if not f.done()]
            else:
                self._left -= 1
                if self._left == 0:
                    if self._followup is None:
                        self._end("DONE", None)
                    else:
                        followup = self._followup
        for f in others:
            _cancel(self._session, f)
        if followup is not None:
            try:
                nf = followup()
            except TcpxdError as e:
                with self._lock:
                    if gen == self._gen and self.state == "PROC":
                        self._end("ERR", e)
                return
            nf.add_done_callback(functools.partial(self._notified, gen))

    def _notified(self, gen: int, fut: concurrent.futures.Future) -> None:
        err = _error(fut)
        with self._lock:
            if gen == self._gen and self.state == "PROC":
                self._end("ERR" if err is not None else "DONE", err)

    def _end(self, state: str, err: Optional[BaseException]) -> None:
        self.state = state
        self.error = err
        self.telemetry.xferDuration = int((time.perf_counter() - self._t0) * 1e6)

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
            futs, session = list(self._futs), self._session
        if active:
            for f in futs:
                if not f.done():
                    _cancel(session, f)


def _bind(f: Callable[[Any], concurrent.futures.Future], arg: Any) -> Callable[[], concurrent.futures.Future]:
    return lambda: f(arg)


def _error(fut: concurrent.futures.Future) -> Optional[BaseException]:
    if fut.cancelled():
        return Cancelled("the transfer was cancelled")
    return fut.exception()


def _cancel(session: Any, fut: concurrent.futures.Future) -> None:
    try:
        session.cancel(fut)
    except TcpxdError:
        pass  # the session ended: its transfers were cancelled with it


def mailbox_write(mailbox_id: int, remote_mailbox: str, framed: bytes, timeout_ms: int) -> Any:
    """The 1-byte WRITE between mailboxes that carries a notification alone."""
    entry = _proto.message("WriteEntry")(
        local_buffer_id=mailbox_id, local_offset=0, remote_descriptor=remote_mailbox, remote_offset=0, length=1
    )
    return _proto.message("WriteRequest")(entry=entry, notification=framed, timeout_ms=timeout_ms)
