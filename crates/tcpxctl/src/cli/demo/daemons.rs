//! The demo's children: spawning `tcpxd` with its log and ready file, waiting until both serve,
//! telling why one exited, and stopping them (SIGTERM, then SIGKILL after the grace period) on
//! every path out, a panic or an interrupt included.

use std::fs::File;
use std::io::{Read as _, Seek as _, SeekFrom};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde::Deserialize;

use super::{DemoError, DemoOptions, STOP_GRACE};

/// Lines of a daemon's log quoted in errors.
const LOG_TAIL_LINES: usize = 30;
/// Longest unix socket path (sun_path is 108 bytes with the terminating NUL).
const MAX_SOCKET_PATH: usize = 107;

/// What a daemon writes to its ready file once it serves.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ReadyInfo {
    pub node_id: String,
    pub api_socket: String,
    pub peer_address: String,
    /// The Prometheus endpoint (`host:port`), when the daemon serves one.
    #[serde(default)]
    pub metrics: Option<String>,
}

/// How a daemon ended when the demo stopped it.
#[derive(Debug, Clone)]
pub struct DaemonExit {
    pub node: String,
    /// `None` if it could not be reaped.
    pub status: Option<ExitStatus>,
    /// Whether SIGKILL was needed.
    pub killed: bool,
}

impl DaemonExit {
    /// Whether it stopped by itself after SIGTERM: exit 0, or death by SIGTERM.
    pub fn clean(&self) -> bool {
        use std::os::unix::process::ExitStatusExt as _;
        !self.killed
            && self
                .status
                .is_some_and(|s| s.success() || s.signal() == Some(libc::SIGTERM))
    }

    pub fn describe(&self) -> String {
        match (&self.status, self.killed) {
            (None, _) => "could not be reaped".to_string(),
            (Some(s), true) => format!("did not stop within {} s, killed ({s})", STOP_GRACE.as_secs()),
            (Some(s), false) => s.to_string(),
        }
    }
}

/// SIGINT and SIGTERM as a future.
pub(crate) struct Signals {
    int: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
}

impl Signals {
    pub(crate) fn new() -> Result<Signals, DemoError> {
        use tokio::signal::unix::{SignalKind, signal};
        let io = |source| DemoError::Io {
            what: "installing the signal handlers".to_string(),
            source,
        };
        Ok(Signals {
            int: signal(SignalKind::interrupt()).map_err(io)?,
            term: signal(SignalKind::terminate()).map_err(io)?,
        })
    }

    pub(crate) async fn recv(&mut self) -> &'static str {
        tokio::select! {
            _ = self.int.recv() => "SIGINT",
            _ = self.term.recv() => "SIGTERM",
        }
    }
}

struct Daemon {
    node: String,
    child: Child,
    ready_file: PathBuf,
    log: PathBuf,
    /// Set once reaped.
    status: Option<ExitStatus>,
}

/// The demo's children. Dropping it stops them (SIGTERM, then SIGKILL after the grace period).
pub(crate) struct Daemons {
    list: Vec<Daemon>,
    verbose: bool,
}

impl Daemons {
    pub(crate) fn new(verbose: bool) -> Daemons {
        Daemons {
            list: Vec::new(),
            verbose,
        }
    }

    pub(crate) fn spawn(
        &mut self,
        daemon: &Path,
        node: &str,
        dir: &Path,
        opts: &DemoOptions,
    ) -> Result<(), DemoError> {
        let socket = dir.join(format!("{node}.sock"));
        let ready_file = dir.join(format!("{node}.ready"));
        let log = dir.join(format!("{node}.log"));
        if socket.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(DemoError::BadOption(format!(
                "the socket path {} is longer than a unix socket allows; set TMPDIR to a shorter directory",
                socket.display()
            )));
        }
        // Leftovers from an earlier run would look ready or block the bind.
        for stale in [&socket, &ready_file] {
            match std::fs::remove_file(stale) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(DemoError::Io {
                        what: format!("removing {}", stale.display()),
                        source,
                    });
                }
            }
        }
        let io = |what: String| move |source| DemoError::Io { what, source };
        let out = File::create(&log).map_err(io(format!("creating {}", log.display())))?;
        let err = out
            .try_clone()
            .map_err(io(format!("opening {}", log.display())))?;
        let mut cmd = std::process::Command::new(daemon);
        cmd.arg("--node-id")
            .arg(node)
            .arg("--builtin-emulation")
            .arg("--api-socket")
            .arg(&socket)
            .arg("--peer-listen")
            .arg("127.0.0.1:0")
            .arg("--ready-file")
            .arg(&ready_file)
            .arg("--metrics-listen")
            .arg("127.0.0.1:0");
        if let Some(chunk) = opts.chunk_bytes {
            cmd.arg("--chunk-bytes").arg(chunk.to_string());
        }
        cmd.args(&opts.extra_daemon_args);
        if let Some(d) = opts.emulation_cuda_devices.get(self.list.len()) {
            cmd.env("TCPXEMU_CUDA_DEVICE", d.to_string());
        }
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "info");
        }
        // Its own process group: a terminal's Ctrl-C reaches tcpxctl only, which then stops the
        // daemons in order (and they still stop when tcpxctl is told to stop).
        cmd.stdin(Stdio::null()).stdout(out).stderr(err).process_group(0);
        let child = cmd
            .spawn()
            .map_err(io(format!("starting {} for {node}", daemon.display())))?;
        if self.verbose {
            eprintln!("demo: started {node} (pid {}), log {}", child.id(), log.display());
        }
        self.list.push(Daemon {
            node: node.to_string(),
            child,
            ready_file,
            log,
            status: None,
        });
        Ok(())
    }

    /// Waits until every daemon wrote a parseable ready file; fails early if one exits.
    pub(crate) async fn wait_ready(&mut self, timeout: Duration) -> Result<[ReadyInfo; 2], DemoError> {
        let deadline = Instant::now() + timeout;
        let mut ready: Vec<Option<ReadyInfo>> = vec![None; self.list.len()];
        loop {
            for (i, d) in self.list.iter_mut().enumerate() {
                if ready[i].is_none() {
                    ready[i] = read_ready(&d.ready_file);
                }
                if ready[i].is_none() {
                    if let Ok(Some(status)) = d.child.try_wait() {
                        d.status = Some(status);
                        return Err(DemoError::DaemonExited {
                            node: d.node.clone(),
                            status: status.to_string(),
                            log: d.log.clone(),
                            log_tail: log_tail(&d.log, LOG_TAIL_LINES),
                        });
                    }
                }
            }
            if ready.iter().all(Option::is_some) {
                break;
            }
            if Instant::now() >= deadline {
                let i = ready.iter().position(Option::is_none).unwrap_or(0);
                let d = &self.list[i];
                return Err(DemoError::NotReady {
                    node: d.node.clone(),
                    ready_file: d.ready_file.clone(),
                    timeout,
                    log: d.log.clone(),
                    log_tail: log_tail(&d.log, LOG_TAIL_LINES),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let infos: Vec<ReadyInfo> = ready.into_iter().flatten().collect();
        for (info, d) in infos.iter().zip(&self.list) {
            if info.node_id != d.node && self.verbose {
                eprintln!("demo: warning: {} reports node id {:?}", d.node, info.node_id);
            }
        }
        infos
            .try_into()
            .map_err(|v: Vec<ReadyInfo>| DemoError::BadOption(format!("expected 2 daemons, got {}", v.len())))
    }

    /// If a daemon has exited on its own, the error that says so (with its log).
    pub(crate) fn explain_exit(&mut self) -> Option<DemoError> {
        for d in &mut self.list {
            if d.status.is_none() {
                if let Ok(Some(status)) = d.child.try_wait() {
                    d.status = Some(status);
                    return Some(DemoError::DaemonExited {
                        node: d.node.clone(),
                        status: status.to_string(),
                        log: d.log.clone(),
                        log_tail: log_tail(&d.log, LOG_TAIL_LINES),
                    });
                }
            }
        }
        None
    }

    /// Sends SIGTERM to every daemon still running.
    fn terminate(&mut self) {
        for d in &mut self.list {
            if d.status.is_none() {
                if let Ok(Some(status)) = d.child.try_wait() {
                    d.status = Some(status);
                    continue;
                }
                if let Ok(pid) = libc::pid_t::try_from(d.child.id()) {
                    // SAFETY: kill(2) has no memory-safety preconditions; the pid is our own
                    // child's, not yet reaped (try_wait above), so it cannot name another process.
                    unsafe {
                        libc::kill(pid, libc::SIGTERM);
                    }
                }
            }
        }
    }

    /// Reaps what has exited; true when all have.
    fn reap(&mut self) -> bool {
        let mut all = true;
        for d in &mut self.list {
            if d.status.is_none() {
                match d.child.try_wait() {
                    Ok(Some(status)) => d.status = Some(status),
                    Ok(None) => all = false,
                    Err(_) => {}
                }
            }
        }
        all
    }

    /// SIGKILLs what is left and collects every exit.
    fn kill_rest(&mut self) -> Vec<DaemonExit> {
        let mut exits = Vec::new();
        for d in self.list.drain(..) {
            let mut d = d;
            let mut killed = false;
            if d.status.is_none() {
                killed = true;
                let _ = d.child.kill();
                d.status = d.child.wait().ok();
            }
            exits.push(DaemonExit {
                node: d.node,
                status: d.status,
                killed,
            });
        }
        exits
    }

    /// SIGTERM, wait up to `grace`, SIGKILL.
    pub(crate) async fn stop(&mut self, grace: Duration) -> Vec<DaemonExit> {
        self.terminate();
        let deadline = Instant::now() + grace;
        while !self.reap() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.kill_rest()
    }
}

impl Drop for Daemons {
    fn drop(&mut self) {
        if self.list.is_empty() {
            return;
        }
        // Reached on a panic or when run_demo's future is dropped: stop them synchronously.
        self.terminate();
        let deadline = Instant::now() + STOP_GRACE;
        while !self.reap() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        self.kill_rest();
    }
}

/// The ready file's contents, once it is complete JSON.
fn read_ready(path: &Path) -> Option<ReadyInfo> {
    let text = std::fs::read_to_string(path).ok()?;
    parse_ready(&text)
}

/// Parses a ready file (unknown fields are ignored).
pub fn parse_ready(text: &str) -> Option<ReadyInfo> {
    serde_json::from_str(text.trim()).ok()
}

/// The last `lines` lines of a log (at most the last 64 KiB of it).
pub fn log_tail(path: &Path, lines: usize) -> String {
    let Ok(mut f) = File::open(path) else {
        return format!("  (cannot open {})", path.display());
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(64 * 1024);
    if f.seek(SeekFrom::Start(start)).is_err() {
        return String::new();
    }
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    tail_lines(&String::from_utf8_lossy(&buf), lines)
}

fn tail_lines(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    if all.is_empty() {
        return "  (empty log)".to_string();
    }
    all[all.len().saturating_sub(lines)..]
        .iter()
        .map(|l| format!("  {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_file_format() {
        let info = parse_ready(
            r#"{"node_id":"demo-a","api_socket":"/tmp/x/demo-a.sock","peer_address":"127.0.0.1:40123","pid":7}"#,
        )
        .expect("parses");
        assert_eq!(info.node_id, "demo-a");
        assert_eq!(info.api_socket, "/tmp/x/demo-a.sock");
        assert_eq!(info.peer_address, "127.0.0.1:40123");
        assert!(parse_ready(r#"{"node_id":"demo-a","api_socket":"/x""#).is_none());
        assert!(parse_ready("").is_none());
    }

    #[test]
    fn tails() {
        assert_eq!(tail_lines("a\nb\nc\n", 2), "  b\n  c");
        assert_eq!(tail_lines("", 2), "  (empty log)");
    }
}
