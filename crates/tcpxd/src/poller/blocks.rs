//! Block chunks in the poller (docs/BLOCKS.md, "The driver"): the engine's `PostGatherSend`,
//! `PostScatterRecv` and `LandScatter`.
//!
//! - **Sends.** Each send lane keeps a staging ring per memory kind (host memory for host
//!   buffers, device memory on the buffer's GPU for GPU buffers), made on first use:
//!   `send_window + gather_ahead` slots of `chunk_bytes` (the GPU memory a lane's ring costs on
//!   each GPU it sends from), registered once with the lane's comm; a host ring has
//!   `send_window + host_gather_ahead` slots (`transfer.host_gather_ahead`). A gather takes slot
//!   `n % S` of its ring of `S` slots (`n` counts the lane's gathers, one per
//!   `PostGatherSend`). The slot is free again by the time it comes round: the engine posts a
//!   send in pieces of that memory only while fewer than `S` of the lane's sends are posted and
//!   unfinished (it knows each buffer's memory from registration), and sends finish in order,
//!   so when gather `n` comes, the gather `n - S` (and every send before it, plain or staged)
//!   was reported done: the plugin no longer reads the slot and its GPU gather (which the send
//!   waited for) is over. Host: the pieces are copied into the slot at once
//!   (`net::blocks::gather_region`). GPU: the gather, with its table, joins the GPU's batch of
//!   this pass (one launch for up to 16 chunks; the batch takes its tables to device memory
//!   first: `unpack::block_batch`). Either way
//!   the send waits in the lane's queue (`deferred`) until its gather is done and the plugin has
//!   fewer than `send_window` of the lane's sends (`lanes::post_sends`): gathers run a window
//!   ahead of the sends, and the plugin sees no more than it did without them.
//! - **Receives into host memory** land in the lane's host landing ring (`recv_window +
//!   scatter_ahead` slots of `MAX_CHUNK_BYTES`, reserved lazily, never populated; the next free
//!   slot from the ring's turn on, taken until the receive is consumed: the engine never has
//!   more of the lane's receives posted and unconsumed, a receive is consumed only after its
//!   scatter, and scatters that end out of order are consumed out of order) and are scattered once
//!   complete, from the bounce pages or the slot (`RecvComm::scatter_landed`). A direct receive
//!   scattered out of its own slot on a copy helper gives its plugin slot back at once
//!   (`lanes::Wait::Slot`), so the receives posted ahead take the plugin's slots while it is
//!   copied.
//! - **Receives into GPU memory** are posted with the destination buffer's registration as their
//!   data pointer (at offset 0: any in-bounds range of a registered window does). By the ABI
//!   (TCPX_PLUGIN_ABI.md §2) a CUDA receive's payload never lands there: it lands in the
//!   plugin's bounce buffer, and each fragment's `dst_off` is its offset in the request, i.e. in
//!   the chunk. The scatter kernel reads the fragments in place and copies them to the pieces,
//!   in the GPU stage's batch of the pass; `irecvConsumed` follows the batch. (A device landing
//!   ring would cost `recv_window` × 4 MiB of GPU memory per lane for bytes nobody writes.)
//! - **Eager** (`LandScatter`): the credit receive already landed in the lane's landing slots;
//!   host destinations are scattered from there, GPU destinations copied piece by piece through
//!   the stage's host staging buffer.
//!
//! - **Buffers registered by address** (a client's pages, `net::cross_memory`): every chunk,
//!   plain or in pieces, goes this way: a plain `PostSend` / `PostRecv` of such a buffer is
//!   staged as a chunk of one piece ([`whole`]), gathered by `process_vm_readv` into the host
//!   staging ring (the engine posts plain sends only within `send_window`, so the ring's rule
//!   holds) and scattered by `process_vm_writev` from the landing ring or the eager landing
//!   slots. The client's memory gone: a send goes empty and the engine fails its offer
//!   (`Engine::fail_posted_send`); a receive fails its transfer.
//!
//! The pieces come from the engine (`send_pieces` / `recv_pieces`) into one reused vector, which
//! the GPU batches copy from. A query that finds no offer, pieces that do not add up
//! to the chunk, or a bad table fail the receive (or, for a send, the pairing: its FIFO order
//! cannot be kept otherwise) with the reason.

use crate::net::host_copies::{CopyTicket, HostCopies, Place};
use std::collections::HashMap;
use std::sync::Arc;

use super::lane_thread::{LaneThreads, ToLanes};
use super::{RecvLane, RecvLaneState, SendLane, SendLaneState};
use crate::buffers::BufferEntry;
use crate::engine::MAX_CHUNK_BYTES;
use crate::engine::blocks::{Pieces, Segment};
use crate::gpu::DeviceSpan;
use crate::gpu::blocks::{GatherTask, ScatterTask};
use crate::lanes::{GpuStage, Wait, stage_for};
use crate::net::{HostRegion, MemHandle, RecvComm, Region, RequestId};
use crate::unpack::UnpackImpl;

/// The buffer id of a send from a staging slot, or a receive into the host landing ring (no
/// client buffer has it).
pub(super) const STAGED: u64 = u64::MAX - 1;

/// A send waiting for the plugin: from a buffer, or (`buffer == STAGED`) from slot `offset` of
/// the lane's staging ring `ring`, once the GPU batch `gate` (GPU ordinal, batch) or the host
/// copy helper's job `copied` has gathered it.
#[derive(Debug, Clone)]
pub(super) struct SendPost {
    pub buffer: u64,
    pub offset: u64,
    pub len: u32,
    pub ring: usize,
    pub gate: Option<(usize, u64)>,
    pub copied: Option<CopyTicket>,
    /// Where `copied` waits in the helpers' queue ([`Place`]; `Next` when there is no ticket):
    /// `post_sends` moves it up as the lane's window reaches it.
    pub place: Place,
}

impl SendPost {
    pub(super) fn plain(buffer: u64, offset: u64, len: u32) -> SendPost {
        SendPost {
            buffer,
            offset,
            len,
            ring: 0,
            gate: None,
            copied: None,
            place: Place::Next,
        }
    }
}

/// Where a block chunk's received bytes go: pieces of `buffer` (the engine's
/// `recv_pieces(peer, offer, wire, len)`), or, for a plain chunk into a buffer registered by
/// address (staged through the landing ring), the one piece at `direct`.
#[derive(Debug, Clone, Copy)]
pub(super) struct ScatterTo {
    pub buffer: u64,
    pub offer: u64,
    pub wire: u64,
    pub direct: Option<u64>,
}

/// A plain chunk of a buffer as one piece: `len` bytes at `offset` (for buffers registered by
/// address, whose plain chunks go through the staging and landing rings as block chunks do).
pub(super) fn whole(offset: u64, len: u32) -> Segment {
    Segment { offset, wire: 0, len }
}

/// Names a buffer registered by address in an error about its client's pages.
fn client_error(entry: &BufferEntry, e: impl std::fmt::Display) -> String {
    format!(
        "buffer {} ({:?}, registered by address): {e}",
        entry.id, entry.label
    )
}

/// A receive waiting for the plugin: into `buffer` at `offset` (`STAGED`: the host landing
/// ring; `LANDING`: the eager landing slots), scattered afterwards when `scatter` says so, for
/// the chunk of offer `offer` (see `Posted::offer`).
#[derive(Debug, Clone, Copy)]
pub(super) struct RecvPost {
    pub buffer: u64,
    pub offset: u64,
    pub len: u32,
    pub scatter: Option<ScatterTo>,
    pub offer: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Host,
    Gpu(usize),
}

/// A send lane's staging ring of one memory kind.
struct StagingRing {
    kind: Kind,
    /// Its registration on the lane's comm; `None` when the lane thread holds it
    /// (`runtime.lane_thread`).
    mh: Option<MemHandle>,
    /// Its memory (the registration keeps it too).
    region: Arc<dyn Region>,
    slot_bytes: u32,
    /// GPU: the ring's device view.
    span: Option<DeviceSpan>,
}

/// A send lane's staging rings and gather count.
#[derive(Default)]
pub(super) struct SendStaging {
    rings: Vec<StagingRing>,
    seq: u64,
}

impl SendStaging {
    /// The registration a staged send is posted from.
    pub(super) fn handle(&self, ring: usize) -> Option<&MemHandle> {
        self.rings.get(ring).and_then(|r| r.mh.as_ref())
    }

    /// Whether a GPU may still be writing this lane's staging rings.
    pub(super) fn on_gpu(&self) -> bool {
        self.rings.iter().any(|r| r.kind != Kind::Host)
    }
}

/// A receive lane's host landing ring (scattered receives into host memory), which of its slots
/// are taken, and whether it scattered on a GPU (whose kernels read the lane's bounce buffer).
#[derive(Default)]
pub(super) struct RecvScatter {
    landing: Option<MemHandle>,
    seq: u64,
    /// Slot `k` holds a receive posted and not yet consumed (its copies may still read it).
    taken: Vec<bool>,
    gpu: bool,
}

impl RecvScatter {
    pub(super) fn landing(&self) -> Option<&MemHandle> {
        self.landing.as_ref()
    }

    /// The landing slot at byte `offset` is free again: its receive was consumed (its copies
    /// over, or it was dropped).
    pub(super) fn release(&mut self, offset: u64) {
        let k = (offset / u64::from(MAX_CHUNK_BYTES)) as usize;
        if let Some(t) = self.taken.get_mut(k) {
            *t = false;
        }
    }

    /// Landing slots taken (posted receives not yet consumed).
    pub(super) fn taken(&self) -> usize {
        self.taken.iter().filter(|&&t| t).count()
    }

    pub(super) fn on_gpu(&self) -> bool {
        self.gpu
    }
}

/// What the poller's configuration says about slots.
#[derive(Debug, Clone, Copy)]
pub(super) struct Slots {
    /// A send lane's host staging slots: `send_window + host_gather_ahead` (the engine posts no
    /// more sends in pieces from host memory on a lane unfinished).
    pub staging_host: u64,
    /// A send lane's staging slots on a GPU: `send_window + gather_ahead`.
    pub staging_gpu: u64,
    /// A receive lane's host landing slots: `recv_window + scatter_ahead`.
    pub landing: u64,
    pub chunk_bytes: u32,
    /// `send_window`: the sends the plugin gets per lane.
    pub send_window: usize,
}

/// Collects a chunk's pieces into `segs` and checks that they add up to `len`.
pub(super) fn collect(
    pieces: Option<Pieces<'_>>,
    segs: &mut Vec<Segment>,
    what: &str,
    offer: u64,
    wire: u64,
    len: u32,
) -> Result<(), String> {
    segs.clear();
    let pieces = pieces.ok_or_else(|| {
        format!("offer {offer} is gone: no pieces for the {len}-byte chunk {what} at wire offset {wire}")
    })?;
    segs.extend(pieces);
    let sum: u64 = segs.iter().map(|s| u64::from(s.len)).sum();
    if sum != u64::from(len) {
        return Err(format!(
            "the pieces of offer {offer}'s chunk at wire offset {wire} add up to {sum} bytes, the chunk is {len}"
        ));
    }
    Ok(())
}

/// `PostGatherSend`: gathers the chunk (its pieces in `segs`) into the lane's next staging slot
/// and returns the send to queue; with a reason when a buffer registered by address could not be
/// read (its client's memory gone): the send is then empty and its offer must be failed.
#[allow(clippy::too_many_arguments)]
pub(super) fn gather_send(
    lane: &mut SendLane,
    entry: &Arc<BufferEntry>,
    segs: &[Segment],
    len: u32,
    slots: Slots,
    stages: &mut HashMap<usize, GpuStage>,
    unpack_impl: UnpackImpl,
    copies: &HostCopies,
    (lanes, key): (Option<&LaneThreads>, (crate::engine::PeerIdx, u32)),
) -> Result<(SendPost, Option<String>), String> {
    let (outstanding, trace_id) = match &lane.state {
        SendLaneState::Ready(comm) => (comm.outstanding(), comm.trace_id()),
        SendLaneState::Threaded(t) => (t.outstanding, t.trace_id),
        _ => return Err("the lane is not connected".into()),
    };
    let kind = entry.gpu().map_or(Kind::Host, |g| Kind::Gpu(g.ordinal()));
    // The engine's limit for this memory's sends in pieces (host or GPU: the buffer's memory as
    // it was told at registration) is the ring's size, so slot `n % ring_slots` is free.
    let ring_slots = match kind {
        Kind::Host => slots.staging_host,
        Kind::Gpu(_) => slots.staging_gpu,
    };
    let staging = &mut lane.staging;
    let ring = match staging.rings.iter().position(|r| r.kind == kind) {
        Some(i) => i,
        None => {
            let slot_bytes = slots.chunk_bytes;
            let bytes = ring_slots as usize * slot_bytes as usize;
            let (region, span): (Arc<dyn Region>, _) = match entry.gpu() {
                None => (
                    Arc::new(HostRegion::populated(bytes).map_err(|e| format!("staging ring: {e}"))?),
                    None,
                ),
                Some(gpu) => {
                    let r = gpu
                        .alloc(bytes)
                        .map_err(|e| format!("staging ring on GPU {}: {e}", gpu.ordinal()))?;
                    let span = r.span();
                    (Arc::new(r), Some(span))
                }
            };
            let mh = match &lane.state {
                SendLaneState::Ready(comm) => Some(
                    comm.register(region.clone())
                        .map_err(|e| format!("registering the staging ring: {e}"))?,
                ),
                // Registered on the lane thread, before the sends from it it is told of.
                _ => {
                    let lanes = lanes.ok_or("a threaded send lane without the lane thread")?;
                    lanes.send(
                        lane.gpu,
                        ToLanes::Staging {
                            key,
                            epoch: lane.epoch,
                            ring: staging.rings.len(),
                            region: region.clone(),
                        },
                    );
                    None
                }
            };
            tracing::debug!(bytes, ?kind, "send lane staging ring ready");
            staging.rings.push(StagingRing {
                kind,
                mh,
                region,
                slot_bytes,
                span,
            });
            staging.rings.len() - 1
        }
    };
    let r = &mut staging.rings[ring];
    if len > r.slot_bytes {
        return Err(format!(
            "a {len}-byte block chunk does not fit the {}-byte staging slots",
            r.slot_bytes
        ));
    }
    let slot = staging.seq % ring_slots;
    staging.seq += 1;
    // Its place among the helpers' jobs: its lane's next send (nothing of the lane waiting
    // before it, room in the plugin); due when the plugin would take its send as soon as it is
    // gathered (fewer than `send_window` of the lane's sends before it, in the plugin or
    // waiting); else behind, until its lane's window reaches it (`post_sends` moves it up).
    let before = outstanding + lane.deferred.len();
    let place = if before >= slots.send_window {
        Place::Behind
    } else if lane.deferred.is_empty() {
        Place::Next
    } else {
        Place::Due
    };
    tracing::trace!(target: "tcpxd::hop", hop = "poller.gather", len, comm = trace_id);
    let offset = slot * u64::from(r.slot_bytes);
    let mut post = SendPost {
        buffer: STAGED,
        offset,
        len,
        ring,
        gate: None,
        copied: None,
        place: Place::Next,
    };
    if len == 0 {
        return Ok((post, None));
    }
    match (entry.attached, entry.device_region(), r.span) {
        (Some(pages), _, _) => {
            use crate::net::blocks::{ClientGatherError, gather_client};
            match gather_client(
                pages,
                entry.size,
                segs,
                &*r.region,
                offset as usize,
                r.slot_bytes as usize,
            ) {
                Ok(_) => {}
                Err(ClientGatherError::Table(e)) => return Err(client_error(entry, e)),
                // The client's memory failed part way: nothing of the slot leaves (the send
                // goes empty, keeping the lane's order) and the caller fails its offer.
                Err(ClientGatherError::Client(e)) => {
                    post.len = 0;
                    return Ok((post, Some(client_error(entry, e))));
                }
            }
        }
        (None, None, _) => {
            // On a copy helper when there is one: the send waits in the lane's queue for it.
            let (_, ticket) = crate::net::blocks::gather_region_queued(
                &entry.mapped_region()?,
                segs,
                &r.region,
                offset as usize,
                r.slot_bytes as usize,
                copies,
                place,
            )
            .map_err(|e| e.to_string())?;
            if ticket.is_some() {
                post.place = place;
            }
            post.copied = ticket;
        }
        (None, Some(region), Some(ring_span)) => {
            crate::net::blocks::check_table(segs, len, region.len() as u64)
                .map_err(|e| format!("gather: {e}"))?;
            let gpu = region.gpu();
            let stage = stage_for(stages, gpu, unpack_impl)?;
            let dst = ring_span
                .sub(offset, u64::from(r.slot_bytes))
                .map_err(|e| e.to_string())?;
            let task = GatherTask::unplaced(segs.len() as u32, region.span(), dst, len)
                .map_err(|e| e.to_string())?;
            post.gate = Some((gpu.ordinal(), stage.push_gather(task, len, segs)?));
        }
        (None, Some(_), None) => return Err("a GPU buffer's chunk met a host staging ring".into()),
    }
    Ok((post, None))
}

/// `PostScatterRecv`: where the receive is posted.
pub(super) fn scatter_recv(
    lane: &mut RecvLane,
    entry: &Arc<BufferEntry>,
    to: ScatterTo,
    len: u32,
    slots: Slots,
) -> Result<RecvPost, String> {
    if len > MAX_CHUNK_BYTES {
        return Err(format!("a {len}-byte chunk is over {MAX_CHUNK_BYTES} bytes"));
    }
    if entry.gpu().is_some() {
        // The data pointer only anchors the request in a registration (see the module's doc).
        if u64::from(len) > entry.size {
            return Err(format!(
                "a {len}-byte chunk into the {}-byte buffer {}",
                entry.size, entry.id
            ));
        }
        return Ok(RecvPost {
            buffer: to.buffer,
            offset: 0,
            len,
            scatter: Some(to),
            offer: Some(to.offer),
        });
    }
    Ok(RecvPost {
        scatter: Some(to),
        offer: Some(to.offer),
        ..landing_ring_slot(lane, len, slots)?
    })
}

/// A receive of `len` bytes into the next slot of the lane's host landing ring (reserved on
/// first use), with nothing to scatter and no offer: what `PostDropRecv` posts, and what
/// [`scatter_recv`] completes for host memory.
pub(super) fn landing_ring_slot(lane: &mut RecvLane, len: u32, slots: Slots) -> Result<RecvPost, String> {
    let RecvLaneState::Ready(comm) = &lane.state else {
        return Err("the lane is not connected".into());
    };
    let offset = ring_slot(comm, &mut lane.scatter, len, slots.landing)?;
    Ok(RecvPost {
        buffer: STAGED,
        offset,
        len,
        scatter: None,
        offer: None,
    })
}

/// The byte offset of the next free slot of a receive lane's host landing ring (`landing` slots,
/// reserved and registered on `comm` on first use), taken for a receive of `len` bytes: the
/// poller's lanes and the lane threads' (`lane_thread/recv.rs`) share it.
pub(super) fn ring_slot(
    comm: &RecvComm,
    sc: &mut RecvScatter,
    len: u32,
    landing: u64,
) -> Result<u64, String> {
    if len > MAX_CHUNK_BYTES {
        return Err(format!("a {len}-byte chunk is over {MAX_CHUNK_BYTES} bytes"));
    }
    if sc.landing.is_none() {
        let bytes = landing as usize * MAX_CHUNK_BYTES as usize;
        let region = HostRegion::new(bytes).map_err(|e| format!("landing ring: {e}"))?;
        sc.landing = Some(
            comm.register(Arc::new(region))
                .map_err(|e| format!("registering the landing ring: {e}"))?,
        );
        tracing::debug!(bytes, "receive lane landing ring reserved");
    }
    // The next free slot from the ring's turn on: receives are consumed as their copies end,
    // in any order (`lanes::RecvQueue::consume_ready`), and the engine posts no more than the
    // ring's slots unconsumed, so one is free.
    let n = landing as usize;
    sc.taken.resize(n, false);
    let from = (sc.seq % landing) as usize;
    let Some(slot) = (0..n).map(|k| (from + k) % n).find(|&k| !sc.taken[k]) else {
        return Err(format!("every one of the lane's {n} landing slots is taken"));
    };
    sc.taken[slot] = true;
    sc.seq = slot as u64 + 1;
    Ok(slot as u64 * u64::from(MAX_CHUNK_BYTES))
}

/// A completed block-chunk receive (`segs`: its pieces): scattered on the host now, or pushed
/// into its GPU's scatter batch. `scatter`: the lane's scatter state.
#[allow(clippy::too_many_arguments)]
pub(super) fn start_scatter(
    comm: &RecvComm,
    id: RequestId,
    to: ScatterTo,
    len: u32,
    segs: &[Segment],
    entry: Option<&Arc<BufferEntry>>,
    stages: &mut HashMap<usize, GpuStage>,
    unpack_impl: UnpackImpl,
    copies: &HostCopies,
    scatter: &mut RecvScatter,
) -> Wait {
    let Some(entry) = entry else {
        let _ = comm.zero_posted(id, len as usize);
        return Wait::Ready(Err(format!("buffer {} vanished", to.buffer)));
    };
    if entry.attached.is_some() {
        return Wait::Ready(scatter_to_client(comm, id, entry, segs, len));
    }
    let Some(region) = entry.device_region() else {
        // On a copy helper when there is one: the receive is consumed once it is done.
        let host = match entry.mapped_region() {
            Ok(r) => r,
            Err(why) => {
                let _ = comm.zero_posted(id, len as usize);
                return Wait::Ready(Err(why));
            }
        };
        // A direct receive in the landing ring: its plugin slot may go back before the copy
        // is over (`Wait::Slot`), while the landing slot stays this receive's until it is.
        let in_place = comm.landed_in_place(id).unwrap_or(false);
        return match comm.scatter_landed_queued(id, segs, len, &host, copies) {
            Ok((_, Some(ticket))) if in_place => Wait::Slot(ticket),
            Ok((_, Some(ticket))) => Wait::Host(ticket),
            Ok((_, None)) => Wait::Ready(Ok(())),
            Err(e) => Wait::Ready(Err(e.to_string())),
        };
    };
    let gpu = region.gpu().clone();
    let r = (|| -> Result<Option<u64>, String> {
        let (ring, q) = comm.completed(id).map_err(|e| e.to_string())?;
        let frags = ring.fragments(q).map_err(|e| e.to_string())?;
        if frags.is_empty() {
            // Nothing landed (an emptied chunk): nothing to scatter, as for plain receives.
            return Ok(None);
        }
        let stage = stage_for(stages, &gpu, unpack_impl)?;
        stage.reach_bounce(ring.bounce_device())?;
        let bounce = ring.bounce_span(frags);
        crate::unpack::validate_list(frags, bounce.len(), u64::from(len), true)
            .map_err(|e| format!("scatter: {e}"))?;
        crate::net::blocks::check_table(segs, len, region.len() as u64)
            .map_err(|e| format!("scatter: {e}"))?;
        let list = ring.fragment_list(q).map_err(|e| e.to_string())?;
        let frag_span = list
            .device_span()
            .ok_or("the fragment list has no device view for the scatter kernel")?;
        let task = ScatterTask::unplaced(
            frag_span,
            frags.len() as u32,
            bounce,
            segs.len() as u32,
            len,
            region.span(),
        )
        .map_err(|e| e.to_string())?;
        scatter.gpu = true;
        stage.push_scatter(task, frags.len() as u32, segs).map(Some)
    })();
    match r {
        Ok(Some(batch)) => Wait::Gpu {
            gpu: gpu.ordinal(),
            batch,
            len,
        },
        Ok(None) => Wait::Ready(Ok(())),
        Err(e) => Wait::Ready(Err(e)),
    }
}

/// A completed receive (landed in a landing slot) scattered to the pieces `segs` of a buffer
/// registered by address: written into its client's pages.
pub(super) fn scatter_to_client(
    comm: &RecvComm,
    id: RequestId,
    entry: &BufferEntry,
    segs: &[Segment],
    len: u32,
) -> Result<(), String> {
    let Some(pages) = entry.attached else {
        return Err(format!("buffer {} is not registered by address", entry.id));
    };
    comm.scatter_landed_to_client(id, segs, len, pages, entry.size)
        .map(|_| ())
        .map_err(|e| client_error(entry, e))
}

/// `LandScatter`: an eager credit receive (in the lane's landing slots) to the pieces `segs`.
#[allow(clippy::too_many_arguments)]
pub(super) fn land_scatter(
    comm: &RecvComm,
    id: RequestId,
    entry: &Arc<BufferEntry>,
    len: u32,
    segs: &[Segment],
    stages: &mut HashMap<usize, GpuStage>,
    unpack_impl: UnpackImpl,
    copies: &HostCopies,
) -> Result<(), String> {
    if entry.attached.is_some() {
        return scatter_to_client(comm, id, entry, segs, len);
    }
    let Some(region) = entry.device_region() else {
        return comm
            .scatter_landed(id, segs, len, &*entry.mapped_region()?, copies)
            .map(|_| ())
            .map_err(|e| e.to_string());
    };
    crate::net::blocks::check_table(segs, len, region.len() as u64).map_err(|e| format!("scatter: {e}"))?;
    let stage = stage_for(stages, region.gpu(), unpack_impl)?;
    let staging = stage.host_staging(len as usize);
    match comm.land_into(id, staging) {
        Ok(n) if n == len as usize => {}
        Ok(n) => return Err(format!("chunk landed {n} of {len} bytes")),
        Err(e) => return Err(e.to_string()),
    }
    for s in segs {
        let w = s.wire as usize;
        region
            .write(s.offset, &staging[w..w + s.len as usize])
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}
