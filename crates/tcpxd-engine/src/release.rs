//! Releasing failed pairings. A node keeps its live pairings and its newest failed one (what
//! GetStats shows, for diagnosis); every older failed pairing of the node is released once no
//! transfer, offer or read names it, its running totals added to the node's retired counters
//! (the metrics count over every pairing a node had). So however often a peer restarts or
//! re-pairs, a node holds at most one failed pairing once its transfers ended.

use std::collections::BTreeMap;

use super::{Action, Engine, LaneCounters, Peer, PeerCounters, PeerIdx};

/// The engine's pairings by id; indexing one it does not keep is a bug (the driver is told of
/// every release, and nothing in the engine names a released pairing).
#[derive(Debug, Default)]
pub(super) struct PeerMap(BTreeMap<PeerIdx, Peer>);

impl std::ops::Deref for PeerMap {
    type Target = BTreeMap<PeerIdx, Peer>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for PeerMap {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl std::ops::Index<&PeerIdx> for PeerMap {
    type Output = Peer;
    fn index(&self, i: &PeerIdx) -> &Peer {
        self.0.get(i).expect("a pairing the engine keeps")
    }
}

impl std::ops::IndexMut<&PeerIdx> for PeerMap {
    fn index_mut(&mut self, i: &PeerIdx) -> &mut Peer {
        self.0.get_mut(i).expect("a pairing the engine keeps")
    }
}

impl Engine {
    /// `peer` just failed: its node's failed pairings other than the newest are to be released.
    pub(super) fn note_failed(&mut self, peer: PeerIdx) {
        let Some(node) = self.peers.get(&peer).map(|p| p.node_id.clone()) else {
            return;
        };
        // In id order: the last one is the newest.
        let failed: Vec<PeerIdx> = self
            .peers
            .iter()
            .filter(|(_, p)| p.node_id == node && p.failed.is_some())
            .map(|(&i, _)| i)
            .collect();
        if let Some((_, older)) = failed.split_last() {
            for &i in older {
                if !self.dying.contains(&i) {
                    self.dying.push(i);
                }
            }
        }
    }

    /// Whether a transfer, offer or read still names the pairing.
    pub(super) fn named(&self, peer: PeerIdx) -> bool {
        self.transfers.values().any(|t| t.peers.contains(&peer))
            || self.out_offers.values().any(|o| o.peer == peer)
            || self.in_offers.keys().any(|&(p, _)| p == peer)
            || self.reads.values().any(|r| r.peer == peer)
    }

    /// Releases the pairings waiting for it that nothing names any more: each is forgotten, its
    /// totals added to its node's, and the driver told (`Action::ReleasePeer`).
    pub(super) fn release_dead(&mut self) {
        if self.dying.is_empty() {
            return;
        }
        for peer in std::mem::take(&mut self.dying) {
            if self.named(peer) {
                self.dying.push(peer);
                continue;
            }
            let Some(counters) = self.listed_counters(peer) else {
                continue;
            };
            self.peers.remove(&peer);
            self.retired
                .entry(counters.node_id.clone())
                .or_insert_with(|| PeerCounters {
                    node_id: counters.node_id.clone(),
                    ..PeerCounters::default()
                })
                .absorb(&counters);
            self.actions.push_back(Action::ReleasePeer { peer });
        }
    }

    /// Per node, the added-up totals of its released pairings.
    pub fn retired_counters(&self) -> impl Iterator<Item = &PeerCounters> {
        self.retired.values()
    }

    /// The pairings the engine keeps (live, failed, not yet released).
    pub fn pairings(&self) -> Vec<PeerIdx> {
        self.peers.keys().copied().collect()
    }
}

impl PeerCounters {
    /// Adds another pairing's running totals (transfers, protocol counts, each lane's bytes,
    /// chunks and window-full stretches) to these, lane by lane (by lane number: lists of lanes
    /// in use, [`Engine::listed_counters`], leave lanes out). Gauges (requests in flight,
    /// queued chunks, credits) describe a live pairing and are not carried over.
    pub fn absorb(&mut self, other: &PeerCounters) {
        self.transfers_started += other.transfers_started;
        self.transfers_ok += other.transfers_ok;
        self.transfers_failed += other.transfers_failed;
        self.sent_eager += other.sent_eager;
        self.sent_rendezvous += other.sent_rendezvous;
        self.received_eager += other.received_eager;
        self.received_rendezvous += other.received_rendezvous;
        self.sent_notices += other.sent_notices;
        self.received_notices += other.received_notices;
        self.sent_inline += other.sent_inline;
        self.received_inline += other.received_inline;
        self.idle_closes += other.idle_closes;
        self.send_lanes = self.send_lanes.max(other.send_lanes);
        self.recv_lanes = self.recv_lanes.max(other.recv_lanes);
        self.routed |= other.routed;
        for (mine, theirs) in [(&mut self.send, &other.send), (&mut self.recv, &other.recv)] {
            for t in theirs {
                let at = match mine.binary_search_by_key(&t.lane, |m| m.lane) {
                    Ok(at) => at,
                    Err(at) => {
                        mine.insert(
                            at,
                            LaneCounters {
                                lane: t.lane,
                                eager: t.eager,
                                memory: t.memory,
                                ..LaneCounters::default()
                            },
                        );
                        at
                    }
                };
                let m = &mut mine[at];
                m.bytes += t.bytes;
                m.chunks += t.chunks;
                m.window_full += t.window_full;
            }
        }
    }
}
