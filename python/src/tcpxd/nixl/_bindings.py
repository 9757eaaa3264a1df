"""What NIXL's Python package exports from its C++ bindings (`nixl._bindings`), on tcpxd.

The names NIXL's Python API takes or returns and that its examples and tests use: the memory types
(`DRAM_SEG`, `VRAM_SEG`, ...), operations, statuses and thread-sync modes, the descriptor lists
(`nixlXferDList`, `nixlRegDList`, `nixlRemoteDList`), `nixlXferTelemetry`, the twelve exception
types, and `nixlAgentConfig` / `nixlAgent`: the object a `nixl_agent` holds as `.agent`, made
through this module's attribute as NIXL's is (so a test may monkeypatch `nixl._bindings.nixlAgent`).
`nixlAgent` also answers the C++ agent's calls that NIXL's binding tests make (`registerMem`,
`createXferReq`, `postXferReq`, `getNotifs`, ...), each carried by the same tcpxd agent.

The shim (`python -m tcpxd.nixl install-shim`) makes `nixl._bindings` this very module.
"""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from ._descs import RegDList as nixlRegDList
from ._descs import RemoteDList as nixlRemoteDList
from ._descs import XferDList as nixlXferDList
from ._descs import nixl_mem_t
from ._errors import (
    nixlBackendError,
    nixlCancelledError,
    nixlInvalidParamError,
    nixlInvalidValueError,
    nixlMismatchError,
    nixlNoTelemetryError,
    nixlNotAllowedError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRemoteDisconnectError,
    nixlRepostActiveError,
    nixlUnknownError,
)
from ._handles import DEFAULT_COMM_PORT, NIXL_INIT_AGENT, nixl_thread_sync_t
from ._xfer import nixlXferTelemetry

if TYPE_CHECKING:
    from ._agent import nixl_agent

#: NIXL's device API (prep_mem_view): not provided by tcpxd.
HAVE_UCX_GPU_DEVICE_API = False

DRAM_SEG = nixl_mem_t.DRAM_SEG
VRAM_SEG = nixl_mem_t.VRAM_SEG
BLK_SEG = nixl_mem_t.BLK_SEG
OBJ_SEG = nixl_mem_t.OBJ_SEG
FILE_SEG = nixl_mem_t.FILE_SEG

NIXL_THREAD_SYNC_NONE = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE.value
NIXL_THREAD_SYNC_STRICT = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT.value
NIXL_THREAD_SYNC_RW = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW.value
NIXL_THREAD_SYNC_DEFAULT = nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT.value

#: Operations (nixl_xfer_op_t): the names nixl_agent takes.
NIXL_READ = "READ"
NIXL_WRITE = "WRITE"

#: estimate_xfer_cost's method (nixl_cost_t); tcpxd has no cost model.
NIXL_COST_ANALYTICAL_BACKEND = 0

#: Statuses (nixl_status_t), as NIXL numbers them.
NIXL_IN_PROG = 1
NIXL_SUCCESS = 0
NIXL_ERR_NOT_POSTED = -1
NIXL_ERR_INVALID_PARAM = -2
NIXL_ERR_BACKEND = -3
NIXL_ERR_NOT_FOUND = -4
NIXL_ERR_MISMATCH = -5
NIXL_ERR_NOT_ALLOWED = -6
NIXL_ERR_REPOST_ACTIVE = -7
NIXL_ERR_UNKNOWN = -8
NIXL_ERR_NOT_SUPPORTED = -9
NIXL_ERR_REMOTE_DISCONNECT = -10
NIXL_ERR_CANCELED = -11
NIXL_ERR_NO_TELEMETRY = -12

_STATES = {"DONE": NIXL_SUCCESS, "PROC": NIXL_IN_PROG}


class nixlAgentConfig:  # noqa: N801 - NIXL's name
    """The C++ agent's configuration, with its fields and positional constructor (use_prog_thread,
    use_listen_thread, port, sync_mode, num_workers, pthr_delay_us, lthr_delay_us,
    capture_telemetry, etcd_watch_timeout)."""

    def __init__(self, useProgThread: bool = True, useListenThread: bool = False, listenPort: int = 0,  # noqa: N803
                 syncMode: int = NIXL_THREAD_SYNC_DEFAULT, numWorkers: int = 1, pthrDelay: int = 0,
                 lthrDelay: int = 100000, captureTelemetry: bool = False, etcdWatchTimeout: int = 5000000):
        self.useProgThread = useProgThread
        self.useListenThread = useListenThread
        self.listenPort = listenPort
        self.syncMode = syncMode
        self.numWorkers = numWorkers
        self.pthrDelay = pthrDelay
        self.lthrDelay = lthrDelay
        self.captureTelemetry = captureTelemetry
        self.etcdWatchTimeout = etcdWatchTimeout


def telemetry_enabled(capture: bool) -> bool:
    """Whether an agent keeps telemetry, as NIXL decides: NIXL_TELEMETRY_ENABLE when set (y, yes,
    on, 1, true, enable / n, no, off, 0, false, disable), else the config's capture flag."""
    env = os.environ.get("NIXL_TELEMETRY_ENABLE")
    if env is None:
        return bool(capture)
    v = env.strip().lower()
    if v in ("y", "yes", "on", "1", "true", "enable"):
        return True
    if v in ("n", "no", "off", "0", "false", "disable"):
        return False
    raise nixlInvalidParamError(f"NIXL_TELEMETRY_ENABLE: {env!r} is neither a yes (y, yes, on, 1, true, enable) "
                                "nor a no (n, no, off, 0, false, disable)")


class nixlAgent:  # noqa: N801 - NIXL's name
    """The agent a `nixl_agent` is made on (`nixl_agent.agent`), as NIXL's C++ agent: named (an
    empty name raises ValueError, as NIXL's std::invalid_argument), configured by nixlAgentConfig.

    Made alone (NIXL's binding tests do), its C++-style calls make a tcpxd agent of that name on
    the node's daemon ($TCPXD_ENDPOINT) on first use; made by a `nixl_agent`, they are that agent's.
    Handles are integers, as the binding's."""

    def __init__(self, name: str, config: Optional[nixlAgentConfig] = None):
        if not isinstance(name, str):
            raise TypeError(f"nixlAgent: the name is a str, got {type(name).__name__}")
        if not name or name == NIXL_INIT_AGENT:
            raise nixlInvalidValueError(f"agent_name: {name!r} cannot name an agent (Agent needs a non-empty name)")
        self.name = name
        self.config = config if config is not None else nixlAgentConfig()
        self._owner: Optional["weakref.ReferenceType[nixl_agent]"] = None
        self._core: Optional["nixl_agent"] = None  # the agent this one made for itself (held)
        self._handles: Dict[int, Any] = {}
        self._backends: Dict[int, str] = {}

    def _attach(self, agent: "nixl_agent") -> None:
        self._owner = weakref.ref(agent)

    def _agent(self) -> "nixl_agent":
        a = self._owner() if self._owner is not None else None
        if a is None:
            from ._agent import nixl_agent
            from ._handles import nixl_agent_config

            c = self.config
            conf = nixl_agent_config(enable_prog_thread=bool(c.useProgThread), enable_listen_thread=bool(c.useListenThread),
                                     listen_port=int(c.listenPort), capture_telemetry=bool(c.captureTelemetry), backends=[])
            a = self._core = nixl_agent(self.name, conf, _binding=self)
        return a

    # -- plugins and backends

    def getAvailPlugins(self) -> List[str]:  # noqa: N802
        return self._agent().get_plugin_list()

    def getPluginParams(self, plugin: str) -> Tuple[Dict[str, str], List[str]]:  # noqa: N802
        a = self._agent()
        if plugin not in a.plugin_list:
            raise nixlNotFoundError(f"plugin: {plugin!r} is not available (tcpxd.nixl has {', '.join(a.plugin_list)})")
        return {}, a.get_plugin_mem_types(plugin)

    def createBackend(self, plugin: str, params: Optional[Dict[str, str]] = None) -> int:  # noqa: N802
        a = self._agent()
        a.create_backend(plugin, params or {})
        h = a.backends[plugin]
        self._backends[h] = plugin
        return h

    def getBackendParams(self, backend: int) -> Tuple[Dict[str, str], List[str]]:  # noqa: N802
        name = self._backends.get(backend) or next((k for k, v in self._agent().backends.items() if v == backend), None)
        if name is None:
            raise nixlNotFoundError(f"backend: no backend {backend!r} on this agent")
        return {}, self._agent().get_backend_mem_types(name)

    # -- memory and metadata

    def registerMem(self, descs: nixlRegDList, backends: Optional[List[int]] = None) -> int:  # noqa: N802
        self._agent().register_memory(descs)
        return NIXL_SUCCESS

    def deregisterMem(self, descs: nixlRegDList, backends: Optional[List[int]] = None) -> int:  # noqa: N802
        self._agent().deregister_memory(descs)
        return NIXL_SUCCESS

    def getLocalMD(self) -> bytes:  # noqa: N802
        return self._agent().get_agent_metadata()

    def loadRemoteMD(self, metadata: bytes) -> bytes:  # noqa: N802
        return self._agent().add_remote_agent(metadata)

    def invalidateRemoteMD(self, agent: str) -> int:  # noqa: N802
        self._agent().remove_remote_agent(agent)
        return NIXL_SUCCESS

    def checkRemoteMD(self, agent: str, descs: Any = None) -> int:  # noqa: N802
        ok = self._agent().check_remote_metadata(agent, None if descs is None or not len(descs) else descs)
        return NIXL_SUCCESS if ok else NIXL_ERR_NOT_FOUND

    def makeConnection(self, agent: str, backends: Optional[List[int]] = None) -> int:  # noqa: N802
        self._agent().make_connection(agent)
        return NIXL_SUCCESS

    # -- transfers and notifications

    def createXferReq(self, op: str, local: nixlXferDList, remote: nixlXferDList, agent: str,  # noqa: N802
                      notif: Any = b"", backends: Optional[List[int]] = None) -> int:
        h = self._agent().initialize_xfer(op, local, remote, agent, notif)
        self._handles[h._handle] = h
        return h._handle

    def _xfer(self, handle: int) -> Any:
        h = self._handles.get(handle)
        if h is None:
            raise nixlNotFoundError(f"handle: no transfer request {handle!r} on this agent")
        return h

    def _status(self, handle: int, state: str) -> int:
        st = _STATES.get(state)
        if st is None:  # "ERR": raised, as NIXL's binding raises a failed status
            err = self._xfer(handle).error
            raise err if isinstance(err, BaseException) else nixlBackendError("the transfer failed")
        return st

    def postXferReq(self, handle: int, notif: Any = b"") -> int:  # noqa: N802
        return self._status(handle, self._agent().transfer(self._xfer(handle), notif))

    def getXferStatus(self, handle: int) -> int:  # noqa: N802
        return self._status(handle, self._agent().check_xfer_state(self._xfer(handle)))

    def getXferTelemetry(self, handle: int) -> nixlXferTelemetry:  # noqa: N802
        return self._agent().get_xfer_telemetry(self._xfer(handle))

    def releaseXferReq(self, handle: int) -> int:  # noqa: N802
        self._xfer(handle).release()
        del self._handles[handle]
        return NIXL_SUCCESS

    def genNotif(self, agent: str, msg: Any, backend: Optional[int] = None) -> int:  # noqa: N802
        self._agent().send_notif(agent, msg)
        return NIXL_SUCCESS

    def getNotifs(self, notifs: Optional[Dict[str, List[bytes]]] = None,  # noqa: N802
                  backends: Optional[List[int]] = None) -> Dict[str, List[bytes]]:
        out = notifs if notifs is not None else {}
        for k, v in self._agent().get_new_notifs().items():
            out.setdefault(k, []).extend(v)
        return out


__all__ = [
    "BLK_SEG", "DEFAULT_COMM_PORT", "DRAM_SEG", "FILE_SEG", "HAVE_UCX_GPU_DEVICE_API", "NIXL_COST_ANALYTICAL_BACKEND",
    "NIXL_ERR_BACKEND", "NIXL_ERR_CANCELED", "NIXL_ERR_INVALID_PARAM", "NIXL_ERR_MISMATCH", "NIXL_ERR_NOT_ALLOWED",
    "NIXL_ERR_NOT_FOUND", "NIXL_ERR_NOT_POSTED", "NIXL_ERR_NOT_SUPPORTED", "NIXL_ERR_NO_TELEMETRY",
    "NIXL_ERR_REMOTE_DISCONNECT", "NIXL_ERR_REPOST_ACTIVE", "NIXL_ERR_UNKNOWN", "NIXL_INIT_AGENT", "NIXL_IN_PROG",
    "NIXL_READ", "NIXL_SUCCESS", "NIXL_THREAD_SYNC_DEFAULT", "NIXL_THREAD_SYNC_NONE", "NIXL_THREAD_SYNC_RW",
    "NIXL_THREAD_SYNC_STRICT", "NIXL_WRITE", "OBJ_SEG", "VRAM_SEG", "nixlAgent", "nixlAgentConfig", "nixlBackendError",
    "nixlCancelledError", "nixlInvalidParamError", "nixlMismatchError", "nixlNoTelemetryError", "nixlNotAllowedError",
    "nixlNotFoundError", "nixlNotPostedError", "nixlNotSupportedError", "nixlRegDList", "nixlRemoteDList",
    "nixlRemoteDisconnectError", "nixlRepostActiveError", "nixlUnknownError", "nixlXferDList", "nixlXferTelemetry",
    "nixl_mem_t", "nixl_thread_sync_t", "telemetry_enabled",
]
