//! The poller's execution of the engine's actions: one short dispatcher (`run_actions`) and a
//! method per action. Posting sends and receives as the windows allow (`posting.rs`), block
//! chunks (`blocks.rs`), unpacking a landed eager or block chunk once its header said where,
//! publishing progress, final outcomes and notifications, and closing and releasing a pairing.

use std::collections::BTreeMap;
use std::time::Instant;

use super::blocks::{self, RecvPost, ScatterTo, SendPost, Slots};
use super::pass_clock;
use super::posting::{Placed, landing_slots, post_recvs, post_sends, start_buffer_unpack};
use super::{LANDING, PeerSlot, Phase, Poller, RecvLane, RecvLaneState, SendLane};
use crate::engine::{Action, Outcome, PeerIdx, PeerMsg, TransferId};
use crate::lanes::{self, GpuStage, Wait};
use crate::net::{RecvComm, RequestId};
use crate::poller::{NotificationEvent, PeerLink};

/// A transfer's progress wakes its waiters only once it is this old: before, it only updates
/// the status they read (`flush_progress`). `Watch` streams see a longer transfer's progress as
/// before; one shorter than this sends its final event alone.
pub(super) const PROGRESS_QUIET: std::time::Duration = std::time::Duration::from_millis(1);

/// A lane's failure: its pairing fails once the pass's actions are done.
type Failure = (PeerIdx, String);

/// Whether an action lands a received chunk (pushes its unpack into a GPU stage or copies it).
fn lands(action: &Action) -> bool {
    matches!(action, Action::Land { .. } | Action::LandScatter { .. })
}

impl Poller {
    /// Executes the engine's actions. Returns whether there were any.
    pub(super) fn run_actions(&mut self) -> bool {
        // The clock is read only once there is something to time: an idle pass calls this twice
        // and found nothing (three clock reads each, a spinning poller's largest cost between
        // two looks at its sockets: session 28, ping).
        let Some(action) = self.engine.poll_action() else {
            if self.direct_pending.is_empty()
                && self.progress.is_empty()
                && !self.stages.values().any(GpuStage::gathers_pending)
            {
                return false;
            }
            let batch = crate::api::local::outbox::Batch::open();
            let t = self.action_clock.mark();
            return self.run_actions_timed(t, Vec::new(), false, batch);
        };
        // The framed sessions' events these actions push (transfers finished, delivered inline)
        // are written as it closes, at the end: one write per session, not one per event.
        let batch = crate::api::local::outbox::Batch::open();
        let (mut any, mut failures) = (false, Vec::new());
        let mut t = self.action_clock.mark();
        let mut next = Some(action);
        let mut launched = false;
        while let Some(action) = next {
            any = true;
            let kind = action.kind();
            let landed = lands(&action);
            if let Err(failure) = self.run_action(action) {
                failures.push(failure);
            }
            t = self.action_clock.add(kind, t);
            next = self.engine.poll_action();
            // A run of landings over: the GPU unpacks they pushed are launched now, before the
            // rest of the batch (the credit receives posted again, the batch's tail), so the GPU
            // works while the poller does those (issue #38, session 33, onemib4: on the H200 a
            // transfer's last unpack was launched 7–10 µs after its `Land`, behind an `irecv`).
            // `consume_landed` still retires and consumes them after the batch, and launches
            // what a later run of landings in the same batch pushed: one launch more a batch at
            // most (the landings a lane test makes come as one run, before its consumes' actions).
            if landed && !launched && !next.as_ref().is_some_and(lands) {
                launched = true;
                for stage in self.stages.values_mut() {
                    stage.advance();
                }
            }
        }
        self.run_actions_timed(t, failures, any, batch)
    }

    /// The end of a batch of actions: the lane threads' orders, the progress flush, the GPU
    /// gathers' launch, the sessions' batched events, the direct connections' writes, then the
    /// pairings that failed; `t` is when the batch's actions ended.
    fn run_actions_timed(
        &mut self,
        mut t: Instant,
        failures: Vec<Failure>,
        any: bool,
        batch: crate::api::local::outbox::Batch,
    ) -> bool {
        // The batch's orders to the lane threads, one message each (`LaneThreads::flush`).
        if let Some(l) = &self.lanes {
            l.flush();
            t = self.action_clock.add(pass_clock::LANE_ORDERS, t);
        }
        self.flush_progress();
        t = self.action_clock.add(pass_clock::PROGRESS_FLUSH, t);
        // This pass's GPU gathers, one launch per GPU; their sends go out once they are done.
        for stage in self.stages.values_mut() {
            stage.submit_gathers();
        }
        t = self.action_clock.add(pass_clock::SUBMIT_GATHERS, t);
        // The framed sessions' events before the direct connections' writes: a READ's answer
        // goes before its `Done` to the server, which only releases the sources on it (a
        // received WRITE's `Done`, which a client waits for, went at once: `Action::SendNow`).
        // With a sessions thread the writes are its own (session_thread.rs): handed over.
        let wrote = match self.park.hub() {
            Some(hub) => {
                let any = batch.close_into(&mut self.hub_writes);
                if hub.hand_writes(&mut self.hub_writes, &mut self.hub_answers) {
                    self.hub_unrung = false;
                }
                any
            }
            None => batch.close(),
        };
        if wrote {
            t = self.action_clock.add(pass_clock::FINISHED, t);
        }
        if !self.direct_pending.is_empty() {
            self.send_direct();
            self.action_clock.add(pass_clock::SEND_DIRECT, t);
        }
        for (p, why) in failures {
            self.engine.on_peer_failed(p, &why);
        }
        any
    }

    /// One action, by the method of its own.
    fn run_action(&mut self, action: Action) -> Result<(), Failure> {
        let fails = |peer: PeerIdx| move |why: String| (peer, why);
        match action {
            Action::Control { peer, msg } => self.send_control(peer, msg),
            Action::PostSend {
                peer,
                lane,
                buffer,
                offset,
                len,
            } => self
                .post_send(peer, lane, buffer, offset, len)
                .map_err(fails(peer))?,
            Action::PostRecv {
                peer,
                lane,
                buffer,
                offset,
                len,
                offer,
            } => self
                .post_recv(peer, lane, buffer, offset, len, offer)
                .map_err(fails(peer))?,
            Action::PostDropRecv { peer, lane, len } => {
                self.post_drop_recv(peer, lane, len).map_err(fails(peer))?
            }
            Action::PostCredit { peer, lane, len } => {
                self.post_credit(peer, lane, len).map_err(fails(peer))?
            }
            Action::Land {
                peer,
                lane,
                buffer,
                offset,
                len,
            } => {
                self.landed_in_actions = true;
                tracing::trace!(target: "tcpxd::hop", hop = "poller.land", pass = crate::lanes::pass(), lane);
                self.land(peer, lane, buffer, offset, len).map_err(fails(peer))?
            }
            Action::Progress {
                transfer,
                bytes_done,
                total,
                running,
            } => self.publish_progress(transfer, bytes_done, total, running),
            Action::Finished { transfer, outcome } => self.finish(transfer, outcome),
            Action::Notify {
                peer,
                transfer_id,
                payload,
                buffers,
            } => self.notify(peer, transfer_id, payload, buffers),
            Action::ClosePeer { peer, reason } => self.close_peer(peer, reason),
            Action::ListenLane { peer, lane } => self.listen_lane(peer, lane).map_err(fails(peer))?,
            Action::ConnectLane { peer, lane, handle } => {
                self.connect_lane(peer, lane, &handle).map_err(fails(peer))?
            }
            Action::CloseLane { peer, lane, send } => self.close_lane(peer, lane, send),
            Action::PostGatherSend {
                peer,
                lane,
                buffer,
                offer,
                wire,
                len,
            } => self
                .post_gather_send(peer, lane, buffer, offer, wire, len)
                .map_err(fails(peer))?,
            Action::PostScatterRecv {
                peer,
                lane,
                buffer,
                offer,
                wire,
                len,
            } => self
                .post_scatter_recv(peer, lane, buffer, offer, wire, len)
                .map_err(fails(peer))?,
            Action::LandScatter {
                peer,
                lane,
                buffer,
                offer,
                wire,
                len,
            } => {
                self.landed_in_actions = true;
                tracing::trace!(target: "tcpxd::hop", hop = "poller.land", pass = crate::lanes::pass(), lane);
                self.land_scatter(peer, lane, buffer, offer, wire, len)
                    .map_err(fails(peer))?
            }
            Action::SendInline {
                peer,
                offer,
                sources,
                gather,
            } => self.send_inline(peer, offer, sources, gather),
            Action::LandInline {
                peer,
                offer,
                dests,
                payload,
                gpu,
            } => self.land_inline(peer, offer, dests, payload, gpu),
            Action::BufferIdle { buffer } => self.buffer_idle(buffer),
            Action::SendNow { peer } => self.send_now(peer),
            Action::Pairing { peer, life } => self.pairing_life(peer, life),
            Action::ReleasePeer { peer } => self.release_peer(peer),
        }
        Ok(())
    }

    pub(super) fn send_control(&mut self, peer: PeerIdx, msg: PeerMsg) {
        let (kind, id) = msg.label();
        tracing::trace!(target: "tcpxd::hop", hop = "poller.out", pass = crate::lanes::pass(), kind, id);
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        match p.direct.as_mut().filter(|d| d.switched) {
            // The direct control connection (`direct.rs`): framed now, on the wire from this
            // thread at the end of the batch of actions (`send_direct`).
            Some(d) => {
                if d.unsent() == 0 {
                    self.direct_pending.push(peer);
                }
                d.push(&msg);
            }
            None => {
                let _ = p.control.send(super::ControlOut::Msg(msg));
            }
        }
    }

    /// The control messages framed for `peer` go on the wire now (`Action::SendNow`: a received
    /// WRITE's `Done`, before the batch's credit receives posted again and the rest of its
    /// actions); what the socket cannot take yet waits for the pass's `flush_direct`, as at the
    /// batch's end. On the control stream every message is queued at once already.
    fn send_now(&mut self, peer: PeerIdx) {
        if let Some(d) = self.peers.get_mut(&peer).and_then(|p| p.direct.as_mut())
            && d.switched
            && d.unsent() > 0
            && let Err(why) = d.flush()
        {
            self.direct_broken.push((peer, why));
        }
    }

    fn post_send(
        &mut self,
        peer: PeerIdx,
        lane: u32,
        buffer: u64,
        offset: u64,
        len: u32,
    ) -> Result<(), String> {
        tracing::trace!(target: "tcpxd::hop", hop = "poller.isend", pass = crate::lanes::pass(), lane);
        let slots = self.slots();
        let Some(l) = lane_of(&mut self.peers, peer, lane, |p| &mut p.send) else {
            return Ok(());
        };
        // A buffer registered by address: the chunk is gathered from the client's pages into
        // the lane's staging ring (as a block chunk of one piece) and sent from there. The
        // engine posts a plain send only while fewer than `send_window` of the lane's sends are
        // out, so the ring's rule holds.
        let made = match self.buffers.get(&buffer) {
            Some(entry) if entry.attached.is_some() => blocks::gather_send(
                l,
                entry,
                &[blocks::whole(offset, len)],
                len,
                slots,
                &mut self.stages,
                self.unpack_impl,
                &self.host_copies,
                (self.lanes.as_ref(), (peer, lane)),
            ),
            _ => Ok((SendPost::plain(buffer, offset, len), None)),
        };
        self.queue_send(peer, lane, (buffer, offset), made, "send")
    }

    /// Queues a send just made (`made`: a plain send, or a chunk gathered into the lane's
    /// staging ring, with why the gather failed if it did) and posts what the lane's window
    /// allows. A failed gather's chunk is sent all the same (the lanes stay in step) and the
    /// engine fails the transfer that sent (buffer, offset). Errors name the lane and
    /// `what` was sent.
    fn queue_send(
        &mut self,
        peer: PeerIdx,
        lane: u32,
        (buffer, offset): (u64, u64),
        made: Result<(SendPost, Option<String>), String>,
        what: &str,
    ) -> Result<(), String> {
        let window = self.cfg.engine.send_window;
        let Some(l) = lane_of(&mut self.peers, peer, lane, |p| &mut p.send) else {
            return Ok(());
        };
        made.and_then(|(post, failed)| {
            if let Some(why) = failed {
                self.engine.fail_posted_send(peer, lane, buffer, offset, &why);
            }
            l.deferred.push_back(post);
            post_sends(
                peer,
                lane as usize,
                l,
                window,
                &self.buffers,
                &mut self.stages,
                &self.host_copies,
                self.lanes.as_ref(),
            )
        })
        .map_err(|why| format!("lane {lane} {what}: {why}"))
    }

    fn post_recv(
        &mut self,
        peer: PeerIdx,
        lane: u32,
        buffer: u64,
        offset: u64,
        len: u32,
        offer: u64,
    ) -> Result<(), String> {
        if let Some(r) = self.thread_post_recv(peer, lane, buffer, offset, len, offer) {
            return r;
        }
        let slots = self.slots();
        let recv_window = self.cfg.engine.recv_window;
        let Some(l) = lane_of(&mut self.peers, peer, lane, |p| &mut p.recv) else {
            return Ok(());
        };
        // A buffer registered by address: the chunk lands in the lane's landing ring and is
        // scattered into the client's pages (one piece) once complete.
        let post = match self.buffers.get(&buffer) {
            Some(entry) if entry.attached.is_some() => {
                let to = ScatterTo {
                    buffer,
                    offer,
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
                offer: Some(offer),
            }),
        };
        trace_recv_slot(l);
        post.and_then(|post| {
            l.deferred.push_back(post);
            post_recvs(l, recv_window, &self.buffers)
        })
        .map_err(|why| format!("lane {lane} receive: {why}"))
    }

    /// A receive for a chunk of a transfer that ended here: into the lane's landing ring, never
    /// into the destination (a plugin receiving in place would write it there), dropped once it
    /// completed (`test_lanes`).
    fn post_drop_recv(&mut self, peer: PeerIdx, lane: u32, len: u32) -> Result<(), String> {
        if let Some(r) = self.thread_post_drop_recv(peer, lane, len) {
            return r;
        }
        let slots = self.slots();
        let recv_window = self.cfg.engine.recv_window;
        let Some(l) = lane_of(&mut self.peers, peer, lane, |p| &mut p.recv) else {
            return Ok(());
        };
        trace_recv_slot(l);
        blocks::landing_ring_slot(l, len, slots)
            .and_then(|post| {
                l.deferred.push_back(post);
                post_recvs(l, recv_window, &self.buffers)
            })
            .map_err(|why| format!("lane {lane} receive: {why}"))
    }

    /// An eager credit receive, into the lane's next landing slot (made on first use).
    fn post_credit(&mut self, peer: PeerIdx, lane: u32, len: u32) -> Result<(), String> {
        let credits = u64::from(self.cfg.engine.credits);
        let recv_window = self.cfg.engine.recv_window;
        // A routed lane into host memory lands in host slots; one into a GPU, in that GPU.
        let into_host =
            self.engine.recv_lane_memory(peer, lane) == Some(crate::engine::topology::Memory::Host);
        let gpu_landing = self.cfg.engine.gpu_credits && !into_host;
        if let Some(r) = self.thread_post_credit(peer, lane, len, gpu_landing) {
            return r.map_err(|why| format!("lane {lane} credit receive: {why}"));
        }
        let Some(l) = lane_of(&mut self.peers, peer, lane, |p| &mut p.recv) else {
            return Ok(());
        };
        landing_slots(l, credits, len, gpu_landing)
            .and_then(|()| {
                let slot = l.credit_seq % credits;
                l.credit_seq += 1;
                l.deferred.push_back(RecvPost {
                    buffer: LANDING,
                    // A GPU landing registration: every credit receive names its start.
                    offset: if l.landing_on_gpu {
                        0
                    } else {
                        slot * u64::from(len)
                    },
                    len,
                    scatter: None,
                    offer: None,
                });
                post_recvs(l, recv_window, &self.buffers)
            })
            .map_err(|why| format!("lane {lane} credit receive: {why}"))
    }

    /// An eager chunk's header said where it goes (`None`: refused or cancelled, consumed without
    /// unpacking, its slot zeroed).
    fn land(
        &mut self,
        peer: PeerIdx,
        lane: u32,
        buffer: Option<u64>,
        offset: u64,
        len: u32,
    ) -> Result<(), String> {
        if let Some(r) = self.thread_land(peer, lane, buffer, offset, len) {
            return r;
        }
        landed_chunk(
            &mut self.peers,
            peer,
            lane,
            "a chunk",
            |comm, id, _| match buffer {
                None => lanes::discard(comm, id),
                Some(buffer) => {
                    let dest = Placed {
                        buffer,
                        offset,
                        len,
                        staged: true,
                    };
                    start_buffer_unpack(comm, id, dest, &self.buffers, &mut self.stages, self.unpack_impl)
                }
            },
        )
    }

    /// A block chunk's header said which blocks it carries: scattered from the landing slot.
    fn land_scatter(
        &mut self,
        peer: PeerIdx,
        lane: u32,
        buffer: u64,
        offer: u64,
        wire: u64,
        len: u32,
    ) -> Result<(), String> {
        if let Some(r) = self.thread_land_scatter(peer, lane, buffer, offer, wire, len) {
            return r;
        }
        let Poller {
            peers,
            engine,
            segs,
            buffers,
            stages,
            unpack_impl,
            host_copies,
            ..
        } = self;
        landed_chunk(peers, peer, lane, "a block chunk", |comm, id, scatter| {
            let collected = blocks::collect(
                engine.recv_pieces(peer, offer, wire, len),
                segs,
                "received",
                offer,
                wire,
                len,
            );
            if collected.is_ok() && comm.posted_on_gpu(id).unwrap_or(false) {
                // Landed in GPU bounce pages (a GPU landing registration): scattered from there
                // as a block receive's chunk is, by the GPU's scatter kernel for GPU memory.
                let to = ScatterTo {
                    buffer,
                    offer,
                    wire,
                    direct: None,
                };
                return blocks::start_scatter(
                    comm,
                    id,
                    to,
                    len,
                    segs,
                    buffers.get(&buffer),
                    stages,
                    *unpack_impl,
                    host_copies,
                    scatter,
                );
            }
            let r = collected.and_then(|()| {
                let entry = buffers
                    .get(&buffer)
                    .ok_or_else(|| format!("buffer {buffer} vanished"))?;
                blocks::land_scatter(comm, id, entry, len, segs, stages, *unpack_impl, host_copies)
            });
            // The receive fails (the engine fails its transfer); the lane goes on, with nothing
            // of the chunk left in its landing slot.
            if r.is_err() {
                let _ = comm.zero_posted(id, len as usize);
            }
            Wait::Ready(r)
        })
    }

    /// Progress is published once per batch of actions (`flush_progress`), and not at all for
    /// a transfer the same batch finishes: each publish wakes the tasks watching the transfer
    /// (`WaitTransfer`'s), and a small transfer's last chunk used to wake its waiter twice for
    /// progress just before its end — a thread wake-up each on a machine with idle workers.
    fn publish_progress(&mut self, transfer: TransferId, bytes_done: u64, total: u64, running: bool) {
        if self.transfers.contains_key(&transfer) {
            let p = self
                .progress
                .entry(transfer)
                .or_insert((bytes_done, total, running));
            *p = (bytes_done, total, p.2 || running);
        }
    }

    /// Publishes the progress the batch's actions reported (the latest per transfer). Waiters
    /// (`Watch`, and the tasks waiting for the end) are woken only for a transfer older than
    /// [`PROGRESS_QUIET`]: a short transfer's progress updates its status in place and its end
    /// is the one wake-up, where each was one more cross-thread wake of the API's runtime for
    /// the poller (the largest part of the sending poller's time with 8 small transfers in
    /// flight: docs/BENCHMARKS.md, session 23 gpu-inflight).
    fn flush_progress(&mut self) {
        if self.progress.is_empty() {
            return;
        }
        let now = Instant::now();
        for (transfer, (bytes_done, total, running)) in self.progress.drain() {
            if let Some(tx) = self.transfers.get(&transfer) {
                tx.send_if_modified(|s| {
                    s.bytes_done = bytes_done;
                    s.total = total;
                    if running && s.phase == Phase::Offered {
                        s.phase = Phase::Running;
                    }
                    now.saturating_duration_since(s.started) >= PROGRESS_QUIET
                });
            }
        }
    }

    fn finish(&mut self, transfer: TransferId, outcome: Outcome) {
        tracing::trace!(target: "tcpxd::hop", hop = "poller.finished", pass = crate::lanes::pass(), id = transfer.0);
        self.progress.remove(&transfer);
        if let Some(tx) = self.transfers.remove(&transfer) {
            let now = Instant::now();
            self.meter.finished_at(transfer, &outcome, outcome.landed, now);
            tx.send_modify(|s| {
                // What landed, not what left: a refused WRITE's chunks may all have been sent.
                s.bytes_done = outcome.landed;
                s.phase = Phase::Finished;
                s.outcome = Some(outcome);
                s.finished_at = Some(now);
            });
            // Started fast by a framed session: its final event goes to the session's outbox
            // from here (`fast_starts.rs`), the status read out of the lock first.
            if let Some(sink) = self.sinks.take(transfer) {
                let status = tx.borrow().clone();
                sink.finished(transfer, Some(&status));
            }
        }
    }

    fn notify(&mut self, peer: PeerIdx, transfer_id: u64, payload: Vec<u8>, buffers: Vec<u64>) {
        let Some(p) = self.peers.get(&peer) else {
            return;
        };
        let _ = self.notifications.send(NotificationEvent {
            from_node: p.node_id.clone(),
            transfer_id,
            payload,
            buffers,
        });
    }

    fn close_peer(&mut self, peer: PeerIdx, reason: String) {
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        p.failed = true;
        // Tells the peer why (on the direct connection once switched to it), then ends the
        // outbound control stream (its pump sees the channel close after sending what was
        // queued) and the direct connection (after what it had left).
        let goodbye = PeerMsg::Goodbye {
            reason: reason.clone(),
        };
        match p.direct.as_mut().filter(|d| d.switched) {
            Some(d) => {
                let _ = d.send(&goodbye);
            }
            None => {
                let _ = p.control.send(super::ControlOut::Msg(goodbye));
            }
        }
        if let Some(mut d) = p.direct.take() {
            d.close(super::direct::CLOSE_FLUSH);
        }
        p.control = tokio::sync::mpsc::unbounded_channel().0;
        // Block kernels may still write the lanes' staging rings or read their bounce buffers:
        // let them finish.
        if p.send.iter().any(|l| l.staging.on_gpu()) || p.recv.iter().any(|l| l.scatter.on_gpu()) {
            self.stages.values_mut().for_each(GpuStage::quiesce_blocks);
        }
        // Host copies queued on helpers may still read bounce pages or write staging slots.
        self.host_copies.quiesce();
        // The lanes' comms close apart: the plugin's close of a comm with a request under way
        // waits for a hung peer, for ever if it never comes back; the poller must not.
        // Those the lane thread drives close there the same way (`lane_thread.rs`).
        if let Some(t) = &self.lanes {
            for (li, l) in p.send.iter().enumerate() {
                if matches!(l.state, super::SendLaneState::Threaded(_)) {
                    t.send(
                        l.gpu,
                        super::lane_thread::ToLanes::Close {
                            key: (peer, li as u32),
                            epoch: l.epoch,
                            apart: true,
                        },
                    );
                }
            }
            // Receive lanes after send lanes, as `close_apart` closes them; the lane thread
            // lets its kernels and the host copies touching them finish first.
            for (li, l) in p.recv.iter().enumerate() {
                if matches!(l.state, RecvLaneState::Threaded { .. }) {
                    t.send(
                        l.gpu,
                        super::lane_thread::ToLanes::CloseRecv {
                            key: (peer, li as u32),
                            epoch: l.epoch,
                            apart: true,
                        },
                    );
                }
            }
        }
        let send = p.send.iter_mut().map(SendLane::take).collect();
        let recv = p.recv.iter_mut().map(RecvLane::take).collect();
        super::peers::close_apart(p.node_id.clone(), send, recv);
        tracing::warn!(peer = %p.node_id, "peer failed: {reason}");
        // Stored even with nobody watching (a replaced pairing): GetStats reads it.
        p.link.send_replace(PeerLink::Failed(reason));
    }

    fn post_gather_send(
        &mut self,
        peer: PeerIdx,
        lane: u32,
        buffer: u64,
        offer: u64,
        wire: u64,
        len: u32,
    ) -> Result<(), String> {
        let slots = self.slots();
        let Some(l) = lane_of(&mut self.peers, peer, lane, |p| &mut p.send) else {
            return Ok(());
        };
        let made = blocks::collect(
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
                &self.host_copies,
                (self.lanes.as_ref(), (peer, lane)),
            )
        });
        self.queue_send(peer, lane, (buffer, wire), made, "block send")
    }

    fn post_scatter_recv(
        &mut self,
        peer: PeerIdx,
        lane: u32,
        buffer: u64,
        offer: u64,
        wire: u64,
        len: u32,
    ) -> Result<(), String> {
        if let Some(r) = self.thread_post_scatter_recv(peer, lane, buffer, offer, wire, len) {
            return r;
        }
        let slots = self.slots();
        let recv_window = self.cfg.engine.recv_window;
        let Some(l) = lane_of(&mut self.peers, peer, lane, |p| &mut p.recv) else {
            return Ok(());
        };
        let to = ScatterTo {
            buffer,
            offer,
            wire,
            direct: None,
        };
        trace_recv_slot(l);
        self.buffers
            .get(&buffer)
            .ok_or_else(|| format!("buffer {buffer} vanished"))
            .and_then(|entry| blocks::scatter_recv(l, entry, to, len, slots))
            .and_then(|post| {
                l.deferred.push_back(post);
                post_recvs(l, recv_window, &self.buffers)
            })
            .map_err(|why| format!("lane {lane} block receive: {why}"))
    }

    fn buffer_idle(&mut self, buffer: u64) {
        for w in self.idle_waiters.remove(&buffer).unwrap_or_default() {
            let _ = w.send(());
        }
    }

    fn release_peer(&mut self, peer: PeerIdx) {
        // Closed already (`ClosePeer`, or `Pairing` closed, came first): what is left goes, and
        // the link's last state stays with whoever still holds its receiver.
        if let Some(p) = self.peers.remove(&peer) {
            tracing::debug!(peer = %p.node_id, "pairing released");
        }
    }

    fn slots(&self) -> Slots {
        let e = &self.cfg.engine;
        Slots {
            staging_host: (e.send_window + e.host_gather_ahead).max(1) as u64,
            staging_gpu: (e.send_window + e.gather_ahead).max(1) as u64,
            landing: (e.recv_window + e.scatter_ahead).max(1) as u64,
            chunk_bytes: e.chunk_bytes,
            send_window: e.send_window,
        }
    }
}

/// The hop trace's mark of a receive the engine posted on a lane (`poller.recv_slot`): from here
/// until its `poller.consumed` it holds one of the lane's `recv_window + scatter_ahead` places,
/// whether it waits in the daemon, in the plugin or for its scatter (`benches/chunks.py`).
fn trace_recv_slot(l: &RecvLane) {
    if let RecvLaneState::Ready(comm) = &l.state {
        tracing::trace!(target: "tcpxd::hop", hop = "poller.recv_slot", comm = comm.trace_id());
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

/// What `Land` and `LandScatter` share: the lane's oldest completed credit receive still waiting
/// for its header gets what `unpack` starts on it (given the lane's scatter state too). Nothing
/// when the lane is gone or closed; an error when no receive waits (`what` names the chunk).
fn landed_chunk(
    peers: &mut BTreeMap<PeerIdx, PeerSlot>,
    peer: PeerIdx,
    lane: u32,
    what: &str,
    unpack: impl FnOnce(&RecvComm, RequestId, &mut blocks::RecvScatter) -> Wait,
) -> Result<(), String> {
    let Some(l) = lane_of(peers, peer, lane, |p| &mut p.recv) else {
        return Ok(());
    };
    let RecvLaneState::Ready(comm) = &mut l.state else {
        return Ok(());
    };
    let Some(landing) = l.queue.awaiting_header() else {
        return Err(format!("lane {lane}: {what} landed with no completed receive"));
    };
    landing.wait = unpack(comm, landing.id, &mut l.scatter);
    if matches!(landing.wait, Wait::Ready(_)) {
        landing.meta.unpacked = Some(Instant::now());
    }
    landing.meta.on_host = landing.wait.on_host();
    Ok(())
}
