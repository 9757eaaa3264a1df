//! Smoke tests of the benchmarks: `tcpxctl bench transfer` between two local daemons and
//! `tcpxctl bench raw`, on host memory with a few small sizes. They check that every size gives a
//! row, that the bytes were verified and that the numbers are sane; never how fast anything is.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

use serde_json::Value;
use tcpxctl::bench::raw::{RawOptions, run_raw};
use tcpxctl::bench::{Harness, Memory, Op, Workload};

const SIZES: [u64; 3] = [4096, 64 << 10, 1 << 20];

/// The tcpxd built with the tests, or `TCPXD_TEST_TCPXD` (as for tcpxctl below).
fn tcpxd_path() -> String {
    std::env::var("TCPXD_TEST_TCPXD")
        .unwrap_or_else(|_| tcpxd_testkit::workspace_bin("tcpxd").display().to_string())
}

/// The tcpxctl built with the tests, or `TCPXD_TEST_TCPXCTL` (test binaries copied to another
/// machine, such as the GPU host, run the tcpxctl copied beside them).
fn tcpxctl(args: &[&str]) -> Output {
    let exe = std::env::var_os("TCPXD_TEST_TCPXCTL").unwrap_or_else(|| env!("CARGO_BIN_EXE_tcpxctl").into());
    let out = Command::new(exe)
        .args(args)
        .env("TCPXD_ENDPOINT", "unix:/nonexistent/tcpxd.sock")
        .output()
        .expect("tcpxctl runs");
    assert!(
        out.status.success(),
        "tcpxctl {args:?} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn json_lines(text: &str) -> Vec<Value> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

/// The rows of one harness: one per size, in order, verified, with sane numbers.
fn check_rows(rows: &[Value], harness: &str, op: &str, batch: u64, iterations: u64) {
    let mine: Vec<&Value> = rows.iter().filter(|r| r["harness"] == harness).collect();
    let sizes: Vec<u64> = mine.iter().map(|r| r["block_size"].as_u64().unwrap()).collect();
    assert_eq!(sizes, SIZES, "{harness}: one row per size, in order");
    for r in mine {
        assert_eq!(r["op"], op, "{r}");
        assert_eq!(r["memory"], "host", "{r}");
        assert_eq!(r["batch_size"].as_u64(), Some(batch), "{r}");
        assert_eq!(r["iterations"].as_u64(), Some(iterations), "{r}");
        assert_eq!(
            r["bytes_per_transfer"].as_u64(),
            Some(r["block_size"].as_u64().unwrap() * batch),
            "{r}"
        );
        assert_eq!(r["verified"], true, "{r}");
        let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} missing in {r}"));
        assert!(f("gb_per_s") > 0.0, "{r}");
        assert!(f("min_lat_us") > 0.0, "{r}");
        assert!(f("min_lat_us") <= f("p50_lat_us"), "{r}");
        assert!(f("p50_lat_us") <= f("p99_lat_us"), "{r}");
        assert!(f("p99_lat_us") <= f("max_lat_us"), "{r}");
        assert!(
            f("min_lat_us") <= f("avg_lat_us") && f("avg_lat_us") <= f("max_lat_us"),
            "{r}"
        );
        assert!(r["lanes"].as_u64().is_some_and(|l| l >= 1), "{r}");
        assert_eq!(r["chunk_bytes"].as_u64(), Some(512 << 10), "{r}");
    }
}

fn temp_file(name: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("tcpxd-bench-smoke-{}-{name}", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

/// Both harnesses on a plugin file (`--plugin`): the emulation's library, or
/// `TCPXD_TEST_PLUGIN`'s (Google's real plugin under tools/realplugin/run.sh).
#[test]
fn bench_transfer_between_two_local_daemons_with_the_raw_bench_beside_it() {
    let out_file = temp_file("transfer.jsonl");
    let plugin = tcpxd_testkit::emulation_plugin_path();
    let out = tcpxctl(&[
        "bench",
        "transfer",
        "--plugin",
        plugin.to_str().unwrap(),
        "--raw",
        "--sizes",
        "4K,64K,1M",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--chunk-bytes",
        "512K",
        "--daemon",
        &tcpxd_testkit::workspace_bin("tcpxd").display().to_string(),
        "--out",
        out_file.to_str().unwrap(),
        "--json",
    ]);
    let rows = json_lines(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(rows.len(), 6, "3 raw rows and 3 daemon rows");
    check_rows(&rows, "raw", "WRITE", 1, 2);
    check_rows(&rows, "daemon", "WRITE", 1, 2);
    let saved = json_lines(&std::fs::read_to_string(&out_file).expect("--out written"));
    assert_eq!(saved, rows, "--out holds the same rows");
    let _ = std::fs::remove_file(&out_file);
}

/// `--via local`: the same transfers on a framed local session (rows `daemon-local`), WRITE and
/// READ with several in flight, the bytes verified.
#[test]
fn bench_transfer_via_the_framed_local_session() {
    for op in ["write", "read"] {
        let out = tcpxctl(&[
            "bench",
            "transfer",
            "--via",
            "local",
            "--op",
            op,
            "--sizes",
            "4K,64K,1M",
            "--iters",
            "6",
            "--warmup",
            "1",
            "--concurrency",
            "4",
            "--chunk-bytes",
            "512K",
            "--daemon",
            &tcpxd_testkit::workspace_bin("tcpxd").display().to_string(),
            "--json",
        ]);
        let rows = json_lines(&String::from_utf8_lossy(&out.stdout));
        assert_eq!(rows.len(), 3, "{rows:?}");
        check_rows(&rows, "daemon-local", &op.to_uppercase(), 1, 6);
        assert!(
            rows.iter().all(|r| r["concurrency"].as_u64() == Some(4)),
            "{rows:?}"
        );
    }
}

#[test]
fn bench_transfer_prints_a_table_for_batched_reads() {
    let out = tcpxctl(&[
        "bench",
        "transfer",
        "--op",
        "read",
        "--batch",
        "3",
        "--sizes",
        "4K,64K,1M",
        "--iters",
        "2",
        "--warmup",
        "0",
        "--daemon",
        &tcpxd_testkit::workspace_bin("tcpxd").display().to_string(),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    for col in [
        "block size",
        "batch",
        "GB/s",
        "avg lat (us)",
        "p50 (us)",
        "p99 (us)",
    ] {
        assert!(lines[0].contains(col), "header lacks {col:?}: {}", lines[0]);
    }
    let rows: Vec<&&str> = lines.iter().filter(|l| l.starts_with("daemon")).collect();
    assert_eq!(rows.len(), 3, "{text}");
    for (row, size) in rows.iter().zip(["4.00 KiB", "64.00 KiB", "1.00 MiB"]) {
        assert!(
            // The bytes-checked cell is last, or next to last when the table adds a "host steal"
            // column (a VM whose hypervisor took CPU time while the row ran).
            row.contains("READ")
                && row.contains(size)
                && row.split_whitespace().rev().take(2).any(|cell| cell == "yes"),
            "{row}"
        );
    }
}

#[test]
fn bench_raw_prints_json_lines_and_appends_to_out() {
    let out_file = temp_file("raw.jsonl");
    std::fs::write(&out_file, "{\"earlier\":true}\n").unwrap();
    let out = tcpxctl(&[
        "bench",
        "raw",
        "--sizes",
        "4K,64K,1M",
        "--iters",
        "2",
        "--batch",
        "2",
        "--json",
        "--out",
        out_file.to_str().unwrap(),
    ]);
    let rows = json_lines(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(rows.len(), 3);
    check_rows(&rows, "raw", "WRITE", 2, 2);
    let saved = json_lines(&std::fs::read_to_string(&out_file).unwrap());
    assert_eq!(saved.len(), 4, "appended after the earlier line");
    assert_eq!(saved[1..], rows[..]);
    let _ = std::fs::remove_file(&out_file);
}

fn raw_options(memory: Memory) -> RawOptions {
    RawOptions {
        workload: Workload {
            op: Op::Write,
            memory,
            peer_memory: None,
            // A size that is not a multiple of the chunk, and chunks over several lanes.
            sizes: vec![1, 4096 + 5, 3 * (64 << 10) + 7],
            batch: 3,
            iterations: 3,
            warmup: 1,
            concurrency: 1,
        },
        plugin: None,
        chunk_bytes: 64 << 10,
        lanes_per_device: 3,
        spread_min_chunk: 0,
        spread_chunks_per_lane: 2,
        devices: None,
        send_window: 12,
        recv_window: 16,
        unpack_impl: tcpxd::unpack::UnpackImpl::default(),
        connect_timeout: Duration::from_secs(30),
        stall_timeout: Duration::from_secs(60),
    }
}

#[test]
fn raw_bench_moves_odd_sizes_over_several_lanes() {
    let opts = raw_options(Memory::Host);
    let rows = run_raw(&opts, &indicatif::ProgressBar::hidden()).expect("raw bench runs");
    assert_eq!(rows.len(), 3);
    for (r, size) in rows.iter().zip(&opts.workload.sizes) {
        assert_eq!(r.harness, Harness::Raw);
        assert_eq!(r.block_size, *size);
        assert_eq!(r.batch_size, 3);
        assert!(r.verified);
        assert_eq!(r.lanes, Some(3));
        assert!(r.latency.min <= r.latency.p50 && r.latency.p50 <= r.latency.p99);
    }
}

#[test]
fn raw_bench_spreads_transfers_of_few_chunks_as_the_engine_does() {
    // A batch of 3 × (4 KiB + 5) over 3 lanes at 64 KiB is 3 chunks, spread: 6 of at most 4 KiB;
    // 3 × 1 byte cannot be cut; 3 × (192 KiB + 7) is 12 chunks already. Every byte lands.
    let mut opts = raw_options(Memory::Host);
    opts.spread_min_chunk = 4096;
    let rows = run_raw(&opts, &indicatif::ProgressBar::hidden()).expect("raw bench runs");
    assert_eq!(rows.len(), 3);
    assert!(rows.iter().all(|r| r.verified), "every byte compared");
    // Four chunks a lane (`transfer.spread_chunks_per_lane`): 3 × (64 KiB + 5) is 6 chunks, two
    // a lane, left alone at two; at four, 15 of at most 16 KiB.
    opts.spread_chunks_per_lane = 4;
    opts.workload.sizes = vec![(64 << 10) + 5];
    let rows = run_raw(&opts, &indicatif::ProgressBar::hidden()).expect("raw bench runs");
    assert!(rows.len() == 1 && rows[0].verified, "every byte compared");
    for bad in [0, 17] {
        opts.spread_chunks_per_lane = bad;
        let e = run_raw(&opts, &indicatif::ProgressBar::hidden())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--spread-chunks-per-lane") && e.contains("1..=16"),
            "{e}"
        );
    }
    opts.spread_chunks_per_lane = 2;
    opts.spread_min_chunk = 100;
    let e = run_raw(&opts, &indicatif::ProgressBar::hidden())
        .unwrap_err()
        .to_string();
    assert!(e.contains("--spread-min-chunk-bytes"), "{e}");
}

#[test]
fn raw_bench_rejects_bad_options_by_name() {
    let mut opts = raw_options(Memory::Host);
    opts.workload.batch = 0;
    let e = run_raw(&opts, &indicatif::ProgressBar::hidden())
        .unwrap_err()
        .to_string();
    assert!(e.contains("--batch"), "{e}");
    let mut opts = raw_options(Memory::Host);
    opts.send_window = 17;
    let e = run_raw(&opts, &indicatif::ProgressBar::hidden())
        .unwrap_err()
        .to_string();
    assert!(e.contains("--send-window"), "{e}");
    let mut opts = raw_options(Memory::Host);
    opts.devices = Some(vec![99]);
    let e = run_raw(&opts, &indicatif::ProgressBar::hidden())
        .unwrap_err()
        .to_string();
    assert!(e.contains("--device 99"), "{e}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn raw_bench_on_cuda_memory() {
    let rows =
        run_raw(&raw_options(Memory::Cuda(0)), &indicatif::ProgressBar::hidden()).expect("raw bench runs");
    assert_eq!(rows.len(), 3);
    assert!(rows.iter().all(|r| r.verified));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bench_transfer_on_cuda_memory_with_the_raw_bench() {
    let out = tcpxctl(&[
        "bench",
        "transfer",
        "--raw",
        "--cuda",
        "0",
        "--sizes",
        "4K,64K,1M",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--daemon",
        &tcpxd_path(),
        "--json",
    ]);
    let rows = json_lines(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(rows.len(), 6);
    for r in &rows {
        assert_eq!(r["memory"], "cuda:0", "{r}");
        assert_eq!(r["verified"], true, "{r}");
    }
}

/// `--blocks N --block-size S`: one row, scattered beside contiguous, both verified, then the
/// same as a READ in a table.
#[test]
fn bench_transfer_blocks_measures_scattered_beside_contiguous() {
    let out_file = temp_file("blocks.jsonl");
    let daemon = tcpxd_testkit::workspace_bin("tcpxd").display().to_string();
    let out = tcpxctl(&[
        "bench",
        "transfer",
        "--blocks",
        "512",
        "--block-size",
        "4K",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--seed",
        "7",
        "--daemon",
        &daemon,
        "--out",
        out_file.to_str().unwrap(),
        "--json",
    ]);
    let rows = json_lines(&String::from_utf8_lossy(&out.stdout));
    assert_eq!(rows.len(), 1, "one block row");
    let r = &rows[0];
    assert_eq!(r["harness"], "daemon-blocks", "{r}");
    assert_eq!(r["op"], "WRITE", "{r}");
    assert_eq!(
        (
            r["blocks"].as_u64(),
            r["block_size"].as_u64(),
            r["bytes"].as_u64()
        ),
        (Some(512), Some(4096), Some(512 * 4096)),
        "{r}"
    );
    assert_eq!(
        (r["verified"].as_bool(), r["checked"].as_str()),
        (Some(true), Some("all pairs")),
        "{r}"
    );
    for side in ["scattered", "contiguous"] {
        let f = |k: &str| {
            r[side][k]
                .as_f64()
                .unwrap_or_else(|| panic!("{side}.{k} missing in {r}"))
        };
        assert!(f("gbps") > 0.0, "{r}");
        assert!(
            f("posting_p50_us") > 0.0 && f("posting_p50_us") <= f("latency_p50_us"),
            "{r}"
        );
    }
    assert!(r["ratio"].as_f64().is_some_and(|x| x > 0.0), "{r}");
    let saved = json_lines(&std::fs::read_to_string(&out_file).expect("--out written"));
    assert_eq!(saved, rows, "--out holds the same row");
    let _ = std::fs::remove_file(&out_file);

    let out = tcpxctl(&[
        "bench",
        "transfer",
        "--op",
        "read",
        "--blocks",
        "300",
        "--block-size",
        "1000",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--daemon",
        &daemon,
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("scattered") && text.contains("contiguous"),
        "{text}"
    );
    assert!(text.contains("scattered/contiguous:"), "{text}");
}
