//! Starting transfers: validating a WRITE or READ against local buffers, peers and limits, and
//! making the offers and read requests that carry it to the peers.

use super::*;

/// `entries[i].remote_descriptor`, written only when an error names it.
struct RemoteField(usize);

impl std::fmt::Display for RemoteField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "entries[{}].remote_descriptor", self.0)
    }
}

impl Engine {
    pub(super) fn check_common(&self, entries: usize, notification: usize) -> EngineResult<()> {
        if entries == 0 {
            return Err(EngineError::invalid("entries: at least one entry is required"));
        }
        if entries > self.cfg.max_entries {
            return Err(EngineError::invalid(format!(
                "entries: {entries} entries exceed the limit of {}",
                self.cfg.max_entries
            )));
        }
        if notification > self.cfg.max_notification {
            return Err(EngineError::invalid(format!(
                "notification: {notification} bytes exceed the limit of {} bytes",
                self.cfg.max_notification
            )));
        }
        Ok(())
    }

    /// Validates a transfer's entries against local buffers, limits and peers; returns the total
    /// bytes. Field names in errors are the API's (`entries[i].…`).
    pub(super) fn check_entries(&self, specs: &[EntrySpec], notification: usize) -> EngineResult<u64> {
        self.check_common(specs.len(), notification)?;
        let mut total = 0u64;
        // A batch names one peer many times over, mostly in a row: checked once a run.
        let (mut last_peer, mut last_buffer) = (None, None);
        for (i, s) in specs.iter().enumerate() {
            // Zero bytes: a notification alone (`notice.rs`), one entry carrying one.
            if s.remote.length == 0 && (specs.len() != 1 || notification == 0) {
                return Err(EngineError::invalid(format!(
                    "entries[{i}].length: must be at least 1 byte (0 only for a WRITE of one entry that carries a notification)"
                )));
            }
            self.check_local(
                i,
                s.local_buffer,
                s.local_offset,
                s.remote.length,
                &mut last_buffer,
            )?;
            if range_end(s.remote.offset, s.remote.length).is_none() {
                return Err(EngineError::invalid(format!(
                    "entries[{i}].remote_offset: {} + length {} overflows 64 bits",
                    s.remote.offset, s.remote.length
                )));
            }
            if last_peer != Some(s.peer) {
                self.live_peer(RemoteField(i), s.peer)?;
                last_peer = Some(s.peer);
            }
            total += s.remote.length;
        }
        Ok(total)
    }

    /// Records one part of a transfer (an offer id or a read id) towards `peer`; the pairing
    /// counts the transfer once, however many parts it has there.
    pub(super) fn add_part(&mut self, id: TransferId, part: u64, peer: PeerIdx) {
        let t = self.transfers.get_mut(&id).expect("just created");
        t.parts.push(part);
        t.pending_parts += 1;
        if !t.peers.contains(&peer) {
            t.peers.push(peer);
            self.peers[&peer].transfers_started += 1;
        }
    }

    /// The first progress event of a new transfer.
    pub(super) fn announce(&mut self, id: TransferId, total: u64) {
        self.actions.push_back(Action::Progress {
            transfer: id,
            bytes_done: 0,
            total,
            running: false,
        });
    }

    pub(super) fn new_transfer(
        &mut self,
        kind: TransferKind,
        total: u64,
        entries: usize,
        deadline: Instant,
    ) -> TransferId {
        let id = TransferId(self.next_transfer);
        self.next_transfer += 1;
        self.transfers.insert(
            id,
            Transfer {
                kind,
                total,
                done_bytes: 0,
                landed: 0,
                entries: vec![None; entries],
                pending_parts: 0,
                parts: Vec::new(),
                deadline,
                running: false,
                peers: Vec::new(),
                one_status: false,
            },
        );
        self.deadlines.insert((deadline, id));
        id
    }

    /// Makes a transfer's outcome carry no per-entry statuses (`Outcome::entries` empty): its
    /// status is every entry's. For a batch of many entries of one buffer pair (the API's
    /// `BatchRanges`), whose statuses would cost more than its planning. Unknown ids: nothing.
    pub fn report_one_status(&mut self, id: TransferId) {
        if let Some(t) = self.transfers.get_mut(&id) {
            t.one_status = true;
        }
    }

    /// Starts a WRITE. Validates everything local (buffers, bounds, peers, limits) first: on error
    /// nothing changed.
    pub fn start_write(
        &mut self,
        specs: Vec<WriteSpec>,
        notification: Vec<u8>,
        deadline: Instant,
        now: Instant,
    ) -> EngineResult<TransferId> {
        self.refuse_while_draining()?;
        let total = self.check_entries(&specs, notification.len())?;
        let id = self.new_transfer(TransferKind::Write, total, specs.len(), deadline);
        // One offer per peer and memory pair (`route_parts.rs`), ranges in entry order.
        // (One entry is one part: no grouping, as `group_by_route` would give.)
        let parts = if specs.len() == 1 {
            vec![(specs[0].peer, vec![0])]
        } else {
            self.group_by_route(&specs)
        };
        // One part (a one-entry WRITE, a notification alone) carries the notification itself:
        // nothing to split (`split_notification` of one part gives it back), no map, no copy.
        let (mut whole, notification) = if parts.len() == 1 {
            (Some(notification), Vec::new())
        } else {
            (None, notification)
        };
        // What each peer's offers carry: the notification, or nothing when it is kept until
        // every part of several landed.
        let mut carried: HashMap<PeerIdx, Vec<u8>> = HashMap::new();
        for (peer, _) in parts.iter().filter(|_| whole.is_none()) {
            if carried.contains_key(peer) {
                continue;
            }
            let mine = || parts.iter().filter(|(p, _)| p == peer);
            let buffers = mine().flat_map(|(_, v)| v.iter().map(|&i| specs[i].remote.buffer_id));
            let carry = self.split_notification(id, *peer, mine().count(), &notification, buffers);
            carried.insert(*peer, carry);
        }
        let deadline_ms = deadline.saturating_duration_since(now).as_millis() as u64;
        for (peer, idxs) in parts {
            let offer_id = self.next_offer;
            self.next_offer += 1;
            let ranges: Vec<RemoteRange> = idxs.iter().map(|&i| specs[i].remote.clone()).collect();
            let one_local = coalesce::all_one(idxs.iter().map(|&i| specs[i].local_buffer));
            let src = if coalesce::should_coalesce(one_local, &ranges, self.cfg.chunk_bytes) {
                coalesce::Places::coalesced(
                    specs[idxs[0]].local_buffer,
                    idxs.iter()
                        .map(|&i| (specs[i].local_offset, specs[i].remote.length)),
                )
            } else {
                coalesce::Places::ranges(
                    idxs.iter()
                        .map(|&i| (specs[i].local_buffer, specs[i].local_offset))
                        .collect(),
                    idxs.iter().map(|&i| specs[i].remote.length).collect(),
                )
            };
            self.make_offer(
                peer,
                offer_id,
                0,
                Some(id),
                idxs,
                src,
                ranges.into(),
                None,
                whole.take().unwrap_or_else(|| carried[&peer].clone()),
                deadline_ms,
                false,
            );
            self.add_part(id, offer_id, peer);
        }
        self.announce(id, total);
        Ok(id)
    }

    /// Records an offer this node makes and sends it, or keeps it until the peer's receive mode
    /// is known. `src`: where its chunks come from (per range, or planned: coalesced or blocks,
    /// with the block header for the receiver in `blocks`). `host_dests`: a READ's reader said
    /// every destination is host memory (it may go inline: `inline.rs`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn make_offer(
        &mut self,
        peer: PeerIdx,
        offer_id: u64,
        read_id: u64,
        transfer: Option<TransferId>,
        entries: Vec<usize>,
        src: coalesce::Places,
        ranges: Ranges,
        blocks: Option<Box<blocks::BlockHeader>>,
        notification: Vec<u8>,
        deadline_ms: u64,
        host_dests: bool,
    ) {
        let coalesce::Places {
            places: sources,
            lengths,
            plan,
        } = src;
        for &(b, _) in &sources {
            self.use_buffer(b);
        }
        let coalesced = plan.is_some() && blocks.is_none();
        self.out_offers.insert(
            offer_id,
            OutOffer {
                peer,
                transfer,
                read_id,
                entries,
                sources,
                lengths,
                chunk_bytes: self.cfg.chunk_bytes,
                first_lane: 0,
                lanes: 0..0,
                msg: Some(Offer {
                    offer_id,
                    read_id,
                    chunk_bytes: 0,
                    first_lane: 0,
                    ranges,
                    notification,
                    deadline_ms,
                    blocks,
                    coalesced,
                    transfer_id: transfer.map_or(0, |t| t.0),
                    announced: None,
                }),
                eager: false,
                accepted: false,
                cancelled: false,
                held: false,
                unfinished: 0,
                done: false,
                sent: false,
                plan,
                stream: None,
                inline_bytes: 0,
                inline_gpu: false,
                gathering: false,
                host_dests,
            },
        );
        let p = self.peers.get_mut(&peer).expect("live");
        p.offers_open += 1;
        if p.remote.is_some() {
            self.send_offer(offer_id);
        } else {
            p.waiting.push(offer_id);
        }
    }

    /// Sends a recorded offer as the peer receives: an offer (rendezvous), or a header followed
    /// at once by its sends (eager, chunks no larger than the peer's credit receives). With a
    /// peer that has lanes of both kinds (auto), the transfer's total size picks: at most the
    /// peer's `eager_max_bytes` goes eager.
    pub(super) fn send_offer(&mut self, offer_id: u64) {
        let Some(o) = self.out_offers.get_mut(&offer_id) else {
            return;
        };
        let Some(mut msg) = o.msg.take() else {
            return;
        };
        let peer = o.peer;
        if Self::is_lone_notice(&msg) {
            return self.send_lone_notice(offer_id, msg);
        }
        if let Some(send) = self.inline_sources(offer_id, &msg) {
            return self.send_inline(offer_id, msg, send);
        }
        // A routed pairing: an eager transfer takes the eager lanes of its memory pair
        // (`routes.rs`).
        let routed_eager =
            self.routed_eager_send_lanes(peer, &self.out_offers[&offer_id].sources, &msg.ranges);
        let o = &self.out_offers[&offer_id];
        let p = &mut self.peers[&peer];
        let remote = p.remote.expect("the peer's receive mode is known");
        let (rendezvous_lanes, eager_lanes) = p.send_split();
        let total = o.lengths.iter().fold(0u64, |a, &l| a.saturating_add(l));
        let others_on_lanes = p.others_on_lanes();
        // Into the receiver's GPU memory by its GPU credits: eager at any size, streamed when
        // larger than what it wants eager otherwise (`streams.rs`).
        let any_size = !eager_lanes.is_empty()
            && Self::credits_at_any_size(p, &msg.ranges, msg.blocks.is_some() || o.plan.is_some());
        let eager = any_size || choose_eager(&rendezvous_lanes, &eager_lanes, total, remote.eager_max);
        let streamed = any_size && total > remote.eager_max;
        let chunk_bytes = if eager {
            self.cfg.chunk_bytes.min(remote.chunk_bytes)
        } else {
            self.cfg.chunk_bytes
        };
        let (lanes, rotor) = if eager {
            p.sent_eager += 1;
            (routed_eager.unwrap_or(eager_lanes), &mut p.next_eager_lane)
        } else {
            p.sent_rendezvous += 1;
            (rendezvous_lanes, &mut p.next_lane)
        };
        let count = lanes.end - lanes.start;
        // A plain transfer of few chunks is spread over more, smaller ones (`spread_min_chunk`)
        // while it is alone on the pairing's lanes: spreading fills sockets a lone transfer would
        // leave idle, but beside other transfers the sockets are busy anyway and more, smaller
        // requests only cost both pollers work (128–256 KiB at 8 in flight 0.83–0.94× the rate
        // spread further, docs/BENCHMARKS.md, session 32). Block and coalesced transfers keep
        // their pieces' plan.
        let chunk_bytes = if msg.blocks.is_none() && o.plan.is_none() && others_on_lanes == 0 {
            crate::plan::spread_chunk_bytes(
                &o.lengths,
                chunk_bytes,
                count,
                self.cfg.spread_min_chunk,
                self.cfg.spread_chunks_per_lane,
            )
        } else {
            chunk_bytes
        };
        let at = *rotor % count;
        let chunks = ChunkPlan::count(&o.lengths, chunk_bytes);
        *rotor = ((u64::from(at) + chunks) % u64::from(count)) as u32;
        let mut first_lane = lanes.start + at;
        if !eager && let Some(lane) = self.routed_offer_lane(peer, &self.out_offers[&offer_id].sources) {
            // A routed pairing: the lane names the source memory; the receiver picks the lanes.
            first_lane = lane;
        }
        let o = self.out_offers.get_mut(&offer_id).expect("present");
        o.chunk_bytes = chunk_bytes;
        o.first_lane = first_lane;
        o.lanes = lanes;
        o.eager = eager;
        msg.chunk_bytes = chunk_bytes;
        msg.first_lane = first_lane;
        if streamed {
            msg.announced = Some(self.start_stream(offer_id));
            self.actions.push_back(Action::Control {
                peer,
                msg: PeerMsg::Header(msg),
            });
            self.start_sending(offer_id);
        } else if eager {
            self.actions.push_back(Action::Control {
                peer,
                msg: PeerMsg::Header(msg),
            });
            self.queue_sends(offer_id);
        } else {
            self.actions.push_back(Action::Control {
                peer,
                msg: PeerMsg::Offer(msg),
            });
        }
    }

    /// Starts a READ: asks each peer holding data for an offer into our buffers.
    pub fn start_read(
        &mut self,
        specs: Vec<ReadSpec>,
        deadline: Instant,
        now: Instant,
    ) -> EngineResult<TransferId> {
        self.refuse_while_draining()?;
        let total = self.check_entries(&specs, 0)?;
        let id = self.new_transfer(TransferKind::Read, total, specs.len(), deadline);
        let deadline_ms = deadline.saturating_duration_since(now).as_millis() as u64;
        // One read request per peer and memory pair (`route_parts.rs`).
        for (peer, idxs) in self.group_by_route(&specs) {
            let read_id = self.next_read;
            self.next_read += 1;
            // A batch of one buffer pair names one local buffer throughout: its key looked up
            // once a run.
            let mut key: Option<(u64, [u8; 16])> = None;
            let pairs: Vec<ReadPair> = idxs
                .iter()
                .map(|&i| {
                    let s = &specs[i];
                    let access_key = match key {
                        Some((b, k)) if b == s.local_buffer => k,
                        _ => {
                            let k = self.buffers[&s.local_buffer].key;
                            key = Some((s.local_buffer, k));
                            k
                        }
                    };
                    ReadPair {
                        source: s.remote.clone(),
                        dest: RemoteRange {
                            buffer_id: s.local_buffer,
                            access_key,
                            offset: s.local_offset,
                            length: s.remote.length,
                        },
                    }
                })
                .collect();
            // What the holder's offer must carry back: the destinations alone.
            let dests: Vec<RemoteRange> = pairs.iter().map(|p| p.dest.clone()).collect();
            let host_dests = self.host_memory(dests.iter().map(|d| d.buffer_id));
            self.actions.push_back(Action::Control {
                peer,
                msg: PeerMsg::ReadRequest {
                    read_id,
                    pairs: pairs.into(),
                    deadline_ms,
                    blocks: None,
                    host_dests,
                },
            });
            self.reads.insert(
                read_id,
                ReadPart {
                    peer,
                    transfer: id,
                    entries: idxs,
                    dests: dests.into(),
                    blocks: None,
                    offer: None,
                    cancelled: false,
                },
            );
            self.add_part(id, read_id, peer);
        }
        self.announce(id, total);
        Ok(id)
    }
}

/// The per-transfer choice, from the receiver's announcement alone (both sides could compute it):
/// eager when the receiver has eager lanes and either no rendezvous lanes (an eager node) or the
/// transfer's `total` bytes are at most its `eager_max`.
pub(super) fn choose_eager(rendezvous: &Range<u32>, eager: &Range<u32>, total: u64, eager_max: u64) -> bool {
    !eager.is_empty() && (rendezvous.is_empty() || total <= eager_max)
}
