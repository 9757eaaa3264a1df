//! The daemon's configuration: a TOML file, then the environment, then command-line flags, each
//! overriding the one before (docs/CONFIG.md lists every setting with its default).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use serde::Deserialize;

use crate::idle::Spin;

use crate::engine::plan;
use crate::engine::topology::MapSpec;

pub mod inline;
mod protocol;

mod file;
pub mod host_copy;
pub use file::{
    FileApi, FileConfig, FileMetrics, FilePeer, FilePlugin, FileRuntime, FileShutdown, FileTopology,
    FileTransfer,
};

pub use protocol::{
    DEFAULT_EAGER_LANES, DEFAULT_SPREAD_CHUNKS_PER_LANE, DEFAULT_SPREAD_MIN_CHUNK_BYTES, GpuCredits,
    MAX_CREDIT_BUDGET_BYTES, MAX_EAGER_LANES, MAX_EAGER_MAX_BYTES, ProtocolSettings, TransferProtocol,
};

/// Async workers when spinning (`runtime.async_workers` 0): one kept awake by
/// [`crate::idle::Warmth`], one more for what it leaves waiting. With the one alone, a message
/// the poller handed over while that worker was busy (a NIXL pull's read requests, a burst of
/// offers) waited 120–280 µs for it (hop traces on two H200s, docs/BENCHMARKS.md session 12);
/// with two, 25–120 µs, and the pull's first byte came ~0.5 ms sooner.
pub const SPIN_ASYNC_WORKERS: usize = 2;

/// A setting that is a bool or a word, in the file (`lane_thread = true` or `= "auto"`).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum BoolOrWord {
    Bool(bool),
    Word(String),
}

/// A setting that is `"auto"` or a number, in the file (`host_copy_spin_us = "auto"` or `= 50`);
/// a flag or variable gives it as a word.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum AutoOrNumber {
    Number(u64),
    Word(String),
}

impl AutoOrNumber {
    /// `None` for auto, else the number, at most `max`; an error names `what` and the limit.
    pub fn resolve(&self, what: &str, max: u64) -> Result<Option<u64>, String> {
        let n = match self {
            AutoOrNumber::Word(w) if w.trim() == "auto" => return Ok(None),
            AutoOrNumber::Word(w) => w
                .trim()
                .parse::<u64>()
                .map_err(|_| format!("{what}: {w:?} is neither auto nor a number (0 to {max})"))?,
            AutoOrNumber::Number(n) => *n,
        };
        if n > max {
            return Err(format!("{what}: {n} (0 to {max} allowed, or auto)"));
        }
        Ok(Some(n))
    }
}

/// Where a setting may come from, highest precedence last.
#[derive(Debug, Clone, Default, Args)]
pub struct DaemonArgs {
    /// TOML configuration file. Default: none.
    #[arg(long, env = "TCPXD_CONFIG", value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// This node's id (letters, digits, '.', '_', '-'; unique in the cluster). Default: hostname.
    #[arg(long, env = "TCPXD_NODE_ID")]
    pub node_id: Option<String>,
    /// Unix socket of the client API; missing directories on its path are created, a stale
    /// socket is replaced, a live daemon's is refused. Default: /run/tcpxd/tcpxd.sock.
    #[arg(long, env = "TCPXD_API_SOCKET", value_name = "PATH")]
    pub api_socket: Option<PathBuf>,
    /// TCP address of the client API (e.g. 127.0.0.1:50051); needs --api-token-file. Default:
    /// off.
    #[arg(long, env = "TCPXD_API_TCP", value_name = "ADDR")]
    pub api_tcp: Option<SocketAddr>,
    /// File holding the bearer token the client API's TCP listener requires (16+ bytes).
    /// Default: none.
    #[arg(long, env = "TCPXD_API_TOKEN_FILE", value_name = "PATH")]
    pub api_token_file: Option<PathBuf>,
    /// File holding the cluster secret peers prove to each other (16+ bytes; same on every
    /// node). Default: none (peers are not authenticated; a warning at start-up).
    #[arg(long, env = "TCPXD_PEER_SECRET_FILE", value_name = "PATH")]
    pub peer_secret_file: Option<PathBuf>,
    /// TCP address of the peer service (port 0: any free port; descriptors carry the bound
    /// one). Default: 0.0.0.0:50052.
    #[arg(long, env = "TCPXD_PEER_LISTEN", value_name = "ADDR")]
    pub peer_listen: Option<SocketAddr>,
    /// Where other nodes reach the peer service, host:port (repeat, or comma-separate, for
    /// several); descriptors carry it. Default: the --peer-listen address (for a wildcard one,
    /// the hostname's non-loopback addresses).
    #[arg(
        long,
        env = "TCPXD_PEER_ADVERTISE",
        value_name = "HOST:PORT",
        value_delimiter = ','
    )]
    pub peer_advertise: Vec<String>,
    /// The TCPX net plugin (libnccl-net.so). Default: /usr/local/tcpx/lib64/libnccl-net.so.
    #[arg(long, env = "TCPXD_PLUGIN", value_name = "PATH")]
    pub plugin: Option<PathBuf>,
    /// Use the emulation plugin linked into tcpxd instead of a plugin file (tests, demos).
    /// Default: off.
    #[arg(long, env = "TCPXD_BUILTIN_EMULATION")]
    pub builtin_emulation: bool,
    /// Data lanes per plugin device, in each direction of each peer (1..=16; under `auto` the
    /// rendezvous lanes, the eager ones come on top). Default: 2.
    #[arg(long, env = "TCPXD_LANES_PER_DEVICE")]
    pub lanes_per_device: Option<u32>,
    /// Chunk size of transfers this node sends (4096..=4194304). Also read from
    /// UCCL_TCPX_CHUNK_BYTES, then NCCL_P2P_NET_CHUNKSIZE. Default: 524288.
    #[arg(long, env = "TCPXD_CHUNK_BYTES")]
    pub chunk_bytes: Option<u64>,
    /// How this node receives: `eager` (receive credits kept posted; a WRITE's data follows its
    /// header with no round trip), `rendezvous` (offer, accept, then the data) or `auto` (eager
    /// lanes for small transfers, rendezvous lanes for large ones, chosen per transfer). Senders
    /// follow the receiver's choice. Default: auto.
    #[arg(long, env = "TCPXD_TRANSFER_PROTOCOL", value_name = "eager|rendezvous|auto")]
    pub transfer_protocol: Option<String>,
    /// `auto`: eager lanes per plugin device, opened in addition to the rendezvous lanes (1..=4).
    /// Default: 1.
    #[arg(long, env = "TCPXD_EAGER_LANES")]
    pub eager_lanes: Option<u32>,
    /// `auto`: transfers of at most this many bytes towards this node go eager (1..=1073741824).
    /// Default: 65536.
    #[arg(long, env = "TCPXD_EAGER_MAX_BYTES")]
    pub eager_max_bytes: Option<u64>,
    /// `auto`: post credit receives into GPU memory, so transfers into this node's GPU buffers
    /// take credits at any size, with no offer/accept round trip: `auto` (on when the node has a
    /// GPU), `on`, `off`. Default: auto.
    #[arg(long, env = "TCPXD_GPU_CREDITS", value_name = "auto|on|off")]
    pub gpu_credits: Option<String>,
    /// With GPU credits: bytes of un-consumed chunks a sender may have per credit lane
    /// (4096..=4294967296). Default: 33554432 (32 MiB).
    #[arg(long, env = "TCPXD_CREDIT_BUDGET_BYTES")]
    pub credit_budget_bytes: Option<u64>,
    /// A plain transfer of fewer than two chunks per lane is cut into smaller chunks, halved
    /// down to no less than this (0: off, else 4096..=4194304). Default: 0.
    #[arg(long, env = "TCPXD_SPREAD_MIN_CHUNK_BYTES")]
    pub spread_min_chunk_bytes: Option<u64>,
    /// Chunks per lane a spread transfer aims at (1..=16): 1 MiB over two lanes is four chunks
    /// of 256 KiB at 2, eight of 128 KiB at 4. Default: 2.
    #[arg(long, env = "TCPXD_SPREAD_CHUNKS_PER_LANE")]
    pub spread_chunks_per_lane: Option<u32>,
    #[command(flatten)]
    pub inline: inline::InlineArgs,
    /// Whether the poller and one async worker keep polling between transfers while traffic
    /// flows: `auto` (on with 8 or more CPUs), `on`, `off` (docs/CONFIG.md, `runtime.spin`).
    /// Default: auto.
    #[arg(long, env = "TCPXD_SPIN", value_name = "auto|on|off")]
    pub spin: Option<String>,
    /// Whether the poller thread reads and starts the framed local sessions' requests itself:
    /// `auto` (on), `on`, `off` (docs/CONFIG.md, `runtime.poller_sessions`).
    /// Default: auto.
    #[arg(long, env = "TCPXD_POLLER_SESSIONS", value_name = "auto|on|off")]
    pub poller_sessions: Option<String>,
    /// Whether the framed local sessions the poller would serve are served on a thread of their
    /// own (`tcpxd-sessions`): `auto` (as `--spin`), `on`, `off` (docs/CONFIG.md,
    /// `runtime.session_thread`). Default: auto.
    #[arg(long, env = "TCPXD_SESSION_THREAD", value_name = "auto|on|off")]
    pub session_thread: Option<String>,
    /// With `--spin` on, whether one async worker is kept awake polling while traffic flows too
    /// (`runtime.warm_worker`): `auto` (on), `on`, `off` (docs/CONFIG.md). Default: auto.
    #[arg(long, env = "TCPXD_WARM_WORKER", value_name = "auto|on|off")]
    pub warm_worker: Option<String>,
    /// Whether framed local sessions may attach a completion board (`runtime.shared_completions`):
    /// `on` or `off` (docs/CONFIG.md). Default: on.
    #[arg(long, env = "TCPXD_SHARED_COMPLETIONS", value_name = "on|off")]
    pub shared_completions: Option<String>,
    /// Whether framed local sessions may attach a request ring (`runtime.request_ring`): `on` or
    /// `off` (docs/CONFIG.md). Default: on.
    #[arg(long, env = "TCPXD_REQUEST_RING", value_name = "on|off")]
    pub request_ring: Option<String>,
    /// Whether the lanes' plugin calls (send and receive) run on lane threads of their own
    /// (`tcpxd-lanes-<gpu>`) rather than the poller's (`runtime.lane_thread`): `on`, `off` or
    /// `auto` (as `runtime.spin`; docs/CONFIG.md). Default: off.
    #[arg(long, env = "TCPXD_LANE_THREAD", value_name = "auto|on|off")]
    pub lane_thread: Option<String>,
    /// Helper threads for block chunks' host gathers and scatters (`transfer.host_copy_threads`;
    /// 0: the poller copies alone). Default: none below 4 CPUs, else half of them, at most 8.
    #[arg(long, env = "TCPXD_HOST_COPY_THREADS")]
    pub host_copy_threads: Option<usize>,
    /// Block receives posted ahead of `recv_window` per lane (`transfer.scatter_ahead`, 0..=16):
    /// those that land in a host landing slot give their plugin slot back while their scatter
    /// runs on a copy helper. Default: 8.
    #[arg(long, env = "TCPXD_SCATTER_AHEAD")]
    pub scatter_ahead: Option<usize>,
    /// Block sends gathered ahead of `send_window` per lane (`transfer.gather_ahead`, 0..=16).
    /// Default: 0.
    #[arg(long, env = "TCPXD_GATHER_AHEAD")]
    pub gather_ahead: Option<usize>,
    /// The most an idle host copy helper spins for its next chunk before it sleeps, in µs
    /// (`transfer.host_copy_spin_us`: 0..=100000, or `auto`: 200 where `runtime.spin` is on, else
    /// 0); a helper spins only while its recent chunks came that close together. Default: auto.
    #[arg(long, env = "TCPXD_HOST_COPY_SPIN_US", value_name = "auto|MICROSECONDS")]
    pub host_copy_spin_us: Option<String>,
    #[command(flatten)]
    pub host_copy: host_copy::HostCopyArgs,
    /// Async worker threads (0: two when spinning, else one per CPU). Default: 0.
    #[arg(long, env = "TCPXD_ASYNC_WORKERS")]
    pub async_workers: Option<usize>,
    /// Keep registrations across restarts in this directory (a tmpfs such as /run/tcpxd/state;
    /// created 0700). Default: none (nothing outlives the process).
    #[arg(long, env = "TCPXD_STATE_DIR", value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// The socket of a `tcpxd fd-keeper` that keeps daemon-allocated CUDA memory's fds across
    /// restarts where systemd does not (GKE, plain runs). Default: none (systemd's store if any).
    #[arg(long, env = "TCPXD_FD_KEEPER", value_name = "PATH")]
    pub fd_keeper: Option<PathBuf>,
    /// Transfer deadline in seconds, when a request carries none. Default: 600.
    #[arg(long, env = "TCPXD_DEFAULT_TIMEOUT_S")]
    pub default_timeout_s: Option<u64>,
    /// Seconds SIGTERM waits for in-flight transfers before failing them. Default: 30.
    #[arg(long, env = "TCPXD_SHUTDOWN_GRACE_S")]
    pub shutdown_grace_s: Option<u64>,
    /// Serve Prometheus metrics over HTTP at this address (GET /metrics). Default: off.
    #[arg(long, env = "TCPXD_METRICS_LISTEN", value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,
    /// Write a JSON file with the node id and bound addresses once serving. Default: none.
    #[arg(long, env = "TCPXD_READY_FILE", value_name = "PATH")]
    pub ready_file: Option<PathBuf>,
    /// Each GPU's NIC(s): `pci` (PCI distance), `a3vm` (RxDM's preset) or `GPU=NIC[+NIC];…`
    /// (GPU: ordinal or PCI bus id; NIC: device name or index). Default: pci.
    #[arg(long, env = "TCPXD_TOPOLOGY", value_name = "pci|a3vm|GPU=NIC;…")]
    pub topology: Option<String>,
    /// Milliseconds a lane towards a peer may stay idle before both sides close it (it opens
    /// again on its next transfer); 0: never. Default: 120000.
    #[arg(long, env = "TCPXD_LANE_IDLE_CLOSE_MS", value_name = "MS")]
    pub lane_idle_close_ms: Option<u64>,
    /// Milliseconds a pairing may have nothing on it before both sides close it (control stream,
    /// heartbeats and all; the next use pairs again); 0: never. Default: 300000.
    #[arg(long, env = "TCPXD_PAIRING_IDLE_CLOSE_MS", value_name = "MS")]
    pub pairing_idle_close_ms: Option<u64>,
    /// Carry a pairing's engine messages on a direct control connection the pollers write and
    /// read themselves, not on the HTTP/2 control stream (`peer.direct_control`): `on` or
    /// `off`. Off by itself under mutual TLS. Default: on.
    #[arg(long, env = "TCPXD_DIRECT_CONTROL", value_name = "on|off")]
    pub direct_control: Option<String>,
}

/// Which plugin to drive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PluginChoice {
    Path(PathBuf),
    BuiltinEmulation,
}

/// The resolved configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub node_id: String,
    pub api_socket: PathBuf,
    pub api_socket_mode: u32,
    pub api_tcp: Option<SocketAddr>,
    /// The bearer token's file (the token itself is read at start-up, never kept here).
    pub api_token_file: Option<PathBuf>,
    pub peer_listen: SocketAddr,
    /// `peer.advertise`: the peer addresses descriptors carry (checked); empty: derived from
    /// the bound peer address at start-up (`advertise::advertised`).
    pub peer_advertise: Vec<String>,
    /// The cluster secret's file; `None`: peers are not authenticated by a secret.
    pub peer_secret_file: Option<PathBuf>,
    /// Mutual TLS on the peer service: (certificate, key, CA) PEM files.
    pub peer_tls: Option<(PathBuf, PathBuf, PathBuf)>,
    pub peer_connect_timeout: Duration,
    pub heartbeat_interval: Duration,
    pub heartbeat_timeout: Duration,
    /// `peer.lane_idle_close_ms`: an idle lane closes after this long (`None`: never).
    pub lane_idle_close: Option<Duration>,
    /// `peer.pairing_idle_close_ms`: an idle pairing closes after this long (`None`: never).
    pub pairing_idle_close: Option<Duration>,
    /// `peer.direct_control`: pairings carry engine messages on a direct control connection
    /// (docs/ARCHITECTURE.md, "The direct control connection"); never under mutual TLS.
    pub direct_control: bool,
    pub plugin: PluginChoice,
    pub lanes_per_device: u32,
    pub devices: Option<Vec<i32>>,
    pub chunk_bytes: u32,
    /// How this node receives (`transfer.protocol`).
    pub protocol: TransferProtocol,
    /// `auto`: eager lanes per device (`transfer.eager_lanes`).
    pub eager_lanes: u32,
    /// `auto`: the largest transfer sent to this node eagerly (`transfer.eager_max_bytes`).
    pub eager_max_bytes: u64,
    /// `auto`: credit receives in GPU memory (`transfer.gpu_credits`), resolved against the
    /// node's GPUs at start.
    pub gpu_credits: crate::config::GpuCredits,
    /// `transfer.credit_budget_bytes`.
    pub credit_budget_bytes: u64,
    /// `transfer.spread_min_chunk_bytes` (0: off).
    pub spread_min_chunk_bytes: u32,
    /// `transfer.spread_chunks_per_lane`.
    pub spread_chunks_per_lane: u32,
    /// `transfer.inline_*`.
    pub inline: inline::InlineSettings,
    pub unpack_impl: crate::unpack::UnpackImpl,
    pub send_window: usize,
    /// Block sends gathered ahead of `send_window` per lane (`transfer.gather_ahead`); each
    /// send lane's staging ring has `send_window + gather_ahead` slots of `chunk_bytes`.
    pub gather_ahead: usize,
    /// Block receives posted ahead of `recv_window` per lane (`transfer.scatter_ahead`): each
    /// receive lane's host landing ring has `recv_window + scatter_ahead` slots.
    pub scatter_ahead: usize,
    /// Helper threads splitting block chunks' host gathers and scatters with the poller
    /// (`transfer.host_copy_threads`; 0: the poller copies alone).
    pub host_copy_threads: usize,
    /// How long idle copy helpers may spin (`transfer.host_copy_spin_us`).
    pub host_copy_spin: crate::net::host_copies::HelperSpin,
    /// The helpers' policy: `host_copy_spin`, and `transfer.host_copy_{spinners,routine,split}`.
    pub host_copy: crate::net::host_copies::HelperPolicy,
    /// Block sends from host memory gathered ahead of `send_window` per lane
    /// (`transfer.host_gather_ahead`); each send lane's host staging ring has `send_window +
    /// host_gather_ahead` slots.
    pub host_gather_ahead: usize,
    pub recv_window: usize,
    pub default_timeout: Duration,
    pub max_buffer_bytes: u64,
    /// Host memory a registration must leave free (`transfer.host_memory_reserve_bytes`).
    pub host_memory_reserve: u64,
    pub finished_retention: Duration,
    /// At most this many transfers kept for `Watch`/`WaitTransfer` (`transfer.finished_kept_max`).
    pub finished_kept_max: usize,
    pub shutdown_grace: Duration,
    pub ready_file: Option<PathBuf>,
    /// Where the Prometheus endpoint listens; `None`: no endpoint.
    pub metrics_listen: Option<SocketAddr>,
    /// Whether the poller lingers and an async worker stays awake while traffic flows (resolved:
    /// `auto` is decided here).
    pub spin: bool,
    /// Whether the poller reads the framed sessions' requests (resolved: `auto` is `!spin`).
    pub poller_sessions: bool,
    /// Whether those sessions are served on a thread of their own instead (resolved; only with
    /// `poller_sessions`).
    pub session_thread: bool,
    /// Whether an async worker is kept awake while traffic flows (`crate::idle::Warmth`'s task;
    /// resolved: only with `spin`).
    pub warm_worker: bool,
    /// Whether framed sessions may attach a completion board (src/api/local/board.rs).
    pub shared_completions: bool,
    /// Whether framed sessions may attach a request ring (src/api/local/ring.rs).
    pub request_ring: bool,
    /// Whether the lanes' comms (send and receive) are driven by lane threads
    /// (`runtime.lane_thread`, `poller/lane_thread.rs`).
    pub lane_thread: bool,
    /// Async worker threads for the runtime (resolved: never 0).
    pub async_workers: usize,
    /// Each GPU's NIC(s) (`topology.map`): checked against the GPUs and devices at start-up.
    pub topology: MapSpec,
    /// Where registrations outlive the process (`runtime.state_dir`); `None`: nowhere.
    pub state_dir: Option<PathBuf>,
    /// A `tcpxd fd-keeper`'s socket (`runtime.fd_keeper`): where CUDA memory's fds are kept.
    pub fd_keeper: Option<PathBuf>,
    /// How long a restarted daemon keeps its previous instance's registrations for their
    /// clients to re-attach (`runtime.reattach_grace_s`).
    pub reattach_grace: Duration,
}

pub const DEFAULT_API_SOCKET: &str = "/run/tcpxd/tcpxd.sock";
pub const DEFAULT_PEER_LISTEN: &str = "0.0.0.0:50052";
pub const DEFAULT_PLUGIN: &str = "/usr/local/tcpx/lib64/libnccl-net.so";
/// `transfer.gather_ahead` at most: a window's worth beyond the plugin's 16 request slots.
pub const MAX_GATHER_AHEAD: usize = 16;
/// `transfer.scatter_ahead` at most, and its default: block receives that landed in a host
/// landing slot give their plugin slot back before their scatter is over, so up to this many
/// more are posted behind them (docs/BLOCKS.md, "Receiving into host memory").
pub const MAX_SCATTER_AHEAD: usize = 16;
pub const DEFAULT_SCATTER_AHEAD: usize = 8;
/// A quiet control stream sends a heartbeat this often.
pub const DEFAULT_HEARTBEAT_INTERVAL_MS: u64 = 500;
/// A control stream silent this long fails its peer: the bound on noticing a dead peer.
pub const DEFAULT_HEARTBEAT_TIMEOUT_MS: u64 = 3000;
/// An idle lane closes after two minutes: reopening costs a listen, a connect and, on the real
/// plugin, its flow-steering wait (0.5-5 s), so only lanes unused for long give their threads back.
pub const DEFAULT_LANE_IDLE_CLOSE_MS: u64 = 120_000;
/// An idle pairing closes after five minutes: past the lanes' two, so a peer that talks every
/// few minutes keeps it, while the next use of one silent for longer pays only a handshake (a
/// round trip, two with a cluster secret, plus TLS's when configured: milliseconds on a LAN),
/// against heartbeats forever (each idle pairing ~0.02% of a core with the default 500 ms ones,
/// 64 peers 1.3%: docs/BENCHMARKS.md, "Idle daemon").
pub const DEFAULT_PAIRING_IDLE_CLOSE_MS: u64 = 300_000;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{0}")]
    Invalid(String),
}

/// Where the chunk size comes from: `UCCL_TCPX_CHUNK_BYTES`, else `NCCL_P2P_NET_CHUNKSIZE`, else
/// the default; the value must lie in the engine's `MIN_CHUNK_BYTES..=MAX_CHUNK_BYTES`.
pub fn chunk_bytes_from_env(
    uccl_tcpx_chunk_bytes: Option<&str>,
    nccl_p2p_net_chunksize: Option<&str>,
) -> Result<u32, String> {
    let (name, value) = match (uccl_tcpx_chunk_bytes, nccl_p2p_net_chunksize) {
        (Some(v), _) => ("UCCL_TCPX_CHUNK_BYTES", v),
        (None, Some(v)) => ("NCCL_P2P_NET_CHUNKSIZE", v),
        (None, None) => return Ok(plan::DEFAULT_CHUNK_BYTES),
    };
    let parsed: u64 = value
        .trim()
        .parse()
        .map_err(|_| format!("{name}={value:?} is not a number of bytes"))?;
    plan::check_chunk_bytes(parsed).map_err(|e| format!("{name}: {e}"))
}

/// The environment variables a setting falls back to, as a lookup function (tests pass a map).
pub type EnvLookup<'a> = &'a dyn Fn(&str) -> Option<String>;

impl Config {
    /// Resolves file < environment < flags. `args` already merges flags over their `TCPXD_*`
    /// variables (clap); `env` is consulted for the UCCL/NCCL chunk-size variables.
    pub fn resolve(args: &DaemonArgs, env: EnvLookup<'_>) -> Result<Config, ConfigError> {
        let file = match &args.config {
            Some(path) => load_file(path)?,
            None => FileConfig::default(),
        };
        let node_id = args
            .node_id
            .clone()
            .or(file.node_id)
            .or_else(|| hostname().ok())
            .ok_or_else(|| ConfigError::Invalid("node_id: not set and the hostname is unreadable".into()))?;
        check_node_id(&node_id)?;
        let plugin = if args.builtin_emulation
            || (file.plugin.builtin_emulation == Some(true) && args.plugin.is_none())
        {
            PluginChoice::BuiltinEmulation
        } else {
            PluginChoice::Path(
                args.plugin
                    .clone()
                    .or(file.plugin.path)
                    .unwrap_or_else(|| PathBuf::from(DEFAULT_PLUGIN)),
            )
        };
        let chunk_bytes = match args.chunk_bytes {
            Some(v) => {
                plan::check_chunk_bytes(v).map_err(|e| ConfigError::Invalid(format!("--chunk-bytes: {e}")))?
            }
            None => {
                let from_env =
                    env("UCCL_TCPX_CHUNK_BYTES").is_some() || env("NCCL_P2P_NET_CHUNKSIZE").is_some();
                match (from_env, file.transfer.chunk_bytes) {
                    (false, Some(v)) => plan::check_chunk_bytes(v)
                        .map_err(|e| ConfigError::Invalid(format!("transfer.chunk_bytes: {e}")))?,
                    _ => chunk_bytes_from_env(
                        env("UCCL_TCPX_CHUNK_BYTES").as_deref(),
                        env("NCCL_P2P_NET_CHUNKSIZE").as_deref(),
                    )
                    .map_err(ConfigError::Invalid)?,
                }
            }
        };
        let lanes_per_device = args
            .lanes_per_device
            .or(file.plugin.lanes_per_device)
            .unwrap_or(2);
        if !(1..=16).contains(&lanes_per_device) {
            return Err(ConfigError::Invalid(format!(
                "lanes_per_device: {lanes_per_device} is outside 1..=16"
            )));
        }
        // The environment beats the file, setting by setting.
        let unpack_impl = {
            use crate::unpack::{PERSIST_BLOCKS_ENV, PERSIST_LINGER_ENV, UNPACK_IMPL_ENV, UnpackImpl};
            let t = &file.transfer;
            UnpackImpl::from_lookup(|k| {
                env(k).or_else(|| match k {
                    UNPACK_IMPL_ENV => t.unpack_impl.clone(),
                    PERSIST_LINGER_ENV => t.unpack_linger_us.map(|v| v.to_string()),
                    PERSIST_BLOCKS_ENV => t.unpack_blocks.map(|v| v.to_string()),
                    _ => None,
                })
            })
            .map_err(|e| {
                ConfigError::Invalid(format!(
                    "UCCL_TCPX_UNPACK_IMPL / transfer.unpack_impl (unpack_linger_us, unpack_blocks): {e}"
                ))
            })?
        };
        let protocol = protocol::resolve(args, &file.transfer)?;
        let inline = inline::resolve(&args.inline, &file.transfer)?;
        let spin = match (&args.spin, &file.runtime.spin) {
            (Some(v), _) => Spin::parse("--spin", v).map_err(ConfigError::Invalid)?,
            (None, Some(v)) => Spin::parse("runtime.spin", v).map_err(ConfigError::Invalid)?,
            (None, None) => Spin::Auto,
        }
        .resolve(crate::idle::cpus());
        let poller_sessions = match (&args.poller_sessions, &file.runtime.poller_sessions) {
            (Some(v), _) => Spin::parse("--poller-sessions", v).map_err(ConfigError::Invalid)?,
            (None, Some(v)) => Spin::parse("runtime.poller_sessions", v).map_err(ConfigError::Invalid)?,
            (None, None) => Spin::Auto,
        };
        // `auto` is on, spinning or not. Without spinning the poller parks in `epoll_wait`; with
        // the sessions in its set a request wakes it directly instead of a runtime worker that
        // then wakes it (2-core VM: p50 0.79-0.99x). Where it spins (the H200 hosts), a ring's
        // request is started in the pass that sees it instead of crossing to a runtime worker
        // and back: the round trip 0.85-0.95x, the 4 KiB tight READ 0.85-0.93x, WRITE
        // 0.83-1.03x (docs/BENCHMARKS.md, sessions 27 and 28; session 24, before the ring, had
        // seen no gain).
        let poller_sessions = match poller_sessions {
            Spin::Auto => true,
            s => s.resolve(0),
        };
        let session_thread = match (&args.session_thread, &file.runtime.session_thread) {
            (Some(v), _) => Spin::parse("--session-thread", v).map_err(ConfigError::Invalid)?,
            (None, Some(v)) => Spin::parse("runtime.session_thread", v).map_err(ConfigError::Invalid)?,
            (None, None) => Spin::Auto,
        };
        // `auto` is as `runtime.spin`: where the threads spin (8 CPUs or more) the sessions
        // thread takes the requests' reads, checks, answers and writes off the poller; where
        // they park, the hop between the two threads is one more wake-up a request (the 2-core
        // VM: 4 KiB one at a time 1.3-1.6x the p50; docs/BENCHMARKS.md, "Session 30, sessthread").
        let session_thread = poller_sessions
            && match session_thread {
                Spin::Auto => spin,
                s => s.resolve(0),
            };
        let warm_worker = match (&args.warm_worker, &file.runtime.warm_worker) {
            (Some(v), _) => Spin::parse("--warm-worker", v).map_err(ConfigError::Invalid)?,
            (None, Some(v)) => Spin::parse("runtime.warm_worker", v).map_err(ConfigError::Invalid)?,
            (None, None) => Spin::Auto,
        };
        // Only with `runtime.spin` (`auto`: on then). The warm worker was for messages the runtime carried
        // (the control stream, a session's task); with the framed sessions on the poller or its
        // sessions thread and the direct control connections read by the poller, a small
        // transfer's path crosses no runtime worker, and the task's `yield_now` loop keeps a
        // second worker switching in and out (~100,000 times a run: BENCHMARKS, session 31,
        // tail) — `off` is measured against it in "Session 32, rt2".
        let warm_worker = spin
            && match warm_worker {
                Spin::Auto => true,
                s => s.resolve(0),
            };
        let shared_completions = on_off(
            "--shared-completions",
            &args.shared_completions,
            file.runtime.shared_completions,
        )?;
        let request_ring = on_off("--request-ring", &args.request_ring, file.runtime.request_ring)?;
        let lane_thread = match (&args.lane_thread, &file.runtime.lane_thread) {
            (Some(v), _) => Spin::parse("--lane-thread", v).map_err(ConfigError::Invalid)?,
            (None, Some(BoolOrWord::Bool(true))) => Spin::On,
            (None, Some(BoolOrWord::Bool(false))) => Spin::Off,
            (None, Some(BoolOrWord::Word(v))) => {
                Spin::parse("runtime.lane_thread", v).map_err(ConfigError::Invalid)?
            }
            // Off by default: the lead turns it to `auto` after the device measurements.
            (None, None) => Spin::Off,
        };
        // `auto` is as `runtime.spin` (and `runtime.session_thread`'s auto): lane threads where
        // the threads spin (8 CPUs or more); on the 2-core VM they cost throughput and
        // one-at-a-time latency (docs/BENCHMARKS.md, sessions 30 and 31).
        let lane_thread = match lane_thread {
            Spin::Auto => spin,
            s => s.resolve(0),
        };
        let async_workers = match args.async_workers.or(file.runtime.async_workers) {
            Some(n) if n > 1024 => {
                return Err(ConfigError::Invalid(format!(
                    "runtime.async_workers: {n} (0 to 1024 allowed)"
                )));
            }
            Some(n) if n > 0 => n,
            _ if spin => SPIN_ASYNC_WORKERS,
            _ => crate::idle::cpus(),
        };
        let host_copy_threads = match args.host_copy_threads.or(file.transfer.host_copy_threads) {
            Some(n) if n > crate::net::host_copies::MAX_HOST_COPY_THREADS => {
                return Err(ConfigError::Invalid(format!(
                    "transfer.host_copy_threads: {n} (0 to {} allowed)",
                    crate::net::host_copies::MAX_HOST_COPY_THREADS
                )));
            }
            Some(n) => n,
            None => crate::net::host_copies::default_threads(crate::idle::cpus()),
        };
        let host_copy_spin =
            host_copy::resolve_spin(args.host_copy_spin_us.as_deref(), &file.transfer, spin)?;
        let host_copy = host_copy::resolve(&args.host_copy, &file.transfer, host_copy_spin)?;
        let host_gather_ahead =
            host_copy::resolve_gather_ahead(&args.host_copy, &file.transfer, host_copy_threads)?;
        let send_window = file.transfer.send_window.unwrap_or(12);
        let recv_window = file.transfer.recv_window.unwrap_or(16);
        if !(1..=16).contains(&send_window) || !(1..=16).contains(&recv_window) {
            return Err(ConfigError::Invalid(
                "transfer.send_window and transfer.recv_window must lie in 1..=16 (the plugin's 16 slots)"
                    .into(),
            ));
        }
        let gather_ahead = args
            .gather_ahead
            .or(file.transfer.gather_ahead)
            .unwrap_or(crate::engine::DEFAULT_GATHER_AHEAD);
        if gather_ahead > MAX_GATHER_AHEAD {
            return Err(ConfigError::Invalid(format!(
                "transfer.gather_ahead: {gather_ahead} is over {MAX_GATHER_AHEAD} (0 to {MAX_GATHER_AHEAD} allowed; each \
                 send lane stages send_window + gather_ahead chunks)"
            )));
        }
        let scatter_ahead = args
            .scatter_ahead
            .or(file.transfer.scatter_ahead)
            .unwrap_or(DEFAULT_SCATTER_AHEAD);
        if scatter_ahead > MAX_SCATTER_AHEAD {
            return Err(ConfigError::Invalid(format!(
                "transfer.scatter_ahead: {scatter_ahead} is over {MAX_SCATTER_AHEAD} (0 to {MAX_SCATTER_AHEAD} allowed; each \
                 receive lane lands block chunks in recv_window + scatter_ahead host slots)"
            )));
        }
        let socket_mode = match file.api.socket_mode.as_deref() {
            None => 0o660,
            Some(m) => u32::from_str_radix(m.trim_start_matches("0o"), 8)
                .ok()
                .filter(|m| *m <= 0o777)
                .ok_or_else(|| {
                    ConfigError::Invalid(format!("api.socket_mode: {m:?} is not an octal mode"))
                })?,
        };
        let heartbeat_interval_ms = file
            .peer
            .heartbeat_interval_ms
            .unwrap_or(DEFAULT_HEARTBEAT_INTERVAL_MS);
        let heartbeat_timeout_ms = file
            .peer
            .heartbeat_timeout_ms
            .unwrap_or(DEFAULT_HEARTBEAT_TIMEOUT_MS);
        if heartbeat_interval_ms == 0 || heartbeat_timeout_ms <= heartbeat_interval_ms {
            return Err(ConfigError::Invalid(format!(
                "peer.heartbeat_timeout_ms ({heartbeat_timeout_ms}) must exceed peer.heartbeat_interval_ms ({heartbeat_interval_ms}), which must be positive"
            )));
        }
        let default_timeout_s = args
            .default_timeout_s
            .or(file.transfer.default_timeout_s)
            .unwrap_or(600);
        if default_timeout_s == 0 {
            return Err(ConfigError::Invalid(
                "default_timeout_s must be at least 1".into(),
            ));
        }
        let api_tcp = args.api_tcp.or(file.api.tcp);
        let api_token_file = args.api_token_file.clone().or(file.api.token_file);
        if api_tcp.is_some() && api_token_file.is_none() {
            return Err(ConfigError::Invalid(
                "api.tcp / --api-tcp: the TCP listener requires a bearer token: set api.token_file / --api-token-file"
                    .into(),
            ));
        }
        let peer_tls = match (
            file.peer.tls_cert_file,
            file.peer.tls_key_file,
            file.peer.tls_ca_file,
        ) {
            (Some(c), Some(k), Some(a)) => Some((c, k, a)),
            (None, None, None) => None,
            _ => {
                return Err(ConfigError::Invalid(
                    "peer.tls_cert_file, peer.tls_key_file and peer.tls_ca_file: set all three or none"
                        .into(),
                ));
            }
        };
        let peer_advertise = if args.peer_advertise.is_empty() {
            file.peer.advertise.unwrap_or_default()
        } else {
            args.peer_advertise.clone()
        };
        crate::advertise::check_peer_addresses("peer.advertise", &peer_advertise)
            .map_err(ConfigError::Invalid)?;
        let topology = match args.topology.as_deref().or(file.topology.map.as_deref()) {
            Some(text) => MapSpec::parse(text).map_err(|e| ConfigError::Invalid(e.to_string()))?,
            None => MapSpec::Pci,
        };
        Ok(Config {
            node_id,
            peer_advertise,
            api_socket: args
                .api_socket
                .clone()
                .or(file.api.socket)
                .unwrap_or_else(|| PathBuf::from(DEFAULT_API_SOCKET)),
            api_socket_mode: socket_mode,
            api_tcp,
            api_token_file,
            peer_secret_file: args.peer_secret_file.clone().or(file.peer.secret_file),
            peer_tls,
            peer_listen: args
                .peer_listen
                .or(file.peer.listen)
                .unwrap_or_else(|| DEFAULT_PEER_LISTEN.parse().expect("valid default")),
            peer_connect_timeout: Duration::from_secs(file.peer.connect_timeout_s.unwrap_or(30)),
            heartbeat_interval: Duration::from_millis(heartbeat_interval_ms),
            heartbeat_timeout: Duration::from_millis(heartbeat_timeout_ms),
            lane_idle_close: match args
                .lane_idle_close_ms
                .or(file.peer.lane_idle_close_ms)
                .unwrap_or(DEFAULT_LANE_IDLE_CLOSE_MS)
            {
                0 => None,
                ms => Some(Duration::from_millis(ms)),
            },
            pairing_idle_close: match args
                .pairing_idle_close_ms
                .or(file.peer.pairing_idle_close_ms)
                .unwrap_or(DEFAULT_PAIRING_IDLE_CLOSE_MS)
            {
                0 => None,
                ms => Some(Duration::from_millis(ms)),
            },
            direct_control: match (&args.direct_control, file.peer.direct_control) {
                (Some(v), _) => match v.as_str() {
                    "on" => true,
                    "off" => false,
                    other => {
                        return Err(ConfigError::Invalid(format!(
                            "--direct-control: {other:?} (on or off)"
                        )));
                    }
                },
                (None, Some(v)) => v,
                (None, None) => true,
            },
            plugin,
            lanes_per_device,
            devices: file.plugin.devices,
            chunk_bytes,
            protocol: protocol.protocol,
            eager_lanes: protocol.eager_lanes,
            eager_max_bytes: protocol.eager_max_bytes,
            gpu_credits: protocol.gpu_credits,
            credit_budget_bytes: protocol.credit_budget_bytes,
            spread_min_chunk_bytes: protocol.spread_min_chunk_bytes,
            spread_chunks_per_lane: protocol.spread_chunks_per_lane,
            inline,
            unpack_impl,
            send_window,
            gather_ahead,
            scatter_ahead,
            host_copy_threads,
            host_copy_spin,
            host_copy,
            host_gather_ahead,
            recv_window,
            default_timeout: Duration::from_secs(default_timeout_s),
            max_buffer_bytes: file.transfer.max_buffer_bytes.unwrap_or(64 << 30),
            host_memory_reserve: file
                .transfer
                .host_memory_reserve_bytes
                .unwrap_or(crate::headroom::DEFAULT_RESERVE),
            finished_retention: Duration::from_secs(file.transfer.finished_retention_s.unwrap_or(300)),
            finished_kept_max: file.transfer.finished_kept_max.unwrap_or(100_000),
            shutdown_grace: Duration::from_secs(
                args.shutdown_grace_s.or(file.shutdown.grace_s).unwrap_or(30),
            ),
            ready_file: args.ready_file.clone(),
            metrics_listen: args.metrics_listen.or(file.metrics.listen),
            spin,
            poller_sessions,
            session_thread,
            warm_worker,
            shared_completions,
            request_ring,
            lane_thread,
            async_workers,
            topology,
            state_dir: args.state_dir.clone().or_else(|| file.runtime.state_dir.clone()),
            fd_keeper: args.fd_keeper.clone().or_else(|| file.runtime.fd_keeper.clone()),
            reattach_grace: Duration::from_secs(match file.runtime.reattach_grace_s.unwrap_or(60) {
                g @ 1..=86_400 => g,
                g => {
                    return Err(ConfigError::Invalid(format!(
                        "runtime.reattach_grace_s: {g} is outside 1..=86400"
                    )));
                }
            }),
        })
    }
}

fn load_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    toml::from_str(&text).map_err(|e| ConfigError::Parse {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// Node ids go into descriptors (`tcpxd1:<node>:…`), so they are restricted to a safe alphabet.
pub fn check_node_id(id: &str) -> Result<(), ConfigError> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(ConfigError::Invalid(format!(
            "node_id {id:?}: use 1 to 128 letters, digits, '.', '_' or '-'"
        )))
    }
}

/// This machine's hostname.
pub fn hostname() -> std::io::Result<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")?;
    Ok(name.trim().to_string())
}

/// An `on|off` flag over the file's bool, on when neither says (`runtime.shared_completions`,
/// `runtime.request_ring`).
fn on_off(flag: &str, arg: &Option<String>, file: Option<bool>) -> Result<bool, ConfigError> {
    match (arg.as_deref(), file) {
        (Some("on"), _) => Ok(true),
        (Some("off"), _) => Ok(false),
        (Some(other), _) => Err(ConfigError::Invalid(format!("{flag}: {other:?} (on or off)"))),
        (None, Some(v)) => Ok(v),
        (None, None) => Ok(true),
    }
}

#[cfg(test)]
mod tests;
