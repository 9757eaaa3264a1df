"""`python -m tcpxd.nixl install-shim DIR`: writes a `nixl` package into DIR whose modules are
tcpxd.nixl's, so a stack that imports NIXL by name (`from nixl._api import nixl_agent`,
`from nixl._bindings import nixlXferTelemetry`, `from nixl import nixl_agent`,
`from nixl.logging import get_logger`) gets tcpxd's agent when DIR is on its PYTHONPATH (or is
site-packages). Nothing else changes; remove DIR/nixl to go back."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional

MARK = "# written by `python -m tcpxd.nixl install-shim`: NIXL's names resolved to tcpxd.nixl\n"

FILES: Dict[str, str] = {
    "__init__.py": MARK + "from tcpxd.nixl import *  # noqa: F401,F403\nfrom tcpxd.nixl import nixl_agent, nixl_agent_config  # noqa: F401\n",
    "_api.py": MARK + "from tcpxd.nixl import *  # noqa: F401,F403\n",
    "_bindings.py": MARK + "from tcpxd.nixl import *  # noqa: F401,F403\nfrom tcpxd.nixl import nixlXferTelemetry  # noqa: F401\n",
    "logging.py": MARK + "import logging as _logging\n\n\ndef get_logger(name: str) -> _logging.Logger:\n    return _logging.getLogger(name)\n",
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
