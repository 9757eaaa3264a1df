//! A peer that restarts again and again: the surviving daemon keeps what it needs of that node and
//! no more. After every restart and re-pairing (dialled by either side), GetStats lists the node's
//! live pairing and its newest failed one (with why it failed), never an ever-growing history;
//! ListPeers the live one; the Prometheus series for the node stay the same set, their counters
//! still adding up over every pairing the node had; lanes and credits drain.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::common::daemons::{self, *};
use crate::common::scrape::{http_get, samples, sum};
use tcpxd::api::proto::v1 as pb;

const MIB: u64 = 1 << 20;
/// Restarts of the peer (each a new process image of the node: a new pairing).
const ROUNDS: u64 = 6;
const NODE: &str = "churn-b";

/// The scrape's samples of series labelled with `peer="<node>"`: `name{labels}` -> value.
async fn node_series(addr: SocketAddr, node: &str) -> BTreeMap<String, f64> {
    let (_, body) = http_get(addr, "/metrics").await;
    let label = format!("peer=\"{node}\"");
    samples(&body)
        .into_iter()
        .filter(|(k, _)| k.contains(&label))
        .collect()
}

/// Waits (10 s at most) until ListPeers shows `node` in `state`.
async fn until_listed(c: &mut Client, node: &str, state: pb::PeerState) -> pb::Peer {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let peers = c
            .list_peers(pb::ListPeersRequest {})
            .await
            .unwrap()
            .into_inner()
            .peers;
        assert_eq!(peers.len(), 1, "one entry per node: {peers:?}");
        if peers[0].node_id == node && peers[0].state == state as i32 {
            return peers[0].clone();
        }
        assert!(Instant::now() < deadline, "{node} never {state:?}: {peers:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarting_peer_leaves_one_live_and_one_failed_pairing() {
    tcpxd::logging::init("error");
    let mut a = daemons::start("churn-a", |a| {
        a.metrics_listen = Some("127.0.0.1:0".parse().unwrap())
    })
    .await;
    let metrics = a.daemon.metrics_addr.expect("metrics enabled");
    let src = host_buffer(&mut a.client, 4 * MIB, "src").await;
    let mut b = daemons::start(NODE, |_| {}).await;
    let mut first_series: Option<Vec<String>> = None;

    for round in 1..=ROUNDS {
        // Even rounds this daemon dials the node, odd ones the node dials this daemon.
        if round % 2 == 0 {
            connect(&mut a, &b).await;
        } else {
            b.client
                .connect_peer(pb::ConnectPeerRequest {
                    address: a.peer_addr(),
                })
                .await
                .unwrap_or_else(|s| panic!("round {round}: {NODE} pairs with churn-a: {s}"));
        }
        until_listed(&mut a.client, NODE, pb::PeerState::Up).await;

        // A byte-exact write over the new pairing.
        let dst = host_buffer(&mut b.client, 4 * MIB, "dst").await;
        fill_seed(&mut a.client, src.id, 0, 0, round).await;
        let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 4 * MIB), b"")
            .await
            .unwrap_or_else(|s| panic!("round {round}: the write did not start: {s}"));
        wait_ok(&mut a.client, id).await;
        assert_eq!(
            crc(&mut b.client, dst.id, 0, 0).await,
            crc(&mut a.client, src.id, 0, 0).await,
            "round {round}"
        );
        assert_lanes_drain(&mut a.client).await;

        // GetStats: the live pairing and, from the second round on, the newest failed one.
        let stats = a
            .client
            .get_stats(pb::GetStatsRequest {})
            .await
            .unwrap()
            .into_inner();
        let states: Vec<(i32, String)> = stats.peers.iter().map(|p| (p.state, p.error.clone())).collect();
        assert!(stats.peers.iter().all(|p| p.node_id == NODE), "{states:?}");
        let up = stats
            .peers
            .iter()
            .filter(|p| p.state == pb::PeerState::Up as i32)
            .count();
        let failed: Vec<&pb::PeerStats> = stats
            .peers
            .iter()
            .filter(|p| p.state == pb::PeerState::Failed as i32)
            .collect();
        assert_eq!(up, 1, "round {round}: one live pairing: {states:?}");
        assert_eq!(
            failed.len(),
            usize::from(round > 1),
            "round {round}: the newest failed pairing only: {states:?}"
        );
        assert_eq!(stats.peers.len(), up + failed.len(), "round {round}: {states:?}");
        for f in &failed {
            assert!(
                !f.error.is_empty(),
                "round {round}: a failed pairing says why: {states:?}"
            );
            assert!(f.lanes.iter().all(|l| l.sends_in_flight + l.recvs_in_flight == 0));
        }
        // The live pairing counts its own transfer; the metrics count every pairing's.
        let live = stats
            .peers
            .iter()
            .find(|p| p.state == pb::PeerState::Up as i32)
            .unwrap();
        assert_eq!(live.transfers_ok, 1, "round {round}: {live:?}");

        let series = node_series(metrics, NODE).await;
        let names: Vec<String> = series.keys().cloned().collect();
        match &first_series {
            None => first_series = Some(names),
            Some(first) => assert_eq!(&names, first, "round {round}: the node's series are the same set"),
        }
        let ok = sum(&series, "tcpxd_peer_transfers_total", &["result=\"ok\""]);
        assert_eq!(ok, round as f64, "round {round}: transfers over every pairing");
        let sent = sum(&series, "tcpxd_lane_bytes_total", &["direction=\"send\""]);
        assert_eq!(
            sent,
            (round * 4 * MIB) as f64,
            "round {round}: bytes over every pairing"
        );
        assert_eq!(sum(&series, "tcpxd_peer_state", &["state=\"up\""]), 1.0);
        assert_eq!(sum(&series, "tcpxd_peer_state", &["state=\"failed\""]), 0.0);

        // The node restarts: this daemon sees the pairing fail, then a new process of it comes.
        b.stop().await;
        until_listed(&mut a.client, NODE, pb::PeerState::Failed).await;
        b = daemons::start(NODE, |_| {}).await;
    }

    // After the last restart: the failed pairing is all that is left of the node.
    let stats = a
        .client
        .get_stats(pb::GetStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.peers.len(), 1, "{stats:?}");
    assert_eq!(stats.peers[0].state, pb::PeerState::Failed as i32);
    let series = node_series(metrics, NODE).await;
    assert_eq!(sum(&series, "tcpxd_peer_state", &["state=\"failed\""]), 1.0);
    assert_eq!(
        sum(&series, "tcpxd_peer_transfers_total", &["result=\"ok\""]),
        ROUNDS as f64
    );
    b.stop().await;
    a.stop().await;
}
