//! Credits at any size on GPU lanes, and the rule that keeps a large transfer from starving
//! small ones.
//!
//! - **GPU credits.** On TCPX a CUDA receive's payload never lands where it was posted: it lands
//!   in the GPU's bounce pages and the unpack decides where it goes (docs/ARCHITECTURE.md, "What
//!   a CUDA receive may name"). So a receiver whose credit receives are CUDA receives (the driver
//!   posts them into one small landing registration on the lane's GPU: `gpu_credits`) can take a
//!   transfer of any size into its GPU memory by credits: header then data, no offer and accept.
//!   It says so to each peer before its `ReceiveMode` ([`PeerMsg::GpuCredits`]): its byte budget
//!   per credit lane and which of its buffers are GPU memory (again for each GPU buffer
//!   registered later). Its credit receives are then `chunk_bytes` each.
//! - **The sender's choice.** A transfer whose destinations are all buffers the receiver named,
//!   in plain ranges (no block or coalesced plan), goes by credits at any size; anything else
//!   follows auto's size rule (`start.rs`).
//! - **Bytes.** Besides one credit, each send spends its length from the lane's byte budget
//!   (un-consumed bytes the receiver holds in bounce pages); a returned credit gives back the
//!   length of the lane's oldest unreturned send (the receiver consumes in lane order), so the
//!   wire carries counts only.
//! - **No starvation.** A lane is matched FIFO: a header's chunks take their places in the lane
//!   order when it is announced. So a transfer larger than the receiver's `eager_max_bytes` is
//!   *streamed*: its header announces only the chunks that fit now ([`Offer::announced`]) and
//!   [`PeerMsg::MoreChunks`] the next ones as credits come back, each chunk only while, after the
//!   chunks already waiting on its lane, more than a quarter of the lane's credits and byte budget
//!   stay free. A small transfer may use every credit. So a small transfer's chunks are never more
//!   than three quarters of a lane's credits behind a large one's, and always find credits: a large
//!   transfer cannot starve small ones, and two large ones share the lane in turns of what fits.

use super::*;

/// The most GPU buffers of one peer a sender remembers (more are ignored: those transfers take
/// auto's size rule).
pub const MAX_GPU_DESTS: usize = 1 << 16;

/// A `GpuCredits` buffer whose GPU ordinal is not known: accepted from a peer (host routes for
/// it); this engine always names the ordinal.
pub const GPU_NOT_KNOWN: u32 = u32::MAX;

/// A streamed header on the sending side: where its chunk plan stands.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stream {
    cursor: ChunkCursor,
    announced: u64,
    total: u64,
}

/// A streamed header on the receiving side: its plan's inputs and where it stands.
#[derive(Debug, Clone)]
pub(crate) struct InStream {
    lengths: Vec<u64>,
    chunk_bytes: u32,
    lanes: Range<u32>,
    cursor: ChunkCursor,
    announced: u64,
}

/// Where one announced chunk goes, from its transfer's destinations (none: refused, discarded).
pub(super) fn target_of(
    offer: u64,
    dests: &[(u64, u64)],
    plan: Option<&blocks::SidePlan>,
    c: &Chunk,
) -> Target {
    if dests.is_empty() {
        return Target {
            offer,
            dest: None,
            len: c.len,
            pieces: false,
        };
    }
    let item = coalesce::chunk_item(offer, dests, plan, c);
    Target {
        offer,
        dest: Some((item.buffer, item.offset)),
        len: c.len,
        pieces: item.pieces,
    }
}

impl Engine {
    /// This node lands credit receives in GPU memory (auto with `gpu_credits`).
    pub(super) fn gpu_credits(&self) -> bool {
        self.cfg.gpu_credits && self.cfg.protocol == Protocol::Auto
    }

    /// The byte budget this node announces per credit lane.
    pub(super) fn own_budget(&self) -> u64 {
        match self.cfg.credit_budget_bytes {
            0 => u64::from(self.cfg.credits) * u64::from(self.cfg.chunk_bytes),
            b => b,
        }
    }

    /// Tells every live peer, with `gpu_credits`, that buffer `id` is memory of GPU `gpu`: its
    /// transfers into the buffer may take credits at any size (`set_buffer_memory`).
    pub(super) fn announce_gpu_buffer(&mut self, id: u64, gpu: u32) {
        if !self.gpu_credits() {
            return;
        }
        let budget_bytes = self.own_budget();
        for (&peer, p) in self.peers.iter() {
            if !p.gone() && !p.recv_split().1.is_empty() {
                self.actions.push_back(Action::Control {
                    peer,
                    msg: PeerMsg::GpuCredits {
                        budget_bytes,
                        buffer_ids: vec![id],
                        buffer_gpus: vec![gpu],
                    },
                });
            }
        }
    }

    /// Before the `ReceiveMode` to a new peer: this node's GPU credits and GPU buffers.
    pub(super) fn announce_gpu_credits(&mut self, peer: PeerIdx) {
        if !self.gpu_credits() || self.peers[&peer].recv_split().1.is_empty() {
            return;
        }
        let mut buffers: Vec<(u64, u32)> = self
            .buffers
            .iter()
            .filter_map(|(&id, b)| match b.memory {
                topology::Memory::Gpu(g) => Some((id, g)),
                topology::Memory::Host => None,
            })
            .collect();
        buffers.sort_unstable();
        let (buffer_ids, buffer_gpus) = buffers.into_iter().unzip();
        self.actions.push_back(Action::Control {
            peer,
            msg: PeerMsg::GpuCredits {
                budget_bytes: self.own_budget(),
                buffer_ids,
                buffer_gpus,
            },
        });
    }

    pub(super) fn on_gpu_credits(
        &mut self,
        peer: PeerIdx,
        budget_bytes: u64,
        buffer_ids: Vec<u64>,
        buffer_gpus: Vec<u32>,
    ) {
        let p = &mut self.peers[&peer];
        if !buffer_gpus.is_empty() && buffer_gpus.len() != buffer_ids.len() {
            let why = format!(
                "GpuCredits: {} GPU ordinals for {} buffers",
                buffer_gpus.len(),
                buffer_ids.len()
            );
            return self.on_peer_failed(peer, &format!("protocol violation: {why}"));
        }
        if let Some(b) = p.remote_gpu_budget
            && b != budget_bytes
        {
            let why = format!("GpuCredits: budget {budget_bytes} bytes after {b}");
            return self.on_peer_failed(peer, &format!("protocol violation: {why}"));
        }
        p.remote_gpu_budget = Some(budget_bytes);
        for (i, id) in buffer_ids.into_iter().enumerate() {
            if p.gpu_dests.len() >= MAX_GPU_DESTS {
                break;
            }
            let gpu = buffer_gpus.get(i).copied().filter(|&g| g != GPU_NOT_KNOWN);
            p.gpu_dests.insert(id, gpu);
        }
        for lane in 0..p.send.len() as u32 {
            if p.send_lane_eager(lane) {
                p.send[lane as usize].send_credits.set_budget(budget_bytes);
            }
        }
    }

    /// Whether a transfer to `peer` of these ranges may take credits at any size: the peer lands
    /// credits in GPU memory and said every destination buffer is GPU memory, and the transfer
    /// is plain ranges (`planned`: a block or coalesced plan, scattered by pieces, is not).
    pub(super) fn credits_at_any_size(p: &Peer, ranges: &Ranges, planned: bool) -> bool {
        p.remote_gpu_budget.is_some()
            && !planned
            && !ranges.is_empty()
            && ranges.buffers().all(|b| p.gpu_dests.contains_key(&b))
    }

    /// Starts streaming an eager offer just chosen (`send_offer`): queues the chunks that fit
    /// now, returns how many (the header announces them).
    pub(super) fn start_stream(&mut self, offer_id: u64) -> u64 {
        let o = self.out_offers.get_mut(&offer_id).expect("present");
        let plan = ChunkPlan::new(&o.lengths, o.chunk_bytes, o.first_lane, o.lanes.clone());
        o.stream = Some(Stream {
            cursor: plan.cursor(),
            announced: 0,
            total: ChunkPlan::count(&o.lengths, o.chunk_bytes),
        });
        let peer = o.peer;
        let n = self.announce_next(offer_id);
        if self.out_offers[&offer_id].stream.is_some() {
            self.peers[&peer].streams.push_back(offer_id);
        }
        n
    }

    /// Queues the next chunks of a streamed offer that fit its lanes now (the rule in the
    /// module's documentation); returns how many. The stream ends once every chunk is queued.
    fn announce_next(&mut self, offer_id: u64) -> u64 {
        let Some(o) = self.out_offers.get_mut(&offer_id) else {
            return 0;
        };
        let Some(mut s) = o.stream else {
            return 0;
        };
        let Some(p) = self.peers.get_mut(&o.peer) else {
            return 0;
        };
        let mut plan = ChunkPlan::resume(&o.lengths, o.chunk_bytes, o.lanes.clone(), s.cursor);
        let mut n = 0;
        while s.announced + n < s.total {
            let Some(c) = plan.clone().next() else { break };
            let l = &mut p.send[c.lane as usize];
            let len = if o.cancelled { 0 } else { c.len };
            let queued_bytes = l.queue.iter().map(|i| u64::from(i.len)).sum();
            if !l.send_credits.room_for_large(l.queue.len(), queued_bytes, len) {
                break;
            }
            plan.next();
            let mut item = coalesce::chunk_item(offer_id, &o.sources, o.plan.as_ref(), &c);
            if o.cancelled {
                // A cancelled offer still meets every receive its header announces, empty.
                item.empty();
            }
            l.queue.push_back(item);
            p.send_used.mark(c.lane);
            n += 1;
        }
        s.cursor = plan.cursor();
        s.announced += n;
        o.unfinished += n;
        o.stream = (s.announced < s.total).then_some(s);
        n
    }

    /// Credits came back (or a streamed offer was cancelled): each streamed offer of the peer,
    /// oldest first, announces the chunks that now fit (`MoreChunks`) and queues them.
    pub(super) fn stream_more(&mut self, peer: PeerIdx) {
        let Some(p) = self.peers.get(&peer).filter(|p| !p.gone()) else {
            return;
        };
        let ids: Vec<u64> = p.streams.iter().copied().collect();
        for offer_id in ids {
            let count = self.announce_next(offer_id);
            if count > 0 {
                self.actions.push_back(Action::Control {
                    peer,
                    msg: PeerMsg::MoreChunks { offer_id, count },
                });
            }
            let o = self.out_offers.get(&offer_id);
            if o.is_none_or(|o| o.stream.is_none()) {
                self.peers[&peer].streams.retain(|&id| id != offer_id);
                if let Some(o) = o
                    && o.unfinished == 0
                    && o.cancelled
                {
                    self.drop_out_offer(offer_id);
                }
            }
        }
    }

    /// The receiver's side of a header: lays out its first `count` chunks (all of them unless
    /// streamed) on the lanes, after every chunk announced before. Returns the transfer's chunk
    /// count and, when chunks remain to be announced, where its plan stands.
    pub(super) fn lay_out_header(
        &mut self,
        peer: PeerIdx,
        offer: &Offer,
        dests: &[(u64, u64)],
        plan: Option<&blocks::SidePlan>,
        lanes: Range<u32>,
    ) -> (u64, Option<Box<InStream>>) {
        let lengths = Self::wire_lengths(offer);
        let total = ChunkPlan::count(&lengths, offer.chunk_bytes);
        let count = offer.announced.unwrap_or(total).min(total);
        let p = &mut self.peers[&peer];
        let mut chunks = ChunkPlan::new(&lengths, offer.chunk_bytes, offer.first_lane, lanes.clone());
        for c in chunks.by_ref().take(count as usize) {
            p.recv_used.mark(c.lane);
            p.recv[c.lane as usize]
                .targets
                .push_back(target_of(offer.offer_id, dests, plan, &c));
        }
        let cursor = chunks.cursor();
        let stream = (count < total).then(|| {
            Box::new(InStream {
                lengths,
                chunk_bytes: offer.chunk_bytes,
                lanes,
                cursor,
                announced: count,
            })
        });
        (total, stream)
    }

    /// The next `count` chunks of a streamed header: laid out after every chunk announced
    /// before. A count the header's plan does not have, or for a transfer not streaming, loses
    /// the lane order: the pairing fails.
    pub(super) fn on_more_chunks(&mut self, peer: PeerIdx, offer_id: u64, count: u64) {
        let Some(o) = self.in_offers.get_mut(&(peer, offer_id)) else {
            return self.on_peer_failed(
                peer,
                &format!("protocol violation: MoreChunks for transfer {offer_id}, which is not streaming"),
            );
        };
        let total = o.chunks_total;
        let InOffer {
            stream, dests, plan, ..
        } = o;
        let Some(s) = stream.as_mut() else {
            return self.on_peer_failed(
                peer,
                &format!("protocol violation: MoreChunks for transfer {offer_id}, every chunk announced"),
            );
        };
        if count == 0 || s.announced.saturating_add(count) > total {
            let why = format!(
                "MoreChunks of {count} for transfer {offer_id}: {} of {total} chunks announced",
                s.announced
            );
            return self.on_peer_failed(peer, &format!("protocol violation: {why}"));
        }
        let p = self.peers.get_mut(&peer).expect("live");
        let mut chunks = ChunkPlan::resume(&s.lengths, s.chunk_bytes, s.lanes.clone(), s.cursor);
        for c in chunks.by_ref().take(count as usize) {
            p.recv_used.mark(c.lane);
            p.recv[c.lane as usize]
                .targets
                .push_back(target_of(offer_id, dests, plan.as_ref(), &c));
        }
        s.cursor = chunks.cursor();
        s.announced += count;
        let lanes = s.lanes.clone();
        if s.announced == total {
            *stream = None;
        }
        for lane in lanes {
            self.match_landed(peer, lane);
        }
    }
}
