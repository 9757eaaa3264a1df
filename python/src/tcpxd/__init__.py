"""tcpxd: move host buffers and PyTorch CUDA tensors between nodes through their tcpxd daemons.

    import tcpxd
    with tcpxd.Client() as c, c.register_host(1 << 20) as buf:
        c.write(buf, remote_descriptor)          # returns once the bytes landed

Guide: docs/PYTHON.md. Errors are tcpxd.TcpxdError subclasses named after gRPC codes.
"""

from ._ops import (
    DEFAULT_ENDPOINT,
    GpuDevice,
    GpuNics,
    NetDevice,
    NodeInfo,
    Notification,
    ReadOp,
    TransferResult,
    WriteOp,
)
from . import _tensor
from ._tensor import cuda_ipc_view, ready_event
from .aio import AsyncBlockList, AsyncBuffer, AsyncClient, AsyncPreparedList, AsyncSession, AsyncSubscription, AsyncTransfer
from .client import BlockList, Buffer, Client, PreparedList, Session, Subscription, Transfer
from .errors import (
    Aborted,
    AlreadyExists,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    TcpxdError,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    Unknown,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_ENDPOINT",
    "Aborted",
    "AlreadyExists",
    "AsyncBlockList",
    "AsyncPreparedList",
    "AsyncBuffer",
    "AsyncClient",
    "AsyncSession",
    "AsyncSubscription",
    "AsyncTransfer",
    "BlockList",
    "PreparedList",
    "Buffer",
    "Cancelled",
    "Client",
    "DataLoss",
    "DeadlineExceeded",
    "FailedPrecondition",
    "GpuDevice",
    "GpuNics",
    "Internal",
    "InvalidArgument",
    "NetDevice",
    "NodeInfo",
    "NotFound",
    "Notification",
    "OutOfRange",
    "PermissionDenied",
    "ReadOp",
    "ResourceExhausted",
    "Session",
    "Subscription",
    "TcpxdError",
    "Transfer",
    "TransferResult",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "Unknown",
    "WriteOp",
    "cuda_ipc_view",
    "ready_event",
]
