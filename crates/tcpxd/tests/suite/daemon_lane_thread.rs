//! `runtime.lane_thread`: the send lanes' comms driven by a lane thread (`tcpxd-lanes` for lanes
//! opened under no GPU, as here). Many transfers in flight both ways move exactly, the threads
//! start with the first send lane (none before it), and every lane drains back to zero. (The whole suite runs with it too: `TCPXD_LANE_THREAD=on`.)

mod recv;

use crate::common::daemons::{self, *};
use tcpxd::api::proto::v1 as pb;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// The names of this process's threads that start with `name` (`tcpxd-lanes` for lanes opened
/// under no GPU; `tcpxd-lanes-<gpu>` where the node has GPUs: under Google's plugin with the
/// CUDA stand-in, tools/realplugin/run.sh, host lanes open under their NIC's GPU).
pub(crate) fn threads_named(name: &str) -> Vec<String> {
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

/// Sets a variable before any daemon (and so the emulation, and the lane threads' test hook)
/// reads it.
pub(crate) fn set_env(k: &str, v: &str) {
    // SAFETY: each test runs in its own process (nextest); this runs before any daemon starts.
    unsafe { std::env::set_var(k, v) };
}

/// A lane thread that panics (the debug builds' test hook `TCPXD_TEST_LANE_THREAD_PANIC_AT`:
/// its 24th post) is noticed at once: the transfers it carried end UNAVAILABLE naming the
/// thread and the panic (not at their deadline), every slot and credit comes back, a new lane
/// thread carries the next transfers byte-exact, and the daemon still answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_thread_that_panics_fails_its_transfers_at_once_and_the_next_work() {
    tcpxd::logging::init("error");
    set_env("TCPXD_TEST_LANE_THREAD_PANIC_AT", "24");
    // Paced (4 Gbit/s): the transfers are still in flight when the thread panics.
    set_env("TCPXEMU_RATE_GBPS", "4");
    let mut a = daemons::start("lanepanic-a", |a| a.lane_thread = Some("on".into())).await;
    let mut b = daemons::start("lanepanic-b", |a| a.lane_thread = Some("off".into())).await;
    connect(&mut a, &b).await;
    let n = 8u64;
    let chunk = 16 * MIB;
    let src = host_buffer(&mut a.client, n * chunk, "").await;
    let dst = host_buffer(&mut b.client, n * chunk, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 3).await;
    let mut ids = Vec::new();
    for i in 0..n {
        let e = write_entry(&src, i * chunk, &dst, i * chunk, chunk);
        ids.push(write(&mut a.client, e, b"").await.unwrap());
    }
    let mut failed = 0;
    for id in ids {
        let e = wait(&mut a.client, id).await;
        if e.status_code == 0 {
            continue;
        }
        failed += 1;
        assert_eq!(
            e.status_code,
            tonic::Code::Unavailable as i32,
            "transfer {id}: {}",
            e.status_message
        );
        assert!(
            // (`tcpxd-lanes`, or `tcpxd-lanes-<gpu>` where the node has GPUs: under
            // tools/realplugin/run.sh the CUDA stand-in's host lanes open under GPU 0)
            e.status_message.contains("lane thread tcpxd-lanes")
                && e.status_message
                    .contains(" panicked: TCPXD_TEST_LANE_THREAD_PANIC_AT"),
            "transfer {id}: {}",
            e.status_message
        );
    }
    assert!(failed > 0, "the panic failed the transfers in flight");
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    // The next transfers pair again and go on a new lane thread (the hook fires once).
    for round in 0..2 {
        fill_seed(&mut a.client, src.id, 0, 0, 20 + round).await;
        let mut ids = Vec::new();
        for i in 0..n {
            let e = write_entry(&src, i * chunk, &dst, i * chunk, chunk);
            ids.push(write(&mut a.client, e, b"").await.unwrap());
        }
        for id in ids {
            wait_ok(&mut a.client, id).await;
        }
        assert_eq!(
            crc(&mut b.client, dst.id, 0, n * chunk).await,
            crc(&mut a.client, src.id, 0, n * chunk).await,
            "round {round}"
        );
    }
    // One lane thread, the new one: the dead one is gone. (Counted on the emulation only: a
    // plugin's own threads started from a lane thread's calls carry its name, above.)
    let names = threads_named("tcpxd-lanes");
    if std::env::var_os("TCPXD_TEST_PLUGIN").is_none() {
        assert_eq!(names.len(), 1, "one lane thread, the new one: {names:?}");
    } else {
        assert!(!names.is_empty(), "a new lane thread: {names:?}");
    }
    assert_lanes_drain(&mut a.client).await;
    a.stop().await;
    b.stop().await;
}

/// A buffer released while sends from it wait on the lane thread: the release waits for the
/// transfer (the engine refuses to remove a buffer in use; `ReleaseBuffer` waits for its last
/// user), and once it returns no registration of the buffer is left on any comm (the
/// emulation counts them). With the lane thread and without.
async fn release_while_sending(on: bool) {
    tcpxd::logging::init("error");
    set_env("TCPXEMU_RATE_GBPS", "2");
    let mode = if on { "on" } else { "off" };
    let mut a = daemons::start("lanerelease-a", |a| a.lane_thread = Some(mode.into())).await;
    let mut b = daemons::start("lanerelease-b", |a| a.lane_thread = Some(mode.into())).await;
    connect(&mut a, &b).await;
    // A size no other registration has (the landing and staging rings are powers of two).
    let size = 48 * MIB + 12 * KIB;
    let count = || nccl_net_tcpxemu::live_registrations(size as usize);
    let src = host_buffer(&mut a.client, size, "").await;
    let dst = host_buffer(&mut b.client, size + 4 * KIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 7).await;
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, size), b"")
        .await
        .unwrap();
    // Released once the lanes registered the source (its sends are posted: 48 MiB at 2 Gbit/s
    // take ~200 ms on the lanes); the registration lives until the removal, so this cannot miss.
    let emulated = daemons::on_emulation();
    if emulated {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while count() == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the source never registered"
            );
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }
    a.client
        .release_buffer(pb::ReleaseBufferRequest { buffer_id: src.id })
        .await
        .expect("the release waits for the transfer instead of refusing");
    let e = wait(&mut a.client, id).await;
    assert_eq!(e.status_code, 0, "{}", e.status_message);
    assert_eq!(e.bytes_done, size);
    if emulated {
        // The lane thread drops its registrations on the order that follows the removal.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while count() > 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "{} registrations of the released buffer remain",
                count()
            );
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }
    assert_lanes_drain(&mut a.client).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_released_while_the_lane_thread_sends_from_it_waits_and_leaves_no_registration() {
    release_while_sending(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffer_released_while_the_poller_sends_from_it_waits_and_leaves_no_registration() {
    release_while_sending(false).await;
}
