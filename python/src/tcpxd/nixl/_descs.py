"""NIXL descriptor lists: what get_reg_descs / get_xfer_descs build from the inputs the serving stacks
pass (lists of tuples, a tensor or a list of tensors, an N×3 numpy array), and the lists themselves
as NIXL's bindings make them (`nixl._bindings.nixlXferDList(DRAM_SEG, descs)`, `addDesc`, ...)."""

from __future__ import annotations

import itertools
import logging
import operator
import sys
from enum import Enum
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .._native_gate import native as _native
from ._errors import nixlInvalidKeyError, nixlInvalidParamError, nixlNotFoundError

log = logging.getLogger("tcpxd.nixl")

#: The memory types NIXL names, with its deprecated aliases.
MEM_TYPES = {"DRAM": "DRAM", "VRAM": "VRAM", "FILE": "FILE", "BLOCK": "BLOCK", "OBJ": "OBJ", "cpu": "DRAM", "cuda": "VRAM"}
#: Those tcpxd moves.
MOVABLE = ("DRAM", "VRAM")


class nixl_mem_t(str, Enum):  # noqa: N801 - NIXL's name
    """NIXL's memory types as its bindings name them (`nixl._bindings.DRAM_SEG`, ...); each is (and
    equals) the name the Python API takes ("DRAM", ...)."""

    DRAM_SEG = "DRAM"
    VRAM_SEG = "VRAM"
    BLK_SEG = "BLOCK"
    OBJ_SEG = "OBJ"
    FILE_SEG = "FILE"


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")  # a tensor exists only if torch was imported already
    return torch is not None and isinstance(obj, torch.Tensor)


def mem_type(name: Any, what: str = "mem_type") -> str:
    """NIXL's canonical memory type for `name` (a name or a nixl_mem_t); raises
    nixlInvalidParamError naming the field, a KeyError too for a name NIXL does not know (as its
    agent's table lookup does)."""
    if type(name) is nixl_mem_t:
        return str(name.value)
    if name is None:
        raise nixlInvalidParamError(f"{what}: give a memory type (\"DRAM\" or \"VRAM\") for descriptors that are not tensors")
    canon = MEM_TYPES.get(name) if isinstance(name, str) else None
    if canon is None:
        raise nixlInvalidKeyError(f"{what}: {name!r} is not a NIXL memory type (one of {', '.join(MEM_TYPES)})")
    return canon


def _binding_rows(descs: Any, width: int) -> Tuple[np.ndarray, List[Any]]:
    """Rows (and, for width 4, the meta fields) from a list of tuples or an N×3 array, checked as
    NIXL's bindings check them: TypeError for an element that is not a tuple, ValueError for a
    tuple of another width or an array not N×3 C-contiguous (u)int64."""
    if isinstance(descs, np.ndarray):
        if descs.ndim != 2 or descs.shape[1] != 3:
            raise ValueError("descs must be a Nx3 numpy array")
        if descs.dtype not in (np.uint64, np.int64):
            raise ValueError("descs must be a Nx3 numpy array of uint64 or int64")
        if not descs.flags.c_contiguous:
            raise ValueError("descs must be a C-contiguous numpy array")
        return descs.astype(np.uint64, copy=True), [b""] * len(descs)
    if not isinstance(descs, list):
        raise TypeError(f"descs: a list of tuples or an N×3 numpy array is needed, got {type(descs).__name__}")
    if not descs:
        return np.zeros((0, 3), dtype=np.uint64), []
    packed = _native.desc_rows(descs, width) if _native is not None else None
    if packed is not None:  # the C pass: every element a tuple of that width, its fields unsigned ints
        return np.frombuffer(packed, dtype=np.uint64).reshape(-1, 3), [d[3] for d in descs] if width == 4 else []
    if set(map(type, descs)) != {tuple}:
        raise TypeError("Each descriptor must be a tuple when provided as a list")
    if set(map(len, descs)) != {width}:
        raise ValueError(f"Each descriptor tuple must have exactly {width} elements")
    fields = descs if width == 3 else map(operator.itemgetter(0, 1, 2), descs)
    try:
        ints = map(operator.index, itertools.chain.from_iterable(fields))  # (a float is refused, as the binding does)
        rows = np.fromiter(ints, dtype=np.uint64, count=3 * len(descs))
    except (OverflowError, TypeError, ValueError) as e:
        raise TypeError(f"descs: addresses, lengths and device ids are unsigned integers ({e})") from None
    return rows.reshape(-1, 3), [d[3] for d in descs] if width == 4 else []


def _one(desc: Any, width: int) -> Tuple[np.ndarray, Any]:
    rows, meta = _binding_rows([tuple(desc)], width)
    return rows, (meta[0] if meta else None)


class DescList:
    """A descriptor list: a memory type and N rows of (address, length, device id).

    Made as NIXL's bindings make one: `(type, init_size=0)` (that many zero descriptors) or
    `(type, descs)` (a list of tuples or an N×3 array); `type` a nixl_mem_t or its name."""

    __slots__ = ("mem", "rows")
    _width = 3

    def __init__(self, type: Any, descs: Any = 0, init_size: int = 0):  # noqa: A002 - the binding's keyword
        self.mem = mem_type(type, "type")
        if isinstance(descs, np.ndarray) and descs.dtype == np.uint64 and descs.ndim == 2 and descs.flags.c_contiguous \
                and descs.shape[1] == 3:
            self.rows = descs  # (the module's own, checked already: kept as given)
        elif isinstance(descs, int) and not isinstance(descs, bool):
            self.rows = np.zeros((max(descs, init_size), 3), dtype=np.uint64)
        else:
            self.rows, meta = _binding_rows(descs, self._width)
            self._took_meta(meta)

    def _took_meta(self, meta: List[Any]) -> None:
        pass

    def getType(self) -> nixl_mem_t:  # noqa: N802 - NIXL's name
        return nixl_mem_t(self.mem)

    def descCount(self) -> int:  # noqa: N802
        return len(self.rows)

    def isEmpty(self) -> bool:  # noqa: N802
        return len(self.rows) == 0

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Tuple[Any, ...]:
        return tuple(int(x) for x in self.rows[i])

    def __setitem__(self, i: int, desc: Tuple[Any, ...]) -> None:
        row, meta = _one(desc, self._width)
        self.rows[i] = row[0]
        self._set_meta(i, meta)

    def _set_meta(self, i: int, meta: Any) -> None:
        pass

    def __iter__(self) -> Iterator[Tuple[Any, ...]]:
        return (self[i] for i in range(len(self.rows)))

    def addDesc(self, desc: Tuple[Any, ...]) -> None:  # noqa: N802
        """Appends a descriptor (a tuple, as the list's elements)."""
        row, meta = _one(desc, self._width)
        self.rows = np.concatenate([self.rows, row])
        self._add_meta(meta)

    append = addDesc

    def _add_meta(self, meta: Any) -> None:
        pass

    def remDesc(self, index: int) -> None:  # noqa: N802
        """Removes the descriptor at `index` (IndexError outside the list)."""
        if not 0 <= index < len(self.rows):
            raise IndexError(f"index: {index} is outside the list's {len(self.rows)} descriptors")
        self.rows = np.delete(self.rows, index, axis=0)
        self._rem_meta(index)

    def _rem_meta(self, index: int) -> None:
        pass

    def clear(self) -> None:
        self.rows = np.zeros((0, 3), dtype=np.uint64)
        self._rem_meta(-1)

    def index(self, desc: Tuple[Any, ...]) -> int:
        """The position of the first descriptor equal to `desc`; nixlNotFoundError where none is."""
        row, meta = _one(desc, self._width)
        want = tuple(int(x) for x in row[0]) + self._key(meta)
        for i in range(len(self.rows)):
            if self[i] == want:
                return i
        raise nixlNotFoundError(f"desc: {desc!r} is not in the list")

    def _key(self, meta: Any) -> Tuple[Any, ...]:
        return ()

    def print(self) -> None:
        """Prints the list, as NIXL's binding does (to standard output)."""
        print(f"{type(self).__name__} of {len(self.rows)} {self.mem} descriptors:")
        for i in range(len(self.rows)):
            print(f"  {self[i]}")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.mem == self.mem and np.array_equal(other.rows, self.rows)

    __hash__ = None  # type: ignore[assignment]

    def __getstate__(self) -> Any:
        return (self.mem, self.rows)

    def __setstate__(self, state: Any) -> None:
        self.mem, self.rows = state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.mem}, {len(self.rows)} descriptors)"


class XferDList(DescList):
    """nixlXferDList: (address, length, device id) rows."""


class RemoteDList(DescList):
    """nixlRemoteDList: (address, length, device id, remote agent name) rows, as NIXL's bindings
    make them (for NIXL's device API, prep_mem_view, which tcpxd does not provide)."""

    __slots__ = ("agents",)
    _width = 4

    def __init__(self, type: Any, descs: Any = 0, init_size: int = 0):  # noqa: A002
        self.agents: List[str] = []
        super().__init__(type, descs, init_size)
        if len(self.agents) != len(self.rows):
            self.agents = [""] * len(self.rows)

    def _took_meta(self, meta: List[Any]) -> None:
        self.agents = [str(m) for m in meta]

    def __getitem__(self, i: int) -> Tuple[Any, ...]:
        return super().__getitem__(i) + (self.agents[i],)

    def _set_meta(self, i: int, meta: Any) -> None:
        self.agents[i] = str(meta)

    def _add_meta(self, meta: Any) -> None:
        self.agents.append(str(meta))

    def _key(self, meta: Any) -> Tuple[Any, ...]:
        return (str(meta),)

    def _rem_meta(self, index: int) -> None:
        if index < 0:
            self.agents = []
        else:
            del self.agents[index]


def _meta_bytes(m: Any) -> bytes:
    return m if isinstance(m, bytes) else bytes(m) if isinstance(m, (bytearray, memoryview)) else str(m).encode()


class RegDList(DescList):
    """nixlRegDList: rows plus each region's meta (bytes, as NIXL returns them), and the tensors
    they came from (kept so a tensor's memory can be shared with the daemon by handle; not
    pickled)."""

    __slots__ = ("meta", "objs")
    _width = 4

    def __init__(self, type: Any, descs: Any = 0, meta: Optional[List[Any]] = None,  # noqa: A002
                 objs: Optional[List[Any]] = None, init_size: int = 0):
        self.meta: List[bytes] = []
        super().__init__(type, descs, init_size)
        if meta is not None:
            self.meta = [_meta_bytes(m) for m in meta]
        elif len(self.meta) != len(self.rows):
            self.meta = [b""] * len(self.rows)
        self.objs: List[Any] = objs if objs is not None else [None] * len(self.rows)

    def _took_meta(self, meta: List[Any]) -> None:
        self.meta = [_meta_bytes(m) for m in meta]

    def __getitem__(self, i: int) -> Tuple[Any, ...]:
        return super().__getitem__(i) + (self.meta[i],)

    def _set_meta(self, i: int, meta: Any) -> None:
        self.meta[i] = _meta_bytes(meta)
        self.objs[i] = None

    def _add_meta(self, meta: Any) -> None:
        self.meta.append(_meta_bytes(meta))
        self.objs.append(None)

    def _rem_meta(self, index: int) -> None:
        if index < 0:
            self.meta, self.objs = [], []
        else:
            del self.meta[index]
            del self.objs[index]

    def _key(self, meta: Any) -> Tuple[Any, ...]:
        return (_meta_bytes(meta),)

    def __eq__(self, other: object) -> bool:
        return super().__eq__(other) and isinstance(other, RegDList) and self.meta == other.meta

    __hash__ = None

    def __getstate__(self) -> Any:
        return (self.mem, self.rows, self.meta)

    def __setstate__(self, state: Any) -> None:
        self.mem, self.rows, meta = state
        self.meta = [_meta_bytes(m) for m in meta]
        self.objs = [None] * len(self.rows)

    def trim(self) -> XferDList:
        """The same regions as transfer descriptors."""
        return XferDList(self.mem, self.rows.copy())


def _rows(array: Any, what: str) -> np.ndarray:
    a = np.asarray(array)
    if a.ndim != 2 or a.shape[1] != 3:
        raise nixlInvalidParamError(f"{what}: an N×3 array of (address, length, device id) is needed, got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise nixlInvalidParamError(f"{what}: an integer array is needed (uint64 or int64), got {a.dtype}")
    if a.dtype.kind == "i" and len(a) and int(a.min()) < 0:
        raise nixlInvalidParamError(f"{what}: negative address, length or device id")
    return np.ascontiguousarray(a, dtype=np.uint64)


def _tensor_row(t: Any, what: str) -> Tuple[str, Tuple[int, int, int]]:
    if not t.is_contiguous():
        raise nixlInvalidParamError(f"{what}: a non-contiguous tensor is not one byte range (use a list of contiguous tensors)")
    dev = t.get_device()
    return ("DRAM" if dev == -1 else "VRAM"), (int(t.data_ptr()), int(t.numel() * t.element_size()), max(dev, 0))


def parse(descs: Any, mem: Optional[str], reg: bool, what: str) -> DescList:
    """A RegDList (reg) or XferDList from NIXL's accepted inputs; raises nixlInvalidParamError
    naming `what` and the reason."""
    cls = RegDList if reg else XferDList
    other = XferDList if reg else RegDList
    if isinstance(descs, cls):
        return descs
    if isinstance(descs, other):
        want = "a registration list (get_reg_descs)" if reg else "a transfer list (get_xfer_descs)"
        raise nixlInvalidParamError(f"{what}: {type(descs).__name__} given where {want} is needed")
    if _is_tensor(descs):
        kind, row = _tensor_row(descs, what)
        rows = np.array([row], dtype=np.uint64)
        return RegDList(kind, rows, objs=[descs]) if reg else XferDList(kind, rows)
    if isinstance(descs, np.ndarray):
        return cls(mem_type(mem, f"{what}.mem_type"), _rows(descs, what))
    if not isinstance(descs, Sequence) or isinstance(descs, (str, bytes)):
        raise nixlInvalidParamError(
            f"{what}: expected a list of tuples, a tensor, a list of tensors or an N×3 numpy array, got {type(descs).__name__}"
        )
    if len(descs) == 0:
        raise nixlInvalidParamError(f"{what}: empty descriptor list")
    first = descs[0]
    if _is_tensor(first):
        kinds: List[str] = []
        trows: List[Tuple[int, int, int]] = []
        devs = set()
        for i, t in enumerate(descs):
            if not _is_tensor(t):
                raise nixlInvalidParamError(f"{what}[{i}]: expected a tensor like the others, got {type(t).__name__}")
            kind, row = _tensor_row(t, f"{what}[{i}]")
            kinds.append(kind)
            devs.add(str(t.device))
            trows.append(row)
        if len(devs) > 1:
            raise nixlInvalidParamError(f"{what}: tensors on different devices ({', '.join(sorted(devs))}) in one list")
        arr = np.array(trows, dtype=np.uint64)
        return RegDList(kinds[0], arr, objs=list(descs)) if reg else XferDList(kinds[0], arr)
    if isinstance(first, tuple):
        width = 4 if reg else 3
        kind = mem_type(mem, f"{what}.mem_type")
        if len(first) != width:
            form = "(address, length, device id, meta)" if reg else "(address, length, device id)"
            raise nixlInvalidParamError(f"{what}[0]: a {width}-tuple {form} is needed, got {first!r}")
        try:  # every element a tuple of that width, unsigned integers: columns at C speed
            arr, meta = _binding_rows(descs if type(descs) is list else list(descs), width)
        except (TypeError, ValueError) as e:
            raise nixlInvalidParamError(f"{what}: {e}") from None
        return RegDList(kind, arr, meta) if reg else XferDList(kind, arr)
    raise nixlInvalidParamError(
        f"{what}: expected a list of tuples, a tensor, a list of tensors or an N×3 numpy array, got a list of {type(first).__name__}"
    )


def lenient(descs: Any, mem: Optional[str], reg: bool, what: str) -> Optional[DescList]:
    """As NIXL's get_reg_descs / get_xfer_descs: None (and the reason logged) for input it refuses;
    a memory type it does not know raises (a KeyError, as NIXL's table lookup)."""
    try:
        return parse(descs, mem, reg, what)
    except nixlInvalidParamError as e:
        if isinstance(e, KeyError):
            raise
        log.error("%s", e.message)
        return None
