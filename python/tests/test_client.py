"""The sync client against two real daemons: host buffers, write/read/batch, notifications,
cancel, deadlines, and bad input raising the exception of its gRPC code."""

from __future__ import annotations

import os
import threading
import time

import pytest
from grpc._cython import cygrpc

import tcpxd
from conftest import Gate, start_daemon, stop_daemon, when_in_flight

MIB = 1 << 20


#: The ways waited transfers go: the daemon's local session (the default on a unix socket), the
#: client's own gRPC Session stream, unary gRPC calls.
PATHS = {"local": {}, "stream": {"local": False}, "unary": {"local": False, "stream": False}}


@pytest.fixture(params=list(PATHS))
def clients(peered, request):
    """Clients whose waited transfers take each path in turn."""
    a, b = peered
    with tcpxd.Client(a.endpoint, **PATHS[request.param]) as ca, tcpxd.Client(b.endpoint, **PATHS[request.param]) as cb:
        yield ca, cb


def pattern(n: int, salt: int = 0) -> bytes:
    return bytes((i * 131 + salt) % 251 for i in range(n))


def test_endpoint_default_comes_from_the_environment(monkeypatch, peered):
    a, _ = peered
    monkeypatch.setenv("TCPXD_ENDPOINT", a.endpoint)
    with tcpxd.Client() as c:
        assert c.endpoint == a.endpoint
        c.list_buffers()
    monkeypatch.delenv("TCPXD_ENDPOINT")
    assert tcpxd.Client().endpoint == tcpxd.DEFAULT_ENDPOINT == "unix:/run/tcpxd/tcpxd.sock"


def test_host_buffer_bytes_round_trip_and_release(clients):
    ca, _ = clients
    data = pattern(3 * MIB + 17)
    with ca.register_host(4 * MIB, label="rt") as buf:
        # Host memory this process shares with the daemon (a memfd the package maps): numpy() sees it.
        assert (buf.kind, buf.size, buf.label, buf.shared) == ("host_shared", 4 * MIB, "rt", True)
        buf.write_bytes(data, offset=5)
        assert buf.read_bytes(5, len(data)) == data
        ids = [b.id for b in ca.list_buffers()]
        assert buf.id in ids
    assert buf.released
    assert buf.id not in [b.id for b in ca.list_buffers()]


def test_write_then_read_back_is_byte_exact(clients):
    ca, cb = clients
    data = pattern(2 * MIB, 7)
    with ca.register_host(2 * MIB) as src, cb.register_host(2 * MIB) as dst, ca.register_host(2 * MIB) as back:
        src.write_bytes(data)
        r = ca.write(src, dst)
        assert isinstance(r, tcpxd.TransferResult) and r.total_bytes == 2 * MIB and r.bytes_done == 2 * MIB
        assert dst.read_bytes() == data
        assert dst.checksum() == src.checksum()
        # READ: the remote buffer (by descriptor string) into a local one, at offsets.
        r = ca.read(dst.descriptor, back, MIB, remote_offset=MIB, local_offset=0)
        assert r.total_bytes == MIB
        assert back.read_bytes(0, MIB) == data[MIB:]


def test_batches_move_every_entry(clients):
    ca, cb = clients
    with ca.register_host(MIB) as src, cb.register_host(MIB) as dst, ca.register_host(MIB) as back:
        src.fill(seed=11)
        ops = [tcpxd.WriteOp(src, dst, 4096, local_offset=i * 8192, remote_offset=i * 4096) for i in range(16)]
        r = ca.write_batch(ops, notification=b"batch")
        assert r.total_bytes == 16 * 4096 and r.entries == []  # one buffer pair: sent packed, one status
        s = src.read_bytes()
        got = dst.read_bytes(0, 16 * 4096)
        assert got == b"".join(s[i * 8192 : i * 8192 + 4096] for i in range(16))
        rops = [tcpxd.ReadOp(dst, back, 4096, remote_offset=i * 4096, local_offset=(15 - i) * 4096) for i in range(16)]
        ca.read_batch(rops)
        assert back.read_bytes(0, 16 * 4096) == b"".join(got[(15 - i) * 4096 : (16 - i) * 4096] for i in range(16))


def test_batches_of_one_buffer_pair_go_packed_and_others_as_entries(clients, monkeypatch):
    """A batch of one buffer pair travels as BatchRanges (varying or uniform lengths, WRITE and READ),
    byte-checked; two remote buffers, or a length left out, still go as entries (per-entry
    statuses); a packed entry past a buffer is refused naming `ranges.<field>[k]`, nothing moved."""
    ca, cb = clients
    sent = []
    real = tcpxd.Client._start

    def spy(self, name, req, timeout, wait):
        sent.append((name, req.HasField("ranges"), len(req.entries)))
        return real(self, name, req, timeout, wait)

    monkeypatch.setattr(tcpxd.Client, "_start", spy)
    with ca.register_host(MIB) as src, cb.register_host(MIB) as dst, cb.register_host(MIB) as dst2, \
            ca.register_host(MIB) as back:
        src.fill(seed=5)
        s = src.read_bytes()
        lens = [100 + 37 * i for i in range(64)]
        ops = [tcpxd.WriteOp(src, dst.descriptor, n, local_offset=(i * 7919) % 900_000, remote_offset=(63 - i) * 8192)
               for i, n in enumerate(lens)]
        r = ca.write_batch(ops)
        assert r.total_bytes == sum(lens) and r.entries == []
        got = dst.read_bytes()
        for i, n in enumerate(lens):
            lo = (i * 7919) % 900_000
            assert got[(63 - i) * 8192:(63 - i) * 8192 + n] == s[lo:lo + n], i
        rops = [tcpxd.ReadOp(dst, back, 4096, remote_offset=i * 8192, local_offset=(i * 3 % 64) * 4096) for i in range(64)]
        ca.read_batch(rops)
        b = back.read_bytes()
        for i in range(64):
            j = (i * 3 % 64) * 4096
            assert b[j:j + 4096] == got[i * 8192:i * 8192 + 4096], i
        assert sent == [("WriteBatch", True, 0), ("ReadBatch", True, 0)]
        # Two remote buffers: entries, one status each.
        r = ca.write_batch([tcpxd.WriteOp(src, dst, 4096), tcpxd.WriteOp(src, dst2, 4096)])
        assert [c for c, _ in r.entries] == [0, 0] and sent[-1] == ("WriteBatch", False, 2)
        # A length left out (the rest of the buffer): entries.
        ca.write_batch([tcpxd.WriteOp(src, dst, 4096), tcpxd.WriteOp(src, dst, local_offset=MIB - 100, remote_offset=8192)])
        assert sent[-1] == ("WriteBatch", False, 2)
        before = dst.checksum()
        with pytest.raises(tcpxd.InvalidArgument, match=r"ranges\.remote_offsets\[1\]"):
            ca.write_batch([tcpxd.WriteOp(src, dst, 4096), tcpxd.WriteOp(src, dst, 4096, remote_offset=MIB - 10)])
        with pytest.raises(tcpxd.InvalidArgument, match=r"ranges\.local_offsets\[2\]"):
            ca.read_batch([tcpxd.ReadOp(dst, back, 16, local_offset=k * (MIB // 2)) for k in range(3)])
        assert dst.checksum() == before


def test_batches_go_as_entries_to_a_daemon_without_packed_ranges(clients, monkeypatch):
    """A daemon whose DescribeNode does not list `batch_ranges` (one from before session 17) would
    refuse a packed batch ("entries: at least one entry is required"): the client asks the
    daemon's features once and sends such a daemon entries (per-entry statuses), from the client
    and from a session, byte-checked; a daemon that lists it gets packed batches."""
    ca, cb = clients
    from tcpxd import _ops

    real_unary, real_w, real_r = tcpxd.Client._unary, _ops.write_batch_request, _ops.read_batch_request
    asked, sent = [], []

    def older(self, name, req, timeout=-1.0):
        r = real_unary(self, name, req, timeout)
        if name == "DescribeNode":
            asked.append(name)
            del r.features[:]  # as a daemon before `batch_ranges` answers
        return r

    def spy_w(ops, *a, **k):
        req = real_w(ops, *a, **k)
        sent.append(("WriteBatch", req.HasField("ranges"), len(req.entries)))
        return req

    def spy_r(ops, *a, **k):
        req = real_r(ops, *a, **k)
        sent.append(("ReadBatch", req.HasField("ranges"), len(req.entries)))
        return req

    monkeypatch.setattr(tcpxd.Client, "_unary", older)
    monkeypatch.setattr(_ops, "write_batch_request", spy_w)
    monkeypatch.setattr(_ops, "read_batch_request", spy_r)
    monkeypatch.setattr(ca, "_batch_ranges", None)
    with ca.register_host(MIB) as src, cb.register_host(MIB) as dst, ca.register_host(MIB) as back:
        src.fill(seed=9)
        s = src.read_bytes()
        ops = [tcpxd.WriteOp(src, dst.descriptor, 4096, local_offset=i * 8192, remote_offset=(15 - i) * 4096)
               for i in range(16)]
        r = ca.write_batch(ops)
        assert len(r.entries) == 16 and r.total_bytes == 16 * 4096
        got = dst.read_bytes(0, 16 * 4096)
        assert got == b"".join(s[(15 - i) * 8192:(15 - i) * 8192 + 4096] for i in range(16))
        ca.read_batch([tcpxd.ReadOp(dst, back, 4096, remote_offset=i * 4096, local_offset=i * 4096) for i in range(16)])
        assert back.read_bytes(0, 16 * 4096) == got
        with ca.session() as sess:
            assert len(sess.write_batch(ops).result(timeout=60).entries) == 16
        assert sent == [("WriteBatch", False, 16), ("ReadBatch", False, 16), ("WriteBatch", False, 16)]
        assert asked == ["DescribeNode"]  # asked once
        # The real daemon lists the feature: packed from then on.
        monkeypatch.setattr(tcpxd.Client, "_unary", real_unary)
        ca.describe_node()
        assert ca.write_batch(ops).entries == [] and sent[-1] == ("WriteBatch", True, 0)


def test_unwaited_transfers_are_futures(clients):
    ca, cb = clients
    with ca.register_host(MIB) as src, cb.register_host(8 * MIB) as dst:
        src.fill(byte=0x5A)
        ts = [ca.write(src, dst, remote_offset=i * MIB, wait=False) for i in range(8)]
        assert len({t.id for t in ts}) == 8
        for t in ts:
            assert t.result(timeout=30).bytes_done == MIB
        assert dst.read_bytes(7 * MIB, 16) == b"\x5a" * 16
        # A finished transfer cannot be cancelled any more.
        assert ts[0].cancel() is False
        events = list(ts[0].events())
        assert events[-1].status_code == 0


def test_notifications_arrive_through_subscribe(clients):
    ca, cb = clients
    with cb.subscribe() as sub, ca.register_host(MIB) as src, cb.register_host(MIB) as dst:
        ca.write(src, dst, 4096, notification=b"landed-1")
        ca.write_batch([tcpxd.WriteOp(src, dst, 4096, remote_offset=8192)], notification=b"landed-2")
        n1, n2 = sub.next(timeout=10), sub.next(timeout=10)
        assert (n1.payload, n2.payload) == (b"landed-1", b"landed-2")
        assert n1.from_node == "pa" and n1.buffer_ids == [dst.id]
        with pytest.raises(tcpxd.DeadlineExceeded):
            sub.next(timeout=0.2)


def test_a_notification_alone_is_a_write_of_zero_bytes(clients):
    """length=0 with a notification: a notification alone (no byte moves, control messages only
    between the daemons); zero bytes without one are refused naming the field."""
    ca, cb = clients
    with cb.subscribe() as sub, ca.register_host(MIB) as src, cb.register_host(MIB) as dst:
        r = ca.write(src, dst, 0, remote_offset=MIB, notification=b"alone")
        assert r.bytes_done == 0
        n = sub.next(timeout=10)
        assert (n.payload, n.transfer_id, n.buffer_ids) == (b"alone", r.transfer_id, [dst.id])
        with pytest.raises(tcpxd.InvalidArgument, match=r"entries\[0\]\.length: must be at least 1 byte"):
            ca.write(src, dst, 0)


@pytest.mark.parametrize("local", [True, False])
def test_subscribe_on_the_local_session_or_grpc(daemons, local):
    """On a unix endpoint the subscription is a local session of its own, read on the caller's
    thread (no helper thread, no gRPC stream); `local=False`, the Subscribe RPC. Either way:
    notifications in order, a timeout, closing from another thread ends the iteration."""
    import threading

    from tcpxd._subscription import LocalSubscription

    a, b = daemons
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint, local=local) as cb:
        with ca.register_host(MIB) as src, cb.register_host(MIB) as dst:
            sub = cb.subscribe()
            assert isinstance(sub, LocalSubscription) == local
            started = []
            real_start = threading.Thread.start

            def record(t: threading.Thread) -> None:
                # gRPC's own threads (its channel delivers connectivity changes to the reattach
                # watcher on a thread of its own, whenever the state moves) are not the
                # subscription's: only threads of other code count.
                target = getattr(t, "_target", None)
                if not str(getattr(target, "__module__", "")).startswith("grpc"):
                    started.append(t.name)
                real_start(t)

            threading.Thread.start = record  # type: ignore[method-assign]
            try:
                for i in range(50):
                    ca.write(src, dst, 16, notification=b"n-%d" % i)
                got = [sub.next(timeout=10).payload for _ in range(50)]
            finally:
                threading.Thread.start = real_start  # type: ignore[method-assign]
            assert got == [b"n-%d" % i for i in range(50)]
            if local:
                assert not started, started  # read on this thread (the gRPC form starts one a next())
                with pytest.raises(tcpxd.DeadlineExceeded):
                    sub.next(timeout=0.1)
                ca.write(src, dst, 16, notification=b"after a timeout")  # the subscription stays
                n = sub.next(timeout=10)
                assert (n.payload, n.from_node, n.buffer_ids) == (b"after a timeout", "pa", [dst.id])
            ca.write(src, dst, 16, notification=b"iterated")
            seen = []
            closer = threading.Timer(0.5, sub.close)
            closer.start()
            for n in sub:  # ends once closed
                seen.append(n.payload)
            closer.join()
            assert seen == [b"iterated"]


def test_bad_input_raises_the_exception_of_its_code(clients):
    ca, cb = clients
    with pytest.raises(tcpxd.InvalidArgument) as e:
        ca.register_host(0)
    assert "size" in e.value.message and e.value.code.name == "INVALID_ARGUMENT"
    with ca.register_host(MIB) as src, cb.register_host(MIB) as dst:
        with pytest.raises(tcpxd.InvalidArgument, match="descriptor"):
            ca.write(src, "tcpxd1:nonsense", 16)
        with pytest.raises(tcpxd.InvalidArgument, match="past the end"):
            ca.write(src, dst, 2 * MIB)
        with pytest.raises(tcpxd.NotFound):
            ca.write(987654, dst, 16)
        # A wrong key: the descriptor with another key is refused by the remote side.
        head, key = dst.descriptor.split("@")[0].rsplit(":", 1)
        forged = f"{head}:{'0' * len(key) if key != '0' * len(key) else '1' * len(key)}"
        with pytest.raises(tcpxd.PermissionDenied) as pd:
            ca.write(src, forged, 16)
        assert pd.value.message
        # Rekeying makes the old descriptor fail the same way.
        old = dst.descriptor
        dst.rekey()
        with pytest.raises(tcpxd.PermissionDenied):
            ca.write(src, old, 16)
        ca.write(src, dst, 16)
    with pytest.raises(tcpxd.NotFound):
        ca.cancel(123456789)
    assert issubclass(tcpxd.PermissionDenied, tcpxd.TcpxdError)


def test_cancel_stops_a_transfer_on_both_sides(slow, slow_gate: Gate):
    a, b = slow
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(128 * MIB) as src, cb.register_host(128 * MIB) as dst:
            with slow_gate.closed():  # it cannot end before the cancel
                t = ca.write(src, dst, wait=False)
                assert t.cancel() is True
                with pytest.raises(tcpxd.Cancelled) as e:
                    t.result()
            assert e.value.event.bytes_done < 128 * MIB
            # The lanes are usable again: the next transfer is byte-exact.
            src.write_bytes(pattern(MIB, 3))
            ca.write(src, dst, MIB)
            assert dst.read_bytes(0, MIB) == pattern(MIB, 3)


def test_deadline_fails_a_transfer_with_deadline_exceeded(slow, slow_gate: Gate):
    a, b = slow
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(128 * MIB) as src, cb.register_host(128 * MIB) as dst:
            with slow_gate.closed():  # they cannot end before their deadline
                t0 = time.monotonic()
                with pytest.raises(tcpxd.DeadlineExceeded):
                    ca.write(src, dst, timeout=0.2)
                assert time.monotonic() - t0 < 30  # the deadline, not the 128 MiB held
                # Unwaited with a deadline: the result says so too.
                t = ca.write(src, dst, timeout=0.2, wait=False)
                with pytest.raises(tcpxd.DeadlineExceeded):
                    t.result()
            ca.write(src, dst, MIB, timeout=30)


def test_threads_share_one_client(clients):
    ca, cb = clients
    with ca.register_host(8 * MIB) as src, cb.register_host(8 * MIB) as dst:
        src.fill(seed=5)
        errors = []

        def worker(i: int) -> None:
            try:
                for _ in range(4):
                    ca.write(src, dst, MIB, local_offset=i * MIB, remote_offset=i * MIB)
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors
        assert dst.checksum() == src.checksum()


def test_tcp_endpoint_sends_the_api_token(tmp_root):
    token_file = tmp_root / "token"
    token_file.write_text("s3cret-token-for-the-python-test\n")
    os.chmod(token_file, 0o600)
    d = start_daemon(tmp_root, "tok", extra=["--api-tcp", "127.0.0.1:0", "--api-token-file", str(token_file)])
    try:
        addr = str(d.ready["api_tcp"])
        with tcpxd.Client(addr, token_file=str(token_file)) as c:
            assert c.list_buffers() == []
        with tcpxd.Client(addr, token="wrong-token-wrong-token") as c:
            with pytest.raises(tcpxd.Unauthenticated):
                c.list_buffers()
    finally:
        stop_daemon(d)


def test_waiting_transfers_take_one_round_trip(clients, monkeypatch):
    """write()/read() and the batch forms take one round trip each, no WaitTransfer: a frame on the
    local session (no gRPC call at all, with a timeout too), a request on the client's own Session
    stream, or (stream=False, or with a timeout) a unary call with `wait`."""
    ca, cb = clients
    calls = []
    unary = tcpxd.Client._unary

    def counting(self, name, req, timeout=-1.0):
        calls.append(name)
        return unary(self, name, req, timeout)

    with ca.register_host(MIB) as src, cb.register_host(MIB) as dst:
        monkeypatch.setattr(tcpxd.Client, "_unary", counting)
        tags = ca._own._tag if ca._own else 0
        ca.write(src, dst, 4096)
        ca.read(dst, src, 4096)
        ca.write_batch([tcpxd.WriteOp(src, dst, 4096)])
        ca.read_batch([tcpxd.ReadOp(dst, src, 4096)])
        ca.write(src, dst, 4096, timeout=30)  # a deadline: the unary call on gRPC (its deadline)
        monkeypatch.setattr(tcpxd.Client, "_unary", unary)
    if ca._local:
        assert calls == [] and ca._waited_path() == "local session"
    elif ca._own:
        assert calls == ["Write"] and ca._own._tag - tags == 4
    else:
        assert calls == ["Write", "Read", "WriteBatch", "ReadBatch", "Write"]


def test_own_stream_recovers_and_falls_back(clients):
    """The client's own stream: ended while idle, it is reopened; busy (another thread's transfer),
    the caller makes the unary call; closed, transfers still work through unary calls."""
    ca, cb = clients
    if ca._local or ca._own is None:
        path = "the local session" if ca._local else "unary calls"
        pytest.skip(f"covers the client's own gRPC Session stream; these clients wait on {path}")
    with ca.register_host(MIB) as src, cb.register_host(MIB) as dst:
        src.fill(seed=9)
        ca.write(src, dst)
        first = ca._own._call
        first.cancel(cygrpc.StatusCode.unavailable, "test")  # as if the daemon went away while idle
        ca.write(src, dst, 4096)  # not sent on the dead stream: a unary call
        ca.write(src, dst, 4096)
        assert ca._own._call is not None and ca._own._call is not first
        assert ca._own._lock.acquire(blocking=False)  # another thread's transfer holds it
        try:
            tags = ca._own._tag
            r = ca.write(src, dst, 4096)
            assert r.bytes_done == 4096 and ca._own._tag == tags
        finally:
            ca._own._lock.release()
        ca._own.close()
        assert ca._own._call is None
        ca.write(src, dst)
        assert dst.checksum() == src.checksum()


def test_failure_on_the_own_stream_raises_and_the_next_transfer_works(slow, slow_gate: Gate):
    """A transfer whose stream fails while it waits raises the stream's status; the daemon cancels
    it (as for a unary caller that went away) and the next transfer opens a new stream."""
    a, b = slow
    with tcpxd.Client(a.endpoint, local=False) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(128 * MIB) as src, cb.register_host(128 * MIB) as dst:
            ca.write(src, dst, 4096)
            call = ca._own._call
            with slow_gate.closed():  # the stream fails while the write waits
                when_in_flight(a.endpoint, lambda: call.cancel(cygrpc.StatusCode.cancelled, "test"))
                with pytest.raises(tcpxd.Cancelled):
                    ca.write(src, dst)
            src.write_bytes(pattern(MIB, 5))
            ca.write(src, dst, MIB)
            assert ca._own._call is not call
            assert dst.read_bytes(0, MIB) == pattern(MIB, 5)


@pytest.mark.parametrize("path", ["local", "stream"])
def test_closing_the_client_ends_a_transfer_waiting_on_it(slow, slow_gate: Gate, path):
    """close() does not wait for another thread's transfer on the client's local session or own
    stream: the transfer ends Cancelled (as a unary call does when its channel closes)."""
    a, b = slow
    with tcpxd.Client(b.endpoint) as cb, cb.register_host(128 * MIB) as dst:
        ca = tcpxd.Client(a.endpoint, **PATHS[path])
        src = ca.register_host(128 * MIB)
        ca.write(src, dst, 4096)
        got = []

        def writer() -> None:
            try:
                ca.write(src, dst)
            except tcpxd.TcpxdError as e:
                got.append(e)

        with slow_gate.closed():  # closed while the write waits
            closer = when_in_flight(a.endpoint, ca.close)
            t = threading.Thread(target=writer)
            t.start()
            closer.join(60)
            t.join(30)
        assert not t.is_alive() and len(got) == 1 and isinstance(got[0], tcpxd.Cancelled)


def test_an_interrupted_wait_on_the_own_stream_cancels_the_transfer(slow, slow_gate: Gate, sigint):
    """Ctrl-C while write() waits on the client's own stream: KeyboardInterrupt, the daemon cancels
    the transfer (as for a unary call that goes away), and the client's next transfer works."""
    import _thread

    a, b = slow
    with tcpxd.Client(a.endpoint, local=False) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(128 * MIB) as src, cb.register_host(128 * MIB) as dst:
            ca.write(src, dst, 4096)

            def cancelled() -> int:
                return sum(t.transfers for t in ca.stats().transfer_totals if t.status == "cancelled")

            before = cancelled()
            with slow_gate.closed():  # interrupted while the write waits
                when_in_flight(a.endpoint, _thread.interrupt_main)
                with pytest.raises(KeyboardInterrupt):
                    ca.write(src, dst)
            for _ in range(100):
                if cancelled() > before:
                    break
                time.sleep(0.05)
            assert cancelled() == before + 1
            src.write_bytes(pattern(MIB, 6))
            ca.write(src, dst, MIB)
            assert dst.read_bytes(0, MIB) == pattern(MIB, 6)


def test_own_stream_and_sessions_share_one_client(clients):
    """Waited transfers (on each path) while a session of the same client carries others from
    another thread: both finish, byte-exact."""
    ca, cb = clients
    with ca.register_host(2 * MIB) as src, cb.register_host(2 * MIB) as dst:
        src.fill(seed=21)
        errors = []

        def session_writes() -> None:
            try:
                with ca.session() as s:
                    for _ in range(20):
                        futs = [s.write(src, dst, 65536, local_offset=MIB + i * 65536, remote_offset=MIB + i * 65536) for i in range(16)]
                        [f.result(timeout=30) for f in futs]
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        t = threading.Thread(target=session_writes)
        t.start()
        for i in range(200):
            ca.write(src, dst, 4096, local_offset=(i % 256) * 4096, remote_offset=(i % 256) * 4096)
        ca.write(src, dst, MIB)
        t.join(60)
        assert not t.is_alive() and not errors
        assert dst.checksum() == src.checksum()


def test_no_daemon_names_the_endpoint_and_the_fix(tmp_root):
    """As tcpxctl's: where the client looked and what to do, not only grpcio's words."""
    endpoint = f"unix:{tmp_root}/nothing.sock"
    with tcpxd.Client(endpoint, timeout=5) as c:
        with pytest.raises(tcpxd.Unavailable) as e:
            c.list_buffers()
    text = str(e.value)
    assert f"cannot connect to {endpoint}" in text, text
    assert "is tcpxd running?" in text and "TCPXD_ENDPOINT" in text, text


def test_no_daemon_names_the_endpoint_and_the_fix_asyncio(tmp_root):
    import asyncio

    endpoint = f"unix:{tmp_root}/nothing.sock"

    async def main() -> str:
        async with tcpxd.AsyncClient(endpoint, timeout=5) as c:
            try:
                await c.list_buffers()
            except tcpxd.Unavailable as e:
                return str(e)
        return "no error"

    text = asyncio.run(main())
    assert f"cannot connect to {endpoint}" in text and "TCPXD_ENDPOINT" in text, text


def test_ready_event_without_torch_says_host_buffers_need_none(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with pytest.raises(tcpxd.FailedPrecondition) as e:
        tcpxd.ready_event()
    assert "register_host" in str(e.value) and "leave ready_event= out" in str(e.value)
