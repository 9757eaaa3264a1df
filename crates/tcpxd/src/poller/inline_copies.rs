//! Inline transfers' GPU copies off the poller's thread (engine `inline.rs`, "GPU copies off the
//! driver's thread"). A sender's GPU pieces are copied device → host asynchronously into pinned
//! staging the poller owns, an event recorded on each GPU's stream; a receiver's GPU pieces are
//! written into staging and copied host → device the same way. The poller's passes query the
//! events (`finish_inline_copies`, from `test_lanes`); when a job's events are all done its
//! payload is framed and sent (`Engine::on_inline_gathered` says whether), or its landing is
//! reported (`Engine::on_inline_landed`: `Done` and the notification come after the bytes are
//! in place). Several jobs run at once, on a few streams per GPU, so eight transfers in flight
//! overlap their copies instead of queueing behind one synchronous copy each.
//!
//! The staging is one pinned allocation of `transfer.inline_window_bytes` (at least
//! `transfer.inline_max_bytes`), made with the first GPU buffer (`prepare_inline_copies`; else at
//! the first GPU inline copy) and handed out in
//! [`GRANULE`]s; a job is freed from it only after its events completed. When it is full (several
//! pairings' windows at once) or cannot be made, a transfer's copy is synchronous, as before:
//! nothing ever waits for staging. So it is on a GPU whose streams or events for these copies
//! cannot be made: the failure is remembered for that GPU (logged once, with the CUDA error),
//! and its transfers' copies stay synchronous instead of each failing and making them again. Each job holds its buffers (`Arc<BufferEntry>`) until its
//! copies ended, besides the engine's use counts, so memory is never freed under a copy. Host
//! memory is copied synchronously (a `memcpy` of a few KiB costs less than an event).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::Poller;
use crate::buffers::{self, BufferEntry};
use crate::engine::{Offer, PeerIdx, PeerMsg};
use crate::gpu::{DeviceRegion, Event, EventPool, Gpu, PinnedRegion, Stream, StreamPool};

/// The staging's allocation unit.
const GRANULE: usize = 1024;
/// Streams per GPU the inline copies rotate over (one per job).
const STREAMS_PER_GPU: usize = 4;

/// A job's piece of staging: its first granule and granule count.
#[derive(Debug, Clone, Copy)]
struct Slot {
    first: usize,
    granules: usize,
}

impl Slot {
    fn offset(&self) -> u64 {
        (self.first * GRANULE) as u64
    }
}

/// Pinned host memory for the copies in flight, in granules.
struct Staging {
    region: PinnedRegion,
    granules: Granules,
}

/// Which granules of the staging are taken: first fit, runs given back whole.
#[derive(Debug)]
struct Granules {
    used: Vec<bool>,
}

impl Granules {
    fn new(count: usize) -> Granules {
        Granules {
            used: vec![false; count],
        }
    }

    /// First fit of `bytes` (at least one granule), or `None` when no run is free.
    fn take(&mut self, bytes: usize) -> Option<Slot> {
        let granules = bytes.div_ceil(GRANULE).max(1);
        let mut run = 0;
        for i in 0..self.used.len() {
            run = if self.used[i] { 0 } else { run + 1 };
            if run == granules {
                let first = i + 1 - granules;
                self.used[first..=i].fill(true);
                return Some(Slot { first, granules });
            }
        }
        None
    }

    fn give(&mut self, slot: Slot) {
        self.used[slot.first..slot.first + slot.granules].fill(false);
    }
}

/// One GPU's streams and events for inline copies.
struct Copier {
    streams: StreamPool,
    events: EventPool,
    /// Round-robin over `streams`, one per job.
    next: usize,
}

/// A job's copies on one GPU: the event recorded after them.
struct Wait {
    gpu: usize,
    event: Event,
}

/// What a job's copies were for.
enum Purpose {
    /// A sender's payload: the GPU pieces land in staging (`pieces`: payload offset, staging
    /// offset, length), the host pieces are in `payload` already.
    Gather {
        peer: PeerIdx,
        offer: Offer,
        payload: Vec<u8>,
        pieces: Vec<(usize, u64, usize)>,
    },
    /// A receiver's landing of `len` bytes of `offer` from `peer`.
    Land { peer: PeerIdx, offer: u64, len: u64 },
}

struct Job {
    purpose: Purpose,
    slot: Slot,
    waits: Vec<Wait>,
    /// Set when enqueuing a copy failed: reported when the copies already queued ended.
    fault: Option<String>,
    /// The buffers the copies read or write, alive until they ended.
    _keep: Vec<Arc<BufferEntry>>,
}

/// The poller's inline copies in flight, its staging and per-GPU streams.
#[derive(Default)]
pub(super) struct InlineCopies {
    staging: Option<Staging>,
    /// Making the staging failed once: every copy stays synchronous.
    no_staging: bool,
    copiers: HashMap<usize, Copier>,
    /// GPUs (ordinals) whose streams or events could not be made: their copies stay synchronous.
    no_copier: HashSet<usize>,
    jobs: Vec<Job>,
}

impl InlineCopies {
    /// Whether no copy is in flight.
    pub(super) fn is_idle(&self) -> bool {
        self.jobs.is_empty()
    }

    /// Makes the staging (`size` bytes, on `gpu`) unless made, or failed, before.
    fn ensure_staging(&mut self, gpu: &Arc<Gpu>, size: usize) {
        if self.staging.is_some() || self.no_staging {
            return;
        }
        let size = size.div_ceil(GRANULE) * GRANULE;
        match gpu.alloc_pinned(size) {
            Ok(region) => {
                self.staging = Some(Staging {
                    region,
                    granules: Granules::new(size / GRANULE),
                })
            }
            Err(e) => {
                tracing::warn!("inline GPU copies stay synchronous: no pinned staging: {e}");
                self.no_staging = true;
            }
        }
    }

    /// A slot of `bytes` of staging (made on `gpu` at first use, `size` bytes); `None`: copy
    /// synchronously.
    fn slot(&mut self, gpu: &Arc<Gpu>, size: usize, bytes: usize) -> Option<Slot> {
        self.ensure_staging(gpu, size);
        let slot = self.staging.as_mut()?.granules.take(bytes);
        if slot.is_none() {
            tracing::debug!(bytes, "inline GPU copy synchronous: the staging is full");
        }
        slot
    }

    /// `gpu`'s streams and events, made at first use; `None` when they could not be (then, or
    /// before: a failure is logged once and remembered, and the GPU's copies stay synchronous).
    fn copier(&mut self, gpu: &Arc<Gpu>) -> Option<&mut Copier> {
        let ordinal = gpu.ordinal();
        if self.no_copier.contains(&ordinal) {
            return None;
        }
        match self.copiers.entry(ordinal) {
            std::collections::hash_map::Entry::Occupied(o) => Some(o.into_mut()),
            std::collections::hash_map::Entry::Vacant(v) => {
                let made = StreamPool::new(gpu, STREAMS_PER_GPU)
                    .and_then(|streams| Ok((streams, EventPool::new(gpu, 8)?)));
                match made {
                    Ok((streams, events)) => Some(v.insert(Copier {
                        streams,
                        events,
                        next: 0,
                    })),
                    Err(e) => {
                        tracing::warn!(
                            "inline GPU copies on GPU {ordinal} stay synchronous: its streams or events cannot be made: {e}"
                        );
                        self.no_copier.insert(ordinal);
                        None
                    }
                }
            }
        }
    }

    /// Whether every GPU of `keep`'s GPU pieces has its streams and events (made here at first
    /// use): else the caller copies synchronously, before taking any staging.
    fn copiers_for(&mut self, keep: &[Arc<BufferEntry>]) -> bool {
        keep.iter().all(|entry| match piece(entry) {
            Piece::Gpu(region) => self.copier(region.gpu()).is_some(),
            Piece::Host(_) => true,
        })
    }

    /// A stream of `gpu` for a job's copies, round-robin: the GPU's ordinal and the stream's
    /// index.
    fn pick(&mut self, gpu: &Arc<Gpu>) -> Result<(usize, usize), String> {
        let c = self
            .copier(gpu)
            .ok_or_else(|| format!("GPU {}: no streams for inline copies", gpu.ordinal()))?;
        c.next = c.next.wrapping_add(1);
        Ok((gpu.ordinal(), c.next % c.streams.len()))
    }

    /// Queues a copy on stream `k` of GPU `gpu` (picked by [`InlineCopies::pick`]) with the
    /// staging region.
    fn queue(
        &self,
        (gpu, k): (usize, usize),
        copy: impl FnOnce(&Stream, &PinnedRegion) -> crate::gpu::GpuResult<()>,
    ) -> Result<(), String> {
        let stream = self.copiers[&gpu].streams.get(k);
        let staging = &self.staging.as_ref().expect("a slot was taken").region;
        copy(stream, staging).map_err(|e| format!("GPU: {e}"))
    }

    /// Records an event after the copies queued on each of `streams`; a failed record waits
    /// for its stream instead and is the job's fault.
    fn record_all(&mut self, streams: &[(usize, usize)], fault: &mut Option<String>) -> Vec<Wait> {
        let mut waits = Vec::with_capacity(streams.len());
        for &(gpu, k) in streams {
            let copier = self.copiers.get_mut(&gpu).expect("picked");
            let event = match copier.events.take() {
                Ok(e) => e,
                Err(e) => {
                    let _ = copier.streams.get(k).synchronize();
                    fault.get_or_insert(format!("GPU: {e}"));
                    continue;
                }
            };
            let stream = copier.streams.get(k);
            if let Err(e) = stream.record(&event) {
                let _ = stream.synchronize();
                copier.events.put(event);
                fault.get_or_insert(format!("GPU: {e}"));
                continue;
            }
            waits.push(Wait { gpu, event });
        }
        waits
    }

    /// Job `i` if its copies ended (`None`: not yet), taken out with their result, its events
    /// back in their pools (its slot is the caller's to free).
    fn ended(&mut self, i: usize) -> Option<(Job, Result<(), String>)> {
        let mut result = Ok(());
        for w in &self.jobs[i].waits {
            match w.event.is_done() {
                Ok(true) => {}
                Ok(false) => return None,
                Err(e) => result = Err(format!("GPU copy: {e}")),
            }
        }
        let mut job = self.jobs.swap_remove(i);
        if let Some(f) = job.fault.take() {
            result = Err(f);
        }
        for w in job.waits.drain(..) {
            if let Some(c) = self.copiers.get_mut(&w.gpu) {
                c.events.put(w.event);
            }
        }
        Some((job, result))
    }
}

impl Drop for InlineCopies {
    fn drop(&mut self) {
        // No staging or buffer may go while a copy still touches it.
        for job in &self.jobs {
            for w in &job.waits {
                let _ = w.event.synchronize();
            }
        }
    }
}

/// Where one piece of an inline payload lies on this node.
enum Piece<'a> {
    /// Host memory (or a client's pages): copied synchronously.
    Host(&'a BufferEntry),
    Gpu(&'a Arc<DeviceRegion>),
}

fn piece(entry: &BufferEntry) -> Piece<'_> {
    match (entry.attached.is_none(), entry.device_region()) {
        (true, Some(region)) => Piece::Gpu(region),
        _ => Piece::Host(entry),
    }
}

impl Poller {
    /// Staging bytes the inline copies may hold: the pairing's inline window, at least one
    /// transfer of the largest inline size.
    fn inline_staging_bytes(&self) -> usize {
        let c = self.engine.config();
        c.inline_window_bytes.max(c.inline_max_bytes) as usize
    }

    /// Makes `gpu`'s streams and events and the staging before the first inline GPU copy needs
    /// them (at a GPU's first buffer: a pinned allocation costs far more than a small copy).
    pub(super) fn prepare_inline_copies(&mut self, gpu: &Arc<Gpu>) {
        if self.engine.config().inline_max_bytes == 0 {
            return;
        }
        let size = self.inline_staging_bytes();
        // (a failure is logged and remembered there)
        let _ = self.inline_copies.copier(gpu);
        self.inline_copies.ensure_staging(gpu, size);
    }

    /// `SendInline` with GPU sources: the payload's GPU pieces copied out asynchronously, the
    /// message sent by [`Poller::finish_inline_copies`] once they ended. The offer given back
    /// (nothing started): the caller copies synchronously (no staging free, a source gone).
    pub(super) fn gather_async(
        &mut self,
        peer: PeerIdx,
        offer: Offer,
        sources: &[(u64, u64, u64)],
    ) -> Option<Offer> {
        let Some((keep, gpu, gpu_bytes)) = self.gpu_pieces(sources) else {
            return Some(offer);
        };
        if !self.inline_copies.copiers_for(&keep) {
            return Some(offer);
        }
        let size = self.inline_staging_bytes();
        let Some(slot) = self.inline_copies.slot(&gpu, size, gpu_bytes) else {
            return Some(offer);
        };
        let total: u64 = sources.iter().map(|s| s.2).sum();
        let mut payload = vec![0u8; total as usize];
        let mut pieces = Vec::new();
        let mut streams: Vec<(usize, usize)> = Vec::new();
        let mut fault = None;
        let (mut at, mut staged) = (0usize, slot.offset());
        for (&(_, offset, len), entry) in sources.iter().zip(&keep) {
            let n = len as usize;
            let r = match piece(entry) {
                Piece::Host(entry) => buffers::read_into(entry, offset, &mut payload[at..at + n]),
                Piece::Gpu(region) => {
                    let queued = self.job_stream(region.gpu(), &mut streams).and_then(|s| {
                        self.inline_copies.queue(s, |stream, staging| {
                            stream.copy_d2h(staging, staged, region, offset, len)
                        })
                    });
                    if queued.is_ok() {
                        pieces.push((at, staged, n));
                        staged += len;
                    }
                    queued
                }
            };
            at += n;
            if let Err(why) = r {
                fault = Some(why);
                break;
            }
        }
        let waits = self.inline_copies.record_all(&streams, &mut fault);
        self.inline_copies.jobs.push(Job {
            purpose: Purpose::Gather {
                peer,
                offer,
                payload,
                pieces,
            },
            slot,
            waits,
            fault,
            _keep: keep,
        });
        None
    }

    /// `LandInline` with GPU destinations (the transfer still lands here): host pieces written
    /// at once, GPU pieces through staging asynchronously, the landing reported by
    /// [`Poller::finish_inline_copies`] once they ended. `Err` (nothing started, the payload
    /// given back): the caller lands it synchronously.
    pub(super) fn land_async(
        &mut self,
        peer: PeerIdx,
        offer: u64,
        dests: &[(u64, u64, u64)],
        payload: Vec<u8>,
    ) -> Result<(), Vec<u8>> {
        let covered = dests.iter().map(|d| d.2).sum::<u64>() == payload.len() as u64;
        let Some((keep, gpu, gpu_bytes)) = self.gpu_pieces(dests).filter(|_| covered) else {
            return Err(payload);
        };
        if !self.inline_copies.copiers_for(&keep) {
            return Err(payload);
        }
        let size = self.inline_staging_bytes();
        let Some(slot) = self.inline_copies.slot(&gpu, size, gpu_bytes) else {
            return Err(payload);
        };
        let mut streams: Vec<(usize, usize)> = Vec::new();
        let mut fault = None;
        let (mut at, mut staged) = (0usize, slot.offset());
        for (&(_, offset, len), entry) in dests.iter().zip(&keep) {
            let src = &payload[at..at + len as usize];
            at += len as usize;
            let r = match piece(entry) {
                Piece::Host(entry) => buffers::write_from(entry, offset, src),
                Piece::Gpu(region) => {
                    let r = self.stage_h2d(region, offset, staged, src, &mut streams);
                    staged += len;
                    r
                }
            };
            if let Err(why) = r {
                fault = Some(format!("landing the inline transfer: {why}"));
                break;
            }
        }
        let waits = self.inline_copies.record_all(&streams, &mut fault);
        self.inline_copies.jobs.push(Job {
            purpose: Purpose::Land {
                peer,
                offer,
                len: payload.len() as u64,
            },
            slot,
            waits,
            fault,
            _keep: keep,
        });
        Ok(())
    }

    /// Writes `src` into staging at `staged` and queues its copy into `region` at `offset`.
    fn stage_h2d(
        &mut self,
        region: &DeviceRegion,
        offset: u64,
        staged: u64,
        src: &[u8],
        streams: &mut Vec<(usize, usize)>,
    ) -> Result<(), String> {
        let s = self.job_stream(region.gpu(), streams)?;
        let staging = &self
            .inline_copies
            .staging
            .as_ref()
            .expect("a slot was taken")
            .region;
        staging
            .write(staged as usize, src)
            .map_err(|e| format!("GPU staging: {e}"))?;
        let len = src.len() as u64;
        self.inline_copies.queue(s, |stream, staging| {
            stream.copy_h2d(region, offset, staging, staged, len)
        })
    }

    /// The entries of `pieces`' buffers, the GPU of the first GPU piece and the GPU pieces'
    /// bytes; `None` when a buffer is gone or no piece is GPU memory.
    fn gpu_pieces(&self, pieces: &[(u64, u64, u64)]) -> Option<(Vec<Arc<BufferEntry>>, Arc<Gpu>, usize)> {
        let mut keep = Vec::with_capacity(pieces.len());
        let mut gpu_bytes = 0usize;
        let mut gpu = None;
        for &(b, _, len) in pieces {
            let entry = self.buffers.get(&b)?;
            if let Piece::Gpu(region) = piece(entry) {
                gpu_bytes += len as usize;
                gpu.get_or_insert_with(|| region.gpu().clone());
            }
            keep.push(entry.clone());
        }
        Some((keep, gpu?, gpu_bytes))
    }

    /// The job's stream on `gpu`: the one it picked before, else the next of that GPU's pool.
    fn job_stream(
        &mut self,
        gpu: &Arc<Gpu>,
        streams: &mut Vec<(usize, usize)>,
    ) -> Result<(usize, usize), String> {
        let ordinal = gpu.ordinal();
        if let Some(&s) = streams.iter().find(|s| s.0 == ordinal) {
            return Ok(s);
        }
        let s = self.inline_copies.pick(gpu)?;
        streams.push(s);
        Ok(s)
    }

    /// The inline copies whose events completed: payloads sent (if the engine still wants them),
    /// landings reported. Whether any ended (their actions are run by the caller's pass).
    pub(super) fn finish_inline_copies(&mut self) -> bool {
        let mut any = false;
        let mut i = 0;
        while i < self.inline_copies.jobs.len() {
            let Some((job, result)) = self.inline_copies.ended(i) else {
                i += 1;
                continue;
            };
            any = true;
            let staging = self.inline_copies.staging.as_mut().expect("a job holds a slot");
            match job.purpose {
                Purpose::Gather {
                    peer,
                    offer,
                    mut payload,
                    pieces,
                } => {
                    let mut result = result;
                    for (at, staged, n) in pieces {
                        if let Err(e) = staging.region.read(staged as usize, &mut payload[at..at + n]) {
                            result = Err(format!("GPU staging: {e}"));
                        }
                    }
                    staging.granules.give(job.slot);
                    if self.engine.on_inline_gathered(offer.offer_id, result) {
                        self.send_control(peer, PeerMsg::Inline { offer, payload });
                    }
                }
                Purpose::Land { peer, offer, len } => {
                    staging.granules.give(job.slot);
                    self.engine.on_inline_landed(peer, offer, len, result);
                }
            }
            // `ended` moved the last job to `i`: look at it next.
        }
        any
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn granules_fit_first_and_come_back_whole() {
        let mut g = Granules::new(8);
        let a = g.take(1).unwrap();
        assert_eq!((a.first, a.granules), (0, 1), "at least one granule");
        let b = g.take(3 * GRANULE).unwrap();
        assert_eq!((b.first, b.granules), (1, 3));
        let c = g.take(3 * GRANULE + 1).unwrap();
        assert_eq!((c.first, c.granules), (4, 4), "rounded up");
        assert!(g.take(1).is_none(), "full: the caller copies synchronously");
        g.give(b);
        assert!(g.take(4 * GRANULE).is_none(), "three free granules hold no four");
        let d = g.take(2 * GRANULE).unwrap();
        assert_eq!((d.first, d.offset()), (1, GRANULE as u64));
        g.give(a);
        g.give(d);
        g.give(c);
        assert_eq!(g.take(8 * GRANULE).map(|s| s.first), Some(0), "all back");
    }
}
