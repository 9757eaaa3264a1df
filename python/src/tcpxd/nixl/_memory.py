"""An agent's registered memory: NIXL regions (raw address, length, device) as daemon buffers.

DRAM: the region's own pages, shared with the daemon by file descriptor (Client.register_host with
the memory: a torch CPU tensor after share_memory_(), memory the package maps, a numpy array over a
memfd or /dev/shm file); anonymous memory is refused with the daemon's explanation of what to
allocate instead. VRAM: the cudaMalloc allocation holding the address, imported once by its IPC
handle (regions in one allocation, such as a layer's K and V, share that import).

Each daemon buffer gets granule lists with it (`granule_list`): strided block lists tiling the
buffer in granules of 4 KiB and of 512 bytes (the fine one, for blocks not a multiple of 4 KiB),
released by the daemon with its buffer. A daemon that refuses them (an older one, or its list limit
reached) leaves the buffer without: its regions' transfers take the batch path.
"""

from __future__ import annotations

import array
import collections
import ctypes
import logging
import mmap
import os
import threading
import weakref
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from .. import Client, _proto
from .._addresses import BY_ADDRESS, FILE_SHARED, AddressBatch, address_ranges, address_tail, range_refusal
from .._hostmem import Pending
from .._native_gate import native as _native
from ..errors import TcpxdError
from . import _cuda
from ._descs import MOVABLE, RegDList
from ._errors import from_tcpxd, nixlInvalidParamError, nixlNotFoundError, nixlNotSupportedError
from ._regions import Region, RegionTable, region as make_region

Key = Tuple[str, int, int, int]

#: A call's addresses where it has no memory by address, its keys where it has none of a kind
#: (never changed: shared).
_NO_ADDRESSES = array.array("Q")
_NO_KEYS: List[Key] = []
_NO_SIZES: Dict[int, "Tail"] = {}
#: Per region size, what a registration by address sends but for the address (its request's
#: serialized tail), the granule lists it asks, and the tail alone in a tuple (a lone region's
#: `Registrar.hold_addresses`).
Tail = Tuple[bytes, List[Any], Tuple[bytes]]

log = logging.getLogger("tcpxd.nixl")

#: tcpxd._native.Lone where the extension has it (`LocalMemory._lone`).
_Lone = getattr(_native, "Lone", None)


def _no(dl: Any) -> bool:
    """`LocalMemory.hold_one` and `withdraw_one` without the extension: never (the general path)."""
    return False

#: A granule list's granule: 4 KiB, doubled while the buffer would hold more granules than a list
#: may (the engine's MAX_LIST_BLOCKS).
GRANULE = 4096
MAX_LIST_BLOCKS = 1 << 24
#: The fine granule list's: 512 bytes, doubled likewise (none once it reaches the coarse one). It
#: serves lists whose blocks are not a multiple of 4 KiB (MLA's 18,432 bytes at vLLM's block size
#: 16, small heads, fp8 caches); the coarse list serves the rest, as the daemon's destination
#: bitmaps are a bit per granule.
FINE_GRANULE = 512


def granule_for(size: int, base: int = GRANULE) -> int:
    """The granule of a `size`-byte buffer's list: `base`, or the smallest power of two above it
    with at most MAX_LIST_BLOCKS granules in the buffer; 0 when the buffer is smaller than that."""
    g = base
    while size // g > MAX_LIST_BLOCKS:
        g *= 2
    return g if size >= g else 0


@dataclass(frozen=True)
class Granules:
    """A buffer's granule list, as its regions carry it, and its fine one (`fine`)."""

    granule: int = 0
    token: str = ""
    count: int = 0
    list_id: int = 0
    fine: Optional["Granules"] = None

    def region(self, addr: int, size: int, dev: int, mem: str, buffer: Any, offset: int) -> Region:
        """The region at `offset` in `buffer`, with these lists."""
        f = self.fine or Granules()
        return Region(addr, size, dev, mem, buffer.descriptor, offset, buffer.id, self.granule, self.token, self.count,
                      self.list_id, f.granule, f.token, f.count, f.list_id)


def granule_tilings(size: int) -> List[Any]:
    """The granule lists of a `size`-byte buffer as the daemon makes them with its registration
    (StridedBlocks): the coarse one and, where finer, the fine one; none below a granule."""
    g = granule_for(size)
    if not g:
        return []
    S = _proto.message("StridedBlocks")
    out = [S(first=0, stride=g, length=g, count=size // g)]
    fg = granule_for(size, FINE_GRANULE)
    if fg and fg < g:
        out.append(S(first=0, stride=fg, length=fg, count=size // fg))
    return out


def granules_made(buffer: Any, lists: List[Any], statuses: List[Any], asked: List[Any]) -> Granules:
    """The Granules of the lists the daemon made with a buffer's registration (a refused one logged:
    the coarse one refused, the buffer's transfers take the batch path)."""
    made: List[Granules] = []
    for bl, st, strided in zip(lists, statuses, asked):
        if st.code != 0 or not bl.id:
            log.warning("buffer %d: no %d-byte granule list (%s); its transfers take the batch path",
                        buffer.id, strided.stride, st.message)
            break
        made.append(Granules(int(strided.stride), str(bl.token), int(bl.count), int(bl.id)))
    if not made:
        return Granules()
    return dataclasses.replace(made[0], fine=made[1]) if len(made) > 1 else made[0]


def granules_answered(buffer_id: int, lists: Tuple[Tuple[int, int, str, Optional[TcpxdError]], ...],
                      asked: List[Any]) -> Granules:
    """`granules_made` of a registration by address's answer (tcpxd._registrar.Answer's lists)."""
    made: List[Granules] = []
    for (list_id, count, token, err), strided in zip(lists, asked):
        if err is not None or not list_id:
            log.warning("buffer %d: no %d-byte granule list (%s); its transfers take the batch path",
                        buffer_id, strided.stride, err)
            break
        made.append(Granules(int(strided.stride), token, int(count), int(list_id)))
    if not made:
        return Granules()
    return dataclasses.replace(made[0], fine=made[1]) if len(made) > 1 else made[0]


@dataclass(frozen=True)
class _Named:
    """A buffer as `Granules.region` and `granule_list` read it: its id and descriptor."""

    id: int
    descriptor: str


def granule_list(client: Client, buffer: Any, size: int) -> Granules:
    """Registers the granule lists of a daemon buffer of `size` bytes (strided: four numbers,
    however many granules): the coarse one and, where finer, the fine one; none (Granules())
    when the daemon refuses them."""
    g = granule_for(size)
    if not g:
        return Granules()
    coarse = _register(client, buffer, size, g)
    fg = granule_for(size, FINE_GRANULE)
    if coarse.granule and fg and fg < g:
        return dataclasses.replace(coarse, fine=_register(client, buffer, size, fg))
    return coarse


def _register(client: Client, buffer: Any, size: int, g: int) -> Granules:
    req = _proto.message("RegisterBlocksRequest")(
        buffer_id=int(buffer.id),
        strided=_proto.message("StridedBlocks")(first=0, stride=g, length=g, count=size // g),
    )
    try:
        msg = client._unary("RegisterBlocks", req)
    except TcpxdError as e:
        log.warning("buffer %d: no %d-byte granule list (%s); its transfers take the batch path", buffer.id, g, e)
        return Granules()
    # Registered again, same id and token, should the daemon restart (tcpxd._reattach).
    client._reattach.track_list_id(int(msg.id), req)
    return Granules(g, str(msg.token), int(msg.count), int(msg.id))


def _in_dram() -> None:
    """The release of a region registered by address (`_drop` releases those by id, together)."""


class _SharedMap(mmap.mmap):
    """A shared mapping of a memfd that keeps the descriptor open while it lives (the daemon is
    handed the memory by that descriptor)."""


def host_array(nbytes: int) -> Any:
    """`nbytes` of host memory an agent can register as DRAM: a numpy uint8 array over a memfd
    mapped shared (the daemon maps the same pages, no copy). Slice or `.view()` it into the
    regions you register; it lives as long as the array (or a view of it) does."""
    import numpy as np

    if not isinstance(nbytes, int) or nbytes <= 0:
        raise nixlInvalidParamError(f"nbytes: {nbytes!r} is not a positive number of bytes")
    fd = os.memfd_create("tcpxd-nixl", os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 2))
    try:
        os.ftruncate(fd, nbytes)
        mm = _SharedMap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(mm, os.close, fd)
    return np.frombuffer(mm, dtype=np.uint8)


class _Sent(Pending):
    """One `register_memory` call's DRAM regions held back (since session 22): memory by
    address, sent with the registration connection's next message (it is the `Pending` the
    registrar holds: `Registrar.hold`, `pending` itself), and memory a file backs (`files`),
    looked up and handed over by descriptor at the first use; folded into the agent's regions,
    all or none, at the next call that needs them (`LocalMemory._settle`); withdrawn unsent when
    deregistered before any use (`LocalMemory._withdraw`). One slotted object: a lone region's
    registration makes one (and its key list)."""

    __slots__ = ("keys", "todo", "by_address", "sizes", "pending", "files", "rows", "list_id")

    def __init__(self, keys: List[Key], todo: Dict[Key, Tuple[int, Any]], by_address: List[Key], addrs: Any,
                 tails: Sequence[bytes], sizes: Dict[int, Tail], files: List[Key]):
        #: Pending's: the regions by address's addresses (u64s) and serialized tails, held
        #: (`held`) until the registrar sends them.
        self.addrs = addrs
        self.tails = tails
        self.got: List[Any] = [None] * len(tails)
        self.frames = 0
        self.lost = None
        self.held = False
        self.keys = keys
        #: Per region: its index in the call's reg_list, and the tensor or array given (kept alive).
        self.todo = todo
        #: By address: the regions, per region size its request's serialized tail and the
        #: granule lists it asks (`sizes`), and what holds them: itself once the registrar took
        #: it (`Registrar.hold`), else None (nothing by address, or not held: no registrar,
        #: or a closed one: registered when folded).
        self.by_address = by_address
        self.sizes = sizes
        self.pending: Optional[Pending] = None
        #: By descriptor: the regions.
        self.files = files
        #: The registration list's rows as bytes, where the call took every one of them (a
        #: deregistration of the same list withdraws it without a look at each region:
        #: `LocalMemory._withdraw_list`), and the list's id(), which `LocalMemory._by_list`
        #: finds it by.
        self.rows = b""
        self.list_id = 0

    @property
    def withdrawable(self) -> bool:
        """Nothing of it sent yet."""
        return self.pending is None or self.pending.held


@dataclass
class _Import:
    """A daemon buffer importing one cudaMalloc allocation, and how many regions use it."""

    buffer: Any
    base: int
    size: int
    users: int = 0
    granules: Granules = Granules()


class LocalMemory:
    """The agent's regions. Thread-safe."""

    def __init__(self, client: Client):
        self._client = client
        self._registrar = client._registrar
        self._lock = threading.Lock()
        self._regions: Dict[Key, Tuple[Region, Callable[[], None]]] = {}
        self._imports: Dict[Tuple[int, int], _Import] = {}
        #: The DRAM regions' buffers (released together by _drop): a Buffer, or the id of one
        #: registered by address (`_by_address`).
        self._dram: Dict[Key, Any] = {}
        #: The tensors and arrays given for regions registered by address (kept alive meanwhile).
        self._kept: Dict[Key, Any] = {}
        #: What a restarted daemon is handed again of the regions registered by address: their
        #: batches (held here; the client's re-attacher holds them weakly), by buffer id.
        self._batch_of: Dict[int, AddressBatch] = {}
        self._table: Optional[RegionTable] = None
        #: Registrations sent and not answered yet (`_Sent`), in the order sent, and their keys.
        self._sent: List[_Sent] = []
        self._sent_keys: Dict[Key, _Sent] = {}
        #: Held while the answers of `_sent[0]` are read and folded in (one thread at a time).
        self._settling = threading.Lock()
        #: Held calls (`_Sent`) that took a whole registration list, by the list's id().
        self._by_list: Dict[int, _Sent] = {}
        #: Per region size: the serialized tail of its request by address and the granule
        #: lists it asks for (`_by_address`), made once.
        self._tails: Dict[int, Tail] = {}
        #: A lone DRAM region's registration and its withdrawal in one C call each (since
        #: session 23: `tcpxd._native.Lone`, the steps of the general path for one region; None
        #: without the extension or a registrar: the general path).
        self._lone: Any = None
        #: `register` of a lone DRAM region held in one call, and `deregister` of one withdrawn so
        #: (`Lone.hold`, `Lone.withdraw`; the agent calls them first): False where it is not that.
        self.hold_one: Callable[[RegDList], bool] = _no
        self.withdraw_one: Callable[[RegDList], bool] = _no
        if _Lone is not None and self._registrar is not None:
            self._lone = _Lone(_Sent, self._lock, self._settling, self._sent, self._sent_keys, self._regions,
                               self._tails, self._tail, self._registrar, _NO_KEYS, _NO_ADDRESSES, _NO_SIZES)
            self.hold_one, self.withdraw_one = self._lone.hold, self._lone.withdraw

    def regions(self) -> List[Region]:
        self._settle()
        with self._lock:
            return [r for r, _ in self._regions.values()]

    def table(self) -> RegionTable:
        if self._sent:
            self._settle()
        with self._lock:
            if self._table is None:
                self._table = RegionTable([r for r, _ in self._regions.values()])
            return self._table

    def register(self, dl: RegDList, lone_tried: bool = False) -> None:
        """Registers every region of the list (all or none); `lone_tried`: `hold_one` said no
        already (not asked again: its check is a system call)."""
        mem = dl.mem
        if mem == "DRAM":
            if lone_tried or not self.hold_one(dl):  # (one region, checked and held in one C call)
                self._register_dram(dl)
            return
        if mem not in MOVABLE:
            raise nixlNotSupportedError(f"reg_list: tcpxd moves DRAM and VRAM memory, not {dl.mem}")
        done: List[Key] = []
        rows = dl.rows.tolist()
        with self._lock:
            have = self._regions
            new = [(i, (mem, a, n, d)) for i, (a, n, d) in enumerate(rows) if (mem, a, n, d) not in have]
        try:
            for i, key in new:  # (registered already: NIXL accepts it again)
                if key[2] == 0:
                    raise nixlInvalidParamError(f"reg_list[{i}]: a region of 0 bytes")
                with self._lock:
                    if key in self._regions:
                        continue  # (twice in the list)
                what = f"reg_list[{i}] ({mem} at {key[1]:#x}, {key[2]} bytes)"
                self._add(key, *self._vram(key[1], key[2], key[3], what))
                done.append(key)
        except BaseException:
            self._drop(done)
            raise

    def _register_dram(self, dl: RegDList) -> None:
        """`register` of DRAM regions: those not registered (or held) already, together
        (`_dram_many`: checked now, held back, all or none)."""
        rows = dl.rows.tolist()
        objs = dl.objs
        todo: Dict[Key, Tuple[int, Any]] = {}
        with self._lock:
            have, sent = self._regions, self._sent_keys
            for i, (a, n, d) in enumerate(rows):
                key = ("DRAM", a, n, d)
                if key not in have and key not in sent and key not in todo:  # (NIXL accepts one again)
                    if not n:
                        raise nixlInvalidParamError(f"reg_list[{i}]: a region of 0 bytes")
                    todo[key] = (i, objs[i])
        if todo:
            self._dram_many(todo, dl if len(todo) == len(rows) else None)

    def _add(self, key: Key, region: Region, release: Callable[[], None]) -> None:
        with self._lock:
            self._regions[key] = (region, release)
            self._table = None

    def deregister(self, dl: RegDList) -> None:
        """Deregisters every region of the list: those of a `register_memory` call held back
        whole and not sent yet are withdrawn (the daemon never hears of them); the rest released
        once the answers before them are folded in."""
        if self._by_list and self._withdraw_list(dl):
            return
        if self.withdraw_one(dl):  # (one region held alone: one C call)
            return
        mem = dl.mem
        rows = dl.rows.tolist()
        if len(rows) == 1:
            a, n, d = rows[0]
            keys = [(mem, a, n, d)]
            if self._withdraw_one(keys[0]):
                return
        else:
            keys = [(mem, a, n, d) for a, n, d in rows]
        held = False
        with self._lock:
            regions, sent = self._regions, self._sent_keys
            for i, k in enumerate(keys):
                if k not in regions:
                    if k not in sent:
                        raise nixlNotFoundError(f"dereg_list[{i}]: {dl.mem} ({k[1]:#x}, {k[2]} bytes) is not registered")
                    held = True
        if not held:  # (all answered: released)
            self._drop(keys)
            return
        gone = self._withdraw(set(keys))
        rest = [k for k in keys if k not in gone]
        if not rest:
            return
        with self._lock:
            unanswered = {k for k in rest if k in self._sent_keys}
        if unanswered:
            self._settle(unanswered)
        with self._lock:
            for i, k in enumerate(rest):
                if k not in self._regions:
                    raise nixlNotFoundError(f"dereg_list[{i}]: {dl.mem} ({k[1]:#x}, {k[2]} bytes) is not registered")
        self._drop(rest)

    def _withdraw_one(self, key: Key) -> bool:
        """`_withdraw` of one region held alone (the usual lone deregistration) in fewer steps:
        False where it is not that."""
        sent = self._sent_keys.get(key)
        registrar = self._registrar
        if sent is None or registrar is None or len(sent.keys) != 1:  # (found by `key`: its one)
            return False
        with self._settling:
            if self._sent_keys.get(key) is not sent:
                return False  # (folded meanwhile)
            if sent.pending is not None and not registrar.withdraw(sent.pending):
                return False
            with self._lock:
                self._sent.remove(sent)
                del self._sent_keys[key]
                if sent.list_id:
                    self._unlist(sent)
        return True

    def _withdraw_list(self, dl: RegDList) -> bool:
        """`_withdraw` of the call that took every region of `dl` (the list `register_memory`
        returned, unchanged), without a look at each region: False where it is not that."""
        sent = self._by_list.get(id(dl))
        registrar = self._client._registrar
        if sent is None or registrar is None or dl.mem != "DRAM" or not sent.withdrawable:
            return False
        if sent.rows != dl.rows.tobytes():
            return False  # (another list at the same id, or this one changed since)
        with self._settling:
            if self._by_list.get(id(dl)) is not sent:
                return False  # (folded meanwhile)
            if sent.pending is not None and not registrar.withdraw(sent.pending):
                return False
            with self._lock:
                self._sent.remove(sent)
                collections.deque(map(self._sent_keys.__delitem__, sent.keys), 0)  # (one C loop)
                self._unlist(sent)
        return True

    def _unlist(self, sent: _Sent) -> None:
        """Forgets the list `sent` took whole (the lock held)."""
        if sent.list_id and self._by_list.get(sent.list_id) is sent:
            del self._by_list[sent.list_id]

    def _withdraw(self, keys: Optional[Set[Key]]) -> Set[Key]:
        """Takes back the held registrations (not sent yet) of every `register_memory` call all of
        whose regions are in `keys` (None: all): the keys withdrawn."""
        gone: Set[Key] = set()
        registrar = self._client._registrar
        if registrar is None or not self._sent:
            return gone
        with self._settling:
            with self._lock:
                if keys is None:
                    calls = list(self._sent)
                else:
                    found = {id(s): s for s in map(self._sent_keys.get, keys) if s is not None}
                    calls = [s for s in found.values() if all(k in keys for k in s.keys)]
                whole = [s for s in calls if s.withdrawable]
            for sent in whole:
                if sent.pending is None or registrar.withdraw(sent.pending):
                    with self._lock:
                        self._sent.remove(sent)
                        for k in sent.keys:
                            self._sent_keys.pop(k, None)
                        self._unlist(sent)
                    gone.update(sent.keys)
        return gone

    def close(self) -> None:
        self._withdraw(None)
        while self._sent:
            try:
                self._settle()
            except TcpxdError as e:  # (raised at no later use: there is none)
                log.warning("%s", e)
        with self._lock:
            keys = list(self._regions)
        self._drop(keys)

    def _settle(self, wanted: Optional[Set[Key]] = None) -> None:
        """Folds in the answers of registrations sent without waiting (`_Sent`), oldest first:
        what needs the agent's regions (metadata, descriptors, transfers, deregistration) calls
        it first. A registration the daemon refused raises here, naming its region, with every
        region of its `register_memory` call released (all or none, as a registration waited
        for); the next call folds the next. `wanted`: only until none of those keys is left
        unanswered (the older ones with them, in order)."""
        while self._sent:
            with self._settling:
                if not self._sent:
                    return
                if wanted is not None:
                    with self._lock:
                        if not any(k in self._sent_keys for k in wanted):
                            return
                sent = self._sent[0]
                try:
                    self._fold(sent)
                finally:
                    with self._lock:
                        self._sent.pop(0)
                        for k in sent.keys:
                            self._sent_keys.pop(k, None)
                        self._unlist(sent)
                    sent.pending = None  # (itself where held: the cycle broken, the record freed now)

    def _fold(self, sent: _Sent, later: bool = True) -> None:
        """`_settle` of one call's registrations: the held ones by address sent if they were not
        and their answers read, the files handed over by descriptor and answered, all read into
        Regions; a refusal raised naming its region, the call's other regions released
        (`later`: "answered later" said; else registered now, as where nothing can be held)."""
        registrar = self._client._registrar
        timeout = self._client.timeout
        said = "register_memory (answered later): " if later else ""
        done: List[Key] = []
        failed: List[Tuple[Key, TcpxdError]] = []
        part = sent.by_address or sent.files
        try:
            if sent.by_address:
                if sent.pending is not None and registrar is not None:
                    got = registrar.collect(sent.pending, timeout)
                else:
                    got = self._client._register_addresses(sent.addrs, sent.tails)
                self._fold_answers(sent.by_address, got, sent.todo, sent.sizes, done, failed)
            if sent.files and not failed:
                part = sent.files
                memories = [sent.todo[k][1] if sent.todo[k][1] is not None else (ctypes.c_char * k[2]).from_address(k[1])
                            for k in part]
                asked = [granule_tilings(k[2]) for k in part]
                self._fold_buffers(part, self._client._register_host_many(memories, asked), asked, done, failed)
        except TcpxdError as e:
            self._drop(done)
            i = sent.todo[part[0]][0]
            raise from_tcpxd(e, f"{said}reg_list[{i}] (DRAM at {part[0][1]:#x}, {part[0][2]} bytes)") from None
        if failed:
            self._drop(done)
            key, err = min(failed, key=lambda f: sent.todo[f[0]][0])
            raise from_tcpxd(err, f"{said}reg_list[{sent.todo[key][0]}] (DRAM at {key[1]:#x}, {key[2]} bytes)") from None

    def _drop(self, keys: List[Key]) -> None:
        """Releases the regions: the DRAM regions' buffers together (by id, those registered by
        address: Client._release_ids; the others Client._release_many), the others one by one."""
        bufs: List[Any] = []
        ids: List[int] = []
        emptied: List[int] = []
        others: List[Callable[[], None]] = []
        with self._lock:
            regions, dram = self._regions, self._dram
            for k in keys:
                entry = regions.pop(k, None)
                buf = dram.pop(k, None)
                self._kept.pop(k, None)
                if buf is not None:
                    if type(buf) is int:
                        ids.append(buf)
                        batch = self._batch_of.pop(buf, None)
                        if batch is not None:
                            batch.regions.pop(buf, None)
                            if batch.released:
                                emptied.append(batch.n)
                    else:
                        bufs.append(buf)
                elif entry is not None:
                    others.append(entry[1])
            self._table = None
        for n in emptied:  # (not registered again after a restart any more)
            self._client._reattach.forget("a", n)
        first: Optional[BaseException] = None
        if ids:
            try:
                self._client._release_ids(ids)
            except TcpxdError as e:
                first = e
        if bufs:
            try:
                self._client._release_many(bufs)
            except TcpxdError as e:
                first = first or e
        for release in others:
            try:
                release()
            except TcpxdError as e:
                first = first or e
        if first is not None:
            raise first

    def _tail(self, size: int) -> Tail:
        """The serialized tail of a `size`-byte region's request by address and the granule lists it
        asks, kept in `_tails` (up to 64 sizes: those an agent registers are few). `Lone.hold` calls
        it for a size's first lone region."""
        tail = self._tails.get(size)
        if tail is None:
            asked = granule_tilings(size)
            t = address_tail(size, "", asked)
            tail = (t, asked, (t,))
            if len(self._tails) < 64:
                self._tails[size] = tail
        return tail

    def _dram_many(self, todo: Dict[Key, Tuple[int, Any]], whole: Optional[RegDList] = None) -> None:
        """Registers DRAM regions together, each buffer's granule lists made by the daemon with
        it (released by the daemon with the buffer). Checked here first as the daemon would
        (mapped, writable: `address_ranges`), what it would refuse raised now; then held back
        (`_Sent`): memory with no file to hand over (anonymous or private: a numpy array, a CPU
        tensor, a pinned one) by address (`Registrar.hold_addresses`: sent with the registration
        connection's next message, PIPELINE to a frame, no object a region but its Region), the
        rest (a memfd, /dev/shm) looked up and handed over by descriptor
        (Client._register_host_many) at the first call that needs the regions, which reads all
        the answers (`_settle`). Registered now where nothing can be held (no local session: a
        TCP endpoint, which refuses it)."""
        keys = list(todo)
        kinds = address_ranges([k[1] for k in keys], [k[2] for k in keys])
        fast: List[Key] = keys
        files: List[Key] = []
        if kinds.count(BY_ADDRESS) != len(keys):  # (else the usual: all anonymous memory)
            fast = []
            for k, kind in zip(keys, kinds):
                if kind == BY_ADDRESS:
                    fast.append(k)
                elif kind == FILE_SHARED:
                    files.append(k)
                else:  # what the daemon would refuse, said now
                    raise nixlInvalidParamError(f"reg_list[{todo[k][0]}] (DRAM at {k[1]:#x}, {k[2]} bytes): "
                                                f"{range_refusal(kind, k[1], k[2])}")
        tails: Dict[int, Tail] = {}
        known = self._tails
        for size in {k[2] for k in fast}:
            tail = known.get(size)
            tails[size] = tail if tail is not None else self._tail(size)
        addrs = array.array("Q", [k[1] for k in fast])
        registrar = self._client._registrar
        sent = _Sent(keys, todo, fast, addrs, [tails[k[2]][0] for k in fast], tails, files)
        if registrar is not None and fast and registrar.hold(sent):
            sent.pending = sent
        if registrar is None or (sent.pending is None and fast):
            self._fold(sent, later=False)
            return
        if whole is not None:  # (every region of the list: `_withdraw_list` finds it)
            sent.rows, sent.list_id = whole.rows.tobytes(), id(whole)
        with self._lock:  # folded in by `_settle`
            self._sent.append(sent)
            sent_keys = self._sent_keys
            for k in keys:
                sent_keys[k] = sent
            if whole is not None:
                self._by_list[sent.list_id] = sent

    def _fold_answers(self, keys: List[Key], got: List[Any], todo: Dict[Key, Tuple[int, Any]],
                      tails: Dict[int, Tail], done: List[Key],
                      failed: List[Tuple[Key, TcpxdError]]) -> None:
        """The daemon's answers to registrations by address read into Regions, the table updated
        once (`done`: the keys registered; `failed`: the others, with why)."""
        added: List[Tuple[Key, Region, int]] = []
        batch = AddressBatch()
        for key, ans in zip(keys, got):
            if isinstance(ans, TcpxdError):
                failed.append((key, ans))
                continue
            id, desc, lists = ans  # (an Answer: tcpxd._registrar)
            asked = tails[key[2]][1]
            if len(asked) == 2 and len(lists) == 2 and lists[0][3] is None and lists[1][3] is None and lists[1][0]:
                (cid, cn, ctok, _), (fid, fn, ftok, _) = lists  # (the usual: both made)
                region = make_region(key[1], key[2], key[3], "DRAM", desc, 0, id, asked[0].stride, ctok, cn, cid,
                                     asked[1].stride, ftok, fn, fid)
                made: Tuple[Tuple[int, Any], ...] = ((cid, asked[0]), (fid, asked[1]))
            elif asked and not lists:  # a daemon that makes no lists with a registration
                buf = _Named(id, desc)
                region = granule_list(self._client, buf, key[2]).region(key[1], key[2], key[3], "DRAM", buf, 0)
                made = ()  # (registered by RegisterBlocks: re-attached as such)
            else:
                gl = granules_answered(id, lists, asked)
                region = gl.region(key[1], key[2], key[3], "DRAM", _Named(id, desc), 0)
                made = tuple((g.list_id, a) for g, a in zip((gl, gl.fine), asked) if g is not None and g.list_id)
            added.append((key, region, id))
            batch.regions[id] = (key[1], key[2], desc, made)
        if batch.regions:
            batch.n = self._client._reattach.track_batch(batch)
        with self._lock:
            for key, region, id in added:
                self._regions[key] = (region, _in_dram)
                self._dram[key] = id
                self._batch_of[id] = batch
                obj = todo[key][1]
                if obj is not None:  # (a tensor or array given: kept alive while registered)
                    self._kept[key] = obj
            self._table = None
        done.extend(k for k, _, _ in added)

    def _fold_buffers(self, keys: List[Key], got: List[Any], asked: List[List[Any]], done: List[Key],
                      failed: List[Tuple[Key, TcpxdError]]) -> None:
        """The daemon's answers to registrations by descriptor (Client._register_host_many's)
        read into Regions (`done`: the keys registered; `failed`: the others, with why)."""
        for key, ans, tilings in zip(keys, got, asked):
            if isinstance(ans, TcpxdError):
                failed.append((key, ans))
                continue
            buf, lists, statuses = ans
            if tilings and not lists:  # a daemon that makes no lists with a registration
                gl = granule_list(self._client, buf, key[2])
            else:
                gl = granules_made(buf, lists, statuses, tilings)
            self._add(key, gl.region(key[1], key[2], key[3], "DRAM", buf, 0), buf.release)
            with self._lock:
                self._dram[key] = buf
            done.append(key)

    def _vram(self, addr: int, size: int, dev: int, what: str) -> Tuple[Region, Callable[[], None]]:
        ordinal, base, asize, handle = _cuda.allocation(addr)
        if ordinal != dev:
            raise nixlInvalidParamError(f"{what}: the address is on GPU {ordinal}, the descriptor says device {dev}")
        if addr + size > base + asize:
            raise nixlInvalidParamError(f"{what}: runs {addr + size - base - asize} bytes past its {asize}-byte allocation")
        with self._lock:
            imp = self._imports.get((ordinal, base))
            if imp is not None:
                imp.users += 1
        if imp is None:
            try:
                buf = self._client.register_cuda_ipc(handle, asize, device=ordinal)
            except TcpxdError as e:
                raise from_tcpxd(e, what) from None
            gl = granule_list(self._client, buf, asize)
            with self._lock:
                imp = self._imports.setdefault((ordinal, base), _Import(buf, base, asize, 0, gl))
                imp.users += 1
            if imp.buffer is not buf:  # another thread imported it meanwhile
                buf.release()

        def release() -> None:
            with self._lock:
                imp.users -= 1
                last = imp.users == 0
                if last:
                    self._imports.pop((ordinal, base), None)
            if last:
                imp.buffer.release()

        return imp.granules.region(addr, size, dev, "VRAM", imp.buffer, addr - base), release
