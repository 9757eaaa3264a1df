//! Plugin completions (sends done, receives consumed), peer failures, cancellation, deadlines,
//! and posting what the windows allow.

use super::*;

impl Engine {
    /// The oldest posted send on a lane completed.
    pub fn on_send_done(&mut self, peer: PeerIdx, lane: u32) {
        let Some(l) = self
            .peers
            .get_mut(&peer)
            .and_then(|p| p.send.get_mut(lane as usize))
        else {
            return;
        };
        let Some(item) = l.posted.pop_front() else {
            return;
        };
        l.bytes += u64::from(item.len);
        l.chunks += 1;
        if let Some(o) = self.out_offers.get_mut(&item.offer) {
            o.unfinished -= 1;
            // Every send done: the plugin no longer reads the sources, which may be released
            // before `Done` comes (a READ's reader finishes first; its client may release at once).
            // (A streamed offer's chunks not yet announced are still to be sent.)
            let sent = o.unfinished == 0 && !o.sent && o.stream.is_none();
            o.sent |= sent;
            let sources: Vec<u64> = if sent {
                o.sources.iter().map(|s| s.0).collect()
            } else {
                Vec::new()
            };
            let (transfer, finished) = (
                o.transfer,
                o.unfinished == 0 && o.stream.is_none() && (o.done || o.cancelled) && !o.held,
            );
            for b in sources {
                self.unuse_buffer(b);
            }
            if finished {
                self.drop_out_offer(item.offer);
            }
            if let Some(t) = transfer {
                self.add_progress(t, u64::from(item.len));
            }
        }
        self.pump(peer);
    }

    /// The oldest posted receive on a lane was unpacked and consumed (`Err`: its unpack failed).
    pub fn on_recv_consumed(&mut self, peer: PeerIdx, lane: u32, result: Result<(), String>) {
        if self.recv_lane_is_eager(peer, lane) {
            let Some((offer_id, len, credit_len)) = self.eager_consumed(peer, lane) else {
                return;
            };
            self.chunk_consumed(peer, lane, offer_id, len, result);
            // The credit receive is posted again after what the consume made: a READ's
            // `Finished` reaches its client, and the transfer's `Done` its sender, without
            // waiting for the `irecv` (issue #38: the legs after the last receive). The `Done`
            // may return this very credit before its receive is posted: the credit is the
            // chunk's bounce memory, which the plugin has back (the driver reports a consume
            // after the plugin's `irecvConsumed`), and a send the sender posts on it matches
            // the receive posted here later in this batch, as any send that reaches a plugin
            // before its receive (NCCL's net API leaves the order of `isend` and `irecv` free).
            if self.peers.get(&peer).is_some_and(|p| !p.gone()) {
                self.actions.push_back(Action::PostCredit {
                    peer,
                    lane,
                    len: credit_len,
                });
            }
        } else {
            let Some((offer_id, len)) = self
                .peers
                .get_mut(&peer)
                .and_then(|p| p.recv.get_mut(lane as usize))
                .and_then(|l| l.posted.pop_front())
                .map(|i| (i.offer, i.len))
            else {
                return;
            };
            self.chunk_consumed(peer, lane, offer_id, len, result);
        }
        self.pump(peer);
    }

    /// A posted receive in pieces on a rendezvous lane — offer `offer`'s chunk at wire offset
    /// `wire`, as `PostScatterRecv` named it — was scattered and consumed, whatever the lane's
    /// older receives are doing: the driver gives the plugin its slots back in ring order, but a
    /// receive that landed in its own landing slot and was scattered out of it by a copy helper
    /// ends when its copy does (`lanes::RecvQueue::consume_ready`), so one slow copy no longer
    /// holds the lane's `recv_window + scatter_ahead` places while the copies behind it are done.
    /// A receive not found this way (an eager lane's, or a plain one) is taken as the oldest, as
    /// [`Engine::on_recv_consumed`].
    pub fn on_scatter_consumed(
        &mut self,
        peer: PeerIdx,
        lane: u32,
        offer: u64,
        wire: u64,
        result: Result<(), String>,
    ) {
        let at = if self.recv_lane_is_eager(peer, lane) {
            None
        } else {
            self.peers
                .get(&peer)
                .and_then(|p| p.recv.get(lane as usize))
                .and_then(|l| {
                    l.posted
                        .iter()
                        .position(|i| i.pieces && i.offer == offer && i.offset == wire)
                })
        };
        let Some(at) = at else {
            return self.on_recv_consumed(peer, lane, result);
        };
        let Some(item) = self.peers.get_mut(&peer).and_then(|p| {
            let l = p.recv.get_mut(lane as usize)?;
            l.posted.remove(at)
        }) else {
            return;
        };
        self.chunk_consumed(peer, lane, item.offer, item.len, result);
        self.pump(peer);
    }

    /// A consumed chunk counted against its transfer (finished when it was the last).
    fn chunk_consumed(
        &mut self,
        peer: PeerIdx,
        lane: u32,
        offer_id: u64,
        len: u32,
        result: Result<(), String>,
    ) {
        let l = &mut self.peers[&peer].recv[lane as usize];
        l.bytes += u64::from(len);
        l.chunks += 1;
        self.offer_chunk_consumed(peer, offer_id, u64::from(len), result);
    }

    /// A chunk of `len` bytes of an offer this node receives was consumed (a lane's, or an
    /// inline transfer's one chunk): counted against its transfer, finished when the last.
    pub(super) fn offer_chunk_consumed(
        &mut self,
        peer: PeerIdx,
        offer_id: u64,
        len: u64,
        result: Result<(), String>,
    ) {
        let key = (peer, offer_id);
        if let Some(o) = self.in_offers.get_mut(&key) {
            o.chunks_done += 1;
            if let Err(why) = result
                && !o.discard
            {
                o.discard = true;
                o.failed = true;
                self.actions.push_back(Action::Control {
                    peer,
                    msg: PeerMsg::Failed {
                        offer_id,
                        code: Code::Internal,
                        message: why.clone(),
                    },
                });
                if let Some(t) = o.read.and_then(|r| self.reads.get(&r)).map(|r| r.transfer) {
                    self.fail_transfer(t, Code::Internal, &format!("unpack failed: {why}"), None);
                }
            }
            let Some(o) = self.in_offers.get_mut(&key) else {
                return;
            };
            if !o.discard {
                o.bytes_done += len;
            }
            let (read, discard) = (o.read, o.discard);
            if !discard && let Some(t) = read.and_then(|r| self.reads.get(&r)).map(|r| r.transfer) {
                self.add_progress(t, len);
                if let Some(tr) = self.transfers.get_mut(&t) {
                    tr.landed += len;
                }
            }
            if self.in_offers[&key].chunks_done == self.in_offers[&key].chunks_total {
                self.finish_in_offer(peer, offer_id);
            }
        }
    }

    pub(super) fn finish_in_offer(&mut self, peer: PeerIdx, offer_id: u64) {
        let o = self.in_offers.remove(&(peer, offer_id)).expect("present");
        for &(b, _) in &o.dests {
            self.unuse_buffer(b);
        }
        if o.discard {
            if let Some(rid) = o.read {
                self.reads.remove(&rid);
            }
            return;
        }
        // What the transfer's end makes goes ahead of the credit receives this batch posts
        // again (below).
        let mark = self.actions.len();
        // Our READ this offer served ends first: its `Finished` reaches the client before the
        // driver frames the `Done` and re-posts the credit receive.
        if let Some(rid) = o.read
            && let Some(r) = self.reads.remove(&rid)
        {
            self.part_done(r.transfer);
        }
        // The credits owed so far (this offer's last consume re-posted its receive) go with
        // it: one message instead of `Done` and, at the batch's end, `Credits`.
        let returned = self.take_owed_credits(peer).unwrap_or_default();
        self.actions.push_back(Action::Control {
            peer,
            msg: PeerMsg::Done { offer_id, returned },
        });
        let ours = o.read.is_some();
        if !o.notification.is_empty() {
            self.actions.push_back(Action::Notify {
                peer,
                transfer_id: o.notify_id,
                payload: o.notification,
                buffers: o.dests.iter().map(|d| d.0).collect(),
            });
        }
        // A WRITE's sender answers its client on this `Done`: on the wire before the credit
        // receives this batch posts again and the rest of the batch (once a peer and batch, so
        // many transfers ending in one pass still share the batch's one write), after the
        // notification (handed to this node's sessions, whose client may be waiting for it as
        // much). Our own READ's `Done` only lets its server release the sources: it goes with
        // the batch.
        if !ours && !self.sent_now.contains(&peer) {
            self.sent_now.push(peer);
            self.actions.push_back(Action::SendNow { peer });
        }
        self.ahead_of_reposts(peer, mark);
    }

    /// Moves the actions from `mark` on (a transfer's end: its `Finished` or `Done`, with what
    /// follows them) ahead of the credit receives of `peer` this batch still has to post again
    /// — chunks consumed in the same pass as the last one, before it — so the client or the
    /// sender hears before the `irecv`s (issue #38). Control messages to `peer` keep their
    /// order: where one waits between the first such receive and `mark`, nothing moves.
    fn ahead_of_reposts(&mut self, peer: PeerIdx, mark: usize) {
        let Some(at) = self
            .actions
            .range(..mark)
            .position(|a| matches!(a, Action::PostCredit { peer: p, .. } if *p == peer))
        else {
            return;
        };
        if self
            .actions
            .range(at..mark)
            .any(|a| matches!(a, Action::Control { peer: p, .. } if *p == peer))
        {
            return;
        }
        // In place (two `split_off`s allocated twice a transfer end: session 33, pollcpu):
        // [at, mark) goes after [mark, end), each keeping its order.
        self.actions.make_contiguous()[at..].rotate_left(mark - at);
    }

    /// The lane (or control stream) of a peer failed: every transfer touching it fails.
    pub fn on_peer_failed(&mut self, peer: PeerIdx, reason: &str) {
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        // A pairing closed when idle has no stream or comm left to fail (its stream's end
        // comes here too).
        if p.gone() {
            return;
        }
        p.failed = Some(reason.to_string());
        let node = p.node_id.clone();
        p.waiting.clear();
        for l in p.send.iter_mut().chain(p.recv.iter_mut()) {
            l.queue.clear();
            l.posted.clear();
            l.set_life(crate::lane_life::Life::Closed);
            l.send_credits = SendCredits::default();
            l.recv_credits = RecvCredits::default();
            l.targets.clear();
            l.landed.clear();
            l.unpacking.clear();
        }
        let msg = format!("peer {node} failed: {reason}");
        let outs: Vec<u64> = self
            .out_offers
            .iter()
            .filter(|(_, o)| o.peer == peer)
            .map(|(&id, _)| id)
            .collect();
        let mut hit: Vec<TransferId> = Vec::new();
        for id in outs {
            if let Some(t) = self.out_offers[&id].transfer {
                hit.push(t);
            }
            self.drop_out_offer(id);
        }
        let ins: Vec<u64> = self
            .in_offers
            .keys()
            .filter(|(p, _)| *p == peer)
            .map(|&(_, id)| id)
            .collect();
        for id in ins {
            let o = self.in_offers.remove(&(peer, id)).expect("present");
            for &(b, _) in &o.dests {
                self.unuse_buffer(b);
            }
        }
        let reads: Vec<u64> = self
            .reads
            .iter()
            .filter(|(_, r)| r.peer == peer)
            .map(|(&id, _)| id)
            .collect();
        for id in reads {
            hit.push(self.reads.remove(&id).expect("present").transfer);
        }
        for t in hit {
            self.fail_transfer(t, Code::Unavailable, &msg, None);
        }
        self.actions.push_back(Action::ClosePeer {
            peer,
            reason: reason.to_string(),
        });
        self.note_failed(peer);
    }

    // ---- cancellation and time ----------------------------------------------------------------

    /// Cancels a transfer. `false` when it already ended (or never existed).
    pub fn cancel(&mut self, id: TransferId, code: Code, message: &str) -> bool {
        if !self.transfers.contains_key(&id) {
            return false;
        }
        self.fail_transfer(id, code, message, None);
        true
    }

    /// A posted send whose bytes the driver could not read (a buffer registered by address whose
    /// client's memory is gone): the driver sends it empty (the lane's order holds) and its
    /// offer fails here with `message` — the local WRITE it belongs to, or the peer's READ it
    /// serves (cancelled, the peer told why). The send is found among the lane's posted ones by
    /// `buffer` and `offset` as `PostSend` / `PostGatherSend` (`wire`) named them. `false` when
    /// none matches (its offer ended already).
    pub fn fail_posted_send(
        &mut self,
        peer: PeerIdx,
        lane: u32,
        buffer: u64,
        offset: u64,
        message: &str,
    ) -> bool {
        let Some(offer) = self
            .peers
            .get(&peer)
            .and_then(|p| p.send.get(lane as usize))
            .and_then(|l| l.posted.iter().find(|i| i.buffer == buffer && i.offset == offset))
            .map(|i| i.offer)
        else {
            return false;
        };
        let Some(o) = self.out_offers.get(&offer) else {
            return false;
        };
        match o.transfer {
            Some(t) => self.fail_transfer(t, Code::FailedPrecondition, message, None),
            None => self.cancel_out_offer(offer, Some((Code::FailedPrecondition, message.to_string()))),
        }
        true
    }

    /// Fails every transfer whose deadline passed.
    pub fn on_tick(&mut self, now: Instant) {
        // A slice of what prepared READs left to plan (prepared::plan), for drivers that call
        // nothing else each pass.
        self.plan_pending();
        self.check_orphans(now);
        self.tick_drain(now);
        self.tick_lanes(now);
        while let Some(&(when, id)) = self.deadlines.first() {
            if when > now {
                break;
            }
            self.deadlines.pop_first();
            if self.transfers.contains_key(&id) {
                self.fail_transfer(id, Code::DeadlineExceeded, "the transfer's deadline passed", None);
            }
        }
    }

    /// The next deadline, for the driver's sleep.
    pub fn next_deadline(&self) -> Option<Instant> {
        let transfers = self.deadlines.first().map(|&(t, _)| t);
        [
            transfers,
            self.next_orphan_deadline(),
            self.drain_deadline(),
            self.next_idle_check(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Ends a transfer with an error; stops its parts on both sides (slots drain normally).
    pub(super) fn fail_transfer(&mut self, id: TransferId, code: Code, message: &str, entry: Option<usize>) {
        let Some(mut t) = self.transfers.remove(&id) else {
            return;
        };
        self.deadlines.remove(&(t.deadline, id));
        self.drop_notice(id);
        self.drop_plan(id);
        for part in std::mem::take(&mut t.parts) {
            match t.kind {
                TransferKind::Write => {
                    if self.out_offers.contains_key(&part) {
                        self.cancel_out_offer(part, Some((code, message.to_string())));
                    }
                }
                TransferKind::Read => {
                    if let Some(r) = self.reads.get_mut(&part) {
                        r.cancelled = true;
                        let (peer, offer) = (r.peer, r.offer);
                        self.actions.push_back(Action::Control {
                            peer,
                            msg: PeerMsg::CancelRead { read_id: part },
                        });
                        match offer.and_then(|o| self.in_offers.get_mut(&(peer, o))) {
                            // Data already agreed on keeps coming; it is discarded.
                            Some(o) => o.discard = true,
                            None => {
                                self.reads.remove(&part);
                            }
                        }
                    }
                }
            }
        }
        for p in &t.peers {
            self.peers[p].transfers_failed += 1;
        }
        let entries = (0..if t.one_status { 0 } else { t.entries.len() })
            .map(|i| match (&t.entries[i], entry) {
                (Some(s), _) => s.clone(),
                (None, Some(e)) if e == i => (code, message.to_string()),
                (None, Some(_)) => (
                    Code::Aborted,
                    format!("not completed: another entry failed: {message}"),
                ),
                (None, None) => (code, message.to_string()),
            })
            .collect();
        self.actions.push_back(Action::Finished {
            transfer: id,
            outcome: Outcome {
                code,
                message: message.to_string(),
                entries,
                landed: t.landed,
            },
        });
    }

    /// `CancelSeen` from `peer`: it discards offer `offer_id`'s chunks now, so those held go
    /// out (empty).
    pub(super) fn on_cancel_seen(&mut self, peer: PeerIdx, offer_id: u64) {
        if self.out_offers.get(&offer_id).is_some_and(|o| o.peer == peer) {
            self.release_held(offer_id);
        }
    }

    /// A held offer's peer discards its chunks (it answered `CancelSeen`, or said so otherwise:
    /// `Done`, `Failed`, `Reject`, `CancelRead`): the chunks held go out (empty).
    pub(super) fn release_held(&mut self, offer_id: u64) {
        let Some(o) = self.out_offers.get_mut(&offer_id).filter(|o| o.held) else {
            return;
        };
        o.held = false;
        let (peer, finished) = (o.peer, o.unfinished == 0 && o.stream.is_none());
        if finished {
            self.drop_out_offer(offer_id);
        }
        self.pump(peer);
    }

    /// Stops an offer we made: unaccepted, it is withdrawn; accepted, its remaining chunks go out
    /// empty. The peer is told unless `notify` is `None`.
    pub(super) fn cancel_out_offer(&mut self, offer_id: u64, notify: Option<(Code, String)>) {
        let Some(o) = self.out_offers.get_mut(&offer_id) else {
            return;
        };
        if o.cancelled {
            if notify.is_none() {
                // The peer gave up the offer itself (`Failed`, `Reject`): it discards the rest.
                self.release_held(offer_id);
            }
            return;
        }
        let peer = o.peer;
        if o.msg.is_some() {
            // Never sent (the peer's receive mode is not known yet): the peer knows nothing of it.
            self.peers[&peer].waiting.retain(|&id| id != offer_id);
            self.drop_out_offer(offer_id);
            return;
        }
        o.cancelled = true;
        if o.gathering {
            // Inline, its payload still being copied out of GPU memory: the peer has heard
            // nothing of it, and hears nothing; it ends when the copy does (`inline.rs`).
            return;
        }
        if let Some((code, message)) = notify {
            o.held = true;
            self.actions.push_back(Action::Control {
                peer,
                msg: PeerMsg::CancelOffer {
                    offer_id,
                    code,
                    message,
                },
            });
        }
        let o = &self.out_offers[&offer_id];
        if o.accepted {
            let p = &mut self.peers[&peer];
            for l in &mut p.send {
                for item in l.queue.iter_mut().filter(|i| i.offer == offer_id) {
                    item.empty();
                }
            }
            if o.unfinished == 0 && o.stream.is_none() && !o.held {
                self.drop_out_offer(offer_id);
            } else if o.stream.is_some() {
                // Its chunks not announced yet go out empty as credits allow.
                self.stream_more(peer);
                self.pump(peer);
            }
        }
        // Unaccepted: kept until the peer's Accept (then sent empty) or Reject arrives.
    }

    pub(super) fn drop_out_offer(&mut self, offer_id: u64) {
        let Some(o) = self.out_offers.remove(&offer_id) else {
            return;
        };
        if let Some(p) = self.peers.get_mut(&o.peer) {
            p.offers_open = p.offers_open.saturating_sub(1);
        }
        if o.inline_bytes > 0
            && let Some(p) = self.peers.get_mut(&o.peer)
        {
            p.inline_open = p.inline_open.saturating_sub(1);
            p.inline_outstanding = p.inline_outstanding.saturating_sub(o.inline_bytes);
            if o.inline_gpu {
                p.inline_gpu_outstanding = p.inline_gpu_outstanding.saturating_sub(1);
            }
        }
        if !o.sent {
            for &(b, _) in &o.sources {
                self.unuse_buffer(b);
            }
        }
    }

    pub(super) fn add_progress(&mut self, id: TransferId, bytes: u64) {
        if bytes == 0 {
            return;
        }
        if let Some(t) = self.transfers.get_mut(&id) {
            t.done_bytes += bytes;
            self.actions.push_back(Action::Progress {
                transfer: id,
                bytes_done: t.done_bytes,
                total: t.total,
                running: t.running,
            });
        }
    }

    pub(super) fn part_done(&mut self, id: TransferId) {
        let Some(t) = self.transfers.get_mut(&id) else {
            return;
        };
        t.pending_parts -= 1;
        if t.pending_parts > 0 {
            return;
        }
        let t = self.transfers.remove(&id).expect("present");
        self.deadlines.remove(&(t.deadline, id));
        self.send_notice(id);
        for p in &t.peers {
            self.peers[p].transfers_ok += 1;
        }
        self.note_finished_ok();
        self.actions.push_back(Action::Progress {
            transfer: id,
            bytes_done: t.total,
            total: t.total,
            running: true,
        });
        self.actions.push_back(Action::Finished {
            transfer: id,
            outcome: Outcome {
                code: Code::Ok,
                message: String::new(),
                entries: if t.one_status {
                    Vec::new()
                } else {
                    vec![(Code::Ok, String::new()); t.entries.len()]
                },
                landed: t.total,
            },
        });
    }

    /// Whether a completed receive of offer `offer` from `peer` (`Action::PostRecv`,
    /// `Action::PostScatterRecv`) may still be unpacked into its destination: `false` once the
    /// transfer it belongs to failed or was cancelled on this node (or its peer failed), so that
    /// no byte of a destination changes after its transfer was reported ended. The driver asks
    /// when the receive completed, before it unpacks anything.
    pub fn recv_lands(&self, peer: PeerIdx, offer: u64) -> bool {
        self.in_offers.get(&(peer, offer)).is_some_and(|o| !o.discard)
    }

    /// Posts what the windows allow on every lane of a peer.
    pub(super) fn pump(&mut self, peer: PeerIdx) {
        let (send_window, recv_window) = (self.cfg.send_window, self.cfg.recv_window);
        let (gather_ahead, scatter_ahead) = (self.cfg.gather_ahead, self.cfg.scatter_ahead);
        let host_gather_ahead = self.cfg.host_gather_ahead;
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        if p.gone() {
            return;
        }
        // Closed lanes with chunks queued are opened first (`lane_life.rs`).
        self.open_wanted(peer);
        let Some(p) = self.peers.get_mut(&peer) else {
            return;
        };
        // On the peer's eager lanes a send also needs a credit (a receive it posted for it).
        // (As `Peer::send_lane_eager`: a routed pairing's lanes are the catalogue's.)
        let (_, eager_lanes) = p.send_split();
        let routes = p.routes.as_ref();
        // A send in pieces from host memory is gathered `host_gather_ahead` ahead, from GPU
        // memory `gather_ahead` (the driver's staging ring of each kind has as many more slots).
        let buffers = &self.buffers;
        let ahead = |i: &Item| match buffers.get(&i.buffer).map(|b| b.memory) {
            Some(topology::Memory::Gpu(_)) => gather_ahead,
            _ => host_gather_ahead,
        };
        // Only lanes that held work can have any to post (`lane_use.rs`).
        for &lane in p.send_used.lanes() {
            let l = &mut p.send[lane as usize];
            let eager = match routes {
                Some(r) => !eager_lanes.is_empty() && r.send_eager(lane),
                None => eager_lanes.contains(&lane),
            };
            // A cancelled offer's chunks wait for the peer's `CancelSeen` (and the lane's order
            // with them).
            let held = |l: &Lane| {
                l.queue
                    .front()
                    .is_some_and(|i| self.out_offers.get(&i.offer).is_some_and(|o| o.held))
            };
            while !held(l)
                && let Some(item) = l.post_next_by(send_window, ahead, eager)
            {
                self.actions.push_back(if item.pieces {
                    Action::PostGatherSend {
                        peer,
                        lane,
                        buffer: item.buffer,
                        offer: item.offer,
                        wire: item.offset,
                        len: item.len,
                    }
                } else {
                    Action::PostSend {
                        peer,
                        lane,
                        buffer: item.buffer,
                        offset: item.offset,
                        len: item.len,
                    }
                });
            }
        }
        for &lane in p.recv_used.lanes() {
            let l = &mut p.recv[lane as usize];
            while let Some(item) = l.post_next(recv_window, scatter_ahead, false) {
                // A chunk of a transfer that ended here (failed, cancelled) still meets its
                // send, but lands in the lane's own place, never in the destination.
                let lands = self
                    .in_offers
                    .get(&(peer, item.offer))
                    .is_some_and(|o| !o.discard);
                self.actions.push_back(if !lands {
                    Action::PostDropRecv {
                        peer,
                        lane,
                        len: item.len,
                    }
                } else if item.pieces {
                    Action::PostScatterRecv {
                        peer,
                        lane,
                        buffer: item.buffer,
                        offer: item.offer,
                        wire: item.offset,
                        len: item.len,
                    }
                } else {
                    Action::PostRecv {
                        peer,
                        lane,
                        buffer: item.buffer,
                        offset: item.offset,
                        len: item.len,
                        offer: item.offer,
                    }
                });
            }
        }
        for &lane in p.send_used.lanes() {
            p.send[lane as usize].note_window();
        }
        for &lane in p.recv_used.lanes() {
            p.recv[lane as usize].note_window();
        }
    }
}
