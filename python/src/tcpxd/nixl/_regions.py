"""Registered regions and how descriptors resolve against them.

A NIXL region is a range of an agent's memory, named by its raw address. Here each one sits inside a
daemon buffer (`descriptor`, and `buffer_id` on the agent's own node) at `offset`: a DRAM region is the
buffer of its shared host memory (offset 0); VRAM regions inside one cudaMalloc allocation share the
buffer that imported the allocation, each at its own offset. Remote agents' regions come from their
metadata, so a remote descriptor (an address in the remote agent's memory) resolves to a remote
buffer and offset, and one outside every region is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import numpy as np

from ._errors import nixlInvalidParamError, nixlNotFoundError


@dataclass(frozen=True)
class Region:
    addr: int
    size: int
    dev: int
    mem: str
    #: The daemon buffer holding it (what another node's transfers name).
    descriptor: str
    #: Where `addr` sits in that buffer.
    offset: int
    #: The buffer's id on its own node (0 in a remote agent's table).
    buffer_id: int = 0
    #: The buffer's granule list: its granule in bytes (0: none), token, block count, and id on
    #: its own node (0 in a remote agent's table).
    granule: int = 0
    blocks: str = ""
    granules: int = 0
    list_id: int = 0
    #: Its fine granule list, the same four (0: none): a finer tiling, for lists whose
    #: descriptors do not align to `granule` (blocks not a multiple of 4 KiB).
    fine: int = 0
    fine_blocks: str = ""
    fine_granules: int = 0
    fine_list_id: int = 0

    def tiling(self, fine: bool) -> Tuple[int, int, int, str]:
        """(granule, granule count, list id on its own node, list token) of the coarse or fine
        granule list."""
        if fine:
            return self.fine, self.fine_granules, self.fine_list_id, self.fine_blocks
        return self.granule, self.granules, self.list_id, self.blocks

    def to_json(self) -> Dict[str, Any]:
        d: Dict[str, Any] = {"addr": self.addr, "len": self.size, "dev": self.dev, "mem": self.mem,
                             "desc": self.descriptor, "off": self.offset}
        if self.granule:
            d.update(g=self.granule, blk=self.blocks, n=self.granules)
        if self.fine:
            d.update(fg=self.fine, fblk=self.fine_blocks, fn=self.fine_granules)
        return d

    @staticmethod
    def from_json(d: Dict[str, Any]) -> "Region":
        g, fg = int(d.get("g", 0)), int(d.get("fg", 0))
        return Region(int(d["addr"]), int(d["len"]), int(d["dev"]), str(d["mem"]), str(d["desc"]), int(d["off"]),
                      0, g, str(d["blk"]) if g else "", int(d["n"]) if g else 0, 0,
                      fg, str(d["fblk"]) if fg else "", int(d["fn"]) if fg else 0)


_FIELDS = tuple(f.name for f in dataclasses.fields(Region))
_new = object.__new__


def region(*values: Any) -> Region:
    """Region(*values), made without the frozen dataclass's `__init__` (a `object.__setattr__`
    a field: ~1.6 µs against ~0.5): what registering many regions makes one of a region."""
    r: Region = _new(Region)
    r.__dict__.update(zip(_FIELDS, values))
    return r


class RegionTable:
    """Regions of one agent, searchable by address per memory type."""

    def __init__(self, regions: List[Region]):
        self.regions = list(regions)
        self._by_mem: Dict[str, Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        for mem in {r.mem for r in self.regions}:
            idx = np.array([i for i, r in enumerate(self.regions) if r.mem == mem], dtype=np.int64)
            starts = np.array([self.regions[i].addr for i in idx], dtype=np.uint64)
            order = np.argsort(starts, kind="stable")
            idx, starts = idx[order], starts[order]
            ends = starts + np.array([self.regions[i].size for i in idx], dtype=np.uint64)
            devs = np.array([self.regions[i].dev for i in idx], dtype=np.uint64)
            self._by_mem[mem] = (idx, starts, ends, devs)

    def resolve(self, mem: str, rows: np.ndarray, owner: str, what: str) -> Tuple[np.ndarray, np.ndarray]:
        """(region index, offset in the region's buffer) of each (address, length, device) row;
        nixlNotFoundError naming the first descriptor outside every region of `owner`."""
        n = len(rows)
        addr, length, dev = rows[:, 0], rows[:, 1], rows[:, 2]
        if n and int(length.min()) == 0:
            k = int(np.flatnonzero(length == 0)[0])
            raise nixlInvalidParamError(f"{what}[{k}]: a descriptor of 0 bytes")
        table = self._by_mem.get(mem)
        if table is None:
            raise nixlNotFoundError(f"{what}: {owner} has no {mem} memory registered")
        idx, starts, ends, devs = table
        pos = np.searchsorted(starts, addr, side="right").astype(np.int64) - 1
        safe = np.maximum(pos, 0)
        ok = (pos >= 0) & (addr + length <= ends[safe]) & (addr + length >= addr)
        if mem == "VRAM":
            ok &= devs[safe] == dev
        region = idx[safe]
        for bad in np.flatnonzero(~ok):  # overlapping registrations: any region that holds it
            a, ln, d = int(addr[bad]), int(length[bad]), int(dev[bad])
            hit = [i for i in idx if self.regions[i].addr <= a and a + ln <= self.regions[i].addr + self.regions[i].size
                   and (mem != "VRAM" or self.regions[i].dev == d)]
            if not hit:
                raise nixlNotFoundError(
                    f"{what}[{bad}]: {mem} ({a:#x}, {ln} bytes, device {d}) is not inside any region {owner} registered"
                )
            region[bad] = hit[0]
        bases = np.array([r.addr for r in self.regions], dtype=np.uint64)
        offs = np.array([r.offset for r in self.regions], dtype=np.uint64)
        return region.astype(np.int64), addr - bases[region] + offs[region]
