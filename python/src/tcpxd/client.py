"""The synchronous client: `Client`, a connection to one daemon.

Its handles (`Buffer`, `BlockList`, `PreparedList`, `Transfer`, `Subscription`) live in
tcpxd._handles and its `Session` stream in tcpxd._session, each module with one job; this one
re-exports them (and the session's helpers), the very objects the client uses."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import grpc

from . import _blocks, _exit, _hostmem, _local, _ops, _proto, _reattach, _tensor, _waited
# The public classes that live in other modules, re-exported explicitly (`X as X`: strict type
# checkers see them as this module's).
from ._handles import BlockList as BlockList
from ._handles import Buffer as Buffer
from ._handles import PreparedList as PreparedList
from ._handles import Subscription as Subscription
from ._handles import Transfer as Transfer
from ._subscription import LocalSubscription
from ._local import local_end, too_large  # noqa: F401 (re-exported)
from ._ops import SESSION_FIELD, BufferLike, NodeInfo, ReadOp, RemoteLike, WriteOp, settle  # noqa: F401 (settle re-exported)
from ._session import (  # noqa: F401 (re-exported: the session's framing helpers)
    _FRAME_ONE,
    _OP,
    _SMALL_VARINTS,
    SESSION_SNDBUF,
    _body_size,
    _field_key,
    _forward,
    _OwnStream,
    _send_pieces,
    _varint,
)
from ._session import Session as Session
from .errors import TcpxdError, from_rpc_error

#: Deadline of calls that are not transfers (registration, peers, ...), in seconds.
DEFAULT_CALL_TIMEOUT = 60.0


class Client:
    """A connection to one tcpxd daemon.

    `endpoint`: "unix:/path" or "host:port" (default: $TCPXD_ENDPOINT, else
    unix:/run/tcpxd/tcpxd.sock). A TCP endpoint sends the API token (`token`, the file `token_file`,
    else the file $TCPXD_API_TOKEN_FILE names). `timeout`: the deadline, in seconds, of calls that
    are not transfers. `local` (default True): on a `unix:` endpoint, `write()`, `read()` and the
    batch forms with `wait` go over the daemon's local session (the Session RPC framed plainly on
    its unix socket, without gRPC: one connection per thread in flight, kept for reuse) when the
    daemon speaks it, which the first transfer finds out; False, or a TCP endpoint, or an older
    daemon: gRPC. `stream` (default True): on gRPC, those with no `timeout` go as requests on one
    Session stream the client keeps open (faster than a unary call each); False makes every
    transfer its own unary call. A context manager: leaving it closes the channel."""

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
        self._metadata = _ops.metadata(_ops.resolve_token(self.endpoint, token, token_file))
        self._channel = grpc.insecure_channel(self.endpoint, options=_ops.channel_options())
        self.timeout = timeout
        self._stubs: Dict[str, Callable[..., Any]] = {}
        self._own: Optional[_OwnStream] = _OwnStream(self) if stream and _proto.has_method("Session") else None
        path = _local.socket_path(self.endpoint) if local else None
        self._local: Optional[_local.LocalSessions] = _local.LocalSessions(path) if path else None
        #: Sessions on the local session (closing the client ends them, as closing the channel ends gRPC's).
        self._sessions: "weakref.WeakSet[Session]" = weakref.WeakSet()
        #: Subscriptions on the local session (closing the client ends them too).
        self._subscriptions: "weakref.WeakSet[LocalSubscription]" = weakref.WeakSet()
        unix = _local.socket_path(self.endpoint)
        #: Registers host memory this process shares (its connection holds those buffers).
        self._registrar: Optional[_hostmem.Registrar] = _hostmem.Registrar(unix, self._local) if unix else None
        _exit.track_client(self)  # closed at exit if still open (tcpxd._exit)
        #: Re-attaches what this client registered when the daemon restarts (tcpxd._reattach).
        self._reattach = _reattach.Reattacher(self)
        #: Whether the daemon reads packed batch ranges (its `batch_ranges` feature): None until a
        #: batch of several ops (or describe_node) asked it; an older daemon gets entries.
        self._batch_ranges: Optional[bool] = None

    # -- plumbing

    def _stub(self, name: str, kind: str) -> Callable[..., Any]:
        s = self._stubs.get(name)
        if s is None:
            s = getattr(self._channel, kind)(_proto.path(name), **_proto.codecs(name))
            self._stubs[name] = s
        return s

    def _unary(self, name: str, req: Any, timeout: Optional[float] = -1.0) -> Any:
        t = self.timeout if timeout == -1.0 else timeout
        try:
            return self._stub(name, "unary_unary")(req, timeout=t, metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, self.endpoint) from None

    def _stream(self, name: str, req: Any, timeout: Optional[float] = None) -> Any:
        return self._stub(name, "unary_stream")(req, timeout=timeout, metadata=self._metadata)

    def _stream_stream(self, name: str, reqs: Iterator[Any], timeout: Optional[float] = None) -> Any:
        return self._stub(name, "stream_stream")(reqs, timeout=timeout, metadata=self._metadata)

    def _waited_path(self) -> str:
        """How waited transfers go (after the first one): "local session", "own stream" or "unary"."""
        if self._local is not None and self._local.available:
            return "local session"
        return "own stream" if self._own is not None and not self._own._closed else "unary"

    def close(self) -> None:
        """Ends the client's sessions (their unfinished transfers end Cancelled) and closes every
        connection it opened: its sessions', its local-session pool's, its registrations' and the
        gRPC channel's. Again: nothing more."""
        sessions = list(self._sessions)
        for session in sessions:
            session._abort("client closed")
        for sub in list(self._subscriptions):
            sub.close()
        if not _exit.finalizing():  # (past the exit handlers the sessions' reader threads are frozen)
            for session in sessions:
                session._release()
        self._reattach.close()
        if self._registrar is not None:
            self._registrar.close()  # the daemon releases the host memory this client shared
        if self._local is not None:
            self._local.close()
        if self._own is not None:
            self._own.close()
        if not _exit.finalizing():  # (past the exit handlers its calls' reader threads are frozen)
            self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- buffers

    def register_host(self, memory: Any, label: str = "", *, fd: Optional[int] = None, shared: Optional[bool] = None) -> Buffer:
        """A host buffer whose memory this process sees (`numpy()`, `tensor()`), no copy either side.

        `memory`: a size in bytes (the package maps a new memfd of that size), or memory of this
        process's own backed by a file mapped shared: a torch CPU tensor after `share_memory_()`, a
        numpy array or `mmap.mmap` over a memfd or a file on /dev/shm (`fd=`: a descriptor of that file,
        when this process holds none open). The descriptor goes to the daemon over its unix socket; the
        buffer lives until `release()` or until the client closes. With a size, `shared=False` (or a TCP
        endpoint, unless `shared=True`) has the daemon allocate the memory instead, as before: it
        outlives the client, and this process reaches it only by read_bytes()/write_bytes().
        Raises InvalidArgument/FailedPrecondition for memory that cannot be shared, saying what to do."""
        if not _hostmem.daemon_allocates(memory, shared, self._registrar):
            got = _hostmem.register(self._registrar, self.endpoint, memory, label, fd, self.timeout, shared)
            if got is not None:
                buf = Buffer(self, got[0], keepalive=got[1], host=got[1])
                if got[1].again is not None:
                    self._reattach.track_buffer(buf, got[1].again)
                return buf
        return Buffer(self, self._unary("RegisterBuffer", _ops.host_register(memory, label)))

    def _register_host_many(self, memories: Sequence[Any], lists: Sequence[Sequence[Any]], label: str = "") -> List[Any]:
        """`register_host` of many memories of this process's own, each with the block lists
        (StridedBlocks) the daemon makes on its buffer in the same step: per memory, (Buffer, the
        daemon's BlockList messages, their EntryStatus messages; both empty from a daemon that
        makes none), or the TcpxdError that refused it. One round trip for many (tcpxd.nixl's
        register_memory)."""
        got = _hostmem.register_many(self._registrar, self.endpoint, memories, lists, label, self.timeout)
        return self._host_buffers(got, lists)

    def _host_buffers(self, got: Sequence[Any], lists: Sequence[Sequence[Any]]) -> List[Any]:
        """`_register_host_many`'s answer from `_hostmem.register_many`'s: Buffers, tracked to be
        registered again after a restart, with their lists."""
        out: List[Any] = []
        for ans, asked in zip(got, lists):
            if isinstance(ans, TcpxdError):
                out.append(ans)
                continue
            msg, host = ans
            buf = Buffer(self, msg, keepalive=host, host=host)
            if host.reattach is not None:
                self._reattach.track_buffer(buf, _reattach.host_fd_again(*host.reattach))
            blocks = _proto.message("RegisterBlocksRequest")
            for bl, st, strided in zip(msg.block_lists, msg.block_list_status, asked):
                if st.code == 0 and bl.id:  # registered again with the buffer after a restart
                    self._reattach.track_list_id(int(bl.id), blocks(buffer_id=buf.id, strided=strided))
            out.append((buf, list(msg.block_lists), list(msg.block_list_status)))
        return out

    def _register_addresses(self, addrs: Any, tails: Sequence[bytes]) -> List[Any]:
        """Memory of this process registered by address, many regions at once (tcpxd.nixl's
        register_memory of anonymous memory): region i at `addrs[i]` (a numpy u64 array), the
        rest of its request in `tails[i]` (_addresses.address_tail). Per region the daemon's
        Buffer message (its lists in `block_lists`) or the TcpxdError that refused it; no Buffer
        object is made (release them with `_release_ids`)."""
        if self._registrar is None:
            raise _hostmem.no_unix_socket(self.endpoint)
        return self._registrar.register_addresses(addrs, tails, self.timeout)

    def _release_ids(self, ids: Sequence[int]) -> None:
        """Releases buffers registered by `_register_addresses`: in `release_batch`es on the
        registration session, any it did not release (an older daemon, a buffer a transfer still
        uses) by ReleaseBuffer. Raises the first error once all are tried."""
        got = None
        if self._registrar is not None and ids:
            try:
                got = self._registrar.release_many(ids, self.timeout)
            except TcpxdError:  # the session ended (its buffers went with it): each asked below
                got = None
        first: Optional[BaseException] = None
        R = _proto.message("ReleaseBufferRequest")
        for i, id in enumerate(ids):
            if got is None or got[i] is not None:
                try:
                    self._unary("ReleaseBuffer", R(buffer_id=id))
                except TcpxdError as e:
                    first = first or e
        if first is not None:
            raise first

    def _release_many(self, buffers: Sequence[Buffer]) -> None:
        """Releases buffers: those this client shared its host memory into (`_register_host_many`)
        in `release_batch`es on its registration session, the rest (and any a transfer still uses,
        which ReleaseBuffer waits for) one call each. Raises the first error once all are tried."""
        todo = [b for b in buffers if not b.released]
        shared = [b for b in todo if b._host is not None and b.kind in ("host_shared", "host_attached")]
        got = None
        if self._registrar is not None and shared:
            try:
                got = self._registrar.release_many([b.id for b in shared], self.timeout)
            except TcpxdError:  # the session ended (its buffers go with it): each asked below
                got = None
        if got is not None:
            for b, err in zip(shared, got):
                if err is None:
                    b._released()
        first: Optional[BaseException] = None
        for b in todo:
            if not b.released:
                try:
                    b.release()
                except TcpxdError as e:
                    first = first or e
        if first is not None:
            raise first

    def allocate_cuda(self, size: int, device: int = 0, label: str = "") -> Buffer:
        """A CUDA buffer the daemon allocates on GPU `device`."""
        return Buffer(self, self._unary("RegisterBuffer", _ops.cuda_register(size, device, label)))

    def register_cuda_ipc(self, ipc_handle: bytes, size: int, *, offset: int = 0, device: int = 0, label: str = "") -> Buffer:
        """CUDA memory of another process, by its 64-byte cudaIpcMemHandle_t (offset and size of the range)."""
        req = _ops.ipc_register(ipc_handle, offset, size, device, label)
        buf = Buffer(self, self._unary("RegisterBuffer", req))
        self._reattach.track_buffer(buf, _reattach.cuda_ipc_again(req))
        return buf

    def register_tensor(self, tensor: Any, label: str = "") -> Buffer:
        """A PyTorch CUDA tensor's own memory, imported by the daemon by IPC handle (no copy). The
        buffer keeps the tensor alive until released; release it before freeing the tensor's memory."""
        device, handle, offset, size = _tensor.cuda_ipc_view(tensor)
        req = _ops.ipc_register(handle, offset, size, device, label)
        buf = Buffer(self, self._unary("RegisterBuffer", req), keepalive=tensor)
        self._reattach.track_buffer(buf, _reattach.cuda_ipc_again(req))
        return buf

    def register_blocks(
        self, buffer: BufferLike, offsets: Any = None, lengths: Any = None, *, block_size: Optional[int] = None
    ) -> BlockList:
        """A list of blocks inside `buffer`, for `write_blocks` / `read_blocks`. `offsets` (numpy
        array, torch tensor, list or range) with `lengths` (one per block, or one int for all) or
        `block_size=`; with `block_size` alone the blocks tile the whole buffer. Sent as compactly as
        the blocks allow (evenly spaced: four numbers). The daemon checks every block once: inside
        the buffer, not empty, none overlapping (InvalidArgument naming the first bad one)."""
        offsets = _blocks.tiling(buffer, offsets, block_size)
        req = _blocks.register_request(buffer, offsets, lengths, block_size)
        bl = BlockList(self, self._unary("RegisterBlocks", req))
        self._reattach.track_list(bl, req)
        return bl

    def describe_buffer(self, buffer: BufferLike) -> Any:
        return self._unary("DescribeBuffer", _proto.message("DescribeBufferRequest")(buffer_id=_ops.buffer_id(buffer)))

    def list_buffers(self) -> List[Any]:
        return list(self._unary("ListBuffers", _proto.message("ListBuffersRequest")()).buffers)

    # -- peers and node

    def connect_peer(self, address: str) -> Any:
        """Connects to another daemon's peer address (not needed for descriptors carrying one)."""
        return self._unary("ConnectPeer", _proto.message("ConnectPeerRequest")(address=address))

    def _connect_peer_started(self, address: str) -> Any:
        """ConnectPeer started and not waited for: its grpc future (gRPC's thread completes it)."""
        stub: Any = self._stub("ConnectPeer", "unary_unary")
        return stub.future(_proto.message("ConnectPeerRequest")(address=address), timeout=self.timeout,
                           metadata=self._metadata)

    def list_peers(self) -> List[Any]:
        return list(self._unary("ListPeers", _proto.message("ListPeersRequest")()).peers)

    def describe_node(self) -> NodeInfo:
        """The daemon's node id, peer address(es), version, plugin, devices and GPUs."""
        info = _ops.node_info(self._unary("DescribeNode", _proto.message("DescribeNodeRequest")()))
        self._batch_ranges = _ops.packs_batches(info.features)
        return info

    def _packs(self, ops: Sequence[Any]) -> bool:
        """Whether a batch of `ops` may go packed: the daemon lists `batch_ranges` (asked once, on
        the first batch of several ops)."""
        if len(ops) < 2:
            return False
        if self._batch_ranges is None:
            self.describe_node()
        return bool(self._batch_ranges)

    def stats(self) -> Any:
        return self._unary("GetStats", _proto.message("GetStatsRequest")())

    # -- transfers

    def _start(self, name: str, req: Any, timeout: Optional[float], wait: bool, tried_local: bool = False) -> Any:
        # `wait` means nothing in a session; the request's `timeout_ms` is its deadline there.
        if wait and self._local is not None and not tried_local:
            r = self._local.run(SESSION_FIELD[name], req, timeout)
            if r is not None:
                return r
        if wait and timeout is None and self._own is not None:
            r = self._own.run(SESSION_FIELD[name], req)
            if r is not None:
                return r
        started = self._unary(name, req, timeout=timeout)
        t = Transfer(self, started)
        return t.result() if wait else t

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
        wait: bool = True,
    ) -> Any:
        """WRITE `length` bytes (default: the rest of `local`) from `local` into the remote buffer a
        descriptor names. `ready_event` (a torch.cuda.Event(interprocess=True), or its IPC handle)
        orders the send after the GPU work recorded before it. With `wait` (default) returns a
        TransferResult once the bytes landed; else a Transfer to wait on or cancel. `timeout`
        (seconds) is the transfer's deadline (default: the daemon's)."""
        tried = False
        if wait and self._local is not None and self._local.available is not False:  # the request written directly
            body = _waited.write_body(local, remote, length, local_offset, remote_offset, notification, ready_event, timeout)
            if body is not None:
                r = self._local.run("write", None, timeout, body)
                if r is not None:
                    return r
                tried = True
        req = _ops.write_request(WriteOp(local, remote, length, local_offset, remote_offset), notification, ready_event, timeout, wait)
        return self._start("Write", req, timeout, wait, tried)

    def read(
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
        """READ `length` bytes (default: the rest of `local`) of a remote buffer into `local`."""
        tried = False
        if wait and self._local is not None and self._local.available is not False:  # the request written directly
            body = _waited.read_body(remote, local, length, remote_offset, local_offset, timeout)
            if body is not None:
                r = self._local.run("read", None, timeout, body)
                if r is not None:
                    return r
                tried = True
        req = _ops.read_request(ReadOp(remote, local, length, remote_offset, local_offset), timeout, wait)
        return self._start("Read", req, timeout, wait, tried)

    def write_batch(
        self,
        ops: Sequence[WriteOp],
        *,
        notification: bytes = b"",
        ready_event: Any = None,
        timeout: Optional[float] = None,
        wait: bool = True,
    ) -> Any:
        """Several WRITE entries as one transfer (one id; per-entry statuses in the result)."""
        req = _ops.write_batch_request(ops, notification, ready_event, timeout, wait, pack=self._packs(ops))
        return self._start("WriteBatch", req, timeout, wait)

    def read_batch(self, ops: Sequence[ReadOp], *, timeout: Optional[float] = None, wait: bool = True) -> Any:
        """Several READ entries as one transfer."""
        return self._start("ReadBatch", _ops.read_batch_request(ops, timeout, wait, pack=self._packs(ops)), timeout, wait)

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
        wait: bool = True,
    ) -> Any:
        """WRITE blocks `local_idx` of a local BlockList (or its id) into blocks `remote_idx` of a
        remote list (its token, or a BlockList), pair by pair: block k of one selection into block
        k of the other, equal in length. Indices: numpy arrays, torch tensors, lists or ranges
        (runs are sent as ranges). Otherwise as `write`."""
        req = _blocks.write_request(local_list, local_idx, remote, remote_idx, notification, ready_event, timeout, wait)
        return self._start("WriteBlocks", req, timeout, wait)

    def read_blocks(
        self,
        local_list: Any,
        local_idx: Any,
        remote: Any,
        remote_idx: Any,
        *,
        timeout: Optional[float] = None,
        wait: bool = True,
    ) -> Any:
        """READ blocks `remote_idx` of a remote list into blocks `local_idx` of a local one, pair by
        pair. Otherwise as `write_blocks`."""
        req = _blocks.read_request(local_list, local_idx, remote, remote_idx, timeout, wait)
        return self._start("ReadBlocks", req, timeout, wait)

    def prepare_blocks(self, lists: Any, entries: Any) -> PreparedList:
        """A prepared list in the daemon: `lists`, this node's block lists (BlockLists or ids) or
        one other node's (their tokens); `entries`, an N×3 array (numpy, torch, nested lists) of
        (position in `lists`, first block, block count). Transfers then name entries by index
        (`write_prepared` / `read_prepared`): nothing per block crosses the API. The daemon checks
        every entry once (InvalidArgument naming the first bad one). Lives until released."""
        req = _blocks.prepare_request(lists, entries)
        p = PreparedList(self, self._unary("PrepareBlocks", req))
        self._reattach.track_prepared(p, req)
        return p

    def _release_prepared(self, prepared_id: int) -> None:
        self._unary("ReleasePrepared", _proto.message("ReleasePreparedRequest")(prepared_id=prepared_id))

    def write_prepared(
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
        """WRITE entries `local_idx` of a local PreparedList into entries `remote_idx` of a remote
        one (prepared here from the other node's tokens), pair by pair, as one transfer: the
        notification reaches the other node once every byte landed. Otherwise as `write`."""
        req = _blocks.prepared_request("WRITE", local, local_idx, remote, remote_idx, notification, timeout, wait)
        return self._start("WritePrepared", req, timeout, wait)

    def read_prepared(
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
        """READ entries `remote_idx` of a remote PreparedList into entries `local_idx` of a local
        one; the notification reaches the other node once every byte landed here."""
        req = _blocks.prepared_request("READ", local, local_idx, remote, remote_idx, notification, timeout, wait)
        return self._start("ReadPrepared", req, timeout, wait)

    def cancel(self, transfer_id: int) -> bool:
        """Cancels a transfer on both sides; False when it had already ended."""
        return self._unary("Cancel", _proto.message("CancelRequest")(transfer_id=transfer_id)).cancelled

    def session(self, timeout: Optional[float] = None) -> Session:
        """A stream for many transfers in flight (`timeout` bounds the whole session): a connection
        of the daemon's local session of its own where waited transfers would take it (`local`),
        else the `Session` RPC."""
        return Session(self, timeout)

    def subscribe(self, addressed_to: str = "") -> Subscription:
        """Notifications other nodes attach to transfers into this node's buffers. Returns once the
        subscription is in place: notifications of transfers finishing after that are delivered.
        On the local session (a unix endpoint) a session of its own, read on the caller's thread
        (tcpxd._subscription); else the Subscribe RPC. `addressed_to`: only the notifications
        framed to that name (tcpxd.nixl's agents; docs/API.md, "Notifications"), where the daemon
        filters (since session 31; an older one sends all)."""
        if self._local is not None:
            sub = LocalSubscription.open(self._local, self.endpoint, addressed_to)
            if sub is not None:
                self._subscriptions.add(sub)
                return sub
        call = self._stream("Subscribe", _proto.message("SubscribeRequest")(addressed_to=addressed_to))
        try:
            call.initial_metadata()  # the daemon answers headers once it has subscribed
        except grpc.RpcError as e:
            raise from_rpc_error(e, self.endpoint) from None
        return Subscription(call)
