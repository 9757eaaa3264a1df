"""nixl_agent.close() and the notifications still on their way (docs/NIXL.md, "Semantics"): it
waits for them up to nixl_agent_config(close_notifs_s=...), else TCPXD_NIXL_CLOSE_NOTIFS_S, else
5 s, then closes (which cancels them) and names in a warning the agents they were going to."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

import pytest

from tcpxd.nixl import nixl_agent, nixl_agent_config, nixlInvalidParamError
from tcpxd.nixl import _notify


def _pair(daemons, name: str, **conf):
    a, b = daemons
    A = nixl_agent(f"{name}-A", nixl_agent_config(endpoint=a.endpoint))
    B = nixl_agent(f"{name}-B", nixl_agent_config(endpoint=b.endpoint, **conf))
    B.add_remote_agent(A.get_agent_metadata())
    return A, B


def test_close_waits_its_bound_then_names_the_notifications_it_cancels(daemons, caplog):
    A, B = _pair(daemons, "cl1", close_notifs_s=0.3)
    try:
        B.send_notif("cl1-A", b"delivered")
        B._remotes["cl1-A"].notif_sent.exception(10)
        # A notification the daemon never answers (as one to a peer that stopped answering).
        B._remotes["cl1-A"].notif_sent = concurrent.futures.Future()
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="tcpxd.nixl"):
            B.close()
        took = time.monotonic() - t0
        assert 0.3 <= took < 30, took
        warned = [r.getMessage() for r in caplog.records if "still on their way" in r.getMessage()]
        assert len(warned) == 1 and "cl1-A" in warned[0] and "after 0.3 s" in warned[0], warned
    finally:
        A.close()
        B.close()


def test_close_waits_for_a_notification_answered_within_its_bound_and_warns_nothing(daemons, caplog):
    A, B = _pair(daemons, "cl2", close_notifs_s=30)
    try:
        sent: concurrent.futures.Future = concurrent.futures.Future()
        B._remotes["cl2-A"].notif_sent = sent
        threading.Timer(0.2, sent.set_result, [None]).start()
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="tcpxd.nixl"):
            B.close()
        assert sent.done() and time.monotonic() - t0 >= 0.2  # it waited for the answer
        assert not [r for r in caplog.records if "still on their way" in r.getMessage()]
    finally:
        A.close()
        B.close()


def test_the_bound_comes_from_the_config_else_the_environment_else_five_seconds(daemons, monkeypatch, caplog):
    a, _ = daemons

    def bound(**conf) -> float:
        with nixl_agent("cl3", nixl_agent_config(endpoint=a.endpoint, **conf)) as ag:
            return ag._close_notifs_s

    monkeypatch.delenv("TCPXD_NIXL_CLOSE_NOTIFS_S", raising=False)
    assert bound() == _notify.CLOSE_NOTIFS_S == 5.0
    monkeypatch.setenv("TCPXD_NIXL_CLOSE_NOTIFS_S", "0.5")
    assert bound() == 0.5
    assert bound(close_notifs_s=0) == 0  # the config first
    monkeypatch.setenv("TCPXD_NIXL_CLOSE_NOTIFS_S", "inf")
    assert bound() == float("inf")
    monkeypatch.setenv("TCPXD_NIXL_CLOSE_NOTIFS_S", "soon")
    with caplog.at_level(logging.WARNING, logger="tcpxd.nixl"):
        assert bound() == 5.0
    assert "TCPXD_NIXL_CLOSE_NOTIFS_S='soon' is not a number of seconds" in caplog.text
    for bad in (-1, float("nan")):
        with pytest.raises(nixlInvalidParamError, match="close_notifs_s: .* is not a number of seconds"):
            nixl_agent_config(endpoint=a.endpoint, close_notifs_s=bad)
