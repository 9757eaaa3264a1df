"""NIXL notifications over tcpxd's: framing, and the agent's inbox.

A tcpxd notification rides a WRITE into a node's buffers and reaches every subscriber of that node
after the data landed. A NIXL notification is addressed to an agent and keyed by the initiator's
name, and several agents may share a node, so its bytes carry both names:
`MAGIC, u16 len(from), u16 len(to), from, to, message`. The inbox keeps those addressed to its agent
and skips everything else (other agents', other tcpxd users').

A notification that rides no WRITE of its own (send_notif, a READ's, one after a transfer split into
several requests) is a 1-byte WRITE from the initiator's mailbox (a small host buffer each agent
registers) into the target's, carrying it.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from typing import Dict, List, Optional, Tuple

from .. import Client
from ..errors import TcpxdError

log = logging.getLogger("tcpxd.nixl")

MAGIC = b"\x00NIXL1"
_LENS = struct.Struct(">HH")
#: Bytes of each agent's mailbox.
MAILBOX_BYTES = 4096
#: How often a lost notification stream is asked for again.
RESUBSCRIBE_S = 0.5
#: How long a poll that finds nothing new waits for a notification, the GIL released (`take`).
#: Notifications come on a gRPC stream, read by gRPC's thread and the inbox's: a loop polling
#: get_new_notifs without a pause would hold the GIL they need until Python's switch interval
#: (5 ms) each; a wait this long lets them run, and ends as soon as one is delivered.
POLL_WAIT_S = 50e-6


def frame(src: str, dst: str, msg: bytes) -> bytes:
    s, d = src.encode(), dst.encode()
    return MAGIC + _LENS.pack(len(s), len(d)) + s + d + msg


def parse(payload: bytes) -> Optional[Tuple[str, str, bytes]]:
    if not payload.startswith(MAGIC) or len(payload) < len(MAGIC) + _LENS.size:
        return None
    ls, ld = _LENS.unpack_from(payload, len(MAGIC))
    at = len(MAGIC) + _LENS.size
    if len(payload) < at + ls + ld:
        return None
    try:
        src = payload[at : at + ls].decode()
        dst = payload[at + ls : at + ls + ld].decode()
    except UnicodeDecodeError:
        return None
    return src, dst, payload[at + ls + ld :]


class Inbox:
    """The notifications addressed to one agent, collected by a thread reading the node's
    Subscribe stream (in place when the constructor returns; re-subscribed should it end)."""

    def __init__(self, client: Client, name: str):
        self._client = client
        self._name = name
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._new: Dict[str, List[bytes]] = {}
        self._closed = False
        self._sub = client.subscribe()
        self._thread = threading.Thread(target=self._run, name=f"tcpxd-nixl-notifs-{name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        quiet = False  # an outage is logged once, until a stream delivers again
        while not self._closed:
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
                    self._sub = self._client.subscribe()
                    break
                except TcpxdError:
                    time.sleep(RESUBSCRIBE_S)

    def _deliver(self, payload: bytes) -> None:
        got = parse(payload)
        if got is None or got[1] != self._name:
            return
        with self._lock:
            self._new.setdefault(got[0], []).append(got[2])
            self._arrived.notify_all()

    def take(self) -> Dict[str, List[bytes]]:
        """What arrived since the last call, by initiator agent, in arrival order. When nothing
        has, waits up to POLL_WAIT_S for something, the GIL released (so a loop polling this
        lets the threads that deliver notifications run)."""
        with self._lock:
            if not self._new and not self._closed:
                self._arrived.wait(POLL_WAIT_S)
            out, self._new = self._new, {}
        return out

    def close(self) -> None:
        self._closed = True
        self._sub.close()
