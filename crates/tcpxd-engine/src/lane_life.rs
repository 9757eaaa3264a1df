//! A lane's life (peer protocol 6): opened on first use, closed on both sides once idle, opened
//! again by its next chunk — invisibly to clients, since a chunk queued on a lane that is not open
//! simply waits in the lane's queue, in the order both sides agreed on.
//!
//! # State
//!
//! **The sending side owns each direction's lanes.** A pairing starts with every lane
//! [`Life::Closed`] and no comm. Lane `L` from A to B (A's send lane `L`, B's receive lane `L`):
//!
//! 1. A queues a chunk on closed `L` (`pump`): `L` is `Opening` at A, and A sends
//!    `LaneOpen { L }` on the ordered control stream.
//! 2. B (receive lane `L` closed) makes it `Opening` and asks its driver to listen for it
//!    (`Action::ListenLane`: under the lane's GPU, on its NIC); the driver sends
//!    `LaneListening { L, handle }` and accepts. B's lane is `Open` when the accept completes.
//! 3. A connects to the handle (`Action::ConnectLane`, under its lane's GPU); A's lane is `Open`
//!    when the connect completes, and its queued sends are posted.
//!
//! Idle close, asked by the sender only: a send lane with nothing queued, nothing posted and,
//! on an eager lane, every credit back (so every chunk it ever sent was received, unpacked and
//! consumed by B) for `lane_idle_close` becomes `Closing` at A — no send is posted on it from
//! then on — and A sends `LaneClose { L }`. B closes its side only if its receive lane is quiet
//! too: nothing queued or posted (a rendezvous accept whose receives B already queued for `L`
//! keeps it), no header's chunk announced or landed, no credit owed. B answers
//! `LaneCloseAnswer { L, closed }` (kept while B's accept of `L` has not completed: on Google's
//! plugin A's connect completes without waiting for it, so A's lane can go idle first); closed,
//! both drivers close the comm (`Action::CloseLane`,
//! B's idle credit receives go with it and are posted again at the next open); kept, A's lane is
//! `Open` again. A chunk queued at A while `L` is `Closing` waits for the answer, then goes on the
//! open lane (kept) or opens it again (closed).
//!
//! **Why no send can meet a receive of another transfer.** The plugin matches the k-th send of
//! a comm with its k-th receive. Both lanes' queues are appended in the order of the control
//! stream, as before; opening changes only *when* they post, not the order. A comm is closed
//! only when A has no send posted or queued on it *and* B has no receive posted or queued on
//! it, each side checking its own requests: A asks only with every send done (and eager credits
//! back: B consumed them all), B refuses while any receive of its own remains, and neither posts
//! on the lane between the question and the answer (A is `Closing`; B answered closed before
//! queueing anything later, and anything it queues after its answer waits for the next
//! `LaneOpen`, which A sends after it saw the answer). So a new comm starts with both queues
//! aligned at a chunk boundary.
//!
//! # Shutdown
//!
//! - **Peer loss** (`on_peer_failed`): every lane is `Closed` with its queues, and the driver
//!   drops every comm, listening comm and connector of the pairing (`ClosePeer`).
//! - **Cancel and deadlines** while a lane opens: chunks already agreed on still meet their
//!   partners (cancelled sends go out empty), so they stay queued and the lane still opens; the
//!   transfer ends as before. A lane never waits for ever: the peer's handle must come within
//!   `lane_open_timeout` (else the pairing fails, naming the lane), and the driver bounds each
//!   connect and accept by its connect timeout.
//! - **Protocol errors**: a `LaneOpen` for a lane that is not closed, a handle nobody asked for, a
//!   `LaneClose` for a lane that is closed or closing, or an answer to no question fails the pairing
//!   ("protocol violation"): the two sides no longer agree on which comms exist.

use super::*;

/// `lane_open_timeout`'s default: the peer's listening handle arrives within 30 s.
pub const DEFAULT_LANE_OPEN_TIMEOUT: Duration = Duration::from_secs(30);

/// How often `on_tick` looks for idle lanes and handles that do not come.
const LANE_SCAN: Duration = Duration::from_millis(100);

/// Where a lane is in its life.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum Life {
    /// No comm.
    #[default]
    Closed,
    /// Send lane: `LaneOpen` sent, waiting for the handle (`connecting` once it came). Receive
    /// lane: listened for, accepting. `since`: first seen opening by a lane scan.
    Opening {
        since: Option<Instant>,
        connecting: bool,
    },
    /// Requests may be posted. `idle_since`: quiet since (noted by a lane scan; any post clears it).
    Open { idle_since: Option<Instant> },
    /// Send lane: `LaneClose` sent, waiting for the answer; nothing is posted.
    Closing,
}

impl Life {
    pub(crate) const OPEN: Life = Life::Open { idle_since: None };

    /// The state's name, for messages and statistics.
    pub fn name(&self) -> &'static str {
        match self {
            Life::Closed => "closed",
            Life::Opening { .. } => "opening",
            Life::Open { .. } => "open",
            Life::Closing => "closing",
        }
    }
}

impl Lane {
    /// Moves to `life`; requests may be posted only while open.
    pub(crate) fn set_life(&mut self, life: Life) {
        self.life = life;
        self.ready = matches!(life, Life::Open { .. });
    }

    /// Something was posted: the lane is busy.
    pub(crate) fn touch(&mut self) {
        if let Life::Open { idle_since } = &mut self.life {
            *idle_since = None;
        }
    }

    /// A send lane with nothing queued or posted and every credit back.
    pub(crate) fn send_quiet(&self) -> bool {
        self.queue.is_empty() && self.posted.is_empty() && self.send_credits.all_back()
    }

    /// A receive lane with nothing queued, posted, announced, landed or unpacking, and no credit
    /// owed.
    pub(crate) fn recv_quiet(&self) -> bool {
        self.queue.is_empty()
            && self.posted.is_empty()
            && self.targets.is_empty()
            && self.landed.is_empty()
            && self.unpacking.is_empty()
            && self.recv_credits.owed() == 0
    }
}

impl Engine {
    /// A lane's state, for statistics (`None`: no such lane).
    pub fn lane_life(&self, peer: PeerIdx, lane: u32, send: bool) -> Option<&'static str> {
        let p = self.peers.get(&peer)?;
        let lanes = if send { &p.send } else { &p.recv };
        lanes.get(lane as usize).map(|l| l.life.name())
    }

    /// Lanes open now towards and from every peer (send, receive).
    pub fn lanes_open(&self) -> (usize, usize) {
        let open = |lanes: &[Lane]| lanes.iter().filter(|l| l.life != Life::Closed).count();
        self.peers
            .values()
            .fold((0, 0), |(s, r), p| (s + open(&p.send), r + open(&p.recv)))
    }

    /// From `pump`: each closed send lane with chunks queued asks the peer to listen for it.
    pub(super) fn open_wanted(&mut self, peer: PeerIdx) {
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        for &lane in p.send_used.lanes() {
            let l = &mut p.send[lane as usize];
            if l.life == Life::Closed && !l.queue.is_empty() {
                l.set_life(Life::Opening {
                    since: None,
                    connecting: false,
                });
                self.actions.push_back(Action::Control {
                    peer,
                    msg: PeerMsg::LaneOpen { lane },
                });
            }
        }
    }

    /// The peer will send on our receive lane `lane`: listen for it.
    pub(super) fn on_lane_open(&mut self, peer: PeerIdx, lane: u32) {
        let p = &mut self.peers[&peer];
        let n = p.recv.len();
        match p.recv.get_mut(lane as usize) {
            Some(l) if l.life == Life::Closed => {
                p.recv_used.mark(lane);
                l.set_life(Life::Opening {
                    since: None,
                    connecting: true,
                });
                self.actions.push_back(Action::ListenLane { peer, lane });
            }
            Some(l) => {
                let state = l.life.name();
                self.violation(
                    peer,
                    format!("LaneOpen for receive lane {lane}, which is {state}"),
                );
            }
            None => self.violation(peer, format!("LaneOpen for receive lane {lane} of {n}")),
        }
    }

    /// The peer listens for our send lane `lane`: connect.
    pub(super) fn on_lane_listening(&mut self, peer: PeerIdx, lane: u32, handle: Vec<u8>) {
        let p = &mut self.peers[&peer];
        match p.send.get_mut(lane as usize) {
            Some(l)
                if matches!(
                    l.life,
                    Life::Opening {
                        connecting: false,
                        ..
                    }
                ) =>
            {
                if let Life::Opening { connecting, .. } = &mut l.life {
                    *connecting = true;
                }
                self.actions.push_back(Action::ConnectLane { peer, lane, handle });
            }
            _ => self.violation(
                peer,
                format!("a listening handle for send lane {lane}, not asked for"),
            ),
        }
    }

    /// The peer has nothing on lane `lane` it sends on: close our receive lane if we have
    /// nothing on it either.
    pub(super) fn on_lane_close(&mut self, peer: PeerIdx, lane: u32) {
        let p = &mut self.peers[&peer];
        let Some(l) = p.recv.get_mut(lane as usize) else {
            return self.violation(
                peer,
                format!("LaneClose for receive lane {lane}, which it does not have"),
            );
        };
        if matches!(l.life, Life::Opening { .. }) {
            // Our accept has not completed yet, though the peer's connect has (Google's plugin
            // completes a connect without waiting for the accept) and its lane went idle since:
            // not quiet here, so kept, as for a receive still queued.
            self.actions.push_back(Action::Control {
                peer,
                msg: PeerMsg::LaneCloseAnswer { lane, closed: false },
            });
            return;
        }
        if !matches!(l.life, Life::Open { .. }) {
            let state = l.life.name();
            return self.violation(
                peer,
                format!("LaneClose for receive lane {lane}, which is {state}"),
            );
        }
        let closed = l.recv_quiet();
        if closed {
            l.set_life(Life::Closed);
            l.recv_credits = RecvCredits::default();
            self.actions.push_back(Action::CloseLane {
                peer,
                lane,
                send: false,
            });
        }
        self.actions.push_back(Action::Control {
            peer,
            msg: PeerMsg::LaneCloseAnswer { lane, closed },
        });
    }

    /// The peer's answer to our `LaneClose`.
    pub(super) fn on_lane_close_answer(&mut self, peer: PeerIdx, lane: u32, closed: bool) {
        let p = &mut self.peers[&peer];
        match p.send.get_mut(lane as usize) {
            Some(l) if l.life == Life::Closing => {
                if closed {
                    l.set_life(Life::Closed);
                    self.actions.push_back(Action::CloseLane {
                        peer,
                        lane,
                        send: true,
                    });
                } else {
                    l.set_life(Life::OPEN);
                }
            }
            _ => {
                return self.violation(
                    peer,
                    format!("an answer to a LaneClose for send lane {lane} never sent"),
                );
            }
        }
        // Chunks queued meanwhile: posted (kept) or the lane opened again (closed).
        self.pump(peer);
    }

    /// From `on_tick`, at most every `LANE_SCAN`: closes send lanes quiet for `lane_idle_close`,
    /// fails pairings whose peer did not listen for a lane within `lane_open_timeout`, and closes
    /// pairings quiet for `pairing_idle_close` (`pair_life.rs`).
    pub(super) fn tick_lanes(&mut self, now: Instant) {
        if self.next_lane_scan.is_some_and(|t| t > now) {
            return;
        }
        self.next_lane_scan = Some(now + LANE_SCAN);
        self.scan_pairings(now);
        let (idle_close, open_timeout) = (self.cfg.lane_idle_close, self.cfg.lane_open_timeout);
        let mut late: Vec<(PeerIdx, String)> = Vec::new();
        for (&peer, p) in self.peers.iter_mut() {
            // Every lane with work is listed in use (`lane_use.rs`): checked here, so a path that
            // forgot to list one delays that lane by a scan at most (and fails debug builds).
            let missing = p.mark_lanes_with_work();
            debug_assert_eq!(missing, 0, "lanes with work not listed in use");
            // A closing pairing sends nothing of its own until the peer answered (`pair_life.rs`).
            if p.failed.is_some() || p.life != crate::PairLife::Live {
                continue;
            }
            for (lane, l) in p.send.iter_mut().enumerate() {
                match l.life {
                    Life::Open { idle_since } => {
                        let Some(limit) = idle_close else { continue };
                        if !l.send_quiet() {
                            l.life = Life::OPEN;
                            continue;
                        }
                        match idle_since {
                            None => {
                                l.life = Life::Open {
                                    idle_since: Some(now),
                                }
                            }
                            Some(t) if now.saturating_duration_since(t) >= limit => {
                                l.set_life(Life::Closing);
                                self.actions.push_back(Action::Control {
                                    peer,
                                    msg: PeerMsg::LaneClose { lane: lane as u32 },
                                });
                            }
                            Some(_) => {}
                        }
                    }
                    Life::Opening {
                        since: None,
                        connecting,
                    } => {
                        l.life = Life::Opening {
                            since: Some(now),
                            connecting,
                        };
                    }
                    Life::Opening {
                        since: Some(t),
                        connecting: false,
                    } if now.saturating_duration_since(t) > open_timeout => {
                        late.push((
                            peer,
                            format!("lane {lane}: the peer did not listen for it within {open_timeout:?}"),
                        ));
                    }
                    _ => {}
                }
            }
        }
        for (peer, why) in late {
            self.on_peer_failed(peer, &why);
        }
    }
}
