"""NIXL's test helpers (`nixl._utils`), which its examples and tests allocate and check memory with.

`malloc_passthru(size)` returns the address of `size` bytes of host memory, 4 KiB aligned, as
NIXL's does (aligned_alloc); here the bytes are a memfd mapped shared, so an agent can register
them as DRAM and the daemon maps the same pages (no copy). `free_passthru(addr)` frees them;
`ba_buf(addr, size)` fills them with 0xba; `verify_transfer(a, b, size)` checks two ranges hold
the same bytes (NIXL's C assert; here an AssertionError naming the first differing offset).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from typing import Dict, Tuple

from .._hostmem import MEMFD_FLAGS

#: NIXL's alignment (the storage plugins' O_DIRECT block); mappings are page aligned anyway.
IO_SIZE = 4096

_lock = threading.Lock()
#: What malloc_passthru handed out, by address: the mapping and its memfd (kept open: the agent
#: hands the daemon the memory by that descriptor).
_blocks: Dict[int, Tuple[mmap.mmap, int]] = {}


def malloc_passthru(size: int) -> int:
    """The address of `size` bytes (at least one page mapped) of zeroed host memory an agent can
    register; free it with free_passthru."""
    size = int(size)
    if size < 0:
        raise ValueError(f"size: {size} is negative")
    length = max(IO_SIZE, -(-size // IO_SIZE) * IO_SIZE)
    fd = os.memfd_create("nixl-malloc-passthru", MEMFD_FLAGS)
    try:
        os.ftruncate(fd, length)
        mm = mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    anchor = ctypes.c_char.from_buffer(mm)
    addr = ctypes.addressof(anchor)
    del anchor  # (an export of the mapping: it must not outlive the reference taken here)
    with _lock:
        _blocks[addr] = (mm, fd)
    return addr


def free_passthru(addr: int) -> None:
    """Frees memory malloc_passthru returned (unknown addresses raise ValueError: NIXL's free()
    of a pointer it did not allocate is undefined)."""
    with _lock:
        got = _blocks.pop(int(addr), None)
    if got is None:
        raise ValueError(f"addr: {int(addr):#x} was not returned by malloc_passthru (or was freed already)")
    mm, fd = got
    try:
        mm.close()
    finally:
        os.close(fd)


def ba_buf(addr: int, size: int) -> None:
    """Fills `size` bytes at `addr` with 0xba."""
    ctypes.memset(int(addr), 0xBA, int(size))


def verify_transfer(addr1: int, addr2: int, size: int) -> None:
    """Checks the `size` bytes at `addr1` and at `addr2` are the same; AssertionError otherwise."""
    a = ctypes.string_at(int(addr1), int(size))
    b = ctypes.string_at(int(addr2), int(size))
    if a != b:
        at = next(i for i in range(len(a)) if a[i] != b[i])
        raise AssertionError(f"verify_transfer: the buffers differ at offset {at} ({a[at]:#04x} against {b[at]:#04x})")


__all__ = ["ba_buf", "free_passthru", "malloc_passthru", "verify_transfer"]
