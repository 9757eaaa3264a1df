"""NIXL notifications over tcpxd's: framing, and the agent's inbox.

A tcpxd notification rides a WRITE into a node's buffers and reaches every subscriber of that node
after the data landed. A NIXL notification is addressed to an agent and keyed by the initiator's
name, and several agents may share a node, so its bytes carry both names:
`MAGIC, u16 len(from), u16 len(to), from, to, message`. The inbox keeps those addressed to its agent
and skips everything else (other agents', other tcpxd users').

A notification that rides no WRITE of its own (send_notif, a READ's, one after a transfer split into
several requests) is a WRITE from the initiator's mailbox (a small host buffer each agent
registers) into the target's, carrying it: of zero bytes (since session 22, where the daemon lists
the `notification_alone` feature), which travels between the daemons as control messages only, the
receiving daemon checking the mailbox's key before it delivers; of one byte before.

The inbox learns of notifications on a local session of its own that subscribed to them (the
daemon writes each as an event on its socket): each `take` (get_new_notifs, check_remote_xfer_done)
reads what has arrived without waiting, on the polling thread, so a tight polling loop sees a
notification as soon as the daemon has it and no other thread needs the GIL. Where there is no
local session (a TCP endpoint, a daemon before session 18), a thread reads the Subscribe stream.

Where the feed has a completion board with notification slots (tcpxd._board), a polling loop
reads the board first (`_Feed.noted`): payloads from their slots, send_notif's answers from the
board's end slots, and the socket only when the board numbers a notification it does not hold, at
the poll after one that took something from the board (the events of what it took, a few at a
time), or DRAIN_S after the last read; so a poll that finds nothing new makes no system call.

send_notif's mailbox WRITE goes on that same session (`Inbox.post`, since session 22) and the call
returns without its answer, as NIXL's genNotif posts: the answer is read by the same reads as the
notifications (a `Sent` settled), so no thread wakes for it. The agent keeps the order of its
notifications to one agent (the next waits while the previous is unanswered) and raises a failure
at the next send_notif to that agent (tcpxd.nixl._agent).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import select
import struct
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from .. import Client, Subscription, _board, _local, _ops, _proto, _ring
from .._session import _SessionFuture, _varint
from ..errors import TcpxdError, Unavailable

log = logging.getLogger("tcpxd.nixl")

MAGIC = b"\x00NIXL1"
_LENS = struct.Struct(">HH")
#: Bytes of each agent's mailbox.
MAILBOX_BYTES = 4096
#: How often a lost notification stream is asked for again.
RESUBSCRIBE_S = 0.5
#: A take() that finds nothing, this soon after the previous one found nothing, is a tight polling
#: loop's: once it has spun for TIGHT_SPIN_S (0 below 8 CPUs: at once), each such take waits up to
#: TIGHT_WAIT_MS for the daemon to write to the feed (the GIL and the CPU released: on a machine
#: with few cores, the daemons a spinning loop waits for need the CPU it spins on), back as soon as
#: something comes (the feed has no other reader to take it first). A loop that does anything
#: between its polls never waits.
TIGHT_S = 50e-6
TIGHT_WAIT_MS = 1


def _tight_spin_s() -> float:
    """TIGHT_SPIN_S: TCPXD_NIXL_TIGHT_SPIN_US (µs; "inf": never wait), else 0 with fewer than 8
    CPUs (the two daemons need the CPU a spin would take: on the 2-core VM, 4 KiB READ p50 / p90
    / p99 199–222 / 264–321 / 294–3,818 µs waiting at once, 194–287 / 472–530 / 722–824 after 250
    µs of spin, 200–506 / 2,396–2,997 / 4,128–14,308 spinning, session 21), else no bound (the
    daemon's own `runtime.spin auto` rule, mirrored). check_xfer_state's and get_new_notifs' tight
    loops (tcpxd.nixl._agent, Inbox.take)."""
    v = os.environ.get("TCPXD_NIXL_TIGHT_SPIN_US", "")
    if v:
        try:
            return float(v) / 1e6
        except ValueError:
            log.warning("TCPXD_NIXL_TIGHT_SPIN_US=%r is not a number of µs (or inf): using the default", v)
    return 0.0 if (os.cpu_count() or 1) < 8 else float("inf")


_INF = float("inf")

#: SessionEvent's `refused` field (decoded whatever its tag: `_Feed._wanted`).
_REFUSED = 3

#: How long a tight get_new_notifs / check_remote_xfer_done loop spins before its polls wait
#: (TIGHT_WAIT_MS each) for the daemon: as check_xfer_state's (session 22).
TIGHT_SPIN_S = _tight_spin_s()

#: How long a poll that finds nothing new waits for a notification, the GIL released (`take`).
#: Notifications come on a gRPC stream, read by gRPC's thread and the inbox's: a loop polling
#: get_new_notifs without a pause would hold the GIL they need until Python's switch interval
#: (5 ms) each; a wait this long lets them run, and ends as soon as one is delivered.
POLL_WAIT_S = 50e-6


#: Notification slots of the feed's completion board (tcpxd._board): a notification's payload of
#: at most 240 bytes is read from memory the agent maps, before (and instead of) its event.
FEED_NOTES = 64

#: With notification slots on the feed's board, how often a polling loop that finds nothing new
#: there reads the feed's socket anyway (`_Feed.noted`): the events whose payloads the board gave,
#: a failed send_notif's answer, the session's end (a restarted daemon). Each such read is ~3 µs.
#: The poll after one that took something from the board reads it too (`_Feed.noted`): a loop of
#: round trips then reads one or two events at a time, while it waits, instead of the ~30 a
#: millisecond's drain decoded at once (40–50 µs on whichever poll met it: session 27, the round
#: trip's p99).
DRAIN_S = 1e-3

#: How long a send_notif whose previous notification to the same agent is not answered yet looks
#: for that answer on the feed's board before it reads the socket (where polling loops spin:
#: TIGHT_SPIN_S; the daemon may publish the answer a little after a notification that came later).
SENT_SPIN_S = 200e-6

#: How long closing an agent waits for its notifications still on their way, by default
#: (send_notif returns before they arrive; closing the agent's session would cancel them):
#: nixl_agent_config(close_notifs_s=...), else TCPXD_NIXL_CLOSE_NOTIFS_S, else this.
CLOSE_NOTIFS_S = 5.0


def close_notifs_s(configured: Optional[float]) -> float:
    """How long an agent's close() waits for its notifications on their way: `configured`
    (nixl_agent_config's close_notifs_s), else TCPXD_NIXL_CLOSE_NOTIFS_S (seconds; "inf": until
    each is answered, which its WRITE's deadline bounds), else CLOSE_NOTIFS_S."""
    if configured is not None:
        return configured
    v = os.environ.get("TCPXD_NIXL_CLOSE_NOTIFS_S", "")
    if v:
        try:
            s = float(v)
            if s >= 0:
                return s
        except ValueError:
            pass
        log.warning("TCPXD_NIXL_CLOSE_NOTIFS_S=%r is not a number of seconds (0 or more, or inf): using %g",
                    v, CLOSE_NOTIFS_S)
    return CLOSE_NOTIFS_S


def notif_future(session: Any, to: str) -> "concurrent.futures.Future[Any]":
    """The future of a send_notif's WRITE on `session` (resolved by whichever thread reads the
    session: its reader, or a caller polling it); a failure is logged when it comes."""
    fut: "concurrent.futures.Future[Any]" = (
        _SessionFuture(session) if getattr(session, "_conn", None) is not None else concurrent.futures.Future())
    fut.add_done_callback(functools.partial(_notif_failed, to))
    return fut


def _notif_failed(to: str, fut: "concurrent.futures.Future[Any]") -> None:
    err = fut.exception()
    if err is not None:
        log.warning("send_notif to %s failed: %s (the next send_notif to it raises this)", to, err)


def frame(src: str, dst: str, msg: bytes) -> bytes:
    s, d = src.encode(), dst.encode()
    return MAGIC + _LENS.pack(len(s), len(d)) + s + d + msg


#: The names of the framings seen (`parse`), by the bytes before the message: a polling loop
#: decodes each pair of agent names once (bounded: cleared when full).
_NAMES: Dict[bytes, Tuple[str, str]] = {}
_NAMES_MAX = 1024
_HEAD = len(MAGIC) + _LENS.size


def parse(payload: bytes) -> Optional[Tuple[str, str, bytes]]:
    if not payload.startswith(MAGIC) or len(payload) < _HEAD:
        return None
    ls, ld = _LENS.unpack_from(payload, len(MAGIC))
    end = _HEAD + ls + ld
    if len(payload) < end:
        return None
    head = payload[:end]
    names = _NAMES.get(head)
    if names is None:
        try:
            names = (payload[_HEAD : _HEAD + ls].decode(), payload[_HEAD + ls : end].decode())
        except UnicodeDecodeError:
            return None
        if len(_NAMES) >= _NAMES_MAX:
            _NAMES.clear()
        _NAMES[head] = names
    return names[0], names[1], payload[end:]


class Sent:
    """A send_notif's WRITE posted on an inbox's feed (`Inbox.post`): done once the daemon answered
    it, read by whichever thread reads the feed (get_new_notifs, or a send_notif waiting for it)."""

    __slots__ = ("_inbox", "_to", "_done", "_error")

    #: Settled with None when the WRITE finished OK (`_ops.settle`): only whether it did matters.
    skips_result = True

    def __init__(self, inbox: "Inbox", to: str):
        self._inbox = inbox
        self._to = to
        self._done = False
        self._error: Optional[BaseException] = None

    def set_result(self, _result: Any) -> None:
        self._done = True

    def set_exception(self, err: BaseException) -> None:
        self._error = err
        self._done = True
        log.warning("send_notif to %s failed: %s (the next send_notif to it raises this)", self._to, err)

    def done(self) -> bool:
        if not self._done:
            self._inbox.read()
        return self._done

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        """Its failure, None when it arrived; waits (up to `timeout` s) while it is on its way;
        raises TimeoutError past it."""
        if not self._done:
            self._inbox.wait_for(self, timeout)
        if not self._done:
            raise TimeoutError(f"send_notif to {self._to}: not answered within {timeout} s")
        return self._error


class _Feed:
    """A local session subscribed to the node's notifications, read without waiting. It also
    carries send_notif's WRITEs (`send`): their answers come in the same reads as the
    notifications, so no other thread wakes for them."""

    def __init__(self, conn: _local.Connection, board: Optional[_board.Board] = None):
        self.conn = conn
        #: Its completion board, where the daemon gave one (closed with the connection).
        self.board = board
        conn.board = board
        self._poll: Any = None
        #: The WRITEs sent on it not answered yet, by tag.
        self.sent: Dict[int, Sent] = {}
        #: When `noted` reads the socket next though the board says nothing is there.
        self.drain_at = 0.0
        #: Whether `noted` serves (a board with notification slots).
        self.noting = board is not None and board.notes > 0

    @staticmethod
    def open(path: str, name: str) -> Optional["_Feed"]:
        """Subscribed to the notifications addressed to agent `name` (the daemon sends no other
        agent's: SubscribeRequest.addressed_to, since session 31; an older daemon sends all, which
        `Inbox._keep` sorts), or None when the daemon does not deliver notifications on a local session
        (too old: the gRPC stream serves instead)."""
        try:
            conn = _local.handshake(path)
        except _local.NotLocal:
            return None
        if conn is None:
            raise TcpxdError(f"nothing answers at {path}")
        board: Optional[_board.Board] = None
        try:
            board = _board.attach(conn, _local.HANDSHAKE_TIMEOUT, FEED_NOTES)
            if board is not None:  # send_notif's WRITEs on a request ring where the board is (tcpxd._ring)
                conn.ring = _ring.attach(conn, _local.HANDSHAKE_TIMEOUT)
            req = _proto.message("SubscribeRequest")(addressed_to=name)
            ev = conn.exchange("subscribe", req, _local.HANDSHAKE_TIMEOUT)
        except (_local.Gone, OSError) as e:
            conn.close()
            if board is not None:
                board.close()
            raise TcpxdError(f"subscribing to notifications at {path}: {e!r}") from None
        if ev is None or ev.WhichOneof("event") != "subscribed":
            conn.close()  # an older daemon refuses the request it does not know
            if board is not None:
                board.close()
            return None
        conn.sock.setblocking(False)  # read only what has arrived (a socket timeout would wait)
        return _Feed(conn, board)

    def wait(self, ms: int) -> None:
        """Waits until the daemon has sent something (or `ms` passed), the GIL released."""
        if self._poll is None:
            self._poll = select.poll()
            self._poll.register(self.conn.sock.fileno(), select.POLLIN)
        try:
            self._poll.poll(ms)
        except InterruptedError:
            pass

    def send(self, body: bytes, sent: Sent) -> bool:
        """Sends a WriteRequest (`body`, serialized) on the feed's session, answered into `sent`;
        False when nothing could be sent (the connection ended: the daemon went away)."""
        conn = self.conn
        tag = conn._tag = conn._tag + 1
        blen = len(body)
        head = b"\x08" + _varint(tag) + b"\x12" + _varint(blen)  # tag = 1, write = 2
        frame = _local.HEADER.pack(len(head) + blen) + head + body
        ring = conn.ring
        bell = None
        if ring is not None:
            bell = ring.put(frame)
            if bell is False:  # on the ring, the daemon's poller spinning
                self.sent[tag] = sent
                return True
            if bell:  # on the ring; the daemon's poller may be parked: the doorbell
                frame = _ring.DOORBELL
            else:
                ring.sent += 1
        return self._write(tag, frame, bell, sent)

    def _write(self, tag: int, frame: bytes, bell: Optional[bool], sent: Sent) -> bool:
        """`send`'s socket part: `frame` (the request, or the doorbell where `bell`) written whole,
        `sent` kept under `tag`."""
        conn = self.conn
        ring = conn.ring
        data = memoryview(frame)
        sock = conn.sock
        n = 0
        while n < len(data):  # (non-blocking: a frame this small goes whole unless the daemon stopped reading)
            try:
                n += sock.send(data[n:])
            except (BlockingIOError, InterruptedError):
                waiter = select.poll()
                waiter.register(sock.fileno(), select.POLLOUT)
                waiter.poll(100)
            except OSError:
                if n == 0 and (not bell or (ring is not None and ring.dropped())):
                    return False  # (nothing sent, or on a ring the daemon no longer reads)
                break  # part of it went (or it is on the ring): the next read fails it (unanswered)
        self.sent[tag] = sent
        return True

    def send_notif(self, head: Tuple[bytes, bytes, bytes], msg: bytes, sent: Sent) -> bool:
        """`send` of send_notif's WriteRequest, `head[0]` + the notification's length + `head[1]`
        + `msg` + `head[2]` (tcpxd.nixl's `send_notif`): written straight into the request ring's
        slot by the C pass where it fits (`_ring.Ring.put_notif`: no frame made in Python), else
        built and sent as `send` does."""
        conn = self.conn
        ring = conn.ring
        if ring is not None:
            tag = conn._tag + 1
            bell = ring.put_notif(tag, head[0], msg, head[1], head[2])
            if bell is not None:  # on the ring
                conn._tag = tag
                if bell is False:  # the daemon's poller spinning
                    self.sent[tag] = sent
                    return True
                return self._write(tag, _ring.DOORBELL, bell, sent)  # it may be parked: the doorbell
        return self.send(head[0] + _varint(len(head[1]) + len(msg)) + head[1] + msg + head[2], sent)

    def noted(self) -> List[bytes]:
        """`payloads()` for a polling loop, from the board where it can: the notifications in its
        slots taken, the WRITEs whose OK end it holds settled (their events, which follow, are
        dropped when read), and the socket read only when the board says something came that it
        does not hold (a payload too long for a slot, the slots full), or DRAIN_S after the last
        read (the events whose payloads the board gave, failures, the session's end). So a poll
        that finds nothing new makes no system call and decodes nothing."""
        board = self.board
        assert board is not None
        out = board.take_notes()
        took = self._settle_sent(board) or bool(out)
        if board.behind():  # (raised since take_notes looked: its slot, written before, is read first)
            out += board.take_notes()
            if board.behind():
                self.drain_at = 0.0
        if time.perf_counter() >= self.drain_at:
            out += self.payloads()
        elif took:  # (their events follow on the socket: read at the next poll, a few at a time)
            self.drain_at = 0.0
        return out

    def _settle_sent(self, board: _board.Board) -> bool:
        """Settles the WRITEs whose OK end the board holds (their events, which follow, are then
        skipped undecoded: `_wanted`); whether it settled any."""
        sent = self.sent
        took = False
        if sent:
            for tag in list(sent):
                got = board.take(tag)
                if got is not None:
                    _ops.settle_done(sent.pop(tag), *got)
                    took = True
        return took

    def payloads(self) -> List[bytes]:
        """The notifications' payloads that have arrived, in order — from the board's notification
        slots first (tcpxd._board), then the events (those whose payload the board gave dropped),
        then the slots again — and the answers to its WRITEs, settled; raises _local.Gone once the
        session ended."""
        board = self.board
        out: List[bytes] = []
        if board is not None:
            out = board.take_notes()
            self._settle_sent(board)  # (before the socket: those ends' events are then not decoded)
        self.drain_at = time.perf_counter() + DRAIN_S
        for ev in self.conn.ready(False, None if board is None else self._wanted):
            kind = ev.WhichOneof("event")
            if kind == "notification":  # (one whose payload the board gave was not decoded)
                out.append(ev.notification.payload)
                continue
            sent = self.sent.pop(ev.tag, None)
            if sent is not None:
                if board is not None:
                    board.forget(ev.tag)  # (its end may be on the board too: the slot freed)
                _ops.settle(sent, ev)
            elif kind == "refused":
                log.warning("notifications: %s", ev.refused.message)
        if board is not None:
            out += board.take_notes()
        return out

    def _wanted(self, tag: int, field: int) -> bool:
        """`ready`'s `keep` (tcpxd._local.peek): a notification whose payload the board gave
        already, and the end of a WRITE settled from the board (no longer in `sent`), are skipped
        without decoding; a refusal (a fell-behind report, the session's end) is decoded."""
        if field == _local.NOTIFICATION:
            board = self.board
            return board is None or board.note_event()  # (False: its payload was taken from its slot)
        return tag == 0 or tag in self.sent or field == _REFUSED

    def end(self, why: str) -> None:
        """The session ended: its WRITEs not answered fail (they may or may not have arrived)."""
        left, self.sent = self.sent, {}
        for sent in left.values():
            sent.set_exception(Unavailable(f"the daemon's session ended before the notification was answered ({why}); "
                                           "it may not have arrived"))


class Inbox:
    """The notifications addressed to one agent: read from a local session subscribed to the
    node's (in place when the constructor returns; subscribed again should it end), by whichever
    thread polls; else collected by a thread reading the node's Subscribe stream."""

    def __init__(self, client: Client, name: str):
        self._client = client
        self._name = name
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        #: Held by the thread waiting on the feed's socket (take(), without `_lock`).
        self._waiting = threading.Lock()
        self._new: Dict[str, List[bytes]] = {}
        self._closed = False
        path = _local.socket_path(client.endpoint)
        self._feed = _Feed.open(path, name) if path else None
        #: Where the local feed is subscribed again should it end (None: the gRPC stream serves).
        self._path = path if self._feed is not None else None
        #: When the local feed ended (the daemon restarted, drained): when to subscribe again.
        self._retry_at = 0.0
        self._quiet = False
        #: When take() last found nothing on the local feed (a tight loop's cue), and when the
        #: current tight loop began (TIGHT_SPIN_S).
        self._empty_at = 0.0
        self._spin_from = 0.0
        self._sub: Optional[Subscription] = None
        if self._feed is None:
            self._sub = client.subscribe(name)
            threading.Thread(target=self._run, name=f"tcpxd-nixl-notifs-{name}", daemon=True).start()

    def _run(self) -> None:
        quiet = False  # an outage is logged once, until a stream delivers again
        while not self._closed:
            assert self._sub is not None
            try:
                for n in self._sub:
                    quiet = False
                    self._deliver(n.payload)
                if self._closed:
                    return
                why = "the daemon ended the notification stream"
            except TcpxdError as e:
                if self._closed:
                    return
                why = f"the notification stream failed ({e})"
            if not quiet:
                log.warning("agent %s: %s; subscribing again every %.1f s", self._name, why, RESUBSCRIBE_S)
                quiet = True
            time.sleep(RESUBSCRIBE_S)
            while not self._closed:
                try:
                    self._sub = self._client.subscribe(self._name)
                    break
                except TcpxdError:
                    time.sleep(RESUBSCRIBE_S)

    def _deliver(self, payload: bytes) -> None:
        with self._lock:
            self._keep(payload)
            self._arrived.notify_all()

    def _keep(self, payload: bytes) -> None:
        got = parse(payload)
        if got is not None and got[1] == self._name:
            self._new.setdefault(got[0], []).append(got[2])

    def _read_feed(self, noted: bool = False) -> None:
        """What the local feed has (the lock held); subscribes again, at most every RESUBSCRIBE_S,
        once it ended. `noted`: a polling loop's read, from the feed's board where it has
        notification slots (`_Feed.noted`: no system call when nothing new is there)."""
        if self._feed is None:
            if self._closed or self._path is None or time.monotonic() < self._retry_at:
                return
            try:
                self._client._reattach.sync()  # (the daemon restarted: the mailbox registered again first)
                self._feed = _Feed.open(self._path, self._name)
            except TcpxdError as e:
                self._retry_at = time.monotonic() + RESUBSCRIBE_S
                if not self._quiet:
                    log.warning("agent %s: notifications: %s; subscribing again every %.1f s", self._name, e, RESUBSCRIBE_S)
                    self._quiet = True
                return
            if self._feed is None:  # the daemon that came back is an older one
                self._retry_at = time.monotonic() + RESUBSCRIBE_S
                return
            self._quiet = False
        feed = self._feed
        try:
            for p in (feed.noted() if noted and feed.noting else feed.payloads()):
                self._keep(p)
        except (_local.Gone, OSError, TcpxdError) as e:
            self._drop_feed(repr(e))
            if not self._closed and not self._quiet:
                log.warning("agent %s: the notification session ended (%r); subscribing again every %.1f s",
                            self._name, e, RESUBSCRIBE_S)
                self._quiet = True

    def take(self) -> Dict[str, List[bytes]]:
        """What arrived since the last call, by initiator agent, in arrival order. On a local
        feed: what the daemon has written to it, read now, without waiting. On the gRPC stream:
        when nothing has arrived, waits up to POLL_WAIT_S, the GIL released (so a loop polling
        this lets the threads that deliver notifications run)."""
        feed = None
        with self._lock:
            if self._path is not None:
                self._read_feed(True)
                if not self._new and self._feed is not None and TIGHT_SPIN_S != _INF:
                    now = time.perf_counter()
                    if now - self._empty_at >= TIGHT_S:  # not a tight loop (or its first poll)
                        self._spin_from = now
                    elif now - self._spin_from >= TIGHT_SPIN_S:  # a tight loop, spun enough: wait for the daemon
                        feed = self._feed
                    self._empty_at = now
            elif not self._new and not self._closed:
                self._arrived.wait(POLL_WAIT_S)
            if feed is None:
                out, self._new = self._new, {}
                return out
        # The wait without the lock (a send_notif of another thread goes meanwhile), by one
        # thread at a time (a poll object is not for two): another finds it taken and returns.
        if self._waiting.acquire(blocking=False):
            try:
                feed.wait(TIGHT_WAIT_MS)
            finally:
                self._waiting.release()
        with self._lock:
            if self._feed is not None:
                self._read_feed()
            self._empty_at = time.perf_counter()
            out, self._new = self._new, {}
        return out

    def post(self, body: bytes, to: str) -> Optional[Sent]:
        """Sends a WriteRequest (`body`, serialized: send_notif's) on the local feed, not waiting
        for its answer; None when there is no feed now (the caller sends it otherwise)."""
        with self._lock:
            if self._path is None or self._closed:
                return None
            if self._feed is None:
                self._read_feed()  # subscribes again (at most every RESUBSCRIBE_S)
                if self._feed is None:
                    return None
            sent = Sent(self, to)
            if self._feed.send(body, sent):
                return sent
            self._drop_feed("its connection ended")  # (the daemon went away): sent the other way
            return None

    def post_notif(self, head: Tuple[bytes, bytes, bytes], msg: bytes, to: str) -> Optional[Sent]:
        """`post` of send_notif's WriteRequest in its parts (`_Feed.send_notif`); written out
        as `post` is, not through a shared helper: it is on `send_notif`'s path (a call's cost)."""
        with self._lock:
            if self._path is None or self._closed:
                return None
            if self._feed is None:
                self._read_feed()  # subscribes again (at most every RESUBSCRIBE_S)
                if self._feed is None:
                    return None
            sent = Sent(self, to)
            if self._feed.send_notif(head, msg, sent):
                return sent
            self._drop_feed("its connection ended")  # (the daemon went away): sent the other way
            return None

    def _drop_feed(self, why: str) -> None:
        """The feed's session ended (the lock held): its WRITEs not answered fail, and it is
        subscribed again at most every RESUBSCRIBE_S."""
        assert self._feed is not None
        self._feed.conn.close()
        self._feed.end(why)
        self._feed = None
        self._retry_at = time.monotonic() + RESUBSCRIBE_S

    def read(self) -> None:
        """Reads what the feed has (notifications kept for take(), answers settled), at once."""
        with self._lock:
            if self._feed is not None:
                self._read_feed()

    def wait_for(self, sent: Sent, timeout: Optional[float]) -> None:
        """Reads the feed until `sent` is answered (or `timeout` s passed), waiting for the
        daemon in between (the GIL released)."""
        end = None if timeout is None else time.monotonic() + timeout
        # A loop that spins looks at the board first (its OK end may come there a little after
        # the notification the caller just saw), for up to SENT_SPIN_S; then the socket.
        spin_until = time.perf_counter() + min(TIGHT_SPIN_S, SENT_SPIN_S)
        while not sent._done:
            with self._lock:
                if self._feed is None:
                    return  # ended: what it left unanswered failed
                noted = self._feed.noting and time.perf_counter() < spin_until
                self._read_feed(noted)
                feed = self._feed
            if sent._done or feed is None:
                return
            if noted:
                continue
            left = 10.0 if end is None else end - time.monotonic()
            if left <= 0:
                return
            waiter = select.poll()  # (its own: take() may be waiting on the feed's meanwhile)
            waiter.register(feed.conn.sock.fileno(), select.POLLIN)
            try:
                waiter.poll(max(1, min(100, int(left * 1000))))
            except (InterruptedError, ValueError):  # (ValueError: closed meanwhile)
                pass

    def close(self) -> None:
        self._closed = True
        with self._lock:
            if self._feed is not None:
                self._feed.conn.close()
                self._feed.end("the agent was closed")
                self._feed = None
        if self._sub is not None:
            self._sub.close()
