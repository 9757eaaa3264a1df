"""The client's own `Session` stream for its waited transfers over gRPC (`_OwnStream`), one at a
time on the caller's thread: a segregated call of grpcio's cygrpc layer, no helper threads.
tcpxd._session re-exports it (and tcpxd.client from there)."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Optional, Set

import grpc
# the segregated call of _OwnStream (grpcio's own layer: private, so types-grpcio has no stub for it)
from grpc._cython import cygrpc  # type: ignore[attr-defined]

from . import _ops, _proto
from ._ops import TransferResult
from .errors import TcpxdError, from_status

if TYPE_CHECKING:
    from .client import Client

_OP = cygrpc.OperationType


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
            # grpcio's channel object underneath (private: grpc.Channel's stub does not declare it)
            channel = self._client._channel._channel  # type: ignore[attr-defined]
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
