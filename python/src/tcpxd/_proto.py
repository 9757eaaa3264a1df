"""The API's message classes, built at run time from the descriptor set shipped in the package.

`tcpxd_v1.binpb` is the compiled `proto/tcpxd/v1/tcpxd.proto` (crates/tcpxd/tests/suite/descriptor.rs keeps it in step
with the proto, python/tests/test_interop.py with what the daemon's reflection serves), so no
generated code has to match the installed protobuf runtime.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any, Dict, Type

from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import Descriptor, MethodDescriptor, ServiceDescriptor
from google.protobuf.message import Message

try:  # protobuf >= 4.21
    from google.protobuf.message_factory import GetMessageClass as _get_class
except ImportError:  # pragma: no cover - older protobuf
    from google.protobuf.message_factory import MessageFactory

    _factory = MessageFactory()

    def _get_class(descriptor: Descriptor) -> Type[Message]:
        # GetPrototype: the API of the protobuf this branch serves; protobuf 5 and its stubs dropped it
        return _factory.GetPrototype(descriptor)  # type: ignore[attr-defined]


PACKAGE = "tcpxd.v1"
SERVICE = "tcpxd.v1.Tcpxd"


def descriptor_set_bytes() -> bytes:
    """The serialized FileDescriptorSet shipped in the package."""
    return resources.files("tcpxd").joinpath("tcpxd_v1.binpb").read_bytes()


#: Every message class of the pool, by full name, held for the life of the process. protobuf's
#: upb runtime keeps a dynamic class only in a weak cache: a class that became garbage could be
#: handed out again by that cache while the garbage collector was tearing it down, and the next
#: attribute read crashed the process (SIGSEGV in PyUpb_Descriptor_GetDef, seen under load in
#: `codecs`; protocolbuffers/protobuf#12047 has the same shape). Held here, none ever dies.
_CLASSES: Dict[str, Any] = {}


def _hold_classes(d: Descriptor) -> None:
    _CLASSES[d.full_name] = _get_class(d)
    for nested in d.nested_types:
        _hold_classes(nested)


@functools.lru_cache(maxsize=None)
def _pool() -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()
    for f in descriptor_pb2.FileDescriptorSet.FromString(descriptor_set_bytes()).file:
        pool.Add(f)
    for f in descriptor_pb2.FileDescriptorSet.FromString(descriptor_set_bytes()).file:
        for d in pool.FindFileByName(f.name).message_types_by_name.values():
            _hold_classes(d)
    return pool


def _class(d: Descriptor) -> Any:
    """The class of message type `d`, one of those held for good."""
    _pool()
    c = _CLASSES.get(d.full_name)
    if c is None:  # (not a type of the shipped set: made, and held, now)
        c = _CLASSES[d.full_name] = _get_class(d)
    return c


@functools.lru_cache(maxsize=None)
def message(name: str) -> Any:
    """The class of `tcpxd.v1.<name>` (e.g. `message("WriteRequest")`)."""
    return _class(_pool().FindMessageTypeByName(f"{PACKAGE}.{name}"))


def service() -> ServiceDescriptor:
    return _pool().FindServiceByName(SERVICE)


def has_method(name: str) -> bool:
    return any(m.name == name for m in service().methods)


def method(name: str) -> MethodDescriptor:
    return service().methods_by_name[name]


@functools.lru_cache(maxsize=None)
def has_field(msg: str, field: str) -> bool:
    return field in message(msg).DESCRIPTOR.fields_by_name


def enum_value(enum: str, value: int) -> str:
    """The name of a value of enum `tcpxd.v1.<enum>`."""
    e = _pool().FindEnumTypeByName(f"{PACKAGE}.{enum}")
    v = e.values_by_number.get(value)
    return v.name if v is not None else str(value)


def path(name: str) -> str:
    """The gRPC method path of `name`."""
    return f"/{SERVICE}/{name}"


def codecs(name: str) -> Dict[str, Any]:
    """Serializer and deserializer for the method `name` (grpcio's generic stubs)."""
    m = method(name)
    req, resp = _class(m.input_type), _class(m.output_type)
    return {"request_serializer": req.SerializeToString, "response_deserializer": resp.FromString}
