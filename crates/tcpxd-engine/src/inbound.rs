//! Control messages from peers, in stream order: offers, accepts, rejects, completions,
//! cancellations and read requests.

use super::*;

impl Engine {
    /// Handles one control message from a peer, in stream order.
    pub fn on_message(&mut self, peer: PeerIdx, msg: PeerMsg, now: Instant) {
        if self.peers.get(&peer).is_none_or(|p| p.gone()) {
            return;
        }
        match msg {
            PeerMsg::ReceiveMode {
                credits,
                chunk_bytes,
                eager_first_lane,
                eager_max_bytes,
            } => self.on_receive_mode(peer, credits, chunk_bytes, eager_first_lane, eager_max_bytes),
            PeerMsg::Credits { returned } => self.on_credits(peer, returned),
            PeerMsg::GpuCredits {
                budget_bytes,
                buffer_ids,
                buffer_gpus,
            } => self.on_gpu_credits(peer, budget_bytes, buffer_ids, buffer_gpus),
            PeerMsg::MoreChunks { offer_id, count } => self.on_more_chunks(peer, offer_id, count),
            PeerMsg::Header(offer) => self.on_header(peer, offer),
            PeerMsg::Offer(offer) => self.on_offer(peer, offer),
            PeerMsg::Accept { offer_id, first_lane } => self.on_accept(peer, offer_id, first_lane),
            PeerMsg::Reject {
                offer_id,
                code,
                message,
                range_index,
            } => self.on_reject(peer, offer_id, code, &message, range_index),
            PeerMsg::Done { offer_id, returned } => {
                // As a `Done` and then a `Credits` message.
                self.on_done(peer, offer_id);
                if !returned.is_empty() {
                    self.on_credits(peer, returned);
                }
            }
            PeerMsg::Failed {
                offer_id,
                code,
                message,
            } => self.on_remote_failed(peer, offer_id, code, &message),
            PeerMsg::CancelOffer {
                offer_id,
                code,
                message,
            } => self.on_cancel_offer(peer, offer_id, code, &message),
            PeerMsg::CancelSeen { offer_id } => self.on_cancel_seen(peer, offer_id),
            PeerMsg::ReadRequest {
                read_id,
                pairs,
                deadline_ms,
                blocks: Some(rb),
                host_dests,
            } => self.on_read_blocks(peer, read_id, pairs.len(), *rb, deadline_ms, host_dests),
            PeerMsg::ReadRequest {
                read_id,
                pairs,
                deadline_ms,
                blocks: None,
                host_dests,
            } => self.on_read_request(peer, read_id, pairs, deadline_ms, host_dests, now),
            PeerMsg::ReadReject {
                read_id,
                code,
                message,
                range_index,
            } => self.on_read_reject(peer, read_id, code, &message, range_index),
            PeerMsg::CancelRead { read_id } => self.on_cancel_read(peer, read_id),
            PeerMsg::Notify {
                transfer_id,
                payload,
                lists,
                buffers,
            } => self.on_notify(peer, transfer_id, payload, lists, buffers),
            PeerMsg::Goodbye { reason } => {
                self.on_peer_failed(peer, &format!("the peer ended the pairing: {reason}"))
            }
            PeerMsg::LaneOpen { lane } => self.on_lane_open(peer, lane),
            PeerMsg::LaneListening { lane, handle } => self.on_lane_listening(peer, lane, handle),
            PeerMsg::LaneClose { lane } => self.on_lane_close(peer, lane),
            PeerMsg::LaneCloseAnswer { lane, closed } => self.on_lane_close_answer(peer, lane, closed),
            PeerMsg::PairingClose => self.on_pairing_close(peer),
            PeerMsg::PairingCloseAnswer { closed } => self.on_pairing_close_answer(peer, closed),
            PeerMsg::InlineLimit { max_bytes } => self.on_inline_limit(peer, max_bytes),
            PeerMsg::Inline { offer, payload } => self.on_inline(peer, offer, payload),
        }
    }

    /// A peer sent a request that could not be read (`Malformed`, naming the field): refused,
    /// as an offer or read request that breaks a rule is.
    pub fn on_malformed(&mut self, peer: PeerIdx, request: Malformed) {
        if self.peers.get(&peer).is_none_or(|p| p.gone()) {
            return;
        }
        let msg = match request {
            Malformed::Offer { offer_id, why } => PeerMsg::Reject {
                offer_id,
                code: Code::InvalidArgument,
                message: why,
                range_index: 0,
            },
            Malformed::ReadRequest { read_id, why } => PeerMsg::ReadReject {
                read_id,
                code: Code::InvalidArgument,
                message: why,
                range_index: 0,
            },
        };
        self.actions.push_back(Action::Control { peer, msg });
    }

    /// Checks a range of one of our buffers as a peer claims it. `last`: the buffer the previous
    /// range of the same message named, kept between calls (a batch of one buffer pair names
    /// one buffer 65,536 times: looked up once; its key is still compared every time).
    pub(super) fn check_claimed<'s>(
        &'s self,
        i: usize,
        r: &RemoteRange,
        last: &mut Option<(u64, &'s BufferMeta)>,
    ) -> Result<(), (Code, String)> {
        let b = match *last {
            Some((id, b)) if id == r.buffer_id => b,
            _ => {
                let b = self.buffers.get(&r.buffer_id).ok_or_else(|| {
                    (
                        Code::NotFound,
                        format!("ranges[{i}]: buffer {} does not exist", r.buffer_id),
                    )
                })?;
                *last = Some((r.buffer_id, b));
                b
            }
        };
        if !keys_equal(&b.key, &r.access_key) {
            return Err((
                Code::PermissionDenied,
                format!("ranges[{i}]: wrong access key for buffer {}", r.buffer_id),
            ));
        }
        if r.length == 0 {
            return Err((
                Code::InvalidArgument,
                format!("ranges[{i}]: length must be at least 1 byte"),
            ));
        }
        // The field names are formatted only for an error: an offer of 65,536 ranges checks each.
        if range_end(r.offset, r.length).is_some_and(|end| end <= b.size) {
            return Ok(());
        }
        check_bounds(
            &format!("ranges[{i}].offset"),
            &format!("ranges[{i}].length"),
            &format!("buffer {}", r.buffer_id),
            b.size,
            r.offset,
            r.length,
        )
        .map_err(|e| (e.code, e.message))
    }

    /// Checks every range of a message as [`check_claimed`](Self::check_claimed) does, the
    /// first bad one refused with its index. Packed ranges (one buffer, one key) look the buffer
    /// up and compare the key once, then check each range's length and bounds in one pass over
    /// the arrays.
    pub(super) fn check_all_claimed(&self, ranges: &Ranges) -> Result<(), (Code, String, u32)> {
        let p = match ranges {
            Ranges::Each(v) => {
                let mut last = None;
                for (i, r) in v.iter().enumerate() {
                    self.check_claimed(i, r, &mut last)
                        .map_err(|(c, m)| (c, m, i as u32))?;
                }
                return Ok(());
            }
            Ranges::Packed(p) => p,
        };
        let Some(first) = ranges.first() else {
            return Ok(());
        };
        let mut last = None;
        self.check_claimed(0, &first, &mut last)
            .map_err(|(c, m)| (c, m, 0))?;
        let size = last.map_or(0, |(_, b)| b.size);
        for (i, (offset, length)) in p.spans().enumerate() {
            if length > 0 && range_end(offset, length).is_some_and(|end| end <= size) {
                continue;
            }
            self.check_claimed(i, &p.range(i), &mut last)
                .map_err(|(c, m)| (c, m, i as u32))?;
        }
        Ok(())
    }

    /// What an offer or header rests on alone (its notification, keys and bounds, the READ it
    /// claims to serve): `Err` refuses that one transfer.
    pub(super) fn check_incoming(&self, peer: PeerIdx, offer: &Offer) -> Result<(), (Code, String, u32)> {
        if offer.notification.len() > self.cfg.max_notification {
            return Err((
                Code::InvalidArgument,
                format!(
                    "notification of {} bytes exceeds {}",
                    offer.notification.len(),
                    self.cfg.max_notification
                ),
                0,
            ));
        }
        self.check_all_claimed(&offer.ranges)?;
        if offer.read_id != 0 {
            let read = self.reads.get(&offer.read_id).filter(|r| r.peer == peer);
            let Some(read) = read else {
                return Err((Code::NotFound, format!("read {} is unknown", offer.read_id), 0));
            };
            if read.cancelled || read.offer.is_some() {
                return Err((
                    Code::Cancelled,
                    format!("read {} is no longer waiting", offer.read_id),
                    0,
                ));
            }
            let matches = match (&read.blocks, &offer.blocks) {
                (None, None) => read.dests == offer.ranges,
                // The header the reader asked for, echoed whole.
                (Some(asked), Some(got)) => asked == got && offer.ranges.is_empty(),
                _ => false,
            };
            if !matches {
                return Err((
                    Code::InvalidArgument,
                    format!("offer does not match read {}", offer.read_id),
                    0,
                ));
            }
        }
        Ok(())
    }

    pub(super) fn on_offer(&mut self, peer: PeerIdx, offer: Offer) {
        let reject = |code: Code, message: String, range_index: u32| PeerMsg::Reject {
            offer_id: offer.offer_id,
            code,
            message,
            range_index,
        };
        let (lanes, _) = self.peers[&peer].recv_split();
        let routed = self.peers[&peer].routes.is_some();
        let verdict: Result<coalesce::Places, (Code, String, u32)> = (|| {
            if lanes.is_empty() {
                // Nothing was posted for it: refusing keeps every lane in step.
                return Err((
                    Code::FailedPrecondition,
                    "this node receives eagerly (its ReceiveMode said so): send a header, not an offer"
                        .into(),
                    0,
                ));
            }
            if self.in_offers.contains_key(&(peer, offer.offer_id)) {
                return Err((
                    Code::AlreadyExists,
                    format!("offer {} is already active", offer.offer_id),
                    0,
                ));
            }
            plan::check_chunk_bytes(u64::from(offer.chunk_bytes))
                .map_err(|e| (Code::InvalidArgument, e, 0))?;
            if !routed && !lanes.contains(&offer.first_lane) {
                return Err((
                    Code::InvalidArgument,
                    format!(
                        "first_lane {} is not below the {} rendezvous lanes",
                        offer.first_lane, lanes.end
                    ),
                    0,
                ));
            }
            self.incoming_places(peer, &offer)
        })();
        let verdict = verdict.and_then(|places| {
            let chunks = ChunkPlan::count(&places.lengths, offer.chunk_bytes);
            match self.routed_recv_lanes(peer, offer.first_lane, &places.places, chunks) {
                Ok(routed) => Ok((places, routed)),
                Err((code, e)) => Err((code, e, 0)),
            }
        });
        let (
            coalesce::Places {
                places: dests,
                lengths,
                plan,
            },
            routed,
        ) = match verdict {
            Ok(v) => v,
            Err((code, message, idx)) => {
                self.actions.push_back(Action::Control {
                    peer,
                    msg: reject(code, message.clone(), idx),
                });
                let read = (offer.read_id != 0).then_some(offer.read_id);
                self.fail_refused_read(peer, read, code, "offered data this node refused", &message, idx);
                return;
            }
        };
        let (first_lane, lanes, chosen) = match routed {
            Some((first, lanes)) => (first, lanes, Some(first)),
            None => (offer.first_lane, lanes, None),
        };
        self.accept_offer(peer, offer, dests, lengths, plan, lanes, first_lane, chosen);
    }

    /// Records an offer found good and queues its receives on the lanes `lanes` from
    /// `first_lane`, in plan order; answers `Accept` (naming `chosen`, a routed pairing's lane).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn accept_offer(
        &mut self,
        peer: PeerIdx,
        offer: Offer,
        dests: Vec<(u64, u64)>,
        lengths: Vec<u64>,
        plan: Option<blocks::SidePlan>,
        lanes: Range<u32>,
        first_lane: u32,
        chosen: Option<u32>,
    ) {
        for &(b, _) in &dests {
            self.use_buffer(b);
        }
        let mut chunks_total = 0u64;
        let p = &mut self.peers[&peer];
        p.received_rendezvous += 1;
        for c in ChunkPlan::new(&lengths, offer.chunk_bytes, first_lane, lanes) {
            p.recv_used.mark(c.lane);
            p.recv[c.lane as usize].queue.push_back(coalesce::chunk_item(
                offer.offer_id,
                &dests,
                plan.as_ref(),
                &c,
            ));
            chunks_total += 1;
        }
        let read = (offer.read_id != 0).then_some(offer.read_id);
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
                dests,
                chunks_total,
                chunks_done: 0,
                bytes_done: 0,
                discard: false,
                failed: false,
                notify_id: offer.notify_id(),
                notification: offer.notification,
                plan,
                stream: None,
            },
        );
        self.actions.push_back(Action::Control {
            peer,
            msg: PeerMsg::Accept {
                offer_id: offer.offer_id,
                first_lane: chosen,
            },
        });
        self.pump(peer);
    }

    /// Refuses a header or inline transfer the peer sent (`Reject` naming the range), and fails our
    /// READ it claimed to serve with the same reason.
    pub(super) fn refuse_sent_data(
        &mut self,
        peer: PeerIdx,
        offer_id: u64,
        read: Option<u64>,
        (code, message, range_index): (Code, String, u32),
    ) {
        self.actions.push_back(Action::Control {
            peer,
            msg: PeerMsg::Reject {
                offer_id,
                code,
                message: message.clone(),
                range_index,
            },
        });
        self.fail_refused_read(
            peer,
            read,
            code,
            "sent data this node refused",
            &message,
            range_index,
        );
    }

    /// Our READ that a refused offer or header claimed to serve (still waiting for it) fails with
    /// the reason: the holder sent what we did not ask for.
    pub(super) fn fail_refused_read(
        &mut self,
        peer: PeerIdx,
        read: Option<u64>,
        code: Code,
        what: &str,
        message: &str,
        range_index: u32,
    ) {
        if let Some(r) = read
            .and_then(|rid| self.reads.get(&rid))
            .filter(|r| r.peer == peer)
            && r.offer.is_none()
            && !r.cancelled
        {
            let (t, entry) = (r.transfer, r.entries.get(range_index as usize).copied());
            let node = self.peers[&peer].node_id.clone();
            self.fail_transfer(t, code, &format!("node {node} {what}: {message}"), entry);
        }
    }

    pub(super) fn set_running(&mut self, id: TransferId) {
        if let Some(t) = self.transfers.get_mut(&id)
            && !t.running
        {
            t.running = true;
            self.actions.push_back(Action::Progress {
                transfer: id,
                bytes_done: t.done_bytes,
                total: t.total,
                running: true,
            });
        }
    }

    pub(super) fn on_accept(&mut self, peer: PeerIdx, offer_id: u64, first_lane: Option<u32>) {
        let Some(o) = self
            .out_offers
            .get(&offer_id)
            .filter(|o| o.peer == peer && !o.accepted && !o.eager)
        else {
            return;
        };
        match self.routed_send_lanes(peer, &o.sources, first_lane) {
            Ok(Some((first, lanes))) => {
                let o = self.out_offers.get_mut(&offer_id).expect("checked");
                o.first_lane = first;
                o.lanes = lanes;
            }
            Ok(None) => {}
            Err(e) => return self.violation(peer, format!("offer {offer_id}: {e}")),
        }
        self.queue_sends(offer_id);
    }

    /// Queues an offer's sends on its lanes, in plan order (after its accept, or at once for an
    /// eager header).
    pub(super) fn queue_sends(&mut self, offer_id: u64) {
        let Some(o) = self.out_offers.get_mut(&offer_id) else {
            return;
        };
        let peer = o.peer;
        let p = &mut self.peers[&peer];
        let mut n = 0u64;
        for c in ChunkPlan::new(&o.lengths, o.chunk_bytes, o.first_lane, o.lanes.clone()) {
            let mut item = coalesce::chunk_item(offer_id, &o.sources, o.plan.as_ref(), &c);
            if o.cancelled {
                // A cancelled offer still meets every posted receive, with nothing in it.
                item.empty();
            }
            p.send_used.mark(c.lane);
            p.send[c.lane as usize].queue.push_back(item);
            n += 1;
        }
        o.unfinished = n;
        self.start_sending(offer_id);
    }

    /// An offer's sends may go (accepted, or eager): its transfer runs, the lanes post what
    /// their windows and credits allow.
    pub(super) fn start_sending(&mut self, offer_id: u64) {
        let Some(o) = self.out_offers.get_mut(&offer_id) else {
            return;
        };
        o.accepted = true;
        let (peer, transfer) = (o.peer, o.transfer);
        if let Some(t) = transfer {
            self.set_running(t);
        }
        self.pump(peer);
    }

    pub(super) fn on_reject(
        &mut self,
        peer: PeerIdx,
        offer_id: u64,
        code: Code,
        message: &str,
        range_index: u32,
    ) {
        let Some(o) = self
            .out_offers
            .get(&offer_id)
            .filter(|o| o.peer == peer && (o.eager || !o.accepted))
        else {
            return;
        };
        let entry = o.entries.get(range_index as usize).copied();
        let transfer = o.transfer;
        if o.eager {
            // The receiver discards what was sent; the rest goes out empty, keeping lanes in step.
            self.cancel_out_offer(offer_id, None);
        } else {
            self.drop_out_offer(offer_id);
        }
        if let Some(t) = transfer {
            let node = self.peers[&peer].node_id.clone();
            let msg = match entry {
                Some(e) => format!("entries[{e}]: node {node} refused: {message}"),
                None => format!("node {node} refused: {message}"),
            };
            self.fail_transfer(t, code, &msg, entry);
        }
    }

    pub(super) fn on_done(&mut self, peer: PeerIdx, offer_id: u64) {
        let Some(o) = self
            .out_offers
            .get_mut(&offer_id)
            .filter(|o| o.peer == peer && o.accepted)
        else {
            return;
        };
        o.done = true;
        // Every chunk landed and was consumed there: none of it waits to land (a cancel that
        // crossed this `Done` is never answered).
        o.held = false;
        let transfer = o.transfer;
        let finished = o.unfinished == 0;
        let entries = o.entries.clone();
        let landed: u64 = o.lengths.iter().sum();
        // The receiver holds every byte: the plugin reads the sources no more, even where this
        // node has not yet seen its last sends complete, so the client may release them now.
        let sources: Vec<u64> = if o.sent {
            Vec::new()
        } else {
            o.sources.iter().map(|s| s.0).collect()
        };
        o.sent = true;
        for b in sources {
            self.unuse_buffer(b);
        }
        if finished {
            self.drop_out_offer(offer_id);
        }
        if let Some(t) = transfer {
            if let Some(tr) = self.transfers.get_mut(&t) {
                for e in entries {
                    tr.entries[e] = Some((Code::Ok, String::new()));
                }
                tr.landed += landed;
            }
            self.part_done(t);
        }
    }

    pub(super) fn on_remote_failed(&mut self, peer: PeerIdx, offer_id: u64, code: Code, message: &str) {
        let Some(o) = self.out_offers.get(&offer_id).filter(|o| o.peer == peer) else {
            return;
        };
        let transfer = o.transfer;
        self.cancel_out_offer(offer_id, None);
        if let Some(t) = transfer {
            let node = self.peers[&peer].node_id.clone();
            self.fail_transfer(
                t,
                code,
                &format!("node {node} failed the transfer: {message}"),
                None,
            );
        }
    }

    pub(super) fn on_cancel_offer(&mut self, peer: PeerIdx, offer_id: u64, code: Code, message: &str) {
        let Some(o) = self.in_offers.get_mut(&(peer, offer_id)) else {
            // Finished (`Done` went first), refused (`Reject`) or failed here (`Failed`): its
            // sender knows from those that nothing of it lands here any more.
            return;
        };
        o.discard = true;
        // From here no chunk of it lands (`recv_lands`, eager `Land`): its sender may send the
        // rest empty.
        self.actions.push_back(Action::Control {
            peer,
            msg: PeerMsg::CancelSeen { offer_id },
        });
        let read = o.read;
        if let Some(rid) = read
            && let Some(r) = self.reads.get(&rid)
        {
            let t = r.transfer;
            let node = self.peers[&peer].node_id.clone();
            self.fail_transfer(
                t,
                code,
                &format!("node {node} gave up serving the read: {message}"),
                None,
            );
        }
    }

    pub(super) fn on_read_request(
        &mut self,
        peer: PeerIdx,
        read_id: u64,
        pairs: ReadPairs,
        deadline_ms: u64,
        host_dests: bool,
        _now: Instant,
    ) {
        let n = pairs.len();
        let verdict: Result<(Ranges, Ranges), (Code, String, u32)> = (|| {
            if n == 0 || n > self.cfg.max_entries {
                return Err((
                    Code::InvalidArgument,
                    format!("{n} ranges (1 to {} allowed)", self.cfg.max_entries),
                    0,
                ));
            }
            let (sources, dests) = pairs.split();
            self.check_all_claimed(&sources)?;
            if let Some(i) = differing_length(&sources, &dests) {
                return Err((
                    Code::InvalidArgument,
                    format!("ranges[{i}]: source and destination lengths differ"),
                    i as u32,
                ));
            }
            Ok((sources, dests))
        })();
        let (sources, dests) = match verdict {
            Ok(v) => v,
            Err((code, message, range_index)) => {
                self.actions.push_back(Action::Control {
                    peer,
                    msg: PeerMsg::ReadReject {
                        read_id,
                        code,
                        message,
                        range_index,
                    },
                });
                return;
            }
        };
        let offer_id = self.next_offer;
        self.next_offer += 1;
        let one_local = coalesce::all_one(sources.buffers());
        let src = match &sources {
            Ranges::Packed(s)
                if coalesce::should_coalesce_ranges(one_local, &dests, self.cfg.chunk_bytes) =>
            {
                coalesce::Places::coalesced(s.buffer_id, s.spans())
            }
            _ if coalesce::should_coalesce_ranges(one_local, &dests, self.cfg.chunk_bytes) => {
                coalesce::Places::coalesced(
                    sources.first().map_or(0, |r| r.buffer_id),
                    sources.iter().map(|r| (r.offset, r.length)),
                )
            }
            _ => coalesce::Places::ranges(
                sources.iter().map(|r| (r.buffer_id, r.offset)).collect(),
                sources.iter().map(|r| r.length).collect(),
            ),
        };
        let entries = (0..n).collect();
        self.make_offer(
            peer,
            offer_id,
            read_id,
            None,
            entries,
            src,
            dests,
            None,
            Vec::new(),
            deadline_ms,
            host_dests,
        );
    }

    pub(super) fn on_read_reject(
        &mut self,
        peer: PeerIdx,
        read_id: u64,
        code: Code,
        message: &str,
        range_index: u32,
    ) {
        let Some(r) = self.reads.get(&read_id).filter(|r| r.peer == peer) else {
            return;
        };
        let entry = r.entries.get(range_index as usize).copied();
        let t = r.transfer;
        self.reads.remove(&read_id);
        let node = self.peers[&peer].node_id.clone();
        let msg = match entry {
            Some(e) => format!("entries[{e}]: node {node} refused: {message}"),
            None => format!("node {node} refused: {message}"),
        };
        self.fail_transfer(t, code, &msg, entry);
    }

    pub(super) fn on_cancel_read(&mut self, peer: PeerIdx, read_id: u64) {
        // Our offer serving that read (made when the request came) stops sending real bytes.
        let offer = self.out_offers.iter().find_map(|(&id, o)| {
            (o.peer == peer && o.transfer.is_none() && o.read_id == read_id).then_some(id)
        });
        if let Some(id) = offer {
            self.cancel_out_offer(id, Some((Code::Cancelled, "the reader cancelled".to_string())));
            // The reader discards the offer already (it did before it asked).
            self.release_held(id);
        }
    }
}

/// The first pair whose source and destination lengths differ (two packed arrays of equal
/// lengths given alike: compared as bytes, without a pass per pair).
fn differing_length(sources: &Ranges, dests: &Ranges) -> Option<usize> {
    if let (Ranges::Packed(s), Ranges::Packed(d)) = (sources, dests)
        && s.lengths == d.lengths
        && s.len() == d.len()
    {
        return None;
    }
    if sources.len() != dests.len() {
        return Some(sources.len().min(dests.len()));
    }
    sources
        .iter()
        .zip(dests.iter())
        .position(|(s, d)| s.length != d.length)
}
