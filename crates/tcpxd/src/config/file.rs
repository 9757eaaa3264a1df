//! The TOML file's shape (`FileConfig` and its tables): every field optional, unknown keys
//! refused. `Config::load` resolves it with the environment and the flags (`super`).

use std::net::SocketAddr;
use std::path::PathBuf;

use serde::Deserialize;

use super::AutoOrNumber;

/// The TOML file: every field optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub node_id: Option<String>,
    #[serde(default)]
    pub api: FileApi,
    #[serde(default)]
    pub peer: FilePeer,
    #[serde(default)]
    pub plugin: FilePlugin,
    #[serde(default)]
    pub transfer: FileTransfer,
    #[serde(default)]
    pub shutdown: FileShutdown,
    #[serde(default)]
    pub metrics: FileMetrics,
    #[serde(default)]
    pub runtime: FileRuntime,
    #[serde(default)]
    pub topology: FileTopology,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileTopology {
    /// `pci`, `a3vm` or `GPU=NIC[+NIC];…` (`crate::engine::topology::MapSpec`).
    pub map: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileRuntime {
    pub spin: Option<String>,
    pub poller_sessions: Option<String>,
    pub session_thread: Option<String>,
    pub warm_worker: Option<String>,
    pub shared_completions: Option<bool>,
    pub request_ring: Option<bool>,
    pub lane_thread: Option<super::BoolOrWord>,
    pub async_workers: Option<usize>,
    pub state_dir: Option<PathBuf>,
    pub reattach_grace_s: Option<u64>,
    pub fd_keeper: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileMetrics {
    pub listen: Option<SocketAddr>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileApi {
    pub socket: Option<PathBuf>,
    pub socket_mode: Option<String>,
    pub tcp: Option<SocketAddr>,
    pub token_file: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilePeer {
    pub listen: Option<SocketAddr>,
    pub advertise: Option<Vec<String>>,
    pub connect_timeout_s: Option<u64>,
    pub heartbeat_interval_ms: Option<u64>,
    pub heartbeat_timeout_ms: Option<u64>,
    pub lane_idle_close_ms: Option<u64>,
    pub pairing_idle_close_ms: Option<u64>,
    pub direct_control: Option<bool>,
    pub secret_file: Option<PathBuf>,
    pub tls_cert_file: Option<PathBuf>,
    pub tls_key_file: Option<PathBuf>,
    pub tls_ca_file: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilePlugin {
    pub path: Option<PathBuf>,
    pub builtin_emulation: Option<bool>,
    pub lanes_per_device: Option<u32>,
    pub devices: Option<Vec<i32>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileTransfer {
    pub chunk_bytes: Option<u64>,
    pub protocol: Option<String>,
    pub eager_lanes: Option<u32>,
    pub eager_max_bytes: Option<u64>,
    pub gpu_credits: Option<String>,
    pub credit_budget_bytes: Option<u64>,
    pub spread_min_chunk_bytes: Option<u64>,
    pub spread_chunks_per_lane: Option<u32>,
    pub inline_max_bytes: Option<u64>,
    pub inline_window_bytes: Option<u64>,
    pub inline_gpu: Option<String>,
    pub inline_gpu_in_flight: Option<u64>,
    pub unpack_impl: Option<String>,
    /// `kernel-persistent` only: how long the grid waits for a new batch (µs).
    pub unpack_linger_us: Option<u64>,
    /// `kernel-persistent` only: worker blocks (0: one per multiprocessor).
    pub unpack_blocks: Option<u32>,
    pub send_window: Option<usize>,
    /// Block sends gathered ahead of `send_window` per lane (0..=16).
    pub gather_ahead: Option<usize>,
    /// Helper threads for block chunks' host gathers and scatters (0..=64).
    pub host_copy_threads: Option<usize>,
    /// Block receives posted ahead of `recv_window` per lane (0..=16).
    pub scatter_ahead: Option<usize>,
    /// `auto` or µs (0..=100000): the most an idle copy helper spins.
    pub host_copy_spin_us: Option<AutoOrNumber>,
    /// The helpers' policy (config/host_copy.rs): `auto` or 0..=64; plain|prefetch|stream; on|off.
    pub host_copy_spinners: Option<AutoOrNumber>,
    pub host_copy_routine: Option<String>,
    pub host_copy_split: Option<String>,
    /// Block sends from host memory gathered ahead of `send_window` per lane (0..=16).
    pub host_gather_ahead: Option<usize>,
    pub recv_window: Option<usize>,
    pub default_timeout_s: Option<u64>,
    pub max_buffer_bytes: Option<u64>,
    /// Host memory a registration must leave free (`crate::headroom`).
    pub host_memory_reserve_bytes: Option<u64>,
    pub finished_retention_s: Option<u64>,
    pub finished_kept_max: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileShutdown {
    pub grace_s: Option<u64>,
}
