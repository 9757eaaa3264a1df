//! Every close of a GPU lane's comm runs with the GPU it was opened under current, as its listen
//! and connect did (issue #37): lanes closed when idle (`peer.lane_idle_close_ms`, on the
//! poller's thread, where another lane's GPU is current by then) and lanes closed by the
//! daemon's drain at SIGTERM, on the stand-in's eight GPUs and four emulated NICs. The
//! emulation logs, for each comm closed in CUDA mode, the GPU current then against the comm's
//! own (Google's plugin frees a comm's device queue under its own GPU and, built on the CUDA
//! runtime, leaves that GPU current on the closing thread).

use crate::common::daemons::*;
use crate::common::gpus::{assert_same, cuda_buffer};
use crate::common::procs;
use crate::topology::{a3_env, lane_bytes, refs};

const MIB: u64 = 1 << 20;

fn env() -> Vec<(String, String)> {
    let mut env = a3_env();
    env.extend(
        [
            ("TCPXEMU_BOUNCE", "cuda"),
            ("TCPXEMU_BOUNCE_PAGES", "2048"),
            ("UCCL_TCPX_UNPACK_IMPL", "d2d"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    env
}

/// WRITEs between three GPU pairs and host memory, waited for and compared: lanes opened under
/// GPUs 3, 0, 6 at `a` and 5, 7, 2 at `b`.
async fn move_bytes(ac: &mut Client, bc: &mut Client) {
    let len = MIB + 5;
    for (s, d) in [(3u32, 5u32), (0, 7), (6, 2)] {
        let src = cuda_buffer(ac, s, 2 * MIB).await;
        let dst = cuda_buffer(bc, d, 2 * MIB).await;
        fill_seed(ac, src.id, 0, 0, 7 + u64::from(s)).await;
        let id = write(ac, write_entry(&src, 0, &dst, 0, len), b"").await.unwrap();
        wait_ok(ac, id).await;
        assert_same(
            ac,
            (src.id, 0),
            bc,
            (dst.id, 0),
            len,
            &format!("GPU {s} -> GPU {d}"),
        )
        .await;
    }
}

/// The emulation judged `at_least` closes (the log's limit per call site: 10) and found none
/// under another GPU (its own call site, whose first line is always logged).
fn assert_closed_under_own_gpus(node: &str, log: &str, at_least: usize) {
    let own = log.matches("comm closed under its own GPU").count();
    assert!(own >= at_least, "{node}: {own} closes judged\n{log}");
    assert!(!log.contains("not its own GPU"), "{node}: {log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_lanes_close_under_their_own_gpus() {
    tcpxd::logging::init("error");
    if test_plugin_file().is_some() {
        return;
    }
    let env = env();
    let idle = "[peer]\nlane_idle_close_ms = 300\n";
    let a = procs::spawn("closes-idle-a", 0, idle, &refs(&env)).await;
    let b = procs::spawn(
        "closes-idle-b",
        0,
        &format!("{idle}[topology]\nmap = \"a3vm\"\n"),
        &refs(&env),
    )
    .await;
    let mut ac = a.client().await;
    let mut bc = b.client().await;
    move_bytes(&mut ac, &mut bc).await;
    // Every lane closes when idle, at both ends.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let (la, lb) = (lane_bytes(&mut ac).await, lane_bytes(&mut bc).await);
        let open = la
            .iter()
            .chain(&lb)
            .filter(|l| {
                (l.send_state != "closed" && !l.send_state.is_empty())
                    || (l.recv_state != "closed" && !l.recv_state.is_empty())
            })
            .count();
        if open == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "lanes never closed: {la:?} {lb:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // Three GPU pairs' lanes, two a pair, each end: six comms closed at each daemon.
    assert_closed_under_own_gpus(&a.node, &a.log(), 6);
    assert_closed_under_own_gpus(&b.node, &b.log(), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drains_closes_run_under_each_lanes_own_gpu() {
    tcpxd::logging::init("error");
    if test_plugin_file().is_some() {
        return;
    }
    let env = env();
    let mut a = procs::spawn("closes-drain-a", 0, "", &refs(&env)).await;
    let mut b = procs::spawn("closes-drain-b", 0, "[topology]\nmap = \"a3vm\"\n", &refs(&env)).await;
    let mut ac = a.client().await;
    let mut bc = b.client().await;
    move_bytes(&mut ac, &mut bc).await;
    drop((ac, bc));
    // The lanes are open (idle close is 2 minutes away): the drain closes them.
    a.terminate();
    b.terminate();
    assert_closed_under_own_gpus(&a.node, &a.log(), 6);
    assert_closed_under_own_gpus(&b.node, &b.log(), 6);
}
