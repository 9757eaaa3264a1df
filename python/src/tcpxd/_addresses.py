"""Memory of this process registered by address, many regions at a time (docs/API.md, "Client
host memory"): which kind of mapping holds each region (`address_kinds`, without reading all of
/proc/self/maps where the kernel answers PROCMAP_QUERY), and a `register_batch`'s entries written
from the regions' addresses and one serialized request a region size (`address_entries`),
without a protobuf message object per region."""

from __future__ import annotations

import array
import functools
import logging
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from . import _proto
from ._native_gate import native as _native
from .errors import TcpxdError

if TYPE_CHECKING:
    from .client import Client

log = logging.getLogger("tcpxd")

#: `address_kinds`: memory registered by address (anonymous, or a private mapping), a shared
#: mapping of a file (handed over by descriptor: `locate` looks it up), no mapping.
BY_ADDRESS, FILE_SHARED, UNMAPPED = 0, 1, 2

#: Whether the kernel answers PROCMAP_QUERY (None: not asked yet).
_procmap: Optional[bool] = None


def address_kinds(addrs: Any) -> bytes:
    """Per address (a sequence or array of ints), the kind of mapping of this process holding it:
    BY_ADDRESS, FILE_SHARED or UNMAPPED. Asked of the kernel address by address where it can
    (tcpxd._native.vma_kinds: PROCMAP_QUERY, Linux 6.11+, ~0.4 µs each), else from one read of
    /proc/self/maps. The answer is of the moment: what `locate` then finds decides."""
    global _procmap
    if isinstance(addrs, array.array) and addrs.typecode == "Q":
        a: Any = addrs
    else:
        import numpy as np

        a = np.ascontiguousarray(addrs, dtype=np.uint64)
    if _native is not None and _procmap is not False:
        try:
            kinds: bytes = _native.vma_kinds(a)
            _procmap = True
            return kinds
        except OSError:
            if _procmap is None:
                _procmap = False  # an older kernel: /proc/self/maps from now on
    from ._hostmem import Locator

    where = Locator()
    out = bytearray(len(a))
    for j, addr in enumerate(a.tolist()):
        i = where.at(addr)
        if i < 0:
            out[j] = UNMAPPED
            continue
        m = where.mapping(i)
        out[j] = FILE_SHARED if m.inode != 0 and not m.path.startswith("[") and "s" in m.perms else BY_ADDRESS
    return bytes(out)


#: tcpxd._native.vma_ranges where the extension has it.
_vma_ranges = getattr(_native, "vma_ranges", None)

#: `address_ranges`, besides BY_ADDRESS, FILE_SHARED and UNMAPPED (the region's first byte): a
#: hole inside the range, a mapping under it that is not writable.
HOLE, READ_ONLY = 3, 4


def address_ranges(addrs: Any, sizes: Any) -> bytes:
    """Per region (addrs[i], sizes[i]), what registering it by address would find, as the daemon
    checks it (docs/API.md, "Memory with no file: by address"): BY_ADDRESS (every byte mapped and
    writable, an anonymous or private mapping at its start), FILE_SHARED (a shared mapping of a
    file at its start: handed over by descriptor, not checked further here), UNMAPPED (its start),
    HOLE or READ_ONLY. The kernel asked region by region where it can (PROCMAP_QUERY through
    tcpxd._native.vma_ranges), else one read of /proc/self/maps. Of the moment: the daemon's
    own probe decides."""
    global _procmap
    if isinstance(addrs, list) and isinstance(sizes, list):  # (few: no numpy conversion)
        a: Any = array.array("Q", addrs)
        n: Any = array.array("Q", sizes)
        if _procmap and _vma_ranges is not None:  # (the kernel answers: the usual, once known)
            kinds: bytes = _vma_ranges(a, n)
            return kinds
    else:
        import numpy as np

        a = np.ascontiguousarray(addrs, dtype=np.uint64)
        n = np.ascontiguousarray(sizes, dtype=np.uint64)
    if _native is not None and _procmap is not False and hasattr(_native, "vma_ranges"):
        try:
            kinds = _native.vma_ranges(a, n)
            _procmap = True
            return kinds
        except OSError:
            if _procmap is None:
                _procmap = False
    from ._hostmem import Locator

    where = Locator()
    out = bytearray(len(a))
    for j, (addr, size) in enumerate(zip(a.tolist(), n.tolist())):
        i = where.at(addr)
        if i < 0:
            out[j] = UNMAPPED
            continue
        m = where.mapping(i)
        if m.inode != 0 and not m.path.startswith("[") and "s" in m.perms:
            out[j] = FILE_SHARED
            continue
        end, kind = addr + size, BY_ADDRESS
        while True:
            if "w" not in m.perms:
                kind = READ_ONLY
                break
            if m.end >= end:
                break
            i += 1
            if i >= where.count() or where.mapping(i).start != m.end:
                kind = HOLE
                break
            m = where.mapping(i)
        out[j] = kind
    return bytes(out)


#: tcpxd._native.vma_row where the extension has it.
_vma_row = getattr(_native, "vma_row", None)


def row_range(rows: Any) -> Optional[Tuple[int, int, int, int]]:
    """A registration list of one region (`rows`: its N×3 u64 rows) in one call of the
    extension (since session 22): (address, length, device id, what `address_ranges` finds
    of the range); None where the kernel is not known to answer PROCMAP_QUERY (or the extension
    is not built), or `rows` is not one row: the caller takes `address_ranges`."""
    if not _procmap or _vma_row is None:
        return None
    try:
        got: Optional[Tuple[int, int, int, int]] = _vma_row(rows)
        return got
    except OSError:  # (asked again, and found out, by `address_ranges`)
        return None


def range_refusal(kind: int, addr: int, size: int) -> str:
    """Why a region `address_ranges` found `kind` (not BY_ADDRESS or FILE_SHARED) cannot be
    registered, as the daemon would say it."""
    span = f"{addr:#x}..{addr + size:#x}"
    if kind == UNMAPPED:
        return f"{addr:#x} is not mapped in this process (the range {span})"
    if kind == HOLE:
        return f"the range {span} has a hole: part of it is not mapped in this process"
    return f"the range {span} is not writable throughout (a read-only mapping under it); transfers write into it"


def address_tail(size: int, label: str, lists: Sequence[Any]) -> bytes:
    """The serialized RegisterClientMemoryRequest of a `size`-byte region with its block lists,
    but for its address (`Registrar.register_addresses`): the same for every region of one size."""
    return bytes(_proto.message("RegisterClientMemoryRequest")(size=size, label=label, block_lists=lists).SerializeToString())


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


@functools.lru_cache(maxsize=None)
def _key(message: str, field: str) -> bytes:
    """The key of a length-delimited field (its number, wire type 2) as protobuf writes it."""
    return _varint(_proto.message(message).DESCRIPTOR.fields_by_name[field].number << 3 | 2)


def address_entries(addrs: Any, tails: List[bytes]) -> bytes:
    """A RegisterBatchRequest's serialized entries of memory registered by address: region i's
    request is its address (field 1) and `tails[i]` (`address_tail`). One C call where the
    package's extension is built; the same bytes from Python otherwise."""
    entry, inner = _key("RegisterBatchRequest", "entries"), _key("RegisterBatchEntry", "client_memory")
    if _native is not None:
        return bytes(_native.address_entries(addrs, tails, entry, inner))
    parts = []
    for a, tail in zip(addrs.tolist(), tails):
        req = b"\x08" + _varint(a) + tail
        e = inner + _varint(len(req)) + req
        parts.append(entry + _varint(len(e)) + e)
    return b"".join(parts)


class AddressBatch:
    """Memory registered by address together (`Client._register_addresses`), as a restarted
    daemon is handed it again (tcpxd._reattach): per buffer id, its address, size, descriptor and
    the block lists made with it (their ids and the StridedBlocks asked for). One re-attach entry
    for the lot, a tuple a region, rather than a Buffer and closures a region. Not thread-safe:
    its owner (tcpxd.nixl's LocalMemory) adds and drops under its own lock."""

    def __init__(self) -> None:
        self.regions: Dict[int, Tuple[int, int, str, Sequence[Tuple[int, Any]]]] = {}
        #: Its number in the client's re-attacher (`Reattacher.track_batch`).
        self.n = 0

    @property
    def released(self) -> bool:
        """Nothing left to register again (every buffer released)."""
        return not self.regions

    def again(self, client: "Client") -> None:
        """Registers each buffer again under its id and key, the same address of this process,
        then its lists under their ids (docs/API.md, "Restarts"); one that fails is logged, the
        others go on."""
        from ._reattach import descriptor_key

        R, B = _proto.message("RegisterClientMemoryRequest"), _proto.message("RegisterBlocksRequest")
        registrar = client._registrar
        for id, (addr, size, desc, lists) in list(self.regions.items()):
            try:
                if registrar is None:
                    raise TcpxdError("no unix socket to register memory by address on")
                registrar.register_by_address(
                    R(address=addr, size=size, reattach_id=id, reattach_key=descriptor_key(desc)), client.timeout)
                for list_id, strided in lists:
                    client._unary("RegisterBlocks", B(buffer_id=id, strided=strided, reattach_id=list_id))
            except TcpxdError as e:
                log.warning("tcpxd: re-attaching buffer %d (memory by address at %#x) to the restarted daemon failed: %s",
                            id, addr, e)
