"""Memory of this process registered by address, many regions at a time (docs/API.md, "Client
host memory"): which kind of mapping holds each region (`address_kinds`, without reading all of
/proc/self/maps where the kernel answers PROCMAP_QUERY), and a `register_batch`'s entries written
from the regions' addresses and one serialized request a region size (`address_entries`),
without a protobuf message object per region."""

from __future__ import annotations

import array
from typing import Any, List, Optional, Sequence

from . import _proto
from ._native_gate import native as _native

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
