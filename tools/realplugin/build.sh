#!/usr/bin/env bash
# Builds Google's TCPX NCCL net plugin (github.com/google/nccl-plugin-gpudirecttcpx) for its host
# path on an ordinary Linux machine without a GPU, CUDA toolkit or nvcc, from checkouts the caller
# points at. Nothing of their source enters this repository: it is copied into the output folder
# and patched there.
#
#   tools/realplugin/build.sh --tcpx-src DIR --nccl-src DIR --cuda-wheels DIR [--out DIR] [--jobs N]
#
#   --tcpx-src     a checkout of google/nccl-plugin-gpudirecttcpx (env TCPX_SRC)
#   --nccl-src     a checkout of NVIDIA/nccl at tag v2.19.3-1 (env NCCL_SRC); only its headers are used
#   --cuda-wheels  a folder holding the nvidia-cuda-runtime-cu12, nvidia-cuda-nvcc-cu12 and
#                  nvidia-cuda-cccl-cu12 wheels (.whl files, or already unpacked) (env CUDA_WHEELS);
#                  only their headers are used. `pip download --no-deps nvidia-cuda-runtime-cu12
#                  nvidia-cuda-nvcc-cu12 nvidia-cuda-cccl-cu12` fetches them (tried: 12.9.x;
#                  12.4's cccl wheels lack nv/target).
#   --out          where everything goes (default target/realplugin; env REALPLUGIN_OUT)
#   --jobs         make's parallelism (default 2)
#
# Needs (Debian 12): cmake g++ protobuf-compiler libprotobuf-dev libabsl-dev libgtest-dev unzip, and
# cargo (for the CUDA stand-in). The result: OUT/lib/libnccl-net.so beside OUT/lib/libcuda.so.1 (the
# stand-in, tools/realplugin/cudastub) and OUT/lib/libtcpxd-devmem-shim.so (devmem-shim/, which
# a3pair.sh preloads); tools/realplugin/run.sh runs things against it.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
tcpx_src="${TCPX_SRC:-}"
nccl_src="${NCCL_SRC:-}"
cuda_wheels="${CUDA_WHEELS:-}"
out="${REALPLUGIN_OUT:-$repo/target/realplugin}"
jobs=2

while [ $# -gt 0 ]; do
  case "$1" in
    --tcpx-src) tcpx_src="$2"; shift 2 ;;
    --nccl-src) nccl_src="$2"; shift 2 ;;
    --cuda-wheels) cuda_wheels="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --jobs) jobs="$2"; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "build.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

die() { echo "build.sh: $*" >&2; exit 1; }
[ -n "$tcpx_src" ] && [ -f "$tcpx_src/src/net_tcpx.cc" ] || die "--tcpx-src must be a checkout of google/nccl-plugin-gpudirecttcpx (no src/net_tcpx.cc in '${tcpx_src}')"
[ -n "$nccl_src" ] && [ -f "$nccl_src/src/nccl.h.in" ] || die "--nccl-src must be a checkout of NVIDIA/nccl (no src/nccl.h.in in '${nccl_src}')"
[ -n "$cuda_wheels" ] && [ -d "$cuda_wheels" ] || die "--cuda-wheels must be a folder with the nvidia-cuda-*-cu12 wheels"
for tool in cmake g++ protoc unzip cargo; do
  command -v "$tool" >/dev/null || die "$tool not found (apt-get install cmake g++ protobuf-compiler libprotobuf-dev libabsl-dev libgtest-dev unzip)"
done
[ -f "$nccl_src/src/device/network/unpack/unpack_defs.h" ] || die "$nccl_src has no src/device/network/unpack/unpack_defs.h: check out tag v2.19.3-1"

mkdir -p "$out"
out="$(cd "$out" && pwd)"
step() { echo "== $*"; }

# 1. NCCL's headers, with nccl.h generated the way NCCL's src/Makefile does.
step "NCCL headers from $nccl_src"
rm -rf "$out/nccl" && mkdir -p "$out/nccl/build/include"
ln -s "$(cd "$nccl_src" && pwd)/src" "$out/nccl/src"
eval "$(sed -n 's/^\(NCCL_[A-Z]*\) *:= *\(.*\)$/\1="\2"/p' "$nccl_src/makefiles/version.mk")"
nccl_version_code="$(printf '%d%02d%02d' "$NCCL_MAJOR" "$NCCL_MINOR" "$NCCL_PATCH")"
sed -e "s/\${nccl:Major}/$NCCL_MAJOR/g" -e "s/\${nccl:Minor}/$NCCL_MINOR/g" \
    -e "s/\${nccl:Patch}/$NCCL_PATCH/g" -e "s/\${nccl:Suffix}/${NCCL_SUFFIX:-}/g" \
    -e "s/\${nccl:Version}/$nccl_version_code/g" \
    "$nccl_src/src/nccl.h.in" > "$out/nccl/build/include/nccl.h"
cp "$nccl_src/src/include/nccl_net.h" "$out/nccl/build/include/"
nccl_version="$NCCL_MAJOR.$NCCL_MINOR.$NCCL_PATCH"

# 2. CUDA headers from the wheels (no toolkit is installed).
step "CUDA headers from $cuda_wheels"
rm -rf "$out/cuda" && mkdir -p "$out/cuda/include" "$out/cuda/wheels"
shopt -s nullglob
for whl in "$cuda_wheels"/nvidia_cuda_{runtime,nvcc,cccl}_cu12-*.whl; do
  unzip -q -o "$whl" 'nvidia/*/include/*' -d "$out/cuda/wheels"
done
shopt -u nullglob
for part in cuda_runtime cuda_nvcc cuda_cccl; do
  inc=""
  for cand in "$out/cuda/wheels/nvidia/$part/include" "$cuda_wheels/nvidia/$part/include"; do
    [ -d "$cand" ] && inc="$cand" && break
  done
  [ -n "$inc" ] || die "no nvidia/$part/include from the nvidia-${part//_/-}-cu12 wheel in $cuda_wheels"
  cp -a "$inc/." "$out/cuda/include/"
done
[ -f "$out/cuda/include/cuda.h" ] && [ -f "$out/cuda/include/cuda_runtime.h" ] || die "cuda.h or cuda_runtime.h missing from the wheels"

# 3. The CUDA stand-in (ours): driver and runtime calls over host memory, soname libcuda.so.1.
step "CUDA stand-in (tools/realplugin/cudastub)"
(cd "$repo" && cargo build --release -q -p tcpxd-cudastub)
mkdir -p "$out/lib"
cp "$repo/target/release/libtcpxd_cudastub.so" "$out/lib/libcuda.so.1"
ln -sf libcuda.so.1 "$out/lib/libcuda.so"
ln -sf libcuda.so.1 "$out/lib/libcudart.so.12"
ln -sf libcuda.so.1 "$out/lib/libcudart.so"
# The devmem shim (ours): the plugin's devmem-tcp and dma-buf interface in user space (a3pair.sh).
"$here/devmem-shim/build.sh" "$out/lib" >/dev/null

# 4. A patched copy of the plugin's source.
step "patching a copy of $tcpx_src"
src="$out/tcpx-src"
rm -rf "$src" && mkdir -p "$src"
(cd "$tcpx_src" && tar --exclude=.git -cf - .) | (cd "$src" && tar -xf -)
top="$src/CMakeLists.txt"
# CMake rejects the C-style licence block at the top of CMakeLists.txt.
if head -1 "$top" | grep -q '^/\*'; then sed -i '1,/\*\//d' "$top"; fi
# protoc rejects the .proto files' `#` licence comments.
sed -i 's|^#|//|' "$src"/src/rx_buf_mgr_client/proto/*.proto
# No nvcc: no CUDA language, no CUDAToolkit package; the .cu files (host code only) compile as C++,
# and CUDA::cuda_driver / CUDA::cudart are the stand-in.
find "$src" -name CMakeLists.txt -print0 | xargs -0 sed -i \
  -e 's/^\( *\)enable_language(CUDA)/\1# tcpxd: no CUDA language/' \
  -e 's/^\( *\)find_package(CUDAToolkit REQUIRED)/\1# tcpxd: no CUDAToolkit/' \
  -e 's|^set(CMAKE_CUDA_COMPILER .*|# tcpxd: no nvcc|'
sed -i "/^project(net-tcpx/a\\
# tcpxd: CUDA headers from the wheels, libraries from the stand-in.\\
set(CMAKE_CUDA_TOOLKIT_INCLUDE_DIRECTORIES $out/cuda/include)\\
add_library(CUDA::cudart INTERFACE IMPORTED GLOBAL)\\
set_target_properties(CUDA::cudart PROPERTIES INTERFACE_LINK_LIBRARIES \"-L$out/lib;-lcuda\")\\
add_library(CUDA::cuda_driver INTERFACE IMPORTED GLOBAL)\\
set_target_properties(CUDA::cuda_driver PROPERTIES INTERFACE_LINK_LIBRARIES \"CUDA::cudart\")" "$top"
for dir in $(find "$src/src" -name '*.cu' -printf '%h\n' | sort -u); do
  cat >> "$dir/CMakeLists.txt" <<'CMAKE'

# tcpxd: the .cu files hold host code only; compile them as C++.
file(GLOB TCPXD_CU_SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/*.cu)
set_source_files_properties(${TCPXD_CU_SOURCES} PROPERTIES LANGUAGE CXX COMPILE_OPTIONS "-xc++")
CMAKE
done
# Debian 12's absl and protobuf have no separate log_internal / utf8 targets.
sed -i -e '/absl::log_internal_/d' -e '/^ *utf8_range$/d' -e '/^ *utf8_validity$/d' \
  "$src/src/rx_buf_mgr_client/proto/CMakeLists.txt"
# std::stringstream without <sstream>.
sed -i '0,/^#include/s//#include <sstream>\n#include/' "$src/src/rx_buf_mgr_client/flow_steer_proto_utils.cc"
# Link the plugin so it finds the stand-in beside it.
echo "set_target_properties(\${NET_GPUDIRECTTCPX_EXPORT}-net PROPERTIES BUILD_RPATH \"\$ORIGIN\" INSTALL_RPATH \"\$ORIGIN\")" >> "$top"

extra_inc=""
if [ ! -f /usr/include/absl/log/check.h ]; then
  # Debian 12's absl (20220623) predates absl/log: CHECK and CHECK_EQ, the two the plugin uses.
  mkdir -p "$out/shim/absl/log"
  cat > "$out/shim/absl/log/check.h" <<'SHIM'
// tcpxd: absl/log/check.h for an absl without absl/log (Debian 12); CHECK and CHECK_EQ only.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <iostream>
namespace tcpxd_check_shim {
struct Fail {
  Fail(const char* file, int line, const char* what) { std::cerr << file << ":" << line << ": CHECK failed: " << what << " "; }
  [[noreturn]] ~Fail() { std::cerr << std::endl; std::abort(); }
  template <typename T> Fail& operator<<(const T& v) { std::cerr << v; return *this; }
};
}  // namespace tcpxd_check_shim
#define CHECK(cond) if (cond) {} else ::tcpxd_check_shim::Fail(__FILE__, __LINE__, #cond)
#define CHECK_EQ(a, b) CHECK((a) == (b))
SHIM
  extra_inc="-I$out/shim"
fi

# 5. Configure and build the plugin only (not its tests).
step "cmake + make -j$jobs (the C++ build takes a while)"
mkdir -p "$out/build"
cmake -S "$src" -B "$out/build" -DCMAKE_BUILD_TYPE=Release \
  -DNCCL_PATH="$out/nccl" -DNCCL_VERSION="$nccl_version" -DNET_GPUDIRECTTCPX_EXPORT=nccl \
  -DCMAKE_CXX_FLAGS="$extra_inc -I$out/cuda/include" >"$out/cmake.log" 2>&1 \
  || { tail -40 "$out/cmake.log"; die "cmake failed (log: $out/cmake.log)"; }
make -C "$out/build" -j"$jobs" nccl-net 2>&1 | tee "$out/make.log" | { grep -E '^\[|error' || true; } \
  || die "make failed (log: $out/make.log)"
cp "$out/build/libnccl-net.so" "$out/lib/libnccl-net.so"

# 6. Every CUDA symbol the plugin needs must come from the stand-in.
missing="$(comm -23 <(nm -D --undefined-only "$out/lib/libnccl-net.so" | awk '{print $2}' | grep -E '^cu' | sed 's/@.*//' | sort -u) \
                    <(nm -D --defined-only "$out/lib/libcuda.so.1" | awk '{print $3}' | sort -u))"
[ -z "$missing" ] || die "the CUDA stand-in lacks: $missing"
echo "built $out/lib/libnccl-net.so (NCCL headers $nccl_version); run things with tools/realplugin/run.sh"
