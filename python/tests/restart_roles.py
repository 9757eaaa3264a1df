"""The two processes of the restart tests (test_restart.py), spawned: a vLLM prefill worker holding
its KV cache (`holder`), and a decode worker pulling blocks of it in a loop as vLLM's
NixlConnector does (`puller`), each through tcpxd.nixl on its own daemon. The puller reports every
transfer's end over the pipe — ("ok", when) or ("err", when, why) — and checks every byte of every
transfer that succeeded; it stops when the parent says so."""

from __future__ import annotations

import pickle
import random
import time
import traceback
from typing import Any, Dict, List, Tuple

import numpy as np

from nixl_roles import KV, host, vllm_worker

#: A transfer still "PROC" after this long hangs (the agent's transfers carry a 5 s deadline).
HANG_S = 20.0


def run(fn: Any, conn: Any, *args: Any) -> None:
    try:
        conn.send(("done", fn(conn, *args)))
    except BaseException:  # noqa: BLE001 - the parent reports it
        conn.send(("error", traceback.format_exc()))


def holder(conn: Any, endpoint: str, shape: Tuple[Any, ...], seed: int) -> Dict[str, Any]:
    kv = KV(*shape)
    kv.fill(seed)
    agent, descs, src = vllm_worker(endpoint, kv)
    conn.send(("metadata", pickle.dumps({"agent_metadata": agent.get_agent_metadata(), "kv_caches_base_addr": kv.base_addrs,
                                         "num_blocks": kv.num_blocks, "block_len": kv.block_len})))
    assert conn.recv() == "stop"
    # Its memory is its own (a memfd it shares): untouched by any restart.
    intact = all(np.array_equal(host(kv.regions[r][b]), kv.expect(seed, r, b))
                 for r in range(len(kv.regions)) for b in range(kv.num_blocks))
    restarts = agent._client._reattach.restarts
    agent.close()
    return {"intact": intact, "reattached": restarts}


def puller(conn: Any, endpoint: str, shape: Tuple[Any, ...], seed: int, md: bytes) -> Dict[str, Any]:
    from tcpxd.nixl import nixl_agent, nixl_agent_config

    kv = KV(*shape)
    agent = nixl_agent("decode", nixl_agent_config(endpoint=endpoint, timeout_s=5.0))
    descs = agent.get_reg_descs(kv.caches_data(), kv.mem)
    agent.register_memory(descs)
    src = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(kv.blocks_data(kv.base_addrs, kv.num_blocks), kv.mem))
    hs = pickle.loads(md)
    remote = agent.add_remote_agent(hs["agent_metadata"])
    dst = agent.prep_xfer_dlist(remote, agent.get_xfer_descs(kv.blocks_data(hs["kv_caches_base_addr"], hs["num_blocks"]), kv.mem))
    rng = random.Random(seed)
    ok = errors = hangs = 0
    n = 0
    while not conn.poll():
        n += 1
        count = rng.randint(1, 4)
        local = rng.sample(range(kv.num_blocks), count)
        remote_ids = rng.sample(range(hs["num_blocks"]), count)
        for r in kv.regions:
            r[local] = 0
        why = ""
        try:
            h = agent.make_prepped_xfer("READ", src, kv.desc_ids(local, kv.num_blocks), dst,
                                        kv.desc_ids(remote_ids, hs["num_blocks"]), notif_msg=f"req-{n}:1".encode())
            state = agent.transfer(h)
            deadline = time.monotonic() + HANG_S
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(0.001)
                state = agent.check_xfer_state(h)
            if state == "PROC":
                hangs += 1
                why = "still PROC after %.0f s" % HANG_S
            elif state != "DONE":
                why = str(h.error)
            agent.release_xfer_handle(h)
        except Exception as e:  # noqa: BLE001 - the application retries, as a serving loop does
            state, why = "RAISED", f"{type(e).__name__}: {e}"
        if state == "DONE":
            for r in range(len(kv.regions)):
                for lb, rb in zip(local, remote_ids):
                    assert np.array_equal(host(kv.regions[r][lb]), kv.expect(seed, r, rb)), (n, r, lb, rb)
            ok += 1
            conn.send(("ok", time.monotonic()))
        else:
            errors += 1
            conn.send(("err", time.monotonic(), f"{state}: {why}"[:300]))
            time.sleep(0.02)
    assert conn.recv() == "stop"
    restarts = agent._client._reattach.restarts
    agent.release_dlist_handle(src)
    agent.release_dlist_handle(dst)
    agent.close()
    return {"ok": ok, "errors": errors, "hangs": hangs, "reattached": restarts}


__all__: List[str] = ["run", "holder", "puller"]
