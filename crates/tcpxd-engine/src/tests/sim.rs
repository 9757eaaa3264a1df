//! The simulator the engine tests run on: two engines wired back to back through a simulated
//! plugin (see the parent module's documentation): its types, the driver carrying out the
//! engines' actions (`drain`), the random order of events, and WRITE / READ with the checks of
//! the end state. How a pair is made is `sim_pair.rs`; the driver's unpack, `sim_unpack.rs`.

use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::super::*;

pub(super) const P: PeerIdx = PeerIdx(0);
/// The buffer id the simulator gives credit receives (their bytes wait for a `Land`).
pub(super) const LANDING: u64 = u64::MAX;
/// The buffer of a receive posted into the lane's own landing place (`Action::PostDropRecv`).
pub(super) const DROPPED: u64 = u64::MAX - 1;

thread_local! {
    /// The receive protocol `Sim::new` gives both engines (see `every_mode`).
    pub(super) static MODE: Cell<Protocol> = const { Cell::new(Protocol::Rendezvous) };
}

/// Under `auto` in `every_mode`: the scenarios' transfers (a few bytes to 90 KB) fall on both
/// sides of this limit, so each scenario mixes eager and rendezvous transfers on one pairing.
pub(super) const SIM_EAGER_MAX: u64 = 16 * 1024;

/// Runs a test under every receive protocol: rendezvous, eager, then auto.
pub(super) fn every_mode(test: fn()) {
    for mode in [Protocol::Rendezvous, Protocol::Eager, Protocol::Auto] {
        MODE.with(|m| m.set(mode));
        test();
    }
    MODE.with(|m| m.set(Protocol::Rendezvous));
}

pub(super) fn mode_now() -> Protocol {
    MODE.with(|m| m.get())
}

/// The receive lanes a node with this configuration opens towards its peer, given the
/// rendezvous (or eager-mode) lane count: auto adds its eager lanes after those.
pub(super) fn recv_lanes(lanes: u32, cfg: &EngineConfig) -> u32 {
    match cfg.protocol {
        Protocol::Auto => lanes + crate::LaneLayout::of(cfg).eager_lanes(),
        _ => lanes,
    }
}

#[derive(Debug, Clone)]
pub(super) struct Post {
    pub(super) buffer: u64,
    pub(super) offset: u64,
    pub(super) len: u32,
    /// A gathered send: its bytes, copied from the pieces when it was posted (the staging slot).
    pub(super) staged: Option<Vec<u8>>,
    /// A scatter receive: (offer, wire); its bytes go to the pieces when it completes.
    pub(super) scatter: Option<(u64, u64)>,
    /// A plain receive: the offer it belongs to (`Engine::recv_lands` is asked on completion).
    pub(super) offer: Option<u64>,
}

impl Post {
    pub(super) fn plain(buffer: u64, offset: u64, len: u32) -> Post {
        Post {
            buffer,
            offset,
            len,
            staged: None,
            scatter: None,
            offer: None,
        }
    }
}

/// Counts of the gather and scatter actions executed (what the property tests check was used).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct PieceStats {
    pub(super) gathers: u64,
    pub(super) scatters: u64,
    pub(super) land_scatters: u64,
    /// Pieces copied in all (gathered or scattered).
    pub(super) pieces: u64,
}

/// Copies a send's pieces out of `buf` (the driver's gather into a staging slot), checking that
/// they tile the chunk in wire order and lie inside the buffer.
pub(super) fn gather(buf: &[u8], pieces: blocks::Pieces<'_>, len: u32) -> (Vec<u8>, u64) {
    let mut out = Vec::with_capacity(len as usize);
    let mut n = 0;
    for p in pieces {
        assert_eq!(p.wire as usize, out.len(), "pieces tile the chunk in order");
        out.extend_from_slice(&buf[p.offset as usize..][..p.len as usize]);
        n += 1;
    }
    assert_eq!(out.len(), len as usize, "the pieces cover the chunk");
    (out, n)
}

/// Copies a received chunk's bytes to its pieces in `buf` (the driver's scatter).
pub(super) fn scatter(buf: &mut [u8], pieces: blocks::Pieces<'_>, data: &[u8]) -> u64 {
    let mut n = 0;
    let mut at = 0usize;
    for p in pieces {
        assert_eq!(p.wire as usize, at, "pieces tile the chunk in order");
        buf[p.offset as usize..][..p.len as usize].copy_from_slice(&data[at..][..p.len as usize]);
        at += p.len as usize;
        n += 1;
    }
    assert_eq!(at, data.len(), "the pieces cover the chunk");
    n
}

#[derive(Default)]
pub(super) struct LaneSim {
    /// Sends the engine posted that the driver holds back, in order, while the plugin already
    /// has `send_window` sends of the lane (gathered ahead: `EngineConfig::gather_ahead`).
    pub(super) deferred: VecDeque<Post>,
    /// Sends the plugin took and not yet matched.
    pub(super) sends: VecDeque<Post>,
    pub(super) recvs: VecDeque<Post>,
    /// With [`Sim::late_reposts`]: credit receives the engine asked for that the driver has
    /// not handed the plugin yet, in order (posted one at a time by `step`).
    pub(super) reposts: VecDeque<Post>,
    pub(super) send_done_pending: usize,
    pub(super) recv_done_pending: usize,
    /// Results to report for the receiver's next completions (an unpack failure, say).
    pub(super) recv_results: VecDeque<Result<(), String>>,
    /// Whether each completed receive not yet reported was a credit receive, in order.
    pub(super) done_credit: VecDeque<bool>,
    /// Bytes of completed credit receives, waiting for their `Land` (the bounce pages).
    pub(super) held: VecDeque<Vec<u8>>,
    /// Plain and scatter receives that met their send, with the bytes that came (in the
    /// plugin's bounce pages): unpacked when their completion is reported, as the daemon's
    /// driver does, and only while the engine says they land (`Engine::recv_lands`).
    pub(super) arrived: VecDeque<(Post, Vec<u8>)>,
    /// Credit receives landed and waiting to be reported consumed.
    pub(super) consume_pending: usize,
    /// With [`Sim::scatter_any_order`]: scatter receives unpacked and not yet reported
    /// consumed, as (offer, wire, result); reported in random order
    /// (`Engine::on_scatter_consumed`), as the daemon's driver does for copies that end out of
    /// order.
    pub(super) scattered: Vec<(u64, u64, Result<(), String>)>,
}

pub(super) struct Node {
    pub(super) eng: Engine,
    pub(super) bufs: HashMap<u64, Vec<u8>>,
    pub(super) finished: HashMap<TransferId, Outcome>,
    pub(super) notes: Vec<(u64, Vec<u8>)>,
    /// The buffers each of `notes` named, in order.
    pub(super) noted_buffers: Vec<Vec<u64>>,
    pub(super) closed: Vec<String>,
    /// The pairing's life as the engine reported it (`Action::Pairing`), in order.
    pub(super) pairing: Vec<PairLife>,
    pub(super) progress: HashMap<TransferId, u64>,
    /// Buffers reported idle (`Action::BufferIdle`), in order.
    pub(super) idle: Vec<u64>,
    pub(super) pieces: PieceStats,
    /// Plain and scatter receives whose completion was reported (unpacked or not).
    pub(super) unpacked: u64,
    /// Chunks that came with data and were not unpacked: the engine said they do not land
    /// (`Engine::recv_lands`, a `Land` with no buffer) or they were posted into the lane's own
    /// place (`Action::PostDropRecv`).
    pub(super) dropped: u64,
    /// Receives posted into the lane's own place (`Action::PostDropRecv`).
    pub(super) drop_posts: u64,
    /// Emptied chunks (a cancelled sender's) that reached a receive still landing its offer:
    /// the daemon's driver, which cannot tell an emptied chunk from one the plugin received in
    /// place, lands such a chunk's landing slot (zeros) in the destination when it was staged.
    pub(super) emptied_live: u64,
    /// `Some`: the driver's inline GPU copies run asynchronously, held here until the test ends
    /// them (`tests/inline.rs`, `finish_copy`); `None`: done at once.
    pub(super) copies: Option<VecDeque<super::inline::SimCopy>>,
}

pub(super) struct Sim {
    pub(super) nodes: [Node; 2],
    /// Control messages in flight to node i.
    pub(super) ctrl: [VecDeque<PeerMsg>; 2],
    /// Data lanes carrying bytes from node i.
    pub(super) wires: [Vec<LaneSim>; 2],
    pub(super) rng: u64,
    pub(super) now: Instant,
    pub(super) cfg: EngineConfig,
    /// Deliver control messages only (to stop data at a chosen stage).
    pub(super) hold_data: bool,
    /// Completed scatter receives on rendezvous lanes are reported consumed in random order
    /// (`Engine::on_scatter_consumed`), not as they completed.
    pub(super) scatter_any_order: bool,
    /// Receive lanes each node listened for (opened on first use) and closed when idle.
    pub(super) opened: [u64; 2],
    pub(super) closed_lanes: [u64; 2],
    /// `Credits` messages node i sent (credits returned before a transfer's `Done`).
    pub(super) credit_msgs: [u64; 2],
    /// Credit receives reach the plugin late: held by the driver and posted one at a time at
    /// random steps, so a `Done` or `Credits` message returning a credit may reach the sender,
    /// and its next send the plugin, before the credit's receive is posted (issue #38: the
    /// `Done` goes before the batch's re-posts; NCCL's net API leaves that order free).
    pub(super) late_reposts: bool,
    /// Times a drain left a credit lane's send waiting for its receive (late re-posts only).
    pub(super) early_sends: u64,
}

pub(super) fn key(n: u8) -> [u8; 16] {
    [n; 16]
}

impl Sim {
    pub(super) fn rand(&mut self, n: usize) -> usize {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng % n as u64) as usize
    }

    /// Executes every pending action of both engines.
    pub(super) fn drain(&mut self) {
        for i in 0..2 {
            while let Some(a) = self.nodes[i].eng.poll_action() {
                match a {
                    Action::Control { peer, msg } => {
                        assert_eq!(peer, P);
                        if matches!(msg, PeerMsg::Credits { .. }) {
                            self.credit_msgs[i] += 1;
                        }
                        self.ctrl[1 - i].push_back(msg);
                    }
                    Action::PostSend {
                        lane,
                        buffer,
                        offset,
                        len,
                        ..
                    } => self.wires[i][lane as usize]
                        .deferred
                        .push_back(Post::plain(buffer, offset, len)),
                    Action::PostRecv {
                        lane,
                        buffer,
                        offset,
                        len,
                        offer,
                        ..
                    } => self.wires[1 - i][lane as usize].recvs.push_back(Post {
                        offer: Some(offer),
                        ..Post::plain(buffer, offset, len)
                    }),
                    Action::PostDropRecv { lane, len, .. } => {
                        self.nodes[i].drop_posts += 1;
                        // Behind the credit receives held back, in the order asked.
                        let w = &mut self.wires[1 - i][lane as usize];
                        let q = if w.reposts.is_empty() {
                            &mut w.recvs
                        } else {
                            &mut w.reposts
                        };
                        q.push_back(Post::plain(DROPPED, 0, len))
                    }
                    Action::PostCredit { lane, len, .. } => {
                        let late = self.late_reposts;
                        let w = &mut self.wires[1 - i][lane as usize];
                        let q = if late { &mut w.reposts } else { &mut w.recvs };
                        q.push_back(Post::plain(LANDING, 0, len))
                    }
                    Action::PostGatherSend {
                        lane,
                        buffer,
                        offer,
                        wire,
                        len,
                        ..
                    } => {
                        let n = &mut self.nodes[i];
                        let pieces = n
                            .eng
                            .send_pieces(offer, wire, len)
                            .expect("a gather for a live offer");
                        let (data, count) = gather(&n.bufs[&buffer], pieces, len);
                        n.pieces.gathers += 1;
                        n.pieces.pieces += count;
                        self.wires[i][lane as usize].deferred.push_back(Post {
                            staged: Some(data),
                            ..Post::plain(buffer, wire, len)
                        });
                    }
                    Action::PostScatterRecv {
                        lane,
                        buffer,
                        offer,
                        wire,
                        len,
                        ..
                    } => {
                        self.nodes[i].pieces.scatters += 1;
                        self.wires[1 - i][lane as usize].recvs.push_back(Post {
                            scatter: Some((offer, wire)),
                            ..Post::plain(buffer, wire, len)
                        });
                    }
                    Action::LandScatter {
                        lane,
                        buffer,
                        offer,
                        wire,
                        len,
                        ..
                    } => {
                        let w = &mut self.wires[1 - i][lane as usize];
                        let data = w.held.pop_front().expect("a Land with no landed receive");
                        w.consume_pending += 1;
                        let n = &mut self.nodes[i];
                        n.pieces.land_scatters += 1;
                        // An emptied chunk (its sender cancelled) brings nothing.
                        if !data.is_empty() {
                            assert_eq!(data.len(), len as usize, "a chunk landed with another size");
                            let pieces = n
                                .eng
                                .recv_pieces(P, offer, wire, len)
                                .expect("a scatter for a live offer");
                            let dst = n.bufs.get_mut(&buffer).expect("Land into a known buffer");
                            n.pieces.pieces += scatter(dst, pieces, &data);
                        }
                    }
                    Action::Land {
                        lane,
                        buffer,
                        offset,
                        len,
                        ..
                    } => {
                        let w = &mut self.wires[1 - i][lane as usize];
                        let data = w.held.pop_front().expect("a Land with no landed receive");
                        w.consume_pending += 1;
                        if buffer.is_none() && !data.is_empty() {
                            self.nodes[i].dropped += 1;
                        }
                        if buffer.is_some() && data.is_empty() {
                            self.nodes[i].emptied_live += 1;
                        }
                        if let Some(b) = buffer {
                            // An emptied chunk (its sender cancelled) brings nothing.
                            if !data.is_empty() {
                                assert_eq!(data.len(), len as usize, "a chunk landed with another size");
                                let dst = self.nodes[i].bufs.get_mut(&b).expect("Land into a known buffer");
                                dst[offset as usize..][..data.len()].copy_from_slice(&data);
                            }
                        }
                    }
                    Action::Progress {
                        transfer,
                        bytes_done,
                        total,
                        ..
                    } => {
                        assert!(bytes_done <= total);
                        let prev = self.nodes[i].progress.insert(transfer, bytes_done).unwrap_or(0);
                        assert!(bytes_done >= prev, "progress never goes back");
                    }
                    Action::Finished { transfer, outcome } => {
                        assert!(
                            self.nodes[i].finished.insert(transfer, outcome).is_none(),
                            "finished twice"
                        );
                    }
                    Action::Notify {
                        payload,
                        transfer_id,
                        buffers,
                        ..
                    } => {
                        self.nodes[i].notes.push((transfer_id, payload));
                        self.nodes[i].noted_buffers.push(buffers);
                    }
                    // Lanes opened on first use (`lane_life.rs`): listened for and accepted at
                    // once; the handle is the lane's number (the other side checks it).
                    Action::ListenLane { lane, .. } => {
                        self.ctrl[1 - i].push_back(PeerMsg::LaneListening {
                            lane,
                            handle: lane.to_le_bytes().to_vec(),
                        });
                        self.nodes[i].eng.on_lane_ready(P, lane, false);
                        self.opened[i] += 1;
                    }
                    Action::ConnectLane { lane, handle, .. } => {
                        assert_eq!(handle, lane.to_le_bytes().to_vec(), "the handle of lane {lane}");
                        self.nodes[i].eng.on_lane_ready(P, lane, true);
                    }
                    Action::CloseLane { lane, send, .. } => {
                        // Nothing of a transfer may be in flight on a comm that closes; a receive
                        // lane's idle credit receives go with it.
                        let w = if send {
                            &mut self.wires[i][lane as usize]
                        } else {
                            &mut self.wires[1 - i][lane as usize]
                        };
                        if send {
                            assert!(
                                w.deferred.is_empty() && w.sends.is_empty(),
                                "lane {lane} closed with sends"
                            );
                        } else {
                            assert!(
                                w.recvs.iter().all(|r| r.buffer == LANDING)
                                    && w.held.is_empty()
                                    && w.arrived.is_empty(),
                                "lane {lane} closed with receives"
                            );
                            assert!(w.sends.is_empty(), "lane {lane} closed with data in flight");
                            assert!(w.reposts.iter().all(|r| r.buffer == LANDING));
                            w.recvs.clear();
                            w.reposts.clear();
                            self.closed_lanes[i] += 1;
                        }
                    }
                    Action::ClosePeer { reason, .. } => self.nodes[i].closed.push(reason),
                    Action::Pairing { life, .. } => {
                        if life == PairLife::Closed {
                            // Closed when idle: nothing of a transfer may be on its comms; a
                            // receive lane's idle credit receives go with them.
                            for w in &self.wires[i] {
                                assert!(w.deferred.is_empty() && w.sends.is_empty(), "closed with sends");
                            }
                            for w in &mut self.wires[1 - i] {
                                assert!(
                                    w.recvs.iter().all(|r| r.buffer == LANDING) && w.held.is_empty(),
                                    "closed with receives"
                                );
                                w.recvs.clear();
                                w.reposts.clear();
                            }
                        }
                        self.nodes[i].pairing.push(life);
                    }
                    Action::ReleasePeer { peer } => panic!("{peer:?} released: a pair's only pairing"),
                    Action::BufferIdle { buffer } => self.nodes[i].idle.push(buffer),
                    // Messages reach the peer in order whenever they are sent: nothing to do.
                    Action::SendNow { .. } => {}
                    // Inline transfers (`inline.rs`): their helpers are in `tests/inline.rs`.
                    Action::SendInline {
                        offer,
                        sources,
                        gather,
                        ..
                    } => super::inline::sim_send(self, i, offer, sources, gather),
                    Action::LandInline {
                        offer,
                        dests,
                        payload,
                        ..
                    } => super::inline::sim_land(self, i, offer, dests, payload),
                }
            }
            let c = self.nodes[i].eng.peer_counters(P).unwrap();
            let cfg = self.nodes[i].eng.config();
            for l in &c.send {
                assert!(
                    l.posted <= cfg.send_window + cfg.gather_ahead.max(cfg.host_gather_ahead),
                    "send window (and gathers ahead) exceeded: {}",
                    l.posted
                );
                assert!(l.credits <= l.credit_limit, "more credits held than granted");
            }
            for l in &c.recv {
                assert!(
                    l.posted <= self.cfg.recv_window + self.cfg.scatter_ahead,
                    "recv window (and scatters ahead) exceeded: {}",
                    l.posted
                );
            }
        }
        // The driver hands the plugin at most `send_window` sends per lane; the plugin matches
        // heads FIFO and moves the bytes.
        for from in 0..2 {
            let window = self.nodes[from].eng.config().send_window;
            for lane in 0..self.wires[from].len() {
                let w = &mut self.wires[from][lane];
                while w.sends.len() + w.send_done_pending < window
                    && let Some(post) = w.deferred.pop_front()
                {
                    w.sends.push_back(post);
                }
                assert!(
                    w.sends.len() + w.send_done_pending <= window,
                    "the plugin holds more than send_window sends of a lane"
                );
                loop {
                    let w = &mut self.wires[from][lane];
                    let (Some(s), Some(r)) = (w.sends.front().cloned(), w.recvs.front().cloned()) else {
                        break;
                    };
                    w.sends.pop_front();
                    w.recvs.pop_front();
                    w.send_done_pending += 1;
                    w.recv_done_pending += 1;
                    w.done_credit.push_back(r.buffer == LANDING);
                    assert!(
                        s.len <= r.len,
                        "sender sent {} bytes into a {}-byte receive: orders disagree",
                        s.len,
                        r.len
                    );
                    let src = match s.staged {
                        Some(data) => data,
                        None if s.len > 0 => {
                            self.nodes[from].bufs[&s.buffer][s.offset as usize..][..s.len as usize].to_vec()
                        }
                        None => Vec::new(),
                    };
                    if r.buffer == LANDING {
                        self.wires[from][lane].held.push_back(src);
                    } else {
                        assert!(
                            s.len == 0 || s.len == r.len,
                            "a live chunk met a receive of another size: orders disagree"
                        );
                        // In the bounce pages until its completion is reported (`step`).
                        self.wires[from][lane].arrived.push_back((r, src));
                    }
                }
                // Eager lanes: every send the sender posted finds a receive posted for it
                // (credits) — or, with late re-posts, one the receiver's driver is yet to post:
                // a credit comes back only once its chunk was consumed, so the sender is never
                // ahead of the receives asked for.
                let eager = self.nodes[1 - from].eng.recv_lane_is_eager(P, lane as u32);
                let w = &self.wires[from][lane];
                assert!(
                    !eager || w.sends.len() <= w.reposts.len(),
                    "a send was posted with no credit receive to meet it"
                );
                if eager && !w.sends.is_empty() {
                    self.early_sends += 1;
                }
            }
        }
    }

    /// Delivers one random pending event; false when none is left.
    pub(super) fn step(&mut self) -> bool {
        self.drain();
        let mut events: Vec<(u8, usize, usize)> = Vec::new();
        for i in 0..2 {
            if !self.ctrl[i].is_empty() {
                events.push((0, i, 0));
            }
            if self.nodes[i].eng.planning() {
                events.push((4, i, 0));
            }
            if self.hold_data {
                continue;
            }
            for (lane, w) in self.wires[i].iter().enumerate() {
                if w.send_done_pending > 0 {
                    events.push((1, i, lane));
                }
                if w.recv_done_pending > 0 {
                    events.push((2, i, lane));
                }
                if w.consume_pending > 0 {
                    events.push((3, i, lane));
                }
                if !w.scattered.is_empty() {
                    events.push((5, i, lane));
                }
                if !w.reposts.is_empty() {
                    events.push((6, i, lane));
                }
            }
        }
        if events.is_empty() {
            return false;
        }
        let (kind, i, lane) = events[self.rand(events.len())];
        match kind {
            0 => {
                let msg = self.ctrl[i].pop_front().unwrap();
                self.nodes[i].eng.on_message(P, msg, self.now);
            }
            1 => {
                self.wires[i][lane].send_done_pending -= 1;
                self.nodes[i].eng.on_send_done(P, lane as u32);
            }
            2 => {
                let w = &mut self.wires[i][lane];
                w.recv_done_pending -= 1;
                if w.done_credit.pop_front().expect("tracked") {
                    // Eager: it landed; it is consumed after its Land.
                    self.nodes[1 - i].eng.on_recv_landed(P, lane as u32, self.now);
                } else {
                    let (r, data) = w.arrived.pop_front().expect("a completed receive met its send");
                    let result = w.recv_results.pop_front().unwrap_or(Ok(()));
                    self.unpack(1 - i, &r, &data);
                    match r.scatter {
                        Some((offer, wire)) if self.scatter_any_order => {
                            self.wires[i][lane].scattered.push((offer, wire, result));
                        }
                        _ => self.nodes[1 - i].eng.on_recv_consumed(P, lane as u32, result),
                    }
                }
            }
            4 => {
                self.nodes[i].eng.plan_pending();
            }
            6 => {
                let w = &mut self.wires[i][lane];
                let post = w.reposts.pop_front().expect("a held receive");
                w.recvs.push_back(post);
            }
            5 => {
                let n = self.wires[i][lane].scattered.len();
                let k = self.rand(n);
                let (offer, wire, result) = self.wires[i][lane].scattered.swap_remove(k);
                self.nodes[1 - i]
                    .eng
                    .on_scatter_consumed(P, lane as u32, offer, wire, result);
            }
            _ => {
                let w = &mut self.wires[i][lane];
                w.consume_pending -= 1;
                let result = w.recv_results.pop_front().unwrap_or(Ok(()));
                self.nodes[1 - i].eng.on_recv_consumed(P, lane as u32, result);
            }
        }
        self.drain();
        true
    }

    pub(super) fn run(&mut self) {
        let mut n = 0;
        while self.step() {
            n += 1;
            assert!(n < 1_000_000, "no quiescence");
        }
    }

    pub(super) fn write(
        &mut self,
        from: usize,
        local: u64,
        loff: u64,
        remote: u64,
        roff: u64,
        len: u64,
    ) -> TransferId {
        let spec = WriteSpec {
            local_buffer: local,
            local_offset: loff,
            peer: P,
            remote: RemoteRange {
                buffer_id: remote,
                access_key: key(remote as u8),
                offset: roff,
                length: len,
            },
        };
        let deadline = self.now + Duration::from_secs(60);
        self.nodes[from]
            .eng
            .start_write(vec![spec], b"note".to_vec(), deadline, self.now)
            .unwrap()
    }

    pub(super) fn read(
        &mut self,
        at: usize,
        remote: u64,
        roff: u64,
        local: u64,
        loff: u64,
        len: u64,
    ) -> TransferId {
        let spec = ReadSpec {
            peer: P,
            remote: RemoteRange {
                buffer_id: remote,
                access_key: key(remote as u8),
                offset: roff,
                length: len,
            },
            local_buffer: local,
            local_offset: loff,
        };
        let deadline = self.now + Duration::from_secs(60);
        self.nodes[at]
            .eng
            .start_read(vec![spec], deadline, self.now)
            .unwrap()
    }

    pub(super) fn outcome(&self, node: usize, t: TransferId) -> &Outcome {
        self.nodes[node]
            .finished
            .get(&t)
            .unwrap_or_else(|| panic!("transfer {t} not finished"))
    }

    pub(super) fn same(&self, a: (usize, u64, u64), b: (usize, u64, u64), len: u64) -> bool {
        self.nodes[a.0].bufs[&a.1][a.2 as usize..][..len as usize]
            == self.nodes[b.0].bufs[&b.1][b.2 as usize..][..len as usize]
    }

    pub(super) fn assert_idle(&self) {
        for n in &self.nodes {
            assert!(n.eng.is_idle(), "engine not idle: {:?}", n.eng.peer_counters(P));
            assert!(n.eng.lanes_idle(), "a request is still posted");
            assert_eq!(n.eng.posted(), (0, 0), "slots not back to zero");
            for id in n.bufs.keys() {
                assert_eq!(n.eng.buffer_users(*id), Some(0), "buffer {id} still in use");
            }
        }
        for w in self.wires.iter().flatten() {
            assert!(
                w.deferred.is_empty()
                    && w.sends.is_empty()
                    && w.reposts.is_empty()
                    && w.recvs.iter().all(|r| r.buffer == LANDING),
                "a post never met its partner"
            );
            assert!(
                w.held.is_empty() && w.consume_pending == 0 && w.arrived.is_empty() && w.scattered.is_empty(),
                "a landed chunk was never consumed"
            );
        }
        // Every credit is back: held by the sender, posted again by the receiver.
        for n in &self.nodes {
            let c = n.eng.peer_counters(P).unwrap();
            for l in c.send.iter().chain(&c.recv) {
                assert_eq!(l.credits, l.credit_limit, "credits not back: {c:?}");
                assert_eq!(l.credit_bytes_out, 0, "credit bytes not back: {c:?}");
            }
        }
    }
}
