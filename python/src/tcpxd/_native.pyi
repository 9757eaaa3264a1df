"""Types of tcpxd._native (python/src/tcpxd/_native.c), the optional C pass."""

from typing import Any, Optional, Tuple

def outer(a: Any, rows: int, n: int, /) -> Optional[bytes]:
    """The OuterIndices message of `a` (C-contiguous 8-byte integers) when it is `rows` rows of
    vLLM's form with every index in [0, n); else None."""

def outer_fields(li: Any, ri: Any, lrows: int, ln: int, rrows: int, rn: int, /) -> Optional[bytes]:
    """outer(li, lrows, ln) and outer(ri, rrows, rn) as a prepared request's fields local_outer 8
    and remote_outer 9, when both are of the form and of one length; else None."""

def frame(tag: int, key: bytes, /, *pieces: bytes) -> bytes:
    """A local session's frame: the big-endian u32 length of the rest, the SessionRequest's tag
    (field 1), `key`, the pieces' length together as a varint, the pieces."""

def ring_put(mem: Any, at: int, k: int, before: int, frame: bytes, /) -> int:
    """Puts `frame`'s request (the frame less its length) in the request ring's slot at byte `at`
    as entry `k`, `before` socket frames before it; the ring's `spinning` word read after a
    sequentially consistent fence (0: ring the doorbell; tcpxd._ring)."""

def notif_put(
    mem: Any, at: int, limit: int, k: int, before: int, tag: int, head: bytes, msg: bytes, name: bytes, tail: bytes, /
) -> int:
    """send_notif's request (tag `tag`, a WriteRequest of `head`, the notification's length,
    `name`, `msg`, `tail`) written straight into the ring's slot at byte `at` as `ring_put` does;
    the `spinning` word after the fence, or -1 (nothing written) when it is over `limit` bytes."""

def desc_rows(descs: list, width: int, /) -> Optional[bytearray]:
    """The rows (address, length, device id) of a list of `width`-tuples whose first three fields
    are ints in [0, 2**64), packed as native u64s; None if any element is not such a tuple."""

def vma_kinds(addrs: Any, /) -> bytes:
    """Per address of `addrs` (a buffer of native u64s), the kind of mapping of this process
    holding it: 0 anonymous or private, 1 a shared mapping of a file, 2 none (PROCMAP_QUERY);
    raises OSError where the kernel has no PROCMAP_QUERY (before Linux 6.11)."""

def vma_ranges(addrs: Any, sizes: Any, /) -> bytes:
    """Per region (addrs[i], sizes[i]: buffers of native u64s), what registering it by address
    would find: 0 mapped and writable throughout, anonymous or private at its start; 1 a shared
    mapping of a file at its start; 2 its start not mapped; 3 a hole inside; 4 a mapping under it
    not writable (PROCMAP_QUERY); raises OSError where the kernel has no PROCMAP_QUERY."""

def vma_row(rows: Any, /) -> Optional[Tuple[int, int, int, int]]:
    """A registration list of one region in one call: (address, length, device id, kind) of
    `rows` (a C-contiguous buffer of three native u64s), `kind` as vma_ranges finds the range;
    None where `rows` is not that; raises OSError where the kernel has no PROCMAP_QUERY."""

def address_entries(addrs: Any, tails: list, entry_key: bytes, inner_key: bytes, /) -> bytes:
    """A RegisterBatchRequest's entries of memory registered by address: per region, its
    address (field 1 of the request) followed by tails[i], the rest of its serialized request."""

class Lone:
    """tcpxd.nixl's register_memory / deregister_memory of one DRAM region in one call each
    (_native_lone.c): LocalMemory's record class (`_Sent`), locks and tables, its registrar."""

    def __init__(self, cls: type, lock: Any, settling: Any, sent: list, sent_keys: dict, regions: dict, tails: dict,
                 tail_for: Any, registrar: Any, no_keys: list, no_addresses: Any, no_sizes: dict, /) -> None: ...

    def hold(self, dl: Any, /) -> bool:
        """register_memory of `dl` where it is a DRAM list of one region: checked (one
        PROCMAP_QUERY) and held back as the general path holds it; True where registered or held
        already; False, nothing changed, where it is not that."""

    def withdraw(self, dl: Any, /) -> bool:
        """deregister_memory of `dl` where it is a DRAM list of one region held alone and not sent
        yet: taken back (True); False, nothing changed, where it is not that."""

def quiet_wait(polled: Any, quiet: float, /) -> None:
    """Sleeps, the GIL released, until time.monotonic() has passed polled[0] + quiet, polled[0]
    read again after each sleep (other threads move it on); at once when it has passed."""
