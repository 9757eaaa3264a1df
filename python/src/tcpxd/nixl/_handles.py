"""What the agent hands out and is made with: nixl_agent_config, and the handles of prepared
lists and transfers (`nixl_prepped_dlist_handle`, `nixl_xfer_handle`), with NIXL's names and
constants. The agent itself is tcpxd.nixl._agent."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from . import _plan
from ._errors import nixlInvalidParamError
from ._xfer import Xfer

if TYPE_CHECKING:
    from ._agent import nixl_agent

#: The agent name prep_xfer_dlist takes for the local side.
NIXL_INIT_AGENT = "NIXL_INIT_AGENT"
#: NIXL's default port for the metadata listener.
DEFAULT_COMM_PORT = 8888
#: What get_plugin_list() reports besides the backends a config names: this module.
PLUGIN = "TCPXD"
#: NIXL's network plugins, whose part tcpxd plays: the plugins an agent reports besides PLUGIN
#: (get_plugin_list), each a backend create_backend makes. Any other name (a storage plugin, a
#: typo) is a plugin this agent does not have: create_backend raises nixlNotFoundError, and a
#: config naming it skips it with a warning, as NIXL does.
NETWORK_PLUGINS = ("UCX", "LIBFABRIC", "UCCL", "MOONCAKE")
#: NIXL's storage plugins: named in create_backend's refusal (tcpxd moves memory, not storage).
STORAGE_PLUGINS = frozenset({"GDS", "GDS_MT", "POSIX", "OBJ", "HF3FS", "GUSLI", "AZURE_BLOB", "GPUNETIO"})


class nixl_thread_sync_t(Enum):  # noqa: N801 - NIXL's name
    """Accepted for compatibility: a tcpxd.nixl agent is always thread-safe."""

    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 3


class nixl_agent_config:  # noqa: N801
    """NIXL's agent configuration, plus tcpxd's own keywords: `endpoint` (the daemon: default
    $TCPXD_ENDPOINT, else unix:/run/tcpxd/tcpxd.sock), `timeout_s` (each transfer's deadline,
    default the daemon's transfer.default_timeout_s) and `close_notifs_s` (how long close() waits
    for notifications still on their way before cancelling them: default
    $TCPXD_NIXL_CLOSE_NOTIFS_S, else 5; docs/NIXL.md). enable_prog_thread and num_threads mean
    nothing here (the daemon progresses transfers); backends name the NIXL backends this agent
    stands in for (reported by get_plugin_list)."""

    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = DEFAULT_COMM_PORT,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: Optional[List[str]] = None,
        sync_mode: Optional[nixl_thread_sync_t] = None,
        *,
        endpoint: Optional[str] = None,
        timeout_s: Optional[float] = None,
        close_notifs_s: Optional[float] = None,
    ):
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(f"sync_mode must be a nixl_thread_sync_t (got {type(sync_mode).__name__!r})")
        if timeout_s is not None and not timeout_s > 0:
            raise nixlInvalidParamError(f"timeout_s: {timeout_s!r} is not a positive number of seconds")
        if close_notifs_s is not None and not close_notifs_s >= 0:
            raise nixlInvalidParamError(f"close_notifs_s: {close_notifs_s!r} is not a number of seconds (0 or more)")
        self.backends = list(backends) if backends is not None else ["UCX"]
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.sync_mode = sync_mode
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.close_notifs_s = close_notifs_s


class nixl_prepped_dlist_handle:  # noqa: N801
    """A prepared descriptor list (prep_xfer_dlist). It holds the list (`_prepped`, None once
    released) and the lanes of the prepared path from it (`_lanes`, _plan.Lane by (operation,
    remote handle, skip_desc_merge), kept by `nixl_agent._keep_lane` and taken by
    make_prepped_xfer)."""

    __slots__ = ("_handle", "_agent", "_released", "_prepped", "_lanes")

    def __init__(self, agent: "nixl_agent", value: int, prepped: _plan.Prepped):
        self._handle = int(value)
        self._agent = agent
        self._released = False
        self._prepped: Optional[_plan.Prepped] = prepped
        self._lanes: Dict[Any, _plan.Lane] = {}

    def __repr__(self) -> str:
        return f"nixl_prepped_dlist_handle(0x{self._handle:x}, released={self._released})"

    def release(self) -> None:
        if not self._released:
            prepped, self._prepped = self._prepped, None
            self._released = True
            self._lanes.clear()
            if prepped is not None:
                self._agent._unprepare(prepped)


class nixl_xfer_handle:  # noqa: N801
    """A transfer request (make_prepped_xfer, initialize_xfer): post it with transfer(), poll it
    with check_xfer_state(). `error` says why it ended in "ERR" (tcpxd's addition)."""

    __slots__ = ("_handle", "_agent", "_released", "_xfer")

    def __init__(self, agent: "nixl_agent", value: int, xfer: Xfer):
        self._handle = int(value)
        self._agent = agent
        self._released = False
        self._xfer = xfer

    def __repr__(self) -> str:
        return f"nixl_xfer_handle(0x{self._handle:x}, released={self._released})"

    @property
    def error(self) -> Optional[BaseException]:
        return self._xfer.error

    def release(self) -> None:
        if not self._released:
            self._xfer.release()
            self._released = True

    def __del__(self) -> None:
        if not self._released:
            try:
                self.release()
            except Exception:  # noqa: BLE001 - best effort, as NIXL's
                pass
