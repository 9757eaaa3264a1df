"""NIXL's Python agent, carried by the node's tcpxd.

    from tcpxd.nixl import nixl_agent, nixl_agent_config     # in place of nixl._api

The serving stacks' NIXL calls (vLLM's NixlConnector, SGLang's nixl backend, NIXL's own examples)
work unchanged; `python -m tcpxd.nixl install-shim DIR` writes a `nixl` package into DIR that
resolves `from nixl._api import nixl_agent` here, for stacks that import NIXL by name. What is
supported, and how it differs from NIXL: docs/NIXL.md.
"""

from ._agent import nixl_agent
from ._descs import RegDList as nixlRegDList
from ._descs import XferDList as nixlXferDList
from ._errors import (
    nixlBackendError,
    nixlCancelledError,
    nixlInvalidParamError,
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
from ._handles import (
    DEFAULT_COMM_PORT,
    NIXL_INIT_AGENT,
    nixl_agent_config,
    nixl_prepped_dlist_handle,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)
from ._memory import host_array
from ._xfer import nixlXferTelemetry

#: NIXL's backend handle type (an integer; not passed to the user).
nixl_backend_handle = int

__all__ = [
    "DEFAULT_COMM_PORT",
    "host_array",
    "NIXL_INIT_AGENT",
    "nixlBackendError",
    "nixlCancelledError",
    "nixlInvalidParamError",
    "nixlMismatchError",
    "nixlNoTelemetryError",
    "nixlNotAllowedError",
    "nixlNotFoundError",
    "nixlNotPostedError",
    "nixlNotSupportedError",
    "nixlRegDList",
    "nixlRemoteDisconnectError",
    "nixlRepostActiveError",
    "nixlUnknownError",
    "nixlXferDList",
    "nixlXferTelemetry",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
]
