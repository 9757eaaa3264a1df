"""How a prepared request's index arrays are checked and carried (tcpxd.nixl._plan's module doc
says which form a request takes when).

- `indices`: an index array checked in range, naming the first bad position (NIXL raises there).
- `Outer`: vLLM's form (R regions × B blocks, each row the first plus r × K) found exactly and
  encoded as an OuterIndices (R row bases, B columns), by the package's optional C pass
  (tcpxd._native: one read of the array) where it is built, else by numpy (a subtraction into
  scratch, a comparison, a scan). The finding stands for the range check.
- `Windows`: the agent's index ring, a host buffer shared with the daemon whose slots carry a
  request's two index arrays as u32s, named in the request by IndexWindow.
- `Scratch`: where indices packed into the request itself are put as u32s.

`OUTER_MIN`, `WINDOW_MIN`, `WINDOW_MAX` and `WINDOW_SLOTS` are read at call time from this module
(tests lower them).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import numpy as np

from .._native_gate import native as _native  # the optional C pass: one read where numpy takes three
from ._errors import nixlInvalidParamError
from ._wire import _SMALL_VARINTS, V

if TYPE_CHECKING:
    from ._plan import Prepped

#: Both sides' OuterIndices as a prepared request's fields local_outer 8 and remote_outer 9, in
#: one call (`_native.outer_fields`), where the C pass is built.
outer_fields = _native.outer_fields if _native is not None else None


def split_fields(fields: bytes) -> Tuple[bytes, bytes]:
    """Both sides' OuterIndices messages out of `outer_fields`' bytes (local_outer 8, then
    remote_outer 9)."""
    ll, at = _read_varint(fields, 1)
    lo = fields[at:at + ll]
    rl, at2 = _read_varint(fields, at + ll + 1)
    return lo, fields[at2:at2 + rl]


def _read_varint(b: bytes, at: int) -> Tuple[int, int]:
    """The varint at b[at:] and where it ends."""
    v = shift = 0
    while True:
        c = b[at]
        at += 1
        v |= (c & 0x7F) << shift
        if c < 0x80:
            return v, at
        shift += 7


#: Indices a side must have for the outer form to be looked for (fewer go packed: cheap enough).
OUTER_MIN = 1024
#: Indices a side must have to go through the agent's index ring (`Windows`), and at most.
WINDOW_MIN = 1024
WINDOW_MAX = 32768
#: Slots of the index ring, each one request's two sides of up to WINDOW_MAX u32s (8 MiB in all).
WINDOW_SLOTS = 32

_U32 = np.dtype("<u4")
_I64 = np.dtype(np.int64)
_U64 = np.dtype(np.uint64)


#: The largest element of an array (one pass; numpy's ufunc, no Python wrapper).
_umax = np.maximum.reduce


def indices(idx: Any, n: int, what: str) -> np.ndarray:
    """`idx` (a list or integer numpy array) as integers each in [0, n): a native-endian integer
    array comes back as it is (checked in one pass: its elements read as unsigned, a negative one
    is above any n), anything else as int64."""
    if type(idx) is list and 0 < len(idx) <= 16:  # a few, as a list (a small request): no numpy pass
        for i in idx:
            if type(i) is not int or not 0 <= i < n:
                break
        else:
            return np.array(idx, dtype=_I64)
    if type(idx) is np.ndarray and idx.dtype is _I64 and idx.ndim == 1 and idx.size:  # the commonest: one reduction
        if int(_umax(idx.view(_U64))) < n:
            return idx
    elif type(idx) is np.ndarray and idx.ndim == 1 and idx.size:
        dt = idx.dtype
        if dt.kind in "iu" and dt.isnative:  # the common case, quickly: one reduction
            v = idx if dt.kind == "u" else idx.view(_UNSIGNED[dt.itemsize])
            if int(_umax(v)) < n:
                return idx
    try:
        a = np.asarray(idx)
    except (TypeError, ValueError) as e:
        raise nixlInvalidParamError(f"{what}: {e}") from None
    if a.ndim != 1:
        raise nixlInvalidParamError(f"{what}: a 1-D list or array of indices is needed, got {a.ndim} dimensions")
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if a.dtype.kind not in "iu":
        raise nixlInvalidParamError(f"{what}: integer indices are needed, got {a.dtype}")
    if a.dtype.kind == "u" and a.dtype.itemsize == 8:  # uint64 past int64's range stays unsigned here
        bad = np.flatnonzero(a >= n)
    else:
        a = a.astype(np.int64, copy=False)
        bad = np.flatnonzero((a < 0) | (a >= n))
    if len(bad):
        k = int(bad[0])
        raise nixlInvalidParamError(f"{what}[{k}]: index {int(a[k])} is outside the prepared list of {n} descriptors")
    return a.astype(np.int64, copy=False)


_UNSIGNED: Dict[int, np.dtype] = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}
_umin = np.minimum.reduce


class Outer:
    """Finds index arrays of vLLM's form and encodes them as an OuterIndices message (module
    doc); scratch arrays reused from one request to the next (no allocation or page faults), the
    row bases' bytes kept by (rows, K) (vLLM's are the same every request)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._diff = np.empty(0, dtype=np.int64)
        self._same = np.empty(0, dtype=bool)
        #: OuterIndices' rows field by (R, K) (vLLM's are the same every request).
        self._rows: Dict[Tuple[int, int], bytes] = {}
        #: Whether `encode` uses tcpxd._native (built, and not turned off by TCPXD_NATIVE=0).
        self.native = _native is not None

    def encode(self, idx: Any, p: Prepped) -> Optional[bytes]:
        """`idx` as an encoded OuterIndices (rows 1, cols 2: little-endian u32s), or None when
        it is not a native 8-byte integer array of at least OUTER_MIN indices, of R = p.rows
        rows of B (= len / R) whose row r is row 0 plus r × K, every index in [0, len(p)).
        None covers every index out of range too: `indices` then names it.

        Exact: the rows are checked equal to K everywhere in idx[B:] - idx[:-B] (wrapping), so
        idx[r × B + c] ≡ idx[c] + r × K modulo 2**64; row 0 (read unsigned) and the row bases are
        checked in [0, len(p)), so each such sum is an index in range and the one 64-bit integer
        congruent to it is the index itself. By the C pass where it is built (one read of the
        array), else by numpy (`_numpy`); both give the same bytes."""
        if type(idx) is not np.ndarray or idx.ndim != 1:
            return None
        m, dt, rows = idx.size, idx.dtype, p.rows
        if m < OUTER_MIN or rows < 2 or m % rows or dt.itemsize != 8 or dt.kind not in "iu" or not dt.isnative:
            return None
        return _native.outer(idx, rows, len(p)) if self.native and _native is not None else self._numpy(idx, rows, len(p))

    def _numpy(self, idx: np.ndarray, rows: int, n: int) -> Optional[bytes]:
        """`_native.outer` in numpy (where the extension is not built, or turned off): a
        subtraction into a scratch array, a comparison, a scan."""
        a = idx if idx.dtype.kind == "i" else idx.view(np.int64)
        m = idx.size
        b = m // rows
        k = int(a[b]) - int(a[0])
        if not -n < k < n or int(a[m - 1]) - int(a[m - 1 - b]) != k:
            return None  # not of the form (a look at two positions turns most others away)
        # Row 0 in [0, n) (read unsigned: a negative one is above any n), and the rows' span:
        # row bases r × K + s for r < R (s lifts them to 0 when K < 0), columns row 0 - s.
        cols = a[:b]
        top = int(_umax(cols.view(np.uint64)))
        s = min(0, (rows - 1) * k)
        if top + max(0, (rows - 1) * k) >= n or (s and int(_umin(cols)) + s < 0):
            return None
        with self.lock:
            if len(self._diff) < m - b:
                self._diff = np.empty(m, dtype=np.int64)
                self._same = np.empty(m, dtype=bool)
            d, same = self._diff[: m - b], self._same[: m - b]
            np.subtract(a[b:], a[:-b], out=d)
            np.equal(d, k, out=same)
            if b"\x00" in same.tobytes():  # (faster than .all(): a copy of m bytes and memchr)
                return None
            rb = self._rows.get((rows, k))
            if rb is None:
                rb = (np.arange(rows, dtype=np.int64) * k - s).astype(_U32).tobytes()
                if len(self._rows) > 64:
                    self._rows.clear()
                rb = self._rows[(rows, k)] = b"\x0a" + V(len(rb)) + rb
        cb = (cols + s if s else cols).astype(_U32).tobytes()
        return rb + b"\x12" + V(len(cb)) + cb


class Scratch:
    """Where a prepared transfer's index arrays are packed as little-endian u32s right before
    they are sent: two arrays reused from one transfer to the next (grown when needed), so a
    request allocates and faults in no pages of its own. Hold `lock` from `pack` until the pieces
    were sent."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._bufs = [np.empty(0, dtype=_U32), np.empty(0, dtype=_U32)]
        #: Each array's bytes (sliced per request: no view object built from numpy's side).
        self._views = [memoryview(b"")] * 2

    def pack(self, side: int, a: np.ndarray) -> memoryview:
        """`a` (integers in u32's range) as u32 bytes: `a`'s own when it is a contiguous u32
        array, else packed into this side's array (one pass)."""
        if a.dtype == _U32 and a.flags.c_contiguous:
            return a.data.cast("B")
        n = len(a)
        buf = self._bufs[side]
        if len(buf) < n:
            buf = self._bufs[side] = np.empty(max(n, 2 * len(buf)), dtype=_U32)
            self._views[side] = buf.data.cast("B")
        buf[:n] = a
        return self._views[side][: 4 * n]


class Windows:
    """The agent's index ring: a host buffer shared with its daemon (a memfd, registered once),
    cut into WINDOW_SLOTS slots of two sides of WINDOW_MAX u32s. A prepared request of at least
    WINDOW_MIN indices takes a free slot, packs its index arrays into it and names them by
    IndexWindow (buffer, offset, count); the daemon reads them when it takes the request, so the
    slot is free again once the request is answered (`give`, from the request's answer, whatever
    it is). With no slot free, or on a daemon whose memory this process cannot map (a TCP
    endpoint), requests go packed as before.

    Per slot side, its array (a view of the ring) and its IndexWindow field but for the count are
    made once; slots are handed out last freed first (one slot serves a request at a time)."""

    def __init__(self, buffer: Any) -> None:
        self.buffer = buffer
        self.id = int(buffer.id)
        u32 = buffer.numpy()[: WINDOW_SLOTS * 8 * WINDOW_MAX].view(_U32)
        self._u32 = u32
        #: Per (slot, side): the side's array, and IndexWindow{buffer_id 1, offset 2, count 3}'s
        #: bytes up to the count's value.
        self._sides: List[Tuple[np.ndarray, bytes]] = []
        for at in range(0, 2 * WINDOW_SLOTS * WINDOW_MAX, WINDOW_MAX):
            self._sides.append((u32[at:at + WINDOW_MAX], b"\x08" + V(self.id) + b"\x10" + V(4 * at) + b"\x18"))
        #: Per slot: both sides' arrays, and both IndexWindow fields for the count last asked for
        #: (requests of one size, as vLLM's, reuse them).
        self._slots: List[List[Any]] = [[self._sides[2 * s][0], self._sides[2 * s + 1][0], -1, b""] for s in range(WINDOW_SLOTS)]
        # list.pop and list.append are atomic: no lock (take / give)
        self._free = list(range(WINDOW_SLOTS - 1, -1, -1))

    @staticmethod
    def nbytes() -> int:
        return WINDOW_SLOTS * 8 * WINDOW_MAX

    def take(self) -> Optional[int]:
        """A free slot, or None."""
        try:
            return self._free.pop()
        except IndexError:
            return None

    def give(self, slot: int) -> None:
        """Frees `slot` (its request was answered, or never sent)."""
        self._free.append(slot)

    @property
    def free(self) -> int:
        return len(self._free)

    def put(self, li: np.ndarray, ri: np.ndarray) -> Optional[Tuple[int, bytes]]:
        """`take` and `pack_both` in one step: a free slot holding both sides (of one length),
        and their IndexWindow fields; None when no slot is free."""
        try:
            slot = self._free.pop()
        except IndexError:
            return None
        return slot, self.pack_both(slot, li, ri)

    def pack_both(self, slot: int, li: np.ndarray, ri: np.ndarray) -> bytes:
        """Both sides (at most WINDOW_MAX integers each in u32's range, of one length) packed into
        `slot`; their IndexWindow fields (local_window 10, remote_window 11)."""
        n = len(li)
        held = self._slots[slot]
        held[0][:n] = li
        held[1][:n] = ri
        if held[2] != n:
            held[3] = self.pack(slot, 0, li[:0], n) + self.pack(slot, 1, ri[:0], n)
            held[2] = n
        return held[3]

    def pack(self, slot: int, side: int, a: np.ndarray, count: Optional[int] = None) -> bytes:
        """`a` (at most WINDOW_MAX integers in u32's range) packed as u32s into side `side` of
        `slot`; its IndexWindow as the request's field (local_window 10, remote_window 11), naming
        `count` indices where given (the field alone: `a` empty)."""
        n = len(a)
        dst, head = self._sides[2 * slot + side]
        dst[:n] = a
        inner = head + V(n if count is None else count)
        return (b"\x5a" if side else b"\x52") + _SMALL_VARINTS[len(inner)] + inner
