"""Exceptions: one class per gRPC status code, each carrying the code and the daemon's message.

A call the daemon refuses raises the class of its status (`tcpxd.InvalidArgument`,
`tcpxd.PermissionDenied`, ...). A transfer that was accepted but ended badly raises the class of its
final status, with the final event in `.event` (per-entry statuses of a batch in `.entries`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Type

import grpc


class TcpxdError(Exception):
    """Base of every tcpxd error: `.code` (grpc.StatusCode), `.message` (the daemon's text)."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, code: Optional[grpc.StatusCode] = None, event: Any = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message
        #: For a transfer that ended badly: its final TransferEvent (None for refused calls).
        self.event = event

    @property
    def entries(self) -> List[Tuple[int, str]]:
        """Per-entry (code, message) of a failed transfer, in request order."""
        if self.event is None:
            return []
        return [(e.code, e.message) for e in self.event.entries]

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


class Cancelled(TcpxdError):
    code = grpc.StatusCode.CANCELLED


class Unknown(TcpxdError):
    code = grpc.StatusCode.UNKNOWN


class InvalidArgument(TcpxdError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceeded(TcpxdError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFound(TcpxdError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(TcpxdError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDenied(TcpxdError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(TcpxdError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(TcpxdError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Aborted(TcpxdError):
    code = grpc.StatusCode.ABORTED


class OutOfRange(TcpxdError):
    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(TcpxdError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(TcpxdError):
    code = grpc.StatusCode.INTERNAL


class Unavailable(TcpxdError):
    code = grpc.StatusCode.UNAVAILABLE


class DataLoss(TcpxdError):
    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(TcpxdError):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE: Dict[grpc.StatusCode, Type[TcpxdError]] = {
    c.code: c
    for c in (
        Cancelled,
        Unknown,
        InvalidArgument,
        DeadlineExceeded,
        NotFound,
        AlreadyExists,
        PermissionDenied,
        ResourceExhausted,
        FailedPrecondition,
        Aborted,
        OutOfRange,
        Unimplemented,
        Internal,
        Unavailable,
        DataLoss,
        Unauthenticated,
    )
}
_BY_NUMBER: Dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


def error_class(code: grpc.StatusCode) -> Type[TcpxdError]:
    return _BY_CODE.get(code, TcpxdError)


#: What grpcio says when nothing answers at the endpoint (no socket file, nothing listening).
_NO_DAEMON = ("failed to connect", "connect failed", "Connection refused", "No such file or directory")


def no_daemon_message(endpoint: str, details: str) -> str:
    """The message for a call that found no daemon at `endpoint`: where it looked and the fix, as
    tcpxctl says it."""
    return (
        f"cannot connect to {endpoint}: {details} (is tcpxd running? pass its API socket as "
        f'tcpxd.Client("unix:/path/to/tcpxd.sock") or set TCPXD_ENDPOINT)'
    )


def from_rpc_error(e: grpc.RpcError, endpoint: Optional[str] = None) -> TcpxdError:
    """The tcpxd exception for a failed call (grpc.RpcError or grpc.aio.AioRpcError). With the
    client's `endpoint`, a call that found no daemon there says where it looked and what to do."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    code = code or grpc.StatusCode.UNKNOWN
    message = details or code.name
    if endpoint and code == grpc.StatusCode.UNAVAILABLE and any(w in message for w in _NO_DAEMON):
        message = no_daemon_message(endpoint, message)
    return error_class(code)(message, code=code)


def from_status(number: int, message: str, event: Any = None) -> TcpxdError:
    """The tcpxd exception for a google.rpc.Code number (a transfer's final status)."""
    code = _BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)
    return error_class(code)(message or code.name, code=code, event=event)
