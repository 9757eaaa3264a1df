//! The daemon's integration tests, in one binary: each module was its own test binary, and each
//! of those linked tokio, tonic and the daemon again (about 50 MB apiece, 1.6 GB for the set on
//! CI's disk, and a link each). cargo-nextest still runs every test in its own process, so no
//! test shares a daemon, a plugin or an environment variable with another; under `cargo test`,
//! run the modules that start daemons as processes with `--test-threads=1` if they misbehave.
//!
//! One module: `cargo nextest run -p tcpxd --test suite daemon_cancel::` (a filter is a
//! substring of `module::test`).

mod common;

mod daemon_addressed_feeds;
mod daemon_auth;
mod daemon_auto;
mod daemon_bad_input;
mod daemon_batches;
mod daemon_binary;
mod daemon_blocks;
mod daemon_cancel;
mod daemon_churn;
mod daemon_client_pages;
mod daemon_describe_inline;
mod daemon_direct_control;
mod daemon_eager;
mod daemon_fast_start;
mod daemon_faults;
mod daemon_first_use;
mod daemon_gather_ahead;
mod daemon_gpu;
mod daemon_gpu_batches;
mod daemon_gpu_credits;
mod daemon_gpu_inline;
mod daemon_heartbeat;
mod daemon_host_fd;
mod daemon_hostile;
mod daemon_hung_peer;
mod daemon_idle;
mod daemon_idle_peers;
mod daemon_inline;
mod daemon_inline_copies;
mod daemon_lane_life;
mod daemon_lane_thread;
mod daemon_local;
mod daemon_local_board;
mod daemon_local_inline;
mod daemon_local_notify;
mod daemon_local_ring;
mod daemon_local_starting;
mod daemon_lone_notice;
mod daemon_pairing;
mod daemon_pairing_life;
mod daemon_peer_loss;
mod daemon_poller_sessions;
mod daemon_prepared;
mod daemon_same_node;
mod daemon_same_node_split;
mod daemon_scatter_ahead;
mod daemon_session;
mod daemon_session_thread;
mod daemon_smoke;
mod daemon_soak;
mod daemon_stub_gpus;
mod daemon_stub_gpus_credits;
mod daemon_stub_gpus_passes;
mod daemon_stub_gpus_spread;
mod daemon_tls;
mod daemon_transfers;
mod deploy;
mod descriptor;
mod doctor;
mod gpu_blocks;
mod gpu_unpack;
mod lane_pass;
mod metrics;
mod monitoring;
mod net_blocks;
mod plugin_loading;
mod reflection;
mod routed_rerun;
mod topology;
mod topology_closes;
mod topology_mixed;
