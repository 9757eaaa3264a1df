"""python/pyproject.toml in the form current setuptools takes without a deprecation warning (CI's
install printed one for `project.license` as a table): the licence an SPDX string, and a
setuptools new enough to read it (77, PEP 639)."""

from __future__ import annotations

import re
import sys

import pytest

from conftest import ROOT


def test_the_license_is_an_spdx_string_and_setuptools_reads_it():
    if sys.version_info < (3, 11):
        pytest.skip("tomllib is Python 3.11's")
    import tomllib

    meta = tomllib.loads((ROOT / "python" / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    (setuptools,) = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    m = re.fullmatch(r"setuptools>=(\d+)", setuptools)
    assert m and int(m.group(1)) >= 77, setuptools
