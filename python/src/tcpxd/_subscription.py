"""`Client.subscribe()` on the daemon's framed local session (tcpxd._local): the node's
notifications as `notification` events of a session of the subscription's own, read on the
caller's thread. No gRPC stream, no helper thread: `next()` waits on the socket itself (the GIL
released) and returns as soon as the daemon wrote the event. Used where the client speaks the
local session (a unix endpoint, a daemon from session 18 on); else the Subscribe RPC serves
(tcpxd._handles.Subscription), with the same iteration and `next(timeout)`.

The two differ where the daemon reports a subscriber that fell behind (left too much unread):
the gRPC stream ends with DATA_LOSS ("subscribe again"); here DATA_LOSS is raised by the call that
meets it, naming how many were missed, and the subscription goes on with what comes after. A
`next(timeout)` that times out leaves this subscription in place (the gRPC one is closed).
"""

from __future__ import annotations

import collections
import select
from typing import Any, Deque, Iterator, Optional

from . import _local, _ops, _proto
from ._handles import Subscription
from ._ops import Notification
from .errors import Cancelled, TcpxdError, Unavailable, from_status


class LocalSubscription(Subscription):
    """Notifications, in the order their transfers completed, from a local session subscribed
    to them. Iterate it, or `next(timeout)`; `close()` ends it."""

    def __init__(self, conn: _local.Connection, endpoint: str):
        self._conn = conn
        self._endpoint = endpoint
        self._ready: Deque[Any] = collections.deque()
        self._poll = select.poll()
        self._poll.register(conn.sock.fileno(), select.POLLIN)

    @staticmethod
    def open(sessions: "_local.LocalSessions", endpoint: str, addressed_to: str = "") -> Optional["LocalSubscription"]:
        """A subscription in place, or None when the daemon does not deliver notifications on
        the local session (no local session, or too old: the Subscribe RPC serves)."""
        conn = sessions.connect()
        if conn is None:
            return None
        try:
            req = _proto.message("SubscribeRequest")(addressed_to=addressed_to)
            ev = conn.exchange("subscribe", req, _local.HANDSHAKE_TIMEOUT)
        except (_local.Gone, OSError):
            conn.close()
            return None  # (the gRPC call says why, if anything is wrong)
        except BaseException:
            conn.close()
            raise
        if ev is None or ev.WhichOneof("event") != "subscribed":
            conn.close()  # an older daemon refuses the request it does not know
            return None
        conn.sock.setblocking(False)  # read only what has arrived (a socket timeout would wait)
        return LocalSubscription(conn, endpoint)

    def __iter__(self) -> Iterator[Notification]:
        while True:
            try:
                n = self._next(None)
            except Cancelled:
                return  # closed
            yield n

    def next(self, timeout: Optional[float] = None) -> Notification:
        """The next notification; tcpxd.DeadlineExceeded when none comes within `timeout` seconds
        (the subscription stays)."""
        return self._next(timeout)

    def _next(self, timeout: Optional[float]) -> Notification:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready:
            if self._closed:
                raise Cancelled("the subscription was closed")
            try:
                events = self._conn.ready()
            except _local.Gone:
                if self._closed:
                    raise Cancelled("the subscription was closed") from None
                raise Unavailable(f"the daemon at {self._endpoint} ended the subscription's session") from None
            except OSError as e:  # closed under us (close() from another thread), or broken
                if self._closed:
                    raise Cancelled("the subscription was closed") from None
                raise Unavailable(f"the subscription's session with {self._endpoint}: {e}") from None
            for ev in events:
                kind = ev.WhichOneof("event")
                if kind == "notification":
                    self._ready.append(ev.notification)
                elif kind == "refused":  # fell behind (DATA_LOSS, how many missed), or the frame refused
                    self._ready.append(from_status(ev.refused.code, ev.refused.message))
            if self._ready:
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise from_status(4, f"no notification within {timeout} s")
            try:
                self._poll.poll(None if left is None else max(1, int(left * 1000 + 0.999)))
            except InterruptedError:
                pass
        got = self._ready.popleft()
        if isinstance(got, TcpxdError):
            raise got
        return _ops.notification(got)

    def close(self) -> None:
        self._closed = True
        self._conn.shutdown()  # wakes a thread waiting on it
        self._conn.close()
