//! The eager protocol: a WRITE with no round trip before the data.
//!
//! - **Receive mode.** Each side's first message to a peer says how it receives
//!   ([`PeerMsg::ReceiveMode`]): `credits` receives of `chunk_bytes` kept posted on every lane
//!   (eager), on its last lanes only (auto: from `eager_first_lane` on), or none (rendezvous:
//!   offer, accept, then receives into the destination). The sender follows the receiver's mode;
//!   a transfer started before the mode is known waits for it.
//! - **Lanes split by protocol (auto).** A lane is one plugin comm, matched FIFO: a credit receive
//!   standing on a lane would swallow the data of a rendezvous transfer sent on it. So an auto
//!   receiver keeps credits only on its eager lanes (`transfer.eager_lanes` per device, opened in
//!   addition to the `lanes_per_device` rendezvous lanes) and rendezvous transfers use the
//!   others. The sender picks per transfer: at most the receiver's `eager_max_bytes` in total →
//!   a header, chunks planned over the eager lanes; larger → offer and accept, chunks planned over
//!   the rendezvous lanes. Each protocol rotates its transfers' first lane over its own lanes.
//! - **Credits.** An eager receiver posts `credits` receives on each lane into landing slots
//!   whose destination is not known yet. The sender holds the same count per lane and spends one
//!   per send, never more than the receiver posted, each chunk at most `chunk_bytes` (the posted
//!   size). The receiver re-posts a receive as soon as it consumed one and returns the credit
//!   ([`PeerMsg::Credits`], batched at the end of each action batch; the consume that finishes
//!   a transfer returns what is owed inside its [`PeerMsg::Done`] instead, so a small transfer
//!   ends with one message; and while the sender cannot need them, owed credits wait for that
//!   `Done`: "Liveness" below).
//! - **Header, then data, no wait.** The sender writes the transfer's header
//!   ([`PeerMsg::Header`]: ranges, keys, chunk size, first lane) on the ordered control stream
//!   and posts its sends at once. The receiver maps the k-th completed receive on lane L to the
//!   k-th chunk headers announced for L; data that completes before its header waits in its
//!   bounce pages (at most `credits` per lane, and at most `header_timeout`).
//! - **Validation at unpack time.** The receiver checks keys and bounds when the header
//!   arrives. An accepted transfer's chunks are unpacked into the destination ([`Action::Land`]
//!   with a buffer); a rejected one's are consumed without unpacking (`Land` with none), its
//!   sender gets `Reject` with the reason, and every credit comes back. A header whose chunk plan
//!   cannot be trusted (chunk larger than the credit receives, bad lane, too many chunks,
//!   duplicate id, a header to a rendezvous receiver) breaks the lane order for every later
//!   transfer: the pairing fails.
//!
//! # Liveness
//!
//! A receiver may hold owed credits back — re-posted receives whose credits it has not sent —
//! hoping the next `Done` carries them (one message at a transfer's end instead of a `Credits`
//! message mid-transfer and the `Done`: issue #38, a spread 1 MiB WRITE's ~25 µs round trip).
//! Holding back must never leave a sender waiting for a credit that only a `Done` brings while
//! that `Done` waits for the sender. Each batch of actions ends by deciding again
//! (`flush_credits`): the owed credits go back in a `Credits` message unless one of two rules
//! says they may wait.
//!
//! What the receiver knows, per eager lane L: the `credits` it granted (`ReceiveMode`), `owed`
//! (and their bytes), `targets` (chunks announced by headers it has read, not landed yet),
//! `landed` (data before its header), `unpacking` (landed and matched, being consumed: local work
//! that always ends). The sender posts chunks on a lane in header order (the k-th receive is the k-th
//! chunk announced), so the chunks the receiver knows of come on each lane before any chunk of a
//! header it has not read; only a credit (and, towards GPU credits, the byte budget) holds a
//! known chunk back at the sender (a cancelled transfer's chunks wait for `CancelSeen`, which the
//! receiver sends at once; a streamed transfer's next chunks wait to be *announced* until
//! credits come back — announced chunks are queued).
//!
//! - **Rule 1** (session 25, `credits_may_wait`): every lane owes at most one and some lane that
//!   owes nothing still expects a chunk. That lane holds back none of the sender's credits or
//!   bytes, so its chunk comes (the sender has a credit for it, or every credit of the lane is a
//!   chunk on its way and consumed in turn); its consume is a new batch, which decides again.
//! - **Rule 2** (session 27, `Engine::done_needs_none_owed`): the sender needs none of the owed
//!   credits for anything announced, and a `Done` is coming. (a) On every lane with `targets`,
//!   `targets + unpacking + owed ≤ credits` — of the `credits` the sender was granted on the
//!   lane, those not back are spent on chunks announced and not landed, being unpacked, owed, or
//!   on their way back (no data waits for its header on a lane with targets), so it holds or
//!   gets back without the `Done` a credit for each announced chunk — and, with a byte budget B,
//!   `owed bytes + bytes of targets and unpacking ≤ B`, so every send fits the budget with
//!   nothing returned. (Counted against the grant, not the receives posted: a lane opened on
//!   first use posts its receives only once ready, while the sender already holds its credits.) (b) A chunk expected or being unpacked belongs
//!   to a transfer that lands here (not cancelled, refused or failed: those end without `Done`)
//!   with every chunk announced (not a stream that needs credits back to announce the rest).
//!   Then every chunk of that transfer comes and is consumed, and its last consume sends its
//!   `Done` with every credit owed at that moment.
//!
//! Why no sender waits for ever. While credits are held, every consume re-posts a receive and
//! owes one more credit, so a lane can owe at most its `credits` (16): at most `credits × lanes`
//! consumes happen while nothing goes back. Each rule guarantees, when it holds, that some
//! consume is still to come without any owed credit (rule 1: the lane owing nothing; rule 2: the
//! awaited transfer's chunks). So the last batch while they are held cannot end with a rule
//! holding — contradiction unless they went back: in the awaited `Done`, or in a `Credits`
//! message once neither rule holds. The cases the rules were checked against (engine tests
//! `eager_credits::`, `owed_credits::`, `gpu_credits::`):
//! - *A small transfer announcing chunks that need every credit of a lane* (its header read
//!   while a lane owes two): rule 2(a) fails in that header's batch, rule 1 too (a lane owes
//!   two), and the credits go back at once.
//! - *A large transfer and small ones*: a transfer of more chunks than a lane's credits fails
//!   2(a) from its header on, so its credits flow as they did before (rule 1 only); a streamed
//!   one fails 2(b) until its last chunks are announced. Small transfers behind either find
//!   the quarter of each lane the sender keeps for them (`streams.rs`); rule 2 only ever delays
//!   a chunk the receiver has not been told of yet, until the next `Done` (its header's batch
//!   decides again).
//! - *Several transfers interleaved on a lane*, WRITEs and READs both ways: 2(a) counts every
//!   announced chunk of every transfer on the lane, and any one `Done` returns every credit
//!   owed, whichever transfer's consumes owed them.
//! - *The receive window*: the grant is the credit receives kept posted per lane, never more
//!   than the plugin's requests per comm; the sender's `send_window` only delays sends that find
//!   receives posted (or a lane still opening, whose receives are posted once it is ready).
//! - *Cancel, refusal, failed unpack*: the transfer no longer lands, so it is no `Done` to wait
//!   for (2(b)); what its consumes owe goes back in the batch that ended it unless another
//!   transfer's `Done` is coming. *Peer lost*: its credits die with its lanes on both sides.

use super::*;

/// The most chunks one header may announce (512 GiB at the smallest chunk size): bounds the
/// receiver's bookkeeping for a header it rejects.
pub const MAX_HEADER_CHUNKS: u64 = 1 << 27;

/// Requests the plugin holds per comm: no receiver can post more credits than this.
pub const PLUGIN_REQUESTS: u32 = 16;

impl Engine {
    /// The first message to a new peer: how this node receives.
    pub(super) fn announce_mode(&mut self, peer: PeerIdx) {
        let p = &self.peers[&peer];
        let (rendezvous, eager) = p.recv_split();
        let credit_bytes = p.credit_bytes;
        let msg = if eager.is_empty() {
            PeerMsg::ReceiveMode {
                credits: 0,
                chunk_bytes: self.cfg.chunk_bytes,
                eager_first_lane: 0,
                eager_max_bytes: 0,
            }
        } else if rendezvous.is_empty() {
            // Every lane eager: the form an eager node has always sent.
            PeerMsg::ReceiveMode {
                credits: self.cfg.credits,
                chunk_bytes: self.cfg.chunk_bytes,
                eager_first_lane: 0,
                eager_max_bytes: 0,
            }
        } else {
            PeerMsg::ReceiveMode {
                credits: self.cfg.credits,
                chunk_bytes: credit_bytes,
                eager_first_lane: eager.start,
                eager_max_bytes: self.cfg.eager_max_bytes,
            }
        };
        self.actions.push_back(Action::Control { peer, msg });
    }

    /// A receive lane became ready: post its credit receives if it is an eager lane.
    pub(super) fn post_credits(&mut self, peer: PeerIdx, lane: u32) {
        if !self.recv_lane_is_eager(peer, lane) {
            return;
        }
        let p = &mut self.peers[&peer];
        let (n, len) = (self.cfg.credits, p.credit_bytes);
        let Some(l) = p.recv.get_mut(lane as usize) else {
            return;
        };
        p.recv_used.mark(lane);
        if l.recv_credits.posted() > 0 || !l.landed.is_empty() || !l.unpacking.is_empty() {
            // Already posted (a second ready event).
            return;
        }
        l.recv_credits.posted_all(n);
        for _ in 0..n {
            self.actions.push_back(Action::PostCredit { peer, lane, len });
        }
    }

    /// Fails the pairing: the peer broke the protocol in a way that loses the lane order.
    pub(super) fn violation(&mut self, peer: PeerIdx, why: String) {
        self.on_peer_failed(peer, &format!("protocol violation: {why}"));
    }

    pub(super) fn on_receive_mode(
        &mut self,
        peer: PeerIdx,
        credits: u32,
        chunk_bytes: u32,
        eager_first_lane: u32,
        eager_max_bytes: u64,
    ) {
        let p = &self.peers[&peer];
        let lanes = p.send_layout;
        if p.remote.is_some() {
            return self.violation(peer, "a second ReceiveMode".into());
        }
        if credits > PLUGIN_REQUESTS {
            return self.violation(
                peer,
                format!("{credits} credits per lane (the plugin posts at most {PLUGIN_REQUESTS})"),
            );
        }
        if credits > 0
            && let Err(e) = plan::check_chunk_bytes(u64::from(chunk_bytes))
        {
            return self.violation(peer, format!("ReceiveMode: {e}"));
        }
        if eager_first_lane > 0 && (credits == 0 || eager_first_lane >= lanes) {
            // No eager lane left, or eager lanes without credits: the plan of either protocol
            // would rest on lanes that do not exist.
            return self.violation(
                peer,
                format!(
                    "ReceiveMode: eager_first_lane {eager_first_lane} with {credits} credits and {lanes} lanes"
                ),
            );
        }
        let eager_from = if credits > 0 { eager_first_lane } else { lanes };
        let eager_max = if eager_max_bytes == 0 {
            u64::MAX
        } else {
            eager_max_bytes
        };
        let p = &mut self.peers[&peer];
        p.remote = Some(RemoteMode {
            credits,
            chunk_bytes,
            eager_from,
            eager_max,
        });
        let budget = p.remote_gpu_budget.unwrap_or(0);
        // The layout's eager lanes, and on a routed pairing each group's eager lanes (`routes.rs`).
        for lane in 0..p.send.len() as u32 {
            let n = if p.send_lane_eager(lane) { credits } else { 0 };
            let l = &mut p.send[lane as usize];
            l.send_credits = SendCredits::granted(n);
            l.send_credits.set_budget(budget);
        }
        for id in std::mem::take(&mut p.waiting) {
            self.send_offer(id);
        }
        self.pump(peer);
    }

    /// Credits the peer returned: only the lanes named are walked (peer protocol 12). A
    /// malformed list, or a count above what the lane has out, fails the pairing and changes
    /// nothing.
    pub(super) fn on_credits(&mut self, peer: PeerIdx, returned: ReturnedCredits) {
        let p = &self.peers[&peer];
        if p.remote.is_none_or(|r| r.credits == 0) {
            return self.violation(peer, "credits from a peer that receives by rendezvous".into());
        }
        if let Err(why) = returned.check(p.send.len()) {
            return self.violation(peer, why);
        }
        // Every lane checked before any takes its credits back: a refused message changes
        // nothing. Its rendezvous lanes (auto) were granted none.
        for (lane, n) in returned.pairs() {
            if let Err(e) = p.send[lane as usize].send_credits.check_return(n) {
                return self.violation(peer, format!("lane {lane}: {e}"));
            }
        }
        let p = &mut self.peers[&peer];
        for (lane, n) in returned.pairs() {
            p.send[lane as usize].send_credits.take_back(n).expect("checked");
        }
        self.stream_more(peer);
        self.pump(peer);
    }

    /// An eager header: the data is already on its way (or here).
    pub(super) fn on_header(&mut self, peer: PeerIdx, offer: Offer) {
        if Self::is_lone_notice(&offer) {
            // No chunks follow it, on any lane: its lanes and plan do not matter.
            return self.on_lone_notice(peer, offer);
        }
        let (_, layout_lanes) = self.peers[&peer].recv_split();
        let credit_bytes = self.peers[&peer].credit_bytes;
        if layout_lanes.is_empty() {
            return self.violation(
                peer,
                format!(
                    "header of transfer {} sent to a node that receives by rendezvous",
                    offer.offer_id
                ),
            );
        }
        // A routed pairing's header names its memory pair's eager lanes (`routes.rs`).
        let lanes = match self.routed_eager_recv_lanes(peer, offer.first_lane, &offer.ranges) {
            Ok(routed) => routed.unwrap_or(layout_lanes),
            Err(why) => {
                return self.violation(peer, format!("header of transfer {}: {why}", offer.offer_id));
            }
        };
        // What the chunk plan rests on: if any of it is wrong, the k-th receive of a lane can no
        // longer be matched to its chunk, for this transfer and every later one.
        let plan: Result<(), String> = (|| {
            plan::check_chunk_bytes(u64::from(offer.chunk_bytes))?;
            if offer.chunk_bytes > credit_bytes {
                return Err(format!(
                    "chunk_bytes {} exceeds the {credit_bytes}-byte credit receives",
                    offer.chunk_bytes
                ));
            }
            if !lanes.contains(&offer.first_lane) {
                return Err(format!(
                    "first_lane {} is not one of the eager lanes {}..{}",
                    offer.first_lane, lanes.start, lanes.end
                ));
            }
            if offer.blocks.is_none()
                && (offer.ranges.is_empty() || offer.ranges.len() > self.cfg.max_entries)
            {
                return Err(format!(
                    "{} ranges (1 to {} allowed)",
                    offer.ranges.len(),
                    self.cfg.max_entries
                ));
            }
            let Some(chunks) = coalesce::offer_chunks(&offer, MAX_HEADER_CHUNKS) else {
                return Err(format!("more than {MAX_HEADER_CHUNKS} chunks in one transfer"));
            };
            if let Some(n) = offer.announced
                && n > chunks
            {
                return Err(format!("{n} chunks announced of {chunks}"));
            }
            if self.in_offers.contains_key(&(peer, offer.offer_id)) {
                return Err(format!("transfer {} is already active", offer.offer_id));
            }
            Ok(())
        })();
        if let Err(why) = plan {
            return self.violation(peer, format!("header of transfer {}: {why}", offer.offer_id));
        }
        // What only this transfer rests on: refused, its chunks are consumed without unpacking.
        let verdict = self.incoming_places(peer, &offer);
        self.take_header(peer, offer, verdict, lanes);
    }

    /// Lays out a header's chunks on the eager lanes `lanes` (after the checks its plan rests on):
    /// into its destinations when `verdict` is good, else to be consumed without unpacking (the
    /// sender is told why).
    pub(super) fn take_header(
        &mut self,
        peer: PeerIdx,
        offer: Offer,
        verdict: Result<coalesce::Places, (Code, String, u32)>,
        lanes: Range<u32>,
    ) {
        let (dests, plan, verdict) = match verdict {
            Ok(p) => (p.places, p.plan, Ok(())),
            Err(e) => (Vec::new(), None, Err(e)),
        };
        let accepted = verdict.is_ok();
        for &(b, _) in &dests {
            self.use_buffer(b);
        }
        self.peers.get_mut(&peer).expect("live").received_eager += 1;
        let (chunks_total, stream) = self.lay_out_header(peer, &offer, &dests, plan.as_ref(), lanes.clone());
        let read = (offer.read_id != 0).then_some(offer.read_id);
        match verdict {
            Ok(()) => {
                if let Some(rid) = read {
                    let r = self.reads.get_mut(&rid).expect("checked");
                    r.offer = Some(offer.offer_id);
                    let t = r.transfer;
                    self.set_running(t);
                }
            }
            // Our READ this header claims to serve fails with the reason.
            Err(why) => self.refuse_sent_data(peer, offer.offer_id, read, why),
        }
        if chunks_total > 0 {
            self.in_offers.insert(
                (peer, offer.offer_id),
                InOffer {
                    read: if accepted { read } else { None },
                    dests,
                    chunks_total,
                    chunks_done: 0,
                    bytes_done: 0,
                    discard: !accepted,
                    failed: !accepted,
                    notify_id: offer.notify_id(),
                    notification: offer.notification,
                    plan,
                    stream,
                },
            );
        }
        for lane in lanes {
            self.match_landed(peer, lane);
        }
    }

    /// The oldest credit receive of an eager lane without data completed.
    pub fn on_recv_landed(&mut self, peer: PeerIdx, lane: u32, now: Instant) {
        let Some(l) = self
            .peers
            .get_mut(&peer)
            .filter(|p| !p.gone())
            .and_then(|p| p.recv.get_mut(lane as usize))
        else {
            return;
        };
        if !l.recv_credits.land() {
            // The driver reported more completions than credits posted: a driver bug, never
            // the peer's doing (the plugin cannot complete a receive nobody posted).
            debug_assert!(false, "on_recv_landed without a posted credit");
            return;
        }
        l.landed.push_back(now);
        self.match_landed(peer, lane);
    }

    /// Pairs landed receives with announced chunks, in lane order.
    pub(super) fn match_landed(&mut self, peer: PeerIdx, lane: u32) {
        let p = &mut self.peers[&peer];
        let l = &mut p.recv[lane as usize];
        while !l.landed.is_empty() && !l.targets.is_empty() {
            l.landed.pop_front();
            let t = l.targets.pop_front().expect("checked");
            l.unpacking.push_back(t);
            // A transfer cancelled or failed since its header came: nothing lands.
            let keep = self.in_offers.get(&(peer, t.offer)).is_some_and(|o| !o.discard);
            let dest = t.dest.filter(|_| keep);
            self.actions.push_back(match dest {
                Some((buffer, wire)) if t.pieces => Action::LandScatter {
                    peer,
                    lane,
                    buffer,
                    offer: t.offer,
                    wire,
                    len: t.len,
                },
                _ => Action::Land {
                    peer,
                    lane,
                    buffer: dest.map(|d| d.0),
                    offset: dest.map_or(0, |d| d.1),
                    len: t.len,
                },
            });
        }
    }

    /// An eager lane's oldest chunk handed to the driver was consumed: its credit receive is
    /// to be posted again (counted here, so the credit goes back to the peer with this batch's
    /// `Done` or `Credits`). Returns the chunk's transfer and length, and the length of the
    /// credit receive the caller posts ([`Action::PostCredit`], before the first message that
    /// returns the credit: `on_recv_consumed`).
    pub(super) fn eager_consumed(&mut self, peer: PeerIdx, lane: u32) -> Option<(u64, u32, u32)> {
        let p = self.peers.get_mut(&peer)?;
        let len = p.credit_bytes;
        let l = p.recv.get_mut(lane as usize)?;
        let t = l.unpacking.pop_front()?;
        l.recv_credits.repost(t.len);
        Some((t.offer, t.len, len))
    }

    /// One `Credits` message per peer with credits to return (those a `Done` did not carry),
    /// unless they may wait for a `Done` that is coming (rules 1 and 2 of the module's
    /// "Liveness": `credits_may_wait`, `done_needs_none_owed`).
    pub(super) fn flush_credits(&mut self) {
        // The byte budget this node announced to its peers (`GpuCredits`): 0, none.
        let budget = if self.gpu_credits() { self.own_budget() } else { 0 };
        let mut now: Vec<PeerIdx> = Vec::new();
        for (&peer, p) in self.peers.iter() {
            if p.gone() || !owing(p) || credits_may_wait(p) || self.done_needs_none_owed(peer, p, budget) {
                continue;
            }
            now.push(peer);
        }
        for peer in now {
            if let Some(returned) = self.peers.get_mut(&peer).and_then(take_owed) {
                self.actions.push_back(Action::Control {
                    peer,
                    msg: PeerMsg::Credits { returned },
                });
            }
        }
    }

    /// Whether a pairing's owed credits may wait for a `Done` because the sender can bring that
    /// `Done` about without any of them (the module's "Liveness", rule 2):
    ///
    /// - on every lane in use that still expects announced chunks, the sender holds (or has on
    ///   its way back) a credit for each, and their bytes with every byte not yet returned fit
    ///   the byte budget this node announced (`budget`, 0: none) — so the sender sends them all
    ///   without a credit back;
    /// - and one of those chunks (expected or being unpacked) belongs to a transfer that lands
    ///   here (not cancelled, refused or failed) and has every chunk announced (a streamed one
    ///   announces more only as credits come back): its last consume sends its `Done`, which
    ///   carries every credit owed then.
    fn done_needs_none_owed(&self, peer: PeerIdx, p: &Peer, budget: u64) -> bool {
        let mut done_coming = false;
        for &i in p.recv_used.lanes() {
            let l = &p.recv[i as usize];
            let c = &l.recv_credits;
            if !l.targets.is_empty() && p.recv_lane_eager(i) {
                // The sender was granted `credits` on the lane; those not back with it are spent
                // on chunks on their way (`targets`), landed (none while targets wait:
                // `match_landed`), being unpacked, owed, or on their way back in a message
                // already sent. So it can send every chunk announced without the owed ones
                // when these fit the grant (whether or not the lane's receives are posted yet:
                // a lane opened on first use posts them once ready).
                let out = l.targets.len() + l.unpacking.len();
                if out as u64 + u64::from(c.owed()) > u64::from(self.cfg.credits) {
                    return false;
                }
                if budget > 0 {
                    // With targets waiting, no data waits for its header (`match_landed`).
                    let out: u64 = l
                        .targets
                        .iter()
                        .chain(&l.unpacking)
                        .map(|t| u64::from(t.len))
                        .sum();
                    if c.owed_bytes() + out > budget {
                        return false;
                    }
                }
            }
            done_coming = done_coming
                || l.targets.iter().chain(&l.unpacking).any(|t| {
                    self.in_offers
                        .get(&(peer, t.offer))
                        .is_some_and(|o| !o.discard && o.stream.is_none())
                });
        }
        done_coming
    }

    /// The credits owed to `peer`, taken (a `Done` carries them); `None` when none is owed or
    /// the pairing is gone.
    pub(super) fn take_owed_credits(&mut self, peer: PeerIdx) -> Option<ReturnedCredits> {
        self.peers.get_mut(&peer).and_then(take_owed)
    }

    /// The earliest moment data that is waiting for its header fails its peer.
    pub(super) fn next_orphan_deadline(&self) -> Option<Instant> {
        self.peers
            .values()
            .filter(|p| !p.gone())
            .flat_map(|p| &p.recv)
            .filter_map(|l| l.landed.front())
            .min()
            .map(|&t| t + self.cfg.header_timeout)
    }

    /// Fails each peer whose data waited for its header past `header_timeout`.
    pub(super) fn check_orphans(&mut self, now: Instant) {
        let timeout = self.cfg.header_timeout;
        let late: Vec<(PeerIdx, usize)> = self
            .peers
            .iter()
            .filter(|(_, p)| !p.gone())
            .filter_map(|(&peer, p)| {
                p.recv
                    .iter()
                    .position(|l| l.landed.front().is_some_and(|&t| t + timeout <= now))
                    .map(|lane| (peer, lane))
            })
            .collect();
        for (peer, lane) in late {
            self.violation(
                peer,
                format!("data on lane {lane} waited {timeout:?} for its header"),
            );
        }
    }
}

/// Rule 1 of the module's "Liveness" (session 25): a pairing's owed credits may wait for the
/// next batch of actions when each lane owes at most one, and some lane that owes nothing still
/// expects a chunk (announced, landed before its header, or being unpacked). That lane holds back
/// none of the sender's credits or credit bytes, so its expected chunk comes, and its consume
/// decides again. A pairing that failed returns nothing (its credits die with its lanes).
fn credits_may_wait(p: &Peer) -> bool {
    if p.gone() {
        return false;
    }
    let mut expecting = false;
    for &i in p.recv_used.lanes() {
        let l = &p.recv[i as usize];
        match l.recv_credits.owed() {
            0 => expecting |= !l.targets.is_empty() || !l.landed.is_empty() || !l.unpacking.is_empty(),
            1 => {}
            _ => return false,
        }
    }
    expecting
}

/// Whether a pairing owes its peer any credit (only a lane in use can: `lane_use.rs`).
fn owing(p: &Peer) -> bool {
    p.recv_used
        .lanes()
        .iter()
        .any(|&i| p.recv[i as usize].recv_credits.owed() > 0)
}

/// A pairing's owed credits, taken; `None` when none is owed or it is gone. Only the lanes in
/// use can owe (`lane_use.rs`): the sparse list is built from them, never from every lane.
fn take_owed(p: &mut Peer) -> Option<ReturnedCredits> {
    if p.gone() {
        return None;
    }
    let mut returned = ReturnedCredits::default();
    for &i in p.recv_used.lanes() {
        let n = p.recv[i as usize].recv_credits.take_owed();
        if n > 0 {
            returned.insert(i, n);
        }
    }
    (!returned.is_empty()).then_some(returned)
}
