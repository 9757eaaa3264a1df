"""A waited `read` / `write`'s request encoded by hand, for the local session.

`Client.read` / `Client.write` of one range build a ReadRequest / WriteRequest, and the local
session wraps it in a SessionRequest: two protobuf messages built from keyword arguments, copied
into a third and serialized, ~4.5 µs of the caller's Python on the 2-core build VM (of ~16 µs a
call with the daemon's answer already waiting; docs/BENCHMARKS.md, "Session 23, client-leg").
Here the request's bytes are written directly: the same bytes `SerializeToString` gives
(`python/tests/test_waited.py` compares them), the field keys taken from the package's descriptors
once. A value protobuf would refuse (a negative or too large number, a descriptor that is no
text) gives None: the caller builds the message the usual way, which raises, naming it.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from . import _proto
from ._ops import _length, buffer_id, descriptor, event_handle, timeout_ms

_U64 = 1 << 64


def varint(v: int) -> bytes:
    """The base-128 varint of 0 <= v < 2**64."""
    if v < 0x80:
        return bytes((v,))
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _key(msg: str, field: str, wire: int) -> bytes:
    return varint((_proto.message(msg).DESCRIPTOR.fields_by_name[field].number << 3) | wire)


_KEYS: Optional[Tuple[bytes, ...]] = None


def _keys() -> Tuple[bytes, ...]:
    """The keys of the fields written here, in the order `_read` and `_write` use them."""
    global _KEYS
    if _KEYS is None:
        _KEYS = (
            _key("ReadEntry", "remote_descriptor", 2), _key("ReadEntry", "remote_offset", 0),
            _key("ReadEntry", "local_buffer_id", 0), _key("ReadEntry", "local_offset", 0),
            _key("ReadEntry", "length", 0),
            _key("ReadRequest", "entry", 2), _key("ReadRequest", "timeout_ms", 0), _key("ReadRequest", "wait", 0),
            _key("WriteEntry", "local_buffer_id", 0), _key("WriteEntry", "local_offset", 0),
            _key("WriteEntry", "remote_descriptor", 2), _key("WriteEntry", "remote_offset", 0),
            _key("WriteEntry", "length", 0),
            _key("WriteRequest", "entry", 2), _key("WriteRequest", "notification", 2),
            _key("WriteRequest", "timeout_ms", 0), _key("WriteRequest", "ready_event_ipc_handle", 2),
            _key("WriteRequest", "wait", 0),
        )
    return _KEYS


def _u(key: bytes, v: int) -> bytes:
    """A uint64 field (nothing for 0, as proto3 writes it)."""
    return key + varint(v) if v else b""


def read_body(remote: Any, local: Any, length: Optional[int], remote_offset: int, local_offset: int,
              timeout: Optional[float]) -> Optional[bytes]:
    """`_ops.read_request(ReadOp(...), timeout, wait=True).SerializeToString()`, written directly;
    None where the message path must say what is wrong."""
    k = _KEYS if _KEYS is not None else _keys()
    desc = descriptor(remote)
    lb = buffer_id(local)
    n = _length(length, local, local_offset, "read")
    tmo = timeout_ms(timeout)
    if type(remote_offset) is not int or type(local_offset) is not int:
        return None
    every = remote_offset | lb | local_offset | n | tmo
    if every < 0 or every >= _U64:
        return None
    try:
        d = desc.encode()
    except UnicodeEncodeError:
        return None
    entry = (k[0] + varint(len(d)) + d if d else b"") + _u(k[1], remote_offset) + _u(k[2], lb) \
        + _u(k[3], local_offset) + _u(k[4], n)
    return k[5] + varint(len(entry)) + entry + _u(k[6], tmo) + k[7] + b"\x01"


def write_body(local: Any, remote: Any, length: Optional[int], local_offset: int, remote_offset: int,
               notification: bytes, ready_event: Any, timeout: Optional[float]) -> Optional[bytes]:
    """`_ops.write_request(WriteOp(...), notification, ready_event, timeout, wait=True)
    .SerializeToString()`, written directly; None where the message path must say what is wrong."""
    k = _KEYS if _KEYS is not None else _keys()
    lb = buffer_id(local)
    desc = descriptor(remote)
    n = _length(length, local, local_offset, "write")
    tmo = timeout_ms(timeout)
    note = bytes(notification or b"")
    ev = event_handle(ready_event)
    if type(remote_offset) is not int or type(local_offset) is not int:
        return None
    every = lb | local_offset | remote_offset | n | tmo
    if every < 0 or every >= _U64:
        return None
    try:
        d = desc.encode()
    except UnicodeEncodeError:
        return None
    entry = _u(k[8], lb) + _u(k[9], local_offset) + (k[10] + varint(len(d)) + d if d else b"") \
        + _u(k[11], remote_offset) + _u(k[12], n)
    return (k[13] + varint(len(entry)) + entry + (k[14] + varint(len(note)) + note if note else b"")
            + _u(k[15], tmo) + (k[16] + varint(len(ev)) + ev if ev else b"") + k[17] + b"\x01")
