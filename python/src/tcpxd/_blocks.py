"""Block lists and block transfers (docs/BLOCKS.md), what the sync and asyncio clients share: a
list's layout and a transfer's indices packed to the bytes the API takes, and the requests.

Offsets, lengths and indices may be numpy arrays, torch tensors (any device: copied to the host),
lists or ranges. A list whose blocks step evenly is sent as four numbers (strided), one of equal
lengths as one offset each (uniform), else an offset and a length each (explicit). Indices go as
(start, count) ranges when that is smaller than one u32 each (a `range` always is).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

from . import _ops, _proto
from .errors import InvalidArgument

#: Encodings of BlockIndices.data (tcpxd.v1.IndexEncoding).
U32 = 0
RANGES = 1

#: The most blocks one transfer may name per side (engine MAX_TRANSFER_BLOCKS).
MAX_TRANSFER_BLOCKS = 1 << 22
#: The most blocks one list may hold (engine MAX_LIST_BLOCKS).
MAX_LIST_BLOCKS = 1 << 24


def _array(x: Any, field: str) -> np.ndarray:
    """`x` as a 1-D numpy array of integers (a torch tensor is copied to the host)."""
    if isinstance(x, range):
        return np.arange(x.start, x.stop, x.step, dtype=np.int64)
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.ndim == 0:
        a = a.reshape(1)
    if a.ndim != 1:
        raise InvalidArgument(f"{field}: expected a 1-D sequence of integers, got shape {a.shape}")
    if a.size == 0:
        return a.astype(np.int64)
    if not np.issubdtype(a.dtype, np.integer):
        raise InvalidArgument(f"{field}: expected integers, got {a.dtype}")
    if (a < 0).any():
        raise InvalidArgument(f"{field}[{int(np.argmax(a < 0))}]: {int(a[a < 0][0])} is negative")
    return a


def _fits(a: np.ndarray, field: str, limit: int, what: str) -> None:
    if a.size and int(a.max()) > limit:
        at = int(np.argmax(a > limit))
        raise InvalidArgument(f"{field}[{at}]: {int(a[at])} exceeds the limit of {limit} for {what}")


def layout(offsets: Any, lengths: Any = None, *, block_size: Optional[int] = None) -> Tuple[str, Any]:
    """The most compact RegisterBlocksRequest layout for these blocks: ("strided" | "uniform" |
    "explicit", message). Give `lengths` (one per offset, or one int for all) or `block_size`."""
    off = _array(offsets, "offsets")
    if off.size == 0:
        raise InvalidArgument("offsets: at least one block is required")
    if off.size > MAX_LIST_BLOCKS:
        raise InvalidArgument(f"offsets: {off.size} blocks exceed the limit of {MAX_LIST_BLOCKS}")
    _fits(off, "offsets", (1 << 64) - 1, "an offset")
    if (lengths is None) == (block_size is None):
        raise InvalidArgument("register_blocks: give exactly one of lengths or block_size=")
    if block_size is not None:
        lengths = block_size
    if isinstance(lengths, (int, np.integer)):
        lens = np.full(off.size, int(lengths), dtype=np.int64)
    else:
        lens = _array(lengths, "lengths")
        if lens.size != off.size:
            raise InvalidArgument(f"lengths: {lens.size} lengths for {off.size} offsets (give one per offset, or one for all)")
    _fits(lens, "lengths", (1 << 32) - 1, "a block's length")
    off = off.astype(np.uint64)
    lens = lens.astype(np.uint32)
    if lens.size and (lens == lens[0]).all():
        length = int(lens[0])
        if off.size == 1:
            return "strided", _proto.message("StridedBlocks")(first=int(off[0]), stride=length, length=length, count=1)
        steps = np.diff(off.astype(np.int64))
        if steps[0] > 0 and (steps == steps[0]).all():
            return "strided", _proto.message("StridedBlocks")(
                first=int(off[0]), stride=int(steps[0]), length=length, count=int(off.size)
            )
        return "uniform", _proto.message("UniformBlocks")(offsets=off.astype("<u8").tobytes(), length=length)
    return "explicit", _proto.message("ExplicitBlocks")(
        offsets=off.astype("<u8").tobytes(), lengths=lens.astype("<u4").tobytes()
    )


def tiling(buffer: Any, offsets: Any, block_size: Optional[int]) -> Any:
    """`offsets`, or with `block_size` alone, blocks of that size tiling the whole buffer."""
    if offsets is not None:
        return offsets
    size = getattr(buffer, "size", None)
    if block_size is None or size is None:
        raise InvalidArgument("offsets: give the blocks' offsets (or block_size= with a Buffer, to tile it)")
    if block_size <= 0 or block_size > int(size):
        raise InvalidArgument(f"block_size: {block_size} (1 to the buffer's {size} bytes allowed)")
    return range(0, int(size) - int(size) % int(block_size), int(block_size))


def register_request(buffer: Any, offsets: Any, lengths: Any, block_size: Optional[int]) -> Any:
    kind, msg = layout(offsets, lengths, block_size=block_size)
    return _proto.message("RegisterBlocksRequest")(buffer_id=_ops.buffer_id(buffer), **{kind: msg})


def pack_indices(idx: Any, field: str) -> Any:
    """A transfer's indices as a BlockIndices message: (start, count) ranges when smaller than
    one u32 each (always for a `range` of step 1), else u32s."""
    BI = _proto.message("BlockIndices")
    if isinstance(idx, range) and idx.step == 1:
        if len(idx) == 0:
            raise InvalidArgument(f"{field}: at least one block is required")
        if idx.start < 0:
            raise InvalidArgument(f"{field}[0]: {idx.start} is negative")
        _fits(np.array([idx.stop - 1]), field, (1 << 32) - 1, "a block index")
        return BI(encoding=RANGES, data=np.array([idx.start, len(idx)], dtype="<u4").tobytes())
    a = _array(idx, field)
    if a.size == 0:
        raise InvalidArgument(f"{field}: at least one block is required")
    if a.size > MAX_TRANSFER_BLOCKS:
        raise InvalidArgument(f"{field}: {a.size} blocks exceed the limit of {MAX_TRANSFER_BLOCKS}")
    _fits(a, field, (1 << 32) - 1, "a block index")
    a = a.astype(np.int64)
    breaks = np.flatnonzero(np.diff(a) != 1) + 1
    if (breaks.size + 1) * 2 < a.size:
        starts = np.concatenate(([0], breaks))
        counts = np.diff(np.concatenate((starts, [a.size])))
        pairs = np.empty(2 * starts.size, dtype="<u4")
        pairs[0::2] = a[starts]
        pairs[1::2] = counts
        return BI(encoding=RANGES, data=pairs.tobytes())
    return BI(encoding=U32, data=a.astype("<u4").tobytes())


def token(remote: Any) -> str:
    """A remote list's token: the string, or anything with a `.token` (a BlockList)."""
    return str(remote.token) if hasattr(remote, "token") else str(remote)


def list_id(local: Any) -> int:
    return int(local.id) if hasattr(local, "id") else int(local)


def write_request(
    local: Any, local_idx: Any, remote: Any, remote_idx: Any, notification: bytes, ready_event: Any,
    timeout: Optional[float], wait: bool,
) -> Any:
    return _proto.message("WriteBlocksRequest")(
        local_list_id=list_id(local),
        local_indices=pack_indices(local_idx, "local_indices"),
        remote_token=token(remote),
        remote_indices=pack_indices(remote_idx, "remote_indices"),
        notification=bytes(notification or b""),
        timeout_ms=_ops.timeout_ms(timeout),
        ready_event_ipc_handle=_ops.event_handle(ready_event),
        wait=wait,
    )


def read_request(local: Any, local_idx: Any, remote: Any, remote_idx: Any, timeout: Optional[float], wait: bool) -> Any:
    return _proto.message("ReadBlocksRequest")(
        remote_token=token(remote),
        remote_indices=pack_indices(remote_idx, "remote_indices"),
        local_list_id=list_id(local),
        local_indices=pack_indices(local_idx, "local_indices"),
        timeout_ms=_ops.timeout_ms(timeout),
        wait=wait,
    )


@dataclass
class ListFields:
    """What the daemon said of a list (tcpxd.v1.BlockList)."""

    id: int
    buffer_id: int
    #: What another node names this list by (give it to its writers and readers): a secret.
    token: str
    count: int
    #: Every block's length when they are equal, else 0.
    block_length: int

    @staticmethod
    def of(msg: Any) -> "ListFields":
        return ListFields(msg.id, msg.buffer_id, msg.token, msg.count, msg.block_length)


# -- prepared lists (docs/BLOCKS.md, "Prepared lists")

#: Entries a prepared list may hold, and indices a prepared transfer may name per side.
MAX_PREPARED = 1 << 22


def prepare_request(lists: Any, entries: Any) -> Any:
    """A PrepareBlocksRequest: `lists`, this node's block lists (BlockLists or ids) or one other
    node's (their tokens, strings); `entries`, an N×3 array-like of (position in `lists`, first
    block, block count)."""
    items = list(lists)
    if not items:
        raise InvalidArgument("lists: at least one block list is required")
    remote = [isinstance(x, str) for x in items]
    if any(remote) and not all(remote):
        raise InvalidArgument("lists: give this node's lists (BlockLists or ids) or another node's tokens (strings), not both")
    if hasattr(entries, "detach") and hasattr(entries, "cpu"):
        entries = entries.detach().cpu().numpy()
    e = np.asarray(entries)
    if e.ndim != 2 or e.shape[1] != 3:
        raise InvalidArgument(f"entries: an N×3 array of (list position, first block, block count) is needed, got shape {e.shape}")
    if e.shape[0] == 0:
        raise InvalidArgument("entries: at least one entry is required")
    if e.shape[0] > MAX_PREPARED:
        raise InvalidArgument(f"entries: {e.shape[0]} entries exceed the limit of {MAX_PREPARED}")
    if not np.issubdtype(e.dtype, np.integer):
        raise InvalidArgument(f"entries: expected integers, got {e.dtype}")
    flat = e.reshape(-1)
    if (flat < 0).any() or (flat > (1 << 32) - 1).any():
        at = int(np.argmax((flat < 0) | (flat > (1 << 32) - 1)))
        raise InvalidArgument(f"entries[{at // 3}]: {int(flat[at])} is outside 0..=4294967295")
    data = e.astype("<u4").tobytes()
    msg = _proto.message("PrepareBlocksRequest")
    if all(remote):
        return msg(remote_tokens=items, entries=data)
    return msg(local_list_ids=[list_id(x) for x in items], entries=data)


def prepared_indices(idx: Any, field: str) -> bytes:
    """Entry indices of a prepared list, packed as little-endian u32s."""
    a = _array(idx, field)
    if a.size == 0:
        raise InvalidArgument(f"{field}: at least one entry is required")
    if a.size > MAX_PREPARED:
        raise InvalidArgument(f"{field}: {a.size} entries exceed the limit of {MAX_PREPARED}")
    _fits(a, field, (1 << 32) - 1, "an entry index")
    return a.astype("<u4").tobytes()


class ListState:
    """What the daemon said of a block list, shared by the sync and asyncio lists: `id`,
    `buffer_id`, `token`, `count` (also `len()`) and `block_length` (`ListFields`), taken again
    from a fresh tcpxd.v1.BlockList by `_update` (a refresh)."""

    def __init__(self, client: Any, msg: Any):
        self._client = client
        self._update(msg)
        self.released = False

    def _update(self, msg: Any) -> None:
        f = ListFields.of(msg)
        self.id: int = f.id
        self.buffer_id: int = f.buffer_id
        self.token: str = f.token
        self.count: int = f.count
        #: Every block's length when they are all equal, else 0.
        self.block_length: int = f.block_length

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id}, buffer_id={self.buffer_id}, count={self.count}, block_length={self.block_length})"


class PreparedFields:
    """What the daemon said of a prepared list (tcpxd.v1.PreparedBlocks), shared by the sync and
    asyncio lists: `id`, `entries` (also `len()`), `blocks` (summed over the entries)."""

    def __init__(self, owner: Any, msg: Any):
        self._owner = owner
        self.id: int = msg.prepared_id
        self.entries: int = msg.entries
        self.blocks: int = msg.blocks
        self.released = False

    def __len__(self) -> int:
        return self.entries

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id}, entries={self.entries}, blocks={self.blocks})"


def prepared_id(p: Any) -> int:
    return int(p.id) if hasattr(p, "id") else int(p)


def prepared_request(
    op: str, local: Any, local_idx: Any, remote: Any, remote_idx: Any, notification: bytes, timeout: Optional[float], wait: bool
) -> Any:
    """A WritePreparedRequest (op "WRITE") or ReadPreparedRequest ("READ")."""
    return _proto.message("WritePreparedRequest" if op == "WRITE" else "ReadPreparedRequest")(
        local_prepared_id=prepared_id(local),
        local_indices=prepared_indices(local_idx, "local_indices"),
        remote_prepared_id=prepared_id(remote),
        remote_indices=prepared_indices(remote_idx, "remote_indices"),
        notification=bytes(notification or b""),
        timeout_ms=_ops.timeout_ms(timeout),
        wait=wait,
    )
