//! Generated code for the API protos and their encoded descriptor set (for reflection).

/// The client API, `tcpxd.v1`.
pub mod v1 {
    #![allow(clippy::all, clippy::pedantic)]
    tonic::include_proto!("tcpxd.v1");
}

/// The daemon-to-daemon protocol, `tcpxd.peer.v1`.
pub mod peer {
    #![allow(clippy::all, clippy::pedantic)]
    tonic::include_proto!("tcpxd.peer.v1");
}

/// The encoded `FileDescriptorSet` of both packages, served by gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/tcpxd_descriptor.bin"));
