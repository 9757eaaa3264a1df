"""What the sync and asyncio clients share: endpoints, request building, results."""

from __future__ import annotations

import os
from array import array
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple, Union

import grpc

from . import _proto
from .errors import InvalidArgument, TcpxdError, from_status

#: The daemon's default API socket.
DEFAULT_ENDPOINT = "unix:/run/tcpxd/tcpxd.sock"
#: Largest client message the daemon accepts (crates/tcpxd/src/daemon.rs MAX_API_MESSAGE).
MAX_MESSAGE = 64 << 20
#: ReadBuffer's and FillBuffer's largest range per call.
MAX_SMALL_IO = 1 << 20

BufferLike = Any  # a tcpxd Buffer / AsyncBuffer, or a buffer id (int)
RemoteLike = Any  # a descriptor string, or anything with a `.descriptor`


def resolve_endpoint(endpoint: Optional[str]) -> str:
    """`endpoint`, else $TCPXD_ENDPOINT, else the daemon's default socket."""
    return endpoint or os.environ.get("TCPXD_ENDPOINT") or DEFAULT_ENDPOINT


def is_unix(endpoint: str) -> bool:
    return endpoint.startswith("unix:") or endpoint.startswith("unix-abstract:")


def resolve_token(endpoint: str, token: Optional[str], token_file: Optional[str]) -> Optional[str]:
    """The API token for a TCP endpoint: `token`, else the file `token_file`, else the file named by
    $TCPXD_API_TOKEN_FILE (as tcpxctl reads it). Unix sockets need none."""
    if token:
        return token.strip()
    if is_unix(endpoint):
        return None
    path = token_file or os.environ.get("TCPXD_API_TOKEN_FILE")
    if path:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    return None


def channel_options() -> List[Tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE),
        ("grpc.max_receive_message_length", MAX_MESSAGE),
        # A daemon that restarts is found again within ~0.1-0.5 s, not after gRPC's default
        # backoff (1 s growing to 2 min).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 500),
        # Despite its name, how long one connection attempt may take until the daemon's HTTP/2
        # SETTINGS arrive (gRPC's MIN_CONNECT_TIMEOUT, doc/connection-backoff.md): its default,
        # 20 s. At 100 ms (as it was, beside the backoff above) a busy 2-core machine failed calls
        # with UNAVAILABLE "connection attempt timed out before receiving SETTINGS frame". A
        # daemon that is gone refuses the connect at once, so this does not slow finding it again.
        ("grpc.min_reconnect_backoff_ms", 20_000),
    ]


def metadata(token: Optional[str]) -> Optional[Tuple[Tuple[str, str], ...]]:
    return (("authorization", f"Bearer {token}"),) if token else None


@dataclass(frozen=True)
class WriteOp:
    """One entry of a write batch: `length` bytes of `local` (at `local_offset`) into `remote`."""

    local: BufferLike
    remote: RemoteLike
    length: Optional[int] = None
    local_offset: int = 0
    remote_offset: int = 0


@dataclass(frozen=True)
class ReadOp:
    """One entry of a read batch: `length` bytes of `remote` (at `remote_offset`) into `local`."""

    remote: RemoteLike
    local: BufferLike
    length: Optional[int] = None
    remote_offset: int = 0
    local_offset: int = 0


@dataclass(frozen=True)
class TransferResult:
    """A transfer that finished OK."""

    transfer_id: int
    total_bytes: int
    bytes_done: int
    elapsed_us: int
    #: Per-entry (code, message), in request order (all 0 for a successful transfer); empty for a
    #: batch of one buffer pair, which travels as packed ranges (its status is every entry's).
    entries: List[Tuple[int, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Notification:
    """A notification another node attached to a transfer into this node's buffers."""

    from_node: str
    transfer_id: int
    payload: bytes
    buffer_ids: List[int]


@dataclass(frozen=True)
class NetDevice:
    """A network device (NIC) the daemon's plugin drives for data lanes."""

    index: int
    name: str
    pci_path: str
    speed_mbps: int
    host_memory: bool
    cuda_memory: bool
    #: Received CUDA data lands in a bounce buffer the daemon unpacks (TCPX's devmem-tcp).
    unpack: bool


@dataclass(frozen=True)
class GpuDevice:
    """A CUDA device of the daemon's machine."""

    ordinal: int
    name: str
    pci_bus_id: str
    total_memory_bytes: int
    compute_capability: Tuple[int, int]


@dataclass(frozen=True)
class GpuNics:
    """Which NIC(s) serve a GPU: every comm the daemon opens is opened under a GPU its NIC serves
    (docs/OPERATIONS.md, "The topology")."""

    gpu_ordinal: int
    gpu_pci_bus_id: str
    #: The plugin's device numbers (NetDevice.index), in order of preference.
    nic_devices: List[int]
    #: Their names, in the same order.
    nic_names: List[str]
    #: How they were chosen: "same PCIe switch", "same root complex", "different root complex",
    #: "even spread (no PCI place)", "a3vm" or "config".
    relation: str


@dataclass(frozen=True)
class NodeInfo:
    """What DescribeNode says about a daemon: hand `node_id` and `peer_addresses` (which every
    descriptor of this node carries already) to whoever needs to reach it."""

    node_id: str
    #: Where other daemons reach this one's peer service (host:port each).
    peer_addresses: List[str]
    version: str
    plugin_name: str = ""
    #: The plugin's file, or "built-in emulation".
    plugin_path: str = ""
    devices: List[NetDevice] = field(default_factory=list)
    gpus: List[GpuDevice] = field(default_factory=list)
    lanes_per_device: int = 0
    chunk_bytes: int = 0
    peer_protocol_version: int = 0
    #: "TCPXD/1" when the API unix socket also speaks the framed local session (docs/API.md);
    #: empty on older daemons. The client finds out for itself (docs/PYTHON.md).
    local_session: str = ""
    #: Request forms the daemon takes beyond the first ones ("prepared_index_windows", ...;
    #: empty on older daemons).
    features: List[str] = field(default_factory=list)
    #: How this node receives (`transfer.protocol`): "eager", "rendezvous" or "auto"; empty from
    #: older daemons.
    transfer_protocol: str = ""
    #: Under "auto": the eager lanes per network device (beside `lanes_per_device`); else 0.
    eager_lanes_per_device: int = 0
    #: Under "auto": transfers towards this node of at most this many bytes go eager; else 0.
    eager_max_bytes: int = 0
    #: Which NIC(s) serve each GPU, one per GPU in ordinal order (empty without GPUs).
    gpu_nics: List[GpuNics] = field(default_factory=list)
    #: Where that map came from (`topology.map`): "pci", "a3vm", "config" or "none"; empty from
    #: older daemons.
    topology_source: str = ""
    #: This daemon process's instance (32 hex digits, new after every restart; empty from older
    #: daemons): a change says the daemon restarted (the client re-attaches by itself).
    instance_id: str = ""
    #: Seconds a restarted daemon keeps its previous instance's registrations for their clients
    #: to re-attach; 0: no state directory, nothing survives a restart.
    reattach_grace_s: int = 0
    #: The transfers the daemon carries inline on a pairing's control connection (no lane): at
    #: most `inline_max_bytes` in total (0: none; a pairing uses the smaller of both nodes'),
    #: `inline_window_bytes` unanswered per peer, GPU memory only with `inline_gpu`, then at most
    #: `inline_gpu_in_flight` such unanswered per peer (`transfer.inline_*`, docs/CONFIG.md). All
    #: 0 / False from older daemons.
    inline_max_bytes: int = 0
    inline_window_bytes: int = 0
    inline_gpu: bool = False
    inline_gpu_in_flight: int = 0
    #: The tcpxd.v1.NodeDescription message itself.
    raw: Any = None


def buffer_id(b: BufferLike) -> int:
    return int(b.id) if hasattr(b, "id") else int(b)


def descriptor(r: RemoteLike) -> str:
    return str(r.descriptor) if hasattr(r, "descriptor") else str(r)


def _length(length: Optional[int], local: BufferLike, local_offset: int, what: str) -> int:
    if length is not None:
        return int(length)
    size = getattr(local, "size", None)
    if size is None:
        raise InvalidArgument(f"{what}.length: give a length when the local buffer is a bare id")
    return int(size) - int(local_offset)


def event_handle(ready_event: Any) -> bytes:
    """The 64-byte IPC handle of a ready event: bytes as they are, or a
    torch.cuda.Event(interprocess=True) (its `ipc_handle()`)."""
    if ready_event is None:
        return b""
    if isinstance(ready_event, (bytes, bytearray, memoryview)):
        return bytes(ready_event)
    if hasattr(ready_event, "ipc_handle"):
        try:
            return bytes(ready_event.ipc_handle())
        except RuntimeError as e:
            raise InvalidArgument(
                f"ready_event: {e} (create it with torch.cuda.Event(interprocess=True) and record it first)"
            ) from None
    raise InvalidArgument(
        f"ready_event: expected bytes or a torch.cuda.Event(interprocess=True), got {type(ready_event).__name__}"
    )


def write_entry(op: WriteOp) -> Any:
    return _proto.message("WriteEntry")(
        local_buffer_id=buffer_id(op.local),
        local_offset=op.local_offset,
        remote_descriptor=descriptor(op.remote),
        remote_offset=op.remote_offset,
        length=_length(op.length, op.local, op.local_offset, "write"),
    )


def read_entry(op: ReadOp) -> Any:
    return _proto.message("ReadEntry")(
        remote_descriptor=descriptor(op.remote),
        remote_offset=op.remote_offset,
        local_buffer_id=buffer_id(op.local),
        local_offset=op.local_offset,
        length=_length(op.length, op.local, op.local_offset, "read"),
    )


def timeout_ms(timeout: Optional[float]) -> int:
    return 0 if timeout is None else max(1, int(timeout * 1000))


def _maybe_wait(name: str, fields: dict, wait: bool) -> dict:
    if wait and _proto.has_field(name, "wait"):
        fields["wait"] = True
    return fields


def write_request(op: WriteOp, notification: bytes, ready_event: Any, timeout: Optional[float], wait: bool) -> Any:
    f = dict(
        entry=write_entry(op),
        notification=bytes(notification or b""),
        timeout_ms=timeout_ms(timeout),
        ready_event_ipc_handle=event_handle(ready_event),
    )
    return _proto.message("WriteRequest")(**_maybe_wait("WriteRequest", f, wait))


def read_request(op: ReadOp, timeout: Optional[float], wait: bool) -> Any:
    f = dict(entry=read_entry(op), timeout_ms=timeout_ms(timeout))
    return _proto.message("ReadRequest")(**_maybe_wait("ReadRequest", f, wait))


#: DescribeNode's feature naming WriteBatch / ReadBatch's packed `ranges` (BatchRanges). A daemon
#: without it ignores the field and refuses the batch ("entries: at least one entry is required"),
#: so the clients send packed batches only to a daemon that lists it (`packs_batches`).
BATCH_RANGES_FEATURE = "batch_ranges"


def packs_batches(features: Sequence[str]) -> bool:
    """Whether a daemon whose DescribeNode lists `features` reads packed batch ranges."""
    return BATCH_RANGES_FEATURE in features


def batch_ranges(ops: Sequence[Any], request: str) -> Optional[Any]:
    """A `BatchRanges` for a batch of two or more WriteOps / ReadOps of ONE buffer pair (one local
    buffer, one remote descriptor, every length given), else None (the batch goes as entries).

    One pass per field over the ops and three packed arrays, where entries cost a message, a
    descriptor string and a per-entry status each (issue 38: ~3x a block list's time for 2,048 x
    16 KiB). The daemon checks every entry as it checks entries, naming `ranges.<field>[k]`."""
    n = len(ops)
    if n < 2 or not _proto.has_field(request, "ranges"):
        return None
    try:
        loc = [o.local for o in ops]
        rem = [o.remote for o in ops]
        lens = [o.length for o in ops]
        # list.count compares by identity first: one C loop each when every op names the same objects.
        if loc.count(loc[0]) != n:
            ids = [buffer_id(b) for b in loc]
            if ids.count(ids[0]) != n:
                return None
        if rem.count(rem[0]) != n:
            ds = [descriptor(r) for r in rem]
            if ds.count(ds[0]) != n:
                return None
        if None in lens:
            return None
        lo = array("Q", [o.local_offset for o in ops]).tobytes()
        ro = array("Q", [o.remote_offset for o in ops]).tobytes()
        uniform = lens.count(lens[0]) == n and int(lens[0]) > 0
        packed_lens = b"" if uniform else array("Q", lens).tobytes()
    except (TypeError, OverflowError, ValueError):
        return None  # negative or non-integer fields: the entries form refuses them naming the entry
    return _proto.message("BatchRanges")(
        local_buffer_id=buffer_id(loc[0]),
        remote_descriptor=descriptor(rem[0]),
        local_offsets=lo,
        remote_offsets=ro,
        lengths=packed_lens,
        uniform_length=int(lens[0]) if uniform else 0,
    )


def write_batch_request(
    ops: Sequence[WriteOp], notification: bytes, ready_event: Any, timeout: Optional[float], wait: bool,
    pack: bool = True,
) -> Any:
    """`pack=False` sends entries even for one buffer pair (benchmarks compare the two forms)."""
    ranges = batch_ranges(ops, "WriteBatchRequest") if pack else None
    f = dict(
        entries=[] if ranges is not None else [write_entry(o) for o in ops],
        notification=bytes(notification or b""),
        timeout_ms=timeout_ms(timeout),
        ready_event_ipc_handle=event_handle(ready_event),
    )
    if ranges is not None:
        f["ranges"] = ranges
    return _proto.message("WriteBatchRequest")(**_maybe_wait("WriteBatchRequest", f, wait))


def read_batch_request(ops: Sequence[ReadOp], timeout: Optional[float], wait: bool, pack: bool = True) -> Any:
    ranges = batch_ranges(ops, "ReadBatchRequest") if pack else None
    f: dict = dict(entries=[] if ranges is not None else [read_entry(o) for o in ops], timeout_ms=timeout_ms(timeout))
    if ranges is not None:
        f["ranges"] = ranges
    return _proto.message("ReadBatchRequest")(**_maybe_wait("ReadBatchRequest", f, wait))


def final_event(started: Any) -> Optional[Any]:
    """The final TransferEvent a `wait` call carried, if the daemon sent one."""
    if _proto.has_field("TransferStarted", "final") and started.HasField("final"):
        return started.final
    return None


def result(event: Any) -> TransferResult:
    """A finished transfer's result; raises the exception of its status when it did not succeed."""
    if event.status_code != 0:
        raise from_status(event.status_code, event.status_message, event=event)
    return TransferResult(
        transfer_id=event.transfer_id,
        total_bytes=event.total_bytes,
        bytes_done=event.bytes_done,
        elapsed_us=event.elapsed_us,
        # (a transfer of one range, or a packed batch, has none: no comprehension to run)
        entries=[(e.code, e.message) for e in entries] if (entries := event.entries) else [],
    )


#: The SessionRequest field that carries each unary transfer call's request.
SESSION_FIELD = {
    "Write": "write",
    "Read": "read",
    "WriteBatch": "write_batch",
    "ReadBatch": "read_batch",
    "WriteBlocks": "write_blocks",
    "ReadBlocks": "read_blocks",
    "WritePrepared": "write_prepared",
    "ReadPrepared": "read_prepared",
}


def settle(fut: Any, ev: Any) -> None:
    """Resolves a session's future (concurrent.futures or asyncio) by the daemon's event for it.
    A sink whose class says `skips_result` (tcpxd.nixl's transfer parts and notifications: they
    keep only whether it succeeded) gets None for a transfer that finished OK, not a
    TransferResult (~3 µs of frozen dataclass a transfer, on the 2-core build VM)."""
    kind = ev.WhichOneof("event")
    if kind == "finished":
        if getattr(fut, "skips_result", False) and ev.finished.status_code == 0:
            fut.set_result(None)
            return
        try:
            fut.set_result(result(ev.finished))
        except TcpxdError as e:
            fut.set_exception(e)
    elif kind == "refused":
        fut.set_exception(from_status(ev.refused.code, ev.refused.message))
    elif kind == "cancelled":
        fut.set_result(ev.cancelled.cancelled)
    elif kind == "registered":
        fut.set_result(ev.registered)
    elif kind == "prepared":
        fut.set_result(ev.prepared)
    elif kind == "released":
        fut.set_result(ev.released)


#: An OK entry's (code, message), as a finished event's OK entries give it.
_OK_ENTRY = (0, "")


def done_result(transfer_id: int, total_bytes: int, bytes_done: int, elapsed_us: int, entries: int) -> TransferResult:
    """The result of an OK end as the completion board published it (tcpxd._board): what
    `result` gives for its `finished` event (status OK, `entries` per-entry statuses each OK)."""
    return TransferResult(transfer_id=transfer_id, total_bytes=total_bytes, bytes_done=bytes_done,
                          elapsed_us=elapsed_us, entries=[_OK_ENTRY] * entries if entries else [])


def settle_done(fut: Any, transfer_id: int, total_bytes: int, bytes_done: int, elapsed_us: int, entries: int) -> None:
    """Resolves a session's future by its transfer's OK end as the completion board published it
    (tcpxd._board): what `settle` gives for the `finished` event of status OK, with `entries`
    per-entry statuses each OK and without a message, that the daemon writes right after (the
    only ends the board carries)."""
    if getattr(fut, "skips_result", False):
        fut.set_result(None)
        return
    fut.set_result(done_result(transfer_id, total_bytes, bytes_done, elapsed_us, entries))


def notification(n: Any) -> Notification:
    return Notification(
        from_node=n.from_node, transfer_id=n.transfer_id, payload=bytes(n.payload), buffer_ids=list(n.buffer_ids)
    )


def node_info(m: Any) -> NodeInfo:
    return NodeInfo(
        node_id=m.node_id,
        peer_addresses=list(m.peer_addresses),
        version=m.version,
        plugin_name=m.plugin_name,
        plugin_path=m.plugin_path,
        devices=[
            NetDevice(d.index, d.name, d.pci_path, d.speed_mbps, d.host_memory, d.cuda_memory, d.unpack)
            for d in m.devices
        ],
        gpus=[
            GpuDevice(
                g.ordinal, g.name, g.pci_bus_id, g.total_memory_bytes,
                (g.compute_capability_major, g.compute_capability_minor),
            )
            for g in m.gpus
        ],
        lanes_per_device=m.lanes_per_device,
        chunk_bytes=m.chunk_bytes,
        peer_protocol_version=m.peer_protocol_version,
        local_session=m.local_session,
        features=list(m.features),
        transfer_protocol=m.transfer_protocol,
        eager_lanes_per_device=int(m.eager_lanes_per_device),
        eager_max_bytes=int(m.eager_max_bytes),
        gpu_nics=[
            GpuNics(int(g.gpu_ordinal), g.gpu_pci_bus_id, [int(d) for d in g.nic_devices], list(g.nic_names), g.relation)
            for g in m.gpu_nics
        ],
        topology_source=m.topology_source,
        instance_id=m.instance_id,
        reattach_grace_s=int(m.reattach_grace_s),
        inline_max_bytes=int(m.inline_max_bytes),
        inline_window_bytes=int(m.inline_window_bytes),
        inline_gpu=bool(m.inline_gpu),
        inline_gpu_in_flight=int(m.inline_gpu_in_flight),
        raw=m,
    )


def kind_name(kind: int) -> str:
    name = _proto.enum_value("BufferKind", kind)
    return name.replace("BUFFER_KIND_", "").lower()


def host_register(size: int, label: str) -> Any:
    return _proto.message("RegisterBufferRequest")(host=_proto.message("HostAllocation")(size=size), label=label)


def cuda_register(size: int, device: int, label: str) -> Any:
    return _proto.message("RegisterBufferRequest")(
        cuda=_proto.message("CudaAllocation")(device=device, size=size), label=label
    )


def ipc_register(handle: bytes, offset: int, size: int, device: int, label: str) -> Any:
    return _proto.message("RegisterBufferRequest")(
        cuda_ipc=_proto.message("CudaIpcImport")(device=device, ipc_handle=bytes(handle), offset=offset, size=size),
        label=label,
    )


def fill_requests(buffer: int, offset: int, data: Union[bytes, bytearray, memoryview]) -> List[Any]:
    """FillBuffer requests writing `data` at `offset`, at most 1 MiB each."""
    mv = memoryview(bytes(data))
    out = []
    for pos in range(0, len(mv), MAX_SMALL_IO):
        chunk = mv[pos : pos + MAX_SMALL_IO]
        out.append(
            _proto.message("FillBufferRequest")(
                buffer_id=buffer, offset=offset + pos, length=len(chunk), repeat=bytes(chunk)
            )
        )
    return out


def read_ranges(offset: int, length: int) -> List[Tuple[int, int]]:
    return [(p, min(MAX_SMALL_IO, offset + length - p)) for p in range(offset, offset + length, MAX_SMALL_IO)]


def fill_pattern(buffer: int, offset: int, length: int, byte: Optional[int], seed: Optional[int]) -> Any:
    F = _proto.message("FillBufferRequest")
    if (byte is None) == (seed is None):
        raise InvalidArgument("fill: give exactly one of byte= or seed=")
    if byte is not None:
        return F(buffer_id=buffer, offset=offset, length=length, byte=byte)
    return F(buffer_id=buffer, offset=offset, length=length, seed=seed)


def ensure_grpc_code(e: BaseException) -> bool:
    return isinstance(e, grpc.RpcError)
