"""nixl_agent on tcpxd: NIXL's Python agent surface, each call mapped onto the node's daemon.

The class is here with its making and closing, session, backends, registration, a transfer's
state and notifications. Two concerns are written in their own modules, as functions the class
names as its methods (the methods are the same, `self` the agent): tcpxd.nixl._remotes (metadata
and remote agents) and tcpxd.nixl._transfers (prepared lists, making and posting transfers)."""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from .. import Client, _exit
from .._session import _varint
from ..client import DEFAULT_CALL_TIMEOUT
from ..errors import TcpxdError
from . import _bindings, _indices, _listen, _remotes, _transfers
from ._descs import DescList, RegDList, XferDList, lenient, parse
from ._errors import (
    from_tcpxd,
    nixlBackendError,
    nixlInvalidParamError,
    nixlInvalidValueError,
    nixlNoTelemetryError,
    nixlNotFoundError,
    nixlNotPostedError,
)
from ._handles import (
    NETWORK_PLUGINS,
    NIXL_INIT_AGENT,
    PLUGIN,
    STORAGE_PLUGINS,
    nixl_agent_config,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)
from ._memory import LocalMemory
from ._notify import MAILBOX_BYTES, Inbox, Sent, _tight_spin_s, close_notifs_s, frame, notif_future
from ._remotes import AgentName, _name, _Remote
from ._transfers import _bytes
from ._xfer import NOTIFICATION_ALONE, Xfer, mailbox_entry, mailbox_timeout, nixlXferTelemetry

log = logging.getLogger("tcpxd.nixl")

_told_no_native = False


def _say_no_native() -> None:
    """Says once a process that the C pass is not in use (vLLM's requests then cost more Python
    time: docs/NIXL.md), and why."""
    global _told_no_native
    if not _told_no_native:
        _told_no_native = True
        why = ("turned off by TCPXD_NATIVE=0" if os.environ.get("TCPXD_NATIVE") == "0" else
               "not built: install the package where a C compiler and Python's headers are present")
        log.info("tcpxd.nixl: the C pass tcpxd._native is %s; index arrays go through numpy and the index ring", why)


#: A check_xfer_state that finds its transfer in progress this soon after the previous one did is a
#: tight polling loop's (NIXL's examples poll so). Such a loop spins for TIGHT_SPIN_S, then each
#: further poll waits up to TIGHT_WAIT_MS for the daemon to send something, the GIL and the CPU
#: released, back as soon as something comes: a small transfer is seen the moment it ends (no
#: thread to wake), and a loop that would spin long gives the CPU to the daemons it waits for.
TIGHT_S = 50e-6
TIGHT_WAIT_MS = 1


TIGHT_SPIN_S = _tight_spin_s()
_INF = float("inf")



class nixl_agent:  # noqa: N801
    """A NIXL agent whose transfers the node's tcpxd carries (docs/NIXL.md).

    `agent_name` names it to remote agents and keys the notifications it sends; `nixl_conf` as
    NIXL's, plus `endpoint=` and `timeout_s=`. Thread-safe. `close()` (or leaving a `with` block)
    releases what it registered; so does the process exiting."""

    def __init__(self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None, instantiate_all: bool = False,
                 *, _binding: Optional[_bindings.nixlAgent] = None):
        if nixl_conf is not None and instantiate_all:
            instantiate_all = False
            log.warning("Ignoring instantiate_all based on the provided config in agent creation.")
        conf = nixl_conf or nixl_agent_config()
        sync = conf.sync_mode or (nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if conf.enable_listen
                                  else nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE)
        if _binding is None:  # made through the module's attribute, as NIXL's agent is (tests patch it)
            cfg = _bindings.nixlAgentConfig()
            cfg.useProgThread = conf.enable_pthread
            cfg.useListenThread = conf.enable_listen
            cfg.listenPort = conf.port
            cfg.syncMode = sync.value
            cfg.captureTelemetry = conf.capture_telemetry
            _binding = _bindings.nixlAgent(agent_name, cfg)  # raises ValueError for an empty name, as NIXL's
        if not isinstance(agent_name, str) or not agent_name or agent_name == NIXL_INIT_AGENT:
            raise nixlInvalidValueError(f"agent_name: {agent_name!r} cannot name an agent")
        #: The C++-style agent (nixl._bindings.nixlAgent) this one is made on, as NIXL's `.agent`.
        self.agent = _binding
        attach = getattr(_binding, "_attach", None)  # (a test's stand-in may be anything)
        if attach is not None:
            attach(self)
        self.name = agent_name
        self._conf = conf
        #: Whether transfers keep telemetry: NIXL_TELEMETRY_ENABLE when set, else capture_telemetry.
        self._telemetry = _bindings.telemetry_enabled(conf.capture_telemetry)
        self._timeout_ms = 0 if conf.timeout_s is None else max(1, int(conf.timeout_s * 1000))
        #: How long close() waits for notifications still on their way (close_notifs_s).
        self._close_notifs_s = close_notifs_s(getattr(conf, "close_notifs_s", None))
        #: How long a request answered at once (PrepareBlocks on the session) may take.
        self._call_timeout_s = DEFAULT_CALL_TIMEOUT if conf.timeout_s is None else max(conf.timeout_s, DEFAULT_CALL_TIMEOUT)
        self._lock = threading.RLock()
        #: When check_xfer_state last found a transfer in progress (a tight loop's cue: TIGHT_S),
        #: and when the current tight loop began (TIGHT_SPIN_S).
        self._checked_at = 0.0
        self._spin_from = 0.0
        self._ids = itertools.count(1)
        #: Where prepared transfers pack their indices as they are sent (_indices.Scratch).
        self._scratch = _indices.Scratch()
        #: Where prepared transfers' indices are looked at for the compact form (_indices.Outer).
        self._outer = _indices.Outer()
        #: The index ring large prepared requests pass their indices through (registered on first
        #: use; `_no_windows`: it cannot be).
        self._windows: Optional[_indices.Windows] = None
        self._no_windows = False
        #: Whether the daemon takes outer sums (an older daemon takes neither form: packed).
        self._outer_ok = False
        #: Whether outer sums are looked for first (the daemon takes them and the native pass
        #: finds them cheaper than the ring's check and pack): `Lane.take`.
        self._outer_native = False
        self._remotes: Dict[str, _Remote] = {}
        #: Where fetch_remote_metadata fetched each remote agent's metadata (`_on_remote`).
        self._fetched: Dict[str, Tuple[str, int]] = {}
        #: This agent as a loopback list's remote side (`_loopback`), with the table it was made on.
        self._self_remote: Optional[Any] = None
        self._session: Any = None
        self.notifs: Dict[str, List[bytes]] = {}
        self._listener: Optional[_listen.Listener] = None
        self._closed = False
        self._client = Client(conf.endpoint)
        try:
            self._node = self._client.describe_node()
            self._no_windows = "prepared_index_windows" not in self._node.features
            self._outer_ok = "prepared_outer_indices" in self._node.features
            #: The mailbox WRITE is of zero bytes: a notification alone (control messages only).
            self._notif_alone = NOTIFICATION_ALONE in self._node.features
            self._outer_native = self._outer_ok and self._outer.native
            if self._outer_ok and not self._outer.native:
                _say_no_native()
            self._mailbox = self._client.register_host(MAILBOX_BYTES)
            self._memory = LocalMemory(self._client)
            self._inbox = Inbox(self._client, agent_name)
        except TcpxdError as e:
            self._client.close()
            raise nixlBackendError(f"tcpxd daemon at {self._client.endpoint}: {e.message}") from None
        self.plugin_list = [PLUGIN, *NETWORK_PLUGINS]
        self.backends: Dict[str, int] = {}
        for b in self.plugin_list if instantiate_all else conf.backends:
            if b not in self.plugin_list:
                why = "a storage plugin: tcpxd.nixl moves memory" if b in STORAGE_PLUGINS else "no such plugin"
                log.warning("Skipping backend registration %s due to the missing plugin (%s).", b, why)
                continue
            self.create_backend(b)
        if conf.enable_listen:
            try:
                self._listener = _listen.Listener(conf.port, agent_name, self.get_agent_metadata, self.add_remote_agent,
                                                  self.remove_remote_agent)
            except OSError as e:
                self.close()
                raise nixlBackendError(f"listen_port: cannot listen on port {conf.port} ({e})") from None
        _exit.track_agent(self)  # closed at exit if still open (tcpxd._exit)
        log.info("Initialized tcpxd.nixl agent %s on node %s (%s)", agent_name, self._node.node_id, self._client.endpoint)

    # -- life

    def close(self) -> None:
        """Releases the agent's transfers' session, registrations and mailbox (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            session, self._session = self._session, None
        if self._listener is not None:
            self._listener.close()
        left = self._notifs_sent(self._close_notifs_s)  # closing their session would cancel them
        if left:
            log.warning("agent %s: closing cancels its notifications still on their way after %g s to %s "
                        "(nixl_agent_config(close_notifs_s=...) or TCPXD_NIXL_CLOSE_NOTIFS_S waits longer)",
                        self.name, self._close_notifs_s, ", ".join(sorted(left)))
        self._inbox.close()
        if session is not None:
            session._abort("client closed")
        try:
            self._memory.close()
            self._mailbox.release()
            if self._windows is not None:
                self._windows.buffer.release()
        except TcpxdError as e:  # the daemon is gone: nothing of ours is left there
            log.warning("agent %s: releasing its buffers: %s", self.name, e)
        self._client.close()

    def __enter__(self) -> "nixl_agent":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if _exit.finalizing():  # past the exit handler (tcpxd._exit): the process's end releases it all
            return
        try:
            self.close()
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass

    def _session_now(self) -> Any:
        """The agent's session: the current one while it lives (read without a lock), else a new one."""
        s = self._session
        if s is not None and s._ended is None and not s._closed and s._why is None and not self._closed:
            return s
        old = None
        with self._lock:
            if self._closed:
                raise nixlBackendError("the agent is closed")
            s = self._session
            if s is None or s._ended is not None or s._closed or s._why is not None:
                if s is not None:  # it failed: the daemon may have restarted (tcpxd._reattach)
                    self._client._reattach.sync()
                    old = s
                s = self._session = self._client.session()
        if old is not None:
            # Its reader has ended (or is ending: the connection is shut down) but its descriptor
            # stays open until closed: left to the garbage collector, one unix socket per daemon
            # restart piled up between two collections (benches/restart_loop.py --series).
            old.close()
        return s

    # -- backends

    def get_plugin_list(self) -> List[str]:
        return list(self.plugin_list)

    def create_backend(self, backend: str, initParams: Optional[Dict[str, str]] = None) -> None:  # noqa: N803
        """Makes a backend of one of the plugins this agent reports (every one is the daemon);
        any other name raises nixlNotFoundError, as NIXL does for a plugin it does not have."""
        if backend not in self.plugin_list:
            why = ("a storage plugin; tcpxd.nixl moves memory between nodes" if backend in STORAGE_PLUGINS
                   else f"this agent's plugins are {', '.join(self.plugin_list)}")
            raise nixlNotFoundError(f"backend: no plugin {backend!r} ({why})")
        with self._lock:
            self.backends.setdefault(backend, len(self.backends) + 1)
        log.info("Backend %s was instantiated", backend)

    def get_plugin_mem_types(self, backend: str) -> List[str]:
        return ["DRAM", "VRAM"] if backend in self.plugin_list else []

    def get_backend_mem_types(self, backend: str) -> List[str]:
        return ["DRAM", "VRAM"] if backend in self.backends else []

    def get_plugin_params(self, backend: str) -> Dict[str, str]:
        return {}

    def get_backend_params(self, backend: str) -> Dict[str, str]:
        return {}

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        return next(iter(self.backends), PLUGIN)

    # -- descriptors and memory

    def get_reg_descs(self, descs: Any, mem_type: Optional[str] = None) -> Optional[RegDList]:
        return lenient(descs, mem_type, True, "descs")  # type: ignore[return-value]

    def get_xfer_descs(self, descs: Any, mem_type: Optional[str] = None) -> Optional[XferDList]:
        return lenient(descs, mem_type, False, "descs")  # type: ignore[return-value]

    def register_memory(self, reg_list: Any, mem_type: Optional[str] = None, backends: Optional[List[str]] = None) -> RegDList:
        """Registers each region with the daemon (DRAM: its pages shared by file descriptor; VRAM:
        its allocation imported by IPC handle). Returns the registration list."""
        dl = reg_list
        if type(dl) is not RegDList:  # (else as given: get_reg_descs's, the usual)
            dl = parse(reg_list, mem_type, True, "reg_list")
            assert isinstance(dl, RegDList)
        elif self._memory.hold_one(dl):  # (one DRAM region, checked and held in one C call)
            return dl
        else:
            self._memory.register(dl, lone_tried=True)
            return dl
        self._memory.register(dl)
        return dl

    def deregister_memory(self, dereg_list: Any, backends: Optional[List[str]] = None) -> None:
        dl = dereg_list
        if type(dl) is not RegDList:  # (else as given: register_memory's, the usual)
            dl = parse(dereg_list, None, True, "dereg_list")
            assert isinstance(dl, RegDList)
        elif self._memory.withdraw_one(dl):  # (one DRAM region held alone: withdrawn in one C call)
            return
        self._memory.deregister(dl)

    def get_serialized_descs(self, descs: DescList) -> bytes:
        return pickle.dumps(descs)

    def deserialize_descs(self, serialized_descs: bytes) -> Any:
        return pickle.loads(serialized_descs)

    # -- metadata and remote agents (tcpxd.nixl._remotes)

    _metadata = _remotes._metadata
    get_agent_metadata = _remotes.get_agent_metadata
    get_partial_agent_metadata = _remotes.get_partial_agent_metadata
    add_remote_agent = _remotes.add_remote_agent
    _pair_ahead = _remotes._pair_ahead
    remove_remote_agent = _remotes.remove_remote_agent
    check_remote_metadata = _remotes.check_remote_metadata
    make_connection = _remotes.make_connection
    send_local_metadata = _remotes.send_local_metadata
    send_partial_agent_metadata = _remotes.send_partial_agent_metadata
    fetch_remote_metadata = _remotes.fetch_remote_metadata
    _on_remote = _remotes._on_remote
    invalidate_local_metadata = _remotes.invalidate_local_metadata
    _peer_exchange = _remotes._peer_exchange
    _remote = _remotes._remote
    _loopback = _remotes._loopback
    _peer = _remotes._peer

    # -- prepared lists and transfers (tcpxd.nixl._transfers)

    prep_xfer_dlist = _transfers.prep_xfer_dlist
    _prepared_id = _transfers._prepared_id
    _unprepare = _transfers._unprepare
    release_dlist_handle = _transfers.release_dlist_handle
    _dlist = _transfers._dlist
    _xfer_handle = _transfers._xfer_handle
    _keep_lane = _transfers._keep_lane
    make_prepped_xfer = _transfers.make_prepped_xfer
    initialize_xfer = _transfers.initialize_xfer
    _windows_now = _transfers._windows_now
    transfer = _transfers.transfer
    _post_lane = _transfers._post_lane

    # -- a transfer's state

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        """"DONE", "PROC" or "ERR" (the handle's `error` says why). A transfer that cannot finish
        ends in "ERR" by its deadline (timeout_s, else the daemon's), or as soon as its peer is
        found gone."""
        xfer = handle._xfer if type(handle) is nixl_xfer_handle and handle._agent is self and not handle._released else self._live(handle)
        state = xfer.state
        if state == "PROC":  # read what the daemon sent, here: no wait for the session's reader thread
            session = xfer._session
            bounded = TIGHT_SPIN_S != _INF  # (read each call: tests set it)
            if bounded:
                now = time.perf_counter()
                if now - self._checked_at < TIGHT_S and now - self._spin_from >= TIGHT_SPIN_S:
                    # a tight loop that spun long enough: wait for the daemon (at once when
                    # something is there already), then read it: no look before the wait
                    session.poll(session.wait_readable(TIGHT_WAIT_MS))
                    self._checked_at = time.perf_counter()
                    return xfer.state
            session.poll()
            state = xfer.state
            if state == "PROC" and bounded:
                if now - self._checked_at >= TIGHT_S:  # not a tight loop (or its first poll)
                    self._spin_from = now
                self._checked_at = now
            return state
        if state == "INIT":
            raise nixlNotPostedError("handle: never posted (call transfer() first)")
        return state

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlXferTelemetry:
        if not self._telemetry:
            raise nixlNoTelemetryError("get_xfer_telemetry: the agent keeps no telemetry (capture_telemetry=True, or "
                                       "NIXL_TELEMETRY_ENABLE=y, when it is made)")
        tm = self._live(handle).telemetry
        if tm is None:  # made before capture_telemetry was set on the agent's config
            raise nixlNoTelemetryError("get_xfer_telemetry: the transfer was made while the agent captured no telemetry")
        return tm

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        """Releases the handle; a transfer still in progress is cancelled on both sides."""
        handle.release()

    def _live(self, handle: Any) -> Xfer:
        if not isinstance(handle, nixl_xfer_handle) or handle._agent is not self:
            raise nixlInvalidParamError("handle: not a transfer handle of this agent")
        if handle._released:
            raise nixlNotFoundError("handle: released")
        return handle._xfer

    # -- notifications

    def send_notif(self, remote_agent_name: AgentName, notif_msg: Any, backend: Optional[str] = None) -> None:
        """Posts a notification alone, as NIXL's does: returns once the daemon has it, not waiting
        for it to reach the remote agent (a zero-byte WRITE between the two agents' mailboxes
        carries it, on the agent's session: control messages only between the daemons, the
        receiving daemon checking the mailbox's key before it delivers; a 1-byte WRITE where the
        daemon does not list the `notification_alone` feature). Notifications to one agent arrive in the order sent: while
        the previous one to it is still on its way, this one waits for it first. One that failed
        is logged, and raised by the next send_notif to the same agent (which then sends nothing)."""
        # The common call (a str name of a loaded remote agent, a bytes message) without the
        # checks' calls: a loaded agent's name was checked when it was added, and a dict's `get`
        # needs no lock (session 32, rt2: ~0.9 of send_notif's ~2.1 µs of Python went there).
        remote = self._remotes.get(remote_agent_name) if type(remote_agent_name) is str else None
        if remote is None:
            remote = self._peer(remote_agent_name, "remote_agent_name")
        msg = notif_msg if type(notif_msg) is bytes else _bytes(notif_msg, "notif_msg")
        with remote.notif_lock:
            prev = remote.notif_sent
            if prev is not None:
                remote.notif_sent = None
                # (an answered _notify.Sent read in place; else waits: the order kept)
                err = prev._error if type(prev) is Sent and prev._done else prev.exception()
                if err is not None:
                    if isinstance(err, TcpxdError):
                        raise from_tcpxd(err, f"send_notif to {remote.md.name}: the previous notification to it failed "
                                              "(this one was not sent)") from None
                    raise nixlBackendError(f"send_notif to {remote.md.name}: the previous notification to it failed "
                                           f"({err!r}; this one was not sent)")
            head = remote.notif_head
            if head is None:  # mailbox_write's bytes but for the message, once a remote agent
                entry = remote.mailbox_entry
                if entry is None:
                    entry = remote.mailbox_entry = mailbox_entry(self._mailbox.id, remote.md.mailbox, self._notif_alone)
                head = remote.notif_head = (entry + b"\x12", frame(self.name, remote.md.name, b""), mailbox_timeout(self._timeout_ms))
            sent: Any = self._inbox.post_notif(head, msg, remote.md.name)  # on the notification feed's session
            if sent is None:  # no local feed (a TCP endpoint, an older daemon): on the agent's session
                body = head[0] + _varint(len(head[1]) + len(msg)) + head[1] + msg + head[2]
                session = self._session_now()
                sent = notif_future(session, remote.md.name)
                try:
                    session._submit_frame("write", body, sent)
                except TcpxdError as e:  # the session was closed under us: nothing was sent
                    raise from_tcpxd(e, f"send_notif to {remote.md.name}") from None
            remote.notif_sent = sent

    def _notifs_sent(self, timeout: float) -> List[str]:
        """Waits (up to `timeout` s in all) for the notifications still on their way: before the
        agent's session ends (closing it would cancel them). The names of the agents whose
        notification is still on its way after it."""
        end = time.monotonic() + timeout
        with self._lock:
            remotes = list(self._remotes.items())
            if self._self_remote is not None:
                remotes.append((self.name, self._self_remote[1]))
        left = []
        for name, remote in remotes:
            sent = remote.notif_sent
            if sent is not None and not sent.done():
                try:
                    sent.exception(max(0.0, end - time.monotonic()) if timeout != _INF else None)
                except Exception:  # noqa: BLE001 - timed out, or the session ended: closing goes on
                    pass
                if not sent.done():
                    left.append(name)
        return left

    def get_new_notifs(self, backends: Optional[List[str]] = None) -> Dict[str, List[bytes]]:
        """Notifications that arrived since the last call, by the sending agent's name."""
        return self._inbox.take()

    def update_notifs(self, backends: Optional[List[str]] = None) -> Dict[str, List[bytes]]:
        with self._lock:
            for k, v in self._inbox.take().items():
                self.notifs.setdefault(k, []).extend(v)
            return self.notifs

    def check_remote_xfer_done(self, remote_agent_name: AgentName, lookup_tag: bytes, backends: Optional[List[str]] = None,
                               tag_is_prefix: bool = True) -> bool:
        """Whether a notification from the remote agent starts with (or contains) `lookup_tag`;
        the one found is removed."""
        name = _name(remote_agent_name, "remote_agent_name")
        tag = _bytes(lookup_tag, "lookup_tag")
        with self._lock:
            self.update_notifs()
            msgs = self.notifs.get(name, [])
            for i, m in enumerate(msgs):
                if (m.startswith(tag) if tag_is_prefix else tag in m):
                    del msgs[i]
                    return True
        return False
