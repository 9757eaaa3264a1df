//! tcpxd: move GPU and host buffers between nodes over GPUDirect-TCPX.

pub mod conformance;
pub mod logging;
pub mod net;
