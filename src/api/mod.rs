//! The gRPC layer: generated code, the client service and the peer service.

pub mod proto;
