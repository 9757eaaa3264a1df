"""A framed local session's request ring: memory this process writes and the daemon reads, where a
request goes instead of a `sendmsg`, and the daemon's poller looks for it on every pass while it
spins — no system call on either side (docs/API.md, "The request ring"; the daemon's side and the
memory's layout: crates/tcpxd/src/api/local/ring.rs).

The client makes the ring (a memfd sealed against shrinking and growing, 64 + SLOTS × SLOT_BYTES
bytes), sends it with `attach_request_ring` (SCM_RIGHTS) right after the session's board, and keeps
it if the daemon answers `request_ring_attached`; a daemon that predates it, or has
`runtime.request_ring` off, refuses and the session sends on the socket as before.

Which requests go there: one frame at a time, small enough for a slot (SLOT_BYTES - 32 bytes of
request), while a slot is free; everything else goes on the socket — requests with file
descriptors, bursts of frames, large ones, and any when the ring is full. One order across both:
each entry says how many socket frames the client sent before it (`sent`, counted by every caller
that sends on the socket once the ring is attached), and the daemon takes an entry only after
those frames, and every entry before a socket frame before that frame.

Where the daemon's poller may be parked (the ring's `spinning` word is 0) a request goes on the
socket, which wakes it in one step; where it said it spins but is 0 after the entry is written
(read across a fence that only C can make: `_native.ring_put`), the caller rings the doorbell:
DOORBELL on the socket, which wakes the session (and a parked poller) as a request would, and is
not counted. So no request sits unseen, and the ring costs nothing where the poller parks. Without
the C pass (`_native`), no ring.

Used where the board is (the package's 8-CPU rule, TCPXD_BOARD_SLOTS): a client whose calls wait on
the socket gains nothing from it. TCPXD_RING_SLOTS sets its slots (0: no ring).
"""

from __future__ import annotations

import logging
import os
import struct
from typing import Any, Optional

from . import _proto
from ._board import sealed_memfd
from ._native_gate import native

log = logging.getLogger("tcpxd")

#: Slots of a ring and bytes of a slot (a request of up to SLOT_BYTES - 32 bytes fits: a 4 KiB
#: transfer's request is ~60-150 bytes, tcpxd.nixl's prepared one a few hundred). TCPXD_RING_SLOTS
#: (a power of two, 16 to 2,048: the daemon takes rings of at most 1 MiB) sets the slots; 0 makes
#: no ring (`slots_wanted`).
SLOTS = 64
SLOT_BYTES = 512
HEADER_BYTES = 64
SLOT_HEAD = 32

_U64 = struct.Struct("<Q")

#: The doorbell frame: a SessionRequest of ring_doorbell = true (field 841), tag 0.
DOORBELL = struct.pack(">I", 3) + bytes([0xC8, 0x34, 0x01])

_put = native.ring_put if native is not None else None
_notif_put = getattr(native, "notif_put", None)  # (None: an older build of the C pass)
_told = False


def slots_wanted() -> int:
    """The slots of a new session's ring (where it has a board): TCPXD_RING_SLOTS, else SLOTS; 0
    (no ring) without the C pass."""
    if _put is None:
        return 0
    v = os.environ.get("TCPXD_RING_SLOTS", "")
    try:
        n = int(v) if v else SLOTS
    except ValueError:
        return SLOTS
    return n if n == 0 or (16 <= n <= 2048 and n & (n - 1) == 0) else SLOTS


def wanted() -> bool:
    """Whether a session with a board attaches a ring (`slots_wanted`)."""
    return slots_wanted() > 0


def _refused(why: str) -> None:
    global _told
    if not _told:
        _told = True
        log.info("tcpxd: the daemon's sessions take no request ring (%s); requests go on the socket", why)


class Ring:
    """The client's mapping of a request ring (`fd`, to send with `attach_request_ring`, closed by
    `sent_fd()`). Callers serialize `put` and the socket sends they count (`sent`): the session's
    send lock, a connection's one thread."""

    __slots__ = ("mem", "fd", "slots", "cap", "written", "taken", "sent", "doorbells")

    def __init__(self, slots: int = SLOTS, slot_bytes: int = SLOT_BYTES):
        size = HEADER_BYTES + slots * slot_bytes
        fd, self.mem = sealed_memfd("tcpxd-ring", size)
        self.fd: Optional[int] = fd
        self.slots = slots
        #: The longest frame a slot takes (its 4-byte length included).
        self.cap = slot_bytes - SLOT_HEAD + 4
        #: Entries written; the daemon's `taken` as last read.
        self.written = 0
        self.taken = 0
        #: Socket frames sent since the attach frame (doorbells not counted), and doorbells rung.
        self.sent = 0
        self.doorbells = 0

    def sent_fd(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def put(self, frame: bytes) -> Optional[bool]:
        """Puts one frame's request on the ring: None when it does not fit, the ring is full, or
        the daemon's poller says it may be parked (`spinning` 0: the socket wakes it in one step,
        where the ring would need the doorbell too) — send it on the socket and count it
        (`sent += 1`); else whether the caller must ring the doorbell (the poller stopped spinning
        meanwhile: DOORBELL on the socket, not counted)."""
        if len(frame) > self.cap:
            return None
        mem = self.mem
        k = self.written + 1
        slots = self.slots
        try:
            if not _U64.unpack_from(mem, 8)[0]:
                return None
            if k - self.taken > slots:
                self.taken = _U64.unpack_from(mem, 0)[0]
                if k - self.taken > slots:
                    return None
        except ValueError:  # closed
            return None
        assert _put is not None
        try:
            spinning = _put(mem, HEADER_BYTES + ((k - 1) % slots) * (self.cap + SLOT_HEAD - 4), k, self.sent, frame)
        except ValueError:  # closed
            return None
        self.written = k
        if spinning:
            return False
        self.doorbells += 1
        return True

    def put_notif(self, tag: int, head: bytes, msg: bytes, name: bytes, tail: bytes) -> Optional[bool]:
        """`put` of tcpxd.nixl's send_notif request (tag `tag`; its WriteRequest `head`, the
        notification's length, `name`, `msg`, `tail`: `_native.notif_put`) with no frame made in
        Python: the same answers as `put` (None: send it on the socket, built the usual way).

        Its slot check and doorbell count repeat `put`'s on purpose: a shared helper costs this
        path ~0.1 µs of its ~1.1 (benches/notif_send.py, session 33)."""
        mem = self.mem
        k = self.written + 1
        slots = self.slots
        try:
            if not _U64.unpack_from(mem, 8)[0]:
                return None
            if k - self.taken > slots:
                self.taken = _U64.unpack_from(mem, 0)[0]
                if k - self.taken > slots:
                    return None
            if _notif_put is None:
                return None
            cap = self.cap - 4
            spinning = _notif_put(mem, HEADER_BYTES + ((k - 1) % slots) * (cap + SLOT_HEAD), cap, k, self.sent, tag,
                                  head, msg, name, tail)
        except ValueError:  # closed
            return None
        if spinning < 0:
            return None
        self.written = k
        if spinning:
            return False
        self.doorbells += 1
        return True

    def dropped(self) -> bool:
        """Whether entries written will never be taken: the daemon's session stopped reading the
        ring (its `ended` word) before taking them all. (A connection found closed: the requests
        that were on the ring may go another way.)"""
        try:
            taken, _, ended = struct.unpack_from("<3Q", self.mem, 0)
        except ValueError:  # closed
            return False
        self.taken = taken
        return bool(ended) and taken < self.written

    def close(self) -> None:
        self.sent_fd()
        try:
            self.mem.close()
        except BufferError:
            pass


def attach(conn: Any, timeout: float) -> Optional[Ring]:
    """Makes a ring and attaches it to the session on `conn` (one round trip; `conn` a
    tcpxd._local.Connection that has sent nothing but its board yet); None when the session goes
    without (turned off here, no C pass, or the daemon refused: too old, `runtime.request_ring`
    off). Raises what the exchange raises when the connection itself failed."""
    slots = slots_wanted()
    if not slots:
        return None
    try:
        ring = Ring(slots)
    except (OSError, AttributeError, ValueError) as e:
        _refused(f"no sealed memfd could be made here: {e}")
        return None
    try:
        req = _proto.message("AttachRequestRingRequest")(slots=ring.slots, slot_bytes=ring.cap + SLOT_HEAD - 4)
        ev = conn.exchange("attach_request_ring", req, timeout, fd=ring.fd)
    except BaseException:
        ring.close()
        raise
    finally:
        ring.sent_fd()
        conn.sock.settimeout(None)
        conn._timeout = None
    kind = None if ev is None else ev.WhichOneof("event")
    if kind == "request_ring_attached":
        return ring
    ring.close()
    _refused(ev.refused.message if ev is not None and kind == "refused" else f"answered {kind}")
    return None
