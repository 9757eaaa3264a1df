"""`python -m tcpxd.nixl install-shim DIR`: writes a `nixl` package into DIR whose modules are
tcpxd.nixl's, so a stack that imports NIXL by name (`from nixl._api import nixl_agent`,
`from nixl._bindings import nixlXferTelemetry`, `from nixl import nixl_agent`,
`from nixl.logging import get_logger`, `import nixl._utils`) gets tcpxd's agent when DIR is on its PYTHONPATH (or is
site-packages). Nothing else changes; remove DIR/nixl to go back."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional

MARK = "# written by `python -m tcpxd.nixl install-shim`: NIXL's names resolved to tcpxd.nixl\n"


def _alias(module: str) -> str:
    """A module of the shim that *is* tcpxd's module (the same object in sys.modules), so what a
    test patches on it (`monkeypatch.setattr(nixl._bindings, "nixlAgent", ...)`) the agent sees."""
    return MARK + f"import sys\n\nfrom {module.rpartition('.')[0]} import {module.rpartition('.')[2]} as _m\n\nsys.modules[__name__] = _m\n"


FILES: Dict[str, str] = {
    "__init__.py": MARK + "from tcpxd.nixl import *  # noqa: F401,F403\n"
    "from tcpxd.nixl import DEFAULT_COMM_PORT, nixl_agent, nixl_agent_config, nixl_backend_handle  # noqa: F401\n"
    "from tcpxd.nixl import nixl_prepped_dlist_handle, nixl_thread_sync_t, nixl_xfer_handle  # noqa: F401\n",
    "_api.py": MARK + "from tcpxd.nixl import *  # noqa: F401,F403\n"
    "from tcpxd.nixl import DEFAULT_COMM_PORT, nixl_agent, nixl_agent_config, nixl_backend_handle  # noqa: F401\n"
    "from tcpxd.nixl import nixl_prepped_dlist_handle, nixl_thread_sync_t, nixl_xfer_handle  # noqa: F401\n"
    "from tcpxd.nixl import _bindings as nixlBind  # noqa: F401\n",
    "_bindings.py": _alias("tcpxd.nixl._bindings"),
    "_utils.py": _alias("tcpxd.nixl._utils"),
    "logging.py": _alias("tcpxd.nixl.logging"),
}


def install(target: Path, force: bool) -> Path:
    pkg = target / "nixl"
    if pkg.exists() and not force:
        init = pkg / "__init__.py"
        if not (init.exists() and init.read_text().startswith(MARK)):
            raise SystemExit(f"{pkg} exists and is not a tcpxd shim (a real NIXL?); pass --force to overwrite it")
    pkg.mkdir(parents=True, exist_ok=True)
    for name, text in FILES.items():
        (pkg / name).write_text(text)
    return pkg


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tcpxd.nixl")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("install-shim", help="write a `nixl` package resolving to tcpxd.nixl into DIR")
    s.add_argument("dir", type=Path, help="a directory to put on PYTHONPATH (or site-packages)")
    s.add_argument("--force", action="store_true", help="overwrite an existing nixl package there")
    a = p.parse_args(argv)
    pkg = install(a.dir, a.force)
    print(f"wrote {pkg}; use it with: PYTHONPATH={a.dir.resolve()}${{PYTHONPATH:+:$PYTHONPATH}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
