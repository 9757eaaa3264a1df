"""Prepared descriptor lists and the daemon requests a transfer by indices becomes.

The one place that knows how a NIXL transfer maps onto the daemon's API. Today: a prepared list is
held here, client side, as arrays (region, offset in the region's buffer, length) per descriptor;
`plan` pairs the chosen local and remote descriptors, merges neighbours that are contiguous on
both sides (as NIXL merges descriptors), and cuts the result into WriteBatch/ReadBatch requests of
at most MAX_ENTRIES entries. With block lists in the daemon a prepared list becomes a daemon block
list and a transfer one request of index arrays; only this module changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

import numpy as np

from .. import _proto
from . import _wire
from ._errors import nixlInvalidParamError, nixlMismatchError
from ._regions import Region, RegionTable

#: Entries per WriteBatch/ReadBatch request (the daemon's limit).
MAX_ENTRIES = 4096


@dataclass
class Prepped:
    """A prepared descriptor list: whose memory (`agent`, "" for the local agent), and per
    descriptor its region (index into `regions`), offset in that region's buffer and length."""

    agent: str
    mem: str
    regions: List[Region]
    region: np.ndarray
    offset: np.ndarray
    length: np.ndarray

    def __post_init__(self) -> None:
        #: Per region: its buffer's id, and its descriptor as an encoded field of each entry kind.
        self.buffer_ids = np.array([r.buffer_id for r in self.regions], dtype=np.uint64)
        descs = [r.descriptor.encode() for r in self.regions]
        self.desc_rows = {"WRITE": _wire.blobs(3, descs), "READ": _wire.blobs(1, descs)}

    def __len__(self) -> int:
        return len(self.length)


def prepare(table: RegionTable, mem: str, rows: np.ndarray, agent: str, owner: str, what: str) -> Prepped:
    region, offset = table.resolve(mem, rows, owner, what)
    return Prepped(agent, mem, table.regions, region, offset, rows[:, 1].copy())


def indices(idx: Any, n: int, what: str) -> np.ndarray:
    """`idx` (a list or integer numpy array) as int64, each in [0, n)."""
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
    a = a.astype(np.int64, copy=False)
    bad = np.flatnonzero((a < 0) | (a >= n))
    if len(bad):
        k = int(bad[0])
        raise nixlInvalidParamError(f"{what}[{k}]: index {int(a[k])} is outside the prepared list of {n} descriptors")
    return a


@dataclass
class Plan:
    """A transfer's daemon requests (their `notification` left empty) and its size."""

    op: str
    requests: List[Any]
    total_bytes: int
    desc_count: int
    entries: int


def plan(op: str, local: Prepped, li: np.ndarray, remote: Prepped, ri: np.ndarray, merge: bool, timeout_ms: int) -> Plan:
    if len(li) != len(ri):
        raise nixlMismatchError(f"local_indices: {len(li)} indices against remote_indices' {len(ri)}")
    if len(li) == 0:
        raise nixlInvalidParamError("local_indices: no descriptors to transfer")
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
    cls = _proto.message("WriteBatchRequest" if op == "WRITE" else "ReadBatchRequest")
    rows = remote.desc_rows[op]
    if op == "WRITE":  # WriteEntry: local_buffer_id, local_offset, remote_descriptor (3), remote_offset, length
        pieces = [_wire.varint_piece(1, local.buffer_ids[lr]), _wire.varint_piece(2, lo), _wire.table_piece(rr, rows),
                  _wire.varint_piece(4, ro), _wire.varint_piece(5, ln)]
    else:  # ReadEntry: remote_descriptor (1), remote_offset, local_buffer_id, local_offset, length
        pieces = [_wire.table_piece(rr, rows), _wire.varint_piece(2, ro), _wire.varint_piece(3, local.buffer_ids[lr]),
                  _wire.varint_piece(4, lo), _wire.varint_piece(5, ln)]
    requests = []
    for body in _wire.entries(1, pieces, MAX_ENTRIES):  # `entries` is field 1 of both requests
        req = cls.FromString(body)
        req.timeout_ms = timeout_ms
        requests.append(req)
    return Plan(op, requests, int(n.sum()), len(n), len(ln))


def descs_plan(op: str, local: Prepped, remote: Prepped, timeout_ms: int) -> Plan:
    """initialize_xfer: every local descriptor with the remote one at the same position."""
    if len(local) != len(remote):
        raise nixlMismatchError(f"local_descs: {len(local)} descriptors against remote_descs' {len(remote)}")
    idx = np.arange(len(local), dtype=np.int64)
    return plan(op, local, idx, remote, idx, True, timeout_ms)


def field(op: str) -> str:
    """The SessionRequest field of a plan's requests."""
    return "write_batch" if op == "WRITE" else "read_batch"


