"""Client.session(): many transfers in flight on one stream, over the daemon's local session (a
connection of its own, the Session RPC framed plainly) where the client's `local` rules allow it,
else the Session RPC. Each case runs on both paths unless it is about one."""

from __future__ import annotations

import time
from typing import List

import pytest

import tcpxd
from conftest import Gate
from fakes import OldDaemon

MIB = 1 << 20

#: Client options per path: the local session (the default on a unix socket), gRPC.
PATHS = {"local": {}, "grpc": {"local": False}}


@pytest.fixture(params=list(PATHS))
def path(request) -> str:
    return request.param


def session_calls(monkeypatch) -> List[str]:
    """The gRPC streaming calls clients make from now on (the Session RPC's is "Session")."""
    calls: List[str] = []
    stream_stream = tcpxd.Client._stream_stream

    def counting(self, name, reqs, timeout=None):
        calls.append(name)
        return stream_stream(self, name, reqs, timeout)

    monkeypatch.setattr(tcpxd.Client, "_stream_stream", counting)
    return calls


def cancelled_transfers(c: tcpxd.Client) -> int:
    return sum(x.transfers for x in c.stats().transfer_totals if x.status == "cancelled")


def wait_until(cond, what: str) -> None:
    for _ in range(200):
        if cond():
            return
        time.sleep(0.05)
    pytest.fail(f"never happened: {what}")


def test_many_in_flight_byte_exact(peered, path, monkeypatch):
    a, b = peered
    calls = session_calls(monkeypatch)
    with tcpxd.Client(a.endpoint, **PATHS[path]) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(4 * MIB) as src, cb.register_host(4 * MIB) as dst, ca.register_host(4 * MIB) as back:
            src.fill(seed=7)
            with ca.session() as s:
                assert s.path == ("local session" if path == "local" else "grpc")
                for round_ in range(4):
                    futs = [s.write(src, dst, 65536, local_offset=i * 65536, remote_offset=(63 - i) * 65536) for i in range(64)]
                    results = [f.result(timeout=60) for f in futs]
                    assert all(r.bytes_done == 65536 for r in results)
                    assert len({r.transfer_id for r in results}) == 64
                futs = [s.read(dst, back, MIB, remote_offset=i * MIB, local_offset=(3 - i) * MIB) for i in range(4)]
                assert [f.result(timeout=60).total_bytes for f in futs] == [MIB] * 4
                batch = s.write_batch([tcpxd.WriteOp(src, dst, 4096, remote_offset=i * 4096) for i in range(8)])
                assert batch.result(timeout=60).total_bytes == 8 * 4096
            data = src.read_bytes()
            got = dst.read_bytes()
            moved = b"".join(data[(63 - i) * 65536 : (64 - i) * 65536] for i in range(64))  # dst before the batch
            assert got[8 * 4096 :] == moved[8 * 4096 :] and got[: 8 * 4096] == data[:4096] * 8
            assert back.read_bytes() == b"".join(moved[(3 - i) * MIB : (4 - i) * MIB] for i in range(4))
    assert calls == ([] if path == "local" else ["Session"])


def test_cancel_one_in_flight(slow, slow_gate: Gate, path):
    a, b = slow
    with tcpxd.Client(a.endpoint, **PATHS[path]) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(128 * MIB) as src, cb.register_host(128 * MIB) as dst:
            before = cancelled_transfers(ca)
            with ca.session() as s:
                # The big one held by the gate until cancelled; the 4 KiB WRITE goes inline on the
                # control connection (transfer.inline_max_bytes), which the gate does not hold.
                with slow_gate.closed():
                    big = s.write(src, dst)
                    small = s.write(src, dst, 4096)
                    assert small.result(timeout=30).bytes_done == 4096
                    assert s.cancel(big).result(timeout=30) is True
                    with pytest.raises(tcpxd.Cancelled):
                        big.result(timeout=30)
                with pytest.raises(tcpxd.FailedPrecondition, match=r"already finished \(OK\)"):
                    s.cancel(small).result(timeout=30)  # it changes nothing
                assert s.write(src, dst, 4096).result(timeout=30).bytes_done == 4096
            assert cancelled_transfers(ca) == before + 1


def test_refused_submit_raises_its_exception(peered, path):
    a, b = peered
    with tcpxd.Client(a.endpoint, **PATHS[path]) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(MIB) as src, cb.register_host(MIB) as dst:
            with ca.session() as s:
                bad = s.write(src, "tcpxd1:nonsense", 16)
                past = s.write(src, dst, 2 * MIB)
                good = s.write(src, dst, 16)
                with pytest.raises(tcpxd.InvalidArgument, match="remote_descriptor"):
                    bad.result(timeout=30)
                with pytest.raises(tcpxd.InvalidArgument, match="past the end"):
                    past.result(timeout=30)
                assert good.result(timeout=30).bytes_done == 16  # the stream goes on
            with pytest.raises(tcpxd.TcpxdError, match="closed"):
                s.write(src, dst, 16)


def test_a_request_too_large_for_a_frame_fails_alone(peered):
    """The local session's frames stop at 64 MiB: a larger request fails with
    ResourceExhausted naming the limit, without reaching the daemon; the session goes on."""
    a, b = peered
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(MIB) as src, cb.register_host(MIB) as dst:
            with ca.session() as s:
                assert s.path == "local session"
                huge = s.write(src, dst, 16, notification=bytes(65 * MIB))
                with pytest.raises(tcpxd.ResourceExhausted, match="67108864-byte frame limit"):
                    huge.result(timeout=30)
                assert s.write(src, dst, 16).result(timeout=30).bytes_done == 16


def test_close_waits_for_in_flight_transfers(slow, path):
    a, b = slow
    with tcpxd.Client(a.endpoint, **PATHS[path]) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(32 * MIB) as src, cb.register_host(32 * MIB) as dst:
            src.fill(seed=3)
            s = ca.session()
            futs = [s.write(src, dst, 8 * MIB, local_offset=i * 8 * MIB, remote_offset=i * 8 * MIB) for i in range(4)]
            s.close()
            assert all(f.done() for f in futs)
            assert [f.result().bytes_done for f in futs] == [8 * MIB] * 4
            assert dst.checksum() == src.checksum()


def test_leaving_by_an_exception_cancels_in_flight_transfers(slow, slow_gate: Gate, path):
    a, b = slow
    with tcpxd.Client(a.endpoint, **PATHS[path]) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(128 * MIB) as src, cb.register_host(128 * MIB) as dst:
            before = cancelled_transfers(ca)
            with slow_gate.closed():  # none can end before the session is left
                with pytest.raises(RuntimeError):
                    with ca.session() as s:
                        futs = [s.write(src, dst, 32 * MIB, local_offset=i * 32 * MIB, remote_offset=i * 32 * MIB)
                                for i in range(4)]
                        time.sleep(0.1)
                        raise RuntimeError("the caller failed")
                for f in futs:
                    with pytest.raises(tcpxd.Cancelled):
                        f.result(timeout=30)
            wait_until(lambda: ca.stats().active_transfers == 0 and cb.stats().active_transfers == 0,
                       "no transfer left on either daemon")
            assert cancelled_transfers(ca) > before  # not every one need have started on the peer
            assert ca.write(src, dst, MIB, timeout=30).bytes_done == MIB


def test_session_timeout_fails_what_is_in_flight(slow, slow_gate: Gate, path):
    a, b = slow
    with tcpxd.Client(a.endpoint, **PATHS[path]) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(128 * MIB) as src, cb.register_host(128 * MIB) as dst:
            with slow_gate.closed(), ca.session(timeout=0.3) as s:  # it cannot end before the timeout
                fut = s.write(src, dst)
                with pytest.raises(tcpxd.DeadlineExceeded):
                    fut.result(timeout=30)
            wait_until(lambda: ca.stats().active_transfers == 0 and cb.stats().active_transfers == 0,
                       "no transfer left on either daemon")


def test_a_request_timeout_is_the_daemons(slow, slow_gate: Gate, path):
    a, b = slow
    with tcpxd.Client(a.endpoint, **PATHS[path]) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(128 * MIB) as src, cb.register_host(128 * MIB) as dst:
            with ca.session() as s:
                with slow_gate.closed():  # it cannot end before its timeout
                    slow_one = s.write(src, dst, timeout=0.2)
                    with pytest.raises(tcpxd.DeadlineExceeded):
                        slow_one.result(timeout=30)
                assert s.write(src, dst, 4096).result(timeout=30).bytes_done == 4096


def test_closing_the_client_ends_its_local_sessions(slow, slow_gate: Gate):
    a, b = slow
    ca = tcpxd.Client(a.endpoint)
    with tcpxd.Client(b.endpoint) as cb, cb.register_host(128 * MIB) as dst:
        src = ca.register_host(128 * MIB)
        s = ca.session()
        with slow_gate.closed():  # it cannot end before the close
            fut = s.write(src, dst)
            time.sleep(0.1)
            ca.close()
            with pytest.raises(tcpxd.Cancelled):
                fut.result(timeout=30)
        s.close()
        wait_until(lambda: cb.stats().active_transfers == 0, "no transfer left on the receiving daemon")


def test_fallback_to_grpc(peered, tmp_root, monkeypatch):
    """local=False, a TCP endpoint or a daemon that predates the local session: the Session RPC;
    the older daemon is found out once (its client's waited transfers then skip the handshake too)."""
    a, b = peered
    calls = session_calls(monkeypatch)
    with tcpxd.Client(a.endpoint, local=False) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(MIB) as src, cb.register_host(MIB) as dst:
            with ca.session() as s:
                assert s.path == "grpc" and s.write(src, dst, 4096).result(timeout=30).bytes_done == 4096
    assert calls == ["Session"]
    old = OldDaemon(tmp_root / "old-s.sock", a.socket, b"")
    try:
        with tcpxd.Client(old.endpoint) as c, tcpxd.Client(b.endpoint) as cb:
            with c.register_host(MIB) as src, cb.register_host(MIB) as dst:
                with c.session() as s:
                    assert s.path == "grpc" and s.write(src, dst, 4096).result(timeout=30).bytes_done == 4096
                assert c._local is not None and c._local.available is False
                with c.session() as s:
                    assert s.path == "grpc"
                assert old.prefaces == 1
    finally:
        old.close()
    assert calls == ["Session"] * 3
