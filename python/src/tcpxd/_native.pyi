"""Types of tcpxd._native (python/src/tcpxd/_native.c), the optional C pass."""

from typing import Any, Optional, Tuple

def outer(a: Any, rows: int, n: int, /) -> Optional[Tuple[int, int, bytes]]:
    """(k, s, cols) when `a` (C-contiguous 8-byte integers) is `rows` rows of the outer form with
    every index in [0, n); else None."""
