//! The README's main job, `tcpxctl demo`, end to end with the real binaries: two tcpxd
//! processes on the built-in emulation, a WRITE and a READ back, checksums compared (a smaller
//! size than the command's 1 GiB default, to keep CI quick).

mod common;

use tcpxctl::cli::demo::{DemoOptions, run_demo};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_moves_data_both_ways_between_two_daemon_processes() {
    let report = run_demo(&DemoOptions {
        daemon: Some(common::tcpxd_bin()),
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
}
