"""The exceptions NIXL's Python bindings raise (nixl._bindings), under the same names.

Each is also the tcpxd exception of the matching status (`tcpxd.InvalidArgument`, ...), so a caller
may catch either form; the message names the argument at fault and, where one applies, the limit.
"""

from __future__ import annotations

from ..errors import (
    Cancelled,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    TcpxdError,
    Unavailable,
    Unimplemented,
    Unknown,
)


class nixlNotPostedError(FailedPrecondition):  # noqa: N801 - NIXL's name
    """The transfer was never posted."""


class nixlInvalidParamError(InvalidArgument):  # noqa: N801
    """Malformed input: a descriptor list, index, memory type or operation NIXL would refuse."""


class nixlInvalidKeyError(nixlInvalidParamError, KeyError):  # noqa: N801
    """An operation or memory type NIXL does not know: where NIXL's agent looks such a name up in
    its tables it raises KeyError, so this is one too."""

    __str__ = TcpxdError.__str__


class nixlInvalidValueError(nixlInvalidParamError, ValueError):  # noqa: N801
    """An argument NIXL's C++ agent refuses with std::invalid_argument (its binding raises
    ValueError), such as an empty agent name."""


class nixlBackendError(Unavailable):  # noqa: N801
    """The daemon could not be reached or refused the request."""


class nixlNotFoundError(NotFound):  # noqa: N801
    """An unknown agent, handle or memory: e.g. a descriptor outside every registered region."""


class nixlMismatchError(InvalidArgument):  # noqa: N801
    """Descriptors that do not pair up (lengths, memory types)."""


class nixlNotAllowedError(FailedPrecondition):  # noqa: N801
    """The call is not allowed in the agent's state (e.g. deregistering memory a list still uses)."""


class nixlRepostActiveError(FailedPrecondition):  # noqa: N801
    """transfer() on a handle whose previous post is still in progress."""


class nixlUnknownError(Unknown):  # noqa: N801
    """Anything else."""


class nixlNotSupportedError(Unimplemented):  # noqa: N801
    """A memory type or feature tcpxd does not move (FILE, BLOCK, OBJ; partial metadata)."""


class nixlRemoteDisconnectError(Unavailable):  # noqa: N801
    """The remote agent's node went away."""


class nixlCancelledError(Cancelled):  # noqa: N801
    """The transfer was cancelled."""


class nixlNoTelemetryError(FailedPrecondition):  # noqa: N801
    """Telemetry asked of an agent created without capture_telemetry=True."""


__all__ = [
    "TcpxdError",
    "nixlBackendError",
    "nixlCancelledError",
    "nixlInvalidParamError",
    "nixlMismatchError",
    "nixlNoTelemetryError",
    "nixlNotAllowedError",
    "nixlNotFoundError",
    "nixlNotPostedError",
    "nixlNotSupportedError",
    "nixlRemoteDisconnectError",
    "nixlRepostActiveError",
    "nixlUnknownError",
]

#: Every exception class above.
NIXL_ERRORS = (
    nixlNotPostedError, nixlInvalidParamError, nixlBackendError, nixlNotFoundError, nixlMismatchError,
    nixlNotAllowedError, nixlRepostActiveError, nixlUnknownError, nixlNotSupportedError,
    nixlRemoteDisconnectError, nixlCancelledError, nixlNoTelemetryError,
)


def from_tcpxd(e: TcpxdError, what: str) -> TcpxdError:
    """The NIXL exception for a tcpxd error, its message prefixed with what was being done (a NIXL
    exception already is one: returned as it is)."""
    import grpc

    if isinstance(e, NIXL_ERRORS):
        return e

    cls = {
        grpc.StatusCode.INVALID_ARGUMENT: nixlInvalidParamError,
        grpc.StatusCode.OUT_OF_RANGE: nixlInvalidParamError,
        grpc.StatusCode.NOT_FOUND: nixlNotFoundError,
        grpc.StatusCode.PERMISSION_DENIED: nixlNotAllowedError,
        grpc.StatusCode.FAILED_PRECONDITION: nixlNotAllowedError,
        grpc.StatusCode.CANCELLED: nixlCancelledError,
        grpc.StatusCode.UNIMPLEMENTED: nixlNotSupportedError,
        grpc.StatusCode.UNAVAILABLE: nixlRemoteDisconnectError,
    }.get(e.code, nixlBackendError)
    return cls(f"{what}: {e.message}")
