//! A peer daemon (a separate `tcpxd` process) killed with SIGKILL in the middle of a 256 MiB write,
//! again and again: each write ends UNAVAILABLE naming the peer within the heartbeat bound, the
//! surviving daemon's lanes and transfers drain to zero, its other peer keeps moving byte-exact
//! data meanwhile, and the next write to the restarted peer reconnects by itself.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::common::daemons::{self, *};
use crate::common::procs;
use tcpxd::api::proto::v1 as pb;

const MIB: u64 = 1 << 20;
const BIG: u64 = 256 * MIB;
/// The default heartbeat timeout: the bound on noticing a dead peer.
const BOUND: Duration = Duration::from_millis(tcpxd::config::DEFAULT_HEARTBEAT_TIMEOUT_MS);

fn kills() -> usize {
    std::env::var("TCPXD_TEST_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20)
}

/// Waits until the write has moved at least `min` bytes (and not finished).
async fn until_midway(c: &mut Client, id: u64, min: u64) -> pb::TransferEvent {
    let mut events = c
        .watch(pb::WatchRequest { transfer_id: id })
        .await
        .expect("watch")
        .into_inner();
    while let Some(e) = events.message().await.expect("watch stream") {
        if e.state == pb::TransferState::Finished as i32 || e.bytes_done >= min {
            return e;
        }
    }
    panic!("watch ended before the transfer finished");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_peers_fail_their_transfers_fast_and_come_back() {
    tcpxd::logging::init("error");
    // The survivor paces its sends (4 Gbit/s) so the kill lands in the middle of the write.
    let a = procs::spawn("loss-a", 0, "", &[("TCPXEMU_RATE_GBPS", "4")]).await;
    let mut ac = a.client().await;
    let b_port = procs::free_port();
    let mut b = procs::spawn("loss-b", b_port, "", &[]).await;
    let mut c = daemons::start("loss-c", |_| {}).await;

    ac.connect_peer(pb::ConnectPeerRequest {
        address: b.peer_addr.clone(),
    })
    .await
    .expect("a pairs with b");
    ac.connect_peer(pb::ConnectPeerRequest {
        address: c.peer_addr(),
    })
    .await
    .expect("a pairs with c");

    let big = host_buffer(&mut ac, BIG, "big").await;
    fill_seed(&mut ac, big.id, 0, 0, 7).await;
    let small = host_buffer(&mut ac, 4 * MIB, "small").await;
    let c_dst = host_buffer(&mut c.client, 4 * MIB, "c-dst").await;

    // Meanwhile a → c keeps moving byte-exact data.
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let side = {
        let (stop, rounds) = (stop.clone(), rounds.clone());
        let (mut ac, mut cc) = (ac.clone(), c.client.clone());
        let (small, c_dst) = (small.clone(), c_dst.clone());
        tokio::spawn(async move {
            let mut seed = 100;
            while !stop.load(Ordering::Relaxed) {
                seed += 1;
                fill_seed(&mut ac, small.id, 0, 0, seed).await;
                let want = crc(&mut ac, small.id, 0, 0).await;
                let id = write(&mut ac, write_entry(&small, 0, &c_dst, 0, 4 * MIB), b"")
                    .await
                    .expect("a → c write starts");
                wait_ok(&mut ac, id).await;
                assert_eq!(crc(&mut cc, c_dst.id, 0, 0).await, want, "a → c round {seed}");
                rounds.fetch_add(1, Ordering::Relaxed);
            }
        })
    };

    let n = kills();
    for round in 0..n {
        let mut bc = b.client().await;
        let dst = host_buffer(&mut bc, BIG, "dst").await;
        // From the second round on, b is a new process: this write pairs again by itself.
        let id = write(&mut ac, write_entry(&big, 0, &dst, 0, BIG), b"")
            .await
            .unwrap_or_else(|s| panic!("round {round}: the write to b did not start: {s}"));
        let seen = until_midway(&mut ac, id, 8 * MIB).await;
        assert_ne!(
            seen.state,
            pb::TransferState::Finished as i32,
            "round {round}: the write ended before the kill: {seen:?}"
        );
        // The pairing carries its control messages on its direct connection
        // (`peer.direct_control`, on by default): that is what the kill breaks too.
        let before = ac.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
        assert!(
            before
                .peers
                .iter()
                .any(|p| p.node_id == "loss-b" && p.direct_control && p.direct_messages_sent > 0),
            "round {round}: {:?}",
            before.peers
        );
        b.kill();
        let killed = Instant::now();
        let end = wait(&mut ac, id).await;
        let took = killed.elapsed();
        assert_eq!(
            end.status_code,
            tonic::Code::Unavailable as i32,
            "round {round}: {}",
            end.status_message
        );
        assert!(
            end.status_message.contains("loss-b"),
            "round {round}: the status names the peer: {}",
            end.status_message
        );
        // The bound, plus room for a loaded 2-core machine to schedule the detection.
        assert!(
            took < BOUND + Duration::from_secs(2),
            "round {round}: failed {took:?} after the kill"
        );
        assert_lanes_drain(&mut ac).await;
        b = procs::spawn("loss-b", b_port, "", &[]).await;
    }

    // The last restart: a full write to it completes byte-exact.
    let mut bc = b.client().await;
    let dst = host_buffer(&mut bc, 16 * MIB, "dst").await;
    let id = write(&mut ac, write_entry(&big, 0, &dst, 0, 16 * MIB), b"")
        .await
        .expect("a write to the returned peer starts");
    wait_ok(&mut ac, id).await;
    assert_eq!(
        crc(&mut bc, dst.id, 0, 0).await,
        crc(&mut ac, big.id, 0, 16 * MIB).await
    );

    stop.store(true, Ordering::Relaxed);
    side.await.expect("a → c traffic never failed");
    assert!(
        rounds.load(Ordering::Relaxed) > 0,
        "a → c moved data during the kills"
    );
    assert_lanes_drain(&mut ac).await;
    let stats = ac.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    assert_eq!(stats.active_transfers, 0);
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigkilled_daemon_restarts_clean_on_its_own_socket_and_port() {
    tcpxd::logging::init("error");
    let dir = std::env::temp_dir().join(format!("tcpxd-restart-{}", std::process::id()));
    let port = procs::free_port();
    let mut d = procs::spawn_in(dir.clone(), "restart-a", port, "", &[]).await;
    let mut c = d.client().await;
    let b = host_buffer(&mut c, MIB, "before").await;
    // SIGKILL leaves the API socket file behind; the restart replaces it and binds the same port.
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    assert!(dir.join("api.sock").exists(), "a killed daemon leaves its socket");
    let d = procs::spawn_in(dir.clone(), "restart-a", port, "", &[]).await;
    assert_eq!(d.peer_addr, format!("127.0.0.1:{port}"));
    let mut c = d.client().await;
    let list = c
        .list_buffers(pb::ListBuffersRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(
        list.buffers.is_empty(),
        "nothing survives a restart: {:?}",
        list.buffers
    );
    let stats = c.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    assert!(stats.peers.is_empty() && stats.active_transfers == 0, "{stats:?}");
    let again = host_buffer(&mut c, MIB, "after").await;
    assert_ne!(again.descriptor, b.descriptor, "old descriptors do not come back");
    drop(d);
    std::fs::remove_dir_all(dir).ok();
}
