//! `runtime.lane_thread`: the send lanes' comms driven by a lane thread (`tcpxd-lanes` for lanes
//! opened under no GPU, as here). Many transfers in flight both ways move exactly, the threads
//! start with the first send lane (none before it), and every lane drains back to zero. (The whole suite runs with it too: `TCPXD_LANE_THREAD=on`.)

use crate::common::daemons::{self, *};

const KIB: u64 = 1 << 10;

/// The names of this process's threads that start with `name` (`tcpxd-lanes` for lanes opened
/// under no GPU; `tcpxd-lanes-<gpu>` where the node has GPUs: under Google's plugin with the
/// CUDA stand-in, tools/realplugin/run.sh, host lanes open under their NIC's GPU).
fn threads_named(name: &str) -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|c| c.trim_end().to_string())
        .filter(|c| c.starts_with(name))
        .collect()
}

/// The daemons (one process) have lane threads now. Not counted exactly: a thread the plugin
/// starts from inside a call on a lane thread inherits its name (Google's plugin starts its
/// socket helpers at a comm's first `isend`: under tools/realplugin/run.sh six threads were named
/// `tcpxd-lanes-0` for the two daemons' one lane thread each), and a node with GPUs opens host
/// lanes under its NICs' GPUs (`tcpxd-lanes-<gpu>`).
fn assert_lane_threads(round: u64) {
    let names = threads_named("tcpxd-lanes");
    assert!(!names.is_empty(), "round {round}: no lane thread: {names:?}");
}

async fn lane_thread_pair(name: &str) -> (TestDaemon, TestDaemon) {
    let on = |a: &mut tcpxd::config::DaemonArgs| a.lane_thread = Some("on".into());
    let mut a = daemons::start(&format!("{name}-a"), on).await;
    let b = daemons::start(&format!("{name}-b"), on).await;
    connect(&mut a, &b).await;
    (a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_and_reads_in_flight_move_exactly_on_the_lane_thread() {
    tcpxd::logging::init("warn");
    let (mut a, mut b) = lane_thread_pair("lanethread").await;
    // Each starts with the first send lane connected under its GPU (none here): none yet.
    assert_eq!(
        threads_named("tcpxd-lanes"),
        Vec::<String>::new(),
        "no send lane connected yet"
    );
    let n = 32u64;
    // Past `transfer.inline_max_bytes` (64 KiB): every transfer goes on the lanes.
    let chunk = 256 * KIB;
    let src = host_buffer(&mut a.client, n * chunk, "").await;
    let dst = host_buffer(&mut b.client, n * chunk, "").await;
    let back = host_buffer(&mut a.client, n * chunk, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 11).await;
    for round in 0..3 {
        let mut ids = Vec::new();
        for i in 0..n {
            let e = write_entry(&src, i * chunk, &dst, i * chunk, chunk);
            ids.push(write(&mut a.client, e, b"").await.unwrap());
        }
        for id in ids {
            wait_ok(&mut a.client, id).await;
        }
        // READs pull b's bytes back: b's send lanes carry them.
        let mut ids = Vec::new();
        for i in 0..n {
            let e = read_entry(&dst, i * chunk, &back, i * chunk, chunk);
            ids.push(read(&mut a.client, e).await.unwrap());
        }
        for id in ids {
            wait_ok(&mut a.client, id).await;
        }
        let want = crc(&mut a.client, src.id, 0, n * chunk).await;
        assert_eq!(
            crc(&mut b.client, dst.id, 0, n * chunk).await,
            want,
            "round {round}"
        );
        assert_eq!(
            crc(&mut a.client, back.id, 0, n * chunk).await,
            want,
            "round {round}"
        );
        // a's lanes carried the WRITEs, b's the READs: lane threads in each daemon.
        assert_lane_threads(round);
        fill_seed(&mut a.client, src.id, 0, 0, 12 + round).await;
    }
    // One large transfer too (4 MiB chunks, the lane's window full).
    let big = host_buffer(&mut a.client, 64 << 20, "").await;
    let far = host_buffer(&mut b.client, 64 << 20, "").await;
    fill_seed(&mut a.client, big.id, 0, 0, 5).await;
    let id = write(&mut a.client, write_entry(&big, 0, &far, 0, 64 << 20), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    assert_eq!(
        crc(&mut a.client, big.id, 0, 64 << 20).await,
        crc(&mut b.client, far.id, 0, 64 << 20).await
    );
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}
