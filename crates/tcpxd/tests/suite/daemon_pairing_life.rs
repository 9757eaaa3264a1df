//! Pairings closed when idle (peer protocol 7, `engine::pair_life`), invisibly to clients: both
//! daemons agree (each reports the pairing idle, not failed, its counters kept), the next WRITE
//! or READ from either side pairs again and lands byte-exact, transfers racing the close land,
//! and a hung peer is still failed by the heartbeats while paired. Daemons on the emulation with
//! short `peer.lane_idle_close_ms` and `peer.pairing_idle_close_ms`.

use std::time::{Duration, Instant};

use crate::common::daemons::{self, *};
use crate::common::hold::Frozen;
use crate::common::procs;
use tcpxd::api::proto::v1 as pb;

const MIB: u64 = 1 << 20;

async fn idle_closing_pair(name: &str, lane_ms: u64, pairing_ms: u64) -> (TestDaemon, TestDaemon) {
    let set = |args: &mut tcpxd::config::DaemonArgs| {
        args.lane_idle_close_ms = Some(lane_ms);
        args.pairing_idle_close_ms = Some(pairing_ms);
    };
    let mut a = daemons::start(&format!("{name}-a"), set).await;
    let b = daemons::start(&format!("{name}-b"), set).await;
    connect(&mut a, &b).await;
    (a, b)
}

/// The daemon's one peer as ListPeers and GetStats show it.
async fn the_peer(c: &mut Client) -> (pb::Peer, pb::PeerStats) {
    let peers = c
        .list_peers(pb::ListPeersRequest {})
        .await
        .unwrap()
        .into_inner()
        .peers;
    let stats = c
        .get_stats(pb::GetStatsRequest {})
        .await
        .unwrap()
        .into_inner()
        .peers;
    assert_eq!(peers.len(), 1, "{peers:?}");
    // GetStats lists the pairings kept: one per node once a new one took over a closed one.
    let newest = stats.into_iter().last().expect("a pairing");
    (peers.into_iter().next().unwrap(), newest)
}

/// Waits (at most 20 s) until the daemon reports its pairing closed when idle.
async fn until_idle(c: &mut Client, who: &str) -> (pb::Peer, pb::PeerStats) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (peer, stats) = the_peer(c).await;
        if peer.state == pb::PeerState::Idle as i32 {
            return (peer, stats);
        }
        assert!(
            Instant::now() < deadline,
            "{who}: the pairing never closed: {peer:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_pairings_close_on_both_sides_and_the_next_transfers_pair_again_byte_exact() {
    tcpxd::logging::init("warn");
    let (mut a, mut b) = idle_closing_pair("pairlife", 100, 400).await;
    let a_src = host_buffer(&mut a.client, 4 * MIB, "src").await;
    let a_back = host_buffer(&mut a.client, 4 * MIB, "back").await;
    let b_dst = host_buffer(&mut b.client, 4 * MIB, "dst").await;
    let b_src = host_buffer(&mut b.client, 4 * MIB, "bsrc").await;
    let a_in = host_buffer(&mut a.client, 4 * MIB, "in").await;
    for round in 0..3u64 {
        fill_seed(&mut a.client, a_src.id, 0, 0, 20 + round).await;
        fill_seed(&mut b.client, b_src.id, 0, 0, 40 + round).await;
        // Odd rounds: b (the side that was dialled first) uses the closed pairing first and
        // dials a itself.
        let b_first = round % 2 == 1;
        if b_first {
            let id = write(&mut b.client, write_entry(&b_src, 0, &a_in, 0, 4 * MIB), b"")
                .await
                .unwrap();
            wait_ok(&mut b.client, id).await;
        }
        let id = write(&mut a.client, write_entry(&a_src, 0, &b_dst, 0, 4 * MIB), b"")
            .await
            .unwrap();
        wait_ok(&mut a.client, id).await;
        let id = read(&mut a.client, read_entry(&b_dst, 0, &a_back, 0, 4 * MIB))
            .await
            .unwrap();
        wait_ok(&mut a.client, id).await;
        if !b_first {
            let id = write(&mut b.client, write_entry(&b_src, 0, &a_in, 0, 4 * MIB), b"")
                .await
                .unwrap();
            wait_ok(&mut b.client, id).await;
        }
        let want = crc(&mut a.client, a_src.id, 0, 0).await;
        assert_eq!(
            crc(&mut b.client, b_dst.id, 0, 0).await,
            want,
            "round {round}: WRITE"
        );
        assert_eq!(
            crc(&mut a.client, a_back.id, 0, 0).await,
            want,
            "round {round}: READ"
        );
        assert_eq!(
            crc(&mut a.client, a_in.id, 0, 0).await,
            crc(&mut b.client, b_src.id, 0, 0).await,
            "round {round}: b's WRITE"
        );
        // Idle for longer than the setting: both sides close it, by agreement, not failure.
        let (pa, sa) = until_idle(&mut a.client, "a").await;
        let (pb_, sb) = until_idle(&mut b.client, "b").await;
        for (who, p, s) in [("a", &pa, &sa), ("b", &pb_, &sb)] {
            assert!(p.error.is_empty() && s.error.is_empty(), "{who}: {p:?} {s:?}");
            assert_eq!(s.state, pb::PeerState::Idle as i32, "{who}");
            assert_eq!(s.idle_closes, round + 1, "{who}: {s:?}");
            assert!(
                s.lanes
                    .iter()
                    .all(|l| l.send_state == "closed" && l.recv_state == "closed")
            );
        }
        // Counters carry on across the closes: a started two transfers a round, b one.
        assert_eq!(sa.transfers_ok, 2 * (round + 1), "{sa:?}");
        assert_eq!(sb.transfers_ok, round + 1, "{sb:?}");
        assert_eq!(sa.transfers_failed + sb.transfers_failed, 0);
    }
    a.stop().await;
    b.stop().await;
}

/// Transfers from both sides spaced around the pairing's idle time: some start while it is
/// closing or just closed (the engine's tests pin each interleaving down; here the daemons' own
/// drivers and the re-pairing run them). Every one lands byte-exact and none fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_racing_the_pairing_close_all_land() {
    tcpxd::logging::init("warn");
    const TRANSFERS: u64 = 21;
    let idle_ms = 100;
    let (mut a, mut b) = idle_closing_pair("pairrace", 40, idle_ms).await;
    let a_buf = host_buffer(&mut a.client, 2 * MIB, "a").await;
    let b_buf = host_buffer(&mut b.client, 2 * MIB, "b").await;
    for i in 0..TRANSFERS {
        let len = 64 * 1024 + i * 60_000;
        // The initiator and the kind turn: a or b, WRITE or READ.
        let (from, to, from_buf, to_buf) = if i % 2 == 0 {
            (&mut a, &mut b, &a_buf, &b_buf)
        } else {
            (&mut b, &mut a, &b_buf, &a_buf)
        };
        if i % 4 < 2 {
            fill_seed(&mut from.client, from_buf.id, 0, len, 300 + i).await;
            let id = write(&mut from.client, write_entry(from_buf, 0, to_buf, 0, len), b"")
                .await
                .unwrap_or_else(|s| panic!("transfer {i}: {s:?}"));
            wait_ok(&mut from.client, id).await;
        } else {
            fill_seed(&mut to.client, to_buf.id, 0, len, 300 + i).await;
            let id = read(&mut from.client, read_entry(to_buf, 0, from_buf, 0, len))
                .await
                .unwrap_or_else(|s| panic!("transfer {i}: {s:?}"));
            wait_ok(&mut from.client, id).await;
        }
        assert_eq!(
            crc(&mut from.client, from_buf.id, 0, len).await,
            crc(&mut to.client, to_buf.id, 0, len).await,
            "transfer {i}"
        );
        // The pairing closes once its lanes closed (40 ms and a lane scan's 100 ms) and it was
        // quiet for `idle_ms` more (~250-350 ms): from under that to over it, so later
        // transfers meet the pairing live, closing and closed.
        let pause = 80 + (i % 7) * 60;
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
    let (_, sa) = the_peer(&mut a.client).await;
    let (_, sb) = the_peer(&mut b.client).await;
    assert_eq!(sa.transfers_failed + sb.transfers_failed, 0, "{sa:?} {sb:?}");
    assert_eq!(sa.transfers_ok + sb.transfers_ok, TRANSFERS);
    assert!(sa.idle_closes > 0, "the pairing never closed: {sa:?}");
    println!(
        "{TRANSFERS} transfers around the idle time: {} idle closes",
        sa.idle_closes
    );
    a.stop().await;
    b.stop().await;
}

/// While paired, a hung peer (SIGSTOP: its heartbeats stop) is still failed by the heartbeat
/// timeout, with the heartbeats' words — the idle close does not stand in for liveness.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_peer_is_still_failed_by_the_heartbeats_while_paired() {
    tcpxd::logging::init("error");
    let config =
        "[peer]\nheartbeat_interval_ms = 100\nheartbeat_timeout_ms = 600\npairing_idle_close_ms = 60000\n";
    let path = std::env::temp_dir().join(format!("tcpxd-pairlife-hb-{}.toml", std::process::id()));
    std::fs::write(&path, config).unwrap();
    let mut a = daemons::start("pairhb-a", |args| args.config = Some(path.clone())).await;
    let mut b = procs::spawn("pairhb-b", 0, config, &[]).await;
    let mut bc = b.client().await;
    a.client
        .connect_peer(pb::ConnectPeerRequest {
            address: b.peer_addr.clone(),
        })
        .await
        .expect("pairs");
    let x = host_buffer(&mut a.client, MIB, "x").await;
    let y = host_buffer(&mut bc, MIB, "y").await;
    let id = write(&mut a.client, write_entry(&x, 0, &y, 0, MIB), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    let frozen = Frozen::now(&b);
    let stopped = Instant::now();
    let deadline = stopped + Duration::from_secs(10);
    let failed = loop {
        let (peer, _) = the_peer(&mut a.client).await;
        if peer.state == pb::PeerState::Failed as i32 {
            break peer;
        }
        assert!(
            Instant::now() < deadline,
            "a hung peer was never failed: {peer:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        failed.error.contains("no control message or heartbeat"),
        "{}",
        failed.error
    );
    println!("hung peer failed after {:?}", stopped.elapsed());
    frozen.thaw();
    a.stop().await;
    b.kill();
    std::fs::remove_file(path).ok();
}
