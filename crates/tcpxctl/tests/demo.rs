//! The README's main job, `tcpxctl demo`, end to end with the real binaries: two tcpxd
//! processes on the built-in emulation, a WRITE and a READ back, checksums compared (a smaller
//! size than the command's 1 GiB default, to keep CI quick).

use tcpxctl::cli::demo::{DemoOptions, run_demo};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_moves_data_both_ways_between_two_daemon_processes() {
    let report = run_demo(&DemoOptions {
        daemon: Some(tcpxd_testkit::workspace_bin("tcpxd")),
        size: 64 << 20,
        ..DemoOptions::default()
    })
    .await
    .expect("demo succeeds");
    assert_eq!(report.size, 64 << 20);
    // Both daemons served metrics; A started the write and the read, both of size bytes.
    assert_eq!(report.metrics.len(), 2, "{:?}", report.metrics);
    let a = &report.metrics[0];
    assert_eq!(a.transfers_ok, 2.0, "{a:?}");
    assert_eq!(a.bytes_ok, 2.0 * report.size as f64, "{a:?}");
    assert_ne!(report.write_transfer_id, 0);
    assert!(report.kept_dir.is_none(), "the temp dir is removed after success");
    // B only served: its report line says so rather than reading as a failure.
    let text = report.to_string();
    assert!(
        text.contains("2 transfers started here finished ok, 128.00 MiB"),
        "{text}"
    );
    assert!(
        text.contains("(demo-b): started no transfers (it served demo-a's)"),
        "{text}"
    );
}

/// The command as a user runs it: no log paths on stderr for a directory it then removes.
#[test]
fn the_demo_command_names_no_log_it_deletes() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tcpxctl"))
        .args(["demo", "--size", "4M", "--daemon"])
        .arg(tcpxd_testkit::workspace_bin("tcpxd"))
        .output()
        .expect("tcpxctl runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("checksums match"), "{stdout}");
    assert!(stderr.contains("started demo-a (pid"), "{stderr}");
    assert!(!stderr.contains(".log"), "names a log it deletes: {stderr}");
    assert!(!stdout.contains("kept"), "{stdout}");
}
