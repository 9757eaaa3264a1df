"""The README's walk-through, run exactly as written: every block marked `<!-- walkthrough -->` (the
shell blocks and the host-only Python snippet), in document order, in one bash, against the tcpxd
and tcpxctl the test command built (the directory `tcpxd_bin()` picks, put first on PATH as the
README's `export PATH=...` line does for target/release). Fails when a command fails, when the
checksums differ (buffers, and the block lists' round trip), when the notification or the refusal
after the re-key does not show, or when `stats --watch` frames lack their time or differ in columns. Its
temporary directory (TMPDIR for the walk-through's `mktemp -d`) is removed, and every process the
blocks started is stopped, whatever happens."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Tuple

from conftest import ROOT, tcpxd_bin

MARK = "<!-- walkthrough -->"


def walkthrough_blocks(readme: str) -> List[Tuple[str, str]]:
    """(language, code) of each fenced block right after a marker line."""
    blocks = []
    for m in re.finditer(re.escape(MARK) + r"\s*\n```(\w+)\n(.*?)\n```", readme, re.S):
        blocks.append((m.group(1), m.group(2) + "\n"))
    return blocks


def script(blocks: List[Tuple[str, str]]) -> str:
    """One bash script: shell blocks as they are, Python blocks fed to the test's Python."""
    parts = ["set -euo pipefail\n"]
    for i, (lang, code) in enumerate(blocks):
        if lang == "sh":
            parts.append(code)
        elif lang == "python":
            parts.append(f'"$README_PYTHON" - <<\'README_PY_{i}\'\n{code}README_PY_{i}\n')
        else:
            raise AssertionError(f"walk-through block {i} is ```{lang}: only sh and python run")
    return "".join(parts)


def test_the_marked_blocks_are_the_walkthrough():
    blocks = walkthrough_blocks((ROOT / "README.md").read_text())
    langs = [lang for lang, _ in blocks]
    assert langs.count("python") == 1, langs
    assert langs.count("sh") >= 5, langs
    text = "".join(code for _, code in blocks)
    for words in ["tcpxd --node-id a", "buffer register", "write --local", "read --remote", "checksum",
                  "buffer rekey", "subscribe", "write-blocks", "read-blocks", "--remote-indices @",
                  "stats --watch", "register_host"]:
        assert words in text, words
    assert "torch" not in text, "the marked Python snippet is the host-only one"


def test_the_readme_walkthrough_runs_as_written():
    bin_dir = tcpxd_bin().parent
    assert (bin_dir / "tcpxctl").exists(), f"no tcpxctl next to {tcpxd_bin()}: build both (cargo build)"
    code = script(walkthrough_blocks((ROOT / "README.md").read_text()))
    tmp = Path(tempfile.mkdtemp(prefix="tcpxd-readme-"))  # short: unix socket paths fit
    env = {k: v for k, v in os.environ.items() if not k.startswith("TCPXD_") and k != "RUST_LOG"}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", TMPDIR=str(tmp), README_PYTHON=sys.executable)
    log = tmp / "walkthrough.out"
    try:
        # Output to a file, not a pipe: the background daemons hold their copy of it open.
        with open(log, "w") as sink:
            proc = subprocess.Popen(["bash", "-c", code], cwd=ROOT, env=env, stdout=sink,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError(f"the walk-through did not finish within 300 s:\n{log.read_text()}")
        finally:
            # The daemons and the subscriber are in the script's process group: none outlives it.
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        out = log.read_text()
        leftovers = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p != log)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out}"
    crcs = re.findall(r"^crc32c ([0-9a-f]{8})  length 67108864", out, re.M)
    assert len(crcs) == 3 and len(set(crcs)) == 1, f"checksums {crcs}:\n{out}"
    # The block lists' round trip: a's blocks 0-99, and the same blocks back through b.
    block_crcs = re.findall(r"^crc32c ([0-9a-f]{8})  length 1638400", out, re.M)
    assert len(block_crcs) == 2 and len(set(block_crcs)) == 1, f"block checksums {block_crcs}:\n{out}"
    # Every `stats --watch` frame is stamped and has the same columns.
    stamps = re.findall(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC \(every 1s; frame (\d)\)$", out, re.M)
    assert stamps == ["1", "2"], out
    headers = [line for line in out.splitlines() if line.strip().startswith("LANE ")]
    assert len(headers) == 3 and len(set(headers[1:])) == 1 and "KIND" in headers[0], headers
    assert re.search(r"^from a transfer \d+ \(buffers 1\): ready$", out, re.M), out
    assert re.search(r"^tcpxd1:b:1:67108864:[0-9a-f]{32}@127\.0\.0\.1:\d+$", out, re.M), out
    assert "PERMISSION_DENIED" in out and "refused: the old descriptor is dead" in out, out
    assert re.search(r"^transfer \d+: 1048576 bytes$", out, re.M), out
    assert leftovers == [], f"the walk-through's clean-up left {leftovers}"
