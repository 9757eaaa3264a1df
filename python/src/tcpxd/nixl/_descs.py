"""NIXL descriptor lists: what get_reg_descs / get_xfer_descs build from the inputs the serving stacks
pass (lists of tuples, a tensor or a list of tensors, an N×3 numpy array)."""

from __future__ import annotations

import logging
import sys
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ._errors import nixlInvalidParamError

log = logging.getLogger("tcpxd.nixl")

#: The memory types NIXL names, with its deprecated aliases.
MEM_TYPES = {"DRAM": "DRAM", "VRAM": "VRAM", "FILE": "FILE", "BLOCK": "BLOCK", "OBJ": "OBJ", "cpu": "DRAM", "cuda": "VRAM"}
#: Those tcpxd moves.
MOVABLE = ("DRAM", "VRAM")


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")  # a tensor exists only if torch was imported already
    return torch is not None and isinstance(obj, torch.Tensor)


def mem_type(name: Optional[str], what: str = "mem_type") -> str:
    """NIXL's canonical memory type for `name`; raises nixlInvalidParamError naming the field."""
    if name is None:
        raise nixlInvalidParamError(f"{what}: give a memory type (\"DRAM\" or \"VRAM\") for descriptors that are not tensors")
    canon = MEM_TYPES.get(str(name))
    if canon is None:
        raise nixlInvalidParamError(f"{what}: {name!r} is not a NIXL memory type (one of {', '.join(MEM_TYPES)})")
    return canon


class DescList:
    """A descriptor list: a memory type and N rows of (address, length, device id)."""

    __slots__ = ("mem", "rows")

    def __init__(self, mem: str, rows: np.ndarray):
        self.mem = mem
        self.rows = rows

    def getType(self) -> str:  # noqa: N802 - NIXL's name
        return self.mem

    def descCount(self) -> int:  # noqa: N802
        return len(self.rows)

    def isEmpty(self) -> bool:  # noqa: N802
        return len(self.rows) == 0

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Tuple[int, ...]:
        return tuple(int(x) for x in self.rows[i])

    def __iter__(self) -> Iterator[Tuple[int, ...]]:
        return (self[i] for i in range(len(self.rows)))

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


class RegDList(DescList):
    """nixlRegDList: rows plus each region's meta string, and the tensors they came from (kept so a
    tensor's memory can be shared with the daemon by handle; not pickled)."""

    __slots__ = ("meta", "objs")

    def __init__(self, mem: str, rows: np.ndarray, meta: Optional[List[str]] = None, objs: Optional[List[Any]] = None):
        super().__init__(mem, rows)
        self.meta = meta if meta is not None else [""] * len(rows)
        self.objs: List[Any] = objs if objs is not None else [None] * len(rows)

    def __getitem__(self, i: int) -> Tuple[Any, ...]:
        return super().__getitem__(i) + (self.meta[i],)

    def __getstate__(self) -> Any:
        return (self.mem, self.rows, self.meta)

    def __setstate__(self, state: Any) -> None:
        self.mem, self.rows, self.meta = state
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
        meta: List[str] = []
        plain = []
        for i, d in enumerate(descs):
            if not isinstance(d, tuple) or len(d) != width:
                form = "(address, length, device id, meta)" if reg else "(address, length, device id)"
                raise nixlInvalidParamError(f"{what}[{i}]: a {width}-tuple {form} is needed, got {d!r}")
            plain.append(d[:3])
            if reg:
                meta.append(d[3].decode() if isinstance(d[3], bytes) else str(d[3]))
        try:
            arr = np.array(plain, dtype=np.int64 if any(int(x) < 0 for r in plain for x in r) else np.uint64)
        except (OverflowError, TypeError, ValueError) as e:
            raise nixlInvalidParamError(f"{what}: {e}") from None
        return RegDList(kind, _rows(arr, what), meta) if reg else XferDList(kind, _rows(arr, what))
    raise nixlInvalidParamError(
        f"{what}: expected a list of tuples, a tensor, a list of tensors or an N×3 numpy array, got a list of {type(first).__name__}"
    )


def lenient(descs: Any, mem: Optional[str], reg: bool, what: str) -> Optional[DescList]:
    """As NIXL's get_reg_descs / get_xfer_descs: None (and the reason logged) for input it refuses."""
    try:
        return parse(descs, mem, reg, what)
    except nixlInvalidParamError as e:
        log.error("%s", e.message)
        return None
