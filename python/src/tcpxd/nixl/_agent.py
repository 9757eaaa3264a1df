"""nixl_agent on tcpxd: NIXL's Python agent surface, each call mapped onto the node's daemon."""

from __future__ import annotations

import functools
import itertools
import logging
import os
import pickle
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np

from .. import Client, _exit
from ..client import DEFAULT_CALL_TIMEOUT
from ..errors import TcpxdError
from . import _bindings, _indices, _listen, _plan
from ._descs import DescList, RegDList, XferDList, lenient, parse
from ._errors import (
    from_tcpxd,
    nixlBackendError,
    nixlInvalidKeyError,
    nixlInvalidParamError,
    nixlInvalidValueError,
    nixlNoTelemetryError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
)
from ._handles import (
    DEFAULT_COMM_PORT,
    NETWORK_PLUGINS,
    NIXL_INIT_AGENT,
    PLUGIN,
    STORAGE_PLUGINS,
    nixl_agent_config,
    nixl_prepped_dlist_handle,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)
from ._memory import LocalMemory
from ._metadata import AgentMetadata
from ._notify import CLOSE_NOTIFS_S, MAILBOX_BYTES, Inbox, _tight_spin_s, frame, notif_future
from ._regions import RegionTable
from ._xfer import NOTIFICATION_ALONE, Xfer, mailbox_entry, mailbox_write, nixlXferTelemetry

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

AgentName = Union[str, bytes]

#: A check_xfer_state that finds its transfer in progress this soon after the previous one did is a
#: tight polling loop's (NIXL's examples poll so). Such a loop spins for TIGHT_SPIN_S, then each
#: further poll waits up to TIGHT_WAIT_MS for the daemon to send something, the GIL and the CPU
#: released, back as soon as something comes: a small transfer is seen the moment it ends (no
#: thread to wake), and a loop that would spin long gives the CPU to the daemons it waits for.
TIGHT_S = 50e-6
TIGHT_WAIT_MS = 1


TIGHT_SPIN_S = _tight_spin_s()


def _name(agent: AgentName, what: str) -> str:
    if isinstance(agent, (bytes, bytearray)):
        return bytes(agent).decode()
    if not isinstance(agent, str):
        raise nixlInvalidParamError(f"{what}: an agent name (str) is needed, got {type(agent).__name__}")
    return agent


def _bytes(msg: Any, what: str) -> bytes:
    if isinstance(msg, str):
        return msg.encode()
    if isinstance(msg, (bytes, bytearray, memoryview)):
        return bytes(msg)
    raise nixlInvalidParamError(f"{what}: bytes (or str) are needed, got {type(msg).__name__}")


class _Remote:
    def __init__(self, md: AgentMetadata):
        self.md = md
        self.table = RegionTable(md.regions)
        #: The mailbox WRITE's entry field, encoded on first use.
        self.mailbox_entry: Optional[bytes] = None
        #: The pairing with its node started when the metadata was loaded (`_pair_ahead`).
        self.pairing: Any = None
        #: The last send_notif to it (its WRITE's answer to come: a `_notify.Sent` on the
        #: notification feed, else a future of the agent's session) and the lock that orders
        #: them (`nixl_agent.send_notif`).
        self.notif_sent: Any = None
        self.notif_lock = threading.Lock()


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
        self._notifs_sent(CLOSE_NOTIFS_S)  # closing their session would cancel them
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
        self._memory.register(dl)
        return dl

    def deregister_memory(self, dereg_list: Any, backends: Optional[List[str]] = None) -> None:
        dl = dereg_list
        if type(dl) is not RegDList:  # (else as given: register_memory's, the usual)
            dl = parse(dereg_list, None, True, "dereg_list")
            assert isinstance(dl, RegDList)
        self._memory.deregister(dl)

    def get_serialized_descs(self, descs: DescList) -> bytes:
        return pickle.dumps(descs)

    def deserialize_descs(self, serialized_descs: bytes) -> Any:
        return pickle.loads(serialized_descs)

    # -- metadata

    def _metadata(self, regions: Any = None) -> AgentMetadata:
        regs = self._memory.regions()
        if regions is not None:
            keep = {tuple(int(x) for x in row) for row in regions.rows}
            regs = [r for r in regs if (r.addr, r.size, r.dev) in keep]
        return AgentMetadata(self.name, self._node.node_id, list(self._node.peer_addresses), self._mailbox.descriptor,
                             regs, list(self.backends))

    def get_agent_metadata(self) -> bytes:
        """This agent's name, node, registered regions (raw base addresses and the daemon buffers
        holding them: access keys, keep it private) and mailbox."""
        return self._metadata().encode()

    def get_partial_agent_metadata(self, descs: Any, inc_conn_info: bool = False, backends: Optional[List[str]] = None) -> bytes:
        """Metadata of only the regions `descs` names (a registration list)."""
        dl = parse(descs, None, True, "descs")
        return self._metadata(dl).encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Loads a remote agent's metadata (again: its regions are replaced). Returns its name as
        bytes, as NIXL's binding does."""
        md = AgentMetadata.decode(metadata)
        if md.name == self.name:
            raise nixlInvalidParamError(f"metadata: names this agent itself ({self.name!r})")
        remote = _Remote(md)
        with self._lock:
            self._remotes[md.name] = remote
        self._pair_ahead(remote)
        return md.name.encode()

    def _pair_ahead(self, remote: _Remote) -> None:
        """Starts pairing with the remote agent's node, not waiting for it (gRPC's own thread
        carries the call), as NIXL's backends connect when metadata is loaded: the first
        prep_xfer_dlist or transfer towards it then finds the pairing done or under way (the
        daemon pairs once however many ask). A failure here is left for that call to report."""
        if remote.md.node_id == self._node.node_id or not remote.md.peer_addresses:
            return
        try:
            remote.pairing = self._client._connect_peer_started(remote.md.peer_addresses[0])
        except Exception as e:  # noqa: BLE001 - an optimisation only: the transfer pairs as before
            log.debug("agent %s: pairing ahead with %s: %s", self.name, remote.md.name, e)

    def remove_remote_agent(self, agent: AgentName) -> None:
        with self._lock:
            self._remotes.pop(_name(agent, "agent"), None)

    def check_remote_metadata(self, agent: AgentName, descs: Any = None) -> bool:
        with self._lock:
            remote = self._remotes.get(_name(agent, "agent"))
        if remote is None:
            return False
        if descs is None:
            return True
        dl = parse(descs, None, False, "descs")
        try:
            remote.table.resolve(dl.mem, dl.rows, remote.md.name, "descs")
        except TcpxdError:
            return False
        return True

    def make_connection(self, remote_agent: AgentName, backends: Optional[List[str]] = None) -> None:
        """Pairs this node with the remote agent's node now (else the first transfer does)."""
        remote = self._remote(remote_agent, "remote_agent")
        if remote.md.node_id == self._node.node_id:
            return  # an agent of this agent's own daemon: nothing to pair
        last: Optional[TcpxdError] = None
        for addr in remote.md.peer_addresses:
            try:
                self._client.connect_peer(addr)
                return
            except TcpxdError as e:
                last = e
        if last is not None:
            raise from_tcpxd(last, f"make_connection to {remote.md.name}")

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self._peer_exchange("send_local_metadata", ip_addr, port, b"SEND", self.get_agent_metadata())

    def send_partial_agent_metadata(self, descs: Any, inc_conn_info: bool = False, backends: Optional[List[str]] = None,
                                    ip_addr: str = "", port: int = DEFAULT_COMM_PORT, label: str = "") -> None:
        self._peer_exchange("send_partial_agent_metadata", ip_addr, port, b"SEND", self.get_partial_agent_metadata(descs))

    def fetch_remote_metadata(self, remote_agent: str, ip_addr: str = "", port: int = DEFAULT_COMM_PORT, label: str = "") -> None:
        name = _name(remote_agent, "remote_agent")
        self._peer_exchange("fetch_remote_metadata", ip_addr, port, b"FTCH", name.encode(), self.add_remote_agent)
        self._fetched[name] = (ip_addr, int(port))

    def _on_remote(self, name: str, what: str, resolve: Callable[[_Remote], Any]) -> Any:
        """`resolve(remote)`; when a descriptor lies outside the remote agent's regions and its
        metadata was fetched from its listener, fetched again once and retried: it may have
        registered memory after it answered (NIXL's two-peer examples fetch while the target
        registers)."""
        try:
            return resolve(self._peer(name, what))
        except nixlNotFoundError:
            got = _listen.fetch_now(self._fetched[name], name) if name in self._fetched else None
            if not got:
                raise
            self.add_remote_agent(got)
            return resolve(self._peer(name, what))

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self._peer_exchange("invalidate_local_metadata", ip_addr, port, b"INVL", self.name.encode())

    def _peer_exchange(self, what: str, ip: str, port: int, kind: bytes, body: bytes, answer: Any = None) -> None:
        if not ip:
            raise nixlNotSupportedError(
                f"{what}: a central metadata server (etcd) is not supported by tcpxd.nixl; give ip_addr (a peer's listener)")
        _listen.in_background(what, (ip, int(port)), kind, body, answer)

    def _remote(self, agent: AgentName, what: str) -> _Remote:
        name = _name(agent, what)
        with self._lock:
            remote = self._remotes.get(name)
        if remote is None:
            if name == self.name:
                return self._loopback()
            raise nixlNotFoundError(f"{what}: no remote agent {name!r} (load its metadata with add_remote_agent first)")
        return remote

    def _loopback(self) -> _Remote:
        """This agent as the remote side of a loopback list (prep_xfer_dlist with its own name, as
        NIXL's loopback): its own metadata, made again once its registrations changed. Its
        transfers are between two buffers of this agent's daemon, which copies them."""
        table = self._memory.table()
        with self._lock:
            lb = self._self_remote
            if lb is None or lb[0] is not table:
                lb = self._self_remote = (table, _Remote(self._metadata()))
            return lb[1]

    def _peer(self, agent: AgentName, what: str) -> _Remote:
        """A remote agent this one can move data to: on another node, or on this agent's daemon
        (another process of this node: the daemon copies between the two, docs/NIXL.md)."""
        return self._remote(agent, what)

    # -- prepared lists and transfers

    def prep_xfer_dlist(self, agent_name: AgentName, xfer_list: Any, mem_type: Optional[str] = None,
                        backends: Optional[List[str]] = None) -> nixl_prepped_dlist_handle:
        """Resolves each descriptor to a registered region: of this agent for "NIXL_INIT_AGENT"
        (or ""), else of the remote agent named (raw addresses in its memory, from its metadata).
        nixlNotFoundError names the first descriptor outside them."""
        name = _name(agent_name, "agent_name")
        dl = parse(xfer_list, mem_type, False, "xfer_list")
        if name in (NIXL_INIT_AGENT, ""):
            prepped = _plan.prepare(self._memory.table(), dl.mem, dl.rows, "", f"agent {self.name!r}", "xfer_list")
        elif name == self.name:  # loopback: the remote side is this agent's own memory
            prepped = _plan.prepare(self._loopback().table, dl.mem, dl.rows, name, f"agent {name!r} (loopback)", "xfer_list")
        else:
            prepped = self._on_remote(name, "agent_name", lambda r: _plan.prepare(
                r.table, dl.mem, dl.rows, name, f"remote agent {name!r}", "xfer_list"))
        if prepped.preparable:  # held by the daemon too (the prepared path): prepared now, once
            try:
                self._prepared_id(self._session_now(), prepped)
            except (TcpxdError, nixlBackendError) as e:
                log.debug("agent %s: the daemon did not prepare a list of %d descriptors (%s): the block path serves it",
                          self.name, len(prepped), e)
        return nixl_prepped_dlist_handle(self, next(self._ids), prepped)

    def _prepared_id(self, session: Any, prepped: _plan.Prepped) -> int:
        """The daemon's id of `prepped` on `session` (PrepareBlocks on it the first time: the
        list goes with the session). A refusal marks the list unpreparable and raises."""
        with prepped.daemon_lock:
            d = prepped.daemon
            if d is not None and d[0] is session:
                return d[1]
            try:
                got = session._submit(prepare_blocks=prepped.prepare_request()).result(timeout=self._call_timeout_s)
            except TcpxdError:
                prepped.refused = True
                raise
            except Exception as e:  # noqa: BLE001 - no answer in time
                raise nixlBackendError(f"prep_xfer_dlist: the daemon did not prepare the list: {e!r}") from None
            prepped.daemon = (session, int(got.prepared_id))
            prepped.held = True
            return prepped.daemon[1]

    def _unprepare(self, prepped: _plan.Prepped) -> None:
        """Releases the daemon's copy of a prepared list (best effort: the session's end releases
        it anyway)."""
        with prepped.daemon_lock:
            d, prepped.daemon = prepped.daemon, None
        if d is not None and d[0]._ended is None and not d[0]._closed:
            try:
                d[0]._submit(release_prepared=d[1])
            except TcpxdError:
                pass

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        handle.release()

    def _dlist(self, handle: Any, what: str) -> _plan.Prepped:
        if not isinstance(handle, nixl_prepped_dlist_handle) or handle._agent is not self:
            raise nixlInvalidParamError(f"{what}: not a prepared list of this agent (prep_xfer_dlist)")
        p = handle._prepped
        if p is None:
            raise nixlNotFoundError(f"{what}: released")
        return p

    def _xfer_handle(self, plan: Any, remote: str, notif: Any) -> nixl_xfer_handle:
        xfer = Xfer(plan, remote, notif if type(notif) is bytes else _bytes(notif, "notif_msg"), self._telemetry)
        return nixl_xfer_handle(self, next(self._ids), xfer)  # (next() on a count is atomic: no lock)

    def _keep_lane(self, operation: str, local_xfer_side: Any, remote_xfer_side: Any, skip_desc_merge: Any, plan: Any) -> None:
        """Keeps a prepared plan's lane on the local handle for the next requests between these
        handles, when its indices went as outer sums on both sides found by the native pass, or
        without outer sums (through the index ring, or packed when few) and the ring may serve."""
        if type(plan) is not _plan.Prepared:
            return
        outer = plan.lo is not None and plan.ro is not None and self._outer_native
        ring = plan.lo is None and plan.ro is None and not self._no_windows and len(plan.li) <= _indices.WINDOW_MAX
        if outer or ring:
            lanes = local_xfer_side._lanes
            if len(lanes) >= 16:  # handles made and dropped unreleased: keep a few
                lanes.clear()
            plan.lane.note_head = frame(self.name, plan.lane.remote.agent, b"")
            lanes[operation, remote_xfer_side, skip_desc_merge] = plan.lane

    def make_prepped_xfer(self, operation: str, local_xfer_side: nixl_prepped_dlist_handle, local_indices: Any,
                          remote_xfer_side: nixl_prepped_dlist_handle, remote_indices: Any, notif_msg: Any = b"",
                          backends: Optional[List[str]] = None, skip_desc_merge: bool = False) -> nixl_xfer_handle:
        """A transfer of local descriptor local_indices[k] with remote descriptor remote_indices[k]
        (WRITE: local into remote; READ: remote into local), equal lengths pairwise.

        Requests between two handles whose first request took the prepared path take its lane
        (one lookup, both arrays found in vLLM's form by the C pass or checked in one reduction
        each, no plan worked out again); anything else goes the general way below."""
        try:  # the lane kept on the local handle for (operation, remote handle, skip_desc_merge) (`_keep_lane`)
            lane = local_xfer_side._lanes[operation, remote_xfer_side, skip_desc_merge]
        except (AttributeError, KeyError, TypeError):  # not a handle, no lane yet, not hashable
            lane = None
        # the fast path when both handles are this agent's and live, neither list refused by
        # the daemon since, and the index arrays as `Lane.take` takes them (outer sums found by
        # the C pass, else the index ring); else the general way decides, checks and names
        if (lane is not None and local_xfer_side._agent is self and not remote_xfer_side._released
                and not lane.local.refused and not lane.remote.refused):
            pr = lane.take(local_indices, remote_indices, self._outer_native, not self._no_windows)
            if pr is not None:
                xfer = Xfer(pr, lane.remote.agent, notif_msg if type(notif_msg) is bytes else _bytes(notif_msg, "notif_msg"),
                            self._telemetry)
                return nixl_xfer_handle(self, next(self._ids), xfer)
        op = operation if operation == "READ" or operation == "WRITE" else _op(operation)
        local = self._dlist(local_xfer_side, "local_xfer_side")
        remote = self._dlist(remote_xfer_side, "remote_xfer_side")
        if local.agent:
            raise nixlInvalidParamError("local_xfer_side: prepared for a remote agent; prepare it with \"NIXL_INIT_AGENT\"")
        if not remote.agent:
            raise nixlInvalidParamError("remote_xfer_side: prepared for this agent; prepare it with the remote agent's name")
        # vLLM's form (regions × blocks) is found and encoded compactly, in range, first where the
        # C pass is built, else where the index ring will not carry the indices (_plan module doc);
        # else checked
        if self._outer_ok and (self._outer_native or self._no_windows or _size(local_indices) > _indices.WINDOW_MAX):
            lo = self._outer.encode(local_indices, local) if local.held and local.preparable else None
            ro = self._outer.encode(remote_indices, remote) if remote.held and remote.preparable else None
            if (lo is None) != (ro is None) and not self._no_windows and _size(local_indices) <= _indices.WINDOW_MAX:
                lo = ro = None  # one side alone of the form: both through the ring (a lane's request)
        else:
            lo = ro = None
        li = local_indices if lo is not None else _indices.indices(local_indices, local.count, "local_indices")
        ri = remote_indices if ro is not None else _indices.indices(remote_indices, remote.count, "remote_indices")
        plan = _plan.plan(op, local, li, remote, ri, not skip_desc_merge, self._timeout_ms, lo, ro)
        h = self._xfer_handle(plan, remote.agent, notif_msg)
        self._keep_lane(op, local_xfer_side, remote_xfer_side, skip_desc_merge, plan)
        return h

    def initialize_xfer(self, operation: str, local_descs: Any, remote_descs: Any, remote_agent: AgentName,
                        notif_msg: Any = b"", backends: Optional[List[str]] = None) -> nixl_xfer_handle:
        """A transfer of every local descriptor with the remote descriptor at the same position."""
        op = _op(operation)
        name = _name(remote_agent, "remote_agent")
        self._peer(name, "remote_agent")  # an unknown agent is named before any descriptor
        ld = parse(local_descs, None, False, "local_descs")
        rd = parse(remote_descs, None, False, "remote_descs")
        local = _plan.prepare(self._memory.table(), ld.mem, ld.rows, "", f"agent {self.name!r}", "local_descs")
        rem = self._on_remote(name, "remote_agent", lambda r: _plan.prepare(
            r.table, rd.mem, rd.rows, name, f"remote agent {name!r}", "remote_descs"))
        return self._xfer_handle(_plan.descs_plan(op, local, rem, self._timeout_ms), name, notif_msg)

    def _windows_now(self) -> Optional[_indices.Windows]:
        """The agent's index ring (_indices.Windows), registered on first use; None where this
        process cannot share memory with the daemon (a TCP endpoint) or the daemon refused it."""
        with self._lock:
            if self._windows is None and not self._no_windows and not self._closed:
                try:
                    buf = self._client.register_host(_indices.Windows.nbytes(), shared=True)
                except (TcpxdError, OSError, ValueError) as e:
                    log.debug("agent %s: no index ring (%s): indices go packed", self.name, e)
                    self._no_windows = True
                else:
                    if buf.shared:
                        self._windows = _indices.Windows(buf)
                    else:
                        buf.release()
                        self._no_windows = True
            return self._windows

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

    def transfer(self, handle: nixl_xfer_handle, notif_msg: Any = b"") -> str:
        """Posts the transfer: "PROC" (or "DONE"/"ERR" if it already ended). A notification reaches
        the remote agent after the data landed (after it was read, for a READ)."""
        xfer = handle._xfer if type(handle) is nixl_xfer_handle and handle._agent is self and not handle._released else self._live(handle)
        plan = xfer.plan
        to = self._remotes.get(xfer.remote)  # (a dict read is atomic: no lock)
        if to is not None and to.notif_sent is not None and (xfer.notif or not (type(notif_msg) is bytes and not notif_msg)):
            _notif_first(to.notif_sent)
        if type(plan) is _plan.Prepared and plan.lane.note_head is not None and type(notif_msg) is bytes and not notif_msg:
            state = self._post_lane(xfer, plan)
            if state is not None:
                return state
        remote = self._remotes.get(xfer.remote)  # (a dict read is atomic: no lock)
        if remote is None:
            remote = self._remote(xfer.remote, "handle's remote agent")  # raises, naming it
        if type(notif_msg) is bytes and not notif_msg:  # the handle's own: framed once
            framed = xfer.framed
            if framed is None:
                framed = xfer.framed = frame(self.name, remote.md.name, xfer.notif) if xfer.notif else b""
        else:
            msg = _bytes(notif_msg, "notif_msg") or xfer.notif
            framed = frame(self.name, remote.md.name, msg) if msg else b""
        session = self._session_now()
        pr = xfer.plan.prepared
        if pr is not None:  # bound to the session's prepared ids (prepared there if it is new)
            ld, rd = pr.local.daemon, pr.remote.daemon  # (session, id) tuples: read without a lock
            lid: Optional[int] = None
            if ld is not None and rd is not None and ld[0] is session and rd[0] is session:
                lid, rid = ld[1], rd[1]
            else:
                try:
                    lid, rid = self._prepared_id(session, pr.local), self._prepared_id(session, pr.remote)
                except (TcpxdError, nixlBackendError) as e:
                    log.debug("agent %s: prepared path refused (%s): the block or batch path instead", self.name, e)
                    xfer.plan = pr.unprepared(xfer.plan.op)
            if lid is not None:  # one request, the notification in it; its indices in the index ring, else packed
                ring = None
                if _indices.WINDOW_MIN <= len(pr.li) <= _indices.WINDOW_MAX:
                    ring = self._windows if self._windows is not None or self._no_windows else self._windows_now()
                slot = ring.take() if ring is not None else None
                if slot is not None:
                    assert ring is not None
                    try:
                        body = pr.window_body(_plan.ids_field(lid, rid), framed, ring, slot)
                        return xfer.post(session, b"", None, [body], functools.partial(ring.give, slot))
                    except BaseException as e:  # nothing was sent: the slot is free again
                        ring.give(slot)
                        if isinstance(e, TcpxdError):
                            raise from_tcpxd(e, "transfer") from None
                        raise
                with self._scratch.lock:
                    try:
                        return xfer.post(session, b"", None, [pr.body(lid, rid, framed, self._scratch)])
                    except TcpxdError as e:
                        raise from_tcpxd(e, "transfer") from None
        ride = framed if xfer.plan.carries_notification else b""
        followup = None
        if framed and not ride:  # after every part: a WRITE between the mailboxes carries it alone
            if remote.mailbox_entry is None:
                remote.mailbox_entry = mailbox_entry(self._mailbox.id, remote.md.mailbox, self._notif_alone)
            body = mailbox_write(remote.mailbox_entry, framed, self._timeout_ms)
            followup = lambda s, sink: s._submit_encoded("write", [body], [sink])  # noqa: E731
        try:
            return xfer.post(session, ride, followup)
        except TcpxdError as e:
            raise from_tcpxd(e, "transfer") from None

    def _post_lane(self, xfer: Xfer, pr: _plan.Prepared) -> Optional[str]:
        """transfer() of a request made on a lane (make_prepped_xfer's fast path), the fast way:
        the session's prepared ids from the lane (bound again only when the lists' daemon ids
        changed); both sides' outer sums in the request, its frame joined in one C call; else both
        index arrays packed into a slot of the index ring (fewer than WINDOW_MIN a side: into the
        request), the request one bytes object in one frame. None, having sent nothing, where the
        general way must serve it: the remote agent removed, the lists not yet prepared on this
        session, no ring or no slot free."""
        if xfer.remote not in self._remotes:
            return None
        lane = pr.lane
        session = self._session
        if session is None or session._ended is not None or session._closed or session._why is not None or self._closed:
            session = self._session_now()
        ld, rd = lane.local.daemon, lane.remote.daemon  # (session, id) tuples: read without a lock
        bound = lane.bound
        if ld is bound[0] and rd is bound[1] and ld[0] is session:
            ids = bound[2]
        elif ld is not None and rd is not None and ld[0] is session and rd[0] is session:
            ids = lane.bind(ld, rd)
        else:
            return None
        fields = pr.fields
        if fields is not None:  # both sides as outer sums (`Lane.take`): a few KiB, framed in one C call
            note = xfer.note_field
            if note is None:
                note = xfer.note_field = _plan.note_field(lane.note_head, xfer.notif)  # type: ignore[arg-type]
            try:
                return xfer.post_one(session, lane.field, (ids, note, lane.tmo, fields), None, lane.key)
            except TcpxdError as e:
                raise from_tcpxd(e, "transfer") from None
        framed = xfer.framed
        if framed is None:
            framed = xfer.framed = lane.note_head + xfer.notif if xfer.notif else b""  # type: ignore[operator]
        head = ids + (b"\x2a" + _plan.V(len(framed)) + framed if framed else b"") + lane.tmo  # notification = 5
        if len(pr.li) < _indices.WINDOW_MIN:  # few indices: packed into the request
            pr.windowed = 0
            try:
                return xfer.post_one(session, lane.field, head + lane.packed(pr.li, pr.ri), None)
            except TcpxdError as e:
                raise from_tcpxd(e, "transfer") from None
        ring = self._windows if self._windows is not None else self._windows_now()
        got = ring.put(pr.li, pr.ri) if ring is not None else None
        if got is None or ring is None:
            return None
        slot, windows = got
        pr.windowed = 2
        try:
            return xfer.post_one(session, lane.field, head + windows, functools.partial(ring.give, slot))
        except BaseException as e:  # nothing was sent: the slot is free again
            ring.give(slot)
            if isinstance(e, TcpxdError):
                raise from_tcpxd(e, "transfer") from None
            raise

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        """"DONE", "PROC" or "ERR" (the handle's `error` says why). A transfer that cannot finish
        ends in "ERR" by its deadline (timeout_s, else the daemon's), or as soon as its peer is
        found gone."""
        xfer = handle._xfer if type(handle) is nixl_xfer_handle and handle._agent is self and not handle._released else self._live(handle)
        state = xfer.state
        if state == "PROC":  # read what the daemon sent, here: no wait for the session's reader thread
            session = xfer._session
            session.poll()
            state = xfer.state
            if state == "PROC" and TIGHT_SPIN_S != float("inf"):
                now = time.perf_counter()
                if now - self._checked_at >= TIGHT_S:  # not a tight loop (or its first poll)
                    self._spin_from = now
                elif now - self._spin_from >= TIGHT_SPIN_S:  # spun long enough: wait for the daemon
                    session.wait_readable(TIGHT_WAIT_MS)
                    session.poll()
                    state = xfer.state
                    now = time.perf_counter()
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
        remote = self._peer(remote_agent_name, "remote_agent_name")
        msg = _bytes(notif_msg, "notif_msg")
        with remote.notif_lock:
            prev = remote.notif_sent
            if prev is not None:
                remote.notif_sent = None
                err = prev.exception()  # at once when it is done (else waits: the order kept)
                if err is not None:
                    if isinstance(err, TcpxdError):
                        raise from_tcpxd(err, f"send_notif to {remote.md.name}: the previous notification to it failed "
                                              "(this one was not sent)") from None
                    raise nixlBackendError(f"send_notif to {remote.md.name}: the previous notification to it failed "
                                           f"({err!r}; this one was not sent)")
            entry = remote.mailbox_entry
            if entry is None:
                entry = remote.mailbox_entry = mailbox_entry(self._mailbox.id, remote.md.mailbox, self._notif_alone)
            body = mailbox_write(entry, frame(self.name, remote.md.name, msg), self._timeout_ms)
            sent: Any = self._inbox.post(body, remote.md.name)  # on the notification feed's session
            if sent is None:  # no local feed (a TCP endpoint, an older daemon): on the agent's session
                session = self._session_now()
                sent = notif_future(session, remote.md.name)
                try:
                    session._submit_frame("write", body, sent)
                except TcpxdError as e:  # the session was closed under us: nothing was sent
                    raise from_tcpxd(e, f"send_notif to {remote.md.name}") from None
            remote.notif_sent = sent

    def _notifs_sent(self, timeout: float) -> None:
        """Waits (up to `timeout` s in all) for the notifications still on their way: before the
        agent's session ends (closing it would cancel them)."""
        end = time.monotonic() + timeout
        with self._lock:
            remotes = list(self._remotes.values()) + ([self._self_remote[1]] if self._self_remote is not None else [])
        for remote in remotes:
            sent = remote.notif_sent
            if sent is not None and not sent.done():
                try:
                    sent.exception(max(0.0, end - time.monotonic()))
                except Exception:  # noqa: BLE001 - timed out, or the session ended: closing goes on
                    pass

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


def _notif_first(sent: Any) -> None:
    """Before a transfer whose notification goes to an agent a send_notif was just posted to:
    waits for that send_notif's answer, so the transfer's notification cannot arrive first (NIXL's
    keep that order: both ride one UCX endpoint; vLLM's prefix-hit send_notif, then the next
    request's READ with its own, relies on it). Its failure is the next send_notif's to raise."""
    if not sent.done():
        try:
            sent.exception()
        except Exception:  # noqa: BLE001 - a failure: raised by the next send_notif (and logged)
            pass


def _size(idx: Any) -> int:
    """The number of indices of a numpy array (0 for anything else: the outer form needs one)."""
    return idx.size if type(idx) is np.ndarray else int(idx.size) if isinstance(idx, np.ndarray) else 0


def _op(operation: Any) -> str:
    if operation not in ("WRITE", "READ"):
        raise nixlInvalidKeyError(f"operation: {operation!r} is neither \"WRITE\" nor \"READ\"")
    return str(operation)


