//! A node's view of its one pairing, as the tests that count protocols and lane bytes read it.

use tcpxd::api::proto::v1 as pb;

use super::daemons::Client;

/// This node's stats of its one peer (asserting it has exactly one).
pub async fn only_peer(c: &mut Client) -> pb::PeerStats {
    let s = c
        .get_stats(pb::GetStatsRequest {})
        .await
        .expect("stats")
        .into_inner();
    assert_eq!(s.peers.len(), 1, "{s:?}");
    s.peers.into_iter().next().unwrap()
}

/// Bytes every listed lane of the pairing carried, both ways.
pub fn lane_bytes_total(p: &pb::PeerStats) -> u64 {
    p.lanes.iter().map(|l| l.bytes_sent + l.bytes_received).sum()
}
