//! The kernel unpacker: one launch of `kernels/unpack.cu` per batch (up to 64 receives per
//! launch; more make more launches on the same stream).
//!
//! A batch's completion is signalled by the kernels, not by a CUDA event, and without any
//! traffic between blocks: every launch carries the number of the newest batch issued before
//! it, and its first block stores that into a host-mapped word once the grids before it have
//! completed ([`Completions`]). The newest batch, which nothing follows yet, is seen done by
//! querying the stream. So a batch costs one driver call (its launch), and asking whether an
//! older batch is done is one load from host memory. A faulted kernel shows in the stream query
//! (made at most once a millisecond while older batches are outstanding).
//!
//! The task descriptors travel as a kernel parameter (copied by the launch itself). The
//! default, [`FragSource::Mapped`], reads each fragment list in place from the plugin's
//! host-mapped ring and reads nothing of it on the host at all: the kernel's bounds guard keeps a
//! bad list from reading or writing out of bounds, and each block stores the lengths it read,
//! added up, into host-mapped memory, which the unpacker compares with the receive's size once
//! the batch is done (`UnpackJob::exact`). Lists the kernel cannot
//! read in place are staged in a pinned, preallocated ring of per-batch slots (`SLOTS` × 16384
//! fragments): [`FragSource::PackedMapped`] re-encodes each list compactly there (4 bytes per
//! whole 4 KiB page, else 12), [`FragSource::DeviceCopy`] uploads the 16-byte lists with one
//! H2D copy per launch into a device mirror of the ring, [`FragSource::Params`] puts them in the
//! kernel's parameter block when they fit. Nothing is allocated after construction.

use std::sync::Arc;

use super::{Ticket, UnpackError, UnpackJob, Unpacker, exact_total, validate};
use crate::gpu::{
    DeviceRegion, DeviceSpan, Gpu, GpuResult, INLINE_MAX_FRAGS, INLINE_MAX_TASKS, INLINE_PAGES_MAX_FRAGS,
    INLINE_PAGES_MAX_TASKS, InlineBatch, InlinePagesBatch, Kernels, LaunchReport, LaunchSignal, ListFormat,
    PinnedRegion, Stream, UNPACK_MAX_TASKS_PER_LAUNCH, UNPACK_WARPS_PER_BLOCK, UnpackTask,
};
use crate::gpu::{PERSIST_MAX_TASKS, PERSIST_QUEUE, PersistConfig, PersistentGrid, PostedLists};
use crate::net::abi::{NET_UNPACK_MAX_SLICE_PAGES, loadMeta};

use super::completions::Completions;

/// Batches in flight before `submit` waits for the oldest.
const SLOTS: usize = 16;
/// Fragments one batch can stage (8 full receives); a larger batch is split transparently.
const SLOT_FRAGS: usize = 8 * 2048;
const META: usize = size_of::<loadMeta>();
// A persistent batch is closed where a launch would be split (64 receives), and its queue slot
// is free exactly when the unpacker's batch slot is (`reserve` waits for both).
const _: () = assert!(PERSIST_MAX_TASKS == UNPACK_MAX_TASKS_PER_LAUNCH);
const _: () = assert!(PERSIST_QUEUE == SLOTS);
/// Cap on blocks per task (a 2048-fragment receive gets 256 blocks: one warp per fragment).
const MAX_BLOCKS_PER_TASK: u32 = 256;
/// Per-block sums of fragment lengths one batch's launches can store (`FragSource::Mapped`):
/// four full launches (64 receives × 256 blocks each); a batch that would need more is split.
const SUMS_PER_SLOT: usize = 4 * UNPACK_MAX_TASKS_PER_LAUNCH * MAX_BLOCKS_PER_TASK as usize;
/// The most sums one launch stores.
const SUMS_PER_LAUNCH: usize = UNPACK_MAX_TASKS_PER_LAUNCH * MAX_BLOCKS_PER_TASK as usize;

/// An exact receive read in place: where its blocks' sums of lengths are (`first`, `blocks`
/// entries of its slot), and what they must add up to.
#[derive(Debug, Clone, Copy)]
struct SumCheck {
    task: u32,
    first: usize,
    blocks: u32,
    expected: u64,
}

/// What is left to check of the batch in a slot once it is done.
#[derive(Debug, Default)]
struct SlotChecks {
    seq: u64,
    sums: Vec<SumCheck>,
}

/// Where the kernel reads the fragment lists from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FragSource {
    /// In place, through the host mapping of the ring, a block's entries in one coalesced read,
    /// with nothing of the list read on the host: the kernel's bounds guard keeps a bad list in
    /// bounds and its per-block sums of lengths show one that does not add up, both reported by
    /// `is_done`. NCCL's design, and the default: the fastest at 1, 4 and 16 chunks per batch,
    /// single or back to back, on the H200 (docs/GPU.md). Lists without a device view are
    /// checked at `push`, staged in pinned memory and read through its mapping.
    #[default]
    Mapped,
    /// From a device copy: every list is staged and uploaded with one H2D copy per launch.
    DeviceCopy,
    /// As DeviceCopy, except that a launch whose lists fit the kernel's parameter block (at
    /// most 4 receives and 256 fragments: one or two 512 KiB chunks) carries them there and
    /// needs no upload; so does a launch of up to 16 receives of whole pages (8.8 KiB block).
    Params,
    /// Lists checked and re-encoded compactly at `push` ([`ListFormat`]: 4 bytes per whole page,
    /// else 12) into pinned staging and read by the kernel through its host mapping, a block's
    /// entries in one coalesced read: a quarter of the bytes across PCIe, for a pass over each
    /// list on the host before the launch.
    PackedMapped,
    /// As `PackedMapped`, with the compact lists uploaded by one H2D copy per launch.
    PackedDevice,
}

pub struct KernelUnpacker {
    gpu: Arc<Gpu>,
    kernels: Arc<Kernels>,
    stream: Stream,
    source: FragSource,
    done: Completions,
    /// SLOTS × SLOT_FRAGS staged fragment lists.
    staging: PinnedRegion,
    /// The device mirror of `staging` (DeviceCopy only).
    mirror: Option<DeviceRegion>,
    /// One error word per slot.
    errs: PinnedRegion,
    /// `Mapped`: SLOTS × SUMS_PER_SLOT u32, the kernels' per-block sums of fragment lengths.
    sums: Option<PinnedRegion>,
    /// Sums used in the open slot, and the receives of the open batch already launched.
    sums_used: usize,
    batch_tasks: u32,
    /// Per pending task: the size its list must add up to (an exact receive read in place).
    expect: Vec<Option<u64>>,
    /// Per slot: the batch in it and its exact receives' sums, checked once it is done.
    checks: Vec<SlotChecks>,
    /// Batches up to this one are checked; errors found, by batch, not yet reported.
    verified: u64,
    errors: std::collections::VecDeque<(u64, UnpackError)>,
    /// The open batch's slot, if any.
    open: Option<usize>,
    /// Fragments staged in the open slot, and how many of those are already uploaded.
    used: usize,
    uploaded: usize,
    /// Tasks waiting for the next launch of the open batch.
    tasks: Vec<UnpackTask>,
    max_count: u32,
    /// Params mode: the staged receives of the next launch (first staged entry, count, bounce,
    /// destination), and the parameter block they go into when they fit.
    pending: Vec<(usize, usize, DeviceSpan, DeviceSpan, bool)>,
    inline: InlineBatch,
    /// Params mode: launches of up to 16 whole-page receives carry their lists here.
    inline_pages: InlinePagesBatch,
    frags_per_warp: u32,
    launched: bool,
    /// The last batch closed internally (slot full) since the last submit.
    unticketed: Option<Ticket>,
    /// Persistent mode: batches are posted to a resident grid instead of launched.
    grid: Option<PersistentGrid>,
    /// Launch task kernels as programmatic dependent launches (on sm_90 and later).
    overlap: bool,
}

impl KernelUnpacker {
    pub fn new(gpu: &Arc<Gpu>, source: FragSource) -> Result<KernelUnpacker, UnpackError> {
        let kernels = gpu.kernels()?;
        let staging = gpu.alloc_pinned(SLOTS * SLOT_FRAGS * META)?;
        let mirror = match source {
            FragSource::DeviceCopy | FragSource::Params | FragSource::PackedDevice => {
                Some(gpu.alloc(SLOTS * SLOT_FRAGS * META)?)
            }
            FragSource::Mapped | FragSource::PackedMapped => None,
        };
        Ok(KernelUnpacker {
            gpu: gpu.clone(),
            kernels,
            stream: Stream::new(gpu)?,
            source,
            done: Completions::new(gpu, SLOTS)?,
            staging,
            mirror,
            errs: gpu.alloc_pinned(SLOTS * 4)?,
            sums: match source {
                FragSource::Mapped => Some(gpu.alloc_pinned(SLOTS * SUMS_PER_SLOT * 4)?),
                _ => None,
            },
            sums_used: 0,
            batch_tasks: 0,
            expect: Vec::with_capacity(UNPACK_MAX_TASKS_PER_LAUNCH),
            checks: (0..SLOTS).map(|_| SlotChecks::default()).collect(),
            verified: 0,
            errors: std::collections::VecDeque::new(),
            open: None,
            used: 0,
            uploaded: 0,
            tasks: Vec::with_capacity(UNPACK_MAX_TASKS_PER_LAUNCH),
            max_count: 0,
            pending: Vec::with_capacity(UNPACK_MAX_TASKS_PER_LAUNCH),
            inline: InlineBatch::new(),
            inline_pages: InlinePagesBatch::new(),
            frags_per_warp: 1,
            launched: false,
            unticketed: None,
            grid: None,
            overlap: gpu.compute_capability() >= (9, 0),
        })
    }

    /// The persistent mode (`kernel-persistent`): compact lists, as `PackedMapped`, but each
    /// batch is posted to a grid that stays resident while batches keep coming
    /// (src/gpu/persist.rs) instead of launched; its leader block copies the lists into device
    /// memory ahead of the copies.
    pub fn persistent(gpu: &Arc<Gpu>, config: PersistConfig) -> Result<KernelUnpacker, UnpackError> {
        let mut u = KernelUnpacker::new(gpu, FragSource::PackedMapped)?;
        // The leader copies each batch's lists here before the workers read them.
        u.mirror = Some(gpu.alloc(SLOTS * SLOT_FRAGS * META)?);
        u.grid = Some(PersistentGrid::new(gpu, config, &u.done.word, 0)?);
        u.done.self_signalled = true;
        Ok(u)
    }

    /// Whether launches overlap the previous grid's tail (programmatic dependent launch; on by
    /// default on sm_90 and later).
    pub fn set_overlap(&mut self, on: bool) {
        self.overlap = on && self.gpu.compute_capability() >= (9, 0);
    }

    /// Persistent mode: grids launched so far (`None` in the launch modes).
    pub fn grid_launches(&self) -> Option<u64> {
        self.grid.as_ref().map(PersistentGrid::launches)
    }

    pub fn source(&self) -> FragSource {
        self.source
    }

    /// Tuning: fragments each warp copies per launch (1 by default: one warp per fragment, so a
    /// receive of n fragments gets n / 8 blocks).
    pub fn set_frags_per_warp(&mut self, n: u32) {
        self.frags_per_warp = n.max(1);
    }

    /// How often a batch waited for a free slot (more than 16 batches in flight).
    pub fn stalls(&self) -> u64 {
        self.done.book.stalls()
    }

    /// Checks what the kernels left for batch `seq` (done): its slot's error word (a fragment
    /// the bounds guard skipped) and its exact receives' sums of lengths. Errors are kept by
    /// batch until `is_done` reports them.
    fn verify(&mut self, seq: u64) -> Result<(), UnpackError> {
        let slot = (seq % SLOTS as u64) as usize;
        if self.checks[slot].seq != seq {
            return Ok(()); // no batch of that number holds the slot (never issued there)
        }
        let v = self.errs.load_u32(slot * 4)?;
        if v != 0 {
            self.errs.store_u32(slot * 4, 0)?;
            let e = UnpackError::DeviceRejected {
                task: (v - 1) >> 12,
                fragment: (v - 1) & 0xfff,
            };
            self.errors.push_back((seq, e));
        }
        let mut checks = std::mem::take(&mut self.checks[slot].sums);
        if let Some(sums) = &self.sums {
            for c in &checks {
                let mut landed = 0u64;
                for b in 0..c.blocks as usize {
                    landed += u64::from(sums.load_u32((slot * SUMS_PER_SLOT + c.first + b) * 4)?);
                }
                if landed != c.expected {
                    let e = UnpackError::DeviceShort {
                        task: c.task,
                        landed,
                        expected: c.expected,
                    };
                    self.errors.push_back((seq, e));
                }
            }
        }
        checks.clear();
        self.checks[slot].sums = checks;
        Ok(())
    }

    /// [`KernelUnpacker::verify`] for every batch up to `seq` (all done) not checked yet.
    fn verify_upto(&mut self, seq: u64) -> Result<(), UnpackError> {
        while self.verified < seq {
            self.verify(self.verified + 1)?;
            self.verified += 1;
        }
        Ok(())
    }

    /// The open batch's slot, with room for one more receive that stages `units` 16-byte units:
    /// the open batch is closed first (its ticket kept for `submit`) when its staging is used
    /// up, or when it holds 64 pending receives and cannot take another launch (persistent mode
    /// posts at most 64; the in-place sums hold four launches); otherwise 64 pending receives
    /// are launched and the batch goes on.
    fn room_for(&mut self, units: usize) -> Result<usize, UnpackError> {
        let staging_full = self.used + units > SLOT_FRAGS;
        let tasks_full = self.tasks.len() == UNPACK_MAX_TASKS_PER_LAUNCH;
        let sums_full = self.sums_used + 2 * SUMS_PER_LAUNCH > SUMS_PER_SLOT;
        if self.open.is_some() && (staging_full || (tasks_full && (self.grid.is_some() || sums_full))) {
            if let Some(t) = self.close_batch()? {
                self.unticketed = Some(t);
            }
        }
        let slot = self.open_batch()?;
        if self.tasks.len() == UNPACK_MAX_TASKS_PER_LAUNCH {
            self.launch_pending()?;
        }
        Ok(slot)
    }

    fn open_batch(&mut self) -> Result<usize, UnpackError> {
        if let Some(slot) = self.open {
            return Ok(slot);
        }
        let slot = self.done.reserve(&self.stream, self.grid.as_mut())?;
        // The batch that held the slot is done: check it before its words are reused.
        let (_, prev) = self.done.book.next_slot();
        self.verify_upto(prev)?;
        self.errs.store_u32(slot * 4, 0)?;
        self.checks[slot] = SlotChecks {
            seq: self.done.book.next_seq(),
            sums: std::mem::take(&mut self.checks[slot].sums),
        };
        self.open = Some(slot);
        self.used = 0;
        self.uploaded = 0;
        self.sums_used = 0;
        self.batch_tasks = 0;
        self.launched = false;
        Ok(slot)
    }

    /// Counts `units` staged 16-byte units at staging index `first` as used; their device view
    /// (the mirror's when there is one, else the pinned staging's own mapping).
    fn take_staged(&mut self, first: usize, units: usize) -> Result<DeviceSpan, UnpackError> {
        self.used += units;
        let view = match &self.mirror {
            Some(m) => m.span(),
            None => self.staging.span(),
        };
        Ok(view.sub((first * META) as u64, (units * META) as u64)?)
    }

    /// Queues a receive whose list (in `format`) the kernel will read at `frags`.
    fn add_task(
        &mut self,
        frags: DeviceSpan,
        count: usize,
        format: ListFormat,
        job: &UnpackJob<'_>,
    ) -> Result<(), UnpackError> {
        self.tasks.push(UnpackTask::with_format(
            frags,
            count as u32,
            format,
            job.bounce,
            job.dst,
        )?);
        self.expect.push(None);
        self.max_count = self.max_count.max(count as u32);
        Ok(())
    }

    fn blocks_for(&self, max_count: u32) -> u32 {
        max_count
            .div_ceil(UNPACK_WARPS_PER_BLOCK * self.frags_per_warp)
            .clamp(1, MAX_BLOCKS_PER_TASK)
    }

    /// Whether the pending receives (all staged, none uploaded) fit one inline launch.
    fn fits_inline(&self) -> bool {
        self.pending.len() == self.tasks.len()
            && self.pending.len() <= INLINE_MAX_TASKS
            && self.pending.iter().map(|p| p.1).sum::<usize>() <= INLINE_MAX_FRAGS
            && self
                .pending
                .iter()
                .all(|&(_, n, _, dst, _)| InlineBatch::accepts(dst, n))
    }

    /// Whether the pending receives fit one page-inline launch (all whole pages).
    fn fits_inline_pages(&self) -> bool {
        self.pending.len() == self.tasks.len()
            && self.pending.len() <= INLINE_PAGES_MAX_TASKS
            && self.pending.iter().map(|p| p.1).sum::<usize>() <= INLINE_PAGES_MAX_FRAGS
            && self.pending.iter().all(|p| p.4)
    }

    /// Params mode: launches the pending receives with their lists in the kernel parameters
    /// when they all fit; returns false (nothing done) when they do not.
    fn try_launch_inline(&mut self, slot: usize, signal: LaunchSignal) -> Result<bool, UnpackError> {
        if !self.fits_inline() {
            if !self.fits_inline_pages() {
                return Ok(false);
            }
            if let Err(e) = push_each(&self.pending, &self.staging, slot, |m, b, d| {
                self.inline_pages.push(m, b, d)
            }) {
                self.inline_pages.discard();
                return Err(e.into());
            }
            let blocks = self.blocks_for(self.inline_pages.max_count());
            self.gpu.launch_unpack_inline_pages(
                &self.kernels,
                &self.stream,
                &mut self.inline_pages,
                blocks,
                LaunchReport {
                    err: &self.errs,
                    err_off: slot * 4,
                    signal,
                    overlap: false,
                },
            )?;
            self.uploaded = self.used;
            return Ok(true);
        }
        if let Err(e) = push_each(&self.pending, &self.staging, slot, |m, b, d| {
            self.inline.push(m, b, d)
        }) {
            self.inline.discard();
            return Err(e.into());
        }
        let blocks = self.blocks_for(self.inline.max_count());
        self.gpu.launch_unpack_inline(
            &self.kernels,
            &self.stream,
            &mut self.inline,
            blocks,
            LaunchReport {
                err: &self.errs,
                err_off: slot * 4,
                signal,
                overlap: self.overlap,
            },
        )?;
        self.uploaded = self.used;
        Ok(true)
    }

    /// Launches the pending tasks (each launch reports the batches issued before it done).
    fn launch_pending(&mut self) -> Result<(), UnpackError> {
        let signal = self.done.signal()?;
        let Some(slot) = self.open else {
            return Ok(());
        };
        if self.tasks.is_empty() {
            return Ok(());
        }
        let inline = self.source == FragSource::Params && self.try_launch_inline(slot, signal)?;
        self.pending.clear();
        if inline {
            self.tasks.clear();
            self.expect.clear();
            self.max_count = 0;
            self.launched = true;
            return Ok(());
        }
        if let Some(mirror) = self.mirror.as_ref().filter(|_| self.used > self.uploaded) {
            let off = ((slot * SLOT_FRAGS + self.uploaded) * META) as u64;
            let len = ((self.used - self.uploaded) * META) as u64;
            self.stream.copy_h2d(mirror, off, &self.staging, off, len)?;
            self.uploaded = self.used;
        }
        let blocks = self.blocks_for(self.max_count);
        let mut signal = signal;
        if let Some(sums) = self
            .sums
            .as_ref()
            .filter(|_| self.expect.iter().any(Option::is_some))
        {
            // The exact receives read in place: their blocks' sums of lengths, checked once the
            // batch is done.
            let entries = self.tasks.len() * blocks as usize;
            debug_assert!(self.sums_used + entries <= SUMS_PER_SLOT);
            signal = signal.with_sums(sums, (slot * SUMS_PER_SLOT + self.sums_used) * 4, entries)?;
            for (i, e) in self.expect.iter().enumerate() {
                if let Some(expected) = *e {
                    self.checks[slot].sums.push(SumCheck {
                        task: self.batch_tasks + i as u32,
                        first: self.sums_used + i * blocks as usize,
                        blocks,
                        expected,
                    });
                }
            }
            self.sums_used += entries;
        }
        self.gpu.launch_unpack(
            &self.kernels,
            &self.stream,
            &self.tasks,
            blocks,
            LaunchReport {
                err: &self.errs,
                err_off: slot * 4,
                signal,
                overlap: self.overlap,
            },
        )?;
        self.batch_tasks += self.tasks.len() as u32;
        self.tasks.clear();
        self.expect.clear();
        self.max_count = 0;
        self.launched = true;
        Ok(())
    }

    /// Launches what is pending as the batch's final launch, carrying its completion signal;
    /// `None` if the batch has nothing to run.
    fn close_batch(&mut self) -> Result<Option<Ticket>, UnpackError> {
        let Some(slot) = self.open else {
            return Ok(None);
        };
        if self.tasks.is_empty() && !self.launched {
            return Ok(None);
        }
        if let Some(grid) = self.grid.as_mut() {
            let base = (slot * SLOT_FRAGS * META) as u64;
            let lists = PostedLists {
                src: self.staging.device_ptr() + base,
                dst: self.mirror.as_ref().map_or(0, |m| m.device_ptr()) + base,
                bytes: (self.used * META) as u64,
            };
            grid.post(
                &self.stream,
                self.done.book.next_seq(),
                &self.tasks,
                lists,
                &self.errs,
                slot * 4,
            )?;
            self.tasks.clear();
            self.expect.clear();
            self.max_count = 0;
        } else {
            self.launch_pending()?;
        }
        let t = self.done.book.issue();
        self.open = None;
        self.launched = false;
        Ok(Some(t))
    }
}

impl Unpacker for KernelUnpacker {
    fn name(&self) -> &'static str {
        if self.grid.is_some() {
            return "kernel-persistent";
        }
        match self.source {
            FragSource::Mapped => "kernel-mapped",
            FragSource::DeviceCopy => "kernel-device",
            FragSource::Params => "kernel-params",
            FragSource::PackedMapped => "kernel-packed-mapped",
            FragSource::PackedDevice => "kernel-packed-device",
        }
    }

    fn push(&mut self, job: &UnpackJob<'_>) -> Result<(), UnpackError> {
        let count = job.frags.len();
        // The ring read in place: nothing of the list is read on the host (the kernel
        // bounds-checks every fragment and adds the lengths up; `is_done` reports).
        if let Some(span) = job
            .frags
            .device_span()
            .filter(|_| self.source == FragSource::Mapped)
        {
            if count > NET_UNPACK_MAX_SLICE_PAGES {
                return Err(UnpackError::TooManyFragments { count });
            }
            if count == 0 {
                return exact_total(job, 0).map(|_| ());
            }
            self.room_for(0)?;
            self.add_task(span, count, ListFormat::Meta, job)?;
            if job.exact {
                // The kernel adds the lengths up (the host reads nothing of the list).
                *self.expect.last_mut().expect("just added") = Some(job.dst.len());
            }
            return Ok(());
        }
        let packed = matches!(self.source, FragSource::PackedMapped | FragSource::PackedDevice);
        // The common case, an open batch with room for this list in any encoding: the bounds
        // check, the choice of encoding and the whole-page encoding in one pass over the list.
        if let Some(slot) = self.open.filter(|_| {
            packed
                && (1..=NET_UNPACK_MAX_SLICE_PAGES).contains(&count)
                && self.used + count <= SLOT_FRAGS
                && self.tasks.len() < UNPACK_MAX_TASKS_PER_LAUNCH
        }) {
            let first = slot * SLOT_FRAGS + self.used;
            let out = self.staging.typed_mut::<u8>(first * META, count * META)?;
            let scan = ListFormat::scan_encode(job.frags.as_slice(), job.dst.len(), job.bounce.len(), out);
            let format = scan.format;
            if !scan.in_bounds {
                // Names the offending fragment; nothing is queued (the bytes written past
                // `used` are not part of any task).
                validate(job)?;
                format.encode(job.frags.as_slice(), out);
            }
            exact_total(job, scan.total)?;
            let frags = self.take_staged(first, (count * format.entry_bytes()).div_ceil(META))?;
            return self.add_task(frags, count, format, job);
        }
        let format = if packed && count <= NET_UNPACK_MAX_SLICE_PAGES {
            // The bounds check and the choice of encoding in one pass; `validate` runs only to
            // name the offending fragment.
            let scan = ListFormat::scan(job.frags.as_slice(), job.dst.len(), job.bounce.len());
            if !scan.in_bounds {
                validate(job)?;
            }
            exact_total(job, scan.total)?;
            scan.format
        } else {
            validate(job)?;
            ListFormat::Meta
        };
        if count == 0 {
            return Ok(());
        }
        // Staged (lists read in place returned above); counted in 16-byte units (one loadMeta
        // each).
        let units = (count * format.entry_bytes()).div_ceil(META);
        let slot = self.room_for(units)?;
        let first = slot * SLOT_FRAGS + self.used;
        if packed {
            let out = self.staging.typed_mut::<u8>(first * META, units * META)?;
            format.encode(job.frags.as_slice(), out);
        } else {
            self.staging
                .typed_mut::<loadMeta>(first * META, count)?
                .copy_from_slice(job.frags.as_slice());
        }
        let frags = self.take_staged(first, units)?;
        if self.source == FragSource::Params {
            let pages = ListFormat::choose(job.frags.as_slice(), job.dst.len()) == ListFormat::Page32;
            self.pending
                .push((self.used - count, count, job.bounce, job.dst, pages));
        }
        self.add_task(frags, count, format, job)
    }

    fn submit(&mut self) -> Result<Option<Ticket>, UnpackError> {
        let t = self.close_batch()?;
        let earlier = self.unticketed.take();
        Ok(t.or(earlier))
    }

    fn is_done(&mut self, t: &Ticket) -> Result<bool, UnpackError> {
        self.done.book.known(t)?;
        if !self.done.poll(t.seq, &self.stream, self.grid.as_mut())? {
            return Ok(false);
        }
        // This batch and every one before it are done: report what their checks found (the
        // batches closed inside this one's `submit` come before it and report with it).
        self.verify_upto(t.seq)?;
        let mut found = None;
        while let Some((seq, _)) = self.errors.front() {
            if *seq > t.seq {
                break;
            }
            let (_, e) = self.errors.pop_front().expect("front");
            found.get_or_insert(e);
        }
        match found {
            Some(e) => Err(e),
            None => Ok(true),
        }
    }

    fn wait(&mut self, t: &Ticket) -> Result<(), UnpackError> {
        self.done.book.known(t)?;
        self.done.wait(t.seq, &self.stream, self.grid.as_mut())?;
        self.is_done(t).map(|_| ())
    }

    fn stream(&self) -> &Stream {
        &self.stream
    }
}

impl Drop for KernelUnpacker {
    fn drop(&mut self) {
        let Some(grid) = self.grid.as_mut() else {
            return;
        };
        // The grid reads this value's queue and staging: let every batch finish, then ask the
        // grid to leave and wait for it, before any of them is freed.
        let last = self.done.book.last_seq();
        if last > 0 {
            if let Err(e) = self.done.wait(last, &self.stream, Some(&mut *grid)) {
                tracing::warn!("unpack: dropping with batch {last} unfinished: {e}");
            }
        }
        if let Err(e) = grid.stop(&self.stream) {
            tracing::warn!("unpack: stopping the persistent grid: {e}");
        }
    }
}

/// Hands each pending receive of `slot` (its fragment list in the staging area) to `push`; the
/// first failure stops it (the caller discards the half-filled batch).
fn push_each(
    pending: &[(usize, usize, DeviceSpan, DeviceSpan, bool)],
    staging: &PinnedRegion,
    slot: usize,
    mut push: impl FnMut(&[loadMeta], DeviceSpan, DeviceSpan) -> GpuResult<()>,
) -> GpuResult<()> {
    for &(first, n, bounce, dst, _) in pending {
        let base = slot * SLOT_FRAGS + first;
        push(staging.typed::<loadMeta>(base * META, n)?, bounce, dst)?;
    }
    Ok(())
}
