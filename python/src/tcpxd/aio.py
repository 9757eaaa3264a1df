"""The asyncio client (grpc.aio, and asyncio streams for the daemon's local session): the same calls
as tcpxd.Client, as coroutines.

`AsyncClient` is here; its handles are in tcpxd._aio_handles, its sessions in tcpxd._aio_session
and its local-session connections in tcpxd._aio_local, each module with one job. This one
re-exports them, the very objects the client uses."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, Dict, List, Optional, Sequence

import grpc
import grpc.aio

from . import _blocks, _hostmem, _local, _ops, _proto, _reattach, _tensor
# The public classes that live in other modules, re-exported explicitly (`X as X`: strict type
# checkers see them as this module's).
from ._aio_handles import AsyncBlockList as AsyncBlockList
from ._aio_handles import AsyncBuffer as AsyncBuffer
from ._aio_handles import AsyncPreparedList as AsyncPreparedList
from ._aio_handles import AsyncSubscription as AsyncSubscription
from ._aio_handles import AsyncTransfer as AsyncTransfer
from ._aio_local import _AsyncConnection, _AsyncLocalSessions, _handshake, send_with_fd  # noqa: F401 (re-exported)
from ._aio_session import AsyncSession as AsyncSession
from ._aio_session import _AsyncOwnStream
from ._local import local_end, too_large  # noqa: F401 (re-exported)
from ._ops import SESSION_FIELD, BufferLike, NodeInfo, ReadOp, RemoteLike, WriteOp, settle  # noqa: F401 (settle re-exported)
from .client import DEFAULT_CALL_TIMEOUT, Client
from .errors import from_rpc_error


class AsyncClient:
    """tcpxd.Client for asyncio (the same options). Use `async with AsyncClient(...) as c:` or
    `await c.close()`. On the daemon's local session, waited transfers in flight at once each take
    a connection of their own; on gRPC, concurrent ones past the first make unary calls."""

    def __init__(
        self,
        endpoint: Optional[str] = None,
        *,
        token: Optional[str] = None,
        token_file: Optional[str] = None,
        timeout: float = DEFAULT_CALL_TIMEOUT,
        stream: bool = True,
        local: bool = True,
    ):
        self.endpoint = _ops.resolve_endpoint(endpoint)
        token = _ops.resolve_token(self.endpoint, token, token_file)
        self._metadata = _ops.metadata(token)
        self._channel = grpc.aio.insecure_channel(self.endpoint, options=_ops.channel_options())
        self.timeout = timeout
        self._stubs: Dict[str, Any] = {}
        self._own = _AsyncOwnStream(self) if stream and _proto.has_method("Session") else None
        path = _local.socket_path(self.endpoint) if local else None
        self._local: Optional[_AsyncLocalSessions] = _AsyncLocalSessions(path) if path else None
        #: Sessions on the local session (closing the client ends them, as closing the channel ends gRPC's).
        self._sessions: "weakref.WeakSet[AsyncSession]" = weakref.WeakSet()
        unix = _local.socket_path(self.endpoint)
        #: Registers host memory this process shares (blocking: run in a thread).
        self._registrar: Optional[_hostmem.Registrar] = _hostmem.Registrar(unix, self._local) if unix else None
        #: Re-attaches what this client registered when the daemon restarts (tcpxd._reattach), from
        #: a thread, through a synchronous client of its own on the same endpoint.
        # (The factory must not hold this client: a cycle would leave its grpc.aio channel to the
        # cyclic garbage collector, which may run it outside its event loop.)
        ep = self.endpoint
        self._reattach = _reattach.Reattacher(
            self, lambda: Client(ep, token=token, timeout=timeout, stream=False, local=False))
        #: Whether the daemon reads packed batch ranges (tcpxd.Client's): None until asked.
        self._batch_ranges: Optional[bool] = None

    def _stub(self, name: str, kind: str) -> Any:
        s = self._stubs.get(name)
        if s is None:
            s = getattr(self._channel, kind)(_proto.path(name), **_proto.codecs(name))
            self._stubs[name] = s
        return s

    async def _unary(self, name: str, req: Any, timeout: Optional[float] = -1.0) -> Any:
        t = self.timeout if timeout == -1.0 else timeout
        try:
            return await self._stub(name, "unary_unary")(req, timeout=t, metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, self.endpoint) from None

    def _waited_path(self) -> str:
        """How waited transfers go (after the first one): "local session", "own stream" or "unary"."""
        if self._local is not None and self._local.available:
            return "local session"
        return "own stream" if self._own is not None and not self._own._closed else "unary"

    async def close(self) -> None:
        """Ends the client's sessions (their unfinished transfers end Cancelled) and closes every
        connection it opened: its sessions', its local-session pool's, its registrations' and the
        gRPC channel's. Again: nothing more."""
        sessions = list(self._sessions)
        for session in sessions:
            session._abort("client closed")
        # Their readers end at once (the abort closed their connections) and wait for the close.
        await asyncio.gather(*(s._reader for s in sessions), return_exceptions=True)
        self._reattach.close()
        if self._registrar is not None:
            self._registrar.close()  # the daemon releases the host memory this client shared
        if self._local is not None:
            await self._local.close()
        if self._own is not None:
            self._own.close()
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- buffers

    async def register_host(
        self, memory: Any, label: str = "", *, fd: Optional[int] = None, shared: Optional[bool] = None
    ) -> AsyncBuffer:
        """As Client.register_host (the descriptor passing runs in a thread of the default executor)."""
        if not _hostmem.daemon_allocates(memory, shared, self._registrar):
            got = await asyncio.get_running_loop().run_in_executor(
                None, _hostmem.register, self._registrar, self.endpoint, memory, label, fd, self.timeout, shared
            )
            if got is not None:
                buf = AsyncBuffer(self, got[0], keepalive=got[1], host=got[1])
                if got[1].again is not None:
                    await self._track(self._reattach.track_buffer, buf, got[1].again)
                return buf
        return AsyncBuffer(self, await self._unary("RegisterBuffer", _ops.host_register(memory, label)))

    async def _track(self, track: Any, *args: Any) -> None:
        """Tracks a registration for re-attach (the first one asks the daemon its instance: in a thread)."""
        await asyncio.get_running_loop().run_in_executor(None, track, *args)

    async def allocate_cuda(self, size: int, device: int = 0, label: str = "") -> AsyncBuffer:
        return AsyncBuffer(self, await self._unary("RegisterBuffer", _ops.cuda_register(size, device, label)))

    async def register_cuda_ipc(
        self, ipc_handle: bytes, size: int, *, offset: int = 0, device: int = 0, label: str = ""
    ) -> AsyncBuffer:
        req = _ops.ipc_register(ipc_handle, offset, size, device, label)
        buf = AsyncBuffer(self, await self._unary("RegisterBuffer", req))
        await self._track(self._reattach.track_buffer, buf, _reattach.cuda_ipc_again(req))
        return buf

    async def register_tensor(self, tensor: Any, label: str = "") -> AsyncBuffer:
        device, handle, offset, size = _tensor.cuda_ipc_view(tensor)
        req = _ops.ipc_register(handle, offset, size, device, label)
        buf = AsyncBuffer(self, await self._unary("RegisterBuffer", req), keepalive=tensor)
        await self._track(self._reattach.track_buffer, buf, _reattach.cuda_ipc_again(req))
        return buf

    async def register_blocks(
        self, buffer: BufferLike, offsets: Any = None, lengths: Any = None, *, block_size: Optional[int] = None
    ) -> AsyncBlockList:
        """As tcpxd.Client.register_blocks."""
        offsets = _blocks.tiling(buffer, offsets, block_size)
        req = _blocks.register_request(buffer, offsets, lengths, block_size)
        bl = AsyncBlockList(self, await self._unary("RegisterBlocks", req))
        await self._track(self._reattach.track_list, bl, req)
        return bl

    async def list_buffers(self) -> List[Any]:
        return list((await self._unary("ListBuffers", _proto.message("ListBuffersRequest")())).buffers)

    # -- peers and node

    async def connect_peer(self, address: str) -> Any:
        return await self._unary("ConnectPeer", _proto.message("ConnectPeerRequest")(address=address))

    async def list_peers(self) -> List[Any]:
        return list((await self._unary("ListPeers", _proto.message("ListPeersRequest")())).peers)

    async def describe_node(self) -> NodeInfo:
        info = _ops.node_info(await self._unary("DescribeNode", _proto.message("DescribeNodeRequest")()))
        self._batch_ranges = _ops.packs_batches(info.features)
        return info

    async def _packs(self, ops: Sequence[Any]) -> bool:
        """Whether a batch of `ops` may go packed (tcpxd.Client's rule)."""
        if len(ops) < 2:
            return False
        if self._batch_ranges is None:
            await self.describe_node()
        return bool(self._batch_ranges)

    async def _learn_batch_ranges(self) -> None:
        """Asks the daemon's features for a session's packed batches; a failure leaves it unknown
        (the session's batches go as entries meanwhile)."""
        try:
            if self._batch_ranges is None:
                await self.describe_node()
        except Exception:  # the session's own calls report an unreachable daemon
            pass

    async def stats(self) -> Any:
        return await self._unary("GetStats", _proto.message("GetStatsRequest")())

    # -- transfers

    async def _start(self, name: str, req: Any, timeout: Optional[float], wait: bool) -> Any:
        # `wait` means nothing in a session; the request's `timeout_ms` is its deadline there.
        if wait and self._local is not None:
            r = await self._local.run(SESSION_FIELD[name], req, timeout)
            if r is not None:
                return r
        if wait and timeout is None and self._own is not None:
            r = await self._own.run(SESSION_FIELD[name], req)
            if r is not None:
                return r
        t = AsyncTransfer(self, await self._unary(name, req, timeout=timeout))
        return await t.result() if wait else t

    async def write(
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
        wait: bool = True,
    ) -> Any:
        req = _ops.write_request(WriteOp(local, remote, length, local_offset, remote_offset), notification, ready_event, timeout, wait)
        return await self._start("Write", req, timeout, wait)

    async def read(
        self,
        remote: RemoteLike,
        local: BufferLike,
        length: Optional[int] = None,
        *,
        remote_offset: int = 0,
        local_offset: int = 0,
        timeout: Optional[float] = None,
        wait: bool = True,
    ) -> Any:
        req = _ops.read_request(ReadOp(remote, local, length, remote_offset, local_offset), timeout, wait)
        return await self._start("Read", req, timeout, wait)

    async def write_batch(
        self,
        ops: Sequence[WriteOp],
        *,
        notification: bytes = b"",
        ready_event: Any = None,
        timeout: Optional[float] = None,
        wait: bool = True,
    ) -> Any:
        req = _ops.write_batch_request(ops, notification, ready_event, timeout, wait, pack=await self._packs(ops))
        return await self._start("WriteBatch", req, timeout, wait)

    async def read_batch(self, ops: Sequence[ReadOp], *, timeout: Optional[float] = None, wait: bool = True) -> Any:
        req = _ops.read_batch_request(ops, timeout, wait, pack=await self._packs(ops))
        return await self._start("ReadBatch", req, timeout, wait)

    async def write_blocks(
        self,
        local_list: Any,
        local_idx: Any,
        remote: Any,
        remote_idx: Any,
        *,
        notification: bytes = b"",
        ready_event: Any = None,
        timeout: Optional[float] = None,
        wait: bool = True,
    ) -> Any:
        """As tcpxd.Client.write_blocks."""
        req = _blocks.write_request(local_list, local_idx, remote, remote_idx, notification, ready_event, timeout, wait)
        return await self._start("WriteBlocks", req, timeout, wait)

    async def read_blocks(
        self,
        local_list: Any,
        local_idx: Any,
        remote: Any,
        remote_idx: Any,
        *,
        timeout: Optional[float] = None,
        wait: bool = True,
    ) -> Any:
        """As tcpxd.Client.read_blocks."""
        req = _blocks.read_request(local_list, local_idx, remote, remote_idx, timeout, wait)
        return await self._start("ReadBlocks", req, timeout, wait)

    async def prepare_blocks(self, lists: Any, entries: Any) -> AsyncPreparedList:
        """As tcpxd.Client.prepare_blocks."""
        req = _blocks.prepare_request(lists, entries)
        p = AsyncPreparedList(self, await self._unary("PrepareBlocks", req))
        await self._track(self._reattach.track_prepared, p, req)
        return p

    async def _release_prepared(self, prepared_id: int) -> None:
        await self._unary("ReleasePrepared", _proto.message("ReleasePreparedRequest")(prepared_id=prepared_id))

    async def write_prepared(
        self,
        local: Any,
        local_idx: Any,
        remote: Any,
        remote_idx: Any,
        *,
        notification: bytes = b"",
        timeout: Optional[float] = None,
        wait: bool = True,
    ) -> Any:
        """As tcpxd.Client.write_prepared."""
        req = _blocks.prepared_request("WRITE", local, local_idx, remote, remote_idx, notification, timeout, wait)
        return await self._start("WritePrepared", req, timeout, wait)

    async def read_prepared(
        self,
        local: Any,
        local_idx: Any,
        remote: Any,
        remote_idx: Any,
        *,
        notification: bytes = b"",
        timeout: Optional[float] = None,
        wait: bool = True,
    ) -> Any:
        """As tcpxd.Client.read_prepared."""
        req = _blocks.prepared_request("READ", local, local_idx, remote, remote_idx, notification, timeout, wait)
        return await self._start("ReadPrepared", req, timeout, wait)

    async def cancel(self, transfer_id: int) -> bool:
        return (await self._unary("Cancel", _proto.message("CancelRequest")(transfer_id=transfer_id))).cancelled

    def session(self, timeout: Optional[float] = None) -> AsyncSession:
        """Call inside a running event loop."""
        return AsyncSession(self, timeout)

    async def subscribe(self, addressed_to: str = "") -> AsyncSubscription:
        """As `Client.subscribe`: `addressed_to` keeps only the notifications framed to that name
        (tcpxd.nixl's agents), where the daemon filters (since session 31; an older one sends all)."""
        req = _proto.message("SubscribeRequest")(addressed_to=addressed_to)
        call = self._stub("Subscribe", "unary_stream")(req, metadata=self._metadata)
        try:
            await call.initial_metadata()
        except grpc.RpcError as e:
            raise from_rpc_error(e, self.endpoint) from None
        return AsyncSubscription(call)
