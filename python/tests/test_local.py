"""The local session (the Session RPC framed plainly on the daemon's unix socket): waited transfers
over it byte-exact, deadlines, threads, refusals, Ctrl-C, and the fall-back to gRPC (`local=False`,
a TCP endpoint, a daemon that predates it)."""

from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import time
from typing import List

import pytest

import tcpxd
from conftest import Gate, when_in_flight
from fakes import HTTP2_SETTINGS, FakeDaemon, OldDaemon, recv_exactly
from tcpxd import _local, _proto

MIB = 1 << 20


def pattern(n: int, salt: int = 0) -> bytes:
    return bytes((i * 131 + salt) % 251 for i in range(n))


def transfer_calls(monkeypatch) -> List[str]:
    """The names of the unary gRPC transfer calls the clients make from now on."""
    calls: List[str] = []
    unary = tcpxd.Client._unary

    def counting(self, name, req, timeout=-1.0):
        if name in ("Write", "Read", "WriteBatch", "ReadBatch", "WaitTransfer"):
            calls.append(name)
        return unary(self, name, req, timeout)

    monkeypatch.setattr(tcpxd.Client, "_unary", counting)
    return calls


def wait_until(cond, what: str) -> None:
    """Polls `cond` (the daemon acts on a closed connection asynchronously); fails naming `what`."""
    for _ in range(200):
        if cond():
            return
        time.sleep(0.05)
    pytest.fail(f"never happened: {what}")


def test_endpoints_that_have_a_local_session():
    assert _local.socket_path("unix:/run/tcpxd/tcpxd.sock") == "/run/tcpxd/tcpxd.sock"
    assert _local.socket_path("unix:///run/tcpxd/tcpxd.sock") == "/run/tcpxd/tcpxd.sock"
    assert _local.socket_path("unix:rel.sock") == "rel.sock"
    for endpoint in ("127.0.0.1:50051", "dns:///node:50051", "unix-abstract:tcpxd"):
        assert _local.socket_path(endpoint) is None
        with tcpxd.Client(endpoint) as c:
            assert c._local is None
    with tcpxd.Client("unix:/nonexistent/tcpxd.sock", local=False) as c:
        assert c._local is None


def test_no_daemon_is_not_an_older_daemon(tmp_root):
    """Nothing listening: the transfer fails as gRPC says (Unavailable), and the client asks the
    next daemon there again rather than remembering it as one without the local session."""
    with tcpxd.Client(f"unix:{tmp_root / 'nobody.sock'}") as c:
        with pytest.raises(tcpxd.Unavailable):
            c.write(1, "tcpxd1:n:2:16:" + "0" * 32, 16)
        assert c._local is not None and c._local.available is None


def test_the_daemon_answers_the_preface_and_says_so(daemons):
    a, _ = daemons
    conn = _local.handshake(a.socket)
    assert conn is not None
    conn.close()
    with tcpxd.Client(a.endpoint) as c:
        assert (c.describe_node().local_session + "\n").encode() == _local.PREFACE


def test_waited_transfers_go_over_it_byte_exact(peered, monkeypatch):
    a, b = peered
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(2 * MIB) as src, cb.register_host(2 * MIB) as dst, ca.register_host(2 * MIB) as back:
            data = pattern(2 * MIB, 1)
            src.write_bytes(data)
            calls = transfer_calls(monkeypatch)
            r = ca.write(src, dst)
            assert ca._waited_path() == "local session"
            assert (r.total_bytes, r.bytes_done) == (2 * MIB, 2 * MIB) and r.transfer_id > 0
            assert dst.read_bytes() == data
            r = ca.read(dst.descriptor, back, MIB, remote_offset=MIB, timeout=30)
            assert r.total_bytes == MIB and back.read_bytes(0, MIB) == data[MIB:]
            ops = [tcpxd.WriteOp(src, dst, 4096, local_offset=i * 8192, remote_offset=i * 4096) for i in range(16)]
            r = ca.write_batch(ops, notification=b"local")
            assert r.total_bytes == 16 * 4096 and r.entries == []  # one buffer pair: packed, one status
            got = dst.read_bytes(0, 16 * 4096)
            assert got == b"".join(data[i * 8192 : i * 8192 + 4096] for i in range(16))
            rops = [tcpxd.ReadOp(dst, back, 4096, remote_offset=i * 4096, local_offset=(15 - i) * 4096) for i in range(16)]
            ca.read_batch(rops)
            assert back.read_bytes(0, 16 * 4096) == b"".join(got[(15 - i) * 4096 : (16 - i) * 4096] for i in range(16))
            assert calls == []
            assert len(ca._local._idle) == 1  # one thread, one connection, reused


@pytest.mark.parametrize("spin_s", [50e-3, 1e-6])
def test_a_bounded_spin_before_blocking_reads_the_same_answers(peered, monkeypatch, spin_s):
    """`_local.SPIN_S` (TCPXD_CLIENT_SPIN_US; 200 µs on 8 CPUs or more): a waited transfer's thread
    looks at its connection without blocking for that long, then blocks as before. An answer that
    comes within (50 ms) or after (1 µs) it is the same: bytes, refusals, the connection kept."""
    monkeypatch.setattr(_local, "SPIN_S", spin_s)
    a, b = peered
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(MIB) as src, cb.register_host(MIB) as dst, ca.register_host(MIB) as back:
            data = pattern(MIB, 3)
            src.write_bytes(data)
            for i in range(8):
                ca.write(src, dst, 4096, local_offset=i * 4096, remote_offset=i * 4096)
                ca.read(dst.descriptor, back, 4096, remote_offset=i * 4096, local_offset=i * 4096)
            assert back.read_bytes(0, 8 * 4096) == data[: 8 * 4096]
            (conn,) = ca._local._idle
            assert conn._poll is not None  # it looked before it blocked
            with pytest.raises(tcpxd.InvalidArgument, match="past the end"):
                ca.write(src, dst, 2 * MIB)
            r = ca.write(src, dst)
            assert r.bytes_done == MIB and dst.read_bytes() == data
            assert ca._local._idle == [conn]


def test_refused_requests_raise_their_exception_and_the_connection_stays(peered):
    a, b = peered
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(MIB) as src, cb.register_host(MIB) as dst:
            ca.write(src, dst, 16)
            (conn,) = ca._local._idle
            with pytest.raises(tcpxd.InvalidArgument, match="remote_descriptor") as e:
                ca.write(src, "tcpxd1:nonsense", 16)
            assert e.value.code.name == "INVALID_ARGUMENT" and e.value.event is None
            with pytest.raises(tcpxd.InvalidArgument, match="past the end"):
                ca.write(src, dst, 2 * MIB)
            with pytest.raises(tcpxd.NotFound):
                ca.read(dst, 987654, 16)
            old = dst.descriptor
            dst.rekey()
            with pytest.raises(tcpxd.PermissionDenied):  # refused by the remote side: a failed transfer
                ca.write(src, old, 16)
            ca.write(src, dst, 16)
            assert ca._local._idle == [conn]


def test_a_timeout_raises_deadline_exceeded_and_leaves_no_transfer(slow, slow_gate: Gate, monkeypatch):
    a, b = slow
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(128 * MIB) as src, cb.register_host(128 * MIB) as dst:
            calls = transfer_calls(monkeypatch)
            with slow_gate.closed(), pytest.raises(tcpxd.DeadlineExceeded) as e:  # it cannot end first
                ca.write(src, dst, timeout=0.2)
            assert calls == [] and ca._waited_path() == "local session"
            if e.value.event is not None:  # the daemon's answer (else the client's backstop, 1 s later)
                assert e.value.event.bytes_done < 128 * MIB
            wait_until(lambda: ca.stats().active_transfers == 0 and cb.stats().active_transfers == 0,
                       "no transfer left on either daemon")
            src.write_bytes(pattern(MIB, 2))
            ca.write(src, dst, MIB, timeout=30)
            assert dst.read_bytes(0, MIB) == pattern(MIB, 2)


def test_an_unanswered_transfer_gives_up_past_its_timeout(tmp_root):
    """The daemon's answer does not come: a little past `timeout` the client closes the connection
    (the daemon would cancel the transfer) and raises DeadlineExceeded."""
    frames: List[bytes] = []
    closed = threading.Event()

    def mute(conn: socket.socket) -> None:
        assert recv_exactly(conn, 8) == _local.PREFACE
        conn.sendall(_local.PREFACE)
        (n,) = struct.unpack(">I", recv_exactly(conn, 4))
        frame = recv_exactly(conn, n)
        first = _proto.message("SessionRequest").FromString(frame)
        if first.WhichOneof("op") == "attach_board":  # refused, as a daemon without boards does
            ev = _proto.message("SessionEvent")(tag=first.tag, refused={"code": 3, "message": "op: unknown"})
            body = ev.SerializeToString()
            conn.sendall(struct.pack(">I", len(body)) + body)
            (n,) = struct.unpack(">I", recv_exactly(conn, 4))
            frame = recv_exactly(conn, n)
        frames.append(frame)
        if conn.recv(1) == b"":
            closed.set()

    fake = FakeDaemon(tmp_root / "mute.sock", mute)
    try:
        with tcpxd.Client(fake.endpoint) as c:
            with pytest.raises(tcpxd.DeadlineExceeded, match="cancelled"):
                c.write(1, "tcpxd1:n:2:16:" + "0" * 32, 16, timeout=0.05)
        assert closed.wait(10)
        req = _proto.message("SessionRequest").FromString(frames[0])
        assert req.tag > 0 and req.write.timeout_ms == 50 and req.write.entry.length == 16
    finally:
        fake.close()


def test_threads_each_get_their_own_connection(peered, monkeypatch):
    a, b = peered
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(8 * MIB) as src, cb.register_host(8 * MIB) as dst:
            src.fill(seed=8)
            calls = transfer_calls(monkeypatch)
            ca.write(src, dst, 4096)
            # Another thread's transfer holds the connection: this one opens a second.
            held = ca._local._take()
            assert held is not None
            ca.write(src, dst, 4096)
            assert len(ca._local._idle) == 1 and ca._local._idle[0] is not held
            ca._local._give_back(held)
            errors: List[BaseException] = []

            def worker(i: int) -> None:
                try:
                    for _ in range(8):
                        ca.write(src, dst, MIB, local_offset=i * MIB, remote_offset=i * MIB)
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            ts = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            assert not errors and calls == []
            assert dst.checksum() == src.checksum()
            assert 2 <= len(ca._local._idle) <= 8 and not ca._local._busy


def test_an_idle_connection_gone_bad_is_replaced(peered, monkeypatch):
    a, b = peered
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(MIB) as src, cb.register_host(MIB) as dst:
            ca.write(src, dst, 4096)
            (conn,) = ca._local._idle
            conn.sock.shutdown(socket.SHUT_RDWR)  # as if the daemon had closed it (it restarted)
            deadline = time.monotonic() + 10
            while conn.ring is not None and not int.from_bytes(conn.ring.mem[16:24], "little"):
                # (with a request ring: a daemon closing the connection says first on the ring
                # that it ended the session (`ended`): wait for that, as for a real close)
                assert time.monotonic() < deadline
                time.sleep(0.01)
            calls = transfer_calls(monkeypatch)
            ca.write(src, dst, 4096)
            assert calls == [] and len(ca._local._idle) == 1 and ca._local._idle[0] is not conn


def test_ctrl_c_while_waiting_cancels_the_transfer(slow, slow_gate: Gate, sigint):
    """SIGINT while write() waits for the daemon's answer: KeyboardInterrupt, the connection is
    closed (the daemon cancels the transfer), and the next transfer takes a new one."""
    a, b = slow
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(128 * MIB) as src, cb.register_host(128 * MIB) as dst:
            ca.write(src, dst, 4096)
            (conn,) = ca._local._idle

            def cancelled() -> int:
                return sum(t.transfers for t in ca.stats().transfer_totals if t.status == "cancelled")

            before = cancelled()
            # To the main thread itself, so that its recv() is interrupted (as by Ctrl-C), once
            # the transfer is in flight (held by the gate: it cannot end first).
            main = threading.main_thread().ident
            assert main is not None
            with slow_gate.closed():
                when_in_flight(a.endpoint, lambda: signal.pthread_kill(main, signal.SIGINT))
                with pytest.raises(KeyboardInterrupt):
                    ca.write(src, dst)
            assert ca._local._idle == [] and not ca._local._busy and conn.sock.fileno() == -1
            wait_until(lambda: cancelled() == before + 1, "the interrupted transfer cancelled")
            src.write_bytes(pattern(MIB, 4))
            ca.write(src, dst, MIB)
            assert dst.read_bytes(0, MIB) == pattern(MIB, 4) and ca._waited_path() == "local session"


def test_local_false_takes_grpc(peered, monkeypatch):
    a, b = peered
    with tcpxd.Client(a.endpoint, local=False) as ca, tcpxd.Client(b.endpoint) as cb:
        assert ca._local is None
        with ca.register_host(MIB) as src, cb.register_host(MIB) as dst:
            src.fill(seed=3)
            ca.write(src, dst)
            assert ca._waited_path() == "own stream" and ca._own._tag == 1
            calls = transfer_calls(monkeypatch)
            ca.write(src, dst, timeout=30)
            assert calls == ["Write"] and dst.checksum() == src.checksum()


@pytest.mark.parametrize("answer", [b"", HTTP2_SETTINGS], ids=["closes", "http2"])
def test_a_daemon_without_it_is_asked_once_then_grpc(peered, tmp_root, answer):
    """A daemon that predates the local session closes the connection, or answers as HTTP/2: the
    client asks once, then every transfer goes through gRPC, byte-exact."""
    a, b = peered
    old = OldDaemon(tmp_root / f"old{len(answer)}.sock", a.socket, answer)
    try:
        with tcpxd.Client(old.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
            with ca.register_host(MIB) as src, cb.register_host(MIB) as dst:
                src.fill(seed=4)
                for n in (4096, MIB):
                    ca.write(src, dst, n)
                    ca.write(src, dst, n, timeout=30)
                assert old.prefaces == 1 and ca._local.available is False
                assert ca._waited_path() == "own stream"
                assert dst.checksum() == src.checksum()
    finally:
        old.close()


def test_a_request_too_large_for_a_frame_goes_through_grpc(peered, monkeypatch):
    """A request over the 64 MiB frame limit is not framed but made as the unary call (which
    grpcio itself refuses here: its messages stop at 64 MiB too)."""
    a, b = peered
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(MIB) as src, cb.register_host(MIB) as dst:
            calls = transfer_calls(monkeypatch)
            with pytest.raises(tcpxd.ResourceExhausted):
                ca.write(src, dst, 16, notification=bytes(_local.MAX_FRAME), timeout=30)
            assert calls == ["Write"]
            ca.write(src, dst, 16, notification=b"small", timeout=30)
            assert calls == ["Write"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_opens_its_own_connection(peered):
    """A child forked with the client's connections idle (a DataLoader worker, say) does not share
    them with its parent: its first transfer opens its own; the parent's stays the parent's."""
    a, b = peered
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(MIB) as src, cb.register_host(MIB) as dst:
            ca.write(src, dst, 4096)
            (mine,) = ca._local._idle
            pid = os.fork()
            if pid == 0:  # the child: report through the exit status only
                code = 1
                try:
                    if not ca._local._idle:
                        ca.write(src, dst, 4096, remote_offset=4096)
                        code = 0 if len(ca._local._idle) == 1 and ca._local._idle[0] is not mine else 3
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
            ca.write(src, dst, 4096)
            assert ca._local._idle == [mine]
