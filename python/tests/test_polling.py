"""A caller polling learns completions itself (issue #39 point 4): `Session.poll()` and the NIXL
agent's `check_xfer_state` read the session's connection in the calling thread, so a loop that
never releases the GIL does not wait for the reader thread. The reader thread is held off here
(its wait for the connection parked on an event), so every completion must be the poller's; the
speed-up is measured by `python -m tcpxd.nixl_compare` (docs/NIXL.md)."""

from __future__ import annotations

import select
import threading
import time
import types

import numpy as np
import pytest

import tcpxd
from tcpxd import _session
from tcpxd.nixl import _plan, host_array, nixl_agent, nixl_agent_config


class _ParkedPoll:
    """select.poll() whose poll() in a session's reader thread waits for `release` (held off)."""

    release = threading.Event()

    def __init__(self) -> None:
        self._real = select.poll()

    def register(self, *a: object) -> None:
        self._real.register(*a)  # type: ignore[arg-type]

    def poll(self, *a: object) -> list:
        if threading.current_thread().name == "tcpxd-session":
            _ParkedPoll.release.wait()
        return self._real.poll(*a)  # type: ignore[arg-type]


@pytest.fixture
def parked_readers(monkeypatch):
    _ParkedPoll.release = threading.Event()
    monkeypatch.setattr(_session, "select", types.SimpleNamespace(poll=_ParkedPoll, POLLIN=select.POLLIN))
    yield
    _ParkedPoll.release.set()


def _spin_until(cond, poll, deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not cond():
        poll()
        assert time.monotonic() < deadline, "never finished"


def test_session_poll_resolves_transfers_in_the_polling_thread(peered, parked_readers):
    a, b = peered
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        src = ca.register_host(1 << 20)
        src.numpy()[:] = np.arange(1 << 20, dtype=np.uint64).astype(np.uint8)
        dst = cb.register_host(1 << 20)
        s = ca.session()
        assert s.path == "local session"
        resolved_by = []
        futs = [s.write(src, dst.descriptor, 4096 * (i + 1), local_offset=0) for i in range(8)]
        for f in futs:
            f.add_done_callback(lambda _f: resolved_by.append(threading.current_thread()))
        _spin_until(lambda: all(f.done() for f in futs), s.poll)
        assert all(f.result().bytes_done == 4096 * (i + 1) for i, f in enumerate(futs))
        assert resolved_by == [threading.current_thread()] * 8  # none by the (parked) reader thread
        assert bytes(dst.numpy()[: 8 * 4096]) == bytes(src.numpy()[: 8 * 4096])
        # a thread waiting on a result reads the connection itself too
        assert s.write(src, dst.descriptor, 1 << 20).result(timeout=30).bytes_done == 1 << 20
        assert bytes(dst.numpy()) == bytes(src.numpy())
        _ParkedPoll.release.set()
        s.close()


def test_check_xfer_state_learns_done_without_the_reader_thread(peered, parked_readers):
    a, b = peered
    n = 1 << 16
    m1, m2 = host_array(n), host_array(n)
    m1[:] = np.random.default_rng(3).integers(0, 256, n, dtype=np.uint8)
    with nixl_agent("poll-1", nixl_agent_config(endpoint=a.endpoint)) as one, \
            nixl_agent("poll-2", nixl_agent_config(endpoint=b.endpoint)) as two:
        one.register_memory([(m1.ctypes.data, n, 0, "")], "DRAM")
        two.register_memory([(m2.ctypes.data, n, 0, "")], "DRAM")
        one.add_remote_agent(two.get_agent_metadata())
        local = one.prep_xfer_dlist("NIXL_INIT_AGENT", [(m1.ctypes.data + i * 4096, 4096, 0) for i in range(16)], "DRAM")
        remote = one.prep_xfer_dlist("poll-2", [(m2.ctypes.data + i * 4096, 4096, 0) for i in range(16)], "DRAM")
        for k in range(3):  # the prepared path, and again on its lane
            h = one.make_prepped_xfer("WRITE", local, list(range(16)), remote, list(range(16))[::-1], b"w%d" % k)
            assert type(h._xfer.plan) is _plan.Prepared  # the lists were prepared in the daemon: answers waited here
            assert one.transfer(h) == "PROC"
            _spin_until(lambda: one.check_xfer_state(h) != "PROC", lambda: None)
            assert one.check_xfer_state(h) == "DONE", h.error
            one.release_xfer_handle(h)
        got = np.frombuffer(bytes(m2), dtype=np.uint8).reshape(16, 4096)
        assert (got[::-1] == m1.reshape(16, 4096)).all()
        _ParkedPoll.release.set()


def test_notifications_are_read_by_the_polling_call_with_no_other_thread(peered, parked_readers):
    """get_new_notifs and check_remote_xfer_done read the agent's subscribed local session
    themselves: no notification thread exists, and a loop that never sleeps sees each
    notification (the WRITE's bytes already in place), with the sessions' reader threads held off."""
    a, b = peered
    n = 1 << 16
    m1, m2 = host_array(n), host_array(n)
    m1[:] = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8)
    with nixl_agent("pn-1", nixl_agent_config(endpoint=a.endpoint)) as one, \
            nixl_agent("pn-2", nixl_agent_config(endpoint=b.endpoint)) as two:
        assert not [t for t in threading.enumerate() if t.name.startswith("tcpxd-nixl-notifs")]
        one.register_memory([(m1.ctypes.data, n, 0, "")], "DRAM")
        two.register_memory([(m2.ctypes.data, n, 0, "")], "DRAM")
        one.add_remote_agent(two.get_agent_metadata())
        two.add_remote_agent(one.get_agent_metadata())
        local = one.prep_xfer_dlist("NIXL_INIT_AGENT", [(m1.ctypes.data, n, 0)], "DRAM")
        remote = one.prep_xfer_dlist("pn-2", [(m2.ctypes.data, n, 0)], "DRAM")
        for k in range(3):
            m1[:8] = k
            h = one.make_prepped_xfer("WRITE", local, [0], remote, [0], b"req-%d" % k)
            one.transfer(h)
            got: dict = {}
            _spin_until(lambda: got.get("pn-1"), lambda: [got.setdefault(s, []).extend(v)
                                                         for s, v in two.get_new_notifs().items()])
            assert got == {"pn-1": [b"req-%d" % k]}
            assert bytes(m2) == bytes(m1)  # the notification came after the bytes
            _spin_until(lambda: one.check_xfer_state(h) != "PROC", lambda: None)
            assert one.check_xfer_state(h) == "DONE", h.error
            one.release_xfer_handle(h)
        # send_notif, both ways; check_remote_xfer_done finds one by prefix and removes it
        one.send_notif("pn-2", b"tag-1:rest")
        _spin_until(lambda: two.check_remote_xfer_done("pn-1", b"tag-1"), lambda: None)
        assert not two.check_remote_xfer_done("pn-1", b"tag-1")
        two.send_notif("pn-1", b"back")
        seen: dict = {}
        _spin_until(lambda: seen, lambda: seen.update(one.get_new_notifs()))
        assert seen == {"pn-2": [b"back"]}
        # The subscribed session ends (as when the daemon restarts): a later poll subscribes again.
        import socket as _socket

        two._inbox._feed.conn.sock.shutdown(_socket.SHUT_RDWR)
        _spin_until(lambda: two._inbox._feed is not None and two._inbox._quiet is False and two._inbox._retry_at > 0,
                    two.get_new_notifs)
        one.send_notif("pn-2", b"again")
        _spin_until(lambda: two.check_remote_xfer_done("pn-1", b"again"), lambda: None)
        _ParkedPoll.release.set()


def test_the_reader_thread_leaves_the_connection_to_a_caller_polling(peered, monkeypatch):
    """Session 21: while a caller polls, the session's reader thread does not read (it would take
    the GIL from the polling thread just as that thread's answer came); once nobody polls it reads
    again, so a future no one looks at still resolves."""
    monkeypatch.setattr(_session, "READER_QUIET_S", 0.25)
    a, b = peered
    drained_by = []
    real = _session.Session._drain

    def drain(self, readable=False):  # (called under the read lock: no other thread drains at once)
        drained_by.append(threading.current_thread().name)
        real(self, readable)

    monkeypatch.setattr(_session.Session, "_drain", drain)
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        src = ca.register_host(1 << 16)
        src.numpy()[:] = np.random.default_rng(9).integers(0, 256, 1 << 16, dtype=np.uint8)
        dst = cb.register_host(1 << 16)
        s = ca.session()
        s.poll()  # the caller polls from here on
        for i in range(16):
            f = s.write(src, dst.descriptor, 4096, local_offset=4096 * i, remote_offset=4096 * i)
            _spin_until(f.done, s.poll)
            assert f.result().bytes_done == 4096
        assert set(drained_by) == {threading.current_thread().name}, drained_by
        assert bytes(dst.numpy()) == bytes(src.numpy())
        # Nobody polls: the reader thread resolves the next one (a callback, on its thread).
        seen = threading.Event()
        names = []
        f = s.write(src, dst.descriptor, 1 << 16)
        f.add_done_callback(lambda _f: (names.append(threading.current_thread().name), seen.set()))
        assert seen.wait(30), "no one resolved the unpolled transfer"
        assert names == ["tcpxd-session"] and f.result().bytes_done == 1 << 16
        s.close()


@pytest.mark.skipif(getattr(_session._native, "quiet_wait", None) is None, reason="the C pass is not built")
def test_the_reader_thread_sleeps_through_a_callers_polling_without_waking(peered, monkeypatch):
    """Session 27: while a caller keeps polling, the session's reader thread stays in the C pass's
    quiet_wait (no GIL), instead of waking every READER_QUIET_S to look (each wake took the GIL
    from the polling thread: a forced switch, the tight loop's p99); once the caller stops, it
    wakes and resolves what nobody polls for."""
    monkeypatch.setattr(_session, "READER_QUIET_S", 0.05)
    real = _session._native
    waits = []

    class Native:  # the C pass, its quiet_wait counted (the reader takes it when it starts)
        def __getattr__(self, name):
            return getattr(real, name)

        def quiet_wait(self, polled, quiet):
            waits.append(quiet)
            return real.quiet_wait(polled, quiet)

    monkeypatch.setattr(_session, "_native", Native())
    a, b = peered
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        src = ca.register_host(1 << 16)
        src.numpy()[:] = np.random.default_rng(5).integers(0, 256, 1 << 16, dtype=np.uint8)
        dst = cb.register_host(1 << 16)
        s = ca.session()
        # A caller polls (its time kept fresh, the socket left alone): the transfer's event wakes
        # the reader, which finds the caller polling and goes quiet. The time is fresh before the
        # write too: an event that woke the reader before the loop's first pass would find a stale
        # time, be resolved by the reader itself, and leave it waiting in `poll` with nothing more
        # to come (CI, session 31: "the reader never went quiet" on a loaded runner).
        s._polled[0] = time.monotonic()
        first = s.write(src, dst.descriptor, 4096)
        deadline = time.monotonic() + 30
        while not waits:
            s._polled[0] = time.monotonic()
            assert time.monotonic() < deadline, "the reader never went quiet"
        start = len(waits)
        end = time.monotonic() + 20 * 0.05  # twenty quiet periods of polling
        while time.monotonic() < end:
            s.poll()
        assert first.done() and first.result().bytes_done == 4096  # (the caller read it)
        assert len(waits) - start <= 1, f"the reader woke {len(waits) - start} times while the caller polled"
        # Nobody polls now: the reader wakes and resolves an unpolled transfer itself.
        seen = threading.Event()
        f = s.write(src, dst.descriptor, 1 << 16)
        f.add_done_callback(lambda _f: seen.set())
        assert seen.wait(30), "no one resolved the unpolled transfer"
        assert f.result().bytes_done == 1 << 16
        assert bytes(dst.numpy()) == bytes(src.numpy())
        s.close()


def test_quiet_wait_returns_once_the_time_it_reads_is_quiet_long_enough():
    """The C pass's quiet_wait (tcpxd._session's reader): returns at once when polled[0] + quiet
    has passed; while another thread keeps moving polled[0] on it does not return."""
    from array import array

    qw = getattr(_session._native, "quiet_wait", None)
    if qw is None:
        pytest.skip("the C pass is not built")
    polled = array("d", [0.0])
    qw(polled, 0.001)  # long past: at once
    moving = threading.Event()
    done = threading.Event()

    def mover():
        moving.set()
        for _ in range(100):
            polled[0] = time.monotonic()
            time.sleep(0.001)
        done.set()  # (before the last write ages past `quiet`)

    polled[0] = time.monotonic()
    t = threading.Thread(target=mover)
    t.start()
    moving.wait()
    qw(polled, 0.5)
    assert done.is_set(), "quiet_wait returned while the time it reads kept moving"
    t.join()
    with pytest.raises(ValueError):
        qw(bytearray(4), 0.1)


@pytest.mark.parametrize("spin_s", [0.0, 250e-6, float("inf")])
def test_a_tight_check_xfer_state_loop_waits_for_the_daemon_or_spins(peered, parked_readers, monkeypatch, spin_s):
    """check_xfer_state in a loop without a pause (NIXL's examples): it spins for TIGHT_SPIN_S
    (none below 8 CPUs; without bound above), then waits for the session's socket, the GIL
    released, before each poll. Whichever, DONE is seen by the polling thread itself (the reader is
    held off) and the bytes are there."""
    from tcpxd.nixl import _agent

    monkeypatch.setattr(_agent, "TIGHT_SPIN_S", spin_s)
    waits = []
    real = _session.Session.wait_readable
    monkeypatch.setattr(_session.Session, "wait_readable", lambda self, ms: (waits.append(ms), real(self, ms)))
    a, b = peered
    n = 1 << 16
    m1, m2 = host_array(n), host_array(n)
    m2[:] = np.random.default_rng(11).integers(0, 256, n, dtype=np.uint8)
    with nixl_agent("tw-1", nixl_agent_config(endpoint=a.endpoint)) as one, \
            nixl_agent("tw-2", nixl_agent_config(endpoint=b.endpoint)) as two:
        one.register_memory([(m1.ctypes.data, n, 0, "")], "DRAM")
        two.register_memory([(m2.ctypes.data, n, 0, "")], "DRAM")
        one.add_remote_agent(two.get_agent_metadata())
        local = one.prep_xfer_dlist("NIXL_INIT_AGENT", [(m1.ctypes.data + i * 4096, 4096, 0) for i in range(16)], "DRAM")
        remote = one.prep_xfer_dlist("tw-2", [(m2.ctypes.data + i * 4096, 4096, 0) for i in range(16)], "DRAM")
        for i in range(16):
            h = one.make_prepped_xfer("READ", local, [i], remote, [i])
            one.transfer(h)
            deadline = time.monotonic() + 30
            while (st := one.check_xfer_state(h)) == "PROC":
                assert time.monotonic() < deadline, "never finished"
            assert st == "DONE", h.error
            one.release_xfer_handle(h)
        assert bytes(m1) == bytes(m2)
        if spin_s == 0.0:
            assert waits, "a loop that may not spin never waited"
        elif spin_s == float("inf"):
            assert not waits, "a loop without a spin bound waited"
        assert all(ms == _agent.TIGHT_WAIT_MS for ms in waits)
        _ParkedPoll.release.set()


@pytest.mark.parametrize("spin_s", [0.0, float("inf")])
def test_a_tight_get_new_notifs_loop_waits_for_the_daemon_or_spins(peered, monkeypatch, spin_s):
    """get_new_notifs in a loop without a pause (a target answering pings, as nixl_compare's):
    it spins for TIGHT_SPIN_S (none below 8 CPUs; without bound above), then waits on the feed's
    socket before each poll. Either way every ping is seen and answered, in order, and the
    answers to the target's own send_notif WRITEs are read by its polls (none left unanswered)."""
    from tcpxd.nixl import _notify

    monkeypatch.setattr(_notify, "TIGHT_SPIN_S", spin_s)
    waits = []
    real = _notify._Feed.wait
    monkeypatch.setattr(_notify._Feed, "wait", lambda self, ms: (waits.append(ms), real(self, ms)))
    a, b = peered
    with nixl_agent("tn-1", nixl_agent_config(endpoint=a.endpoint)) as one, \
            nixl_agent("tn-2", nixl_agent_config(endpoint=b.endpoint)) as two:
        one.add_remote_agent(two.get_agent_metadata())
        two.add_remote_agent(one.get_agent_metadata())
        for i in range(20):
            one.send_notif("tn-2", b"ping-%d" % i)
            deadline = time.monotonic() + 30
            while not (got := two.get_new_notifs()):
                assert time.monotonic() < deadline, "never arrived"
            assert got == {"tn-1": [b"ping-%d" % i]}
            two.send_notif("tn-1", b"pong-%d" % i)
            while not (got := one.get_new_notifs()):
                assert time.monotonic() < deadline, "never arrived"
            assert got == {"tn-2": [b"pong-%d" % i]}
        assert two._remotes["tn-1"].notif_sent.exception(10) is None
        if spin_s == 0.0:
            assert waits, "a loop that may not spin never waited"
        else:
            assert not waits, "a loop without a spin bound waited"
        assert all(ms == _notify.TIGHT_WAIT_MS for ms in waits)


def test_send_notif_does_not_wait_for_a_thread_waiting_in_get_new_notifs(peered, monkeypatch):
    """One thread polls get_new_notifs tight (its wait on the feed's socket held here until
    released); another's send_notif goes meanwhile: the wait holds no lock send_notif needs."""
    from tcpxd.nixl import _notify

    monkeypatch.setattr(_notify, "TIGHT_SPIN_S", 0.0)
    entered, release = threading.Event(), threading.Event()
    real = _notify._Feed.wait

    def held(self, ms):
        entered.set()
        release.wait(60)
        return real(self, ms)

    monkeypatch.setattr(_notify._Feed, "wait", held)
    a, b = peered
    with nixl_agent("tl-1", nixl_agent_config(endpoint=a.endpoint)) as one, \
            nixl_agent("tl-2", nixl_agent_config(endpoint=b.endpoint)) as two:
        one.add_remote_agent(two.get_agent_metadata())
        def poll() -> None:
            # Polls back to back until a take counts as a tight loop's and waits (two empty takes
            # within _notify.TIGHT_S: on a loaded machine three calls in a row may never be),
            # held in that wait until released; then stops.
            deadline = time.monotonic() + 30
            while not entered.is_set() and time.monotonic() < deadline:
                one.get_new_notifs()

        poller = threading.Thread(target=poll)
        poller.start()
        assert entered.wait(30), "the polling loop never waited"
        sender = threading.Thread(target=one.send_notif, args=("tl-2", b"while it waits"))
        sender.start()
        sender.join(20)  # (a send_notif needing the waiting thread's lock would hang until released)
        assert not sender.is_alive(), "send_notif waited for the polling thread's wait"
        assert poller.is_alive()  # still held in its wait
        release.set()
        poller.join(30)
        seen: dict = {}
        _spin_until(lambda: seen, lambda: seen.update(two.get_new_notifs()))
        assert seen == {"tl-1": [b"while it waits"]}


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_a_transfers_notification_does_not_overtake_a_send_notif_before_it(peered, op):
    """vLLM's pull: a prefix hit's send_notif, then the next request's transfer with its own
    notification. send_notif returns before its notification arrived, so the transfer waits for it
    first: the target sees them in the order the initiator made them (as NIXL's, one endpoint)."""
    a, b = peered
    n = 4096
    m1, m2 = host_array(n), host_array(n)
    with nixl_agent("ov-1", nixl_agent_config(endpoint=a.endpoint)) as one, \
            nixl_agent("ov-2", nixl_agent_config(endpoint=b.endpoint)) as two:
        one.register_memory([(m1.ctypes.data, n, 0, "")], "DRAM")
        two.register_memory([(m2.ctypes.data, n, 0, "")], "DRAM")
        one.add_remote_agent(two.get_agent_metadata())
        local = one.prep_xfer_dlist("NIXL_INIT_AGENT", [(m1.ctypes.data, n, 0)], "DRAM")
        remote = one.prep_xfer_dlist("ov-2", [(m2.ctypes.data, n, 0)], "DRAM")
        want = []
        for k in range(15):
            one.send_notif("ov-2", b"hit-%d" % k)
            h = one.make_prepped_xfer(op, local, [0], remote, [0], b"req-%d" % k)
            one.transfer(h)
            _spin_until(lambda: one.check_xfer_state(h) != "PROC", lambda: None)
            assert one.check_xfer_state(h) == "DONE", h.error
            one.release_xfer_handle(h)
            want += [b"hit-%d" % k, b"req-%d" % k]
        got: list = []
        _spin_until(lambda: len(got) >= len(want), lambda: got.extend(two.get_new_notifs().get("ov-1", [])))
        assert got == want
