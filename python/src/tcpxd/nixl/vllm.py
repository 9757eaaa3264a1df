"""vLLM's NixlConnector on tcpxd, with no change to vLLM and no NIXL installed:

    vllm serve MODEL --kv-transfer-config \\
      '{"kv_connector":"TcpxdNixlConnector","kv_connector_module_path":"tcpxd.nixl.vllm","kv_role":"kv_both"}'

vLLM imports this module (in each process that builds a connector) for the class the config
names. Importing it imports vLLM's NIXL connector modules and points the names they bound at
import time (NixlWrapper, nixl_agent_config, nixlXferTelemetry) at tcpxd.nixl, as vLLM's own tests
swap NixlWrapper for a fake; TcpxdNixlConnector is vLLM's NixlConnector itself, under a name the
connector factory does not know, so it loads it from here. Both the single-module connector
(vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py) and the package form
(.../v1/nixl/) are handled.

With `"kv_buffer_device": "cpu"` vLLM stages the KV cache in host tensors it allocates with
torch.empty (anonymous memory, which the daemon cannot map); the worker's
initialize_host_xfer_buffer is wrapped to move them into shared memory (`share_memory_()`, before
they are registered), so host staging works too.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, List

from . import nixl_agent, nixl_agent_config, nixlXferTelemetry

PREFIX = "vllm.distributed.kv_transfer.kv_connector.v1"
MODULES = (f"{PREFIX}.nixl_connector", f"{PREFIX}.nixl", f"{PREFIX}.nixl.utils", f"{PREFIX}.nixl.worker",
           f"{PREFIX}.nixl.connector")
NAMES = {"NixlWrapper": nixl_agent, "nixl_agent_config": nixl_agent_config, "nixlXferTelemetry": nixlXferTelemetry}


def patch() -> List[str]:
    """Imports vLLM's NIXL connector modules and rebinds their NIXL names to tcpxd.nixl; returns
    the modules changed."""
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
    changed = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith(PREFIX):
            continue
        hit = False
        for attr, value in NAMES.items():
            if attr in vars(mod):
                setattr(mod, attr, value)
                hit = True
        worker = vars(mod).get("NixlConnectorWorker")
        if worker is not None and hasattr(worker, "initialize_host_xfer_buffer"):
            worker.initialize_host_xfer_buffer = _shared_host_buffers(worker.initialize_host_xfer_buffer)
            hit = True
        if hit:
            changed.append(mod_name)
    return changed


def _shared_host_buffers(init: Any) -> Any:
    """initialize_host_xfer_buffer, then its host tensors moved into shared memory."""
    if getattr(init, "_tcpxd_shared", False):
        return init

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = init(self, *args, **kwargs)
        for t in getattr(self, "host_xfer_buffers", {}).values():
            t.share_memory_()
        return out

    wrapper._tcpxd_shared = True  # type: ignore[attr-defined]
    return wrapper


def _connector() -> Any:
    patched = patch()
    for name in (f"{PREFIX}.nixl", f"{PREFIX}.nixl_connector"):
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "NixlConnector"):
            return mod.NixlConnector
    raise ImportError(f"tcpxd.nixl.vllm: no vLLM NixlConnector found (vLLM not installed? patched: {patched})")


TcpxdNixlConnector = _connector()
