//! `tcpxd` daemons as separate processes (the built binary), for tests that kill them.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tcpxd::api::proto::v1::tcpxd_client::TcpxdClient;
use tonic::transport::Channel;

pub struct ProcDaemon {
    pub child: Child,
    pub node: String,
    pub dir: PathBuf,
    pub api_socket: PathBuf,
    pub peer_addr: String,
}

/// A free loopback port (bound, then released, so a daemon can take it and take it again).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `tcpxd` on the built-in emulation (or `TCPXD_TEST_PLUGIN`'s plugin) with a TCP API on loopback; `peer_port` 0 picks one.
/// `config` is TOML for its configuration file; `env` goes to its environment.
pub async fn spawn(node: &str, peer_port: u16, config: &str, env: &[(&str, &str)]) -> ProcDaemon {
    let dir = std::env::temp_dir().join(format!(
        "tcpxd-proc-{}-{node}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    spawn_in(dir, node, peer_port, config, env).await
}

/// As [`spawn`], in a given directory (its API socket is `<dir>/api.sock`).
pub async fn spawn_in(
    dir: PathBuf,
    node: &str,
    peer_port: u16,
    config: &str,
    env: &[(&str, &str)],
) -> ProcDaemon {
    std::fs::create_dir_all(&dir).unwrap();
    let ready = dir.join("ready.json");
    std::fs::remove_file(&ready).ok();
    let cfg = dir.join("tcpxd.toml");
    std::fs::write(&cfg, config).unwrap();
    // TCPXD_TEST_DAEMON_BIN: another tcpxd binary (a release build, for benchmarks).
    let bin = std::env::var_os("TCPXD_TEST_DAEMON_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_tcpxd").into());
    let mut cmd = Command::new(bin);
    cmd.args(["--node-id", node]);
    // TCPXD_TEST_PLUGIN (tools/realplugin/run.sh) names a plugin file; unset, the emulation.
    match super::daemons::test_plugin_file() {
        Some(p) => cmd.arg("--plugin").arg(p),
        None => cmd.arg("--builtin-emulation"),
    };
    cmd.arg("--peer-listen")
        .arg(format!("127.0.0.1:{peer_port}"))
        .arg("--api-socket")
        .arg(dir.join("api.sock"))
        .arg("--ready-file")
        .arg(&ready)
        .arg("--config")
        .arg(&cfg)
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        // The daemon's log, for tests that read it (`log()`).
        .stderr(std::fs::File::create(dir.join("tcpxd.log")).expect("log file"));
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("tcpxd starts");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ready.exists() {
        assert!(Instant::now() < deadline, "{node}: no ready file");
        if let Some(s) = child.try_wait().unwrap() {
            panic!("{node}: tcpxd exited early: {s:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The ready file is written in one go, but give a partial read a second chance.
    let info: serde_json::Value = loop {
        if let Ok(v) = serde_json::from_str(&std::fs::read_to_string(&ready).unwrap()) {
            break v;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    ProcDaemon {
        child,
        node: node.to_string(),
        dir: dir.clone(),
        api_socket: dir.join("api.sock"),
        peer_addr: info["peer_address"].as_str().unwrap().to_string(),
    }
}

impl ProcDaemon {
    pub async fn client(&self) -> TcpxdClient<Channel> {
        super::daemons::unix_client(self.api_socket.clone()).await
    }

    /// SIGKILL: no drain, no goodbye.
    pub fn kill(&mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reaped");
        std::fs::remove_dir_all(&self.dir).ok();
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// SIGTERM, then waits (at most 60 s, then SIGKILL) for the daemon to drain and exit.
    pub fn terminate(&mut self) {
        // SAFETY: sending SIGTERM to the child we spawned (not yet reaped).
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while let Ok(None) = self.child.try_wait() {
            if std::time::Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("{}: still running 60 s after SIGTERM", self.node);
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// What the daemon logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("tcpxd.log")).unwrap_or_default()
    }
}

impl Drop for ProcDaemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        std::fs::remove_dir_all(&self.dir).ok();
    }
}
