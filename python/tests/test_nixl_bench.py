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
