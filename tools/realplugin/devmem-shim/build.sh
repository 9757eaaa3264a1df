#!/usr/bin/env bash
# Builds the devmem shim (devmem_shim.c: the TCPX-era devmem-tcp interface of Google's plugin's
# CUDA path, emulated in user space; LD_PRELOAD it into the process that loads the plugin).
#
#   tools/realplugin/devmem-shim/build.sh [OUT]    (default target/realplugin/lib)
#
# → OUT/libtcpxd-devmem-shim.so. Needs a C compiler (cc) only.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
out="${1:-${REALPLUGIN_OUT:-$repo/target/realplugin}/lib}"
mkdir -p "$out"
# Built beside and renamed over: a running process that has the old one mapped keeps it.
${CC:-cc} -O2 -g -Wall -Wextra -Werror -std=gnu11 -shared -fPIC \
  -o "$out/.libtcpxd-devmem-shim.so.$$" "$here/devmem_shim.c" -ldl -lpthread
mv -f "$out/.libtcpxd-devmem-shim.so.$$" "$out/libtcpxd-devmem-shim.so"
echo "$out/libtcpxd-devmem-shim.so"
