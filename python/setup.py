"""The package's one native part, tcpxd._native (src/tcpxd/_native.c): optional. Where it cannot
be compiled (no C compiler or no Python headers) the install goes on without it and tcpxd.nixl
uses numpy for the same work; everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("tcpxd._native", ["src/tcpxd/_native.c", "src/tcpxd/_native_lone.c"], optional=True, extra_compile_args=["-O3"])])
