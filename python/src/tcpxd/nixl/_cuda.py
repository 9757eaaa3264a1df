"""The CUDA allocation behind a device address, and its IPC handle: how a VRAM region NIXL names by
raw address (as vLLM registers its KV caches) becomes a daemon buffer (CudaIpcImport), through the
CUDA driver API with ctypes (no torch needed)."""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Optional, Tuple

from ._errors import nixlInvalidParamError, nixlNotSupportedError

_CU_POINTER_ATTRIBUTE_CONTEXT = 1
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
_CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12

_lock = threading.Lock()
_lib: Optional[Any] = None


def _driver() -> Any:
    global _lib
    with _lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as e:
                raise nixlNotSupportedError(f"VRAM: no CUDA driver in this process ({e})") from None
            if lib.cuInit(0) != 0:
                raise nixlNotSupportedError("VRAM: cuInit failed: no usable GPU in this process")
            _lib = lib
        return _lib


def _check(what: str, rc: int, addr: int) -> None:
    if rc != 0:
        raise nixlInvalidParamError(f"VRAM address {addr:#x}: {what} failed with CUresult {rc} (not device memory of this process?)")


def allocation(addr: int) -> Tuple[int, int, int, bytes]:
    """(device ordinal, base, size, 64-byte CUipcMemHandle) of the cudaMalloc allocation holding `addr`."""
    lib = _driver()
    ptr = ctypes.c_uint64(addr)
    ordinal = ctypes.c_int(0)
    base = ctypes.c_uint64(0)
    size = ctypes.c_size_t(0)
    ctx = ctypes.c_void_p(0)
    _check("cuPointerGetAttribute(CONTEXT)", lib.cuPointerGetAttribute(ctypes.byref(ctx), _CU_POINTER_ATTRIBUTE_CONTEXT, ptr), addr)
    _check("cuPointerGetAttribute(DEVICE_ORDINAL)", lib.cuPointerGetAttribute(ctypes.byref(ordinal), _CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr), addr)
    _check("cuPointerGetAttribute(RANGE_START_ADDR)", lib.cuPointerGetAttribute(ctypes.byref(base), _CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, ptr), addr)
    _check("cuPointerGetAttribute(RANGE_SIZE)", lib.cuPointerGetAttribute(ctypes.byref(size), _CU_POINTER_ATTRIBUTE_RANGE_SIZE, ptr), addr)
    handle = (ctypes.c_char * 64)()
    _check("cuCtxPushCurrent", lib.cuCtxPushCurrent_v2(ctx), addr)
    try:
        rc = lib.cuIpcGetMemHandle(handle, base)
    finally:
        popped = ctypes.c_void_p(0)
        lib.cuCtxPopCurrent_v2(ctypes.byref(popped))
    if rc != 0:
        raise nixlNotSupportedError(
            f"VRAM address {addr:#x}: cuIpcGetMemHandle failed with CUresult {rc}: the daemon imports cudaMalloc "
            "memory by IPC handle (PyTorch's expandable segments and cuMemCreate/VMM memory have none: run with "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False)"
        )
    return int(ordinal.value), int(base.value), int(size.value), bytes(handle.raw)
