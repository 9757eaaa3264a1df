//! tcpxd: move GPU and host buffers between nodes over GPUDirect-TCPX.

pub mod api;
pub mod conformance;
pub mod engine;
pub mod logging;
pub mod net;
