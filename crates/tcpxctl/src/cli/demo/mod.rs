//! `tcpxctl demo`: two local daemons on the built-in emulation plugin, a WRITE from A into B's
//! buffer and a READ back, checked by CRC-32C.
//!
//! The daemons are started as
//!
//! ```text
//! tcpxd --node-id demo-a --builtin-emulation --api-socket DIR/demo-a.sock \
//!       --peer-listen 127.0.0.1:0 --ready-file DIR/demo-a.ready [--chunk-bytes N]
//! ```
//!
//! with stdout and stderr in `DIR/demo-a.log` and `RUST_LOG=info` unless set. Each writes its
//! ready file (JSON: `{"node_id", "api_socket", "peer_address"}`) once it serves. A guard owns
//! the children: whatever happens (error, panic, Ctrl-C) they get SIGTERM, then SIGKILL after the
//! grace period.
//!
//! The module is split by concern: this file holds the options, the errors and the demo's flow
//! (registering, filling, pairing, the WRITE and the READ, the checksums); `daemons` the children
//! (spawning, ready files, logs, signals, stopping them); `report` what a successful run measured
//! (and the metrics scrape).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tonic::Status;

use crate::cli::output::transfer_elapsed;
use crate::cli::transfer::{FollowOptions, follow_transfer};
use crate::client::ApiClient;
use crate::client::{
    ClientError, code_and_message, code_number_name, connect, format_bytes, format_duration, format_rate,
    status_line,
};
use tcpxd::api::proto::v1::register_buffer_request::Source;
use tcpxd::api::proto::v1::{
    ChecksumBufferRequest, ConnectPeerRequest, FillBufferRequest, HostAllocation, ListPeersRequest,
    PeerState, ReadEntry, ReadRequest, RegisterBufferRequest, WriteEntry, WriteRequest, fill_buffer_request,
};

mod daemons;
mod report;

pub use daemons::{DaemonExit, ReadyInfo, log_tail, parse_ready};
pub(crate) use daemons::{Daemons, Signals};
pub use report::{DemoReport, MetricsScrape, scrape_metrics};

/// The demo's node ids.
pub const NODES: [&str; 2] = ["demo-a", "demo-b"];
/// The seed A's buffer is filled with.
pub const SEED: u64 = 42;
/// How long the daemons get to exit after SIGTERM before SIGKILL.
pub const STOP_GRACE: Duration = Duration::from_secs(10);
/// How long ConnectPeer may leave the peer CONNECTING before the demo gives up.
const PEER_UP_TIMEOUT: Duration = Duration::from_secs(30);

/// What `run_demo` does.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Bytes moved each way.
    pub size: u64,
    /// `--chunk-bytes` for both daemons; their default when `None`.
    pub chunk_bytes: Option<u64>,
    /// Keep the directory (sockets, ready files, logs) after a successful run. It is also kept
    /// after a failure (not an interrupt), so the logs can be read.
    pub keep_dir: bool,
    /// The tcpxd binary; `None`: `tcpxd` next to the running executable (integration tests pass
    /// `env!("CARGO_BIN_EXE_tcpxd")`).
    pub daemon: Option<PathBuf>,
    /// The working directory; `None`: `$TMPDIR/tcpxd-demo-<pid>`.
    pub dir: Option<PathBuf>,
    /// How long each daemon gets to write its ready file.
    pub ready_timeout: Duration,
    /// Progress bars and step lines on stderr.
    pub progress: bool,
    /// Turn SIGINT/SIGTERM into a clean stop (daemons stopped, error returned). The CLI sets it;
    /// a test harness usually should not.
    pub handle_signals: bool,
    /// Extra arguments for both daemons (after the standard ones).
    pub extra_daemon_args: Vec<String>,
    /// Per daemon (in spawn order): the CUDA device its built-in emulation keeps its bounce
    /// buffers on (`TCPXEMU_CUDA_DEVICE`), so each daemon owns one GPU.
    pub emulation_cuda_devices: Vec<u32>,
    /// The plugin file both daemons load (`--plugin`); `None`: the built-in emulation.
    pub plugin: Option<PathBuf>,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            size: 1 << 30,
            chunk_bytes: None,
            keep_dir: false,
            daemon: None,
            dir: None,
            ready_timeout: Duration::from_secs(30),
            progress: false,
            handle_signals: false,
            extra_daemon_args: Vec::new(),
            emulation_cuda_devices: Vec::new(),
            plugin: None,
        }
    }
}

impl DemoOptions {
    /// The directory the demo works in.
    pub fn work_dir(&self) -> PathBuf {
        self.dir.clone().unwrap_or_else(default_dir)
    }

    /// The daemon binary the demo starts.
    pub fn daemon_path(&self) -> Result<PathBuf, DemoError> {
        match &self.daemon {
            Some(p) => Ok(p.clone()),
            None => std::env::current_exe()
                .map(|exe| exe.with_file_name("tcpxd"))
                .map_err(|source| DemoError::Io {
                    what: "finding tcpxctl's own path".to_string(),
                    source,
                }),
        }
    }
}

/// `$TMPDIR/tcpxd-demo-<pid>`.
pub fn default_dir() -> PathBuf {
    std::env::temp_dir().join(format!("tcpxd-demo-{}", std::process::id()))
}

/// Why the demo failed.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("bad option: {0}")]
    BadOption(String),
    #[error(
        "the daemon binary {} does not exist; build it with `cargo build --release` \
         (or pass --daemon PATH)",
        path.display()
    )]
    DaemonMissing { path: PathBuf },
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error("{node} did not write {} within {:.0} s; last lines of {}:\n{log_tail}",
        ready_file.display(), timeout.as_secs_f64(), log.display())]
    NotReady {
        node: String,
        ready_file: PathBuf,
        timeout: Duration,
        log: PathBuf,
        log_tail: String,
    },
    #[error("{node} exited early ({status}); last lines of {}:\n{log_tail}", log.display())]
    DaemonExited {
        node: String,
        status: String,
        log: PathBuf,
        log_tail: String,
    },
    #[error("{0}")]
    Connect(#[from] ClientError),
    #[error("{what} failed: {}", status_line(status))]
    Rpc { what: String, status: Status },
    #[error("{what} failed: {}", code_and_message(&code_number_name(*code), message))]
    Transfer {
        what: String,
        code: i32,
        message: String,
    },
    #[error(
        "checksums differ after the {what}: {left} {left_crc:08x} ({left_len} bytes) vs {right} {right_crc:08x} ({right_len} bytes)"
    )]
    ChecksumMismatch {
        what: String,
        left: String,
        left_crc: u32,
        left_len: u64,
        right: String,
        right_crc: u32,
        right_len: u64,
    },
    #[error("interrupted by {0}; daemons stopped")]
    Interrupted(&'static str),
}

impl DemoError {
    fn rpc(what: impl Into<String>) -> impl FnOnce(Status) -> DemoError {
        let what = what.into();
        move |status| DemoError::Rpc { what, status }
    }
}

/// Runs the demo: start both daemons, WRITE A → B, READ B → A, compare checksums, stop both.
/// The daemons are stopped on every path out of this function.
pub async fn run_demo(opts: &DemoOptions) -> Result<DemoReport, DemoError> {
    if opts.size == 0 {
        return Err(DemoError::BadOption("--size must be at least 1 byte".into()));
    }
    if opts.chunk_bytes == Some(0) {
        return Err(DemoError::BadOption("--chunk-bytes must be at least 1".into()));
    }
    let daemon = opts.daemon_path()?;
    if !daemon.is_file() {
        return Err(DemoError::DaemonMissing { path: daemon });
    }
    // Listen before any child exists, so a Ctrl-C can never skip the clean-up.
    let mut signals = if opts.handle_signals {
        Some(Signals::new()?)
    } else {
        None
    };

    let dir = opts.work_dir();
    let created_dir = !dir.exists();
    std::fs::create_dir_all(&dir).map_err(|source| DemoError::Io {
        what: format!("creating {}", dir.display()),
        source,
    })?;
    let mut daemons = Daemons::new(opts.progress);
    let outcome = {
        let flow = demo_flow(opts, &daemon, &dir, &mut daemons);
        match signals.as_mut() {
            Some(signals) => tokio::select! {
                r = flow => r,
                name = signals.recv() => Err(DemoError::Interrupted(name)),
            },
            None => flow.await,
        }
    };
    let exits = daemons.stop(STOP_GRACE).await;
    // After a failure the logs explain it, so the directory stays (an interrupt explains itself).
    if matches!(outcome, Err(DemoError::Interrupted(_))) && !opts.keep_dir {
        remove_dir(&dir, created_dir);
    }
    let mut report = outcome?;
    report.daemon_exits = exits;
    if opts.keep_dir {
        report.kept_dir = Some(dir);
    } else {
        remove_dir(&dir, created_dir);
    }
    Ok(report)
}

/// Removes what the demo made: the whole directory if it created it, else its own files.
pub(crate) fn remove_dir(dir: &Path, created: bool) {
    if created {
        let _ = std::fs::remove_dir_all(dir);
    } else {
        for node in NODES {
            for ext in ["sock", "ready", "log"] {
                let _ = std::fs::remove_file(dir.join(format!("{node}.{ext}")));
            }
        }
    }
}

async fn demo_flow(
    opts: &DemoOptions,
    daemon: &Path,
    dir: &Path,
    daemons: &mut Daemons,
) -> Result<DemoReport, DemoError> {
    for node in NODES {
        daemons.spawn(daemon, node, dir, opts)?;
    }
    let ready = daemons.wait_ready(opts.ready_timeout).await?;
    let [info_a, info_b] = ready;
    step(
        opts,
        &format!(
            "{} serves on {} (peer {}), {} on {} (peer {})",
            info_a.node_id,
            info_a.api_socket,
            info_a.peer_address,
            info_b.node_id,
            info_b.api_socket,
            info_b.peer_address
        ),
    );

    let result = transfer_and_check(opts, &info_a, &info_b).await;
    let result = match result {
        Ok(moved) => {
            let mut scrapes = Vec::new();
            for info in [&info_a, &info_b] {
                if let Some(addr) = &info.metrics {
                    scrapes.push(scrape_metrics(&info.node_id, addr).await?);
                }
            }
            Ok((moved, scrapes))
        }
        Err(e) => Err(e),
    };
    // A failed RPC is often a daemon that died: say so, with its log.
    match result {
        Ok(((write, read, crc), metrics)) => Ok(DemoReport {
            size: opts.size,
            nodes: [info_a, info_b],
            write_time: write.1,
            read_time: read.1,
            write_transfer_id: write.0,
            read_transfer_id: read.0,
            crc32c: crc,
            kept_dir: None,
            daemon_exits: Vec::new(),
            metrics,
        }),
        Err(e) => Err(daemons.explain_exit().unwrap_or(e)),
    }
}

type Moved = (u64, Duration);

async fn transfer_and_check(
    opts: &DemoOptions,
    a: &ReadyInfo,
    b: &ReadyInfo,
) -> Result<(Moved, Moved, u32), DemoError> {
    let mut ca = connect(&format!("unix:{}", a.api_socket)).await?;
    let mut cb = connect(&format!("unix:{}", b.api_socket)).await?;
    let size = opts.size;

    let src = register(&mut ca, size, "demo-src", &a.node_id).await?;
    let dst = register(&mut cb, size, "demo-dst", &b.node_id).await?;
    let back = register(&mut ca, size, "demo-readback", &a.node_id).await?;
    step(
        opts,
        &format!(
            "registered {} host buffers: {}#{} (source), {}#{} (destination), {}#{} (read-back)",
            format_bytes(size),
            a.node_id,
            src.id,
            b.node_id,
            dst.id,
            a.node_id,
            back.id
        ),
    );

    ca.fill_buffer(FillBufferRequest {
        buffer_id: src.id,
        offset: 0,
        length: 0,
        pattern: Some(fill_buffer_request::Pattern::Seed(SEED)),
    })
    .await
    .map_err(DemoError::rpc(format!(
        "filling {}#{} with seed {SEED}",
        a.node_id, src.id
    )))?;

    connect_peer(&mut ca, a, b).await?;
    step(
        opts,
        &format!("{} connected to {} at {}", a.node_id, b.node_id, b.peer_address),
    );

    // WRITE A -> B.
    let started = ca
        .write(WriteRequest {
            entry: Some(WriteEntry {
                local_buffer_id: src.id,
                local_offset: 0,
                remote_descriptor: dst.descriptor.clone(),
                remote_offset: 0,
                length: size,
            }),
            notification: Vec::new(),
            timeout_ms: 0,
            ready_event_ipc_handle: Vec::new(),
            wait: false,
        })
        .await
        .map_err(DemoError::rpc(format!("write {} -> {}", a.node_id, b.node_id)))?
        .into_inner();
    let write = finish(&mut ca, started.transfer_id, size, "write", opts).await?;
    let crc_src = checksum(&mut ca, src.id, &a.node_id).await?;
    let crc_dst = checksum(&mut cb, dst.id, &b.node_id).await?;
    compare(
        "write",
        (&a.node_id, src.id, crc_src),
        (&b.node_id, dst.id, crc_dst),
    )?;

    // READ B -> A, into the second buffer.
    let started = ca
        .read(ReadRequest {
            entry: Some(ReadEntry {
                remote_descriptor: dst.descriptor.clone(),
                remote_offset: 0,
                local_buffer_id: back.id,
                local_offset: 0,
                length: size,
            }),
            timeout_ms: 0,
            wait: false,
        })
        .await
        .map_err(DemoError::rpc(format!("read {} -> {}", b.node_id, a.node_id)))?
        .into_inner();
    let read = finish(&mut ca, started.transfer_id, size, "read", opts).await?;
    let crc_back = checksum(&mut ca, back.id, &a.node_id).await?;
    compare(
        "read",
        (&b.node_id, dst.id, crc_dst),
        (&a.node_id, back.id, crc_back),
    )?;
    Ok((write, read, crc_src.0))
}

fn step(opts: &DemoOptions, line: &str) {
    if opts.progress {
        eprintln!("demo: {line}");
    }
}

async fn register(
    client: &mut ApiClient,
    size: u64,
    label: &str,
    node: &str,
) -> Result<tcpxd::api::proto::v1::Buffer, DemoError> {
    client
        .register_buffer(RegisterBufferRequest {
            reattach_id: Default::default(),
            reattach_key: Default::default(),
            source: Some(Source::Host(HostAllocation { size })),
            label: label.to_string(),
        })
        .await
        .map(tonic::Response::into_inner)
        .map_err(DemoError::rpc(format!(
            "registering a {} host buffer on {node}",
            format_bytes(size)
        )))
}

async fn checksum(client: &mut ApiClient, buffer_id: u64, node: &str) -> Result<(u32, u64), DemoError> {
    let r = client
        .checksum_buffer(ChecksumBufferRequest {
            buffer_id,
            offset: 0,
            length: 0,
        })
        .await
        .map_err(DemoError::rpc(format!("checksum of {node}#{buffer_id}")))?
        .into_inner();
    Ok((r.crc32c, r.length))
}

fn compare(
    what: &str,
    (ln, lid, (lcrc, llen)): (&str, u64, (u32, u64)),
    (rn, rid, (rcrc, rlen)): (&str, u64, (u32, u64)),
) -> Result<(), DemoError> {
    if lcrc == rcrc && llen == rlen {
        return Ok(());
    }
    Err(DemoError::ChecksumMismatch {
        what: what.to_string(),
        left: format!("{ln}#{lid}"),
        left_crc: lcrc,
        left_len: llen,
        right: format!("{rn}#{rid}"),
        right_crc: rcrc,
        right_len: rlen,
    })
}

pub(crate) async fn connect_peer(
    client: &mut ApiClient,
    a: &ReadyInfo,
    b: &ReadyInfo,
) -> Result<(), DemoError> {
    let what = format!("connecting {} to {} at {}", a.node_id, b.node_id, b.peer_address);
    let peer = client
        .connect_peer(ConnectPeerRequest {
            address: b.peer_address.clone(),
        })
        .await
        .map_err(DemoError::rpc(what.clone()))?
        .into_inner();
    let mut state = (peer.state, peer.error, peer.node_id);
    let deadline = Instant::now() + PEER_UP_TIMEOUT;
    loop {
        if state.0 == PeerState::Up as i32 {
            return Ok(());
        }
        if state.0 == PeerState::Failed as i32 {
            return Err(DemoError::Rpc {
                what,
                status: Status::unavailable(format!("peer {} failed: {}", state.2, state.1)),
            });
        }
        if Instant::now() >= deadline {
            return Err(DemoError::Rpc {
                what,
                status: Status::deadline_exceeded(format!(
                    "peer still not UP after {} s",
                    PEER_UP_TIMEOUT.as_secs()
                )),
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let peers = client
            .list_peers(ListPeersRequest {})
            .await
            .map_err(DemoError::rpc(what.clone()))?
            .into_inner()
            .peers;
        if let Some(p) = peers
            .into_iter()
            .find(|p| p.address == b.peer_address || p.node_id == b.node_id)
        {
            state = (p.state, p.error, p.node_id);
        }
    }
}

async fn finish(
    client: &mut ApiClient,
    transfer_id: u64,
    size: u64,
    what: &str,
    opts: &DemoOptions,
) -> Result<Moved, DemoError> {
    let follow = FollowOptions {
        progress: opts.progress,
        label: what.to_string(),
        client_deadline: None,
    };
    let done = follow_transfer(client, transfer_id, size, &follow)
        .await
        .map_err(DemoError::rpc(format!(
            "following the {what} (transfer {transfer_id})"
        )))?;
    let ev = &done.event;
    if ev.status_code != 0 {
        return Err(DemoError::Transfer {
            what: format!("{what} (transfer {transfer_id})"),
            code: ev.status_code,
            message: ev.status_message.clone(),
        });
    }
    let elapsed = transfer_elapsed(ev, done.observed);
    step(
        opts,
        &format!(
            "{what}: {} in {} ({})",
            format_bytes(size),
            format_duration(elapsed),
            format_rate(size, elapsed)
        ),
    );
    Ok((transfer_id, elapsed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn missing_daemon_is_named() {
        let opts = DemoOptions {
            daemon: Some(PathBuf::from("/nonexistent/tcpxd")),
            ..DemoOptions::default()
        };
        let err = run_demo(&opts).await.expect_err("no daemon");
        let text = err.to_string();
        assert!(text.contains("/nonexistent/tcpxd"), "{text}");
        assert!(text.contains("cargo build --release"), "{text}");
    }

    /// A stand-in daemon (a shell script) that exits at once: the demo reports its log.
    #[tokio::test]
    async fn early_exit_is_reported() {
        let dir = std::env::temp_dir().join(format!("tcpxd-demo-test-exit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = dir.join("fake-tcpxd");
        std::fs::write(&script, "#!/bin/sh\necho \"fake daemon $*\"\nexit 3\n").unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let opts = DemoOptions {
            daemon: Some(script),
            dir: Some(dir.join("work")),
            size: 4096,
            chunk_bytes: Some(1024),
            ..DemoOptions::default()
        };
        let err = run_demo(&opts).await.expect_err("the fake daemon exits");
        let text = err.to_string();
        assert!(matches!(err, DemoError::DaemonExited { .. }), "{text}");
        assert!(text.contains("exit status: 3"), "{text}");
        assert!(text.contains("--node-id demo-"), "{text}");
        assert!(text.contains("--peer-listen 127.0.0.1:0"), "{text}");
        assert!(text.contains("--chunk-bytes 1024"), "{text}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A stand-in daemon that never gets ready: the demo times out, and stops it with SIGTERM.
    #[tokio::test]
    async fn not_ready_times_out_and_stops_children() {
        let dir = std::env::temp_dir().join(format!("tcpxd-demo-test-hang-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = dir.join("fake-tcpxd");
        let pids = dir.join("pids");
        std::fs::write(
            &script,
            format!(
                "#!/bin/sh\necho $$ >> {}\necho starting\nexec sleep 60\n",
                pids.display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let opts = DemoOptions {
            daemon: Some(script),
            dir: Some(dir.join("work")),
            size: 4096,
            ready_timeout: Duration::from_millis(500),
            ..DemoOptions::default()
        };
        let t0 = Instant::now();
        let err = run_demo(&opts).await.expect_err("never ready");
        assert!(matches!(err, DemoError::NotReady { .. }), "{err}");
        assert!(err.to_string().contains("starting"), "{err}");
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "SIGTERM stops sleep at once"
        );
        // Both children are gone.
        let text = std::fs::read_to_string(&pids).unwrap();
        for pid in text.split_whitespace() {
            let pid: libc::pid_t = pid.parse().unwrap();
            // SAFETY: signal 0 only checks whether the process exists.
            let alive = unsafe { libc::kill(pid, 0) } == 0;
            assert!(!alive, "pid {pid} still running");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
