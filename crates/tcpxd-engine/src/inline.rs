//! Small transfers inline on the control connection (peer protocol 11), as UCX's active-message
//! "eager short": a transfer of at most the pairing's inline limit carries its bytes in its
//! header (`PeerMsg::Inline`) and touches no lane, credit or landing slot. It generalises the
//! notification alone (`notice.rs`), which is the same with no bytes.
//!
//! - **Limit.** Each side announces the most it takes inline (`PeerMsg::InlineLimit`, before its
//!   `ReceiveMode`; none announced: nothing inline, so a receiver with `inline_max_bytes` 0 is
//!   never sent one). A sender inlines a transfer of 1 byte to the smaller of both limits.
//! - **Sender** ([`Engine::send_offer`] asks [`Engine::inline_sources`]): a WRITE's share for a
//!   peer, or the holder's answer to a READ request (plain, coalesced, block or prepared: the
//!   payload is the wire stream, its pieces from the offer's plan), whose sources are host memory
//!   and whose destinations it knows are host memory (`host_destinations_known`, or the READ's
//!   reader said so in its request: `ReadRequest::host_dests`; both lifted with `inline_gpu`), and that fits the pairing's inline window (bytes sent inline and not yet
//!   answered; a transfer that would pass it takes its lanes at once, it never waits). One
//!   touching GPU memory (a source or a destination not known to be host memory: a synchronous
//!   device copy on a poller, the sender's or the receiver's) goes inline only while fewer than
//!   `inline_gpu_in_flight` such are unanswered on the pairing and none of the pairing's other
//!   offers from this node is on the lanes (beside lane traffic an inline GPU transfer costs it
//!   more than it saves); the rest take their lanes at once. A READ's answer is sent by its holder, so the holder's bound covers its source copy. The
//!   engine names the source pieces ([`Action::SendInline`]); the driver reads them into the
//!   payload as it frames the message. The offer then waits only for `Done` or `Reject`, as a
//!   notice's does: accepted at once, no chunk unfinished. Cancel and deadline follow the
//!   eager header's rules (`CancelOffer`, the receiver's answer ends the held offer).
//! - **Receiver** ([`Engine::on_inline`]): the payload's length must be the ranges' total and
//!   within this node's limit; then every check an eager header's ranges get (notification
//!   size, each buffer, key and bounds, the READ it serves) BEFORE any byte lands. Good: the
//!   offer is recorded as one chunk ([`Action::LandInline`]), the driver copies the payload and
//!   reports it ([`Engine::on_inline_landed`]), then, as a header's last consume: a READ served
//!   ends here, `Done` goes back (with the credits owed), the notification is delivered, in
//!   that order. Refused: `Reject` naming the range, nothing written. Nothing on a lane depends
//!   on it, so a bad inline message refuses that one transfer and never fails the pairing.
//! - **GPU copies off the driver's thread.** A GPU source's payload may be copied out
//!   asynchronously (`SendInline::gather`): the offer is *gathering* until the driver reports
//!   [`Engine::on_inline_gathered`], and only then is the message framed. A cancel, deadline or
//!   reader's `CancelRead` meanwhile ends the transfer at once but only marks the offer: no
//!   `CancelOffer` goes out (the peer has heard nothing of it), and the offer, its inline window
//!   and GPU count are given back when the copy ends, nothing sent. A payload landing in GPU
//!   memory may likewise be copied asynchronously; `Done` and the notification wait for
//!   [`Engine::on_inline_landed`]. Either copy keeps its buffers in use (`InlineCopy`) until
//!   the driver reports its end, past peer loss and cancel, so a release waits for it.

use super::*;

/// Buffer, offset and length of each piece of a transfer's bytes, in wire order.
type Pieces = Vec<(u64, u64, u64)>;

/// An inline payload's copy to or from GPU memory that the driver may still be running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum InlineCopy {
    /// An offer's payload copied out of its GPU sources (`SendInline::gather`).
    Gather(u64),
    /// A peer's offer landing in GPU destinations (`LandInline`).
    Land(PeerIdx, u64),
}

/// What [`Engine::inline_sources`] decided for an offer that goes inline.
pub(super) struct InlineSend {
    pub(super) sources: Pieces,
    /// It touches GPU memory (counted in `inline_gpu_in_flight`).
    pub(super) gpu: bool,
    /// Some source is GPU memory (the driver may copy the payload out asynchronously).
    pub(super) gather: bool,
}

/// Pieces of one side of an offer, in wire order: a plan's (coalesced), else its ranges'.
fn flat_pieces(places: &[(u64, u64)], lengths: &[u64], plan: Option<&blocks::SidePlan>) -> Pieces {
    match plan {
        Some(plan) => {
            let buffer = places.first().map_or(0, |p| p.0);
            let total = plan.total().min(u64::from(u32::MAX)) as u32;
            plan.pieces(0, total)
                .map(|s| (buffer, s.offset, u64::from(s.len)))
                .collect()
        }
        None => places
            .iter()
            .zip(lengths)
            .map(|(&(b, o), &l)| (b, o, l))
            .collect(),
    }
}

impl Engine {
    /// The first message to a new peer when this node takes transfers inline: its limit.
    pub(super) fn announce_inline(&mut self, peer: PeerIdx) {
        if self.cfg.inline_max_bytes > 0 {
            self.actions.push_back(Action::Control {
                peer,
                msg: PeerMsg::InlineLimit {
                    max_bytes: self.cfg.inline_max_bytes,
                },
            });
        }
    }

    /// A peer's inline limit (taken as announced up to [`MAX_INLINE_BYTES`]).
    pub(super) fn on_inline_limit(&mut self, peer: PeerIdx, max_bytes: u64) {
        if let Some(p) = self.peers.get_mut(&peer) {
            p.remote_inline_max = max_bytes.min(MAX_INLINE_BYTES);
        }
    }

    /// The source pieces of a recorded offer (`msg`, taken from it) if it goes inline, and
    /// whether it touches GPU memory: see the module doc for when. `None`: it takes its lanes.
    pub(super) fn inline_sources(&self, offer_id: u64, msg: &Offer) -> Option<InlineSend> {
        let o = &self.out_offers[&offer_id];
        let p = &self.peers[&o.peer];
        let limit = self.cfg.inline_max_bytes.min(p.remote_inline_max);
        if limit == 0 || o.stream.is_some() {
            return None;
        }
        let total = o.lengths.iter().try_fold(0u64, |a, &l| a.checked_add(l))?;
        if total == 0
            || total > limit
            || p.inline_outstanding.saturating_add(total) > self.cfg.inline_window_bytes
        {
            return None;
        }
        let host_sources = o
            .sources
            .iter()
            .all(|(b, _)| self.memory_of(*b) == topology::Memory::Host);
        let gpu = !host_sources || !(o.host_dests || Self::host_destinations_known(p, msg));
        // A GPU transfer goes inline only while the pairing's other offers all went inline too:
        // beside transfers on the lanes it would take the control connection and the pollers'
        // time from them (8 x 64 KiB in flight lost 5-20% so; docs/BENCHMARKS.md, session 24).
        let on_lanes = p.others_on_lanes();
        if gpu
            && (!self.cfg.inline_gpu
                || p.inline_gpu_outstanding >= self.cfg.inline_gpu_in_flight
                || on_lanes > 0)
        {
            return None;
        }
        Some(InlineSend {
            sources: flat_pieces(&o.sources, &o.lengths, o.plan.as_ref()),
            gpu,
            gather: !host_sources,
        })
    }

    /// Whether the sender knows every destination of `msg` is host memory: the peer has no GPU
    /// (its topology, as announced at pairing, lists none; a driver that gives none knows of no
    /// GPU), or it tells its GPU buffers (`GpuCredits`) and none of the ranges names one (a block
    /// transfer's list does not say its buffer to the sender: not known).
    fn host_destinations_known(p: &Peer, msg: &Offer) -> bool {
        if p.topology.as_ref().is_none_or(|t| t.gpus.is_empty()) {
            return true;
        }
        p.remote_gpu_budget.is_some()
            && msg.blocks.is_none()
            && !msg.ranges.buffers().any(|b| p.gpu_dests.contains_key(&b))
    }

    /// Sends a recorded offer inline (`inline_sources` said it goes so): answered as a notice
    /// is, its bytes counted in the pairing's inline window until the offer is dropped.
    pub(super) fn send_inline(&mut self, offer_id: u64, mut msg: Offer, send: InlineSend) {
        let InlineSend { sources, gpu, gather } = send;
        let chunk_bytes = self.cfg.chunk_bytes;
        let o = self.out_offers.get_mut(&offer_id).expect("present");
        let (peer, transfer) = (o.peer, o.transfer);
        let total: u64 = sources.iter().map(|s| s.2).sum();
        o.chunk_bytes = chunk_bytes;
        o.first_lane = 0;
        o.lanes = 0..0;
        o.eager = true;
        o.accepted = true;
        o.unfinished = 0;
        o.inline_bytes = total;
        o.inline_gpu = gpu;
        o.gathering = gather;
        let source_buffers: Vec<u64> = if gather {
            o.sources.iter().map(|s| s.0).collect()
        } else {
            Vec::new()
        };
        msg.chunk_bytes = chunk_bytes;
        msg.first_lane = 0;
        let p = self.peers.get_mut(&peer).expect("live");
        p.sent_inline += 1;
        p.inline_outstanding += total;
        p.inline_gpu_outstanding += u64::from(gpu);
        p.inline_open += 1;
        if gather {
            self.copy_started(InlineCopy::Gather(offer_id), source_buffers);
        }
        self.actions.push_back(Action::SendInline {
            peer,
            offer: msg,
            sources,
            gather,
        });
        if let Some(t) = transfer {
            self.set_running(t);
        }
    }

    /// The driver's copy of a gathering offer's payload (`SendInline::gather`) ended (`Err`: it
    /// failed). `true`: send the message now. `false`: send nothing — the offer was cancelled
    /// meanwhile (it ends here, its window and GPU count given back), its pairing failed, or
    /// the copy failed (handled as [`Engine::on_inline_unsent`]).
    pub fn on_inline_gathered(&mut self, offer_id: u64, result: Result<(), String>) -> bool {
        self.copy_ended(InlineCopy::Gather(offer_id));
        let Some(o) = self.out_offers.get_mut(&offer_id).filter(|o| o.gathering) else {
            return false;
        };
        o.gathering = false;
        if o.cancelled {
            self.drop_out_offer(offer_id);
            return false;
        }
        match result {
            Ok(()) => true,
            Err(why) => {
                let message = format!("reading the inline transfer's GPU source: {why}");
                self.on_inline_unsent(offer_id, &message);
                false
            }
        }
    }

    /// An asynchronous inline copy began: `buffers` stay in use until [`Engine::copy_ended`].
    fn copy_started(&mut self, copy: InlineCopy, buffers: Vec<u64>) {
        for &b in &buffers {
            self.use_buffer(b);
        }
        self.inline_copies.insert(copy, buffers);
    }

    /// The driver reported an inline copy's end (if it was asynchronous): its buffers are free.
    fn copy_ended(&mut self, copy: InlineCopy) {
        if self.inline_copies.is_empty() {
            return;
        }
        for b in self.inline_copies.remove(&copy).unwrap_or_default() {
            self.unuse_buffer(b);
        }
    }

    /// Inline copies to or from GPU memory the driver has not reported ended yet.
    pub fn inline_copies_in_flight(&self) -> usize {
        self.inline_copies.len()
    }

    /// The driver could not read an inline offer's sources (`SendInline`): nothing was sent. The
    /// offer ends here; its WRITE fails, or the READ it serves is refused to the reader.
    pub fn on_inline_unsent(&mut self, offer_id: u64, message: &str) {
        self.copy_ended(InlineCopy::Gather(offer_id));
        let Some(o) = self.out_offers.get(&offer_id).filter(|o| o.inline_bytes > 0) else {
            return;
        };
        let (peer, transfer, read_id) = (o.peer, o.transfer, o.read_id);
        self.drop_out_offer(offer_id);
        match transfer {
            Some(t) => self.fail_transfer(t, Code::FailedPrecondition, message, None),
            None if self.peers.get(&peer).is_some_and(|p| !p.gone()) => {
                self.actions.push_back(Action::Control {
                    peer,
                    msg: PeerMsg::ReadReject {
                        read_id,
                        code: Code::FailedPrecondition,
                        message: message.to_string(),
                        range_index: 0,
                    },
                });
            }
            None => {}
        }
    }

    /// A peer's inline transfer: checked whole before any byte lands, then landed
    /// ([`Action::LandInline`]) or refused (`Reject`).
    pub(super) fn on_inline(&mut self, peer: PeerIdx, offer: Offer, payload: Vec<u8>) {
        self.peers.get_mut(&peer).expect("live").received_inline += 1;
        let verdict = self.check_inline(peer, &offer, payload.len() as u64);
        let read = (offer.read_id != 0).then_some(offer.read_id);
        let places = match verdict {
            Ok(places) => places,
            Err(why) => {
                self.refuse_sent_data(peer, offer.offer_id, read, why);
                return;
            }
        };
        let dests = flat_pieces(&places.places, &places.lengths, places.plan.as_ref());
        for &(b, _) in &places.places {
            self.use_buffer(b);
        }
        let gpu_dests: Vec<u64> = places
            .places
            .iter()
            .map(|p| p.0)
            .filter(|&b| self.memory_of(b) != topology::Memory::Host)
            .collect();
        let gpu = !gpu_dests.is_empty();
        if gpu {
            self.copy_started(InlineCopy::Land(peer, offer.offer_id), gpu_dests);
        }
        if let Some(rid) = read {
            let r = self.reads.get_mut(&rid).expect("checked");
            r.offer = Some(offer.offer_id);
            let t = r.transfer;
            self.set_running(t);
        }
        self.in_offers.insert(
            (peer, offer.offer_id),
            InOffer {
                read,
                dests: places.places,
                chunks_total: 1,
                chunks_done: 0,
                bytes_done: 0,
                discard: false,
                failed: false,
                notify_id: offer.notify_id(),
                notification: offer.notification,
                plan: places.plan,
                stream: None,
            },
        );
        self.actions.push_back(Action::LandInline {
            peer,
            offer: offer.offer_id,
            dests,
            payload,
            gpu,
        });
    }

    /// What an inline transfer rests on: not a duplicate, its payload within this node's limit,
    /// the ranges (or block header) as a header's are checked, the payload exactly their total.
    fn check_inline(
        &self,
        peer: PeerIdx,
        offer: &Offer,
        payload: u64,
    ) -> Result<coalesce::Places, (Code, String, u32)> {
        let invalid = |m: String| Err((Code::InvalidArgument, m, 0));
        if self.in_offers.contains_key(&(peer, offer.offer_id)) {
            return Err((
                Code::AlreadyExists,
                format!("transfer {} is already active", offer.offer_id),
                0,
            ));
        }
        if payload > self.cfg.inline_max_bytes {
            return invalid(format!(
                "payload: {payload} bytes inline exceeds this node's inline limit of {}",
                self.cfg.inline_max_bytes
            ));
        }
        let places = self.incoming_places(peer, offer)?;
        let total = places
            .lengths
            .iter()
            .try_fold(0u64, |a, &l| a.checked_add(l))
            .unwrap_or(u64::MAX);
        if total != payload {
            return invalid(format!(
                "payload: {payload} bytes inline for ranges of {total} bytes"
            ));
        }
        Ok(places)
    }

    /// The driver carried out `LandInline` for offer `offer` from `peer` (`len` bytes; `Err`:
    /// the copy failed). Its consequences come next, ahead of any action queued before:
    /// the READ it served ends, `Done` (or `Failed`) goes back, the notification is delivered.
    pub fn on_inline_landed(&mut self, peer: PeerIdx, offer: u64, len: u64, result: Result<(), String>) {
        let mark = self.actions.len();
        self.offer_chunk_consumed(peer, offer, len, result);
        self.copy_ended(InlineCopy::Land(peer, offer));
        // What it made moves ahead of everything queued before it, in order.
        let made = self.actions.len() - mark;
        self.actions.rotate_right(made);
    }

    /// Whether every one of `buffers` is host memory here (a READ tells its holder so).
    pub(super) fn host_memory(&self, mut buffers: impl Iterator<Item = u64>) -> bool {
        buffers.all(|b| self.memory_of(b) == topology::Memory::Host)
    }

    /// Inline bytes sent to `peer` and not answered yet (the pairing's inline window in use).
    pub fn inline_outstanding(&self, peer: PeerIdx) -> u64 {
        self.peers.get(&peer).map_or(0, |p| p.inline_outstanding)
    }

    /// Inline transfers touching GPU memory sent to `peer` and not answered yet (bounded by
    /// `inline_gpu_in_flight`).
    pub fn inline_gpu_in_flight(&self, peer: PeerIdx) -> u64 {
        self.peers.get(&peer).map_or(0, |p| p.inline_gpu_outstanding)
    }
}
