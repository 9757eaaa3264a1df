"""Registrations across a daemon restart (docs/PYTHON.md, "When the daemon restarts").

A daemon with a state directory (`runtime.state_dir`) keeps, across a restart, the ids and keys of
what was registered with it, for `reattach_grace_s` seconds: its new instance (a new
`instance_id` in DescribeNode) takes each back from the client that presents it. `Reattacher` is
that client side, one per `Client`: it remembers what the client registered that only the client
can give back (host memory by file descriptor, CUDA memory by IPC handle, block lists, prepared
lists), watches the daemon (the health service's Watch stream, which ends when the process
does), and once a new instance answers, registers each again under its old id and key. Descriptors
and block-list tokens handed out before then work again, unchanged, on every node that holds them.

What the daemon allocated in host memory comes back by itself (its bytes kept in the state
directory); what it allocated on a GPU too where its descriptor is kept (systemd's store or `tcpxd
fd-keeper`: docs/OPERATIONS.md, "Restarts"), else it does not outlive the daemon.
Transfers in flight at the restart fail (UNAVAILABLE, within their deadline); the next ones
succeed once the re-attach is done (`wait()` waits for it).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Tuple

import grpc

from . import _ops, _proto
from .errors import TcpxdError

if TYPE_CHECKING:
    from .client import Client

log = logging.getLogger("tcpxd")

#: How often a daemon that does not answer is asked again while it restarts.
POLL_S = 0.05
#: One DescribeNode's deadline while the daemon restarts.
ASK_S = 2.0
_WATCH = "/grpc.health.v1.Health/Watch"
#: grpc.health.v1.HealthCheckRequest{service: "tcpxd.v1.Tcpxd"}: the API's own status, which the
#: daemon sets NOT_SERVING as it starts stopping.
_WATCH_API = b"\n\x0etcpxd.v1.Tcpxd"
#: grpc.health.v1.HealthCheckResponse{status: SERVING}, as the Watch stream sends it.
_SERVING = b"\x08\x01"


def descriptor_key(descriptor: str) -> bytes:
    """The access key a descriptor carries (`tcpxd1:node:id:size:key[@...]`)."""
    return bytes.fromhex(descriptor.split("@", 1)[0].split(":")[4])


class Reattacher:
    """What one client registered that it re-attaches to a restarted daemon. Thread-safe. `rpc`
    (the asyncio client's): makes the synchronous client its watch and re-registrations use,
    on first need; by default they use `client` itself."""

    def __init__(self, client: Any, rpc: Optional[Callable[[], "Client"]] = None):
        self._owner = weakref.ref(client)
        self._make_rpc = rpc
        self._rpc: Optional["Client"] = None
        self._lock = threading.Lock()
        #: Buffers, block lists and prepared lists by id, with how to register each again.
        self._buffers: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
        self._again: Dict[Tuple[str, int], "Again"] = {}
        self._lists: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
        self._prepared: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
        #: Memory registered by address together (tcpxd._addresses.AddressBatch), one entry a
        #: batch: registered again after the buffers, with its lists.
        self._batches: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()
        self._batch_ids = 0
        #: The block lists of each buffer (they go with it).
        self._lists_of: Dict[int, Set[int]] = {}
        #: The daemon instance the registrations belong to (None: not asked yet).
        self.instance: Optional[str] = None
        #: Re-attaches done (a test or a tool can watch it).
        self.restarts = 0
        #: Buffers tracked so far (how often _prune looks).
        self._tracked = 0
        #: Held while a new instance is asked about and re-attached (the watch and sync()).
        self._recovering = threading.Lock()
        self._ready = threading.Event()
        self._ready.set()
        self._thread: Optional[threading.Thread] = None
        self._call: Any = None
        self._channel: Any = None
        self._metadata: Any = None
        self._closed = False
        self._pid = os.getpid()

    # -- what is tracked

    def _prune(self) -> None:
        """Forgets buffers whose objects are gone (with the lock held; now and then): without
        the object there is no descriptor of the memory to hand over again. Looked at once
        every 64 new buffers, so that tracking many stays linear."""
        self._tracked += 1
        if self._tracked % 64:
            return
        live = len(self._buffers) + len(self._again_lists)
        if len(self._again) > 2 * live + 64:
            self._again = {k: v for k, v in self._again.items() if k[0] != "b" or k[1] in self._buffers}

    @property
    def _again_lists(self) -> List[Tuple[str, int]]:
        return [k for k in self._again if k[0] != "b"]

    def track_buffer(self, buf: Any, again: "Again") -> None:
        """`again(buf, rpc)` registers `buf` again under its id and key (after a restart), while
        the object lives (it holds what the memory is handed over by)."""
        self._start()
        with self._lock:
            self._prune()
            self._buffers[buf.id] = buf
            self._again[("b", buf.id)] = again

    def track_list(self, bl: Any, req: Any) -> None:
        """A block list, registered again by `req` until it or its buffer is released (the
        daemon keeps it that long, whether or not the object lives on here)."""
        self.track_list_id(int(bl.id), req)
        with self._lock:
            self._lists[bl.id] = bl  # kept up to date while it lives

    def track_list_id(self, list_id: int, req: Any) -> None:
        self._start()
        with self._lock:
            self._again[("l", list_id)] = _list_again(req, list_id)
            self._lists_of.setdefault(int(req.buffer_id), set()).add(list_id)

    def track_batch(self, batch: Any) -> int:
        """An AddressBatch, registered again (its buffers, then their lists) while it lives and
        holds any; returns the number `forget("a", n)` takes."""
        self._start()
        with self._lock:
            self._batch_ids += 1
            n = self._batch_ids
            self._batches[n] = batch
            self._again[("a", n)] = _batch_again
        return n

    def track_prepared(self, p: Any, req: Any) -> None:
        """A prepared list, registered again by `req` until released."""
        self._start()
        with self._lock:
            self._prepared[p.id] = p
            self._again[("p", p.id)] = _prepared_again(req, int(p.id))

    def forget(self, kind: str, id: int) -> None:
        """`kind` ("b", "l", "p") `id` was released: not registered again (a buffer's lists
        neither: they went with it)."""
        with self._lock:
            self._again.pop((kind, id), None)
            if kind == "b":
                for lid in self._lists_of.pop(id, ()):
                    self._again.pop(("l", lid), None)

    def sync(self) -> None:
        """Re-attaches now if the daemon is a new instance: what opens a connection again after a
        failure calls it first, so that nothing it sends meets a daemon without its registrations."""
        if self.instance is None or self._closed:
            return  # nothing tracked
        with self._recovering:
            msg = self._describe()
            if msg is None:
                return  # not there (yet): the caller's own call says so
            client = self._client()
            if client is not None and msg.instance_id != self.instance:
                self._reattach_now(client, msg)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Waits until no re-attach is under way; False if `timeout` passed first."""
        return self._ready.wait(timeout)

    # -- the watch

    def _client(self) -> Optional["Client"]:
        """The synchronous client the re-registrations use."""
        if self._make_rpc is None:
            return self._owner()
        if self._rpc is None and not self._closed:
            self._rpc = self._make_rpc()
        return self._rpc

    def _describe(self) -> Any:
        """DescribeNode on the watch's own channel; None when the daemon does not answer."""
        ch = self._channel
        if ch is None:
            return None
        try:
            stub = ch.unary_unary(_proto.path("DescribeNode"), **_proto.codecs("DescribeNode"))
            return stub(_proto.message("DescribeNodeRequest")(), timeout=ASK_S, metadata=self._metadata)
        except (grpc.RpcError, ValueError):  # (ValueError: the channel closed meanwhile)
            return None

    def _start(self) -> None:
        if self._thread is not None and self._pid == os.getpid():
            return
        client = self._client()
        if client is None or self._closed:
            return
        with self._lock:
            if self._thread is not None and self._pid == os.getpid():
                return
            self._pid = os.getpid()
            # The watch's own channel: the client's may be closed, or collected with the client,
            # while the watch thread waits on it (grpcio does not survive that).
            self._metadata = client._metadata
            self._channel = grpc.insecure_channel(client.endpoint, options=_ops.channel_options())
            if self.instance is None:
                msg = self._describe()
                self.instance = msg.instance_id if msg is not None else ""
            self._thread = threading.Thread(target=self._run, args=(self._channel,), name="tcpxd-reattach", daemon=True)
            self._thread.start()
        # The client going away unclosed ends the watch too (the thread then closes its channel).
        weakref.finalize(client if self._make_rpc is None else self._owner() or client, self._stop)

    def _run(self, channel: Any) -> None:
        try:
            while not self._closed:
                try:
                    with self._lock:  # _stop() cancels what is here
                        if self._closed:
                            return
                        watch: Any = channel.unary_stream(_WATCH)  # raw bytes both ways
                        call = self._call = watch(_WATCH_API, metadata=self._metadata)
                    for status in call:
                        if status != _SERVING:
                            # NOT_SERVING: the daemon is stopping (SIGTERM, an upgrade). Let go of
                            # the stream, which would hold its shutdown up, and wait for the next.
                            call.cancel()
                            break
                except grpc.RpcError:
                    pass
                except ValueError:  # "Channel closed"
                    return
                if self._closed:
                    return
                time.sleep(POLL_S)
                self._recover()
        finally:
            channel.close()

    def _recover(self) -> None:
        """The watch ended: wait for the daemon to answer; a new instance gets everything again."""
        while not self._closed:
            msg = self._describe()
            if msg is None:
                time.sleep(POLL_S)
                continue
            with self._recovering:
                client = self._client()
                if client is not None and msg.instance_id != self.instance:  # (else the same daemon, or re-attached by sync())
                    self._reattach_now(client, msg)
            return

    def _reattach_now(self, client: "Client", msg: Any) -> None:
        self._ready.clear()
        try:
            self._reattach(client, msg)
        finally:
            self._ready.set()

    def _reattach(self, client: "Client", msg: Any) -> None:
        started = time.monotonic()
        old, self.instance = self.instance, msg.instance_id
        owner = self._owner()
        if owner is not None and owner._registrar is not None:
            owner._registrar.reset()  # its connection died with the old instance
            # A new instance may be another version, and a daemon draining for a restart closes
            # the connections it still accepted, as an older daemon without the local session
            # does: ask the new one afresh (the registrar and the transfers share what it says).
            owner._registrar.available = None
        with self._lock:
            todo = list(self._again.items())
            alive = {("b", i): b for i, b in self._buffers.items()}
            alive.update({("l", i): b for i, b in self._lists.items()})
            alive.update({("p", i): b for i, b in self._prepared.items()})
            alive.update({("a", i): b for i, b in self._batches.items()})
        if not msg.reattach_grace_s:
            log.warning("tcpxd daemon at %s restarted without a state directory (runtime.state_dir): %d registrations "
                        "of this client are gone; register them again", client.endpoint, len(alive))
        done, failed = 0, 0
        # Buffers first (one by one, then those registered by address together, with their
        # lists), then the lists in them, then prepared lists over those.
        for kind in ("b", "a", "l", "p"):
            for key, again in todo:
                obj = alive.get(key)
                if key[0] != kind:
                    continue
                if (obj is None and kind in ("b", "a")) or getattr(obj, "released", False):
                    self.forget(*key)  # gone here: nothing to hand over, or released
                    continue
                try:
                    again(obj, client)
                    done += 1
                except TcpxdError as e:
                    what = {"b": "buffer", "a": "memory by address", "l": "block list", "p": "prepared list"}[kind]
                    if obj is None and e.code == grpc.StatusCode.NOT_FOUND:
                        # A list whose object went: released with what it was over, most likely.
                        log.debug("tcpxd: block or prepared list %d not re-attached: %s", key[1], e)
                    else:
                        failed += 1
                        log.warning("tcpxd: re-attaching %s %d to the restarted daemon failed: %s", what, key[1], e)
                    self.forget(*key)
        self.restarts += 1
        log.info("tcpxd daemon at %s restarted (instance %s -> %s): %d registrations re-attached, %d failed, in %.0f ms",
                 client.endpoint, (old or "?")[:8], msg.instance_id[:8], done, failed,
                 (time.monotonic() - started) * 1000)

    def _stop(self) -> None:
        """Ends the watch (its thread closes its channel on the way out)."""
        with self._lock:
            self._closed = True
            call = self._call
        if call is not None:
            call.cancel()

    def close(self) -> None:
        """Stops the watch and waits for its thread (a re-attach under way ends first)."""
        self._stop()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and self._pid == os.getpid():
            thread.join(ASK_S + 1)
        if self._rpc is not None:
            self._rpc.close()


#: How a registration is made again: (the buffer or list, the synchronous client to call).
Again = Callable[[Any, "Client"], None]


def _list_again(req: Any, list_id: int) -> Again:
    def again(bl: Any, rpc: "Client") -> None:
        r = type(req)()
        r.CopyFrom(req)
        r.reattach_id = list_id
        msg = rpc._unary("RegisterBlocks", r)
        if bl is not None:  # the object, where it still lives
            bl._update(msg)

    return again


def _batch_again(batch: Any, rpc: "Client") -> None:
    batch.again(rpc)


def _prepared_again(req: Any, prepared_id: int) -> Again:
    def again(p: Any, rpc: "Client") -> None:
        r = type(req)()
        r.CopyFrom(req)
        r.reattach_id = prepared_id
        rpc._unary("PrepareBlocks", r)

    return again


def host_fd_again(fd: int, offset: int, size: int, label: str) -> Again:
    """How a host buffer shared by file descriptor is registered again: `fd` (a duplicate the
    buffer keeps open) sent anew, on the connection of the client that holds the buffer."""

    def again(buf: Any, rpc: "Client") -> None:
        req = _proto.message("RegisterHostFdRequest")(
            offset=offset, size=size, label=label, reattach_id=buf.id, reattach_key=descriptor_key(buf.descriptor))
        buf._update(buf._client._registrar.register_fd(fd, req, rpc.timeout))

    return again


def client_memory_again(address: int, size: int, label: str) -> Again:
    """How host memory registered by address is registered again: the same range of this process,
    on the connection of the client that holds the buffer (the daemon takes the process from the
    connection's peer credentials and accepts only the one that registered it)."""

    def again(buf: Any, rpc: "Client") -> None:
        req = _proto.message("RegisterClientMemoryRequest")(
            address=address, size=size, label=label, reattach_id=buf.id, reattach_key=descriptor_key(buf.descriptor))
        buf._update(buf._client._registrar.register_by_address(req, rpc.timeout))

    return again


def cuda_ipc_again(req: Any) -> Again:
    def again(buf: Any, rpc: "Client") -> None:
        r = type(req)()
        r.CopyFrom(req)
        r.reattach_id = buf.id
        r.reattach_key = descriptor_key(buf.descriptor)
        buf._update(rpc._unary("RegisterBuffer", r))

    return again


def keep_fd(fd: int, owner: Any) -> int:
    """A duplicate of `fd` that lives as long as `owner` (closed with it)."""
    dup = os.dup(fd)
    weakref.finalize(owner, os.close, dup)
    return dup


__all__: List[str] = ["Reattacher", "descriptor_key", "host_fd_again", "cuda_ipc_again", "keep_fd"]
