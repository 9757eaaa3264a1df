"""tcpxd.nixl's surface against two real daemons: metadata, notifications, bad input (what NIXL
raises), the plan a transfer becomes, the `nixl` shim."""

from __future__ import annotations

import dataclasses

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import tcpxd
from tcpxd.nixl import (
    nixl_agent,
    nixl_agent_config,
    nixlBackendError,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNoTelemetryError,
    nixlNotFoundError,
    nixlNotSupportedError,
)
from tcpxd.nixl import _indices, _plan
from tcpxd.nixl._notify import frame, parse
from tcpxd.nixl._regions import Region, RegionTable

from conftest import start_daemon, stop_daemon


def wait_notifs(agent: nixl_agent, want: int, timeout: float = 10.0) -> dict:
    got: dict = {}
    deadline = time.monotonic() + timeout
    while sum(len(v) for v in got.values()) < want and time.monotonic() < deadline:
        for k, v in agent.get_new_notifs().items():
            got.setdefault(k, []).extend(v)
        time.sleep(0.01)
    return got


@pytest.fixture()
def pair(daemons):
    a, b = daemons
    A = nixl_agent("api-A", nixl_agent_config(endpoint=a.endpoint))
    B = nixl_agent("api-B", nixl_agent_config(endpoint=b.endpoint, capture_telemetry=True))
    assert B.add_remote_agent(A.get_agent_metadata()) == b"api-A"
    assert A.add_remote_agent(B.get_agent_metadata()) == b"api-B"
    yield A, B
    A.close()
    B.close()


def test_send_notif_reaches_the_agent_keyed_by_the_sender(pair):
    A, B = pair
    B.send_notif("api-A", b"req-1:1")
    B.send_notif(b"api-A", "req-2:1")  # names and messages as bytes or str, as NIXL takes them
    B.send_notif("api-A", bytearray(b"req-3:1"))
    B.send_notif(b"api-A", memoryview(b"req-4:1"))
    # The checks the common call skips (a loaded agent's str name, a bytes message) still apply.
    with pytest.raises(nixlNotFoundError, match="no remote agent 'api-C'"):
        B.send_notif("api-C", b"x")
    with pytest.raises(nixlInvalidParamError, match="notif_msg"):
        B.send_notif("api-A", 5)
    with pytest.raises(nixlInvalidParamError, match="remote_agent_name"):
        B.send_notif(7, b"x")
    assert wait_notifs(A, 4) == {"api-B": [b"req-1:1", b"req-2:1", b"req-3:1", b"req-4:1"]}
    assert A.get_new_notifs() == {}
    B.send_notif("api-A", b"tag-77 done")
    deadline = time.monotonic() + 10
    while not A.check_remote_xfer_done("api-B", b"tag-77") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert time.monotonic() < deadline
    assert not A.check_remote_xfer_done("api-B", b"tag-77")  # the one found was removed


def test_send_notif_is_a_notification_alone_no_lane_carries_a_byte(daemons, pair):
    """send_notif's mailbox WRITE is of zero bytes (the daemons list `notification_alone`): it goes
    between the daemons as control messages only, counted as notices, no lane carrying a byte, and
    the receiving daemon checks the mailbox's key before it delivers."""
    A, B = pair
    a, b = daemons

    def peer(c, other):
        """The counters of every pairing with node `other` (a pairing closed when idle, or one
        dialled from each side, is listed beside the live one), summed, and their lanes' bytes."""
        ps = [p for p in c.stats().peers if p.node_id == other]
        counts = {k: sum(getattr(p, k) for p in ps)
                  for k in ("sent_notices", "received_notices", "sent_eager", "sent_rendezvous")}
        return counts, sorted((ln.lane, ln.bytes_sent, ln.bytes_received) for p in ps for ln in p.lanes)

    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        node_a, node_b = ca.describe_node().node_id, cb.describe_node().node_id
        B.send_notif("api-A", b"first")  # pairs the daemons
        assert wait_notifs(A, 1) == {"api-B": [b"first"]}
        B._remotes["api-A"].notif_sent.exception(10)
        (pb0, lanes_b), (pa0, lanes_a) = peer(cb, node_a), peer(ca, node_b)
        for i in range(20):
            B.send_notif("api-A", b"n-%d" % i)
        assert wait_notifs(A, 20) == {"api-B": [b"n-%d" % i for i in range(20)]}
        B._remotes["api-A"].notif_sent.exception(10)
        (pb1, lanes_b1), (pa1, lanes_a1) = peer(cb, node_a), peer(ca, node_b)
        assert (lanes_b1, lanes_a1) == (lanes_b, lanes_a), "a lane carried a notification"
        assert pb1["sent_notices"] - pb0["sent_notices"] == 20
        assert pa1["received_notices"] - pa0["received_notices"] == 20
        assert pb1["sent_eager"] + pb1["sent_rendezvous"] == pb0["sent_eager"] + pb0["sent_rendezvous"]


def test_notifications_go_only_to_the_agent_named(daemons, pair):
    A, B = pair
    a, _ = daemons
    with nixl_agent("api-A2", nixl_agent_config(endpoint=a.endpoint)) as A2:  # same node as A
        B.send_notif("api-A", b"for A")
        assert wait_notifs(A, 1) == {"api-B": [b"for A"]}
        time.sleep(0.2)
        assert A2.get_new_notifs() == {}
        A2.add_remote_agent(A.get_agent_metadata())
        A2.send_notif("api-A", b"same node")  # an agent of the same daemon: carried by it
        assert wait_notifs(A, 1) == {"api-A2": [b"same node"]}
        assert B.get_new_notifs() == {}


def test_metadata_names_the_agent_and_its_node(pair, daemons):
    A, B = pair
    md = A.get_agent_metadata()
    assert md.startswith(b"tcpxd-nixl/2\n")
    assert b'"name":"api-A"' in md and b'"node":"pa"' in md
    # Version 1 (no granule lists) is still read; a newer one is refused saying so.
    v1 = b"tcpxd-nixl/1\n" + B.get_agent_metadata().split(b"\n", 1)[1]
    assert A.add_remote_agent(v1) == b"api-B"
    with pytest.raises(nixlInvalidParamError, match="format version '9', newer than this agent reads"):
        A.add_remote_agent(b"tcpxd-nixl/9\n{}")
    assert A.check_remote_metadata("api-B") and not A.check_remote_metadata("nobody")
    A.remove_remote_agent("api-B")
    assert not A.check_remote_metadata("api-B")
    with pytest.raises(nixlNotFoundError, match="remote_agent_name: no remote agent 'api-B'"):
        A.send_notif("api-B", b"x")
    A.remove_remote_agent("api-B")  # unknown: no error, as NIXL's binding
    with pytest.raises(nixlInvalidParamError, match="metadata: not a tcpxd.nixl agent's metadata"):
        A.add_remote_agent(b"\x00\x01 a NIXL UCX blob")
    with pytest.raises(nixlInvalidParamError, match="metadata: names this agent itself"):
        A.add_remote_agent(A.get_agent_metadata())


def test_bad_input_raises_what_nixl_raises(pair):
    A, _ = pair
    # get_*_descs return None for input NIXL refuses (and log why), as NIXL's do.
    assert A.get_xfer_descs([(1, 2)], "DRAM") is None
    assert A.get_reg_descs([(1, 2, 0)], "DRAM") is None  # registration tuples have 4 fields
    assert A.get_xfer_descs([(1, 2, 0)]) is None  # no mem_type
    assert A.get_xfer_descs(np.zeros((2, 4), dtype=np.uint64), "DRAM") is None
    xd = A.get_xfer_descs(np.array([[4096, 64, 0], [8192, 64, 0]], dtype=np.uint64), "DRAM")
    assert len(xd) == 2 and xd[1] == (8192, 64, 0) and xd.getType() == "DRAM"
    with pytest.raises(nixlInvalidParamError, match="reg_list: expected a list of tuples"):
        A.register_memory("not memory", "DRAM")
    with pytest.raises(nixlInvalidParamError, match="mem_type: 'HBM' is not a NIXL memory type"):
        A.register_memory([(4096, 64, 0, "")], "HBM")
    with pytest.raises(nixlNotSupportedError, match="not FILE"):
        A.register_memory([(4096, 64, 0, "")], "FILE")
    with pytest.raises(nixlInvalidParamError, match=r"reg_list: XferDList given where a registration list \(get_reg_descs\)"):
        A.register_memory(xd)
    with pytest.raises(nixlNotFoundError, match="xfer_list: agent 'api-A' has no DRAM memory registered"):
        A.prep_xfer_dlist("NIXL_INIT_AGENT", [(4096, 64, 0)], "DRAM")
    with pytest.raises(nixlNotFoundError, match="agent_name: no remote agent 'ghost'"):
        A.prep_xfer_dlist("ghost", [(4096, 64, 0)], "DRAM")
    with pytest.raises(nixlNotFoundError, match="remote agent 'api-B' has no DRAM memory registered"):
        A.prep_xfer_dlist("api-B", [(4096, 64, 0)], "DRAM")
    with pytest.raises(nixlNotFoundError, match=r"agent 'api-A' \(loopback\) has no DRAM memory registered"):
        A.prep_xfer_dlist("api-A", [(4096, 64, 0)], "DRAM")  # its own name: a loopback list, of its own memory
    with pytest.raises(nixlNotFoundError, match="remote_agent: no remote agent 'ghost'"):
        A.initialize_xfer("WRITE", xd, xd, "ghost")
    with pytest.raises(nixlInvalidParamError, match="operation: 'PUT' is neither"):
        A.initialize_xfer("PUT", xd, xd, "api-B")
    with pytest.raises(nixlInvalidParamError, match="agent_name: 'NIXL_INIT_AGENT' cannot name an agent"):
        nixl_agent("NIXL_INIT_AGENT")
    with pytest.raises(nixlNotSupportedError, match="central metadata server"):
        A.send_local_metadata()
    with pytest.raises(TypeError, match="sync_mode"):
        nixl_agent_config(sync_mode="strict")


def test_no_daemon_is_a_backend_error_naming_the_endpoint(tmp_path):
    with pytest.raises(nixlBackendError, match=f"tcpxd daemon at unix:{tmp_path}/none.sock"):
        nixl_agent("lonely", nixl_agent_config(endpoint=f"unix:{tmp_path}/none.sock"))


def test_plugins_and_backends_are_reported(daemons):
    a, _ = daemons
    with nixl_agent("plug", nixl_agent_config(endpoint=a.endpoint, backends=["UCX", "LIBFABRIC", "GDS", "UVX"])) as ag:
        assert ag.get_plugin_list() == ["TCPXD", "UCX", "LIBFABRIC", "UCCL", "MOONCAKE"]
        assert sorted(ag.backends) == ["LIBFABRIC", "UCX"]  # GDS (storage), UVX skipped, as NIXL skips a missing plugin
        assert ag.get_backend_mem_types("UCX") == ["DRAM", "VRAM"]
        with pytest.raises(nixlNoTelemetryError):
            ag.get_xfer_telemetry(None)  # type: ignore[arg-type]


def _prepped(regions, rows, agent=""):
    table = RegionTable(regions)
    return _plan.prepare(table, "DRAM", np.array(rows, dtype=np.uint64), agent, "x", "xfer_list")


def test_plan_merges_neighbours_and_cuts_batches():
    loc = [Region(0x10000, 1 << 20, 0, "DRAM", "tcpxd1:a:1:x", 0, buffer_id=7)]
    rem = [Region(0x90000, 1 << 20, 0, "DRAM", "tcpxd1:b:3:y", 0), Region(0x500000, 1 << 20, 0, "DRAM", "tcpxd1:b:4:z", 64)]
    blocks = [(0x10000 + i * 256, 256, 0) for i in range(64)]
    lp = _prepped(loc, blocks)
    rp = _prepped(rem, [(0x90000 + i * 256, 256, 0) for i in range(32)] + [(0x500000 + i * 256, 256, 0) for i in range(32)], "b")
    idx = np.arange(64)
    p = _plan.plan("READ", lp, idx, rp, idx, True, 5000)
    assert (p.total_bytes, p.desc_count, p.entries, p.path) == (64 * 256, 64, 2, "batch")  # one run per remote buffer
    (e0,), (e1,) = [r.entries for r in p.requests]  # a request per buffer pair (the daemon coalesces each)
    req = p.requests[0]
    assert (e0.remote_descriptor, e0.remote_offset, e0.local_buffer_id, e0.local_offset, e0.length) == ("tcpxd1:b:3:y", 0, 7, 0, 32 * 256)
    assert (e1.remote_descriptor, e1.remote_offset, e1.local_offset, e1.length) == ("tcpxd1:b:4:z", 64, 32 * 256, 32 * 256)
    assert req.timeout_ms == 5000
    # Reversed order: nothing merges; more entries than a batch takes: several requests.
    rev = _plan.plan("WRITE", lp, idx, rp, idx[::-1].copy(), True, 0)
    assert rev.entries == 64
    old = _plan.MAX_ENTRIES
    _plan.MAX_ENTRIES = 10
    try:
        cut = _plan.plan("WRITE", lp, idx, rp, idx[::-1].copy(), True, 0)
    finally:
        _plan.MAX_ENTRIES = old
    assert [len(r.entries) for r in cut.requests] == [10, 10, 10, 2] * 2  # per buffer pair, then every 10
    assert {r.entries[0].remote_descriptor for r in cut.requests[:4]} == {"tcpxd1:b:3:y"}
    assert _plan.plan("READ", lp, idx, rp, idx, False, 0).entries == 64  # skip_desc_merge
    with pytest.raises(nixlMismatchError, match="local_indices: 2 indices against remote_indices' 1"):
        _plan.plan("READ", lp, np.arange(2), rp, np.arange(1), True, 0)
    with pytest.raises(nixlInvalidParamError, match=r"remote_indices\[1\]: index 64 is outside the prepared list of 64"):
        _indices.indices([0, 64], 64, "remote_indices")
    short = _prepped(loc, [(0x10000, 128, 0)])
    with pytest.raises(nixlMismatchError, match="local descriptor 0 has 128 bytes, remote descriptor 0 has 256"):
        _plan.plan("READ", short, np.arange(1), rp, np.arange(1), True, 0)
    with pytest.raises(nixlNotFoundError, match=r"xfer_list\[0\]: DRAM \(0x10000, 8 bytes, device 0\) is not inside any region x"):
        _prepped(rem, [(0x10000, 8, 0)])


def _granular(addr, size, desc, off=0, buffer_id=0, g=4096, list_id=0):
    """A region whose buffer carries a granule list of `g` (as register_memory makes them)."""
    return Region(addr, size, 0, "DRAM", desc, off, buffer_id, g, f"tcpxd1b:{desc}", (off + size) // g, list_id)


def _ranges(bi):
    assert bi.encoding == _plan.RANGES
    return np.frombuffer(bi.data, dtype="<u4").reshape(-1, 2).tolist()


def test_block_plan_groups_by_buffer_pair_in_granule_ranges():
    loc = [_granular(0x100000, 1 << 20, "la", buffer_id=7, list_id=70), _granular(0x300000, 1 << 20, "lb", buffer_id=8, list_id=80)]
    rem = [_granular(0x900000, 1 << 20, "ra"), _granular(0xB00000, 1 << 20, "rb")]
    B = 16384  # 4 granules a block
    lp = _prepped(loc, [(0x100000 + i * B, B, 0) for i in range(64)] + [(0x300000 + i * B, B, 0) for i in range(64)])
    rp = _prepped(rem, [(0x900000 + i * B, B, 0) for i in range(64)] + [(0xB00000 + i * B, B, 0) for i in range(64)], "b")
    assert lp.aligned and rp.aligned
    # vLLM's order: region by region; within a region scattered blocks, a run of two (5, 6) merged.
    li = np.array([5, 6, 1, 64 + 9, 64 + 3])
    ri = np.array([60, 61, 2, 64 + 0, 64 + 40])
    p = _plan.plan("READ", lp, li, rp, ri, True, 700)
    assert (p.path, p.field, p.total_bytes, p.desc_count) == ("blocks", "read_blocks", 5 * B, 5)
    r0, r1 = p.requests
    assert (r0.local_list_id, r0.remote_token, r0.timeout_ms) == (70, "tcpxd1b:ra", 700)
    assert _ranges(r0.local_indices) == [[20, 8], [4, 4]] and _ranges(r0.remote_indices) == [[240, 8], [8, 4]]
    assert (r1.local_list_id, r1.remote_token) == (80, "tcpxd1b:rb")
    assert _ranges(r1.local_indices) == [[36, 4], [12, 4]] and _ranges(r1.remote_indices) == [[0, 4], [160, 4]]
    # Pairs of one buffer pair that are not neighbours in the request still go in one request.
    p = _plan.plan("WRITE", lp, np.array([0, 64, 1]), rp, np.array([0, 64, 1]), True, 0)
    assert [(r.local_list_id, r.remote_token) for r in p.requests] == [(70, "tcpxd1b:ra"), (80, "tcpxd1b:rb")]
    assert _ranges(p.requests[0].local_indices) == [[0, 8]] and p.field == "write_blocks"
    # Unaligned somewhere (a 512-byte descriptor), another granule, a destination named twice:
    # the batch path.
    odd = _prepped(loc, [(0x100000, B, 0), (0x100000 + B + 512, 512, 0)])
    assert not odd.aligned
    assert _plan.plan("READ", odd, np.array([0]), rp, np.array([0]), True, 0).path == "blocks"  # this pair is aligned
    assert _plan.plan("READ", odd, np.array([0, 1]), _prepped(rem, [(0x900000, B, 0), (0x900000 + B, 512, 0)], "b"),
                      np.array([0, 1]), True, 0).path == "batch"
    big = _prepped([_granular(0x100000, 1 << 20, "la", buffer_id=7, g=8192, list_id=70)], [(0x100000, B, 0)])
    assert _plan.plan("READ", big, np.array([0]), rp, np.array([0]), True, 0).path == "batch"
    twice = _plan.plan("READ", lp, np.array([3, 3]), rp, np.array([1, 2]), True, 0)
    assert twice.path == "batch" and twice.entries == 2
    assert _plan.plan("WRITE", lp, np.array([3, 3]), rp, np.array([1, 2]), True, 0).path == "blocks"  # sources may repeat
    over = _prepped(loc, [(0x100000, 2 * B, 0), (0x100000 + B, B, 0)])  # the list's descriptors overlap
    assert _plan.plan("READ", over, np.array([1]), rp, np.array([0]), True, 0).path == "batch"
    no_list = _prepped([Region(0x100000, 1 << 20, 0, "DRAM", "la", 0, 7)], [(0x100000, B, 0)])  # version 1 metadata
    assert _plan.plan("READ", no_list, np.array([0]), rp, np.array([0]), True, 0).path == "batch"


def _fine(addr, size, desc, buffer_id=0, list_id=0, fine_id=0, fine=True):
    """A region whose buffer carries the 4 KiB granule list and, with `fine`, the 512-byte one."""
    r = _granular(addr, size, desc, buffer_id=buffer_id, list_id=list_id)
    if not fine:
        return r
    return dataclasses.replace(r, fine=512, fine_blocks=f"tcpxd1f:{desc}", fine_granules=size // 512, fine_list_id=fine_id)


def test_blocks_off_the_4k_granules_take_the_fine_lists():
    """A list of MLA-sized blocks (18,432 bytes: not a multiple of 4 KiB) is aligned on the fine
    (512-byte) granule lists and takes the block path over them, on both sides; 16 KiB blocks keep
    the 4 KiB lists; a side whose metadata has no fine lists (an older agent's), or a block off the
    fine granules too, goes the batch path; the fine lists travel in the metadata and an older
    blob's regions read without them."""
    import json

    B = 18432
    loc = [_fine(0x100000, 1 << 22, "la", buffer_id=7, list_id=70, fine_id=71)]
    rem = [_fine(0x900000, 1 << 22, "ra")]
    lp = _prepped(loc, [(0x100000 + i * B, B, 0) for i in range(64)])
    rp = _prepped(rem, [(0x900000 + i * B, B, 0) for i in range(64)], "b")
    assert lp.aligned and rp.aligned and lp.fine and rp.fine and lp.lists == [71] and rp.lists == ["tcpxd1f:ra"]
    p = _plan.plan("READ", lp, np.array([5, 6, 1]), rp, np.array([60, 61, 2]), True, 0)
    assert (p.path, p.total_bytes) == ("blocks", 3 * B)
    (r,) = p.requests
    assert (r.local_list_id, r.remote_token) == (71, "tcpxd1f:ra")
    assert _ranges(r.local_indices) == [[5 * 36, 72], [36, 36]] and _ranges(r.remote_indices) == [[60 * 36, 72], [72, 36]]
    assert lp.preparable and lp.prepare_request().local_list_ids == [71]
    q = _prepped(loc, [(0x100000 + i * 16384, 16384, 0) for i in range(8)])
    assert q.aligned and not q.fine and q.lists == [70]  # the coarse lists where they align
    old = _prepped([_fine(0x900000, 1 << 22, "ra", fine=False)], [(0x900000 + i * B, B, 0) for i in range(64)], "b")
    assert not old.aligned and _plan.plan("READ", lp, np.array([1]), old, np.array([1]), True, 0).path == "batch"
    odd = _prepped(loc, [(0x100000 + i * 1000, 1000, 0) for i in range(8)])
    assert not odd.aligned and not odd.fine
    back = Region.from_json(json.loads(json.dumps(loc[0].to_json())))
    assert (back.fine, back.fine_blocks, back.fine_granules) == (512, "tcpxd1f:la", (1 << 22) // 512)
    v2 = {k: v for k, v in loc[0].to_json().items() if not k.startswith("f")}
    assert Region.from_json(v2).fine == 0 and Region.from_json(v2).granule == 4096


def test_a_pair_aligned_on_the_4k_lists_on_one_side_only_takes_both_fine_lists():
    """16 KiB blocks 4 KiB-aligned here, 512 bytes off the 4 KiB granules there (a remote buffer
    laid out with a header): each side alone picks its own lists (4 KiB here, fine there), and the
    pair takes the block path on both sides' fine lists instead of the batch path; without fine
    lists on the aligned side, the batch path as before."""
    K = 16384
    loc = [_fine(0x100000, 1 << 22, "la", buffer_id=7, list_id=70, fine_id=71)]
    rem = [_fine(0x900000, 1 << 22, "ra")]
    lp = _prepped(loc, [(0x100000 + i * K, K, 0) for i in range(16)])
    rp = _prepped(rem, [(0x900000 + 512 + i * K, K, 0) for i in range(16)], "b")
    assert lp.aligned and not lp.fine and lp.lists == [70]
    assert rp.aligned and rp.fine and rp.lists == ["tcpxd1f:ra"]
    for op in ("READ", "WRITE"):
        p = _plan.plan(op, lp, np.array([2, 3, 9]), rp, np.array([0, 1, 15]), True, 0)
        assert (p.path, p.total_bytes) == ("blocks", 3 * K)
        (r,) = p.requests
        assert (r.local_list_id, r.remote_token) == (71, "tcpxd1f:ra")
        assert _ranges(r.local_indices) == [[64, 64], [288, 32]]
        assert _ranges(r.remote_indices) == [[1, 64], [1 + 15 * 32, 32]]
    assert lp.fine_twin is lp.fine_twin and lp.fine_twin.lists == [71] and rp.fine_twin is rp
    coarse_only = _prepped([_fine(0x100000, 1 << 22, "la", buffer_id=7, list_id=70, fine=False)],
                           [(0x100000 + i * K, K, 0) for i in range(16)])
    assert coarse_only.fine_twin is None
    assert _plan.plan("READ", coarse_only, np.array([2]), rp, np.array([0]), True, 0).path == "batch"


def test_the_fine_granule_grows_with_the_buffer_and_stops_at_the_coarse_one():
    from tcpxd.nixl import _memory

    assert _memory.granule_for(1 << 30, _memory.FINE_GRANULE) == 512
    assert _memory.granule_for(16 << 30, _memory.FINE_GRANULE) == 1024  # at most 2**24 granules a list
    assert _memory.granule_for(16 << 30) == 4096 and _memory.granule_for(128 << 30) == 8192
    assert _memory.granule_for(256, _memory.FINE_GRANULE) == 0  # smaller than one granule: no list


def test_block_plan_cuts_a_group_past_the_blocks_limit(monkeypatch):
    monkeypatch.setattr(_plan, "MAX_BLOCKS", 16)  # cut every 8 granules (2 blocks of 16 KiB)
    loc = [_granular(0x100000, 1 << 20, "la", buffer_id=7, list_id=70)]
    rem = [_granular(0x900000, 1 << 20, "ra")]
    B = 16384
    lp = _prepped(loc, [(0x100000 + i * B, B, 0) for i in range(64)])
    rp = _prepped(rem, [(0x900000 + i * B, B, 0) for i in range(64)], "b")
    idx = np.arange(0, 20, 2)
    p = _plan.plan("READ", lp, idx, rp, idx, True, 0)
    assert p.path == "blocks" and len(p.requests) == 5
    counts = [sum(c for _, c in _ranges(r.local_indices)) for r in p.requests]
    assert counts == [8] * 5
    assert [s for r in p.requests for s, _ in _ranges(r.remote_indices)] == [i * 4 for i in idx]


def test_notification_framing():
    f = frame("agent-é", "b", b"msg:1")
    assert parse(f) == ("agent-é", "b", b"msg:1")
    assert parse(b"plain tcpxd notification") is None
    assert parse(f[:8]) is None


def test_install_shim_resolves_nixl_names(tmp_path):
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-m", "tcpxd.nixl", "install-shim", str(tmp_path)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}"
    code = (
        "from nixl._api import nixl_agent, nixl_agent_config\n"
        "from nixl._bindings import nixlXferTelemetry, nixlNotFoundError\n"
        "from nixl import nixl_agent as a2\n"
        "from nixl.logging import get_logger\n"
        "import tcpxd.nixl as t\n"
        "assert nixl_agent is t.nixl_agent is a2 and nixlXferTelemetry is t.nixlXferTelemetry\n"
        "assert nixlNotFoundError is t.nixlNotFoundError\n"
        "print(get_logger('x').name)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert run.returncode == 0 and run.stdout.strip() == "nixl.x", run.stderr  # (NIXL's logger hierarchy)
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "nixl").mkdir()
    (tmp_path / "real" / "nixl" / "__init__.py").write_text("# a real NIXL\n")
    refused = subprocess.run([sys.executable, "-m", "tcpxd.nixl", "install-shim", str(tmp_path / "real")], capture_output=True, text=True)
    assert refused.returncode != 0 and "not a tcpxd shim" in refused.stderr


def test_a_killed_peer_fails_send_notif_quickly(tmp_root: Path):
    a = start_daemon(tmp_root, "ka")
    b = start_daemon(tmp_root, "kb")
    try:
        A = nixl_agent("kill-A", nixl_agent_config(endpoint=a.endpoint, timeout_s=20))
        B = nixl_agent("kill-B", nixl_agent_config(endpoint=b.endpoint))
        A.add_remote_agent(B.get_agent_metadata())
        A.send_notif("kill-B", b"before")  # pairs the nodes
        assert wait_notifs(B, 1) == {"kill-A": [b"before"]}
        B.close()
        stop_daemon(b)
        t0 = time.monotonic()
        with pytest.raises(tcpxd.TcpxdError, match="previous notification to it failed.*peer kb"):
            A.send_notif("kill-B", b"after")  # posted (or refused at once: the peer is known down)
            A.send_notif("kill-B", b"again")  # the first one's failure, which came quickly
        assert time.monotonic() - t0 < 15
        A.close()
    finally:
        stop_daemon(a)
        stop_daemon(b)


def test_vllm_connector_module_rebinds_vllms_nixl_names(tmp_path):
    """A stand-in for vLLM's connector module (the names it binds at import, NixlWrapper None when
    NIXL is missing): importing tcpxd.nixl.vllm points them at tcpxd.nixl."""
    pkg = tmp_path / "vllm" / "distributed" / "kv_transfer" / "kv_connector" / "v1"
    pkg.mkdir(parents=True)
    for d in [tmp_path / "vllm", *list(pkg.parents)[: 4], pkg]:
        (d / "__init__.py").write_text("")
    (pkg / "nixl_connector.py").write_text(
        "NixlWrapper = None\nnixl_agent_config = None\nnixlXferTelemetry = None\n"
        "class NixlConnector:\n    def agent(self):\n        return NixlWrapper\n"
        "class T:\n    shared = False\n    def share_memory_(self):\n        self.shared = True\n        return self\n"
        "class NixlConnectorWorker:\n    def initialize_host_xfer_buffer(self, kv_caches):\n"
        "        self.host_xfer_buffers = {k: T() for k in kv_caches}\n"
    )
    (tmp_path / "vllm" / "distributed" / "nixl_utils.py").write_text("NixlWrapper = None\nnixl_agent_config = None\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    code = (
        "import tcpxd.nixl.vllm as m, tcpxd.nixl as t\n"
        "import vllm.distributed.nixl_utils as u\n"
        "assert u.NixlWrapper is t.nixl_agent and u.nixl_agent_config is t.nixl_agent_config  # the newest vLLM's\n"
        "import vllm.distributed.kv_transfer.kv_connector.v1.nixl_connector as v\n"
        "assert m.TcpxdNixlConnector is v.NixlConnector\n"
        "assert v.NixlWrapper is t.nixl_agent and v.nixl_agent_config is t.nixl_agent_config\n"
        "assert v.nixlXferTelemetry is t.nixlXferTelemetry and v.NixlConnector().agent() is t.nixl_agent\n"
        "w = v.NixlConnectorWorker()\n"
        "w.initialize_host_xfer_buffer({'layer.0': None, 'layer.1': None})\n"
        "assert all(b.shared for b in w.host_xfer_buffers.values())  # host staging moved to shared memory\n"
        "m.patch()\n"
        "assert v.NixlConnectorWorker.initialize_host_xfer_buffer._tcpxd_shared  # wrapped once\n"
        "print('ok')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_bulk_encoded_entries_match_protobufs():
    from tcpxd import _proto
    from tcpxd.nixl import _wire

    rng = np.random.default_rng(3)
    n = 1000
    values = [rng.integers(0, 1 << 62, n, dtype=np.uint64), rng.integers(0, 300, n, dtype=np.uint64),
              np.zeros(n, dtype=np.uint64), rng.integers(1, 1 << 40, n, dtype=np.uint64)]
    descs = [b"tcpxd1:a:1:" + b"f" * 32 + b"@10.0.0.1:5", b"d" * 300, b""]
    keys = rng.integers(0, 3, n)
    for count, per in ((n, 300), (50, 20)):  # numpy's path, and the plain loop's for a few entries
        pieces = [_wire.varint_piece(1, values[0][:count]), _wire.varint_piece(2, values[1][:count]),
                  _wire.table_piece(keys[:count], _wire.blobs(3, descs)), _wire.varint_piece(4, values[2][:count]),
                  _wire.varint_piece(5, values[3][:count])]
        bodies = _wire.entries(1, pieces, per)
        msgs = [_proto.message("WriteBatchRequest").FromString(b) for b in bodies]
        assert [len(m.entries) for m in msgs] == [per] * (count // per) + ([count % per] if count % per else [])
        got = [e for m in msgs for e in m.entries]
        for i, e in enumerate(got):
            want = (int(values[0][i]), int(values[1][i]), descs[keys[i]].decode(), 0, int(values[3][i]))
            assert (e.local_buffer_id, e.local_offset, e.remote_descriptor, e.remote_offset, e.length) == want


def test_closing_an_agent_releases_what_it_held(daemons):
    a, _ = daemons
    with tcpxd.Client(a.endpoint) as c:
        before = {b.id for b in c.list_buffers()}
        ag = nixl_agent("short-lived", nixl_agent_config(endpoint=a.endpoint))
        assert len({b.id for b in c.list_buffers()} - before) == 1  # its mailbox
        ag.close()
        ag.close()  # idempotent
        assert {b.id for b in c.list_buffers()} - before == set()


@pytest.mark.parametrize("path", ["feed", "session"])
def test_send_notif_posts_keeps_the_order_and_close_delivers_the_last(daemons, path):
    """send_notif returns once the daemon has the notification (NIXL's genNotif posts too): on the
    agent's notification feed (the subscribed local session), else on its transfers' session.
    Notifications to one agent still arrive in the order sent, and closing the agent right after
    one delivers it (the close waits for it rather than cancelling it)."""
    a, b = daemons
    A = nixl_agent("ord-A", nixl_agent_config(endpoint=a.endpoint))
    B = nixl_agent("ord-B", nixl_agent_config(endpoint=b.endpoint))
    try:
        B.add_remote_agent(A.get_agent_metadata())
        if path == "session":
            B._inbox.post_notif = lambda head, msg, to: None  # as without a local feed (a TCP endpoint)
        sent = [b"n-%d" % i for i in range(200)]
        for m in sent:
            B.send_notif("ord-A", m)
        assert wait_notifs(A, len(sent)) == {"ord-B": sent}
        last = B._remotes["ord-A"].notif_sent
        assert last is not None and last.exception(10) is None
        if path == "feed":
            assert B._session is None  # nothing went on the transfers' session
            assert not B._inbox._feed.sent  # every answer read (by the waits and the polls)
        B.send_notif("ord-A", b"the last")
        B.close()
        assert wait_notifs(A, 1) == {"ord-B": [b"the last"]}
    finally:
        A.close()
        B.close()


def test_send_notif_falls_back_when_the_feed_connection_ended(daemons):
    """A feed whose connection the daemon ended (a restart, a drain) is not written into: the
    notification goes on the agent's session, and the feed is subscribed again later."""
    import socket as _socket

    a, b = daemons
    with nixl_agent("fb-A", nixl_agent_config(endpoint=a.endpoint)) as A, \
            nixl_agent("fb-B", nixl_agent_config(endpoint=b.endpoint)) as B:
        B.add_remote_agent(A.get_agent_metadata())
        B.send_notif("fb-A", b"one")
        assert wait_notifs(A, 1) == {"fb-B": [b"one"]}
        B._remotes["fb-A"].notif_sent.exception(10)
        feed = B._inbox._feed
        feed.conn.sock.shutdown(_socket.SHUT_RDWR)  # as the daemon closing it
        ring = feed.conn.ring
        deadline = time.monotonic() + 10
        while ring is not None and not int.from_bytes(ring.mem[16:24], "little"):
            # (with a request ring: the daemon ends the session, which says so on the ring
            # (`ended`) before it closes the connection, as a daemon closing it does)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        B.send_notif("fb-A", b"two")
        assert B._inbox._feed is None and B._session is not None
        assert wait_notifs(A, 1) == {"fb-B": [b"two"]}
        deadline = time.monotonic() + 10
        while B._inbox._feed is None and time.monotonic() < deadline:
            B.get_new_notifs()
            time.sleep(0.05)
        B.send_notif("fb-A", b"three")
        assert wait_notifs(A, 1) == {"fb-B": [b"three"]}
