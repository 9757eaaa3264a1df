"""Any gRPC client just works: a stock grpcio channel over the unix socket with default options,
server reflection on v1alpha (Python's ProtoReflectionDescriptorDatabase) and v1, and the package's
shipped descriptor set equal to what the daemon serves."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool

try:
    from google.protobuf.message_factory import GetMessageClass
except ImportError:  # pragma: no cover
    from google.protobuf.message_factory import MessageFactory

    GetMessageClass = MessageFactory().GetPrototype  # type: ignore[assignment]

from tcpxd import _proto


def _reflected_pool(channel: grpc.Channel) -> descriptor_pool.DescriptorPool:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    return descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))


def test_stock_channel_with_default_options_calls_the_daemon(daemons):
    a, _ = daemons
    # No options at all: grpcio sends the socket path as :authority (the daemon's h2 accepts it).
    with grpc.insecure_channel(a.endpoint) as ch:
        Req, Buf = _proto.message("RegisterBufferRequest"), _proto.message("Buffer")
        register = ch.unary_unary(
            "/tcpxd.v1.Tcpxd/RegisterBuffer", request_serializer=Req.SerializeToString, response_deserializer=Buf.FromString
        )
        buf = register(Req(host=_proto.message("HostAllocation")(size=4096), label="stock"), timeout=10)
        assert buf.size == 4096 and buf.descriptor.startswith("tcpxd1:")
        # An error status still comes back as the daemon's status (not a stream reset).
        with pytest.raises(grpc.RpcError) as e:
            register(Req(host=_proto.message("HostAllocation")(size=0)), timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        release = ch.unary_unary("/tcpxd.v1.Tcpxd/ReleaseBuffer", request_serializer=lambda m: m.SerializeToString(), response_deserializer=lambda b: b)
        release(_proto.message("ReleaseBufferRequest")(buffer_id=buf.id), timeout=10)


def test_v1alpha_reflection_client_builds_messages_and_calls(daemons):
    a, _ = daemons
    with grpc.insecure_channel(a.endpoint) as ch:
        pool = _reflected_pool(ch)
        svc = pool.FindServiceByName("tcpxd.v1.Tcpxd")
        assert "RegisterBuffer" in svc.methods_by_name
        m = svc.methods_by_name["ListBuffers"]
        Req, Resp = GetMessageClass(m.input_type), GetMessageClass(m.output_type)
        call = ch.unary_unary("/tcpxd.v1.Tcpxd/ListBuffers", request_serializer=Req.SerializeToString, response_deserializer=Resp.FromString)
        assert isinstance(list(call(Req(), timeout=10).buffers), list)
        # The health service is reflected too.
        assert pool.FindServiceByName("grpc.health.v1.Health").name == "Health"


def test_v1_reflection_lists_the_services(daemons):
    a, _ = daemons
    from grpc_reflection.v1alpha import reflection_pb2  # same messages as v1

    with grpc.insecure_channel(a.endpoint) as ch:
        call = ch.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        answers = list(call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
        names = {s.name for s in answers[0].list_services_response.service}
        assert {"tcpxd.v1.Tcpxd", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"} <= names


def test_shipped_descriptor_set_equals_what_the_daemon_serves(daemons):
    """The package builds its classes from tcpxd_v1.binpb; it must be the daemon's API exactly."""
    a, _ = daemons
    shipped = {
        f.name: f for f in descriptor_pb2.FileDescriptorSet.FromString(_proto.descriptor_set_bytes()).file
    }
    with grpc.insecure_channel(a.endpoint) as ch:
        fd = _reflected_pool(ch).FindFileByName("tcpxd/v1/tcpxd.proto")
    served = descriptor_pb2.FileDescriptorProto()
    fd.CopyToProto(served)
    mine = shipped["tcpxd/v1/tcpxd.proto"]
    mine.ClearField("source_code_info")
    served.ClearField("source_code_info")
    assert mine == served, "python/src/tcpxd/tcpxd_v1.binpb is stale: regenerate it (python/make_descriptor.sh)"
