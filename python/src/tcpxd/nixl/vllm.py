"""vLLM's NixlConnector on tcpxd, with no change to vLLM and no NIXL installed:

    vllm serve MODEL --kv-transfer-config \\
      '{"kv_connector":"TcpxdNixlConnector","kv_connector_module_path":"tcpxd.nixl.vllm","kv_role":"kv_both"}'

vLLM imports this module (in each process that builds a connector) for the class the config
names. Importing it imports vLLM's NIXL connector modules and points the names they bound at
import time (NixlWrapper, nixl_agent_config, nixlXferTelemetry) at tcpxd.nixl, as vLLM's own tests
swap NixlWrapper for a fake; TcpxdNixlConnector is vLLM's NixlConnector itself, under a name the
connector factory does not know, so it loads it from here. The single-module connector
(vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py), the package form (.../v1/nixl/)
and vllm/distributed/nixl_utils.py (where the newest binds them) are handled.

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

#: Where vLLM binds NIXL's names: every module under this is looked at once the ones below are imported.
SCOPE = "vllm.distributed"
PREFIX = "vllm.distributed.kv_transfer.kv_connector.v1"
#: vLLM's NIXL modules across versions (the single-module connector; the package form and its
#: workers; the shared vllm.distributed.nixl_utils of the newest).
MODULES = (f"{PREFIX}.nixl_connector", "vllm.distributed.nixl_utils", f"{PREFIX}.nixl", f"{PREFIX}.nixl.utils",
           f"{PREFIX}.nixl.worker", f"{PREFIX}.nixl.base_worker", f"{PREFIX}.nixl.pull_worker",
           f"{PREFIX}.nixl.push_worker", f"{PREFIX}.nixl.connector")
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
        if mod is None or not mod_name.startswith(SCOPE):
            continue
        hit = False
        for attr, value in NAMES.items():
            if attr in vars(mod):
                setattr(mod, attr, value)
                hit = True
        for cls in list(vars(mod).values()):  # the worker classes that allocate host staging
            if isinstance(cls, type) and cls.__module__ == mod_name and "initialize_host_xfer_buffer" in vars(cls):
                cls.initialize_host_xfer_buffer = _shared_host_buffers(vars(cls)["initialize_host_xfer_buffer"])  # type: ignore[attr-defined]
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
