"""A small Python client for tcpxd, with no generated code.

Message classes come from tcpxd_v1.binpb (regenerate with ./make_descriptor.sh after changing the
proto); methods are called through grpcio's generic stubs. Endpoints: "unix:/path" or "host:port".
"""

import os

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool

try:  # protobuf >= 4.21
    from google.protobuf.message_factory import GetMessageClass
except ImportError:  # older protobuf
    from google.protobuf.message_factory import MessageFactory

    _factory = MessageFactory()

    def GetMessageClass(desc):  # noqa: N802
        return _factory.GetPrototype(desc)


_HERE = os.path.dirname(os.path.abspath(__file__))
_POOL = descriptor_pool.DescriptorPool()
with open(os.path.join(_HERE, "tcpxd_v1.binpb"), "rb") as f:
    _FDS = descriptor_pb2.FileDescriptorSet.FromString(f.read())
for _file in _FDS.file:
    _POOL.Add(_file)
_SERVICE = _POOL.FindServiceByName("tcpxd.v1.Tcpxd")


def message(name):
    """The class of tcpxd.v1.<name>."""
    return GetMessageClass(_POOL.FindMessageTypeByName("tcpxd.v1." + name))


class Tcpxd:
    """client.Call(**fields) for every unary method; streaming ones return an iterator."""

    def __init__(self, endpoint, timeout=120.0):
        # Over a unix socket grpc-python would send the socket path as the HTTP/2 :authority,
        # which servers built on hyper (tcpxd) reject as malformed: name a plain authority.
        self.channel = grpc.insecure_channel(endpoint, options=[("grpc.default_authority", "localhost")])
        self.timeout = timeout
        for m in _SERVICE.methods:
            req, resp = GetMessageClass(m.input_type), GetMessageClass(m.output_type)
            path = "/tcpxd.v1.Tcpxd/" + m.name
            if m.server_streaming:
                stub = self.channel.unary_stream(path, req.SerializeToString, resp.FromString)
            else:
                stub = self.channel.unary_unary(path, req.SerializeToString, resp.FromString)
            setattr(self, m.name, self._caller(stub, req, m.server_streaming))

    def _caller(self, stub, req, streaming):
        def call(timeout=None, **fields):
            return stub(req(**fields), timeout=None if streaming else (timeout or self.timeout))

        return call

    def close(self):
        self.channel.close()
