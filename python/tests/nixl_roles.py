"""The two sides of each replayed call sequence, run in processes of their own (spawned) by
test_nixl_replay.py. Each role talks to its own daemon through tcpxd.nixl exactly as the stack it
replays talks to NIXL, exchanges what the stack's side channel carries over a multiprocessing
pipe, and reports what it saw (or raises: the parent gets the traceback)."""

from __future__ import annotations

import pickle
import time
import traceback
import uuid
from typing import Any, Callable, Dict, List, Tuple

import numpy as np

POLL_S = 30.0


def pattern(seed: int, n: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.uint64) * 2654435761 + seed * 97) >> 3).astype(np.uint8)


def run_role(fn: Callable[..., Dict[str, Any]], conn: Any, *args: Any) -> None:
    """Runs a role, sending {"ok": result} or {"error": traceback} to the parent."""
    try:
        conn.send({"ok": fn(conn, *args)})
    except BaseException:  # noqa: BLE001 - the parent reports it
        conn.send({"error": traceback.format_exc()})


def poll_done(agent: Any, handles: List[Any], deadline_s: float = POLL_S) -> List[str]:
    """check_xfer_state on each handle until none is "PROC" (as the stacks poll every step)."""
    deadline = time.monotonic() + deadline_s
    while True:
        states = [agent.check_xfer_state(h) for h in handles]
        if "PROC" not in states or time.monotonic() > deadline:
            return states
        time.sleep(0.002)


def wait_notifs(agent: Any, want: int, deadline_s: float = POLL_S) -> Dict[str, List[bytes]]:
    got: Dict[str, List[bytes]] = {}
    deadline = time.monotonic() + deadline_s
    while sum(len(v) for v in got.values()) < want and time.monotonic() < deadline:
        for k, v in agent.get_new_notifs().items():
            got.setdefault(k, []).extend(v)
        time.sleep(0.002)
    return got


# -- vLLM's NixlConnector ------------------------------------------------------------------------

def alloc(nbytes: int, mem: str, dev: int = 0) -> Any:
    """Memory an agent can register: shared host memory (DRAM), or a torch CUDA tensor (VRAM)."""
    if mem == "DRAM":
        from tcpxd.nixl import host_array

        return host_array(nbytes)
    import torch

    return torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{dev}")


def addr(x: Any) -> int:
    return int(x.data_ptr()) if hasattr(x, "data_ptr") else int(x.ctypes.data)


def host(x: Any) -> np.ndarray:
    """A copy of the bytes, in host memory."""
    return np.array(x.cpu()) if hasattr(x, "cpu") else np.array(x)


def put(x: Any, data: np.ndarray) -> None:
    if hasattr(x, "copy_"):
        import torch

        x.copy_(torch.from_numpy(np.ascontiguousarray(data)))
    else:
        x[:] = data


class KV:
    """A vLLM worker's KV cache: per layer one [2, num_blocks, block_len] cache, K and V registered
    as separate regions (split_k_and_v), one descriptor per block per region."""

    def __init__(self, layers: int, num_blocks: int, block_len: int, mem: str = "DRAM", dev: int = 0):
        self.layers, self.num_blocks, self.block_len, self.mem, self.dev = layers, num_blocks, block_len, mem, dev
        self.caches = [alloc(2 * num_blocks * block_len, mem, dev).reshape(2, num_blocks, block_len) for _ in range(layers)]
        self.regions = [c[kv] for c in self.caches for kv in (0, 1)]
        self.base_addrs = [addr(r) for r in self.regions]

    def caches_data(self) -> List[Tuple[int, int, int, str]]:
        return [(base, self.num_blocks * self.block_len, self.dev, "") for base in self.base_addrs]

    def blocks_data(self, base_addrs: List[int], num_blocks: int, dev: int = -1) -> List[Tuple[int, int, int]]:
        d = self.dev if dev < 0 else dev
        return [(base + b * self.block_len, self.block_len, d) for base in base_addrs for b in range(num_blocks)]

    def desc_ids(self, block_ids: List[int], num_blocks: int) -> np.ndarray:
        region_ids = np.arange(len(self.regions))[:, None]
        return (region_ids * num_blocks + np.array(block_ids)[None, :]).flatten()

    def fill(self, seed: int) -> None:
        for i, r in enumerate(self.regions):
            for b in range(self.num_blocks):
                put(r[b], pattern(seed + i * 1000 + b, self.block_len))

    def expect(self, seed: int, region: int, block: int) -> np.ndarray:
        return pattern(seed + region * 1000 + block, self.block_len)


def vllm_worker(endpoint: str, kv: KV) -> Tuple[Any, Any, Any]:
    from tcpxd.nixl import nixl_agent, nixl_agent_config

    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config(num_threads=4, capture_telemetry=True, endpoint=endpoint))
    descs = agent.get_reg_descs(kv.caches_data(), kv.mem)
    agent.register_memory(descs, backends=["UCX"])
    src = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(kv.blocks_data(kv.base_addrs, kv.num_blocks), kv.mem))
    return agent, descs, src


def vllm_prefill_pull(conn: Any, endpoint: str, shape: Tuple[Any, ...], seed: int, requests: List[str]) -> Dict[str, Any]:
    """The prefill worker of a pull: registers, hands its metadata and base addresses over the side
    channel, then frees each request's blocks when the decode agent's notification names it."""
    kv = KV(*shape)
    kv.fill(seed)
    agent, descs, src = vllm_worker(endpoint, kv)
    conn.send(pickle.dumps({"agent_metadata": agent.get_agent_metadata(), "kv_caches_base_addr": kv.base_addrs,
                            "num_blocks": kv.num_blocks, "block_len": kv.block_len, "device_id": kv.dev}))
    # Decode is done (every READ DONE, each notification sent) before the notifications are
    # waited for: POLL_S bounds their delivery, not however long the decode side took.
    conn.recv()
    notifs = wait_notifs(agent, len(requests))
    agent.release_dlist_handle(src)
    agent.deregister_memory(descs)
    agent.close()
    return {"notifs": {k: [m.decode() for m in v] for k, v in notifs.items()}}


def vllm_decode_pull(conn: Any, endpoint: str, shape: Tuple[Any, ...], seed: int,
                     reqs: List[Tuple[str, List[int], List[int]]]) -> Dict[str, Any]:
    """The decode worker of a pull: add_remote_agent, a remote list over all the remote blocks, one
    READ by block indices per request with "<request id>:<tp size>", polled to DONE, telemetry
    recorded and the handle released; an empty request (a full prefix hit) sends only send_notif;
    then the connector's shutdown order."""
    kv = KV(*shape)
    agent, descs, src = vllm_worker(endpoint, kv)
    hs = pickle.loads(conn.recv())
    remote_name = agent.add_remote_agent(hs["agent_metadata"])
    dst = agent.prep_xfer_dlist(remote_name, agent.get_xfer_descs(kv.blocks_data(hs["kv_caches_base_addr"], hs["num_blocks"], hs["device_id"]), kv.mem))
    out: Dict[str, Any] = {"remote_name": remote_name, "telemetry": []}
    for req_id, local_ids, remote_ids in reqs:
        notif_id = f"{req_id}:1".encode()
        if not local_ids:
            agent.send_notif(remote_name, notif_msg=notif_id)
            continue
        h = agent.make_prepped_xfer("READ", src, kv.desc_ids(local_ids, kv.num_blocks), dst,
                                    kv.desc_ids(remote_ids, hs["num_blocks"]), notif_msg=notif_id)
        assert agent.transfer(h) in ("PROC", "DONE")
        (state,) = poll_done(agent, [h])
        assert state == "DONE", (state, h.error)
        t = agent.get_xfer_telemetry(h)
        out["telemetry"].append((t.totalBytes, t.descCount, t.xferDuration > 0))
        out.setdefault("paths", []).append(h._xfer.plan.path)  # tcpxd's: granule lists or batches
        agent.release_xfer_handle(h)
        for r in range(len(kv.regions)):
            for lb, rb in zip(local_ids, remote_ids):
                assert np.array_equal(host(kv.regions[r][lb]), kv.expect(seed, r, rb)), (req_id, r, lb, rb)
    agent.release_dlist_handle(src)
    agent.release_dlist_handle(dst)
    agent.remove_remote_agent(remote_name)
    agent.deregister_memory(descs)
    agent.close()
    out["agent_name"] = agent.name
    return out


def vllm_decode_push(conn: Any, endpoint: str, shape: Tuple[Any, ...], nreqs: int) -> Dict[str, Any]:
    """Push mode's decode side: hands its metadata and base addresses to prefill, then waits for
    the WRITE notifications that say each request's blocks landed."""
    kv = KV(*shape)
    agent, descs, src = vllm_worker(endpoint, kv)
    conn.send(pickle.dumps({"agent_metadata": agent.get_agent_metadata(), "kv_caches_base_addr": kv.base_addrs,
                            "num_blocks": kv.num_blocks, "device_id": kv.dev}))
    conn.recv()  # prefill is done (every WRITE DONE): POLL_S bounds only the notifications' delivery
    notifs = wait_notifs(agent, nreqs)
    snap = [host(r) for r in kv.regions]  # what had landed when the notifications came
    agent.release_dlist_handle(src)
    agent.deregister_memory(descs)
    agent.close()
    return {"notifs": {k: [m.decode() for m in v] for k, v in notifs.items()}, "regions": snap}


def vllm_prefill_push(conn: Any, endpoint: str, shape: Tuple[Any, ...], seed: int,
                      reqs: List[Tuple[str, List[int], List[int]]]) -> Dict[str, Any]:
    """Push mode's prefill side: WRITEs each request's blocks into decode's with a notification."""
    kv = KV(*shape)
    kv.fill(seed)
    agent, descs, src = vllm_worker(endpoint, kv)
    hs = pickle.loads(conn.recv())
    remote_name = agent.add_remote_agent(hs["agent_metadata"])
    dst = agent.prep_xfer_dlist(remote_name, agent.get_xfer_descs(kv.blocks_data(hs["kv_caches_base_addr"], hs["num_blocks"], hs["device_id"]), kv.mem))
    handles = []
    for req_id, local_ids, remote_ids in reqs:
        h = agent.make_prepped_xfer("WRITE", src, kv.desc_ids(local_ids, kv.num_blocks), dst,
                                    kv.desc_ids(remote_ids, hs["num_blocks"]), notif_msg=f"{req_id}:1".encode())
        agent.transfer(h)
        handles.append(h)
    states = poll_done(agent, handles)
    paths = [h._xfer.plan.path for h in handles]
    for h in handles:
        agent.release_xfer_handle(h)
    agent.release_dlist_handle(src)
    agent.release_dlist_handle(dst)
    agent.remove_remote_agent(remote_name)
    agent.deregister_memory(descs)
    agent.close()
    return {"states": states, "agent_name": agent.name, "paths": paths}


# -- SGLang's nixl backend -----------------------------------------------------------------------

def sglang_decode(conn: Any, endpoint: str, layers: int, pages: int, item_len: int, aux_len: int,
                  room: int, chunks: int, kv_mem: str = "DRAM", gpu: int = 0) -> Dict[str, Any]:
    """SGLang's decode side (NixlKVReceiver): registers its KV (one region per layer) and aux
    buffers, sends its agent name, metadata, pointers and the page indices to fill, then polls
    get_new_notifs, parsing "<room>_kv_<chunk>_<last>" and "<room>_aux", until the room is done."""
    from tcpxd.nixl import host_array, nixl_agent, nixl_agent_config

    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config(endpoint=endpoint))
    capacity = 2 * pages  # decode's pool: the pages it fills are scattered in it
    kv = [alloc(capacity * item_len, kv_mem, gpu) for _ in range(layers)]
    aux = host_array(8 * aux_len)
    kv_descs = agent.register_memory([(addr(k), capacity * item_len, gpu, "") for k in kv], kv_mem)
    aux_descs = agent.register_memory([(addr(aux), aux.nbytes, 0, "")], "DRAM")
    dst_pages = np.random.default_rng(room).permutation(capacity)[:pages].astype(np.int32)
    conn.send({"agent_name": agent.name, "agent_metadata": agent.get_agent_metadata(),
               "dst_kv_ptrs": [addr(k) for k in kv], "dst_aux_ptrs": [addr(aux)], "gpu_id": gpu,
               "dst_kv_indices": dst_pages, "dst_aux_index": 3})
    received, expected, got_aux = set(), None, False
    conn.recv()  # prefill is done (every WRITE DONE): POLL_S bounds only the notifications' delivery
    deadline = time.monotonic() + POLL_S
    while not (expected is not None and len(received) == expected and got_aux) and time.monotonic() < deadline:
        for peer, msgs in agent.get_new_notifs().items():
            for msg in msgs:
                parts = msg.decode("ascii").split("_")
                assert int(parts[0]) == room
                if parts[1] == "kv":
                    received.add(int(parts[2]))
                    if bool(int(parts[3])):
                        expected = int(parts[2]) + 1
                elif parts[1] == "aux":
                    got_aux = True
        time.sleep(0.002)
    snap = {"kv": [host(k) for k in kv], "aux": np.array(aux), "received": sorted(received), "expected": expected,
            "aux_done": got_aux, "dst_pages": dst_pages}
    agent.deregister_memory(kv_descs)
    agent.deregister_memory(aux_descs)
    agent.close()
    return snap


def sglang_prefill(conn: Any, endpoint: str, layers: int, pages: int, item_len: int, aux_len: int,
                   room: int, chunks: int, seed: int, kv_mem: str = "DRAM", gpu: int = 0) -> Dict[str, Any]:
    """SGLang's prefill side (NixlKVManager.add_transfer_request): per chunk of pages, descriptors
    for every layer built from the decode pointers, initialize_xfer("WRITE", ..., notif) and
    transfer; the last chunk also sends the aux item; then polls check_xfer_state to DONE."""
    from tcpxd.nixl import host_array, nixl_agent, nixl_agent_config

    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config(endpoint=endpoint))
    assert "TCPXD" in agent.get_plugin_list()
    kv = [alloc(pages * item_len, kv_mem, gpu) for _ in range(layers)]
    for i, k in enumerate(kv):
        put(k, pattern(seed + i, pages * item_len))
    aux = host_array(8 * aux_len)
    aux[:] = pattern(seed + 99, aux.nbytes)
    kv_descs = agent.register_memory([(addr(k), pages * item_len, gpu, "") for k in kv], kv_mem)
    aux_descs = agent.register_memory([(addr(aux), aux.nbytes, 0, "")], "DRAM")
    info = conn.recv()
    agent.add_remote_agent(info["agent_metadata"])
    peer = info["agent_name"]
    src_pages = np.arange(len(info["dst_kv_indices"]), dtype=np.int32)
    handles = []
    for chunk, sl in enumerate(np.array_split(np.arange(len(src_pages)), chunks)):
        is_last = chunk == chunks - 1
        src_addrs, dst_addrs = [], []
        for layer in range(layers):
            for sp, dp in zip(src_pages[sl], info["dst_kv_indices"][sl]):
                src_addrs.append((addr(kv[layer]) + int(sp) * item_len, item_len, gpu))
                dst_addrs.append((info["dst_kv_ptrs"][layer] + int(dp) * item_len, item_len, info["gpu_id"]))
        h = agent.initialize_xfer("WRITE", agent.get_xfer_descs(src_addrs, kv_mem), agent.get_xfer_descs(dst_addrs, kv_mem),
                                  peer, f"{room}_kv_{chunk}_{int(is_last)}".encode("ascii"))
        assert agent.transfer(h) != "ERR"
        handles.append(h)
        if is_last:
            src = [(addr(aux) + 2 * aux_len, aux_len, 0)]
            dst = [(info["dst_aux_ptrs"][0] + info["dst_aux_index"] * aux_len, aux_len, 0)]
            h = agent.initialize_xfer("WRITE", agent.get_xfer_descs(src, "DRAM"), agent.get_xfer_descs(dst, "DRAM"), peer,
                                      f"{room}_aux".encode("ascii"))
            assert agent.transfer(h) != "ERR"
            handles.append(h)
    states = poll_done(agent, handles)
    paths = [h._xfer.plan.path for h in handles]  # tcpxd's: which daemon requests each became
    agent.deregister_memory(kv_descs)
    agent.deregister_memory(aux_descs)
    agent.close()
    return {"states": states, "paths": paths}


# -- NIXL's expanded two-peer example ------------------------------------------------------------

ROWS, ROW_BYTES = 16, 128


def nixl_target(conn: Any, endpoint: str, port: int) -> Dict[str, Any]:
    """examples/python/expanded_two_peers.py, target mode (numpy rows in shared memory for the
    example's torch rows)."""
    from tcpxd.nixl import host_array, nixl_agent, nixl_agent_config

    agent = nixl_agent("target", nixl_agent_config(True, True, port, backends=["UCX"], endpoint=endpoint))
    mem = host_array(ROWS * ROW_BYTES).view(np.float32).reshape(ROWS, ROW_BYTES // 4)
    mem[:] = 1.0
    reg_descs = agent.register_memory(agent.get_reg_descs([(int(mem.ctypes.data), mem.nbytes, 0, "")], "DRAM"))
    base_addr = int(mem.ctypes.data)
    target_descs = agent.get_xfer_descs([(base_addr + i * ROW_BYTES, ROW_BYTES, 0) for i in range(ROWS)], "DRAM")
    target_desc_str = agent.get_serialized_descs(target_descs)
    conn.send("listening")
    # The initiator's process starts after this one's (spawned: its imports, agent and
    # registration come first): 3 POLL_S for its metadata, within the parent's 120 s.
    deadline = time.monotonic() + 3 * POLL_S
    while not agent.check_remote_metadata("initiator"):
        assert time.monotonic() < deadline, "no metadata from the initiator"
        time.sleep(0.01)
    agent.send_notif("initiator", pickle.dumps((target_desc_str, (base_addr, ROWS, ROW_BYTES, 0, "cpu"))))
    expected_reads = {f"Read idx {s},{s + 4},{s + 8}".encode() for s in range(4)}
    expected_reads |= {m + b" again" for m in expected_reads}
    remaining_writes = 2
    while (expected_reads or remaining_writes > 0) and time.monotonic() < deadline + POLL_S:
        notif_map = agent.get_new_notifs()
        for msg in notif_map.get("initiator", []):
            if msg in expected_reads:
                expected_reads.remove(msg)
            elif msg.startswith(b"Write") and remaining_writes > 0:
                remaining_writes -= 1
        time.sleep(0.002)
    tail = np.array(mem[12:, :])
    agent.deregister_memory(reg_descs)
    agent.close()
    return {"missing_reads": sorted(expected_reads), "missing_writes": remaining_writes, "tail": tail}


def nixl_initiator(conn: Any, endpoint: str, ip: str, port: int) -> Dict[str, Any]:
    """expanded_two_peers.py, initiator mode: metadata by the listener, READs by prepared lists
    (remote indices reversed) posted in parallel, two WRITEs by initialize_xfer (tuples, then an
    N×3 numpy array), the READs re-posted with new notifications, then the teardown."""
    import random

    from tcpxd.nixl import host_array, nixl_agent, nixl_agent_config

    assert conn.recv() == "listening"
    agent = nixl_agent("initiator", nixl_agent_config(True, True, 0, backends=["UCX"], endpoint=endpoint))
    mem = host_array(ROWS * ROW_BYTES).view(np.float32).reshape(ROWS, ROW_BYTES // 4)
    mem[:] = 0.0
    reg_descs = agent.register_memory(agent.get_reg_descs([(int(mem.ctypes.data), mem.nbytes, 0, "")], "DRAM"))
    agent.send_local_metadata(ip, port)
    agent.fetch_remote_metadata("target", ip, port)
    notifs = agent.get_new_notifs()
    deadline = time.monotonic() + POLL_S
    while len(notifs) == 0:
        assert time.monotonic() < deadline, "no descriptors from the target"
        notifs = agent.get_new_notifs()
    target_descs_ser, layout_info = pickle.loads(notifs["target"][0])
    target_descs = agent.deserialize_descs(target_descs_ser)
    while not agent.check_remote_metadata("target"):
        assert time.monotonic() < deadline
    rows = [(int(mem.ctypes.data) + i * ROW_BYTES, ROW_BYTES, 0) for i in range(ROWS)]
    local_side = agent.prep_xfer_dlist("", agent.get_xfer_descs(rows, "DRAM"))
    remote_side = agent.prep_xfer_dlist("target", target_descs)
    read_handles = []
    for start in range(4):
        idxs = [start, start + 4, start + 8]
        read_handles.append(agent.make_prepped_xfer("READ", local_side, idxs, remote_side, idxs[::-1],
                                                    f"Read idx {start},{start + 4},{start + 8}".encode()))
    base_addr, tensors, tensor_size, remote_dev, remote_mem = layout_info
    random.seed(0)
    starts = {r: (0 if random.randint(0, 1) == 0 else tensor_size // 2) for r in range(12, 16)}
    half = tensor_size // 2
    local_w0 = [(rows[r][0] + starts[r], half, 0) for r in (12, 13)]
    remote_w0 = [(base_addr + r * tensor_size + starts[r], half, remote_dev) for r in (12, 13)]
    xfer_w0 = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local_w0, mem_type="cpu"),
                                    agent.get_xfer_descs(remote_w0, mem_type=remote_mem), "target", b"Write tensors 12,13")
    local_w1 = np.array([[rows[r][0] + starts[r], half, 0] for r in (14, 15)], dtype=np.uint64)
    remote_w1 = np.array([[base_addr + r * tensor_size + starts[r], half, remote_dev] for r in (14, 15)], dtype=np.uint64)
    xfer_w1 = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local_w1, mem_type="cpu"),
                                    agent.get_xfer_descs(remote_w1, mem_type=remote_mem), "target", b"Write tensors 14,15")
    handles = read_handles + [xfer_w0, xfer_w1]
    for h in read_handles:
        assert agent.transfer(h) != "ERR"
    assert poll_done(agent, read_handles) == ["DONE"] * 4
    for h in (xfer_w0, xfer_w1):
        assert agent.transfer(h) != "ERR"
    assert poll_done(agent, [xfer_w0, xfer_w1]) == ["DONE"] * 2
    for start in range(4):
        assert agent.transfer(read_handles[start], f"Read idx {start},{start + 4},{start + 8} again".encode()) != "ERR"
    assert poll_done(agent, read_handles) == ["DONE"] * 4
    check = np.zeros_like(mem)
    check[:12, :] = 1.0
    final = np.array(mem)
    agent.remove_remote_agent("target")
    for h in handles:
        agent.release_xfer_handle(h)
    agent.release_dlist_handle(local_side)
    agent.release_dlist_handle(remote_side)
    agent.invalidate_local_metadata(ip, port)
    agent.deregister_memory(reg_descs)
    agent.close()
    return {"verified": bool(np.array_equal(final, check)), "written": {r: starts[r] for r in starts}}


# -- a peer that dies ---------------------------------------------------------------------------

def dying_prefill(conn: Any, endpoint: str, nbytes: int) -> Dict[str, Any]:
    """Registers a big region, hands over its metadata, and waits to be told to stop (the parent
    kills this side's daemon meanwhile)."""
    from tcpxd.nixl import host_array, nixl_agent, nixl_agent_config

    agent = nixl_agent("dying-prefill", nixl_agent_config(endpoint=endpoint))
    mem = host_array(nbytes)
    agent.register_memory([(int(mem.ctypes.data), nbytes, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), int(mem.ctypes.data)))
    conn.recv()
    return {}


def reading_decode(conn: Any, endpoint: str, nbytes: int, timeout_s: float) -> Dict[str, Any]:
    """READs the whole remote region; reports each state it polled and how long ERR took after the
    parent said the remote daemon was killed."""
    from tcpxd.nixl import host_array, nixl_agent, nixl_agent_config

    agent = nixl_agent("reading-decode", nixl_agent_config(endpoint=endpoint, timeout_s=timeout_s))
    md, remote_base = conn.recv()
    mem = host_array(nbytes)
    agent.register_memory([(int(mem.ctypes.data), nbytes, 0, "")], "DRAM")
    name = agent.add_remote_agent(md)
    chunk = 1 << 20
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(int(mem.ctypes.data) + o, chunk, 0) for o in range(0, nbytes, chunk)], "DRAM")
    remote = agent.prep_xfer_dlist(name, [(remote_base + o, chunk, 0) for o in range(0, nbytes, chunk)], "DRAM")
    idx = np.arange(nbytes // chunk)
    warm = agent.make_prepped_xfer("READ", local, idx[:1], remote, idx[:1])
    agent.transfer(warm)
    assert poll_done(agent, [warm]) == ["DONE"]
    h = agent.make_prepped_xfer("READ", local, idx, remote, idx[::-1].copy(), notif_msg=b"never")
    first = agent.transfer(h)
    conn.send("started")
    assert conn.recv() == "killed"
    t0 = time.monotonic()
    (state,) = poll_done(agent, [h], deadline_s=timeout_s + 10)
    took = time.monotonic() - t0
    err = repr(h.error)
    after = agent.make_prepped_xfer("READ", local, idx[:1], remote, idx[:1])
    agent.transfer(after)
    (after_state,) = poll_done(agent, [after], deadline_s=timeout_s + 10)
    agent.release_xfer_handle(h)
    agent.close()
    return {"first": first, "state": state, "took": took, "error": err, "after": after_state}
