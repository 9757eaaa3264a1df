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
(`Registrar`) as SCM_RIGHTS with its `register_host_fd` frame; the buffer belongs to that connection:
released when it closes (the client's `close()`), or by `release()`.

Shared by the sync client, the asyncio client (which runs `register` in a thread) and sessions (whose
own connection carries the frame and the descriptor; the buffer then goes when the session ends).
"""

from __future__ import annotations

import array
import bisect
import contextlib
import ctypes
import mmap
import os
import socket
import stat
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from . import _local, _proto, _reattach
from ._addresses import BY_ADDRESS, _varint, address_entries, address_kinds
from .errors import FailedPrecondition, InvalidArgument, ResourceExhausted, TcpxdError, Unavailable, from_status

#: Registrations sent before their answers are read (`Registrar.register_many`): few enough that
#: their answers fit the socket's buffer, so neither side blocks on the other.
PIPELINE = 64
#: `register_batch` and `release_batch` frames of memory by address sent before the first
#: answer is read (`Registrar.register_addresses`, `release_many`): the daemon carries out the
#: next while this process reads the last; their answers (~20 KB a registration frame) fit the
#: socket's buffer together.
FRAMES = 4

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
                st = os.fstat(fd)
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


def registered(ev: Any, tag: int) -> Any:
    """The Buffer message the daemon's answer carries; raises its refusal."""
    kind = ev.WhichOneof("event")
    if kind == "refused":
        raise from_status(ev.refused.code, ev.refused.message)
    if ev.tag != tag or kind != "registered":
        raise TcpxdError(f"local session: the daemon answered tag {ev.tag} ({kind}) to registration {tag}")
    return ev.registered


def _registered_each(conn: _local.Connection, tags: Sequence[int]) -> List[Any]:
    """The answers to registrations sent as `tags`, in order: each one's Buffer message, or the
    TcpxdError refusing it."""
    out: List[Any] = []
    for tag in tags:
        try:
            out.append(registered(conn.receive(), tag))
        except TcpxdError as e:
            out.append(e)
    return out


def no_unix_socket(endpoint: str) -> TcpxdError:
    return FailedPrecondition(
        f"register_host: host memory is handed to the daemon as a file descriptor over its unix socket, and "
        f"{endpoint} is not one (a TCP endpoint cannot carry descriptors): connect to unix:/path on the daemon's "
        "node, or let the daemon allocate the buffer (register_host(size, shared=False)) and use "
        "write_bytes()/read_bytes()"
    )


def _unreleased(n: int) -> List[Any]:
    """What release_many answers for ids it did not get to release."""
    return [FailedPrecondition("release: not released by a batch") for _ in range(n)]


class _Known:
    available: Optional[bool] = None


class OldDaemon(FailedPrecondition):
    """The daemon does not speak the local session: it cannot take host memory by descriptor."""


class Registrar:
    """The client's connection for registering its host memory: one local session of its own, kept
    open while the client lives (the daemon releases the buffers registered on it when it closes),
    one registration at a time."""

    def __init__(self, path: str, known: Any = None):
        self.path = path
        self._lock = threading.Lock()
        self._conn: Optional[_local.Connection] = None
        self._closed = False
        self._pid = os.getpid()
        #: False once the daemon turned out not to know `register_batch` (registrations then go
        #: one request each, pipelined).
        self._batches: Optional[bool] = None
        #: What the client found out about the daemon's local session (`available`): its pool of
        #: local sessions, shared so the daemon is asked once; else this registrar's own.
        self._known = known if known is not None else _Known()

    @property
    def available(self) -> Optional[bool]:
        """False once the daemon turned out not to speak the local session (it predates it)."""
        return self._known.available

    @available.setter
    def available(self, value: Optional[bool]) -> None:
        self._known.available = value

    @contextlib.contextmanager
    def _talking(self, what: str, timeout: Optional[float]) -> Iterator[None]:
        """The local session's silence or end while doing `what` (`register_host`, `release`): the
        connection is dropped (the next call opens one) and Unavailable says which."""
        try:
            yield
        except socket.timeout:
            self._drop()
            raise Unavailable(f"{what}: no answer from the daemon at {self.path} within {timeout} s") from None
        except (_local.Gone, OSError) as e:
            self._drop()
            raise Unavailable(f"{what}: the local session with {self.path} ended: {e!r}") from None

    def register(self, shared: Shared, label: str, timeout: Optional[float]) -> Any:
        """Registers the memory; returns the daemon's Buffer message."""
        try:
            with self._lock:
                conn = self._connection()
                with self._talking("register_host", timeout):
                    [(field, req)] = shared.session_op(label).items()
                    ev = conn.exchange(field, req, timeout, fd=shared.sent_fd)
                return registered(ev, conn.tag)
        finally:
            shared.done_sending()

    def register_many(self, items: Sequence[Tuple[Shared, Sequence[Any]]], label: str, timeout: Optional[float]) -> List[Any]:
        """Registers each memory with its block lists (StridedBlocks, made by the daemon on the new
        buffer): the daemon's Buffer message, or the TcpxdError refusing it, per memory in order.
        PIPELINE at a time go in one `register_batch` frame, their descriptors with it; to a
        daemon without it, PIPELINE requests go out before their answers are read (one round trip
        for each PIPELINE, not each memory, either way)."""
        out: List[Any] = []
        try:
            with self._lock:
                conn = self._connection()
                with self._talking("register_host", timeout):
                    start = 0
                    while self._batches is not False and start < len(items):
                        got = self._batch(conn, items[start : start + PIPELINE], label, timeout)
                        if got is None:
                            self._batches = False  # the daemon predates register_batch
                            break
                        out.extend(got)
                        start += len(got)
                    for at in range(start, len(items), PIPELINE):
                        tags = []
                        for shared, lists in items[at : at + PIPELINE]:
                            [(field, req)] = shared.session_op(label).items()
                            req.block_lists.extend(lists)
                            try:
                                if not conn.send(field, req, timeout, fd=shared.sent_fd):
                                    raise InvalidArgument("register_host: the registration is too large for a frame")
                            finally:
                                shared.done_sending()
                            tags.append(conn.tag)
                        out.extend(_registered_each(conn, tags))
                return out
        finally:
            for shared, _ in items:
                shared.done_sending()

    def _batch(self, conn: _local.Connection, items: Sequence[Tuple[Shared, Sequence[Any]]], label: str,
               timeout: Optional[float]) -> Optional[List[Any]]:
        """One `register_batch` of `items`: per memory, its Buffer message or the TcpxdError
        refusing it; None when the daemon does not know the request (it refused the frame's op)."""
        entry = _proto.message("RegisterBatchEntry")
        entries, fds = [], []
        for shared, lists in items:
            [(field, req)] = shared.session_op(label).items()
            req.block_lists.extend(lists)
            entries.append(entry(**{"host_fd" if field == "register_host_fd" else "client_memory": req}))
            if shared.sent_fd is not None:
                fds.append(shared.sent_fd)
        batch = _proto.message("RegisterBatchRequest")(entries=entries)
        try:
            if not conn.send("register_batch", batch, timeout, fds=fds):
                raise InvalidArgument("register_host: the registrations are too large for a frame")
        finally:
            for shared, _ in items:
                shared.done_sending()
        return _batch_answer(conn, len(items), conn.tag)

    def register_addresses(self, addrs: Any, tails: Sequence[bytes], timeout: Optional[float]) -> List[Any]:
        """Registers memory of this process by address, region i at `addrs[i]` (a numpy u64
        array) with the rest of its request serialized in `tails[i]` (`address_tail`): per
        region, the daemon's Buffer message or the TcpxdError refusing it. As `register_many`,
        PIPELINE to a `register_batch` frame, its entries written without a message object each
        (`address_entries`); to a daemon without it, one request each, pipelined."""
        out: List[Any] = []
        n = len(tails)
        with self._lock:
            conn = self._connection()
            with self._talking("register_host", timeout):
                start = 0
                sent: List[Tuple[int, int, int]] = []  # (first region, end, tag) of frames unanswered
                B = _proto.message("RegisterBatchRequest")
                while self._batches is not False and (start < n or sent):
                    while start < n and len(sent) < FRAMES:
                        end = min(n, start + PIPELINE)
                        batch = B.FromString(address_entries(addrs[start:end], list(tails[start:end])))
                        if not conn.send("register_batch", batch, timeout):
                            raise InvalidArgument("register_host: the registrations are too large for a frame")
                        sent.append((start, end, conn.tag))
                        start = end
                    first, end, tag = sent.pop(0)
                    got = _batch_answer(conn, end - first, tag)
                    if got is None:  # the daemon predates register_batch: it refuses every frame
                        for _ in sent:
                            _batch_answer(conn, 0, 0)
                        self._batches, start = False, first
                        break
                    out.extend(got)
                R = _proto.message("RegisterClientMemoryRequest")
                for at in range(start, n, PIPELINE):
                    tags = []
                    for j in range(at, min(n, at + PIPELINE)):
                        req = R.FromString(b"\x08" + _varint(int(addrs[j])) + tails[j])
                        if not conn.send("register_client_memory", req, timeout):
                            raise InvalidArgument("register_host: the registration is too large for a frame")
                        tags.append(conn.tag)
                    out.extend(_registered_each(conn, tags))
        return out


    def release_many(self, ids: Sequence[int], timeout: Optional[float]) -> Optional[List[Any]]:
        """Releases buffers registered on this connection, PIPELINE to a `release_batch` (FRAMES
        of them sent before the first answer is read): per id,
        None (released) or the TcpxdError the daemon answered (a buffer a transfer still uses is
        not released: FailedPrecondition); None for all when the daemon does not know the request
        or no connection is open (the caller releases them one by one)."""
        if self._batches is False or not ids:
            return None
        out: List[Any] = []
        with self._lock:
            if self._conn is None or self._pid != os.getpid():
                return None
            conn = self._conn
            R = _proto.message("ReleaseBatchRequest")
            with self._talking("release", timeout):
                at = 0
                sent: List[Tuple[int, int]] = []  # (ids in the frame, its tag), unanswered
                while at < len(ids) or sent:
                    while at < len(ids) and len(sent) < FRAMES:
                        chunk = list(ids[at : at + PIPELINE])
                        if not conn.send("release_batch", R(buffer_ids=chunk), timeout):
                            raise InvalidArgument("release: the ids are too large for a frame")
                        sent.append((len(chunk), conn.tag))
                        at += len(chunk)
                    count, tag = sent.pop(0)
                    ev = conn.receive()
                    kind = ev.WhichOneof("event")
                    if kind == "refused" and ev.refused.code == 3 and ev.refused.message.startswith("op: set one of"):
                        for _ in sent:  # (refused likewise)
                            conn.receive()
                        self._batches = False  # the daemon predates release_batch
                        return out + _unreleased(len(ids) - len(out)) if out else None
                    if kind != "released_batch" or ev.tag != tag or len(ev.released_batch.statuses) != count:
                        raise TcpxdError(f"local session: the daemon answered tag {ev.tag} ({kind}) to release {tag}")
                    out.extend(None if st.code == 0 else from_status(st.code, st.message) for st in ev.released_batch.statuses)
        return out

    def register_fd(self, fd: int, req: Any, timeout: Optional[float]) -> Any:
        """Sends `req` (a RegisterHostFdRequest) with `fd` (kept open: the caller's); returns the
        daemon's Buffer message. A re-attach after a restart goes this way."""
        with self._lock:
            conn = self._connection()
            with self._talking("register_host", timeout):
                ev = conn.exchange("register_host_fd", req, timeout, fd=fd)
            return registered(ev, conn.tag)

    def register_by_address(self, req: Any, timeout: Optional[float]) -> Any:
        """Sends `req` (a RegisterClientMemoryRequest); returns the daemon's Buffer message. A
        re-attach after a restart goes this way."""
        with self._lock:
            conn = self._connection()
            with self._talking("register_host", timeout):
                ev = conn.exchange("register_client_memory", req, timeout)
            return registered(ev, conn.tag)

    def reset(self) -> None:
        """Forgets the connection (the daemon it went to is gone): the next registration opens one."""
        with self._lock:
            self._drop()

    def _connection(self) -> _local.Connection:
        if self._closed:
            raise TcpxdError("the client is closed")
        if self._pid != os.getpid():  # a forked child: the parent's connection is not ours
            if self._conn is not None:
                self._conn.close()
            self._conn, self._pid = None, os.getpid()
        if self._conn is None:
            try:
                if self.available is False:
                    raise _local.NotLocal("found out before")
                conn = _local.handshake(self.path)
            except _local.NotLocal as e:
                self.available = False
                raise OldDaemon(
                    f"register_host: the daemon at {self.path} does not speak the local session ({e}); "
                    "it predates host memory registration: upgrade it, or use register_host(size, shared=False)"
                ) from None
            if conn is None:
                raise Unavailable(f"register_host: nothing answers at {self.path}")
            self._conn, self.available = conn, True
        return self._conn

    def speaks_local(self) -> bool:
        """Whether the daemon speaks the local session (connects to find out, once)."""
        if self.available is None:
            try:
                with self._lock:
                    self._connection()
            except OldDaemon:
                pass
        return self.available is not False

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        """Closes the connection: the daemon releases the buffers registered on it."""
        with self._lock:
            self._closed = True
            self._drop()


def _batch_answer(conn: _local.Connection, n: int, tag: int) -> Optional[List[Any]]:
    """The answer to the `register_batch` of `n` registrations sent with `tag`: per registration,
    its Buffer message or the TcpxdError refusing it; None when the daemon does not know the
    request."""
    ev = conn.receive()
    kind = ev.WhichOneof("event")
    if kind == "refused":
        if ev.refused.code == 3 and ev.refused.message.startswith("op: set one of"):  # INVALID_ARGUMENT
            return None
        raise from_status(ev.refused.code, ev.refused.message)
    if ev.tag != tag or kind != "registered_batch":
        raise TcpxdError(f"local session: the daemon answered tag {ev.tag} ({kind}) to registration {tag}")
    got = ev.registered_batch
    if len(got.buffers) != n or len(got.statuses) != n:
        raise TcpxdError(f"local session: the daemon answered {len(got.buffers)} registrations of {n}")
    return [b if st.code == 0 else from_status(st.code, st.message) for b, st in zip(got.buffers, got.statuses)]


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
    where = Locator()
    prepared: List[Any] = []
    for memory in memories:
        try:
            prepared.append(locate(memory, None, where))
        except TcpxdError as e:
            prepared.append(e)
    todo = [(i, p) for i, p in enumerate(prepared) if isinstance(p, Shared)]
    hosts = {i: HostMemory(p) for i, p in todo}
    for i, p in todo:
        if p.address is None:
            hosts[i].reattach = (_reattach.keep_fd(p.fd, hosts[i]), p.offset, p.nbytes, label)
    answers = registrar.register_many([(p, lists[i]) for i, p in todo], label, timeout)
    out: List[Any] = list(prepared)
    for (i, _), ans in zip(todo, answers):
        out[i] = ans if isinstance(ans, TcpxdError) else (ans, hosts[i])
    return out


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
