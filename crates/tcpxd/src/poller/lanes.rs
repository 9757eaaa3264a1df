//! The poller's passes over the lanes: connecting them, executing the engine's actions (posting
//! sends and receives as the windows allow), testing the head of each comm, and consuming
//! completed receives in ring order once unpacked.

use std::collections::BTreeMap;
use std::time::Instant;

use super::blocks::{self, RecvPost, STAGED, ScatterTo, SendPost, Slots};
use super::posting::{Placed, landing_slots, post_recvs, post_sends, start_unpack};
use super::{Completion, LANDING, Landing, PeerSlot, Phase, Poller, Posted, RecvLaneState, SendLaneState};
use crate::engine::{Action, PeerIdx, PeerMsg};
use crate::lanes::{self, GpuStage, Wait};
use crate::poller::{NotificationEvent, PeerLink};

impl Poller {
    /// Drives non-blocking connects and accepts of lanes being set up.
    pub(super) fn drive_setup(&mut self) -> bool {
        // Reused every pass: no allocation on the hot path once it has grown.
        let mut events = std::mem::take(&mut self.completions);
        let now = Instant::now();
        let meter = &self.meter;
        for (&peer, p) in self.peers.iter_mut() {
            if p.failed {
                continue;
            }
            for (li, l) in p.send.iter_mut().enumerate() {
                if let SendLaneState::Connecting(c, deadline) = &mut l.state {
                    match c.step() {
                        Ok(Some(comm)) => {
                            l.state = SendLaneState::Ready(comm);
                            events.push(Completion::LaneReady(peer, li as u32, true));
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
            for (li, l) in p.recv.iter_mut().enumerate() {
                if let RecvLaneState::Accepting(listen, deadline) = &mut l.state {
                    match listen.accept_step() {
                        Ok(Some(comm)) => {
                            l.state = RecvLaneState::Ready(comm);
                            events.push(Completion::LaneReady(peer, li as u32, false));
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
        for p in self.peers.values_mut() {
            if !p.up
                && !p.failed
                && p.send.iter().all(|l| matches!(l.state, SendLaneState::Ready(_)))
                && p.recv.iter().all(|l| matches!(l.state, RecvLaneState::Ready(_)))
            {
                p.up = true;
                tracing::info!(peer = %p.node_id, "peer up");
                p.link.send_replace(PeerLink::Up);
            }
        }
        progressed
    }

    fn apply(&mut self, events: &mut Vec<Completion>) {
        for e in events.drain(..) {
            match e {
                Completion::SendDone(p, l) => self.engine.on_send_done(p, l),
                Completion::RecvConsumed(p, l, r) => self.engine.on_recv_consumed(p, l, r),
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

    /// Executes the engine's actions. Returns whether there were any.
    pub(super) fn run_actions(&mut self) -> bool {
        let mut any = false;
        let mut failures = Vec::new();
        while let Some(a) = self.engine.poll_action() {
            any = true;
            match a {
                Action::Control { peer, msg } => {
                    let (kind, id) = msg.label();
                    tracing::trace!(target: "tcpxd::hop", hop = "poller.out", kind, id);
                    if let Some(p) = self.peers.get(&peer) {
                        let _ = p.control.send(msg);
                    }
                }
                Action::PostSend {
                    peer,
                    lane,
                    buffer,
                    offset,
                    len,
                } => {
                    tracing::trace!(target: "tcpxd::hop", hop = "poller.isend", lane);
                    let (slots, window) = (self.slots(), self.cfg.engine.send_window);
                    let Some(l) = lane_of(&mut self.peers, peer, lane, |p| &mut p.send) else {
                        continue;
                    };
                    // A buffer registered by address: the chunk is gathered from the client's
                    // pages into the lane's staging ring (as a block chunk of one piece) and
                    // sent from there. The engine posts a plain send only while fewer than
                    // `send_window` of the lane's sends are out, so the ring's rule holds.
                    let post = match self.buffers.get(&buffer) {
                        Some(entry) if entry.attached.is_some() => blocks::gather_send(
                            l,
                            entry,
                            &[blocks::whole(offset, len)],
                            len,
                            slots,
                            &mut self.stages,
                            self.unpack_impl,
                        ),
                        _ => Ok((SendPost::plain(buffer, offset, len), None)),
                    };
                    let r = post.and_then(|(post, failed)| {
                        if let Some(why) = failed {
                            self.engine.fail_posted_send(peer, lane, buffer, offset, &why);
                        }
                        l.deferred.push_back(post);
                        post_sends(l, window, &self.buffers, &mut self.stages)
                    });
                    if let Err(why) = r {
                        failures.push((peer, format!("lane {lane} send: {why}")));
                    }
                }
                Action::PostRecv {
                    peer,
                    lane,
                    buffer,
                    offset,
                    len,
                } => {
                    let slots = self.slots();
                    let Some(l) = lane_of(&mut self.peers, peer, lane, |p| &mut p.recv) else {
                        continue;
                    };
                    // A buffer registered by address: the chunk lands in the lane's landing
                    // ring and is scattered into the client's pages (one piece) once complete.
                    let post = match self.buffers.get(&buffer) {
                        Some(entry) if entry.attached.is_some() => {
                            let to = ScatterTo {
                                buffer,
                                offer: 0,
                                wire: 0,
                                direct: Some(offset),
                            };
                            blocks::scatter_recv(l, entry, to, len, slots)
                        }
                        _ => Ok(RecvPost {
                            buffer,
                            offset,
                            len,
                            scatter: None,
                        }),
                    };
                    let r = post.and_then(|post| {
                        l.deferred.push_back(post);
                        post_recvs(l, &self.buffers)
                    });
                    if let Err(why) = r {
                        failures.push((peer, format!("lane {lane} receive: {why}")));
                    }
                }
                Action::PostCredit { peer, lane, len } => {
                    let credits = u64::from(self.cfg.engine.credits);
                    let Some(l) = lane_of(&mut self.peers, peer, lane, |p| &mut p.recv) else {
                        continue;
                    };
                    let r = landing_slots(l, credits, len).and_then(|()| {
                        let slot = l.credit_seq % credits;
                        l.credit_seq += 1;
                        l.deferred.push_back(RecvPost {
                            buffer: LANDING,
                            offset: slot * u64::from(len),
                            len,
                            scatter: None,
                        });
                        post_recvs(l, &self.buffers)
                    });
                    if let Err(why) = r {
                        failures.push((peer, format!("lane {lane} credit receive: {why}")));
                    }
                }
                Action::Land {
                    peer,
                    lane,
                    buffer,
                    offset,
                    len,
                } => {
                    let Some(l) = lane_of(&mut self.peers, peer, lane, |p| &mut p.recv) else {
                        continue;
                    };
                    let RecvLaneState::Ready(comm) = &mut l.state else {
                        continue;
                    };
                    // The oldest completed credit receive still waiting for its header.
                    let Some(landing) = l.queue.awaiting_header() else {
                        failures.push((
                            peer,
                            format!("lane {lane}: a chunk landed with no completed receive"),
                        ));
                        continue;
                    };
                    landing.wait = match buffer {
                        // Refused or cancelled: consumed without unpacking, its slot zeroed.
                        None => lanes::discard(comm, landing.id),
                        Some(buffer) => {
                            let dest = Placed {
                                buffer,
                                offset,
                                len,
                                staged: true,
                            };
                            start_unpack(
                                comm,
                                landing.id,
                                dest,
                                &self.buffers,
                                &mut self.stages,
                                self.unpack_impl,
                            )
                        }
                    };
                    if matches!(landing.wait, Wait::Ready(_)) {
                        landing.meta.unpacked = Some(Instant::now());
                    }
                }
                Action::Progress {
                    transfer,
                    bytes_done,
                    total,
                    running,
                } => {
                    if let Some(tx) = self.transfers.get(&transfer) {
                        tx.send_modify(|s| {
                            s.bytes_done = bytes_done;
                            s.total = total;
                            if running && s.phase == Phase::Offered {
                                s.phase = Phase::Running;
                            }
                        });
                    }
                }
                Action::Finished { transfer, outcome } => {
                    tracing::trace!(target: "tcpxd::hop", hop = "poller.finished", id = transfer.0);
                    if let Some(tx) = self.transfers.remove(&transfer) {
                        self.meter.finished(transfer, &outcome, outcome.landed);
                        tx.send_modify(|s| {
                            // What landed, not what left: a refused WRITE's chunks may all
                            // have been sent.
                            s.bytes_done = outcome.landed;
                            s.phase = Phase::Finished;
                            s.outcome = Some(outcome);
                            s.finished_at = Some(Instant::now());
                        });
                    }
                }
                Action::Notify {
                    peer,
                    transfer_id,
                    payload,
                    buffers,
                } => {
                    let Some(p) = self.peers.get(&peer) else {
                        continue;
                    };
                    let _ = self.notifications.send(NotificationEvent {
                        from_node: p.node_id.clone(),
                        transfer_id,
                        payload,
                        buffers,
                    });
                }
                Action::ClosePeer { peer, reason } => {
                    let Some(p) = self.peers.get_mut(&peer) else {
                        continue;
                    };
                    p.failed = true;
                    // Tells the peer why, then ends the outbound control stream (its pump sees
                    // the channel close after sending what was queued).
                    let _ = p.control.send(PeerMsg::Goodbye {
                        reason: reason.clone(),
                    });
                    p.control = tokio::sync::mpsc::unbounded_channel().0;
                    // Block kernels may still write the lanes' staging rings or read their bounce
                    // buffers: let them finish.
                    if p.send.iter().any(|l| l.staging.on_gpu()) || p.recv.iter().any(|l| l.scatter.on_gpu())
                    {
                        self.stages.values_mut().for_each(GpuStage::quiesce_blocks);
                    }
                    for l in &mut p.send {
                        l.handles.clear();
                        l.deferred.clear();
                        l.staging = blocks::SendStaging::default();
                        l.state = SendLaneState::Closed;
                    }
                    for l in &mut p.recv {
                        l.scatter = blocks::RecvScatter::default();
                        l.handles.clear();
                        l.landing_slots = None;
                        l.deferred.clear();
                        l.queue.clear();
                        l.state = RecvLaneState::Closed;
                    }
                    tracing::warn!(peer = %p.node_id, "peer failed: {reason}");
                    // Stored even with nobody watching (a replaced pairing): GetStats reads it.
                    p.link.send_replace(PeerLink::Failed(reason));
                }
                Action::PostGatherSend {
                    peer,
                    lane,
                    buffer,
                    offer,
                    wire,
                    len,
                } => {
                    let (slots, window) = (self.slots(), self.cfg.engine.send_window);
                    let Some(l) = lane_of(&mut self.peers, peer, lane, |p| &mut p.send) else {
                        continue;
                    };
                    let r = blocks::collect(
                        self.engine.send_pieces(offer, wire, len),
                        &mut self.segs,
                        "sent",
                        offer,
                        wire,
                        len,
                    )
                    .and_then(|()| {
                        let entry = self
                            .buffers
                            .get(&buffer)
                            .ok_or_else(|| format!("buffer {buffer} vanished"))?;
                        blocks::gather_send(
                            l,
                            entry,
                            &self.segs,
                            len,
                            slots,
                            &mut self.stages,
                            self.unpack_impl,
                        )
                    })
                    .and_then(|(post, failed)| {
                        if let Some(why) = failed {
                            self.engine.fail_posted_send(peer, lane, buffer, wire, &why);
                        }
                        l.deferred.push_back(post);
                        post_sends(l, window, &self.buffers, &mut self.stages)
                    });
                    if let Err(why) = r {
                        failures.push((peer, format!("lane {lane} block send: {why}")));
                    }
                }
                Action::PostScatterRecv {
                    peer,
                    lane,
                    buffer,
                    offer,
                    wire,
                    len,
                } => {
                    let slots = self.slots();
                    let Some(l) = lane_of(&mut self.peers, peer, lane, |p| &mut p.recv) else {
                        continue;
                    };
                    let to = ScatterTo {
                        buffer,
                        offer,
                        wire,
                        direct: None,
                    };
                    let r = self
                        .buffers
                        .get(&buffer)
                        .ok_or_else(|| format!("buffer {buffer} vanished"))
                        .and_then(|entry| blocks::scatter_recv(l, entry, to, len, slots))
                        .and_then(|post| {
                            l.deferred.push_back(post);
                            post_recvs(l, &self.buffers)
                        });
                    if let Err(why) = r {
                        failures.push((peer, format!("lane {lane} block receive: {why}")));
                    }
                }
                Action::LandScatter {
                    peer,
                    lane,
                    buffer,
                    offer,
                    wire,
                    len,
                } => {
                    let Some(l) = lane_of(&mut self.peers, peer, lane, |p| &mut p.recv) else {
                        continue;
                    };
                    let RecvLaneState::Ready(comm) = &mut l.state else {
                        continue;
                    };
                    let Some(landing) = l.queue.awaiting_header() else {
                        failures.push((
                            peer,
                            format!("lane {lane}: a block chunk landed with no completed receive"),
                        ));
                        continue;
                    };
                    let r = blocks::collect(
                        self.engine.recv_pieces(peer, offer, wire, len),
                        &mut self.segs,
                        "received",
                        offer,
                        wire,
                        len,
                    )
                    .and_then(|()| {
                        let entry = self
                            .buffers
                            .get(&buffer)
                            .ok_or_else(|| format!("buffer {buffer} vanished"))?;
                        blocks::land_scatter(
                            comm,
                            landing.id,
                            entry,
                            len,
                            &self.segs,
                            &mut self.stages,
                            self.unpack_impl,
                        )
                    });
                    // The receive fails (the engine fails its transfer); the lane goes on, with
                    // nothing of the chunk left in its landing slot.
                    if r.is_err() {
                        let _ = comm.zero_posted(landing.id, len as usize);
                    }
                    landing.wait = Wait::Ready(r);
                    landing.meta.unpacked = Some(Instant::now());
                }
                Action::BufferIdle { buffer } => {
                    for w in self.idle_waiters.remove(&buffer).unwrap_or_default() {
                        let _ = w.send(());
                    }
                }
                Action::ReleasePeer { peer } => {
                    // Closed already (`ClosePeer` came first): what is left goes, and the link's
                    // last state stays with whoever still holds its receiver.
                    if let Some(p) = self.peers.remove(&peer) {
                        tracing::debug!(peer = %p.node_id, "failed pairing released");
                    }
                }
            }
        }
        // This pass's GPU gathers, one launch per GPU; their sends go out once they are done.
        for stage in self.stages.values_mut() {
            stage.submit_gathers();
        }
        for (p, why) in failures {
            self.engine.on_peer_failed(p, &why);
        }
        any
    }

    fn slots(&self) -> Slots {
        let e = &self.cfg.engine;
        Slots {
            staging: (e.send_window + e.gather_ahead).max(1) as u64,
            recv_window: e.recv_window.max(1) as u64,
            chunk_bytes: e.chunk_bytes,
        }
    }

    /// Tests the head of every comm; completes, unpacks and consumes what finished.
    pub(super) fn test_lanes(&mut self) -> bool {
        let window = self.cfg.engine.send_window;
        let Poller {
            peers,
            buffers,
            stages,
            unpack_impl,
            meter,
            engine,
            segs,
            ..
        } = self;
        // Reused every pass: no allocation on the hot path once it has grown.
        let mut events = std::mem::take(&mut self.completions);
        for (&peer, p) in peers.iter_mut() {
            if p.failed {
                continue;
            }
            for (li, l) in p.send.iter_mut().enumerate() {
                let SendLaneState::Ready(comm) = &mut l.state else {
                    continue;
                };
                let tested = lanes::test_sends(comm, || {
                    tracing::trace!(target: "tcpxd::hop", hop = "poller.sent", lane = li);
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
                    && let Err(why) = post_sends(l, window, buffers, stages)
                {
                    events.push(Completion::Failed(peer, format!("lane {li} send: {why}")));
                }
            }
            // Completed receives start their unpack, in ring order.
            for (li, l) in p.recv.iter_mut().enumerate() {
                if !l.deferred.is_empty()
                    && let Err(why) = post_recvs(l, buffers)
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
                    } = posted.meta;
                    let wait = if let Some(to) = to {
                        tracing::trace!(target: "tcpxd::hop", hop = "poller.received", lane = li);
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
                                buffers,
                                stages,
                                *unpack_impl,
                                scatter,
                            ),
                            Err(why) => {
                                if buffer == STAGED {
                                    let _ = comm.zero_posted(id, posted.len as usize);
                                }
                                Wait::Ready(Err(why))
                            }
                        }
                    } else if buffer == LANDING {
                        // Eager: where it goes comes with its header (`Action::Land`).
                        tracing::trace!(target: "tcpxd::hop", hop = "poller.landed", lane = li);
                        events.push(Completion::Landed(peer, li as u32));
                        Wait::Header
                    } else {
                        tracing::trace!(target: "tcpxd::hop", hop = "poller.received", lane = li);
                        let dest = Placed {
                            buffer,
                            offset,
                            len: posted.len,
                            staged: false,
                        };
                        start_unpack(comm, id, dest, buffers, stages, *unpack_impl)
                    };
                    let unpacked = matches!(wait, Wait::Ready(_)).then(Instant::now);
                    (wait, Landing { landed, unpacked })
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
        // Consume what is unpacked, in ring order: only now are the pages returned.
        for (&peer, p) in peers.iter_mut() {
            if p.failed {
                continue;
            }
            for (li, l) in p.recv.iter_mut().enumerate() {
                let RecvLaneState::Ready(comm) = &mut l.state else {
                    continue;
                };
                let consumed = l.queue.consume_ready(
                    comm,
                    |gpu, batch| stages.get(&gpu).and_then(|s| s.outcome(batch)),
                    |front, result| {
                        tracing::trace!(target: "tcpxd::hop", hop = "poller.consumed", lane = li);
                        let now = Instant::now();
                        let Landing { landed, unpacked } = front.meta;
                        let kind = if unpacked.is_some() { "host" } else { "gpu" };
                        meter
                            .metrics
                            .recv_consumed(kind, unpacked.unwrap_or(now) - landed, now - landed);
                        events.push(Completion::RecvConsumed(peer, li as u32, result));
                    },
                );
                if let Err(e) = consumed {
                    meter.metrics.plugin_error(&e);
                    events.push(Completion::Failed(peer, format!("lane {li} irecvConsumed: {e}")));
                }
            }
        }
        let progressed = !events.is_empty();
        self.apply(&mut events);
        self.completions = events;
        progressed
    }
}

/// A lane of a pairing the poller still has (`None` once released).
fn lane_of<L>(
    peers: &mut BTreeMap<PeerIdx, PeerSlot>,
    peer: PeerIdx,
    lane: u32,
    side: impl FnOnce(&mut PeerSlot) -> &mut Vec<L>,
) -> Option<&mut L> {
    peers.get_mut(&peer).and_then(|p| side(p).get_mut(lane as usize))
}
