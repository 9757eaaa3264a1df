"""Client host memory without copies: memory of this process's own, handed to the daemon as a file
descriptor over its unix socket and registered as a buffer both processes map (docs/PYTHON.md,
"Host memory you can see").

What can be handed over is memory backed by a file mapped shared: a memfd the package allocates
(`allocate`), a torch CPU tensor after `share_memory_()`, a numpy array or `mmap.mmap` over a memfd or
a file on /dev/shm. `locate` finds the file behind such memory (/proc/self/maps) and a descriptor of it
(the `fd=` given, else one this process holds open, else the file's path). Memory with no file the
daemon could map (anonymous memory: a plain numpy array, a CPU tensor; a private mapping) is
registered by address instead (`register_client_memory`): the daemon reads and writes this process's
pages by cross-memory attach, which needs its ptrace permission (docs/OPERATIONS.md); between nodes
the daemon stages such a buffer's chunks through its lanes' slots. The descriptor travels on a connection of the daemon's local session
(`Registrar`, tcpxd._registrar) as SCM_RIGHTS with its `register_host_fd` frame; the buffer belongs to that connection:
released when it closes (the client's `close()`), or by `release()`.

Shared by the sync client, the asyncio client (which runs `register` in a thread) and sessions (whose
own connection carries the frame and the descriptor; the buffer then goes when the session ends).
"""

from __future__ import annotations

import array
import bisect
import ctypes
import mmap
import os
import stat
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _proto, _reattach
from ._addresses import BY_ADDRESS, address_kinds
from ._registrar import FRAMES, PIPELINE, OldDaemon, Pending, Registrar, registered  # noqa: F401 (re-exported)
from .errors import FailedPrecondition, InvalidArgument, ResourceExhausted, TcpxdError

#: The memfd flags the package allocates with: sealable, so the daemon can seal it against
#: shrinking (F_SEAL_SHRINK) and never fault on a truncated page.
MEMFD_FLAGS = getattr(os, "MFD_CLOEXEC", 1) | getattr(os, "MFD_ALLOW_SEALING", 2)


@dataclass
class Shared:
    """Memory of this process that the daemon can map: `fd` (owned when `close_fd`) and the range
    `[offset, offset + nbytes)` of its file; `view`: the bytes, writable; `keepalive`: what owns
    them (an mmap, an array, a tensor)."""

    fd: int
    close_fd: bool
    offset: int
    nbytes: int
    view: memoryview
    keepalive: Any
    #: A descriptor the client side keeps open while the memory lives (the package's memfd: so a
    #: part of it can be registered again, found in /proc/self/fd).
    kept_fd: Optional[int] = None
    #: Memory with no file to hand over: registered by its address in this process (`fd` is -1).
    address: Optional[int] = None

    def session_op(self, label: str) -> Dict[str, Any]:
        """The SessionRequest field that registers it: by descriptor, or by address."""
        if self.address is not None:
            R = _proto.message("RegisterClientMemoryRequest")
            return {"register_client_memory": R(address=self.address, size=self.nbytes, label=label)}
        return {"register_host_fd": register_request(self, label)}

    @property
    def sent_fd(self) -> Optional[int]:
        """The descriptor that goes with the registration (None: by address)."""
        return None if self.address is not None else self.fd

    def done_sending(self) -> None:
        """The descriptor went out (or failed to): close it if it was opened here."""
        if self.close_fd and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class HostMemory:
    """The client's side of a shared host buffer: its bytes, seen as numpy or torch without a copy."""

    #: How the buffer is registered again after a daemon restart (tcpxd._reattach): its
    #: descriptor (a duplicate kept open) sent anew, or its address in this process.
    again: Optional["_reattach.Again"] = None
    #: By descriptor: (the duplicate kept open, offset, size, label) that `again` sends.
    reattach: Optional[Tuple[int, int, int, str]] = None

    def __init__(self, shared: Shared):
        self._view = shared.view
        self._keepalive = shared.keepalive
        self.nbytes = shared.nbytes
        if shared.kept_fd is not None:
            weakref.finalize(self, os.close, shared.kept_fd)

    def numpy(self) -> Any:
        """The buffer's bytes as a numpy uint8 array aliasing them (writes are the buffer's)."""
        import numpy as np

        return np.frombuffer(self._view, dtype=np.uint8)

    def tensor(self) -> Any:
        """The buffer's bytes as a torch uint8 CPU tensor aliasing them (needs torch)."""
        try:
            import torch
        except ImportError:
            raise FailedPrecondition("tensor(): torch is not installed (numpy() needs only numpy)") from None
        if _is_torch(self._keepalive):
            return self._keepalive.reshape(-1).view(torch.uint8)
        import warnings

        with warnings.catch_warnings():  # "non-writable buffer": the memoryview is writable
            warnings.simplefilter("ignore")
            return torch.frombuffer(self._view, dtype=torch.uint8)


class HostView:
    """What Buffer and AsyncBuffer add for host memory the client shares (`_host`)."""

    _host: Optional[HostMemory]

    @property
    def shared(self) -> bool:
        """Whether this process sees the buffer's memory (`numpy()`, `tensor()`)."""
        return self._host is not None

    def _memory(self) -> HostMemory:
        if self._host is None:
            raise FailedPrecondition(
                "this buffer's memory is the daemon's own (daemon-allocated: a TCP endpoint, shared=False, "
                "or a CUDA buffer), which this process cannot see; use read_bytes()/write_bytes(), or "
                "register host memory over the daemon's unix socket (register_host(size) or an array)"
            )
        return self._host

    def numpy(self) -> Any:
        """The buffer's memory as a numpy uint8 array, no copy: what you write into it is what the
        next transfer from this buffer sends; what a transfer into it lands is there once it finished."""
        return self._memory().numpy()

    def tensor(self) -> Any:
        """The buffer's memory as a torch uint8 CPU tensor, no copy (torch needed for this call only)."""
        return self._memory().tensor()


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "torch" and hasattr(obj, "data_ptr")


def allocate(size: int, label: str) -> Shared:
    """A new memfd of `size` bytes (sealable), its pages allocated now, mapped shared here."""
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise InvalidArgument(f"size: {size!r} is not a positive number of bytes")
    if not hasattr(os, "memfd_create"):
        raise FailedPrecondition("register_host: this platform has no memfd_create (Linux only)")
    fd = os.memfd_create(f"tcpxd:{label}"[:200] if label else "tcpxd", MEMFD_FLAGS)
    try:
        os.ftruncate(fd, size)
        try:
            # Allocated here, charged to this process, failing now (not with SIGBUS at first touch).
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            raise ResourceExhausted(f"size: cannot allocate {size} bytes of shared memory: {e}") from None
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return Shared(fd, False, 0, size, memoryview(mm), mm, kept_fd=fd)


@dataclass
class Mapping:
    """One line of /proc/self/maps."""

    start: int
    end: int
    perms: str
    offset: int
    dev: Tuple[int, int]
    inode: int
    path: str


def mappings() -> List[Mapping]:
    with open("/proc/self/maps") as f:
        return [parse_mapping(line) for line in f]


def parse_mapping(line: str) -> Mapping:
    """One line of /proc/<pid>/maps."""
    parts = line.split(maxsplit=5)
    lo, hi = parts[0].split("-")
    major, minor = parts[3].split(":")
    return Mapping(
        int(lo, 16), int(hi, 16), parts[1], int(parts[2], 16), (int(major, 16), int(minor, 16)),
        int(parts[4]), parts[5].strip() if len(parts) > 5 else "",
    )


def address_of(obj: Any) -> Tuple[int, int, memoryview, Any]:
    """(address, bytes, a writable byte view, what keeps them alive) of a tensor, array or buffer."""
    if _is_torch(obj):
        if getattr(obj, "is_cuda", False) or str(getattr(obj, "device", "cpu")) != "cpu":
            raise InvalidArgument(
                "memory: a CUDA tensor is not host memory; register it with register_tensor(tensor) "
                "(the daemon imports it by CUDA IPC handle)"
            )
        if not obj.is_contiguous():
            raise InvalidArgument("memory: the tensor is not contiguous; register tensor.contiguous() (one byte range)")
        nbytes = obj.numel() * obj.element_size()
        view = memoryview(obj.detach().reshape(-1).view(__import__("torch").uint8).numpy())
        return int(obj.data_ptr()), nbytes, view, obj
    if isinstance(obj, (bytes, str)):
        raise InvalidArgument(f"memory: a {type(obj).__name__} is read-only; give a size, an array, a tensor or an mmap")
    if hasattr(obj, "__array_interface__"):
        ai = obj.__array_interface__
        if ai.get("data", (0, True))[1]:
            raise InvalidArgument("memory: the array is read-only; transfers write into a buffer")
        flags = getattr(obj, "flags", None)
        if flags is not None and not flags["C_CONTIGUOUS"]:
            raise InvalidArgument("memory: the array is not C-contiguous; register one contiguous byte range")
    try:
        view = memoryview(obj)
    except TypeError:
        raise InvalidArgument(
            f"memory: a {type(obj).__name__} is neither a size nor memory (give a size in bytes, a numpy array, "
            "a torch CPU tensor or an mmap.mmap)"
        ) from None
    if view.readonly:
        raise InvalidArgument("memory: the buffer is read-only; transfers write into a buffer")
    if not view.c_contiguous:
        raise InvalidArgument("memory: not contiguous; register one contiguous byte range")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if view.nbytes == 0:
        raise InvalidArgument("memory: 0 bytes")
    if isinstance(obj, ctypes.Array):  # (tcpxd.nixl's raw addresses)
        return ctypes.addressof(obj), view.nbytes, view, obj
    c = (ctypes.c_char * view.nbytes).from_buffer(view)
    addr = ctypes.addressof(c)
    del c
    return addr, view.nbytes, view, obj


class Locator:
    """What `locate` reads about this process, read once for many memories: /proc/self/maps, and
    which read-write descriptor this process holds of each file (one scan of /proc/self/fd)."""

    def __init__(self) -> None:
        #: /proc/self/maps's lines (in address order, as the kernel writes them), each parsed
        #: when first looked at: most registrations look at one or two of hundreds.
        self._lines: Optional[List[str]] = None
        self._parsed: Dict[int, Mapping] = {}
        self._starts: List[int] = []
        self._held: Optional[Dict[Tuple[int, Tuple[int, int]], int]] = None

    def _load(self) -> List[str]:
        if self._lines is None:
            with open("/proc/self/maps") as f:
                self._lines = f.read().splitlines()
            self._starts = [int(line[: line.index("-")], 16) for line in self._lines]
        return self._lines

    def count(self) -> int:
        return len(self._load())

    def mapping(self, i: int) -> Mapping:
        """The `i`-th mapping, in address order."""
        m = self._parsed.get(i)
        if m is None:
            m = self._parsed[i] = parse_mapping(self._load()[i])
        return m

    def at(self, addr: int) -> int:
        """The index of the mapping holding `addr` (binary search), -1 for none."""
        self._load()
        i = bisect.bisect_right(self._starts, addr) - 1
        return i if i >= 0 and addr < self.mapping(i).end else -1

    def descriptor(self, m: Mapping) -> Optional[Tuple[int, bool]]:
        """A read-write descriptor of the mapping's file: one this process holds (found by one
        scan for all the memories), else the file opened by path; (fd, whether opened here)."""
        if self._held is None:
            self._held = {}
            for fd in _held_descriptors():
                try:
                    st = os.fstat(fd)
                except OSError:  # (closed meanwhile: by another thread, or a finalizer)
                    continue
                self._held.setdefault((st.st_ino, (os.major(st.st_dev), os.minor(st.st_dev))), fd)
        held = self._held.get((m.inode, m.dev))
        if held is not None:
            fd = held
            try:
                st = os.fstat(fd)
                if (st.st_ino, (os.major(st.st_dev), os.minor(st.st_dev))) == (m.inode, m.dev):  # still that file
                    return fd, False
            except OSError:
                pass
        return _open_by_path(m)


def locate(obj: Any, fd: Optional[int], where: Optional[Locator] = None) -> Shared:
    """The file behind `obj`'s memory, a descriptor of it, and where in it the memory starts
    (`where`: what is known of this process's mappings and descriptors already)."""
    addr, nbytes, view, keep = address_of(obj)
    if fd is None and where is None and address_kinds(array.array("Q", (addr,)))[0] == BY_ADDRESS:
        # Anonymous or private memory, known without reading all of /proc/self/maps.
        return Shared(-1, False, 0, nbytes, view, keep, address=addr)
    where = where if where is not None else Locator()
    at = where.at(addr)
    if at < 0:
        raise InvalidArgument("memory: its address is not mapped in this process")
    first = where.mapping(at)
    # The range may span several mappings of the same file, back to back.
    covered, last = first.end, first
    for i in range(at + 1, where.count()):
        if covered >= addr + nbytes:
            break
        m = where.mapping(i)
        if m.start == covered and m.inode == first.inode and m.dev == first.dev and m.offset == last.offset + (last.end - last.start):
            covered, last = m.end, m
    if first.inode == 0 or first.path.startswith("[") or "s" not in first.perms or covered < addr + nbytes:
        # Anonymous memory (a plain numpy array, a torch tensor not in shared memory), a private
        # mapping (the daemon's own mapping would not see this process's writes) or a range over
        # several mappings: no one file to hand over. Registered by address (cross-memory attach).
        if fd is not None:
            raise InvalidArgument("fd: this memory is not one shared mapping of a file; register it without fd=")
        return Shared(-1, False, 0, nbytes, view, keep, address=addr)
    offset = first.offset + (addr - first.start)
    if fd is not None:
        st = os.fstat(fd)
        if (st.st_ino, (os.major(st.st_dev), os.minor(st.st_dev))) != (first.inode, first.dev):
            raise InvalidArgument("fd: not the file this memory is mapped from")
        return Shared(fd, False, offset, nbytes, view, keep)
    found = where.descriptor(first)
    if found is None:
        raise FailedPrecondition(
            f"memory: mapped from {first.path or 'a file'}, which this process no longer holds open; pass fd= "
            "(a descriptor of the file, open for reading and writing)"
        )
    return Shared(found[0], found[1], offset, nbytes, view, keep)


def _held_descriptors() -> List[int]:
    """The regular files this process holds open for reading and writing."""
    import fcntl

    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = int(name)
            if stat.S_ISREG(os.fstat(fd).st_mode) and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR:
                out.append(fd)
        except (ValueError, OSError):
            continue
    return out


def _open_by_path(m: Mapping) -> Optional[Tuple[int, bool]]:
    """The mapping's file opened by its path, read-write; (fd, True) or None."""
    if m.path and not m.path.endswith("(deleted)"):
        try:
            fd = os.open(m.path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return None
        st = os.fstat(fd)
        if st.st_ino == m.inode:
            return fd, True
        os.close(fd)
    return None


def register_request(shared: Shared, label: str) -> Any:
    return _proto.message("RegisterHostFdRequest")(offset=shared.offset, size=shared.nbytes, label=label)


def no_unix_socket(endpoint: str) -> TcpxdError:
    return FailedPrecondition(
        f"register_host: host memory is handed to the daemon as a file descriptor over its unix socket, and "
        f"{endpoint} is not one (a TCP endpoint cannot carry descriptors): connect to unix:/path on the daemon's "
        "node, or let the daemon allocate the buffer (register_host(size, shared=False)) and use "
        "write_bytes()/read_bytes()"
    )


def prepare(memory: Any, label: str, fd: Optional[int]) -> Shared:
    """What `register_host(memory)` hands over: a new memfd for a size, else the memory given."""
    if isinstance(memory, int) and not isinstance(memory, bool):
        if fd is not None:
            raise InvalidArgument("fd: only with memory to register (an array, tensor or mmap), not a size")
        return allocate(memory, label)
    return locate(memory, fd)


def register_many(
    registrar: Optional[Registrar], endpoint: str, memories: Sequence[Any], lists: Sequence[Sequence[Any]], label: str,
    timeout: Optional[float],
) -> List[Any]:
    """Shares each memory of this process (not sizes) with the daemon, with the block lists
    (StridedBlocks) asked for each: per memory, (its Buffer message, this side of it), or the
    TcpxdError that refused it (nothing registered for it). One read of this process's mappings
    and descriptors for all of them; their registrations pipelined on the registrar's connection."""
    if registrar is None:
        raise no_unix_socket(endpoint)
    prepared, hosts = prepare_many(memories, label)
    todo = [(i, p) for i, p in enumerate(prepared) if isinstance(p, Shared)]
    answers = registrar.register_many([(p, lists[i]) for i, p in todo], label, timeout)
    out: List[Any] = list(prepared)
    for (i, _), ans in zip(todo, answers):
        out[i] = ans if isinstance(ans, TcpxdError) else (ans, hosts[i])
    return out


def prepare_many(memories: Sequence[Any], label: str) -> Tuple[List[Any], Dict[int, HostMemory]]:
    """What `register_many` hands over: per memory its Shared (or the TcpxdError saying why it
    cannot be), and this side of each (HostMemory, by index; a duplicate of the descriptor kept
    to register it again after a restart). One read of this process's mappings and descriptors."""
    where = Locator()
    prepared: List[Any] = []
    for memory in memories:
        try:
            prepared.append(locate(memory, None, where))
        except TcpxdError as e:
            prepared.append(e)
    hosts = {i: HostMemory(p) for i, p in enumerate(prepared) if isinstance(p, Shared)}
    for i, h in hosts.items():
        p = prepared[i]
        if p.address is None:
            h.reattach = (_reattach.keep_fd(p.fd, h), p.offset, p.nbytes, label)
    return prepared, hosts


def daemon_allocates(memory: Any, shared: Optional[bool], registrar: Optional[Registrar]) -> bool:
    """Whether `register_host(memory, shared=...)` is the daemon-allocated kind (RegisterBuffer), as
    far as known without connecting: a size with shared=False, or with shared=None where no
    descriptor can pass (a TCP endpoint, a daemon found to predate the local session)."""
    sized = isinstance(memory, int) and not isinstance(memory, bool)
    cannot = registrar is None or registrar.available is False
    return sized and (shared is False or (shared is None and cannot))


def register(
    registrar: Optional[Registrar],
    endpoint: str,
    memory: Any,
    label: str,
    fd: Optional[int],
    timeout: Optional[float],
    shared: Optional[bool] = None,
) -> Optional[Tuple[Any, HostMemory]]:
    """Shares `memory` (a size: a new memfd) with the daemon: its Buffer message, and this side of it;
    None for a size with shared=None when the daemon predates the local session (the caller has it
    allocate the buffer instead). Blocking (the asyncio client runs it in a thread)."""
    if registrar is None:
        raise no_unix_socket(endpoint)
    sized = isinstance(memory, int) and not isinstance(memory, bool)
    if sized and shared is None and not registrar.speaks_local():
        return None
    mem = prepare(memory, label, fd)
    host = HostMemory(mem)
    # What a restarted daemon is handed again (tcpxd._reattach): a duplicate of the descriptor,
    # kept while the memory lives, or the same address of this process (the daemon checks that
    # the request comes from the process it was registered by).
    if mem.address is None:
        host.reattach = (_reattach.keep_fd(mem.fd, host), mem.offset, mem.nbytes, label)
        host.again = _reattach.host_fd_again(*host.reattach)
    else:
        host.again = _reattach.client_memory_again(mem.address, mem.nbytes, label)
    return registrar.register(mem, label, timeout), host
