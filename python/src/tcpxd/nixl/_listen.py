"""NIXL's peer-to-peer metadata exchange (enable_listen_thread, send_local_metadata,
fetch_remote_metadata, invalidate_local_metadata), as NIXL's own examples use it: a TCP listener
per agent and short connections carrying one framed message each.

A message is a 4-byte kind (b"SEND": load this metadata; b"FTCH": answer with your metadata if
your name is the one given; b"INVL": forget the agent named) and a 4-byte big-endian length, then
that many bytes. A FTCH is answered on the same connection, framed the same way (kind b"META").
The calls that send run in the background, as NIXL's do; check_remote_metadata tells when the
remote agent's metadata is in.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from typing import Any, Callable, Optional, Tuple

log = logging.getLogger("tcpxd.nixl")

_HEAD = struct.Struct(">4sI")
#: Largest message accepted.
MAX_MESSAGE = 64 << 20
#: How long the background sends keep trying to reach a peer that is not listening yet.
RETRY_S = 30.0


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        part = sock.recv(n - len(out))
        if not part:
            raise ConnectionError("peer closed the connection")
        out += part
    return bytes(out)


def read_message(sock: socket.socket) -> Tuple[bytes, bytes]:
    kind, n = _HEAD.unpack(_recv_exact(sock, _HEAD.size))
    if n > MAX_MESSAGE:
        raise ConnectionError(f"a {n}-byte message (the limit is {MAX_MESSAGE})")
    return kind, _recv_exact(sock, n)


def write_message(sock: socket.socket, kind: bytes, body: bytes) -> None:
    sock.sendall(_HEAD.pack(kind, len(body)) + body)


class Listener:
    """The agent's listener thread."""

    def __init__(self, port: int, name: str, metadata: Callable[[], bytes], load: Callable[[bytes], Any],
                 forget: Callable[[str], None]):
        self._name, self._metadata, self._load, self._forget = name, metadata, load, forget
        self._sock = socket.create_server(("", port), reuse_port=False)
        self.port = self._sock.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=f"tcpxd-nixl-listen-{name}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(10)
                    kind, body = read_message(conn)
                    if kind == b"SEND":
                        self._load(body)
                    elif kind == b"FTCH":
                        write_message(conn, b"META", self._metadata() if body.decode() == self._name else b"")
                    elif kind == b"INVL":
                        self._forget(body.decode())
                except Exception as e:  # noqa: BLE001 - one bad peer does not stop the listener
                    log.warning("agent %s: metadata listener: %s", self._name, e)

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def _exchange(addr: Tuple[str, int], kind: bytes, body: bytes, answer: bool) -> Optional[bytes]:
    with socket.create_connection(addr, timeout=10) as s:
        write_message(s, kind, body)
        if answer:
            got_kind, got = read_message(s)
            return got if got_kind == b"META" else None
    return None


def fetch_now(addr: Tuple[str, int], name: str) -> Optional[bytes]:
    """The metadata of agent `name` from its listener at `addr`, now; None when it cannot be had."""
    try:
        return _exchange(addr, b"FTCH", name.encode(), True)
    except (OSError, ValueError) as e:
        log.debug("fetching %s's metadata again from %s:%d: %s", name, addr[0], addr[1], e)
        return None


def in_background(what: str, addr: Tuple[str, int], kind: bytes, body: bytes,
                  on_answer: Optional[Callable[[bytes], Any]] = None) -> None:
    """Sends one message to `addr` from a thread, retrying while nothing listens there (RETRY_S)."""

    def run() -> None:
        deadline = time.monotonic() + RETRY_S
        while True:
            try:
                got = _exchange(addr, kind, body, on_answer is not None)
                if on_answer is not None:
                    if got:
                        on_answer(got)
                        return
                    raise ValueError("the agent listening there has another name")
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    log.error("%s to %s:%d failed: %s", what, addr[0], addr[1], e)
                    return
                time.sleep(0.1)
            except Exception as e:  # noqa: BLE001 - reported, as NIXL's background sends are
                log.error("%s to %s:%d failed: %s", what, addr[0], addr[1], e)
                return

    threading.Thread(target=run, name=f"tcpxd-nixl-{kind.decode().lower()}", daemon=True).start()
