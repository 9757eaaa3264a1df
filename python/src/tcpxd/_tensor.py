"""PyTorch tensors as daemon buffers: the tensor's own CUDA memory, shared by IPC handle (no copy)."""

from __future__ import annotations

from typing import Any, Tuple

from .errors import FailedPrecondition, InvalidArgument


def cuda_ipc_view(tensor: Any) -> Tuple[int, bytes, int, int]:
    """(device, 64-byte cudaIpcMemHandle_t of the tensor's allocation, offset of the tensor's bytes
    in that allocation, size in bytes).

    Raises tcpxd.InvalidArgument for a CPU or non-contiguous tensor and tcpxd.FailedPrecondition for
    memory that has no CUDA IPC memory handle (PyTorch's expandable segments)."""
    if not getattr(tensor, "is_cuda", False):
        raise InvalidArgument(
            "tensor: a CPU tensor has no CUDA IPC handle; register a host buffer (Client.register_host) "
            "or move the tensor to the GPU (tensor.cuda())"
        )
    if not tensor.is_contiguous():
        raise InvalidArgument("tensor: not contiguous; register tensor.contiguous() (one byte range)")
    shared = tensor.untyped_storage()._share_cuda_()
    device, handle, storage_offset = int(shared[0]), bytes(shared[1]), int(shared[3])
    offset = storage_offset + tensor.storage_offset() * tensor.element_size()
    return device, ipc_mem_handle(handle), offset, tensor.numel() * tensor.element_size()


def ipc_mem_handle(handle: bytes) -> bytes:
    """The 64-byte cudaIpcMemHandle_t inside PyTorch's shared handle.

    Recent PyTorch prefixes it with a version byte and an allocation-type byte: 'c' for memory from
    cudaMalloc (what tcpxd imports), 'e' for expandable segments (no IPC memory handle)."""
    if len(handle) == 64:
        return handle
    if len(handle) == 66 and handle[1:2] == b"c":
        return handle[2:]
    if len(handle) == 66 and handle[1:2] == b"e":
        raise FailedPrecondition(
            "tensor: its memory is an expandable segment (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), "
            "which has no cudaIpcMemHandle_t; tcpxd imports cudaMalloc memory: turn expandable segments off "
            "for this process, or let the daemon allocate the buffer (Client.allocate_cuda)"
        )
    raise InvalidArgument(f"tensor: unrecognised PyTorch IPC handle ({len(handle)} bytes)")


def ready_event(stream: Any = None) -> Any:
    """A torch.cuda.Event(interprocess=True) recorded on `stream` (default: the current stream):
    pass it as `ready_event=` so the daemon reads the source only after the work queued before it.

    Raises tcpxd.FailedPrecondition without PyTorch: host buffers need no ready event (leave
    `ready_event=` out)."""
    try:
        import torch
    except ImportError as e:
        raise FailedPrecondition(
            f"ready_event: needs PyTorch with CUDA ({e}); it orders a write after GPU work, so a write "
            "from a host buffer (Client.register_host) needs none: leave ready_event= out"
        ) from None

    ev = torch.cuda.Event(interprocess=True)
    ev.record(stream if stream is not None else torch.cuda.current_stream())
    return ev
