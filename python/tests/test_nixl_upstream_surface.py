"""What NIXL's Python package exports besides the agent, as its examples and tests use it (issue #39
point 1): `nixl._bindings` (names, descriptor lists, nixlAgent as a patchable attribute and its C++
calls), `nixl._utils`, `nixl.logging`, and the exceptions NIXL raises where it raises them. The runs
of NIXL's own examples and tests are tools/nixl-upstream/run.py (docs/NIXL.md)."""

from __future__ import annotations

import ctypes
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import ROOT
from tcpxd.nixl import _bindings as B
from tcpxd.nixl import _utils as U
from tcpxd.nixl import nixl_agent, nixl_agent_config, nixlInvalidParamError, nixlNoTelemetryError, nixlNotFoundError


def test_descriptor_lists_are_made_and_edited_as_nixls_bindings():
    descs = [(1000, 105, 0), (2000, 30, 0), (1010, 20, 0)]
    xl = B.nixlXferDList(B.DRAM_SEG, descs)
    assert xl.descCount() == 3 and xl.getType() == B.DRAM_SEG == "DRAM" and xl[0] == descs[0]
    assert pickle.loads(pickle.dumps(xl)) == xl
    assert B.nixlXferDList(B.DRAM_SEG, np.array(descs, dtype=np.uint64)) == xl
    assert xl.index((2000, 30, 0)) == 1
    xl.remDesc(1)
    assert [tuple(d) for d in xl] == [descs[0], descs[2]]
    xl[1] = (4096, 8, 1)
    xl.addDesc((8192, 16, 0))
    assert xl.descCount() == 3 and xl[1] == (4096, 8, 1) and xl[2] == (8192, 16, 0)
    with pytest.raises(nixlNotFoundError):
        xl.index((1, 1, 1))
    xl.clear()
    assert xl.isEmpty()
    assert B.nixlXferDList(B.VRAM_SEG, 2).descCount() == 2  # (type, init_size)
    with pytest.raises(TypeError):
        B.nixlXferDList(B.DRAM_SEG, [[1, 2, 3]])  # each descriptor a tuple
    with pytest.raises(ValueError):
        B.nixlXferDList(B.DRAM_SEG, [(1, 2)])
    with pytest.raises(ValueError):
        B.nixlXferDList(B.DRAM_SEG, np.zeros((2, 3), dtype=np.uint32))  # (u)int64 only
    rl = B.nixlRegDList(B.DRAM_SEG, [(4096, 64, 0, "dead")])
    rl.addDesc((8192, 64, 0, b"beef"))
    assert rl[0] == (4096, 64, 0, b"dead") and rl[1][3] == b"beef"  # meta comes back as bytes, as NIXL's
    assert pickle.loads(pickle.dumps(rl)) == rl
    assert rl.trim() == B.nixlXferDList(B.DRAM_SEG, [(4096, 64, 0), (8192, 64, 0)])
    remote = B.nixlRemoteDList(B.VRAM_SEG, [(1, 2, 0, "peer")])
    assert remote[0] == (1, 2, 0, "peer") and remote.getType() == B.VRAM_SEG


def test_malloc_passthru_memory_is_real_and_registers():
    addr = U.malloc_passthru(10_000)
    other = U.malloc_passthru(10_000)
    try:
        assert addr % U.IO_SIZE == 0
        U.ba_buf(addr, 10_000)
        assert ctypes.string_at(addr, 10_000) == b"\xba" * 10_000
        assert ctypes.string_at(other, 16) == bytes(16)  # zeroed
        with pytest.raises(AssertionError, match="offset 0"):
            U.verify_transfer(addr, other, 10_000)
        ctypes.memmove(other, addr, 10_000)
        U.verify_transfer(addr, other, 10_000)
    finally:
        U.free_passthru(addr)
        U.free_passthru(other)
    with pytest.raises(ValueError):
        U.free_passthru(addr)


def test_malloc_passthru_memory_moves_between_agents(daemons):
    """NIXL's tests register malloc_passthru memory as DRAM: here it is shared with the daemon."""
    a, b = daemons
    n = 1 << 16
    src, dst = U.malloc_passthru(n), U.malloc_passthru(n)
    ctypes.memmove(src, bytes(range(256)) * (n // 256), n)
    with nixl_agent("up-src", nixl_agent_config(endpoint=a.endpoint)) as one, \
            nixl_agent("up-dst", nixl_agent_config(endpoint=b.endpoint)) as two:
        one.register_memory(one.get_reg_descs([(src, n, 0, "")], "DRAM"))
        two.register_memory(two.get_reg_descs([(dst, n, 0, "")], "DRAM"))
        assert one.add_remote_agent(two.get_agent_metadata()) == b"up-dst"
        h = one.initialize_xfer("WRITE", one.get_xfer_descs([(src, n, 0)], "DRAM"),
                                one.get_xfer_descs([(dst, n, 0)], "DRAM"), "up-dst", b"done")
        one.transfer(h)
        while (st := one.check_xfer_state(h)) == "PROC":
            pass
        assert st == "DONE", h.error
        U.verify_transfer(src, dst, n)
        one.release_xfer_handle(h)
    U.free_passthru(src)
    U.free_passthru(dst)


def test_agents_raise_what_nixl_raises_where_it_raises(daemons):
    a, _ = daemons
    with pytest.raises(ValueError):
        nixl_agent("", nixl_agent_config(endpoint=a.endpoint))  # NIXL: std::invalid_argument
    with nixl_agent("raises", nixl_agent_config(endpoint=a.endpoint)) as ag:
        with pytest.raises(nixlNotFoundError):
            ag.create_backend("UVX")  # a plugin it does not have
        with pytest.raises(KeyError):
            ag.make_prepped_xfer("RD", 0, [], 0, [])  # the operation, looked up first
        xl = ag.get_xfer_descs([(4096, 8, 0)], "DRAM")
        with pytest.raises(KeyError):
            ag.initialize_xfer("WR", xl, xl, "nobody")
        with pytest.raises(KeyError):
            ag.get_xfer_descs([(1, 2, 3)], mem_type="V-RAM")
        assert ag.get_xfer_descs([(1, 2, 3, 4)], "DRAM") is None  # (logged, as NIXL)
        assert isinstance(ag.agent, B.nixlAgent) and ag.agent.name == "raises"
        with pytest.raises(nixlInvalidParamError):  # the tcpxd-side class of each, too
            ag.make_prepped_xfer("RD", 0, [], 0, [])


@pytest.mark.parametrize("env,capture,keeps", [(None, True, True), ("y", False, True), ("no", True, False), (None, False, False)])
def test_telemetry_follows_nixl_telemetry_enable_then_the_config(daemons, monkeypatch, env, capture, keeps):
    a, _ = daemons
    if env is None:
        monkeypatch.delenv("NIXL_TELEMETRY_ENABLE", raising=False)
    else:
        monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", env)
    with nixl_agent(f"telem-{env}-{capture}", nixl_agent_config(endpoint=a.endpoint, capture_telemetry=capture)) as ag:
        assert ag._telemetry is keeps
        if not keeps:
            with pytest.raises(nixlNoTelemetryError):
                ag.get_xfer_telemetry(None)  # type: ignore[arg-type]


def test_nixl_agent_binding_calls_move_bytes_and_notify(daemons, monkeypatch):
    """NIXL's binding test drives the C++ agent's calls directly: two nixlAgent objects, each on
    its own daemon here ($TCPXD_ENDPOINT when it first needs one)."""
    a, b = daemons
    cfg = B.nixlAgentConfig()
    cfg.useProgThread = False
    one, two = B.nixlAgent("bind-1", cfg), B.nixlAgent("bind-2", cfg)
    with pytest.raises(ValueError):
        B.nixlAgent("", cfg)
    monkeypatch.setenv("TCPXD_ENDPOINT", a.endpoint)
    h1 = one.createBackend("UCX", {})
    monkeypatch.setenv("TCPXD_ENDPOINT", b.endpoint)
    two.createBackend("UCX", {})
    with pytest.raises(nixlNotFoundError):
        one.getPluginParams("POSIX")
    assert one.getBackendParams(h1)[1] == ["DRAM", "VRAM"]
    size = 256
    src, dst = U.malloc_passthru(size), U.malloc_passthru(size)
    U.ba_buf(src, size)
    r1, r2 = B.nixlRegDList(B.DRAM_SEG), B.nixlRegDList(B.DRAM_SEG)
    r1.addDesc((src, size, 0, "dead"))
    r2.addDesc((dst, size, 0, "dead"))
    assert one.registerMem(r1, [h1]) == B.NIXL_SUCCESS and two.registerMem(r2) == B.NIXL_SUCCESS
    assert one.loadRemoteMD(two.getLocalMD()) == b"bind-2"
    s, d = B.nixlXferDList(B.DRAM_SEG), B.nixlXferDList(B.DRAM_SEG)
    s.addDesc((src + 8, 8, 0))
    d.addDesc((dst + 8, 8, 0))
    h = one.createXferReq(B.NIXL_WRITE, s, d, "bind-2", "n\0tification")
    status = one.postXferReq(h)
    notifs: dict = {}
    while status != B.NIXL_SUCCESS or not notifs:
        if status != B.NIXL_SUCCESS:
            status = one.getXferStatus(h)
        if not notifs:
            notifs = two.getNotifs(notifs)
        assert status in (B.NIXL_SUCCESS, B.NIXL_IN_PROG)
    U.verify_transfer(src + 8, dst + 8, 8)
    assert ctypes.string_at(dst, 8) == bytes(8)  # only the descriptor's bytes moved
    assert notifs == {"bind-1": [b"n\0tification"]}
    assert one.releaseXferReq(h) == B.NIXL_SUCCESS
    assert one.deregisterMem(r1, [h1]) == B.NIXL_SUCCESS and two.deregisterMem(r2) == B.NIXL_SUCCESS
    one.invalidateRemoteMD("bind-2")
    for ag in (one, two):
        ag._agent().close()
    U.free_passthru(src)
    U.free_passthru(dst)


def _shim_run(tmp_path, code: str, endpoint: str = "", extra_env: dict = {}) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "tcpxd.nixl", "install-shim", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT / "python/src"), os.environ.get("PYTHONPATH", "")]),
               TCPXD_ENDPOINT=endpoint, **extra_env)
    env.pop("NIXL_LOG_LEVEL", None) if "NIXL_LOG_LEVEL" not in extra_env else None
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=60)


def test_the_shims_bindings_are_tcpxds_module_so_patches_reach_the_agent(tmp_path, daemons):
    a, _ = daemons
    run = _shim_run(tmp_path, """
        import nixl._bindings as bindings, nixl._utils as utils, tcpxd.nixl._bindings as mine
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        assert bindings is mine and utils.malloc_passthru and bindings.DRAM_SEG == "DRAM"
        captured = {}
        real = bindings.nixlAgent
        def spy(name, cfg):
            captured["syncMode"] = cfg.syncMode
            return real(name, cfg)
        bindings.nixlAgent = spy
        nixl_agent("spied", nixl_agent_config(sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_RW, enable_listen_thread=True,
                                              listen_port=0)).close()
        assert captured["syncMode"] == nixl_thread_sync_t.NIXL_THREAD_SYNC_RW.value, captured
        nixl_agent("spied2", nixl_agent_config(enable_listen_thread=True, listen_port=0)).close()
        assert captured["syncMode"] == nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT.value, captured
        print("ok")
    """, a.endpoint)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr


def test_the_shims_logging_prints_as_nixls(tmp_path):
    code = """
        from nixl.logging import get_logger
        log = get_logger("_example")
        log.info("hello %d", 7)
        log.debug("quiet")
        print(log.name)
    """
    run = _shim_run(tmp_path, code)
    lines = run.stdout.splitlines()
    assert run.returncode == 0 and lines[-1] == "nixl.example", run.stderr
    assert " NIXL INFO    <string>:" in lines[0] and lines[0].endswith(" hello 7"), lines  # to stdout, NIXL's format
    assert not any("quiet" in ln for ln in lines)
    run = _shim_run(tmp_path, code, extra_env={"NIXL_LOG_LEVEL": "ERROR"})
    assert run.stdout.splitlines() == ["nixl.example"], run.stdout


@pytest.mark.parametrize("native", [True, False], ids=["c-pass", "python"])
def test_tuple_lists_read_the_same_with_and_without_the_c_pass(monkeypatch, native):
    from tcpxd.nixl import _descs

    if native and _descs._native is None:
        pytest.skip("tcpxd._native is not built here")
    if not native:
        monkeypatch.setattr(_descs, "_native", None)
    rows = [(2**64 - 1 - i, i, i % 3) for i in range(1000)]
    xl = _descs.parse(rows, "DRAM", False, "descs")
    assert xl.rows.dtype == np.uint64 and xl.rows.tolist() == [list(r) for r in rows]
    xl[0] = (1, 2, 3)  # writable
    rl = _descs.parse([r + (f"m{i}",) for i, r in enumerate(rows)], "DRAM", True, "descs")
    assert rl[999] == rows[999] + (b"m999",)
    for bad in ([(1, 2, 3), [4, 5, 6]], [(1, 2, 3), (4, 5)], [(1, -2, 3)], [(1, 2.0, 3)]):
        with pytest.raises(nixlInvalidParamError):
            _descs.parse(bad, "DRAM", False, "descs")
    assert _descs.parse([(1, np.uint64(2), True)], "DRAM", False, "descs")[0] == (1, 2, 1)  # (not exact ints: Python's path)


def test_telemetry_never_says_done_before_the_post_returned():
    """NIXL's tests require xferDuration >= postDuration: a transfer answered while transfer()
    was still posting (its reader thread, or a poll) is seen done when the post returned."""
    from types import SimpleNamespace

    from tcpxd.nixl._xfer import Xfer

    x = Xfer(SimpleNamespace(total_bytes=128, desc_count=2), "peer", b"", True)
    x._t0, x._post_us, x._xfer_us = 1.0, 1339, 1261
    t = x.telemetry
    assert (t.postDuration, t.xferDuration, t.totalBytes, t.descCount) == (1339, 1339, 128, 2)
    x._xfer_us = 2000
    assert x.telemetry.xferDuration == 2000


def test_a_loopback_list_is_the_agents_own_memory(daemons):
    """prep_xfer_dlist with the agent's own name (NIXL's loopback, prep_xfer_perf.py's "agent"):
    resolved against its own regions; its transfers are between two buffers of its daemon (carried
    where the daemon copies within one node)."""
    a, _ = daemons
    n = 64 * 1024
    addr = U.malloc_passthru(n)
    with nixl_agent("loop", nixl_agent_config(endpoint=a.endpoint)) as ag:
        ag.register_memory(ag.get_reg_descs([(addr + i * 1024, 1024, 0, b"") for i in range(64)], "DRAM"))
        xl = ag.get_xfer_descs([(addr + i * 1024, 1024, 0) for i in range(64)], "DRAM")
        local, remote = ag.prep_xfer_dlist("", xl, "DRAM"), ag.prep_xfer_dlist("loop", xl, "DRAM")
        assert remote._prepped is not None and remote._prepped.agent == "loop" and remote._prepped.count == 64
        h = ag.make_prepped_xfer("WRITE", local, list(range(32)), remote, list(range(32, 64)), b"UUID2")
        assert h._xfer.remote == "loop"
        with pytest.raises(nixlNotFoundError, match=r"\(loopback\)"):
            ag.prep_xfer_dlist("loop", [(addr + n, 64, 0)], "DRAM")  # outside its regions
        ag.release_xfer_handle(h)
    U.free_passthru(addr)
