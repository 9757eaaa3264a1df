//! tcpxd: the per-node transfer daemon.

use std::process::ExitCode;

use clap::Parser;
use tcpxd::config::{Config, DaemonArgs, PluginChoice};
use tcpxd::daemon;
use tcpxd::net::{NetError, Plugin};

/// mimalloc, not glibc's malloc: the poller allocates what other threads free (a transfer's
/// status, its session events), which takes glibc's slow path (docs/BENCHMARKS.md, "Session 33,
/// alloc").
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "tcpxd",
    version,
    about = "Moves GPU and host buffers between nodes over GPUDirect-TCPX",
    long_about = "Moves GPU and host buffers between nodes over GPUDirect-TCPX.\n\nSettings come from a TOML file (--config), then TCPXD_* environment variables, then flags; each overrides the one before. See docs/CONFIG.md."
)]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(flatten)]
    args: DaemonArgs,
    #[command(subcommand)]
    command: Option<Sub>,
}

#[derive(clap::Subcommand)]
enum Sub {
    /// Check this node's set-up for GPUDirect-TCPX and tcpxd: each check ok, warn or fail with a
    /// one-line fix; exits 1 when any check fails. See docs/OPERATIONS.md.
    Doctor(Box<tcpxd::doctor::DoctorArgs>),
    /// Hold the file descriptors of the daemon's CUDA memory across its restarts where no
    /// systemd does (a GKE sidecar, a plain run): serve --socket, the daemon's runtime.fd_keeper.
    /// See docs/OPERATIONS.md, "Restarts".
    FdKeeper(tcpxd::fd_keeper::FdKeeperArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Sub::Doctor(args)) = &cli.command {
        // The report goes to stdout; only warnings (e.g. the plugin's) to stderr.
        tcpxd::logging::init("warn");
        return if tcpxd::doctor::main(args) {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        };
    }
    if let Some(Sub::FdKeeper(args)) = &cli.command {
        tcpxd::logging::init("info");
        return match tcpxd::fd_keeper::serve(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!(socket = %args.socket.display(), "fd keeper: {e}");
                ExitCode::FAILURE
            }
        };
    }
    tcpxd::logging::init("info");
    let cfg = match Config::resolve(&cli.args, &|k| std::env::var(k).ok()) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("configuration: {e}");
            return ExitCode::from(2);
        }
    };
    // The plugin is loaded before any other thread exists: it may set NCCL_DYNAMIC_CHUNK_SIZE.
    let plugin = match &cfg.plugin {
        PluginChoice::BuiltinEmulation => {
            tracing::warn!("using the built-in emulation plugin (TCP over the emulated NICs), as requested");
            Plugin::builtin_emulation()
        }
        PluginChoice::Path(p) => Plugin::load(p),
    };
    let plugin = match plugin {
        Ok(p) => p,
        Err(e @ NetError::FileMissing { .. }) => {
            tracing::error!(
                "{e}. Install Google's nccl-plugin-gpudirecttcpx and point --plugin (or TCPXD_PLUGIN, or plugin.path) at its libnccl-net.so; on GKE it is staged under /var/lib/tcpx/lib64, often mounted noexec, so copy it to an executable directory such as /usr/local/tcpx/lib64. For a test set-up without TCPX hardware, pass --builtin-emulation explicitly."
            );
            return ExitCode::from(2);
        }
        Err(e) => {
            tracing::error!("{e}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.async_workers)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!("starting the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(async move {
        let d = match daemon::start(&cfg, plugin).await {
            Ok(d) => d,
            Err(e) => {
                tracing::error!("{e}");
                return ExitCode::FAILURE;
            }
        };
        if let Some(path) = &cfg.ready_file {
            let tmp = path.with_extension("tmp");
            let written =
                std::fs::write(&tmp, daemon::ready_json(&d)).and_then(|_| std::fs::rename(&tmp, path));
            if let Err(e) = written {
                tracing::error!("writing the ready file {}: {e}", path.display());
            }
        }
        systemd_ready(&d);
        wait_for_signal().await;
        tracing::info!(
            "shutting down: draining in-flight transfers for up to {:?}",
            cfg.shutdown_grace
        );
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
        d.shutdown().await;
        tcpxd::hop_record::flush();
        ExitCode::SUCCESS
    })
}

/// Under systemd (`Type=notify`): reports readiness, and when the unit sets `WatchdogSec=`, pings
/// the watchdog at half its period for as long as the poller thread answers. A wedged poller stops
/// the pings and systemd restarts the daemon. Outside systemd these are no-ops.
fn systemd_ready(d: &daemon::RunningDaemon) {
    let status = format!("serving node {} (peer service {})", d.node_id, d.peer_addr);
    if let Err(e) = sd_notify::notify(&[
        sd_notify::NotifyState::Ready,
        sd_notify::NotifyState::Status(&status),
    ]) {
        tracing::warn!("systemd readiness notification failed: {e}");
    }
    let Some(period) = sd_notify::watchdog_enabled() else {
        return;
    };
    let poller = d.state().poller.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period / 2);
        loop {
            tick.tick().await;
            let (tx, rx) = tokio::sync::oneshot::channel();
            if poller.send(tcpxd::poller::Command::Stats { reply: tx }).is_err() {
                return;
            }
            match tokio::time::timeout(period / 2, rx).await {
                Ok(Ok(_)) => {
                    let _ = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]);
                }
                _ => tracing::error!(
                    "the poller did not answer within {:?}: withholding the watchdog ping",
                    period / 2
                ),
            }
        }
    });
}

async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("cannot watch SIGTERM: {e}");
            return std::future::pending().await;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT"),
    }
}
