"""Stand-ins for a daemon on a unix socket: one that predates the local session (in front of a real
daemon), and a bare server for protocol tests."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

from tcpxd import _local

#: The start of what an HTTP/2 server sends first (its SETTINGS frame).
HTTP2_SETTINGS = b"\x00\x00\x12\x04\x00\x00\x00\x00\x00"


def recv_exactly(conn: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        part = conn.recv(n - len(got))
        if not part:
            break
        got += part
    return got


class FakeDaemon:
    """A unix socket server in a thread, each connection handled by `serve(conn)`."""

    def __init__(self, path: Path, serve):
        self.path = str(path)
        self._serve = serve
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"unix:{self.path}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def close(self) -> None:
        self._listener.close()
        Path(self.path).unlink(missing_ok=True)


class OldDaemon(FakeDaemon):
    """A daemon from before the local session, made of a real one: gRPC connections are relayed to
    it; one that starts with the local session's preface gets `answer` (nothing, or what an HTTP/2
    server sends first) and is closed."""

    def __init__(self, path: Path, real: str, answer: bytes):
        self.prefaces = 0
        self._real, self._answer = real, answer
        super().__init__(path, self._relay)

    def _relay(self, conn: socket.socket) -> None:
        first = recv_exactly(conn, len(_local.PREFACE))
        if first == _local.PREFACE:
            self.prefaces += 1
            conn.sendall(self._answer)
            conn.close()
            return
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        up.connect(self._real)
        up.sendall(first)
        threading.Thread(target=self._pump, args=(up, conn), daemon=True).start()
        self._pump(conn, up)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
