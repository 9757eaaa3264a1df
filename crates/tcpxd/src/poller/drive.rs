//! The poller's passes that drive the comms: connecting and accepting lanes being set up, testing
//! the head of each comm (a completed receive starts its unpack, in ring order), and consuming
//! completed receives in ring order once unpacked. What the plugin reports becomes a
//! [`Completion`], applied to the engine at the end of the pass.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use super::blocks::{self, STAGED};
use super::lane_thread::{LaneEvent, ToLanes};
use super::posting::{Placed, post_recvs, post_sends, start_buffer_unpack};
use super::{
    Completion, LANDING, Landing, PeerSlot, Poller, Posted, RecvLane, RecvLaneState, SendLaneState, Threaded,
};
use crate::buffers::BufferEntry;
use crate::engine::PeerIdx;
use crate::lanes::GpuStage;
use crate::lanes::{self, Wait};
use crate::metrics::Meter;

impl Poller {
    /// Drives non-blocking connects and accepts of lanes being set up.
    pub(super) fn drive_setup(&mut self) -> bool {
        // Reused every pass: no allocation on the hot path once it has grown.
        let mut events = std::mem::take(&mut self.completions);
        let now = Instant::now();
        let meter = &self.meter;
        let rules = &self.cfg.rx_rules;
        let topology = &self.cfg.topology;
        let lanes = &mut self.lanes;
        for (&peer, p) in self.peers.iter_mut() {
            if p.failed {
                continue;
            }
            // Only lanes ever opened have a comm (`PeerSlot::send_opened`).
            for &li in &p.send_opened {
                let l = &mut p.send[li];
                if let SendLaneState::Connecting(c, deadline) = &mut l.state {
                    // Each call under the lane's GPU: the plugin reads the current device.
                    if let Err(e) = crate::topology::make_current(l.gpu) {
                        events.push(Completion::Failed(peer, format!("lane {li}: {e}")));
                        continue;
                    }
                    match c.step() {
                        Ok(Some(comm)) => {
                            let handed = match lanes.as_mut() {
                                // Every call on the comm from now on is its GPU's lane thread's.
                                Some(t) => {
                                    l.epoch += 1;
                                    let trace_id = comm.trace_id();
                                    let open = ToLanes::Open {
                                        key: (peer, li as u32),
                                        epoch: l.epoch,
                                        comm,
                                        gpu: l.gpu,
                                    };
                                    t.open(l.gpu, open).map(|()| {
                                        SendLaneState::Threaded(Threaded {
                                            outstanding: 0,
                                            trace_id,
                                        })
                                    })
                                }
                                None => Ok(SendLaneState::Ready(comm)),
                            };
                            match handed {
                                Ok(state) => {
                                    l.state = state;
                                    events.push(Completion::LaneReady(peer, li as u32, true));
                                }
                                Err(why) => {
                                    events.push(Completion::Failed(peer, format!("lane {li}: {why}")))
                                }
                            }
                        }
                        Ok(None) if now > *deadline => {
                            events.push(Completion::Failed(peer, format!("lane {li}: connect timed out")))
                        }
                        Ok(None) => {}
                        Err(e) => {
                            meter.metrics.plugin_error(&e);
                            events.push(Completion::Failed(peer, format!("lane {li}: {e}")))
                        }
                    }
                }
            }
            for &li in &p.recv_opened {
                let l = &mut p.recv[li];
                if let RecvLaneState::Accepting(listen, deadline) = &mut l.state {
                    if let Err(e) = crate::topology::make_current(l.gpu) {
                        events.push(Completion::Failed(peer, format!("lane {li}: {e}")));
                        continue;
                    }
                    let data_at = crate::rx_rules::data_listen_addr(&listen.handle().0);
                    match listen.accept_step() {
                        Ok(Some(comm)) => {
                            // Google's plugin installed a flow-steering rule per data socket it
                            // accepted: recorded until the comm's close removes them
                            // (src/rx_rules.rs).
                            let recorded = match (rules, data_at) {
                                (Some(book), Some(at)) => {
                                    Some(book.record(super::peers::lane_flows(topology, l.gpu, at)))
                                }
                                _ => None,
                            };
                            let handed = match lanes.as_mut() {
                                // Every call on the comm from now on is its GPU's lane thread's
                                // (`lane_thread/recv.rs`), with the rules' record.
                                Some(t) => {
                                    l.epoch += 1;
                                    let trace_id = comm.trace_id();
                                    let open = ToLanes::OpenRecv {
                                        key: (peer, li as u32),
                                        epoch: l.epoch,
                                        comm,
                                        gpu: l.gpu,
                                        rules: recorded,
                                    };
                                    t.open(l.gpu, open).map(|()| RecvLaneState::Threaded { trace_id })
                                }
                                None => {
                                    l.rules = recorded;
                                    Ok(RecvLaneState::Ready(comm))
                                }
                            };
                            match handed {
                                Ok(state) => {
                                    l.state = state;
                                    events.push(Completion::LaneReady(peer, li as u32, false));
                                }
                                Err(why) => {
                                    events.push(Completion::Failed(peer, format!("lane {li}: {why}")))
                                }
                            }
                        }
                        Ok(None) if now > *deadline => {
                            events.push(Completion::Failed(peer, format!("lane {li}: accept timed out")))
                        }
                        Ok(None) => {}
                        Err(e) => {
                            meter.metrics.plugin_error(&e);
                            events.push(Completion::Failed(peer, format!("lane {li}: {e}")))
                        }
                    }
                }
            }
        }
        let progressed = !events.is_empty();
        self.apply(&mut events);
        self.completions = events;
        progressed
    }

    fn apply(&mut self, events: &mut Vec<Completion>) {
        for e in events.drain(..) {
            match e {
                Completion::SendDone(p, l) => self.engine.on_send_done(p, l),
                Completion::RecvConsumed(p, l, r) => self.engine.on_recv_consumed(p, l, r),
                Completion::ScatterConsumed(p, l, (offer, wire), r) => {
                    self.engine.on_scatter_consumed(p, l, offer, wire, r)
                }
                Completion::Landed(p, l) => self.engine.on_recv_landed(p, l, Instant::now()),
                Completion::LaneReady(p, l, send) => self.engine.on_lane_ready(p, l, send),
                Completion::Failed(p, why) => {
                    if let Some(slot) = self.peers.get(&p) {
                        tracing::warn!(peer = %slot.node_id, "{why}");
                    }
                    self.engine.on_peer_failed(p, &why)
                }
            }
        }
    }

    /// Tests the head of every comm; completes, unpacks and consumes what finished.
    pub(super) fn test_lanes(&mut self) -> bool {
        // Everything unpacked by now is consumed below.
        self.landed_in_actions = false;
        let copied = !self.inline_copies.is_idle() && self.finish_inline_copies();
        // Reused every pass: no allocation on the hot path once it has grown.
        let mut events = std::mem::take(&mut self.completions);
        let threaded = self.take_lane_events(&mut events);
        let window = self.cfg.engine.send_window;
        let recv_window = self.cfg.engine.recv_window;
        let Poller {
            peers,
            buffers,
            stages,
            unpack_impl,
            host_copies,
            meter,
            engine,
            segs,
            lanes,
            ..
        } = self;
        let lanes = lanes.as_ref();
        for (&peer, p) in peers.iter_mut() {
            if p.failed {
                continue;
            }
            for &li in &p.send_opened {
                let l = &mut p.send[li];
                let comm = match &mut l.state {
                    SendLaneState::Ready(comm) => comm,
                    // Its sends done came from the lane thread (above): those held back follow.
                    SendLaneState::Threaded(_) => {
                        if !l.deferred.is_empty()
                            && let Err(why) =
                                post_sends(peer, li, l, window, buffers, stages, host_copies, lanes)
                        {
                            events.push(Completion::Failed(peer, format!("lane {li} send: {why}")));
                        }
                        continue;
                    }
                    _ => continue,
                };
                let cid = comm.trace_id();
                for _ in 0..std::mem::take(&mut l.sent_early) {
                    tracing::trace!(target: "tcpxd::hop", hop = "poller.sent", pass = crate::lanes::pass(), lane = li, comm = cid);
                    events.push(Completion::SendDone(peer, li as u32));
                }
                let tested = lanes::test_sends(comm, || {
                    tracing::trace!(target: "tcpxd::hop", hop = "poller.sent", pass = crate::lanes::pass(), lane = li, comm = cid);
                    events.push(Completion::SendDone(peer, li as u32))
                });
                if let Err(e) = tested {
                    meter.metrics.plugin_error(&e);
                    events.push(Completion::Failed(peer, format!("lane {li} send: {e}")));
                    continue;
                }
                // After the test: a send done makes room for the next one held back (gathered
                // ahead), posted in this pass rather than the next.
                if !l.deferred.is_empty()
                    && let Err(why) = post_sends(peer, li, l, window, buffers, stages, host_copies, lanes)
                {
                    events.push(Completion::Failed(peer, format!("lane {li} send: {why}")));
                }
            }
            // Completed receives start their unpack, in ring order.
            for &li in &p.recv_opened {
                let l = &mut p.recv[li];
                if !l.deferred.is_empty()
                    && let Err(why) = post_recvs(l, recv_window, buffers)
                {
                    events.push(Completion::Failed(peer, format!("lane {li} receive: {why}")));
                    continue;
                }
                let RecvLaneState::Ready(comm) = &mut l.state else {
                    continue;
                };
                let scatter = &mut l.scatter;
                let tested = l.queue.test_heads(comm, |comm, posted| {
                    let landed = Instant::now();
                    let id = posted.id;
                    let Posted {
                        buffer,
                        offset,
                        scatter: to,
                        offer,
                    } = posted.meta;
                    let wait = if buffer == LANDING {
                        // Eager: where it goes comes with its header (`Action::Land`).
                        tracing::trace!(target: "tcpxd::hop", hop = "poller.landed", pass = crate::lanes::pass(), lane = li, comm = comm.trace_id());
                        events.push(Completion::Landed(peer, li as u32));
                        Wait::Header
                    } else if offer.is_none_or(|o| !engine.recv_lands(peer, o)) {
                        // Its transfer ended here since it was posted (failed, cancelled), or it
                        // was posted for one that had (`PostDropRecv`): nothing of it reaches the
                        // destination. What a landing slot holds is zeroed (a direct receive's
                        // bytes); a receive posted into the destination or a GPU anchor has
                        // nothing to undo.
                        tracing::trace!(target: "tcpxd::hop", hop = "poller.dropped", pass = crate::lanes::pass(), lane = li, comm = comm.trace_id());
                        if buffer == STAGED {
                            lanes::discard(comm, id)
                        } else {
                            Wait::Ready(Ok(()))
                        }
                    } else if let Some(to) = to {
                        tracing::trace!(target: "tcpxd::hop", hop = "poller.received", pass = crate::lanes::pass(), lane = li, comm = comm.trace_id());
                        let pieces = match to.direct {
                            Some(at) => {
                                segs.clear();
                                segs.push(blocks::whole(at, posted.len));
                                Ok(())
                            }
                            None => blocks::collect(
                                engine.recv_pieces(peer, to.offer, to.wire, posted.len),
                                segs,
                                "received",
                                to.offer,
                                to.wire,
                                posted.len,
                            ),
                        };
                        match pieces {
                            Ok(()) => blocks::start_scatter(
                                comm,
                                id,
                                to,
                                posted.len,
                                segs,
                                buffers.get(&to.buffer),
                                stages,
                                *unpack_impl,
                                host_copies,
                                scatter,
                            ),
                            Err(why) => {
                                if buffer == STAGED {
                                    let _ = comm.zero_posted(id, posted.len as usize);
                                }
                                Wait::Ready(Err(why))
                            }
                        }
                    } else {
                        tracing::trace!(target: "tcpxd::hop", hop = "poller.received", pass = crate::lanes::pass(), lane = li, comm = comm.trace_id());
                        let dest = Placed {
                            buffer,
                            offset,
                            len: posted.len,
                            staged: false,
                        };
                        start_buffer_unpack(comm, id, dest, buffers, stages, *unpack_impl)
                    };
                    let unpacked = matches!(wait, Wait::Ready(_)).then(Instant::now);
                    let on_host = wait.on_host();
                    (
                        wait,
                        Landing {
                            landed,
                            unpacked,
                            on_host,
                            ring_slot: (buffer == STAGED).then_some(offset),
                            chunk: to.filter(|t| t.direct.is_none()).map(|t| (t.offer, t.wire)),
                        },
                    )
                });
                if let Err(e) = tested {
                    meter.metrics.plugin_error(&e);
                    events.push(Completion::Failed(peer, format!("lane {li} receive: {e}")));
                }
            }
        }
        // One batch of GPU work per GPU for everything pushed in this pass; then what finished.
        for stage in stages.values_mut() {
            stage.advance();
        }
        consume_unpacked(peers, buffers, recv_window, stages, meter, &mut events);
        let progressed = copied || threaded || !events.is_empty();
        self.apply(&mut events);
        self.completions = events;
        self.sweep_lands();
        if let Some(t) = &self.lanes {
            t.flush();
        }
        progressed
    }

    /// Takes what the lane threads reported (`lane_thread.rs`): each send done a
    /// [`Completion::SendDone`] (its lane's count handed over goes down), each credit receive
    /// completed a [`Completion::Landed`], each receive consumed a [`Completion::RecvConsumed`]
    /// (or `ScatterConsumed`), a lane's failure its pairing's. Those about a comm the lane no
    /// longer has are ignored. True when any came.
    fn take_lane_events(&mut self, events: &mut Vec<Completion>) -> bool {
        let Some(t) = &self.lanes else {
            return false;
        };
        let mut got = std::mem::take(&mut self.lane_events);
        t.events.take(&mut got);
        let any = !got.is_empty();
        let mut ended = Vec::new();
        for e in got.drain(..) {
            match e {
                LaneEvent::Ended { gpu, why } => ended.push((gpu, why)),
                LaneEvent::Sent { key, epoch, .. } | LaneEvent::Failed { key, epoch, .. } => {
                    let (peer, li) = key;
                    let Some(l) = self
                        .peers
                        .get_mut(&peer)
                        .filter(|p| !p.failed)
                        .and_then(|p| p.send.get_mut(li as usize))
                        .filter(|l| l.epoch == epoch)
                    else {
                        continue;
                    };
                    let SendLaneState::Threaded(th) = &mut l.state else {
                        continue;
                    };
                    match e {
                        LaneEvent::Sent { n, .. } => {
                            th.outstanding = th.outstanding.saturating_sub(n as usize);
                            for _ in 0..n {
                                tracing::trace!(target: "tcpxd::hop", hop = "poller.sent", pass = crate::lanes::pass(), lane = li, comm = th.trace_id);
                                events.push(Completion::SendDone(peer, li));
                            }
                        }
                        LaneEvent::Failed { why, .. } => {
                            events.push(Completion::Failed(peer, format!("lane {li} send: {why}")));
                        }
                        _ => {}
                    }
                }
                LaneEvent::Landed { key, epoch }
                | LaneEvent::Consumed { key, epoch, .. }
                | LaneEvent::RecvFailed { key, epoch, .. } => {
                    let (peer, li) = key;
                    let Some(l) = self
                        .peers
                        .get(&peer)
                        .filter(|p| !p.failed)
                        .and_then(|p| p.recv.get(li as usize))
                        .filter(|l| l.epoch == epoch)
                    else {
                        continue;
                    };
                    let RecvLaneState::Threaded { trace_id } = l.state else {
                        continue;
                    };
                    match e {
                        LaneEvent::Landed { .. } => {
                            tracing::trace!(target: "tcpxd::hop", hop = "poller.landed", pass = crate::lanes::pass(), lane = li, comm = trace_id);
                            events.push(Completion::Landed(peer, li));
                        }
                        LaneEvent::Consumed { chunk, result, .. } => {
                            tracing::trace!(target: "tcpxd::hop", hop = "poller.consumed", pass = crate::lanes::pass(), lane = li, comm = trace_id);
                            events.push(match chunk {
                                Some(c) => Completion::ScatterConsumed(peer, li, c, result),
                                None => Completion::RecvConsumed(peer, li, result),
                            });
                        }
                        LaneEvent::RecvFailed { why, .. } => {
                            events.push(Completion::Failed(peer, format!("lane {li} receive: {why}")));
                        }
                        _ => {}
                    }
                }
            }
        }
        self.lane_events = got;
        for (gpu, why) in ended {
            self.lane_thread_ended(gpu, &why, events);
        }
        any
    }

    /// After a pass's completions: the offers handed to lane threads whose receives no longer
    /// land (the engine discarded or ended them) are told so through their flag and forgotten;
    /// and the lane threads hear whether the engine expects bytes (a thread with only idle
    /// credit receives blocks; it is woken when transfers start again).
    fn sweep_lands(&mut self) {
        let Some(t) = &self.lanes else {
            return;
        };
        let engine = &self.engine;
        self.lands.retain(|&(peer, offer), flag| {
            let lands = engine.recv_lands(peer, offer);
            if !lands {
                flag.store(false, std::sync::atomic::Ordering::Release);
            }
            lands
        });
        t.expect(!engine.lanes_idle());
    }

    /// A lane thread ended other than by `stop` (it panicked: `LaneEvent::Ended`): its lanes
    /// are gone (the thread's guard handed them to the closer threads), so each pairing with a
    /// send lane it drove fails as for a lane's plugin error — its transfers end UNAVAILABLE
    /// naming the thread, its slots and credits come back, and the next transfer pairs again.
    /// The GPU's next connected send lane starts a new thread.
    fn lane_thread_ended(&mut self, gpu: Option<u32>, why: &str, events: &mut Vec<Completion>) {
        if let Some(t) = self.lanes.as_mut() {
            t.ended(gpu);
        }
        let mut failed = 0;
        for (&peer, p) in self.peers.iter().filter(|(_, p)| !p.failed) {
            if let Some(li) = p
                .send
                .iter()
                .position(|l| l.gpu == gpu && matches!(l.state, SendLaneState::Threaded(_)))
            {
                failed += 1;
                events.push(Completion::Failed(peer, format!("lane {li} send: {why}")));
            } else if let Some(li) = p
                .recv
                .iter()
                .position(|l| l.gpu == gpu && matches!(l.state, RecvLaneState::Threaded { .. }))
            {
                failed += 1;
                events.push(Completion::Failed(peer, format!("lane {li} receive: {why}")));
            }
        }
        tracing::error!(pairings = failed, "{why}: the pairings whose lanes it drove fail");
    }

    /// After a batch of actions that landed eager chunks (`Action::Land`, `LandScatter`): the
    /// GPU unpacks they pushed are launched now (a second batch in this pass, not the next
    /// pass's first), and those whose unpack is already over (a host copy, done at once; a GPU
    /// batch that finished) are consumed now, in this pass, so their transfer's end (`Done`,
    /// `Finished`) goes out with this pass's actions rather than after another pass. True when
    /// something was consumed.
    pub(super) fn consume_landed(&mut self) -> bool {
        if !std::mem::take(&mut self.landed_in_actions) {
            return false;
        }
        for stage in self.stages.values_mut() {
            stage.advance();
        }
        let mut events = std::mem::take(&mut self.completions);
        let recv_window = self.cfg.engine.recv_window;
        consume_unpacked(
            &mut self.peers,
            &self.buffers,
            recv_window,
            &self.stages,
            &self.meter,
            &mut events,
        );
        let progressed = !events.is_empty();
        self.apply(&mut events);
        self.completions = events;
        progressed
    }
}

/// Consumes each lane's completed receives whose unpack is over, in ring order (only now are
/// the pages returned), as [`Completion::RecvConsumed`] events; then posts the receives held
/// beyond `recv_window` (`transfer.scatter_ahead`) into the slots that came back.
fn consume_unpacked(
    peers: &mut BTreeMap<PeerIdx, PeerSlot>,
    buffers: &crate::engine::idhash::IdMap<u64, Arc<BufferEntry>>,
    recv_window: usize,
    stages: &HashMap<usize, GpuStage>,
    meter: &Meter,
    events: &mut Vec<Completion>,
) {
    {
        for (&peer, p) in peers.iter_mut() {
            if p.failed {
                continue;
            }
            for &li in &p.recv_opened {
                let l = &mut p.recv[li];
                let RecvLane {
                    state,
                    queue,
                    scatter,
                    ..
                } = l;
                let RecvLaneState::Ready(comm) = state else {
                    continue;
                };
                let cid = comm.trace_id();
                let consumed = queue.consume_ready(
                    comm,
                    |gpu, batch| stages.get(&gpu).and_then(|s| s.outcome(batch)),
                    |front, result| {
                        // A scatter on a copy helper: its wait, copying and end unseen until now.
                        let t = match &front.wait {
                            Wait::Host(t) | Wait::Slot(t) => t.times(),
                            _ => None,
                        }
                        .unwrap_or_default();
                        tracing::trace!(
                            target: "tcpxd::hop",
                            hop = "poller.consumed",
                            pass = crate::lanes::pass(),
                            lane = li,
                            comm = cid,
                            wait_us = t.wait_us,
                            copy_us = t.copy_us,
                            since_us = t.since_us
                        );
                        let now = Instant::now();
                        let Landing {
                            landed,
                            unpacked,
                            on_host,
                            ring_slot,
                            chunk,
                        } = front.meta;
                        let kind = if on_host { "host" } else { "gpu" };
                        meter
                            .metrics
                            .recv_consumed(kind, unpacked.unwrap_or(now) - landed, now - landed);
                        if let Some(at) = ring_slot {
                            scatter.release(at);
                        }
                        events.push(match chunk {
                            Some(c) => Completion::ScatterConsumed(peer, li as u32, c, result),
                            None => Completion::RecvConsumed(peer, li as u32, result),
                        });
                    },
                );
                if let Err(e) = consumed {
                    meter.metrics.plugin_error(&e);
                    events.push(Completion::Failed(peer, format!("lane {li} irecvConsumed: {e}")));
                    continue;
                }
                // Every taken landing slot belongs to a receive held, posted or landed.
                debug_assert!(
                    l.scatter.taken() <= l.deferred.len() + l.queue.posted() + l.queue.landed(),
                    "lane {li}: {} landing slots taken for {} receives",
                    l.scatter.taken(),
                    l.deferred.len() + l.queue.posted() + l.queue.landed()
                );
                // Slots given back (consumed, or released while their copies run) take the
                // receives posted ahead in this pass rather than the next.
                if !l.deferred.is_empty()
                    && let Err(why) = post_recvs(l, recv_window, buffers)
                {
                    events.push(Completion::Failed(peer, format!("lane {li} receive: {why}")));
                }
            }
        }
    }
}

impl Poller {
    /// True while requests carrying bytes are in flight (the engine's view), or the poller
    /// itself has work pending: lanes being set up, posts the plugin could not take yet,
    /// receives being unpacked.
    pub(super) fn busy(&self) -> bool {
        !self.engine.lanes_idle()
            || !self.inline_copies.is_idle()
            || self.engine.planning()
            || !self.inbound.is_empty()
            || !self.direct_ready.is_empty()
            || self.peers.values().any(|p| {
                p.direct.as_ref().is_some_and(|d| d.unsent() > 0)
                    || p.send_opened.iter().map(|&i| &p.send[i]).any(|l| match &l.state {
                        SendLaneState::Connecting(..) => true,
                        SendLaneState::Ready(_) | SendLaneState::Threaded(_) => !l.deferred.is_empty(),
                        SendLaneState::Closed => false,
                    })
                    || p.recv_opened.iter().map(|&i| &p.recv[i]).any(|l| match &l.state {
                        RecvLaneState::Accepting(..) => true,
                        RecvLaneState::Ready(_) => !l.deferred.is_empty() || l.queue.landed() > 0,
                        // Its receives are the engine's in flight until reported consumed.
                        RecvLaneState::Threaded { .. } | RecvLaneState::Closed => false,
                    })
            })
    }
}
