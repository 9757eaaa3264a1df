"""Types of tcpxd._native (python/src/tcpxd/_native.c), the optional C pass."""

from typing import Any, Optional, Tuple

def outer(a: Any, rows: int, n: int, /) -> Optional[bytes]:
    """The OuterIndices message of `a` (C-contiguous 8-byte integers) when it is `rows` rows of
    vLLM's form with every index in [0, n); else None."""

def outer_pair(li: Any, ri: Any, lrows: int, ln: int, rrows: int, rn: int, /) -> Optional[Tuple[bytes, bytes, bytes]]:
    """(outer(li, lrows, ln), outer(ri, rrows, rn), both as the request's fields local_outer and
    remote_outer) when both are of the form and of one length; else None."""
