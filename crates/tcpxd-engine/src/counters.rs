//! What the engine counts per lane and per pairing, as GetStats and the metrics read it.

use super::{Engine, Lane, PeerIdx};
use crate::topology::Memory;

/// Per-lane counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LaneCounters {
    /// The lane's number in its direction (lane `i` towards the peer and lane `i` from it are
    /// two lanes: each direction has its own).
    pub lane: u32,
    pub bytes: u64,
    pub chunks: u64,
    pub posted: usize,
    pub queued: usize,
    /// Times the lane's window filled while chunks still waited for a slot.
    pub window_full: u64,
    /// Eager mode. Send lanes: credits held (sends the peer's posted receives can still
    /// take). Receive lanes: credit receives posted and holding no data.
    pub credits: u32,
    /// Eager mode: the credits per lane announced at pairing (the peer's for send lanes, ours
    /// for receive lanes); 0 for rendezvous.
    pub credit_limit: u32,
    /// Send lanes towards a peer with GPU credits: bytes of sends whose credits have not come
    /// back (at most its byte budget; 0 once every credit is back).
    pub credit_bytes_out: u64,
    /// Where the lane is in its life (`lane_life.rs`): "closed", "opening", "open", "closing".
    pub state: &'static str,
    /// The lane carries eager transfers (the receiver keeps credit receives on it): one of the
    /// receiver's eager lanes under `auto`, every lane of an `eager` receiver, a routed group's
    /// eager lanes towards a receiver that keeps credits. Else rendezvous.
    pub eager: bool,
    /// A routed lane's memory pair: the source memory on the sending node and the destination
    /// memory on the receiving node of its group (`topology::LaneCatalogue`); `None` for a
    /// lane of the layout.
    pub memory: Option<(Memory, Memory)>,
}

impl LaneCounters {
    /// Whether statistics list the lane: it exists (its comm is opening, open or closing), or
    /// it has counted something since the pairing (so a lane that moved bytes stays listed
    /// after it closed, and its totals never vanish), or it holds requests. A pairing's lanes
    /// that were never used are not listed: a routed pairing has hundreds
    /// (`topology::LaneCatalogue`), which open on first use.
    pub fn in_use(&self) -> bool {
        (!self.state.is_empty() && self.state != "closed")
            || self.bytes > 0
            || self.chunks > 0
            || self.window_full > 0
            || self.posted > 0
            || self.queued > 0
    }
}

/// Per-peer counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerCounters {
    pub node_id: String,
    pub failed: Option<String>,
    pub transfers_started: u64,
    pub transfers_ok: u64,
    pub transfers_failed: u64,
    /// Transfers (offers: a WRITE's share, or the data of a peer's READ) this node sent to the
    /// peer as eager headers, and as rendezvous offers: the per-transfer choice.
    pub sent_eager: u64,
    pub sent_rendezvous: u64,
    /// Headers and offers the peer sent this node (those whose chunk plan was sound).
    pub received_eager: u64,
    pub received_rendezvous: u64,
    /// Notifications alone (a WRITE of one zero-byte entry, `notice.rs`) sent to the peer and
    /// received from it: control messages only, no lane touched (not in the counts above).
    pub sent_notices: u64,
    pub received_notices: u64,
    /// Transfers sent to the peer and received from it inline on the control connection
    /// (`inline.rs`): no lane touched (not in the eager or rendezvous counts).
    pub sent_inline: u64,
    pub received_inline: u64,
    /// Times pairings with the node closed when idle (`pair_life.rs`; carried from one pairing
    /// to the next).
    pub idle_closes: u64,
    /// Each lane of the direction, in lane order: every lane the pairing has
    /// ([`Engine::peer_counters`]), or only those in use ([`Engine::listed_counters`],
    /// [`LaneCounters::in_use`]).
    pub send: Vec<LaneCounters>,
    pub recv: Vec<LaneCounters>,
    /// The lanes the pairing has each way, listed or not (on a routed pairing the layout's and
    /// the catalogue's).
    pub send_lanes: u32,
    pub recv_lanes: u32,
    /// Its lanes follow the memory pair (`routes.rs`).
    pub routed: bool,
}

impl Lane {
    fn counters(&self, lane: usize) -> LaneCounters {
        LaneCounters {
            lane: lane as u32,
            bytes: self.bytes,
            chunks: self.chunks,
            posted: self.posted.len() + self.landed.len() + self.unpacking.len(),
            queued: self.queue.len() + self.targets.len(),
            window_full: self.window_full,
            credits: 0,
            credit_limit: 0,
            credit_bytes_out: 0,
            state: self.life.name(),
            eager: false,
            memory: None,
        }
    }
}

impl Engine {
    /// A pairing's counters with every lane it has, in use or not.
    pub fn peer_counters(&self, peer: PeerIdx) -> Option<PeerCounters> {
        let p = self.peers.get(&peer)?;
        let live = !p.gone();
        let remote_credits = p.remote.map_or(0, |r| r.credits);
        Some(PeerCounters {
            node_id: p.node_id.clone(),
            failed: p.failed.clone(),
            transfers_started: p.transfers_started,
            transfers_ok: p.transfers_ok,
            transfers_failed: p.transfers_failed,
            sent_eager: p.sent_eager,
            sent_rendezvous: p.sent_rendezvous,
            received_eager: p.received_eager,
            received_rendezvous: p.received_rendezvous,
            sent_notices: p.sent_notices,
            received_notices: p.received_notices,
            sent_inline: p.sent_inline,
            received_inline: p.received_inline,
            idle_closes: p.idle.closes,
            send: p
                .send
                .iter()
                .enumerate()
                .map(|(i, l)| LaneCounters {
                    eager: p.send_lane_eager(i as u32),
                    memory: p.routes.as_ref().and_then(|r| r.send_memory(i as u32)),
                    credits: l.send_credits.held(),
                    credit_bytes_out: l.send_credits.bytes_out(),
                    credit_limit: if live && p.send_lane_eager(i as u32) {
                        remote_credits
                    } else {
                        0
                    },
                    ..l.counters(i)
                })
                .collect(),
            recv: p
                .recv
                .iter()
                .enumerate()
                .map(|(i, l)| {
                    let limit = if live && p.recv_lane_eager(i as u32) {
                        self.cfg.credits
                    } else {
                        0
                    };
                    LaneCounters {
                        // A closed lane owes nothing: its credit receives are all posted again
                        // (with the comm) when it opens, so it reads as back at its limit.
                        credits: if l.life == crate::lane_life::Life::Closed {
                            limit
                        } else {
                            l.recv_credits.posted()
                        },
                        credit_limit: limit,
                        eager: p.recv_lane_eager(i as u32),
                        memory: p.routes.as_ref().and_then(|r| r.recv_memory(i as u32)),
                        ..l.counters(i)
                    }
                })
                .collect(),
            send_lanes: p.send.len() as u32,
            recv_lanes: p.recv.len() as u32,
            routed: p.routes.is_some(),
        })
    }

    /// A pairing's counters with only the lanes in use ([`LaneCounters::in_use`]): what
    /// GetStats and the metrics list. Lanes left out have counted nothing, so totals over the
    /// listed lanes are the pairing's totals.
    pub fn listed_counters(&self, peer: PeerIdx) -> Option<PeerCounters> {
        let mut c = self.peer_counters(peer)?;
        c.send.retain(LaneCounters::in_use);
        c.recv.retain(LaneCounters::in_use);
        Some(c)
    }
}
