//! tcpxd: move GPU and host buffers between nodes over GPUDirect-TCPX.
//!
//! The daemon: the plugin layer (`net`), the GPU data path (`gpu`, `unpack`), the registry
//! (`buffers`), the poller thread that drives the plugin and the engine (`poller`), pairing
//! (`peers`), the gRPC services (`api`, assembled by `daemon`), and `metrics`, `auth`, `config`,
//! `doctor`. The engine and the ABI mirror are crates of their own (docs/ARCHITECTURE.md); the
//! tools (`tcpxctl`) use this crate as a library, never the other way round.

pub mod advertise;
pub mod api;
pub mod auth;
pub mod block_token;
pub mod buffers;
pub mod config;
pub mod cuda_kept;
pub mod daemon;
pub mod doctor;
pub mod fd_keeper;
pub mod fd_store;
pub mod gpu;
pub mod headroom;
pub mod hop_record;
pub mod host_fd;
pub mod host_file;
pub mod idle;
pub mod journal;
pub mod lanes;
pub mod logging;
pub mod metrics;
pub mod net;
pub mod peer_stats;
pub mod peers;
pub mod poller;
pub mod rewound;
pub mod rx_rules;
pub mod sniffing;
pub mod status_watch;
pub mod topology;
pub mod unpack;

/// The transfer state machine (the `tcpxd-engine` crate), under the name the daemon uses.
pub use tcpxd_engine as engine;
