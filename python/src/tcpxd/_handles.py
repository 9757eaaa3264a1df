"""The synchronous client's handles: a registered `Buffer`, a `BlockList`, a `PreparedList`, a
`Transfer` started without waiting, a `Subscription` to notifications. Each keeps the client (or,
for a list prepared on a session, the session) whose calls it makes. tcpxd.client re-exports them;
their asyncio forms are tcpxd._aio_handles'."""

from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING, Any, Iterator, Optional

import grpc

from . import _blocks, _hostmem, _ops, _proto
from ._ops import Notification, TransferResult
from .errors import from_rpc_error, from_status

if TYPE_CHECKING:
    from .client import Client


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
            self._released()

    def _released(self) -> None:
        """The daemon released it (here or in a batch: Client._release_many)."""
        self.released = True
        self._keepalive = None
        self._client._reattach.forget("b", self.id)

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


class BlockList(_blocks.ListState):
    """A list of blocks inside a registered buffer (`Client.register_blocks`), moved by index with
    `write_blocks` / `read_blocks`. `token` names it to other nodes (a secret, as a descriptor is).
    `len()` is its block count. A context manager: leaving it releases the list; releasing its
    buffer releases it too."""

    def refresh(self) -> str:
        """Asks the daemon for the list's token again (after its buffer was re-keyed); returns it."""
        self._update(self._client._unary("DescribeBlocks", _proto.message("DescribeBlocksRequest")(list_id=self.id)))
        return self.token

    def release(self) -> None:
        """Releases the list (its token stops working). Idempotent."""
        if not self.released:
            self._client._unary("ReleaseBlocks", _proto.message("ReleaseBlocksRequest")(list_id=self.id))
            self.released = True
            self._client._reattach.forget("l", self.id)

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
            reattach = getattr(self._owner, "_reattach", None)  # (a session's goes with it)
            if reattach is not None:
                reattach.forget("p", self.id)

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
