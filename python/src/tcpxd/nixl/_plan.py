"""Prepared descriptor lists and the daemon requests a transfer by indices becomes.

The one place that knows how a NIXL transfer maps onto the daemon's API.

**Granule lists (the block path).** Every daemon buffer an agent registers carries a strided
block list tiling it in granules of G bytes (4 KiB; more for buffers past 16,777,216 granules) and
a fine one (512 bytes, likewise), and the agent's metadata publishes each region's list tokens and
G. A prepared list is held here as arrays per descriptor: its region, offset in the region's
buffer and length, and, precomputed, whether it is *granule-aligned* (offset and length multiples
of its buffer's G, inside the list), its list, first granule and granule count; on the fine lists
where the 4 KiB ones do not align every descriptor and the fine ones do (`Prepped._granules`);
a side on the 4 KiB lists meeting one on the fine lists retiles on its fine ones
(`Prepped.fine_twin`). A transfer whose every pair is aligned on both sides with the same G is
grouped by (local list, remote list) — a daemon buffer pair — and each group is
one WriteBlocks/ReadBlocks request whose indices are granule *ranges* (start, count), consecutive
ones merged, both sides' ranges packed independently (the daemon copies block k of one selection
into block k of the other: both sides list the same number of granules in pair order). vLLM's
pull request (32 layers × 2 regions, 512 scattered 16 KiB blocks each) is one request per layer
buffer pair, not 32,768 entries.

**The batch path (fallback).** A transfer with an unaligned descriptor (or lengths, granules,
destination overlaps the block path cannot carry) pairs the descriptors, merges neighbours
contiguous on both sides (as NIXL merges descriptors), groups them by buffer pair (the daemon
coalesces a plain batch of one buffer pair into shared wire chunks) and cuts each group into
WriteBatch/ReadBatch requests of at most MAX_ENTRIES entries.

**Prepared lists in the daemon (the fast path).** A list whose every descriptor is
granule-aligned with one length is also prepared in the daemon (PrepareBlocks: its buffers' granule
lists, and per descriptor its buffer's position, first granule and granule count), on the agent's
session, once (again if the session is renewed). A transfer between two such lists of equal
signature is then one WritePrepared/ReadPrepared request: the two prepared ids and both index arrays
packed as u32s, nothing per descriptor in Python; the daemon groups the pairs by buffer pair and
sends the notification (a READ's too) once every byte landed. Large index arrays stay off the
socket. Arrays of vLLM's form (region base + block id, R regions × B blocks:
`region_ids[:, None] * num_blocks + block_ids`, flattened) go as outer sums (OuterIndices: R row
bases and B columns, ~2 KiB where 32,768 indices take 128 KiB), found by `_indices.Outer.encode`,
which also stands for the range check; the daemon expands them. With the package's C pass
(tcpxd._native: one read of the array, the columns written) that is the cheapest form and is
looked for first when both sides have it. Anything else (and every array when the C pass is not
built: numpy needs a subtraction into scratch, a comparison and a scan, which cost about what the
ring's check and pack do) is packed into a slot of the agent's index ring (`Windows`, a host
buffer shared with the daemon) and named by IndexWindow, the daemon reading it when it takes the
request; where the ring cannot serve either, numpy's outer sums, else packed into the request.

A request on this path does little besides those passes, as every Python line, call and object
costs more once they swept the caches (vLLM's pull: ~0.5 µs a line). The first request between two
prepared handles (in one direction, one skip_desc_merge) that takes the prepared path is planned
the general way, and its `Lane` is kept on the local handle when both sides went as outer sums
found by the C pass, or through the index ring, or (fewer than WINDOW_MIN indices a side) packed
in the request: the lists, the request's constant fields, the prepared ids' fields for the daemon
ids they were made from, the notification frame's head. The next requests between them are made
on the lane (`Lane.take`): one dict lookup; both sides found and encoded as the request's fields
in one C call (`_native.outer_fields`), else both int64 arrays checked in one reduction each
(`Lane.fits`; anything else, a bad index included, goes the general way, which names it); one
`Prepared` (the request, and its own plan), one Xfer and handle. `transfer` reads the agent's
session and the lists' daemon ids without a lock (PrepareBlocks again only on a new session),
puts the outer sums in the request or takes a ring slot and packs both sides into it in one call
(`Windows.put`: no lock, list pop and append), and sends the request (a few KiB, or a few dozen
bytes with the ring) as one frame in one send (`Session._submit_frame`; outer sums' requests are
joined with their frame header in one C call, `Session._submit_joined`); no clock is read for
telemetry unless the agent captures it. About 100 Python statements for make + transfer + check
(session 15, counted), where the general way runs about 240 lines.

Either way the requests go out on the agent's session and pipeline; _xfer.Xfer follows them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from .. import _proto
from .._session import _field_key
from . import _wire
from . import _indices
from ._errors import nixlInvalidParamError, nixlMismatchError
from ._indices import Scratch, Windows, _umax
from ._regions import Region, RegionTable
from ._wire import V

#: Entries per WriteBatch/ReadBatch request (the engine's max_entries).
MAX_ENTRIES = 65536
#: Granules one block request may name per side (the engine's MAX_TRANSFER_BLOCKS). A group is cut
#: into requests of at most this many; a pair of more than half of it takes the batch path.
MAX_BLOCKS = 1 << 22
#: The BlockIndices encoding of (start, count) u32 pairs (tcpxd.v1.IndexEncoding.RANGES).
RANGES = 1
#: Entries a daemon prepared list may hold, and indices a prepared transfer may name per side.
MAX_PREPARED = 1 << 22
#: The largest range a one-pair transfer sends as the plain ReadRequest / WriteRequest
#: (`single_fields`); a larger one keeps the block or prepared path, as bulk transfers had it.
SINGLE_MAX = 1 << 20

_LIST_SHIFT = np.int64(32)
_U32 = np.dtype("<u4")
_LOW = np.int64(0xFFFFFFFF)
_I64 = np.dtype(np.int64)
_U64 = np.dtype(np.uint64)


@dataclass
class Prepped:
    """A prepared descriptor list: whose memory (`agent`, "" for the local agent), and per
    descriptor its region (index into `regions`), offset in that region's buffer and length; and
    what the block path needs, precomputed (module doc)."""

    agent: str
    mem: str
    regions: List[Region]
    region: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    #: Tile on the fine lists whatever the coarse ones align (`fine_twin`).
    force_fine: bool = False

    def __post_init__(self) -> None:
        #: Per region: its buffer's id, and its descriptor as an encoded field of each entry kind.
        #: The number of descriptors.
        self.count = len(self.length)
        self.buffer_ids = np.array([r.buffer_id for r in self.regions], dtype=np.uint64)
        descs = [r.descriptor.encode() for r in self.regions]
        self.desc_rows = {"WRITE": _wire.blobs(3, descs), "READ": _wire.blobs(1, descs)}
        #: Per region: its daemon buffer's index among this list's buffers (`buffers`).
        keys = [(r.buffer_id if not self.agent else r.descriptor) for r in self.regions]
        pos = {k: i for i, k in enumerate(dict.fromkeys(keys))}
        uniq = list(pos)
        self.buffer_of = np.array([pos[k] for k in keys], dtype=np.int64)
        self.nbuffers = len(uniq)
        #: A region of each buffer (the first), by buffer index: whose granule lists the buffer's are.
        first = {k: r for k, r in zip(reversed(keys), reversed(self.regions))}
        self._buffer_region = [first[k] for k in uniq]
        self._granules()
        #: The daemon's prepared list of these descriptors: (session, prepared id), set by the
        #: agent on the session it was prepared on; `refused`: the daemon would not prepare it
        #: (an older daemon, a list over its limits): the block path serves it.
        self.daemon: Optional[Tuple[Any, int]] = None
        self.refused = False
        #: Whether the daemon prepared it once (the prepared path is planned only then).
        self.held = False
        self.daemon_lock = threading.Lock()
        #: Whether the daemon can hold this list, but for a refusal (`preparable`).
        self._holdable = self.usig is not None and self.usig >= 0 and 0 < len(self.length) <= MAX_PREPARED
        self._scratch: Optional[np.ndarray] = None
        self._scratch_lock = threading.Lock()
        self._fields: Dict[str, List[bytes]] = {}
        self._rows: Optional[int] = None

    @property
    def rows(self) -> int:
        """The regions this list's descriptors lie in (computed once): the rows an index array
        of vLLM's form has when it names blocks of every region (`Outer.encode`)."""
        if self._rows is None:
            self._rows = len(np.unique(self.region)) if len(self.region) else 0
        return self._rows

    def _granules(self) -> None:
        """Per descriptor: `sig` (length × 64 + log2 G when granule-aligned, else -1 locally and
        -2 remotely, so two sides agree only where both are aligned with equal G and length),
        `gpos` (buffer index << 32 | first granule), `gcnt` (granules); `lists`, per buffer its
        granule list (local: list id; remote: token). On the buffers' granule lists, or on their
        fine ones (`fine`) where those align every descriptor and the coarse ones do not (blocks
        not a multiple of 4 KiB); `overlaps`: whether any two descriptors of the list share a byte
        (the block path refuses a destination named twice)."""
        n = len(self.length)
        self.fine = self.force_fine
        ok, g, first, cnt = self._tiled(self.fine)
        if n and not self.fine and not bool(ok.all()) and any(r.fine for r in self.regions):
            fok, fg, ffirst, fcnt = self._tiled(True)
            if bool(fok.all()):
                self.fine, ok, g, first, cnt = True, fok, fg, ffirst, fcnt
        self.lists: List[Any] = [r.tiling(self.fine)[3 if self.agent else 2] for r in self._buffer_region]
        log2 = np.zeros(n, dtype=np.int64)
        if n:
            log2[ok] = np.log2(g[ok]).astype(np.int64)
        ln = self.length.astype(np.int64)
        self.sig = np.where(ok, ln * 64 + log2, -2 if self.agent else -1)
        self.gpos = (self.buffer_of[self.region] << _LIST_SHIFT) | np.where(ok, first, 0)
        self.gcnt = np.where(ok, cnt, 0)
        self.aligned = bool(ok.all()) if n else False
        #: The one `sig` of every descriptor, when they share it (vLLM's lists: blocks of one size):
        #: a transfer then compares two numbers instead of gathering both sides' signatures.
        self.usig: Optional[int] = int(self.sig[0]) if n and bool((self.sig == self.sig[0]).all()) else None
        self._overlaps: Optional[bool] = None
        self._fine_twin: Optional[Prepped] = None

    @property
    def fine_twin(self) -> Optional["Prepped"]:
        """This list tiled on its buffers' fine lists (itself when it already is), for a pair
        whose other side only the fine lists align (`unprepared_plan`); None where its buffers have
        no fine lists. Made once, on first use."""
        if self.fine:
            return self
        if not any(r.fine for r in self.regions):
            return None
        if self._fine_twin is None:
            self._fine_twin = Prepped(self.agent, self.mem, self.regions, self.region, self.offset, self.length,
                                      force_fine=True)
        return self._fine_twin

    def _tiled(self, fine: bool) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(aligned, granule, first granule, granules) per descriptor on the coarse or fine lists."""
        n = len(self.length)
        tiles = [r.tiling(fine) for r in self.regions]
        g = np.array([t[0] for t in tiles], dtype=np.int64)[self.region] if n else np.zeros(0, np.int64)
        cap = np.array([t[1] for t in tiles], dtype=np.int64)[self.region] if n else np.zeros(0, np.int64)
        off = self.offset.astype(np.int64)
        ln = self.length.astype(np.int64)
        gs = np.maximum(g, 1)
        first, cnt = off // gs, ln // gs
        ok = (g > 0) & (off % gs == 0) & (ln % gs == 0) & (first + cnt <= cap) & (cnt <= MAX_BLOCKS // 2)
        return ok, g, first, cnt

    @property
    def overlaps(self) -> bool:
        """Whether two descriptors of the list share a byte (computed once, on first use)."""
        if self._overlaps is None:
            n = len(self.length)
            if n > 1:  # sorted by (buffer, offset): does one reach into the next?
                b = self.buffer_of[self.region]
                off, ln = self.offset.astype(np.int64), self.length.astype(np.int64)
                order = np.lexsort((off, b))
                bo, oo, lo = b[order], off[order], ln[order]
                self._overlaps = bool(((bo[1:] == bo[:-1]) & (oo[1:] < oo[:-1] + lo[:-1])).any())
            else:
                self._overlaps = False
        return self._overlaps

    @property
    def preparable(self) -> bool:
        """Whether the daemon can hold this list (every descriptor granule-aligned, one length)."""
        return self._holdable and not self.refused

    def prepare_request(self) -> Any:
        """This list's PrepareBlocksRequest: its buffers' granule lists (ids here, tokens for a
        remote agent's) and per descriptor (buffer position, first granule, granules), u32s."""
        ent = np.empty((len(self.length), 3), dtype="<u4")
        ent[:, 0] = self.buffer_of[self.region]
        ent[:, 1] = self.gpos & _LOW
        ent[:, 2] = self.gcnt
        cls = _proto.message("PrepareBlocksRequest")
        if self.agent:
            return cls(remote_tokens=[str(t) for t in self.lists], entries=ent.tobytes())
        return cls(local_list_ids=[int(x) for x in self.lists], entries=ent.tobytes())

    def list_fields(self, read: bool) -> List[bytes]:
        """Per buffer, its granule list as the field a block request names it by: the local
        list's id (ReadBlocksRequest.local_list_id = 3, WriteBlocksRequest's = 1), the remote
        list's token (remote_token: 1 in a READ, 3 in a WRITE). Encoded once."""
        key = "read" if read else "write"
        got = self._fields.get(key)
        if got is None:
            if not self.agent:
                tag = b"\x18" if read else b"\x08"
                got = [tag + _wire.varint(int(x)) for x in self.lists]
            else:
                tag = b"\x0a" if read else b"\x1a"
                got = [tag + _wire.varint(len(t.encode())) + t.encode() for t in self.lists]
            self._fields[key] = got
        return got

    def distinct(self, idx: np.ndarray) -> bool:
        """Whether `idx` names no descriptor twice (a scratch array per list: two gathers)."""
        m = len(idx)
        if m < 2:
            return True
        with self._scratch_lock:
            if self._scratch is None:
                self._scratch = np.empty(len(self.length), dtype=np.int64)
            s = self._scratch
            at = np.arange(m, dtype=np.int64)
            s[idx] = at
            return bool((s[idx] == at).all())

    def __len__(self) -> int:
        return self.count


def prepare(table: RegionTable, mem: str, rows: np.ndarray, agent: str, owner: str, what: str) -> Prepped:
    region, offset = table.resolve(mem, rows, owner, what)
    return Prepped(agent, mem, table.regions, region, offset, rows[:, 1].copy())


class Plan:
    """A transfer's daemon requests, serialized (`bodies`: each the bytes of the message in
    `field` of a SessionRequest, without a notification, or a list of pieces whose concatenation
    they are; `notif_key` is the key of a WRITE's notification field, appended when one rides),
    and its size. `path`: "prepared" (one request naming two daemon prepared lists), "blocks"
    (granule lists), "batch", or "plain" (one range of at most SINGLE_MAX bytes: the plain
    ReadRequest / WriteRequest, `descs_plan`). `prepared`: the prepared path's request before it is bound to a
    session's prepared ids."""

    __slots__ = ("op", "bodies", "total_bytes", "desc_count", "entries", "path", "field", "notif_key", "prepared")

    def __init__(self, op: str, bodies: List[Any], total_bytes: int, desc_count: int, entries: int, path: str = "batch",
                 field: str = "", notif_key: bytes = b"", prepared: Optional["Prepared"] = None) -> None:
        self.op = op
        self.bodies = bodies
        self.total_bytes = total_bytes
        self.desc_count = desc_count
        self.entries = entries
        self.path = path
        self.field = field or _FIELD[(op, path)]
        self.notif_key = _NOTIF_KEY[path] if op == "WRITE" or path == "prepared" else notif_key
        self.prepared = prepared

    @property
    def carries_notification(self) -> bool:
        """Whether a notification can ride the request itself (else it follows every part)."""
        return len(self.bodies) == 1 and (self.op == "WRITE" or self.path == "prepared")

    @property
    def parts(self) -> int:
        """The daemon requests a post sends (the prepared path's one is built as it is sent)."""
        return 1 if self.prepared is not None else len(self.bodies)

    @property
    def requests(self) -> List[Any]:
        """The requests as messages (for inspection; none for the prepared path, whose request
        is built as it is sent)."""
        cls = _proto.message(_MESSAGE[self.field])
        return [cls.FromString(b if isinstance(b, bytes) else b"".join(b)) for b in self.bodies]


#: A lane's bound ids before it was bound: no list's `daemon` is this object.
_UNBOUND: Tuple[Any, int] = (None, 0)


class Lane:
    """What every prepared-path transfer in one direction between one local and one remote
    prepared list shares, worked out once: both lists, the request's SessionRequest field and
    timeout field, what the block or batch path needs should the daemon refuse a list, and (for
    the agent's fast path) the prepared ids' fields for the daemon ids they were made from and
    the notification frame's head. The agent keeps one per (operation, local handle, remote
    handle, skip_desc_merge) once a transfer between them took the index ring (`fits`); the
    outer-sum and packed forms make one per request."""

    __slots__ = ("op", "local", "remote", "merge", "timeout_ms", "tmo", "field", "key", "bound", "note_head", "dims",
                 "singles")

    def __init__(self, op: str, local: Prepped, remote: Prepped, merge: bool, timeout_ms: int, note_head: Optional[bytes] = None) -> None:
        self.op = op
        self.local = local
        self.remote = remote
        self.merge = merge
        self.timeout_ms = timeout_ms
        self.tmo = _timeout(b"\x30", timeout_ms)  # timeout_ms = 6 in both requests
        self.field = _FIELD[(op, "prepared")]
        #: The field's key bytes in a SessionRequest (`Session._submit_joined`'s `key`).
        self.key = _field_key(self.field)
        #: Both lists' daemon ids (`Prepped.daemon`: (session, id)) and the prepared ids' fields
        #: made from them (`bind`), one tuple (replaced whole: read without a lock).
        self.bound: Tuple[Tuple[Any, int], Tuple[Any, int], bytes] = (_UNBOUND, _UNBOUND, b"")
        #: The notification frame up to the message (`_notify.frame`'s head for this pair of
        #: agents), set on a lane the agent keeps (its requests take the fast path): else None.
        self.note_head = note_head
        #: Both lists' (rows, count), for `take`'s outer sums (None until first needed).
        self.dims: Optional[Tuple[int, int, int, int]] = None
        #: One-pair requests made on this lane (`one`), by (local index, remote index): both
        #: index arrays and the plain request's pieces (`single_fields`), worked out once.
        self.singles: Dict[Tuple[int, int], Tuple[np.ndarray, np.ndarray, Tuple[bytes, bytes]]] = {}

    def bind(self, ld: Tuple[Any, int], rd: Tuple[Any, int]) -> bytes:
        """The prepared ids' fields for the lists' daemon ids `ld`, `rd` (kept for the next request)."""
        ids = ids_field(ld[1], rd[1])
        self.bound = (ld, rd, ids)
        return ids

    def take(self, li: Any, ri: Any, native: bool, ring: bool) -> Optional["Prepared"]:
        """The request on this lane for index arrays `li`, `ri`, or None where the general way
        must make it (which checks and names what is wrong). One index a side (a list, tuple or
        array of one integer): `one`. Both 1-D numpy arrays of one length: as outer sums where
        `native` (the daemon takes them and the C pass is built) and both are of vLLM's form,
        found in one call reading each array once (`_native.outer_fields`: a few KiB sent), else
        through the index ring where `ring` and they `fit`."""
        if type(li) is not np.ndarray or type(ri) is not np.ndarray or li.size != ri.size:
            return self.one(li, ri)
        if li.size == 1:
            one = self.one(li, ri)
            if one is not None:
                return one
        if native and _indices.OUTER_MIN <= li.size <= MAX_PREPARED:
            dims = self.dims
            if dims is None:  # (a list's rows are counted once, on first use)
                dims = self.dims = (self.local.rows, self.local.count, self.remote.rows, self.remote.count)
            fields = _indices.outer_fields(li, ri, *dims)  # type: ignore[misc]
            if fields is not None:
                return Prepared(self, li, ri, None, None, fields)
        return Prepared(self, li, ri) if ring and self.fits(li, ri) else None

    def fits(self, li: Any, ri: Any) -> bool:
        """Whether a request takes the fast path as given: both index arrays 1-D int64 numpy
        arrays of one length, 1 to WINDOW_MAX (the index ring's bound), every index in range (one
        reduction a side: read unsigned, a negative index is above any count). Anything else
        (lists, other dtypes, a bad index, no index) goes the general way, which checks and names it."""
        return (type(li) is np.ndarray and type(ri) is np.ndarray and li.dtype is _I64 and ri.dtype is _I64
                and li.ndim == 1 and ri.ndim == 1 and 0 < li.size == ri.size <= _indices.WINDOW_MAX
                and int(_umax(li.view(_U64))) < self.local.count and int(_umax(ri.view(_U64))) < self.remote.count)


    def one(self, li: Any, ri: Any) -> Optional["Prepared"]:
        """The request of one descriptor a side (`li`, `ri`: a list or tuple of one int, or a 1-D
        integer numpy array of one element), both in range; else None (the general way checks and
        names what is wrong). Made once per pair of indices and kept (a few dozen pairs: a loop
        moving one block at a time reuses them), its `single`: the plain ReadRequest /
        WriteRequest the agent sends in place of the prepared request (`single_fields`)."""
        i, j = _one_index(li), _one_index(ri)
        if i is None or j is None or not (0 <= i < self.local.count and 0 <= j < self.remote.count):
            return None
        got = self.singles.get((i, j))
        if got is None:
            fields = single_fields(self.op, self.local, i, self.remote, j, self.timeout_ms)
            if fields is None:
                return None
            la, ra = np.array([i], dtype=_I64), np.array([j], dtype=_I64)
            la.flags.writeable = ra.flags.writeable = False
            if len(self.singles) >= 64:
                self.singles.clear()
            got = self.singles[i, j] = (la, ra, fields)
        return Prepared(self, got[0], got[1], single=got[2])

    @staticmethod
    def packed(li: np.ndarray, ri: np.ndarray) -> bytes:
        """Both sides (fewer than WINDOW_MIN indices: not worth a ring slot) packed as u32s into
        the request's fields: local_indices 2, remote_indices 4 (the ids' fields come first, in
        another order than `Prepared.body`'s, which protobuf allows)."""
        lb, rb = li.astype(_U32).tobytes(), ri.astype(_U32).tobytes()
        return b"\x12" + V(len(lb)) + lb + b"\x22" + V(len(rb)) + rb


class Prepared:
    """A prepared-path transfer, which is also its plan (it answers what Xfer and the agent read
    of a Plan, the constant parts from its class and its lane): its `lane`, both index arrays (as
    given, checked to be in range) and each side's indices as an encoded OuterIndices when they
    have that form."""

    __slots__ = ("lane", "li", "ri", "_lo", "_ro", "windowed", "fields", "single")

    path = "prepared"
    #: None serialized ahead: the request is built as it is sent, bound to the session's ids.
    bodies: Tuple[Any, ...] = ()
    notif_key = b"\x2a"  # Write/ReadPreparedRequest.notification = 5
    carries_notification = True
    parts = 1

    def __init__(self, lane: Lane, li: np.ndarray, ri: np.ndarray, lo: Optional[bytes] = None, ro: Optional[bytes] = None,
                 fields: Optional[bytes] = None, single: Optional[Tuple[bytes, bytes]] = None) -> None:
        self.lane = lane
        self.li = li
        self.ri = ri
        self._lo = lo
        self._ro = ro
        #: Sides its last request passed through the agent's index ring.
        self.windowed = 0
        #: Both outer sums as the request's fields, when the C pass found both (`Lane.take`):
        #: then `lo` and `ro` are read out of them when asked.
        self.fields = fields
        #: One descriptor a side (`Lane.one`): the plain request's fields before and after a
        #: WRITE's notification (`single_fields`), sent in place of the prepared request where
        #: nothing needs that (the agent's `_post_lane`).
        self.single = single

    @property
    def lo(self) -> Optional[bytes]:
        """The local side's OuterIndices message, when it has that form."""
        if self._lo is None and self.fields is not None:
            self._lo, self._ro = _indices.split_fields(self.fields)
        return self._lo

    @property
    def ro(self) -> Optional[bytes]:
        """The remote side's OuterIndices message, when it has that form."""
        if self._ro is None and self.fields is not None:
            self._lo, self._ro = _indices.split_fields(self.fields)
        return self._ro

    @property
    def prepared(self) -> "Prepared":
        return self

    @property
    def op(self) -> str:
        return self.lane.op

    @property
    def local(self) -> Prepped:
        return self.lane.local

    @property
    def remote(self) -> Prepped:
        return self.lane.remote

    @property
    def field(self) -> str:
        return self.lane.field

    @property
    def total_bytes(self) -> int:
        # every descriptor's length is usig >> 6 (`Prepped._granules`)
        return len(self.li) * (self.lane.local.usig >> 6)  # type: ignore[operator]

    @property
    def desc_count(self) -> int:
        return len(self.li)

    entries = desc_count

    @property
    def requests(self) -> List[Any]:
        return []

    def body(self, lid: int, rid: int, notification: bytes, scratch: "Scratch") -> List[Any]:
        """Write/ReadPreparedRequest (same numbers): local_prepared_id 1, local_indices 2,
        remote_prepared_id 3, remote_indices 4, notification 5, timeout_ms 6, local_outer 8,
        remote_outer 9; as pieces whose concatenation it is, a side's index array (when it has no
        outer form) packed as u32s into `scratch` (hold its lock until they are sent)."""
        self.windowed = 0
        lb: Any = b"" if self.lo is not None else scratch.pack(0, self.li)
        rb: Any = b"" if self.ro is not None else scratch.pack(1, self.ri)
        head = b"\x08" + V(lid) + (b"\x12" + V(len(lb)) if self.lo is None else b"")
        mid = b"\x18" + V(rid) + (b"\x22" + V(len(rb)) if self.ro is None else b"")
        return [head, lb, mid, rb, self._tail(notification)]

    def window_body(self, ids: bytes, notification: bytes, ring: "Windows", slot: int) -> List[Any]:
        """The request with each side not sent as an outer sum packed into `slot` of the agent's
        index ring and named by an IndexWindow (local_window 10, remote_window 11): a few dozen
        bytes a side instead of 4 an index. `ids`: both prepared ids' fields (`ids_field`)."""
        lo, ro = self.lo, self.ro
        if lo is None and ro is None:  # the common case: both sides in the ring
            self.windowed = 2
            tail = ring.pack_both(slot, self.li, self.ri)
        else:
            self.windowed = (lo is None) + (ro is None)
            tail = (ring.pack(slot, 0, self.li) if lo is None else b"") + (ring.pack(slot, 1, self.ri) if ro is None else b"")
        return [ids + self._tail(notification) + tail]

    def _outer(self) -> bytes:
        """Each side's outer sum where it has one (local_outer 8, remote_outer 9): `fields` when
        both are."""
        if self.fields is not None:
            return self.fields
        lo, ro = self._lo, self._ro
        return (b"" if lo is None else b"\x42" + V(len(lo)) + lo) + (b"" if ro is None else b"\x4a" + V(len(ro)) + ro)

    def _tail(self, notification: bytes) -> bytes:
        """The fields both request forms end with: notification 5, timeout_ms 6, and each side's
        outer sum where it has one (local_outer 8, remote_outer 9)."""
        return (b"\x2a" + V(len(notification)) + notification if notification else b"") + self.lane.tmo + self._outer()

    def unprepared(self, op: str) -> "Plan":
        """The block or batch path for this transfer (the daemon refused a list)."""
        lane = self.lane
        li, ri = self.li.astype(np.int64, copy=False), self.ri.astype(np.int64, copy=False)
        return unprepared_plan(op, lane.local, li, lane.remote, ri, lane.merge, lane.timeout_ms)


def _one_index(idx: Any) -> Optional[int]:
    """The one index of a list or tuple of one int, or of a 1-D integer numpy array of one
    element; else None."""
    t = type(idx)
    if t is list or t is tuple:
        if len(idx) == 1 and type(idx[0]) is int:
            return int(idx[0])
        return None
    if t is np.ndarray and idx.ndim == 1 and idx.size == 1 and idx.dtype.kind in "iu":
        return int(idx[0])
    return None


def single_fields(op: str, local: Prepped, i: int, remote: Prepped, j: int, timeout_ms: int) -> Optional[Tuple[bytes, bytes]]:
    """A transfer of local descriptor `i` with remote descriptor `j` as the plain ReadRequest or
    WriteRequest (the daemon's path for one range: `tcpxd.Client.read` / `write`'s, cheaper than
    the prepared path's, which expands indices and plans blocks for one pair), split where a
    WRITE's notification goes: (its entry, its timeout) — the whole request is `entry + timeout`,
    or for a WRITE with a notification `entry + b"\x12" + len + frame + timeout`
    (WriteRequest.notification = 2). A ReadRequest carries no notification: a READ with one
    takes the prepared request. None when the two descriptors' lengths differ (the general
    way names it) or pass SINGLE_MAX (a bulk range keeps the block and prepared paths)."""
    n = int(local.length[i])
    if n != int(remote.length[j]) or not 0 < n <= SINGLE_MAX:
        return None
    lb = int(local.buffer_ids[int(local.region[i])])
    lo, ro = int(local.offset[i]), int(remote.offset[j])
    rdesc = remote.desc_rows[op][int(remote.region[j])]  # the remote descriptor as its entry field
    u = _u
    if op == "WRITE":  # WriteEntry: local_buffer_id 1, local_offset 2, remote_descriptor 3, remote_offset 4, length 5
        entry = u(b"\x08", lb) + u(b"\x10", lo) + rdesc + u(b"\x20", ro) + u(b"\x28", n)
        tmo = _timeout(b"\x18", timeout_ms)  # WriteRequest.timeout_ms = 3
    else:  # ReadEntry: remote_descriptor 1, remote_offset 2, local_buffer_id 3, local_offset 4, length 5
        entry = rdesc + u(b"\x10", ro) + u(b"\x18", lb) + u(b"\x20", lo) + u(b"\x28", n)
        tmo = _timeout(b"\x10", timeout_ms)  # ReadRequest.timeout_ms = 2
    return b"\x0a" + V(len(entry)) + entry, tmo  # entry = 1 in both


def _u(key: bytes, v: int) -> bytes:
    """A varint field, nothing for 0 (as proto3 writes it)."""
    return key + V(v) if v else b""


def note_field(note_head: bytes, notif: bytes) -> bytes:
    """A prepared request's notification field (5): the frame `note_head` + `notif` for the
    remote agent (`_notify.frame`), or nothing when there is no message."""
    if not notif:
        return b""
    framed = note_head + notif
    return b"\x2a" + V(len(framed)) + framed


def ids_field(lid: int, rid: int) -> bytes:
    """A prepared request's first fields: local_prepared_id 1, remote_prepared_id 3."""
    return b"\x08" + V(lid) + b"\x18" + V(rid)


#: A request message by SessionRequest field, and a notification's key by path.
_MESSAGE = {"write_batch": "WriteBatchRequest", "read_batch": "ReadBatchRequest",
            "write_blocks": "WriteBlocksRequest", "read_blocks": "ReadBlocksRequest",
            "write_prepared": "WritePreparedRequest", "read_prepared": "ReadPreparedRequest",
            "write": "WriteRequest", "read": "ReadRequest"}
# WriteBatchRequest.notification = 2, WriteBlocksRequest's = 5, Write/ReadPreparedRequest's = 5,
# WriteRequest's = 2 (a ReadRequest has none: a READ's notification follows it)
_NOTIF_KEY = {"batch": b"\x12", "blocks": b"\x2a", "prepared": b"\x2a", "plain": b"\x12"}
def _timeout(key: bytes, ms: int) -> bytes:
    return key + V(ms) if ms else b""


def plan(op: str, local: Prepped, li: np.ndarray, remote: Prepped, ri: np.ndarray, merge: bool, timeout_ms: int,
         lo: Optional[bytes] = None, ro: Optional[bytes] = None) -> Union[Plan, Prepared]:
    """`lo`, `ro`: a side's indices as an encoded OuterIndices, when they have that form."""
    if len(li) != len(ri):
        raise nixlMismatchError(f"local_indices: {len(li)} indices against remote_indices' {len(ri)}")
    if len(li) == 0:
        raise nixlInvalidParamError("local_indices: no descriptors to transfer")
    p = prepared_plan(op, local, li, remote, ri, merge, timeout_ms, lo, ro)
    if p is not None:
        return p
    li, ri = li.astype(np.int64, copy=False), ri.astype(np.int64, copy=False)
    return unprepared_plan(op, local, li, remote, ri, merge, timeout_ms)


def unprepared_plan(op: str, local: Prepped, li: np.ndarray, remote: Prepped, ri: np.ndarray, merge: bool, timeout_ms: int) -> Plan:
    """The block path, else the batch path. A side on the 4 KiB lists whose other side only the
    fine lists align (a remote buffer laid out with another offset) takes the block path on both
    sides' fine lists."""
    if local.aligned or remote.aligned:  # else no pair can take the block path
        p = block_plan(op, local, li, remote, ri, timeout_ms)
        if p is not None:
            return p
    if local.fine != remote.fine and (local.fine or remote.fine):
        lt, rt = local.fine_twin, remote.fine_twin
        if lt is not None and rt is not None:
            p = block_plan(op, lt, li, rt, ri, timeout_ms)
            if p is not None:
                return p
    return batch_plan(op, local, li, remote, ri, merge, timeout_ms)


def prepared_plan(op: str, local: Prepped, li: np.ndarray, remote: Prepped, ri: np.ndarray, merge: bool,
                  timeout_ms: int, lo: Optional[bytes] = None, ro: Optional[bytes] = None) -> Optional[Prepared]:
    """The prepared path (module doc), or None when the lists cannot take it: both held by the
    daemon, with one signature (every pair the same granules), a destination list whose descriptors
    share no byte, at most MAX_PREPARED indices. A destination descriptor named twice is refused
    by the daemon (the transfer ends in "ERR" naming it)."""
    if not (local.held and remote.held and local.usig == remote.usig and local._holdable and remote._holdable
            and not local.refused and not remote.refused):
        return None
    n = len(li)
    if (local if op == "READ" else remote).overlaps or n > MAX_PREPARED:
        return None
    pr = Prepared(Lane(op, local, remote, merge, timeout_ms), li, ri, lo, ro)
    if lo is not None and ro is not None:  # as `Lane.take` makes them: both sides as the request's fields
        pr.fields = pr._outer()
    return pr


def block_plan(op: str, local: Prepped, li: np.ndarray, remote: Prepped, ri: np.ndarray, timeout_ms: int) -> Optional[Plan]:
    """The block path (module doc), or None when some pair cannot take it."""
    if local.usig is not None and remote.usig is not None:
        if local.usig != remote.usig:
            return None  # unaligned on a side, of unequal G, or of unequal lengths
        c: Any = int(local.gcnt[0])  # one granule count for every pair
    elif not np.array_equal(local.sig[li], remote.sig[ri]):
        return None  # a pair unaligned on a side, of unequal G, or of unequal lengths
    else:
        c = local.gcnt[li]
    dest, di = (local, li) if op == "READ" else (remote, ri)
    if dest.overlaps or not dest.distinct(di):
        return None  # a destination granule named twice: the daemon refuses it; batches allow it
    lp, rp = local.gpos[li], remote.gpos[ri]
    n = len(li)
    key = (lp >> _LIST_SHIFT) * remote.nbuffers + (rp >> _LIST_SHIFT)
    total = c * n if isinstance(c, int) else int(c.sum())
    if n > 1 and total > MAX_BLOCKS // 2:
        if isinstance(c, int):
            c = np.full(n, c, dtype=np.int64)  # cut groups every MAX_BLOCKS / 2 granules (pairs are at most that)
        order = np.argsort(key, kind="stable")
        lp, rp, c, key = lp[order], rp[order], c[order], key[order]
        cum = np.cumsum(c)
        gstart = np.concatenate(([0], np.flatnonzero(key[1:] != key[:-1]) + 1))
        base = np.repeat(cum[gstart] - c[gstart], np.diff(np.concatenate((gstart, [n]))))
        key = key * (MAX_BLOCKS * 4) + (cum - base - 1) // (MAX_BLOCKS // 2)
    elif n > 1 and bool((key[1:] < key[:-1]).any()):
        order = np.argsort(key, kind="stable")
        lp, rp, key = lp[order], rp[order], key[order]
        if not isinstance(c, int):
            c = c[order]
    if n > 1:
        newgrp = key[1:] != key[:-1]
        gstart = np.concatenate(([0], np.flatnonzero(newgrp) + 1))
    else:
        newgrp = np.zeros(0, dtype=bool)
        gstart = np.zeros(1, dtype=np.int64)
    lr, lat = _ranges(lp, c, newgrp, gstart)
    rr, rat = _ranges(rp, c, newgrp, gstart)
    read = op == "READ"
    tmo = _timeout(b"\x28" if read else b"\x30", timeout_ms)  # ReadBlocksRequest.timeout_ms = 5, WriteBlocksRequest's = 6
    # Per group, in plain Python over lists (no numpy call per group): its lists' fields (encoded
    # once per prepared list) and its slices of both sides' packed ranges.
    lf, rf = local.list_fields(read), remote.list_fields(read)
    lk = (lp[gstart] >> _LIST_SHIFT).tolist()
    rk = (rp[gstart] >> _LIST_SHIFT).tolist()
    lb, rb = lr.tobytes(), rr.tobytes()
    la, ra = (lat * 8).tolist(), (rat * 8).tolist()
    bodies = []
    for g in range(len(lk)):
        ld = lb[la[g]:la[g + 1]]
        rd = rb[ra[g]:ra[g + 1]]
        # BlockIndices{encoding: RANGES (1), data (2)} as a field: key, length, 08 01 12 len data
        lidx = b"\x08\x01\x12" + V(len(ld)) + ld
        ridx = b"\x08\x01\x12" + V(len(rd)) + rd
        if read:  # remote_token 1, remote_indices 2, local_list_id 3, local_indices 4
            bodies.append(b"".join((rf[rk[g]], b"\x12", V(len(ridx)), ridx, lf[lk[g]], b"\x22", V(len(lidx)), lidx, tmo)))
        else:  # local_list_id 1, local_indices 2, remote_token 3, remote_indices 4
            bodies.append(b"".join((lf[lk[g]], b"\x12", V(len(lidx)), lidx, rf[rk[g]], b"\x22", V(len(ridx)), ridx, tmo)))
    nbytes = int(local.length[li].sum())
    return Plan(op, bodies, nbytes, n, len(lr) + len(rr), "blocks")


def _ranges(pos: np.ndarray, c: Any, newgrp: np.ndarray, gstart: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """One side's granule ranges: (start, count) u32 pairs, consecutive ones merged within a
    group; and where each group's ranges begin (len(gstart) + 1 bounds). `c`: the pairs'
    granule counts (an array, or one int for all)."""
    n = len(pos)
    one = isinstance(c, int)
    if n > 1:
        brk = np.empty(n, dtype=bool)
        brk[0] = True
        np.not_equal(pos[1:], pos[:-1] + (c if one else c[:-1]), out=brk[1:])
        brk[1:] |= newgrp
        st = np.flatnonzero(brk)
    else:
        st = np.zeros(1, dtype=np.int64)
    out = np.empty((len(st), 2), dtype="<u4")
    if len(st) == n:  # nothing merged
        out[:, 0] = pos & _LOW
        out[:, 1] = c
    else:
        out[:, 0] = pos[st] & _LOW
        out[:, 1] = np.diff(np.append(st, n)) * c if one else np.add.reduceat(c, st)
    at = np.empty(len(gstart) + 1, dtype=np.int64)
    at[:-1] = np.searchsorted(st, gstart)
    at[-1] = len(st)
    return out, at


def batch_plan(op: str, local: Prepped, li: np.ndarray, remote: Prepped, ri: np.ndarray, merge: bool, timeout_ms: int) -> Plan:
    """The batch path (module doc): entries grouped by buffer pair, MAX_ENTRIES a request."""
    n = local.length[li]
    rn = remote.length[ri]
    if not np.array_equal(n, rn):
        k = int(np.flatnonzero(n != rn)[0])
        raise nixlMismatchError(
            f"local_indices[{k}]: local descriptor {int(li[k])} has {int(n[k])} bytes, "
            f"remote descriptor {int(ri[k])} has {int(rn[k])}"
        )
    lr, lo = local.region[li], local.offset[li]
    rr, ro = remote.region[ri], remote.offset[ri]
    if merge and len(n) > 1:
        cont = np.zeros(len(n), dtype=bool)
        cont[1:] = (lr[1:] == lr[:-1]) & (rr[1:] == rr[:-1]) & (lo[1:] == lo[:-1] + n[:-1]) & (ro[1:] == ro[:-1] + n[:-1])
        starts = np.flatnonzero(~cont)
        lr, lo, rr, ro, ln = lr[starts], lo[starts], rr[starts], ro[starts], np.add.reduceat(n, starts)
    else:
        ln = n
    # Grouped by buffer pair (stable), so each request names one pair and the daemon coalesces it.
    key = local.buffer_of[lr] * remote.nbuffers + remote.buffer_of[rr]
    cuts: List[Any]  # the numpy integers where the buffer pair changes
    if len(key) > 1 and bool((key[1:] != key[:-1]).any()):
        order = np.argsort(key, kind="stable")
        lr, lo, rr, ro, ln, key = lr[order], lo[order], rr[order], ro[order], ln[order], key[order]
        cuts = list(np.flatnonzero(key[1:] != key[:-1]) + 1)
    else:
        cuts = []
    tmo = _timeout(b"\x18" if op == "WRITE" else b"\x10", timeout_ms)  # WriteBatchRequest.timeout_ms = 3, ReadBatchRequest's = 2
    rows = remote.desc_rows[op]
    bodies = []
    for a, b in zip([0] + cuts, cuts + [len(ln)]):
        s = slice(int(a), int(b))
        if op == "WRITE":  # WriteEntry: local_buffer_id, local_offset, remote_descriptor (3), remote_offset, length
            pieces = [_wire.varint_piece(1, local.buffer_ids[lr[s]]), _wire.varint_piece(2, lo[s]), _wire.table_piece(rr[s], rows),
                      _wire.varint_piece(4, ro[s]), _wire.varint_piece(5, ln[s])]
        else:  # ReadEntry: remote_descriptor (1), remote_offset, local_buffer_id, local_offset, length
            pieces = [_wire.table_piece(rr[s], rows), _wire.varint_piece(2, ro[s]), _wire.varint_piece(3, local.buffer_ids[lr[s]]),
                      _wire.varint_piece(4, lo[s]), _wire.varint_piece(5, ln[s])]
        for body in _wire.entries(1, pieces, MAX_ENTRIES):  # `entries` is field 1 of both requests
            bodies.append(body + tmo)
    return Plan(op, bodies, int(n.sum()), len(n), len(ln), "batch")


def descs_plan(op: str, local: Prepped, remote: Prepped, timeout_ms: int) -> Plan:
    """initialize_xfer: every local descriptor with the remote one at the same position."""
    if len(local) != len(remote):
        raise nixlMismatchError(f"local_descs: {len(local)} descriptors against remote_descs' {len(remote)}")
    if len(local) == 0:
        raise nixlInvalidParamError("local_descs: no descriptors to transfer")
    if len(local) == 1:  # one range: the plain request (`single_fields`), as a lane's one pair
        one = single_fields(op, local, 0, remote, 0, timeout_ms)
        if one is not None:
            return Plan(op, [one[0] + one[1]], int(local.length[0]), 1, 1, "plain")
    idx = np.arange(len(local), dtype=np.int64)
    # Lists made for one transfer are not prepared in the daemon (a round trip to save none).
    return unprepared_plan(op, local, idx, remote, idx, True, timeout_ms)


def field(op: str, path: str = "batch") -> str:
    """The SessionRequest field of a plan's requests."""
    return _FIELD[(op, path)]


_FIELD = {(op, path): f"{op.lower()}_{path}" for op in ("WRITE", "READ") for path in ("batch", "blocks", "prepared")}
_FIELD.update({("WRITE", "plain"): "write", ("READ", "plain"): "read"})
