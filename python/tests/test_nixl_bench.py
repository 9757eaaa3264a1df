"""`python -m tcpxd.nixl_bench` at CI sizes, in a fresh interpreter (it forks its prefill
process): the prefill agent in a process of its own and in this one, the bytes read checked by the
bench itself, its JSON line's fields."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, tcpxd_bin


@pytest.mark.parametrize("where", ["own process", "in process"])
def test_the_bench_reads_vllm_pattern_by_prepared_requests(tmp_path: Path, where: str):
    out = tmp_path / "bench.json"
    args = [sys.executable, "-m", "tcpxd.nixl_bench", "--tcpxd", str(tcpxd_bin()), "--layers", "2", "--blocks", "64",
            "--block-kib", "4", "--req-blocks", "16", "--requests", "3", "--json", str(out)]
    if where == "in process":
        args.append("--peer-in-process")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "python/src"), os.environ.get("PYTHONPATH")])))
    run = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout + run.stderr  # it exits non-zero when the bytes read differ
    assert "page faults; context switches in" in run.stdout
    got = json.loads(out.read_text().splitlines()[-1])
    assert got["path"] == "prepared" and got["parts"] == 1
    assert got["descriptors"] == 2 * 2 * 16 and got["bytes"] == 64 * 4096
    assert got["python_us"] > 0 and got["python_us_small"] > 0 and got["switches"] >= 0
    assert got["make_after_us"] > 0 and got["make_again_us"] > 0 and "made again at once" in run.stdout


def test_the_nixl_comparison_runs_its_script_on_tcpxd(tmp_path: Path):
    """`python -m tcpxd.nixl_compare --impl tcpxd --one-node` at CI sizes: every row measured on
    two daemons and with both agents on one, the bulk transfers' bytes checked by the script
    itself (it fails when they differ)."""
    args = [sys.executable, "-m", "tcpxd.nixl_compare", "--impl", "tcpxd", "--tcpxd", str(tcpxd_bin()), "--mib", "4",
            "--rounds", "1", "--iters", "1", "--small-iters", "5", "--one-node"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "python/src"), os.environ.get("PYTHONPATH")])))
    run = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "tcpxd.nixl, one daemon" in run.stdout.splitlines()[0], run.stdout
    rows = {line.split("  ")[0]: line for line in run.stdout.splitlines()[1:]}
    for want in ("register µs/region", "prep_xfer_dlist µs/desc", "4 MiB READ GB/s", "4 MiB WRITE GB/s",
                 "256 x 16 KiB random READ GB/s", "4 KiB READ p50 µs (tight)", "4 KiB READ p99 µs (sleep(0))",
                 "4 KiB READ p50 µs (tcpxd.Client.read)", "notification round trip p50 µs"):
        assert want in rows, run.stdout
        assert "-" not in rows[want][44:].split(), f"{want}: both columns measured\n{run.stdout}"


def test_the_registration_benchmark_runs_on_tcpxd():
    """`python -m tcpxd.nixl_registration --impl tcpxd` at CI sizes: a row per memory kind, count
    and size, register and deregister, each a positive time a region."""
    args = [sys.executable, "-m", "tcpxd.nixl_registration", "--impl", "tcpxd", "--tcpxd", str(tcpxd_bin()),
            "--rounds", "1", "--counts", "1,3", "--sizes", "64K,1M", "--max-total", "2M", "--state-dir"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "python/src"), os.environ.get("PYTHONPATH")])))
    run = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {line[:44].strip(): line[44:].split() for line in run.stdout.splitlines()[1:]}
    for kind in ("numpy", "memfd"):
        for what in ("1 x 64 KiB", "1 x 1 MiB", "3 x 64 KiB"):
            for op in ("register", "deregister"):
                cells = rows[f"{op} µs/region, {kind} {what}"]
                assert float(cells[0]) > 0, run.stdout
    assert f"{'register µs/region, numpy 3 x 1 MiB':44}" not in run.stdout, "over --max-total: left out"


def test_the_registration_benchmark_times_the_calls_alone_when_warm():
    """`--warm`: register and deregister rows only (no first use between rounds: no "answered"
    or "after use" rows), each a positive time a region."""
    args = [sys.executable, "-m", "tcpxd.nixl_registration", "--impl", "tcpxd", "--tcpxd", str(tcpxd_bin()),
            "--rounds", "1", "--counts", "1", "--sizes", "64K", "--memory", "numpy", "--warm"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "python/src"), os.environ.get("PYTHONPATH")])))
    run = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {line[:44].strip(): line[44:].split() for line in run.stdout.splitlines()[1:]}
    for op in ("register", "deregister"):
        assert float(rows[f"{op} µs/region, numpy 1 x 64 KiB"][0]) > 0, run.stdout
    assert "register, first round µs/region, numpy 1 x 64 KiB" in run.stdout, run.stdout
    assert "answered" not in run.stdout and "after use" not in run.stdout, run.stdout


def test_the_comparison_says_at_once_when_a_role_process_dies() -> None:
    """A role that dies (here: no daemon at its endpoint) ends the round with its exit status, not
    after the 600 s the result may take."""
    import time as _time

    from tcpxd import nixl_compare

    t = _time.monotonic()
    with pytest.raises(RuntimeError, match="exited"):
        nixl_compare.run_once("tcpxd", "unix:/nonexistent/cmp-a.sock", "unix:/nonexistent/cmp-b.sock", 1, 1, 1 << 20)
    assert _time.monotonic() - t < 120


def test_nixl_compare_picks_ucx_tls_for_real_nixl():
    """Session 27: UCX_TLS as set wins; unset, `tcp,cuda_copy` where a GPU is visible (NIXL's UCX
    backend refuses `tcp` alone there), else `tcp`; each choice says why. A CUDA_VISIBLE_DEVICES
    that hides every GPU counts as none."""
    from tcpxd import nixl_compare

    assert nixl_compare.ucx_tls({"UCX_TLS": "tcp,sm"}, gpu=True) == ("tcp,sm", "UCX_TLS as set")
    tls, why = nixl_compare.ucx_tls({}, gpu=True)
    assert tls == "tcp,cuda_copy" and "GPU is visible" in why
    tls, why = nixl_compare.ucx_tls({"UCX_TLS": ""}, gpu=False)
    assert tls == "tcp" and "no GPU" in why
    import os

    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        assert nixl_compare.ucx_tls({})[0] == "tcp"
    finally:
        if old is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old
