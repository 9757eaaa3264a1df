"""`native`: the package's optional C extension (tcpxd._native, python/src/tcpxd/_native.c) where
it is built and not turned off by TCPXD_NATIVE=0; else None, and the Python paths do the same work.

One place decides, so the session's framing (tcpxd._session) and the NIXL agent's index pass
(tcpxd.nixl._indices) are on or off together."""

from __future__ import annotations

import os
from types import ModuleType
from typing import Optional

native: Optional[ModuleType]
try:
    from . import _native as native
except ImportError:  # not built here (no C compiler or Python headers at install)
    native = None
if os.environ.get("TCPXD_NATIVE", "") == "0":
    native = None
