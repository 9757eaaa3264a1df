"""Memory registered by address, many regions at a time (tcpxd._addresses): which kind of mapping
holds an address, asked of the kernel (PROCMAP_QUERY, through the C extension) or read from
/proc/self/maps, the two agreeing; a register_batch's entries written from addresses and one
serialized request a size, the C and the Python writer giving the same bytes, which protobuf
reads back as the requests they stand for."""

from __future__ import annotations

import mmap
import os
import tempfile

import numpy as np
import pytest

from tcpxd import _addresses, _hostmem, _proto
from tcpxd._native_gate import native


def _writers():
    return [("python", None)] + ([("native", native)] if native is not None else [])


@pytest.fixture
def memories():
    anon = np.ones(1 << 20, np.uint8)
    fd = os.memfd_create("tcpxd-test-addresses", os.MFD_CLOEXEC)
    os.ftruncate(fd, 1 << 16)
    shared = mmap.mmap(fd, 1 << 16, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    shared_view = np.frombuffer(shared, np.uint8)
    with tempfile.TemporaryFile() as f:
        f.truncate(1 << 16)
        private = mmap.mmap(f.fileno(), 1 << 16, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        private_view = np.frombuffer(private, np.uint8)
        yield {
            "anonymous": (int(anon.ctypes.data), _addresses.BY_ADDRESS),
            "anonymous, inside": (int(anon.ctypes.data) + 12345, _addresses.BY_ADDRESS),
            "memfd, shared": (int(shared_view.ctypes.data), _addresses.FILE_SHARED),
            "file, private": (int(private_view.ctypes.data), _addresses.BY_ADDRESS),
            "unmapped": (8, _addresses.UNMAPPED),
        }
        del private_view
        private.close()
    del shared_view
    shared.close()
    os.close(fd)


@pytest.mark.parametrize("name,ext", _writers())
def test_address_kinds_name_each_mapping_with_or_without_the_kernel_query(memories, monkeypatch, name, ext):
    monkeypatch.setattr(_addresses, "_native", ext)
    monkeypatch.setattr(_addresses, "_procmap", None)
    names = list(memories)
    got = _addresses.address_kinds([memories[n][0] for n in names])
    assert {n: got[i] for i, n in enumerate(names)} == {n: memories[n][1] for n in names}


def test_locate_registers_anonymous_memory_by_address_without_reading_the_maps(memories, monkeypatch):
    a = np.zeros(4096, np.uint8)

    def no_maps(self):
        raise AssertionError("/proc/self/maps read")

    if native is not None and _addresses.address_kinds([int(a.ctypes.data)]) == bytes([0]) and _addresses._procmap:
        monkeypatch.setattr(_hostmem.Locator, "_load", no_maps)
    shared = _hostmem.locate(a, None)
    assert (shared.address, shared.nbytes, shared.fd) == (int(a.ctypes.data), 4096, -1)


@pytest.mark.parametrize("name,ext", _writers())
def test_address_entries_are_the_requests_protobuf_reads_back(monkeypatch, name, ext):
    monkeypatch.setattr(_addresses, "_native", ext)
    S = _proto.message("StridedBlocks")
    lists = [S(first=0, stride=4096, length=4096, count=256), S(first=0, stride=512, length=512, count=2048)]
    tails = {1 << 20: _addresses.address_tail(1 << 20, "", lists), 5: _addresses.address_tail(5, "a label " * 30, [])}
    addrs = np.array([0x7F00_1234_5000, 1, (1 << 64) - 1, 0x80], np.uint64)
    sizes = [1 << 20, 5, 1 << 20, 5]
    body = _addresses.address_entries(addrs, [tails[n] for n in sizes])
    batch = _proto.message("RegisterBatchRequest").FromString(body)
    assert [e.WhichOneof("memory") for e in batch.entries] == ["client_memory"] * 4
    got = [(e.client_memory.address, e.client_memory.size, e.client_memory.label, list(e.client_memory.block_lists))
           for e in batch.entries]
    want = [(int(a), n, "" if n > 5 else "a label " * 30, lists if n > 5 else []) for a, n in zip(addrs, sizes)]
    assert got == want
    if native is not None and ext is None:  # the two writers, byte for byte
        monkeypatch.setattr(_addresses, "_native", native)
        assert _addresses.address_entries(addrs, [tails[n] for n in sizes]) == body


def test_a_region_made_in_bulk_is_the_dataclass_made_by_its_init():
    from tcpxd.nixl._regions import Region, region

    values = (0x7F00_0000_1000, 1 << 20, 0, "DRAM", "tcpxd1:n:7:1048576:00", 0, 7, 4096, "t", 256, 3, 512, "f", 2048, 4)
    fast, slow = region(*values), Region(*values)
    assert fast == slow and hash(fast) == hash(slow) and repr(fast) == repr(slow)
    assert fast.tiling(True) == (512, 2048, 4, "f") and fast.to_json() == slow.to_json()
    with pytest.raises(AttributeError):
        fast.addr = 0  # type: ignore[misc]
