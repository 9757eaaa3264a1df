//! Lanes open on first use and close when idle (peer protocol 6, `engine::lane_life`), invisibly
//! to clients: transfers after an idle close land byte-exact, and so do transfers that start
//! while lanes are closing. Two in-process daemons on the emulation with a short
//! `peer.lane_idle_close_ms`.

use std::time::{Duration, Instant};

use crate::common::daemons::{self, *};
use tcpxd::api::proto::v1 as pb;

const MIB: u64 = 1 << 20;

async fn idle_closing_pair(name: &str, idle_ms: u64) -> (TestDaemon, TestDaemon) {
    let mut a = daemons::start(&format!("{name}-a"), |args| {
        args.lane_idle_close_ms = Some(idle_ms)
    })
    .await;
    let b = daemons::start(&format!("{name}-b"), |args| {
        args.lane_idle_close_ms = Some(idle_ms)
    })
    .await;
    connect(&mut a, &b).await;
    (a, b)
}

/// Every lane's state on both directions (send, receive), as GetStats names them.
async fn lane_states(c: &mut Client) -> Vec<(String, String)> {
    let s = c.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    s.peers
        .iter()
        .flat_map(|p| &p.lanes)
        .map(|l| (l.send_state.clone(), l.recv_state.clone()))
        .collect()
}

/// Bytes sent over every lane of the daemon so far.
async fn bytes_sent(c: &mut Client) -> u64 {
    let s = c.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    s.peers.iter().flat_map(|p| &p.lanes).map(|l| l.bytes_sent).sum()
}

/// Waits (at most 20 s) until every lane of the daemon is closed both ways.
async fn until_all_closed(c: &mut Client, who: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let states = lane_states(c).await;
        if !states.is_empty() && states.iter().all(|(s, r)| s == "closed" && r == "closed") {
            return;
        }
        assert!(Instant::now() < deadline, "{who}: lanes never closed: {states:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_lanes_close_on_both_sides_and_the_next_transfers_land_byte_exact() {
    tcpxd::logging::init("warn");
    let (mut a, mut b) = idle_closing_pair("lanelife", 300).await;
    // Paired, nothing sent: no lane was opened, so GetStats lists none (it lists the lanes in
    // use only).
    let states = lane_states(&mut a.client).await;
    assert!(states.is_empty(), "{states:?}");
    let src = host_buffer(&mut a.client, 8 * MIB, "src").await;
    let dst = host_buffer(&mut b.client, 8 * MIB, "dst").await;
    let back = host_buffer(&mut a.client, 8 * MIB, "back").await;
    for round in 0..3u64 {
        fill_seed(&mut a.client, src.id, 0, 0, 11 + round).await;
        let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 8 * MIB), b"")
            .await
            .unwrap();
        wait_ok(&mut a.client, id).await;
        let id = read(&mut a.client, read_entry(&dst, 0, &back, 0, 8 * MIB))
            .await
            .unwrap();
        wait_ok(&mut a.client, id).await;
        let want = crc(&mut a.client, src.id, 0, 0).await;
        assert_eq!(crc(&mut b.client, dst.id, 0, 0).await, want, "round {round}");
        assert_eq!(crc(&mut a.client, back.id, 0, 0).await, want, "round {round}");
        // Each round's bytes went over lanes opened again after the last round closed them.
        assert_eq!(
            bytes_sent(&mut a.client).await,
            (round + 1) * 8 * MIB,
            "round {round}"
        );
        // Idle for longer than the setting: every lane closes, on both sides.
        until_all_closed(&mut a.client, "a").await;
        until_all_closed(&mut b.client, "b").await;
        assert_lanes_drain(&mut a.client).await;
        assert_lanes_drain(&mut b.client).await;
    }
    a.stop().await;
    b.stop().await;
}

/// Transfers spaced around the idle time: some start while their lanes are closing or just
/// closed (the engine's tests pin each case down; here the daemons' own drivers run them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_started_around_the_idle_close_all_land() {
    tcpxd::logging::init("warn");
    let idle_ms = 120;
    let (mut a, mut b) = idle_closing_pair("lanerace", idle_ms).await;
    let src = host_buffer(&mut a.client, 4 * MIB, "src").await;
    let dst = host_buffer(&mut b.client, 4 * MIB, "dst").await;
    for i in 0..24u64 {
        let len = MIB + i * 4096;
        fill_seed(&mut a.client, src.id, 0, len, 100 + i).await;
        let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, len), b"")
            .await
            .unwrap();
        wait_ok(&mut a.client, id).await;
        assert_eq!(
            crc(&mut b.client, dst.id, 0, len).await,
            crc(&mut a.client, src.id, 0, len).await,
            "transfer {i}"
        );
        // The idle time itself is the subject here: just under, at and just over it (the
        // lanes are scanned every 100 ms), so later writes meet lanes in every state.
        let pause = idle_ms - 40 + (i % 5) * 40;
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}
