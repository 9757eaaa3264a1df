"""Tensor handle checks that need no GPU."""

import pytest

import tcpxd


class FakeCpuTensor:
    is_cuda = False


def test_ipc_handle_of_expandable_segments_is_refused_clearly():
    # PyTorch's shared handle for an expandable segment: version byte, 'e', then the segment.
    with pytest.raises(tcpxd.FailedPrecondition, match="expandable"):
        tcpxd._tensor.ipc_mem_handle(b"\x01e" + bytes(64))
    assert tcpxd._tensor.ipc_mem_handle(b"\x01c" + bytes(range(64))) == bytes(range(64))


def test_cpu_tensor_is_refused_without_touching_cuda():
    with pytest.raises(tcpxd.InvalidArgument, match="CPU tensor"):
        tcpxd.cuda_ipc_view(FakeCpuTensor())


def test_ready_event_must_be_an_ipc_handle_or_event():
    from tcpxd import _ops

    assert _ops.event_handle(None) == b""
    assert _ops.event_handle(bytes(64)) == bytes(64)
    with pytest.raises(tcpxd.InvalidArgument, match="ready_event"):
        _ops.event_handle(42)
