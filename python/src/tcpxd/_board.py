"""A framed local session's completion board: memory this process and the daemon both map, where
the daemon publishes each of the session's transfers that finished OK, so a caller polling a
transfer learns its end by reading memory — no `recv`, no protobuf decode (docs/API.md, "The
completion board"; the daemon's side and the memory's layout: crates/tcpxd/src/api/local/board.rs).

The client makes the board (a memfd sealed against shrinking and growing, of 64 × (slots + 1)
bytes), sends it with the session's first frame (`attach_board`, SCM_RIGHTS) and keeps it if the
daemon answers `board_attached`; a daemon that predates it, or has `runtime.shared_completions`
off, refuses the request and the session goes on with its events alone (said once in the log).

What the board says is never all there is: every end published there also comes as its event on
the socket right after, and failures and refusals come only as events. So the board only lets a
poller see an OK end sooner and cheaper; whoever settles a tag (from the board or from its event)
frees its slot, under the session's lock, and an event whose tag is settled already is dropped as
any event without a pending request is. Word 0 (`published`, how many ends the daemon published)
tells a poller in one read whether there is anything new to look for.

Reading order: `published`, then a slot's state word, then its fields, then the free (a store of
0) — loads in program order and a store after them, which x86-64 keeps in that order (this
package's platform, as the daemon's).

A board may also carry notification slots (tcpxd.nixl's feed asks for them): a subscribed
session's notifications' payloads, numbered in the order of their events, each put in its slot
before its event when it fits (240 bytes) and the slot is consumed. `take_notes` reads them in
order, `note_event` tells which events to drop (their payload was taken from a slot); a
notification that did not go in a slot is taken by its event, so the order is the events'.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import struct
from typing import Any, Dict, List, Optional, Tuple

from . import _ops, _proto

log = logging.getLogger("tcpxd")

#: Slots a board has: a request with tag t goes in slot t mod SLOTS (a tag whose slot an unread
#: end still holds goes the socket's way). TCPXD_BOARD_SLOTS (a power of two, 64 to 4,096);
#: 0 makes no board (every end comes as an event, as before); unset: SLOTS with 8 CPUs or more,
#: else none (`slots_wanted`).
SLOTS = 256
#: Bytes of the header and of each slot (a cache line each).
SLOT_BYTES = 64

_U64 = struct.Struct("<Q")
_FIELDS = struct.Struct("<5Q")
_NOTE_HEAD = struct.Struct("<2Q")
#: Bytes of a notification slot, and of the payload it holds.
NOTE_SLOT = 256
NOTE_BYTES = NOTE_SLOT - 16

_told = False


def slots_wanted() -> int:
    """The slots a new session's board gets: TCPXD_BOARD_SLOTS, else SLOTS with 8 CPUs or more
    and none below (where the package's polls and waits block on the socket instead of spinning:
    TCPXD_CLIENT_SPIN_US, TCPXD_NIXL_TIGHT_SPIN_US; a client woken by the event gains nothing from
    the board, docs/BENCHMARKS.md "Session 25, shmring"); 0: no board."""
    v = os.environ.get("TCPXD_BOARD_SLOTS", "")
    if not v:
        return SLOTS if (os.cpu_count() or 1) >= 8 else 0
    try:
        n = int(v)
    except ValueError:
        return SLOTS
    return n if n == 0 or (64 <= n <= 4096 and n & (n - 1) == 0) else SLOTS


def refused(why: str) -> None:
    """A session went without a board: said once a process (every later one goes without it alike)."""
    global _told
    if not _told:
        _told = True
        log.info("tcpxd: the daemon's sessions carry no completion board (%s); transfers' ends come as events", why)



def sealed_memfd(name: str, size: int) -> "tuple[int, mmap.mmap]":
    """A memfd of `size` bytes sealed against resizing (as the daemon requires of boards and
    rings) and its mapping; the fd is closed again if anything fails."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        return fd, mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise

class Board:
    """The client's mapping of a board (`fd`, to send with `attach_board`, closed by `sent()`)."""

    __slots__ = ("mem", "mask", "slots", "fd", "seen", "notes", "notes_at", "consumed", "noted")

    def __init__(self, slots: int, notes: int = 0):
        size = SLOT_BYTES * (slots + 1) + NOTE_SLOT * notes
        fd, self.mem = sealed_memfd("tcpxd-board", size)
        self.fd: Optional[int] = fd
        self.slots = slots
        self.mask = slots - 1
        #: `published` as last read (`news`).
        self.seen = 0
        #: Notification slots (0: none), where they start, the number of the last notification
        #: taken (from a slot or its event: `consumed`, mirrored in the header for the daemon),
        #: and of the last notification event read (`noted`).
        self.notes = notes
        self.notes_at = SLOT_BYTES * (slots + 1)
        self.consumed = 0
        self.noted = 0

    @staticmethod
    def make(notes: int = 0) -> Optional["Board"]:
        """A new board of slots_wanted() slots (and `notes` notification slots); None when none is
        wanted or none can be made (no memfd here: said once)."""
        n = slots_wanted()
        if n == 0:
            return None
        try:
            return Board(n, notes)
        except (OSError, AttributeError, ValueError) as e:
            refused(f"no sealed memfd could be made here: {e}")
            return None

    def sent(self) -> None:
        """The descriptor went with `attach_board` (or the session has none): closed here; the
        mapping stays."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def news(self) -> int:
        """How many ends the daemon published since the last call that found any (one read); 0
        once the board is closed (its session ended)."""
        try:
            n = _U64.unpack_from(self.mem, 0)[0]
        except ValueError:  # closed
            return 0
        new = (n - self.seen) & 0xFFFFFFFFFFFFFFFF
        self.seen = n
        return new

    def take(self, tag: int) -> Optional[Tuple[int, int, int, int, int]]:
        """The end published for `tag` — (transfer_id, total_bytes, bytes_done, elapsed_us, the
        number of per-entry statuses, each OK) —
        its slot freed; None when its slot holds no end of this tag. Callers serialize takes and
        `forget`s (the session's lock)."""
        off = ((tag & self.mask) + 1) * SLOT_BYTES
        mem = self.mem
        try:
            if _U64.unpack_from(mem, off)[0] != tag:
                return None
            fields: Tuple[int, int, int, int, int] = _FIELDS.unpack_from(mem, off + 8)
            _U64.pack_into(mem, off, 0)
        except ValueError:  # closed
            return None
        return fields

    def forget(self, tag: int) -> None:
        """`tag` was settled by its event: its slot is freed if the daemon published it there."""
        off = ((tag & self.mask) + 1) * SLOT_BYTES
        try:
            if _U64.unpack_from(self.mem, off)[0] == tag:
                _U64.pack_into(self.mem, off, 0)
        except ValueError:  # closed
            pass

    def take_notes(self) -> List[bytes]:
        """The payloads of the notifications in their slots that come next in order (each after
        the last one taken), `consumed` stored for the daemon after them; none once closed."""
        out: List[bytes] = []
        if not self.notes:
            return out
        mem, k = self.mem, self.consumed
        try:
            while True:
                at = self.notes_at + (k % self.notes) * NOTE_SLOT
                got, n = _NOTE_HEAD.unpack_from(mem, at)
                if got != k + 1:
                    break
                out.append(bytes(mem[at + 16 : at + 16 + min(n, NOTE_BYTES)]))
                k += 1
            if out:
                self.consumed = k
                _U64.pack_into(mem, 24, k)  # (header word 3: the daemon may reuse those slots)
        except ValueError:  # closed
            return []
        return out

    def behind(self) -> bool:
        """Whether the daemon numbered a notification after the last one taken (`notified` past
        `consumed`: header word 2, one read): its payload is not in its slot yet, or never will be
        (too long, the ring was full), so its event is to be read; False once closed."""
        try:
            # (`>`: a slot taken before the daemon raised `notified` after writing it is not behind)
            return bool(_U64.unpack_from(self.mem, 16)[0] > self.consumed)
        except ValueError:  # closed
            return False

    def note_event(self) -> bool:
        """A notification event was read: whether to deliver it (False: its payload was taken
        from its slot already)."""
        self.noted += 1
        if self.noted <= self.consumed:
            return False
        self.consumed = self.noted
        try:
            _U64.pack_into(self.mem, 24, self.noted)
        except ValueError:  # closed
            pass
        return True

    def close(self) -> None:
        """Unmaps the board (and closes the descriptor Python's mmap keeps of the memfd): for when
        its session or connection is closed; a later read finds nothing."""
        self.sent()
        try:
            self.mem.close()
        except BufferError:  # (a view of it still alive: the mapping goes with the object)
            pass


def settle(board: Board, lock: Any, pending: Dict[int, Any], new: int) -> bool:
    """Settles the futures in `pending` (by tag; `lock` guards it) whose OK end the board holds,
    each taken out of `pending` and its slot freed, looking until it found the `new` ends the board
    says were published since its last look (or every pending tag was looked at: some of those
    were settled by their events); whether it settled any."""
    done = []
    with lock:
        for tag in list(pending) if len(pending) > 1 else tuple(pending):
            got = board.take(tag)
            if got is not None:
                done.append((pending.pop(tag), got))
                if len(done) == new:
                    break
    for fut, got in done:
        _ops.settle_done(fut, *got)
    return bool(done)


def attach(conn: Any, timeout: float, notes: int = 0) -> Optional[Board]:
    """Makes a board (with `notes` notification slots) and attaches it to the new session on
    `conn` (one round trip, before the session's first request); None when the session goes without (the daemon refused it: too old,
    `runtime.shared_completions` off; or no memfd here). Raises what the exchange raises when the
    connection itself failed (`_local.Gone`, OSError). `conn`: a tcpxd._local.Connection just
    opened; `timeout`: how long the answer may take."""
    board = Board.make(notes)
    if board is None:
        return None
    try:
        req = _proto.message("AttachBoardRequest")(slots=board.slots, notification_slots=notes)
        ev = conn.exchange("attach_board", req, timeout, fd=board.fd)
    except BaseException:
        board.close()
        raise
    finally:
        board.sent()
        conn.sock.settimeout(None)  # (the exchange's deadline: the session's socket blocks)
        conn._timeout = None
    kind = None if ev is None else ev.WhichOneof("event")
    if kind == "board_attached":
        board.notes = min(board.notes, ev.board_attached.notification_slots)  # (0: a daemon without them)
        return board
    board.close()
    refused(ev.refused.message if ev is not None and kind == "refused" else f"answered {kind}")
    return None

