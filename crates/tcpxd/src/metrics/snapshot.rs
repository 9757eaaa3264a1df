//! The series read from the poller's stats snapshot at each scrape: per-lane bytes, chunks,
//! requests in flight, queued chunks and window-full events, peer states and counters, and the
//! node's buffers and memory ([`NodeGauges`]). Made fresh for each scrape.

use std::collections::HashMap;

use prometheus::{IntGauge, IntGaugeVec, Opts, Registry};

use super::counter_vec;
use crate::peer_stats::{PeerLink, StatsSnapshot};

/// What a scrape reads besides the poller's snapshot.
#[derive(Debug, Clone, Default)]
pub struct NodeGauges {
    /// Registered buffers, and their bytes.
    pub buffers: usize,
    pub buffer_bytes: u64,
    /// The host memory a registration may still fault in (`crate::headroom::available`;
    /// `None`: unreadable, and the series is left out), and the reserve kept free.
    pub memory_available: Option<u64>,
    pub memory_reserve: u64,
}

/// The snapshot's series, made fresh for one scrape (peers with one node id summed).
pub(super) fn snapshot_registry(snap: &StatsSnapshot, node: &NodeGauges) -> Registry {
    let r = Registry::new();
    let lane_labels = &["peer", "lane", "direction"];
    let lane_bytes = counter_vec(
        &r,
        "tcpxd_lane_bytes_total",
        "Payload bytes moved on a lane (every transfer, either side's)",
        lane_labels,
    );
    let lane_chunks = counter_vec(
        &r,
        "tcpxd_lane_chunks_total",
        "Chunks moved on a lane",
        lane_labels,
    );
    let window_full = counter_vec(
        &r,
        "tcpxd_lane_window_full_total",
        "Times a lane's window filled with chunks still waiting for a slot",
        lane_labels,
    );
    let gauge = |name: &str, help: &str, labels: &[&str]| {
        let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
        r.register(Box::new(g.clone())).expect("registered once");
        g
    };
    let in_flight = gauge(
        "tcpxd_lane_in_flight",
        "Requests posted to the plugin and not finished, per lane",
        lane_labels,
    );
    let queued = gauge(
        "tcpxd_lane_queued",
        "Chunks waiting for a window slot, per lane",
        lane_labels,
    );
    let credits = gauge(
        "tcpxd_lane_credits",
        "Eager credits: held for sending (direction send), credit receives posted without data (recv)",
        lane_labels,
    );
    let credit_limit = gauge(
        "tcpxd_lane_credit_limit",
        "Eager credits per lane announced at pairing (0: rendezvous)",
        lane_labels,
    );
    let peer_state = gauge(
        "tcpxd_peer_state",
        "1 for each peer's current state (connecting, up, failed)",
        &["peer", "state"],
    );
    let peer_transfers = counter_vec(
        &r,
        "tcpxd_peer_transfers_total",
        "Transfers this node started with a peer, by result: started, ok, failed",
        &["peer", "result"],
    );
    let peer_idle_closes = counter_vec(
        &r,
        "tcpxd_peer_idle_closes_total",
        "Times pairings with a peer closed when idle (peer.pairing_idle_close_ms)",
        &["peer"],
    );
    let peer_protocol = counter_vec(
        &r,
        "tcpxd_peer_protocol_total",
        "Transfers with a peer by the protocol they went by (eager header, rendezvous offer, or notice: a notification alone): sent by this node, or received from the peer",
        &["peer", "direction", "protocol"],
    );
    let single = |name: &str, help: &str, v: i64| {
        let g = IntGauge::new(name, help).expect("valid metric");
        g.set(v);
        r.register(Box::new(g)).expect("registered once");
    };
    single(
        "tcpxd_active_transfers",
        "Transfers not yet finished",
        snap.active_transfers as i64,
    );
    single("tcpxd_buffers", "Registered buffers", node.buffers as i64);
    single(
        "tcpxd_buffer_bytes",
        "Bytes of registered buffers",
        node.buffer_bytes as i64,
    );
    if let Some(available) = node.memory_available {
        single(
            "tcpxd_host_memory_available_bytes",
            "Host memory a registration may still fault in: MemAvailable, under a cgroup v2 limit no more than the limit less the cgroup's use",
            available.min(i64::MAX as u64) as i64,
        );
    }
    single(
        "tcpxd_host_memory_reserve_bytes",
        "Host memory registrations must leave free (transfer.host_memory_reserve_bytes)",
        node.memory_reserve.min(i64::MAX as u64) as i64,
    );
    // The latest slot of a node decides its state; counters add up over its slots and the
    // pairings of it the engine released (`StatsSnapshot::retired`), so they never go back.
    let mut states: HashMap<&str, &PeerLink> = HashMap::new();
    let kept = snap.peers.iter().map(|p| (&p.counters, Some(&p.link)));
    for (c, link) in kept.chain(snap.retired.iter().map(|c| (c, None))) {
        let peer = c.node_id.as_str();
        if let Some(link) = link {
            states.insert(peer, link);
        }
        for (dir, lanes) in [("send", &c.send), ("recv", &c.recv)] {
            // The lanes in use only (`Engine::listed_counters`): a lane that counted something
            // stays listed for the pairing's life and then in the retired totals, so no counter
            // goes back; a routed pairing's never-used catalogue lanes export no series.
            for l in lanes.iter() {
                let lane = l.lane.to_string();
                let labels = [peer, lane.as_str(), dir];
                lane_bytes.with_label_values(&labels).inc_by(l.bytes);
                lane_chunks.with_label_values(&labels).inc_by(l.chunks);
                window_full.with_label_values(&labels).inc_by(l.window_full);
                in_flight.with_label_values(&labels).add(l.posted as i64);
                queued.with_label_values(&labels).add(l.queued as i64);
                credits.with_label_values(&labels).add(i64::from(l.credits));
                credit_limit
                    .with_label_values(&labels)
                    .add(i64::from(l.credit_limit));
            }
        }
        for (result, v) in [
            ("started", c.transfers_started),
            ("ok", c.transfers_ok),
            ("failed", c.transfers_failed),
        ] {
            peer_transfers.with_label_values(&[peer, result]).inc_by(v);
        }
        peer_idle_closes.with_label_values(&[peer]).inc_by(c.idle_closes);
        for (dir, protocol, v) in [
            ("sent", "eager", c.sent_eager),
            ("sent", "rendezvous", c.sent_rendezvous),
            ("received", "eager", c.received_eager),
            ("received", "rendezvous", c.received_rendezvous),
            ("sent", "notice", c.sent_notices),
            ("received", "notice", c.received_notices),
            ("sent", "inline", c.sent_inline),
            ("received", "inline", c.received_inline),
        ] {
            peer_protocol.with_label_values(&[peer, dir, protocol]).inc_by(v);
        }
    }
    for (peer, link) in states {
        for s in ["connecting", "up", "idle", "failed"] {
            peer_state
                .with_label_values(&[peer, s])
                .set(i64::from(link_name(link) == s));
        }
    }
    r
}

pub fn link_name(l: &PeerLink) -> &'static str {
    match l {
        PeerLink::Connecting => "connecting",
        PeerLink::Up | PeerLink::Closing => "up",
        PeerLink::Idle => "idle",
        PeerLink::Failed(_) => "failed",
    }
}
