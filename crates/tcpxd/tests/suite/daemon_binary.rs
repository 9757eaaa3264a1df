//! The tcpxd binary itself: start-up with a ready file, the API socket's mode, SIGTERM, and the
//! message when the TCPX plugin is missing (never a silent fallback to the emulation).

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::daemons::unix_client;
use tcpxd::api::proto::v1 as pb;
use tcpxd_testkit::ScratchDir;

/// A fresh directory of this test under the temp dir, removed when the test ends (passed or not).
fn temp_dir(tag: &str) -> ScratchDir {
    let d = ScratchDir::fresh("tcpxd-bin", tag);
    std::fs::create_dir_all(&*d).unwrap();
    d
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_serves_on_its_socket_and_stops_on_sigterm() {
    let dir = temp_dir("run");
    let sock = dir.join("api.sock");
    let ready = dir.join("ready.json");
    let mut child = Command::new(env!("CARGO_BIN_EXE_tcpxd"))
        .args([
            "--node-id",
            "bin-a",
            "--builtin-emulation",
            "--peer-listen",
            "127.0.0.1:0",
        ])
        .arg("--api-socket")
        .arg(&sock)
        .arg("--ready-file")
        .arg(&ready)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tcpxd starts");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ready.exists() {
        assert!(Instant::now() < deadline, "no ready file");
        assert!(child.try_wait().unwrap().is_none(), "tcpxd exited early");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let info: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&ready).unwrap()).unwrap();
    assert_eq!(info["node_id"], "bin-a");
    assert!(info["peer_address"].as_str().unwrap().starts_with("127.0.0.1:"));
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660, "the API socket is group-accessible only");

    let mut c = unix_client(sock.clone()).await;
    let b = c
        .register_buffer(pb::RegisterBufferRequest {
            reattach_id: Default::default(),
            reattach_key: Default::default(),
            source: Some(pb::register_buffer_request::Source::Host(pb::HostAllocation {
                size: 4096,
            })),
            label: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(b.descriptor.starts_with("tcpxd1:bin-a:"));

    // SAFETY: sending SIGTERM to the child we spawned.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let deadline = Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "tcpxd ignored SIGTERM");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{status:?}");
    assert!(!sock.exists(), "the socket is removed on exit");
    // stderr is a pipe, not a terminal: plain text, no colour codes in a log file.
    let mut log = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut log).unwrap();
    assert!(log.contains("WARN"), "the emulation warning is logged: {log}");
    assert!(!log.contains('\x1b'), "ANSI escapes in a redirected log: {log:?}");
    // The stop line says what it counts: every transfer started here, then the drain's share.
    assert!(
        log.contains("tcpxd stopped: transfers started here, over its life: 0 ok, 0 failed; of those in flight at the stop, 0 finished within the grace period, 0 failed at its end"),
        "{log}"
    );
}

#[test]
fn a_missing_plugin_is_named_with_the_fix_and_never_replaced_silently() {
    let dir = temp_dir("missing");
    let out = Command::new(env!("CARGO_BIN_EXE_tcpxd"))
        .args(["--node-id", "bin-b", "--plugin", "/nonexistent/libnccl-net.so"])
        .arg("--api-socket")
        .arg(dir.join("api.sock"))
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    for words in [
        "/nonexistent/libnccl-net.so",
        "does not exist",
        "--plugin",
        "noexec",
        "--builtin-emulation",
    ] {
        assert!(err.contains(words), "stderr should mention {words:?}: {err}");
    }
    assert!(!dir.join("api.sock").exists(), "nothing was served");
}

#[test]
fn bad_configuration_exits_with_a_named_setting() {
    let out = Command::new(env!("CARGO_BIN_EXE_tcpxd"))
        .args(["--node-id", "has:colon", "--builtin-emulation"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("node_id"));
}

#[test]
fn tells_systemd_it_is_ready_pings_the_watchdog_and_says_when_stopping() {
    use std::os::unix::net::UnixDatagram;
    let dir = temp_dir("notify");
    let notify = dir.join("notify.sock");
    let sock = UnixDatagram::bind(&notify).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_tcpxd"))
        .args([
            "--node-id",
            "bin-n",
            "--builtin-emulation",
            "--peer-listen",
            "127.0.0.1:0",
        ])
        .arg("--api-socket")
        .arg(dir.join("api.sock"))
        .env("NOTIFY_SOCKET", &notify)
        .env("WATCHDOG_USEC", "200000")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut buf = [0u8; 512];
    let mut seen = Vec::new();
    let mut recv = |seen: &mut Vec<String>| {
        let n = sock.recv(&mut buf).expect("a notification");
        seen.push(String::from_utf8_lossy(&buf[..n]).to_string());
    };
    recv(&mut seen);
    assert!(seen[0].contains("READY=1"), "{seen:?}");
    assert!(seen[0].contains("STATUS=serving node bin-n"), "{seen:?}");
    // Watchdog pings follow at half the 200 ms period.
    recv(&mut seen);
    recv(&mut seen);
    assert!(seen[1..].iter().all(|m| m.contains("WATCHDOG=1")), "{seen:?}");
    // SAFETY: sending SIGTERM to the child we spawned.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let deadline = Instant::now() + Duration::from_secs(15);
    while !seen.last().unwrap().contains("STOPPING=1") {
        assert!(Instant::now() < deadline, "no STOPPING=1: {seen:?}");
        recv(&mut seen);
    }
    assert!(child.wait().unwrap().success());
}
