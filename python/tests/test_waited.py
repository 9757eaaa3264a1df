"""A waited read / write's request written by hand (tcpxd._waited) is byte for byte what protobuf
writes, and what protobuf refuses goes the message way (which names it). No daemon needed."""

import random

import pytest

import tcpxd
from tcpxd import _local, _ops, _proto, _waited
from tcpxd._ops import ReadOp, WriteOp


class Buf:
    """A local buffer as the client's Buffer shows one (an id and a size)."""

    def __init__(self, id: int, size: int):
        self.id = id
        self.size = size


class Remote:
    def __init__(self, descriptor: str):
        self.descriptor = descriptor


def _values(rng: random.Random):
    big = [0, 1, 127, 128, 16383, 16384, 2**21, 2**32 - 1, 2**32, 2**63, 2**64 - 1]
    return rng.choice(big) if rng.random() < 0.5 else rng.randrange(0, 1 << rng.choice((7, 14, 28, 40, 64)))


def test_read_and_write_bodies_are_protobufs_bytes():
    rng = random.Random(23)
    descs = ["", "tcpxd1:b:1:4096:" + "ab" * 16 + "@127.0.0.1:4000", "x" * 300, "nœud-é:1"]
    for _ in range(3000):
        d = rng.choice(descs)
        remote = Remote(d) if rng.random() < 0.5 else d
        local = Buf(_values(rng), rng.randrange(1, 1 << 40)) if rng.random() < 0.8 else _values(rng)
        length = _values(rng) if rng.random() < 0.8 or not isinstance(local, Buf) else None
        roff, loff = _values(rng), _values(rng)
        if length is None and loff > local.size:
            loff = 0
        timeout = rng.choice([None, 0.0005, 1.0, 30.0, 1e6])
        got = _waited.read_body(remote, local, length, roff, loff, timeout)
        want = _ops.read_request(ReadOp(remote, local, length, roff, loff), timeout, True).SerializeToString()
        assert got == want, (remote, local, length, roff, loff, timeout)
        note = rng.choice([b"", b"ready", bytes(range(256)) * 3])
        ev = rng.choice([None, b"\x01" * 64])
        got = _waited.write_body(local, remote, length, loff, roff, note, ev, timeout)
        want = _ops.write_request(WriteOp(local, remote, length, loff, roff), note, ev, timeout, True).SerializeToString()
        assert got == want, (remote, local, length, roff, loff, note, timeout)


def test_the_frame_is_request_frames():
    msg = _proto.message("ReadRequest").FromString(_waited.read_body("d", Buf(3, 4096), None, 0, 0, None))
    for tag in (0, 1, 127, 128, 2**40):
        for field in ("read", "write"):
            req = msg if field == "read" else _proto.message("WriteRequest")()
            body = req.SerializeToString()
            assert _local.body_frame(tag, field, body) == _local.request_frame(tag, field, req)


@pytest.mark.parametrize("bad", [
    dict(roff=-1), dict(loff=-1), dict(length=-5), dict(roff=2**64), dict(length=2**64), dict(roff=1.5),
])
def test_what_protobuf_refuses_is_left_to_the_message(bad):
    roff, loff, length = bad.get("roff", 0), bad.get("loff", 0), bad.get("length", 16)
    assert _waited.read_body("d", Buf(1, 64), length, roff, loff, None) is None
    assert _waited.write_body(Buf(1, 64), "d", length, loff, roff, b"", None, None) is None
    with pytest.raises((ValueError, TypeError)):
        _ops.read_request(ReadOp("d", Buf(1, 64), length, roff, loff), None, True)


def test_a_descriptor_that_is_no_text_is_left_to_the_message():
    assert _waited.read_body("\udc80", Buf(1, 64), 8, 0, 0, None) is None
    with pytest.raises((ValueError, UnicodeError)):
        _ops.read_request(ReadOp("\udc80", Buf(1, 64), 8, 0, 0), None, True)


def test_a_bare_id_without_a_length_is_named_as_before():
    with pytest.raises(tcpxd.InvalidArgument, match="read.length"):
        _waited.read_body("d", 7, None, 0, 0, None)
    with pytest.raises(tcpxd.InvalidArgument, match="write.length"):
        _waited.write_body(7, "d", None, 0, 0, b"", None, None)
