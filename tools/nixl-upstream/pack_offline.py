#!/usr/bin/env python3
"""Packs real NIXL (PyPI `nixl` + `nixl-cuXX`) into a small tarball for a machine with no network.

    tools/nixl-upstream/pack_offline.py --out nixl-site.tar.xz [--version 1.5.1] [--cuda 13]
                                        [--python-version 3.12] [--wheels DIR]

Why: issue #39's comparison (`python -m tcpxd.nixl_compare`, `python -m tcpxd.nixl_registration`)
belongs on the GPU host, which reaches no registry, and NIXL's CUDA wheel is 56 MiB (most of it
storage and cloud plugins: S3, Azure, gRPC for etcd) — more than a device call may carry beside the
binaries. This keeps what NIXL's Python agent needs to move memory over UCX: the `nixl` meta package,
`nixl_cuXX`'s Python modules and bindings, the UCX backend plugin, UCX's TCP, shared-memory (CMA)
and CUDA-copy transports, and every library those load (their ELF `NEEDED` entries, followed inside
the wheel; readelf from binutils). About 8 MiB as `.tar.xz` for 1.5.1.

It fetches the two wheels with pip (`--wheels DIR` uses wheels already downloaded there instead).
On the other machine:

    mkdir -p /tmp/nixlsite && tar -C /tmp/nixlsite -xJf nixl-site.tar.xz
    export PYTHONPATH=/tmp/nixlsite:python/src
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$LD_LIBRARY_PATH    # NIXL's libcudart.so.13
    export UCX_TLS=tcp,cuda_copy    # NIXL refuses UCX_TLS=tcp alone where a GPU is present
    python3 -m tcpxd.nixl_compare --impl both --tcpxd target/release/tcpxd

Nothing of NIXL is committed to this repository; the tarball is built from PyPI where it is used.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Dict, Iterable, List, Set

#: The manylinux tags pip is asked for (pip matches each exactly).
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
]

#: UCX transports kept (loaded by UCX at start from its `ucx/` folder): shared memory by CMA and CUDA
#: copies; TCP is in libuct itself. InfiniBand, EFA and GPUDirect-async modules are left out.
UCX_MODULES = ("libuct_cma.so", "libuct_cuda.so", "libucm_cuda.so")


def download(version: str, cuda: str, python_version: str, dest: Path) -> None:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", python_version, "--implementation", "cp", "-d", str(dest),
    ]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    cmd += [f"nixl=={version}", f"nixl-cu{cuda}=={version}"]
    subprocess.run(cmd, check=True)


def needed(path: Path) -> List[str]:
    """The ELF `NEEDED` entries of one shared object."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True)
    return re.findall(r"\(NEEDED\).*\[(.*)\]", out.stdout)


def closure(tree: Path, start: Iterable[Path]) -> Set[Path]:
    """Every shared object of `tree` that `start` loads, directly or not (by file name, as the
    wheel's `$ORIGIN` run paths find them); names not in the tree are the system's."""
    by_name: Dict[str, List[Path]] = {}
    for p in tree.rglob("*.so*"):
        if p.is_file() and not p.name.endswith(".la"):
            by_name.setdefault(p.name, []).append(p)
    keep: Set[Path] = set()
    todo = list(start)
    while todo:
        p = todo.pop()
        if p in keep:
            continue
        keep.add(p)
        for name in needed(p):
            todo.extend(by_name.get(name, []))
    return keep


def pack(wheels: Path, cuda: str, out: Path) -> None:
    meta = next(wheels.glob("nixl-*-py3-none-any.whl"), None)
    backend = next(wheels.glob(f"nixl_cu{cuda}-*.whl"), None)
    if meta is None or backend is None:
        raise SystemExit(f"{wheels}: needs nixl-*-py3-none-any.whl and nixl_cu{cuda}-*.whl")
    with tempfile.TemporaryDirectory() as tmp:
        src, site = Path(tmp) / "src", Path(tmp) / "site"
        for whl in (meta, backend):
            with zipfile.ZipFile(whl) as z:
                z.extractall(src)
        pkg = src / f"nixl_cu{cuda}"
        starts = list(pkg.glob("_bindings.*.so")) + list(pkg.glob("_utils.*.so"))
        starts += [p for p in src.rglob("libplugin_UCX.so")]
        starts += [p for m in UCX_MODULES for p in src.rglob(m + "*") if not p.name.endswith(".la")]
        if not starts:
            raise SystemExit(f"{backend.name}: no bindings or UCX plugin found")
        files = set(closure(src, starts))
        files |= {p for p in pkg.iterdir() if p.suffix in (".py", ".typed")}
        files |= set((src / "nixl").glob("*.py")) | {src / "nixl_meta_utils.py"}
        for p in sorted(files):
            dst = site / p.relative_to(src)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, dst)
        with tarfile.open(out, "w:xz") as tar:
            for p in sorted(site.rglob("*")):
                tar.add(p, arcname=str(p.relative_to(site)), recursive=False)
        size = sum(p.stat().st_size for p in files)
    print(f"{out}: {len(files)} files, {size / 1e6:.1f} MB unpacked, {out.stat().st_size / 1e6:.1f} MB packed")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--version", default="1.5.1")
    ap.add_argument("--cuda", default="13", help="the CUDA major of the nixl-cuXX wheel")
    ap.add_argument("--python-version", default="3.12", help="the other machine's Python")
    ap.add_argument("--wheels", type=Path, help="wheels already downloaded (no pip)")
    a = ap.parse_args()
    if a.wheels is not None:
        pack(a.wheels, a.cuda, a.out)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        download(a.version, a.cuda, a.python_version, Path(tmp))
        pack(Path(tmp), a.cuda, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
