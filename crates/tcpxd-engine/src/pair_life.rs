//! A pairing's life (peer protocol 7): closed by agreement of both sides once idle, paired anew
//! by its next use — invisibly to clients, since a transfer refused because its pairing closed is
//! started again by the daemon on the new pairing (`EngineError::closed_pairing`).
//!
//! # State
//!
//! A pairing is [`PairLife::Live`] from its start. It is **quiet** on a side when that side has
//! no transfer, offer or read naming it (`release.rs`, `named`), no offer waiting for the peer's
//! `ReceiveMode`, no streamed header, and every lane is closed or open with nothing queued,
//! posted, announced, landed or unpacking, every credit back and none owed (the conditions under
//! which a lane would close, `lane_life.rs`), and the peer's `ReceiveMode` came.
//!
//! 1. A side whose pairing was quiet, with no transfer sent or received on it in between, for
//!    `pairing_idle_close` (noted by the lane scan) makes it `Closing` and sends `PairingClose`.
//!    From then on it sends nothing of its own on the pairing: a transfer naming it is refused
//!    with `EngineError::closed_pairing` (the daemon waits for the answer and starts it again),
//!    no lane is opened or closed. What the peer sent before it saw the question is handled as
//!    ever, answers included.
//! 2. The peer closes its side only if it is quiet too: it answers `PairingCloseAnswer {
//!    closed }` and, closed, is [`PairLife::Closed`] at once; kept, it carries on.
//! 3. The asking side, on `closed`, is `Closed` too; on kept it is `Live` again.
//!
//! A closed pairing ends its control stream once the answer is out and closes every comm it
//! still has (`Action::Pairing`); its messages, failures and the stream's end are ignored from
//! then on, and the driver reports it idle, not failed. The node's next pairing takes over its
//! running totals and releases it (`adopt_closed`).
//!
//! **Why nothing is lost.** The control stream is ordered both ways. When B answers `closed`, B
//! is quiet: every message of B's that wants an answer (an offer, a header, a read request, a
//! `LaneOpen` or `LaneClose`) leaves B with state it holds until the answer comes, so B has
//! none outstanding, and every message A sent before its question was handled by B before it.
//! A sent nothing of its own after the question, so nothing A sent is lost either; whatever A
//! received meanwhile came from B before B's answer and left B busy unless it needed no answer
//! (a `Done`, credits, a notification), so a `closed` answer finds A quiet too — if not, the two
//! disagree about what exists and the pairing fails ("protocol violation"). No comm of the
//! pairing carries a request on either side, so closing them drops no byte.
//!
//! **Both at once.** Each side asks while quiet and then sends nothing of its own, so each
//! finds the other's question while `Closing` and still quiet: each answers `closed` and is
//! `Closed`; the answers that cross are ignored (the pairing is closed). A side that is not
//! quiet when the other's question comes answers kept and stays `Closing` for its own answer.
//!
//! **A transfer racing the close.** Posted at A while A is `Closing`: refused until the answer
//! (kept: started on this pairing; closed: on the next). Posted at B before B saw the question:
//! B is not quiet and answers kept. Posted at B after its `closed` answer: refused, started on
//! the next pairing. So a transfer never fails because its pairing closed; its deadline still
//! bounds the wait and the re-pairing.
//!
//! **Peer loss** while `Live` or `Closing` fails the pairing as ever (heartbeats run while the
//! control stream exists); a closed pairing has no stream and notices nothing until its next use
//! pairs again, which reports an unreachable peer then.

use super::*;

/// Where a pairing is in its life.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PairLife {
    /// In use, or quiet and not yet asked about.
    #[default]
    Live,
    /// This side sent `PairingClose` and waits for the answer; it sends nothing of its own.
    Closing,
    /// Both sides agreed it is idle: no control stream, no comm. Its next use pairs anew.
    Closed,
}

impl PairLife {
    /// The state's name, for messages and statistics.
    pub fn name(&self) -> &'static str {
        match self {
            PairLife::Live => "live",
            PairLife::Closing => "closing",
            PairLife::Closed => "closed when idle",
        }
    }
}

/// What the lane scan notes to find a pairing idle.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Idle {
    /// Quiet since (noted by a scan; `None`: busy at the last one).
    since: Option<Instant>,
    /// The pairing's activity count at the last scan: a transfer that started and ended between
    /// two scans still counts as use.
    seen: u64,
    /// Times pairings with this node closed when idle (carried to the next pairing).
    pub(crate) closes: u64,
}

impl Peer {
    /// Failed, or closed when idle: nothing happens on it any more.
    pub(crate) fn gone(&self) -> bool {
        self.failed.is_some() || self.life == PairLife::Closed
    }

    /// Grows with every transfer sent or received on the pairing.
    fn activity(&self) -> u64 {
        let chunks: u64 = self.send.iter().chain(&self.recv).map(|l| l.chunks).sum();
        self.transfers_started
            + self.sent_eager
            + self.sent_rendezvous
            + self.received_eager
            + self.received_rendezvous
            + self.sent_notices
            + self.received_notices
            + self.sent_inline
            + self.received_inline
            + chunks
    }
}

impl Engine {
    /// The pairing, if it can carry a new transfer: UNAVAILABLE naming `field` when it failed or
    /// has no lanes; closed when idle or closing, refused with `EngineError::closed_pairing`.
    /// (`field` is formatted only for an error: a start names `entries[i]…` without a string.)
    pub(super) fn live_peer(&self, field: impl std::fmt::Display, peer: PeerIdx) -> EngineResult<&Peer> {
        let p = self
            .peers
            .get(&peer)
            .ok_or_else(|| EngineError::not_found(format!("{field}: unknown peer")))?;
        if let Some(why) = &p.failed {
            return Err(EngineError::new(
                Code::Unavailable,
                format!("{field}: peer {} failed: {why}", p.node_id),
            ));
        }
        if p.life != PairLife::Live {
            return Err(EngineError::pairing_closed(
                &p.node_id,
                format!(
                    "{field}: the pairing with peer {} is {} (pair again and retry)",
                    p.node_id,
                    p.life.name()
                ),
            ));
        }
        if p.send.is_empty() || p.recv.is_empty() {
            return Err(EngineError::new(
                Code::Unavailable,
                format!("{field}: peer {} has no data lanes", p.node_id),
            ));
        }
        Ok(p)
    }

    /// A pairing's life (`None`: no such pairing).
    pub fn pairing_life(&self, peer: PeerIdx) -> Option<PairLife> {
        self.peers.get(&peer).map(|p| p.life)
    }

    /// Why a transfer naming `peer` would be refused for a retry (`EngineError::closed_pairing`:
    /// its pairing closed when idle or is closing), if it would: a driver holding a large
    /// request checks this first and keeps the request for the retry.
    pub fn pairing_closed(&self, peer: PeerIdx) -> Option<EngineError> {
        let p = self.peers.get(&peer).filter(|p| p.failed.is_none())?;
        (p.life != PairLife::Live)
            .then(|| self.live_peer("peer", peer).err())
            .flatten()
    }

    /// The pairing, failed or not (a pairing closed when idle still names its node): NOT_FOUND
    /// or UNAVAILABLE naming `field` otherwise.
    pub(super) fn named_peer(&self, field: &str, peer: PeerIdx) -> EngineResult<&Peer> {
        let p = self
            .peers
            .get(&peer)
            .ok_or_else(|| EngineError::not_found(format!("{field}: unknown peer")))?;
        match &p.failed {
            Some(why) => Err(EngineError::new(
                Code::Unavailable,
                format!("{field}: peer {} failed: {why}", p.node_id),
            )),
            None => Ok(p),
        }
    }

    /// When `on_tick` must next run for an idle lane or pairing to close on time (`None`:
    /// nothing to close): the end of an idle time noted, or the next lane scan for one not noted
    /// yet. So a parked driver wakes for these (and not every second's park), and not at all once
    /// everything idle closed.
    pub(super) fn next_idle_check(&self) -> Option<Instant> {
        let (lanes, pairings) = (self.cfg.lane_idle_close, self.cfg.pairing_idle_close);
        if lanes.is_none() && pairings.is_none() {
            return None;
        }
        let scan = self.next_lane_scan.unwrap_or_else(Instant::now);
        let due = |since: Option<Instant>, limit: Duration| since.map_or(scan, |t| (t + limit).max(scan));
        let mut next: Option<Instant> = None;
        for p in self.peers.values().filter(|p| !p.gone()) {
            if let (Some(limit), PairLife::Live) = (pairings, p.life) {
                let t = due(p.idle.since, limit);
                next = Some(next.map_or(t, |n| n.min(t)));
            }
            let Some(limit) = lanes else { continue };
            for l in &p.send {
                if let lane_life::Life::Open { idle_since } = l.life {
                    let t = due(idle_since, limit);
                    next = Some(next.map_or(t, |n| n.min(t)));
                }
            }
        }
        next
    }

    /// Whether nothing is on the pairing on this side (the module doc's "quiet").
    fn pairing_quiet(&self, peer: PeerIdx) -> bool {
        let Some(p) = self.peers.get(&peer) else {
            return false;
        };
        let lanes_quiet = p.send.iter().all(|l| match l.life {
            lane_life::Life::Closed => true,
            lane_life::Life::Open { .. } => l.send_quiet(),
            _ => false,
        }) && p.recv.iter().all(|l| match l.life {
            lane_life::Life::Closed => true,
            lane_life::Life::Open { .. } => l.recv_quiet(),
            _ => false,
        });
        p.failed.is_none()
            && p.remote.is_some()
            && p.waiting.is_empty()
            && p.streams.is_empty()
            && lanes_quiet
            && !self.named(peer)
    }

    /// From the lane scan: asks to close live pairings quiet, with no transfer in between, for
    /// `pairing_idle_close`.
    pub(super) fn scan_pairings(&mut self, now: Instant) {
        let Some(limit) = self.cfg.pairing_idle_close else {
            return;
        };
        let live: Vec<PeerIdx> = self
            .peers
            .iter()
            .filter(|(_, p)| p.failed.is_none() && p.life == PairLife::Live)
            .map(|(&i, _)| i)
            .collect();
        for peer in live {
            let quiet = self.pairing_quiet(peer);
            let p = &mut self.peers[&peer];
            let seen = p.activity();
            if !quiet || seen != p.idle.seen {
                p.idle.since = None;
                p.idle.seen = seen;
                continue;
            }
            match p.idle.since {
                None => p.idle.since = Some(now),
                Some(t) if now.saturating_duration_since(t) >= limit => {
                    p.life = PairLife::Closing;
                    p.idle.since = None;
                    self.actions.push_back(Action::Pairing {
                        peer,
                        life: PairLife::Closing,
                    });
                    self.actions.push_back(Action::Control {
                        peer,
                        msg: PeerMsg::PairingClose,
                    });
                }
                Some(_) => {}
            }
        }
    }

    /// The peer has nothing on the pairing and would close it: closed here too if this side is
    /// quiet (also when this side asked the same at once), else kept.
    pub(super) fn on_pairing_close(&mut self, peer: PeerIdx) {
        let closed = self.pairing_quiet(peer);
        self.actions.push_back(Action::Control {
            peer,
            msg: PeerMsg::PairingCloseAnswer { closed },
        });
        if closed {
            self.close_pairing(peer);
        }
    }

    /// The peer's answer to our `PairingClose`.
    pub(super) fn on_pairing_close_answer(&mut self, peer: PeerIdx, closed: bool) {
        if self.peers[&peer].life != PairLife::Closing {
            return self.violation(peer, "an answer to a PairingClose never sent".to_string());
        }
        if !closed {
            let p = &mut self.peers[&peer];
            p.life = PairLife::Live;
            p.idle.since = None;
            self.actions.push_back(Action::Pairing {
                peer,
                life: PairLife::Live,
            });
            // Chunks the peer's messages queued meanwhile.
            return self.pump(peer);
        }
        if !self.pairing_quiet(peer) {
            return self.violation(
                peer,
                "the peer closed the pairing while this side still has transfers or lanes on it".to_string(),
            );
        }
        self.close_pairing(peer);
    }

    /// Both sides agreed: the pairing is closed when idle, its lanes with it.
    fn close_pairing(&mut self, peer: PeerIdx) {
        let p = &mut self.peers[&peer];
        p.life = PairLife::Closed;
        p.idle.since = None;
        p.idle.closes += 1;
        for l in p.send.iter_mut().chain(p.recv.iter_mut()) {
            l.set_life(lane_life::Life::Closed);
            l.send_credits = SendCredits::default();
            l.recv_credits = RecvCredits::default();
        }
        self.actions.push_back(Action::Pairing {
            peer,
            life: PairLife::Closed,
        });
        // The peer may have paired anew while this side was closing (it dials once its side
        // closed): that pairing takes the totals over now.
        let node = &self.peers[&peer].node_id;
        let newer = self
            .peers
            .range(peer..)
            .filter(|&(&i, p)| i != peer && &p.node_id == node && !p.gone())
            .map(|(&i, _)| i)
            .next_back();
        if let Some(newer) = newer {
            self.adopt_closed(newer);
        }
    }

    /// A new pairing (`idx`) with a node whose earlier pairing closed when idle: takes over its
    /// running totals (lane by lane when the lanes are as many; else they go to the node's
    /// retired totals) and releases it, so statistics carry on as if it had never closed.
    pub(super) fn adopt_closed(&mut self, idx: PeerIdx) {
        let node = self.peers[&idx].node_id.clone();
        let closed: Vec<PeerIdx> = self
            .peers
            .iter()
            .filter(|&(&i, p)| {
                i != idx && p.node_id == node && p.failed.is_none() && p.life == PairLife::Closed
            })
            .map(|(&i, _)| i)
            .collect();
        for old in closed {
            let totals = self.peer_counters(old).expect("listed");
            let o = self.peers.remove(&old).expect("listed");
            let p = &mut self.peers[&idx];
            p.idle.closes += o.idle.closes;
            p.transfers_started += o.transfers_started;
            p.transfers_ok += o.transfers_ok;
            p.transfers_failed += o.transfers_failed;
            p.sent_eager += o.sent_eager;
            p.sent_rendezvous += o.sent_rendezvous;
            p.received_eager += o.received_eager;
            p.received_rendezvous += o.received_rendezvous;
            p.sent_notices += o.sent_notices;
            p.received_notices += o.received_notices;
            p.sent_inline += o.sent_inline;
            p.received_inline += o.received_inline;
            if p.send.len() == o.send.len() && p.recv.len() == o.recv.len() {
                for (mine, theirs) in p
                    .send
                    .iter_mut()
                    .zip(&o.send)
                    .chain(p.recv.iter_mut().zip(&o.recv))
                {
                    mine.bytes += theirs.bytes;
                    mine.chunks += theirs.chunks;
                    mine.window_full += theirs.window_full;
                }
            } else {
                // Only the lanes: the totals above went to the new pairing.
                let lanes = PeerCounters {
                    node_id: node.clone(),
                    send: totals.send,
                    recv: totals.recv,
                    ..PeerCounters::default()
                };
                self.retired
                    .entry(node.clone())
                    .or_insert_with(|| PeerCounters {
                        node_id: node.clone(),
                        ..PeerCounters::default()
                    })
                    .absorb(&lanes);
            }
            self.actions.push_back(Action::ReleasePeer { peer: old });
        }
    }
}
