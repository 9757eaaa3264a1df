"""Replays of what the serving stacks call, through tcpxd.nixl, each side in a process of its own
against its own daemon, host memory byte-checked: vLLM's NixlConnector (pull, with the prefix-hit
send_notif and the shutdown order; push), SGLang's nixl backend, NIXL's expanded two-peer example,
and a peer whose daemon dies mid-transfer."""

from __future__ import annotations

import multiprocessing
import socket
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import pytest

import nixl_roles as roles
from conftest import start_daemon, stop_daemon


CTX = multiprocessing.get_context("spawn")  # no fork of a process with gRPC threads
TIMEOUT = 120


class Side:
    """One role in a spawned process, with its end of the side channel."""

    def __init__(self, fn: Callable[..., Dict[str, Any]], *args: Any):
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=roles.run_role, args=(fn, child) + args, daemon=True)
        self.proc.start()

    def recv(self) -> Any:
        if not self.conn.poll(TIMEOUT):
            raise AssertionError("the other process said nothing in time")
        msg = self.conn.recv()
        if isinstance(msg, dict) and "error" in msg:
            raise AssertionError("the role failed:\n" + msg["error"])
        return msg

    def send(self, msg: Any) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, ConnectionResetError):
            # The role ended early (it failed): say why, not "Broken pipe".
            self.recv()
            raise AssertionError(f"the role ended (exit code {self.proc.exitcode}) before it was told {msg!r}") from None

    def result(self) -> Dict[str, Any]:
        msg = self.recv()
        assert isinstance(msg, dict) and "ok" in msg, msg
        self.proc.join(30)
        return msg["ok"]


@pytest.mark.parametrize("block", [1000, 18432, 16384], ids=["batch-path", "fine-granules", "block-path"])
def test_vllm_pull_reads_blocks_by_index_and_notifies(daemons, block):
    a, b = daemons
    # 3 layers × (K, V) regions, 12 blocks each; 1,000-byte blocks are no granules (batches),
    # 18 KiB ones (MLA's at block size 16) the fine granule lists' and 16 KiB ones the 4 KiB lists'
    # (prepared lists over the granule lists)
    shape = (3, 12, block)
    reqs: List[Tuple[str, List[int], List[int]]] = [
        ("req-1", [3, 4, 5, 9], [0, 1, 2, 7]),   # a partial run of neighbours: merged where both sides are
        ("req-2", [], []),                       # a full prefix hit: only send_notif
        ("req-3", [11, 0], [10, 11]),
    ]
    prefill = Side(roles.vllm_prefill_pull, b.endpoint, shape, 5, [r[0] for r in reqs])
    decode = Side(roles.vllm_decode_pull, a.endpoint, shape, 5, reqs)
    decode.send(prefill.recv())  # the handshake over vLLM's side channel
    got = decode.result()
    prefill.send("done")
    notifs = prefill.result()["notifs"]
    # Keyed by the decode agent's name, which prefill never loaded; after the data was read.
    assert notifs == {got["agent_name"]: ["req-1:1", "req-2:1", "req-3:1"]}
    assert got["telemetry"] == [(6 * 4 * block, 24, True), (6 * 2 * block, 12, True)]
    assert got["paths"] == ["batch" if block == 1000 else "prepared"] * 2  # the prepared lists in the daemon


@pytest.mark.parametrize("block", [1000, 1024, 16384], ids=["batch-path", "fine-granules", "block-path"])
def test_vllm_push_writes_blocks_with_notifications(daemons, block):
    a, b = daemons
    shape = (2, 8, block)
    reqs = [("push-1", [0, 1, 2], [4, 5, 6]), ("push-2", [7], [0])]
    decode = Side(roles.vllm_decode_push, a.endpoint, shape, len(reqs))
    prefill = Side(roles.vllm_prefill_push, b.endpoint, shape, 9, reqs)
    prefill.send(decode.recv())
    pushed = prefill.result()
    decode.send("done")
    assert pushed["states"] == ["DONE", "DONE"]
    assert pushed["paths"] == ["batch" if block == 1000 else "prepared"] * 2
    got = decode.result()
    assert list(got["notifs"]) == [pushed["agent_name"]]
    assert sorted(got["notifs"][pushed["agent_name"]]) == ["push-1:1", "push-2:1"]  # in completion order
    kv = roles.KV.__new__(roles.KV)
    kv.block_len = shape[2]
    for r, region in enumerate(got["regions"]):
        for req_id, local_ids, remote_ids in reqs:
            for lb, rb in zip(local_ids, remote_ids):
                assert np.array_equal(region[rb], kv.expect(9, r, lb)), (req_id, r, lb, rb)


def test_sglang_writes_chunks_with_notifications(daemons):
    a, b = daemons
    layers, pages, item_len, aux_len, room, chunks = 3, 8, 2048, 64, 4242, 3
    decode = Side(roles.sglang_decode, a.endpoint, layers, pages, item_len, aux_len, room, chunks)
    prefill = Side(roles.sglang_prefill, b.endpoint, layers, pages, item_len, aux_len, room, chunks, 17)
    prefill.send(decode.recv())
    pushed = prefill.result()
    assert pushed["states"] == ["DONE"] * (chunks + 1)
    # 2 KiB pages: the block path over the fine (512-byte) granule lists; the 64-byte aux item, one
    # range: the plain WRITE, its notification in it
    assert pushed["paths"] == ["blocks"] * chunks + ["plain"]
    decode.send("done")
    got = decode.result()
    assert got["received"] == list(range(chunks)) and got["expected"] == chunks and got["aux_done"]
    for layer in range(layers):
        src = roles.pattern(17 + layer, pages * item_len)
        for sp, dp in enumerate(got["dst_pages"]):
            assert np.array_equal(got["kv"][layer][dp * item_len:(dp + 1) * item_len], src[sp * item_len:(sp + 1) * item_len])
    aux_src = roles.pattern(17 + 99, 8 * aux_len)
    assert np.array_equal(got["aux"][3 * aux_len:4 * aux_len], aux_src[2 * aux_len:3 * aux_len])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_nixl_expanded_two_peers_example(daemons):
    a, b = daemons
    port = _free_port()
    target = Side(roles.nixl_target, b.endpoint, port)
    initiator = Side(roles.nixl_initiator, a.endpoint, "127.0.0.1", port)
    initiator.send(target.recv())
    got = initiator.result()
    assert got["verified"]
    t = target.result()
    assert t["missing_reads"] == [] and t["missing_writes"] == 0
    tail = t["tail"]  # rows 12..15 of the target: one half of each zeroed by the WRITEs
    half = roles.ROW_BYTES // 8
    for i, r in enumerate(range(12, 16)):
        start = got["written"][r] // 4
        assert (tail[i, start:start + half] == 0.0).all() and (np.delete(tail[i], range(start, start + half)) == 1.0).all()


def test_a_killed_peer_ends_in_err_within_the_deadline(tmp_root: Path):
    # The READ must still be in flight when the peer dies. Slow NICs (1 Gbit/s) once held it
    # for ~2 s, which a loaded machine could overrun between "started" and the kill; the
    # emulation's hold gate holds it for sure: while the file exists, each daemon's sends stop
    # after 16 MiB (the 1 MiB warm-up READ passes), so the 256 MiB READ waits for the kill.
    hold = tmp_root / "hold"
    hold.write_text("1\n")
    env = {"TCPXEMU_HOLD_FILE": str(hold)}
    a = start_daemon(tmp_root, "ra", env=env)
    b = start_daemon(tmp_root, "rb", env=env)
    try:
        nbytes = 256 << 20
        prefill = Side(roles.dying_prefill, b.endpoint, nbytes)
        decode = Side(roles.reading_decode, a.endpoint, nbytes, 20.0)
        decode.send(prefill.recv())
        assert decode.recv() == "started"
        # Killed, not stopped: SIGTERM drains, and a READ whose request reached the holder before
        # it then finishes (DONE, rightly; the test passed by luck while the reader's daemon took
        # milliseconds to plan the request and SIGTERM overtook it).
        b.proc.kill()
        b.proc.wait()
        decode.send("killed")
        got = decode.result()
        assert got["first"] == "PROC"
        assert got["state"] == "ERR", got
        assert got["took"] < 20.0, got  # the peer is found gone well before the 20 s deadline
        assert "Unavailable" in got["error"] or "unavailable" in got["error"].lower(), got
        assert got["after"] == "ERR"
        prefill.send("stop")
        prefill.proc.join(10)
    finally:
        hold.unlink(missing_ok=True)
        stop_daemon(a)
        stop_daemon(b)


def _gpus() -> Tuple[int, int]:
    import torch

    return 0, (1 if torch.cuda.device_count() > 1 else 0)


@pytest.mark.gpu
def test_vllm_pull_on_gpu_memory(daemons):
    """The pull replay with both KV caches in GPU memory (vLLM's default), as raw device addresses."""
    a, b = daemons
    dgpu, pgpu = _gpus()
    reqs = [("g-1", [3, 4, 5, 9], [0, 1, 2, 7]), ("g-2", [], []), ("g-3", list(range(16)), list(range(16, 32)))]
    prefill = Side(roles.vllm_prefill_pull, b.endpoint, (4, 32, 16384, "VRAM", pgpu), 7, [r[0] for r in reqs])
    decode = Side(roles.vllm_decode_pull, a.endpoint, (4, 32, 16384, "VRAM", dgpu), 7, reqs)
    decode.send(prefill.recv())
    got = decode.result()
    prefill.send("done")
    assert prefill.result()["notifs"] == {got["agent_name"]: ["g-1:1", "g-2:1", "g-3:1"]}


@pytest.mark.gpu
def test_sglang_on_gpu_memory(daemons):
    """SGLang as it runs: KV in GPU memory, the aux buffers in (shared) host memory."""
    a, b = daemons
    dgpu, pgpu = _gpus()
    layers, pages, item_len, aux_len, room, chunks = 4, 8, 65536, 64, 7, 2
    decode = Side(roles.sglang_decode, a.endpoint, layers, pages, item_len, aux_len, room, chunks, "VRAM", dgpu)
    prefill = Side(roles.sglang_prefill, b.endpoint, layers, pages, item_len, aux_len, room, chunks, 23, "VRAM", pgpu)
    prefill.send(decode.recv())
    pushed = prefill.result()
    assert pushed["states"] == ["DONE"] * (chunks + 1)
    # 64 KiB pages: the block path over the 4 KiB granule lists; the 64-byte aux item, one range:
    # the plain WRITE, its notification in it
    assert pushed["paths"] == ["blocks"] * chunks + ["plain"]
    decode.send("done")
    got = decode.result()
    assert got["received"] == list(range(chunks)) and got["aux_done"]
    for layer in range(layers):
        src = roles.pattern(23 + layer, pages * item_len)
        for sp, dp in enumerate(got["dst_pages"]):
            assert np.array_equal(got["kv"][layer][dp * item_len:(dp + 1) * item_len], src[sp * item_len:(sp + 1) * item_len])
