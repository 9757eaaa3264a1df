"""The transfer requests a session carries, the same in both clients (tcpxd.Session and
tcpxd.AsyncSession): each built by the shared core (`_ops`, `_blocks`) and handed to the
session's `_submit`, which sends it and returns the client's kind of future
(`concurrent.futures.Future` or `asyncio.Future`) resolved when that transfer finishes."""

from __future__ import annotations

from typing import Any, Generic, Optional, Sequence, TypeVar

from . import _blocks, _ops
from ._ops import BufferLike, ReadOp, RemoteLike, WriteOp

#: The future a session's `_submit` returns.
F = TypeVar("F")


class SessionRequests(Generic[F]):
    """write, read, write_batch, read_batch, write_blocks and read_blocks, as the client's calls
    of the same names, in this session: each returns its transfer's future at once."""

    def _submit(self, **op: Any) -> F:  # the session's own
        raise NotImplementedError

    def _packs(self, ops: Sequence[Any]) -> bool:  # the session's own: may a batch of `ops` go packed
        raise NotImplementedError

    def write(
        self,
        local: BufferLike,
        remote: RemoteLike,
        length: Optional[int] = None,
        *,
        local_offset: int = 0,
        remote_offset: int = 0,
        notification: bytes = b"",
        ready_event: Any = None,
        timeout: Optional[float] = None,
    ) -> F:
        op = WriteOp(local, remote, length, local_offset, remote_offset)
        return self._submit(write=_ops.write_request(op, notification, ready_event, timeout, False))

    def read(
        self,
        remote: RemoteLike,
        local: BufferLike,
        length: Optional[int] = None,
        *,
        remote_offset: int = 0,
        local_offset: int = 0,
        timeout: Optional[float] = None,
    ) -> F:
        op = ReadOp(remote, local, length, remote_offset, local_offset)
        return self._submit(read=_ops.read_request(op, timeout, False))

    def write_batch(self, ops: Sequence[WriteOp], *, notification: bytes = b"", ready_event: Any = None,
                    timeout: Optional[float] = None) -> F:
        req = _ops.write_batch_request(ops, notification, ready_event, timeout, False, pack=self._packs(ops))
        return self._submit(write_batch=req)

    def read_batch(self, ops: Sequence[ReadOp], *, timeout: Optional[float] = None) -> F:
        return self._submit(read_batch=_ops.read_batch_request(ops, timeout, False, pack=self._packs(ops)))

    def write_blocks(
        self,
        local_list: Any,
        local_idx: Any,
        remote: Any,
        remote_idx: Any,
        *,
        notification: bytes = b"",
        ready_event: Any = None,
        timeout: Optional[float] = None,
    ) -> F:
        req = _blocks.write_request(local_list, local_idx, remote, remote_idx, notification, ready_event, timeout, False)
        return self._submit(write_blocks=req)

    def read_blocks(self, local_list: Any, local_idx: Any, remote: Any, remote_idx: Any, *,
                    timeout: Optional[float] = None) -> F:
        return self._submit(read_blocks=_blocks.read_request(local_list, local_idx, remote, remote_idx, timeout, False))
