//! tcpxd: move GPU and host buffers between nodes over GPUDirect-TCPX.

pub mod advertise;
pub mod api;
pub mod auth;
pub mod bench;
pub mod buffers;
pub mod cli;
pub mod client;
pub mod config;
pub mod conformance;
pub mod daemon;
pub mod doctor;
pub mod engine;
pub mod gpu;
pub mod host_fd;
pub mod idle;
pub mod logging;
pub mod metrics;
pub mod net;
pub mod peers;
pub mod poller;
pub mod unpack;
