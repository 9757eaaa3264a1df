//! The kernel unpacker: one launch of `kernels/unpack.cu` per batch (up to 64 receives per
//! launch; more make more launches on the same stream), an event per batch.
//!
//! The task descriptors travel as a kernel parameter (copied by the launch itself), so the only
//! memory a batch needs is for fragment lists that the kernel cannot read in place: those are
//! staged in a pinned, preallocated ring of per-batch slots (`SLOTS` × 16384 fragments). The
//! default, [`FragSource::PackedMapped`], re-encodes each list compactly there (4 bytes per whole
//! 4 KiB page, else 12) and the kernel reads it through the host mapping, a block's entries in
//! one coalesced read. [`FragSource::DeviceCopy`] uploads the 16-byte lists with one H2D copy per
//! launch into a device mirror of the ring, [`FragSource::Params`] puts them in the kernel's
//! parameter block when they fit. Nothing is allocated after construction.

use std::sync::Arc;

use super::{BatchEvents, Ticket, UnpackError, UnpackJob, Unpacker, validate};
use crate::gpu::{
    DeviceRegion, DeviceSpan, Gpu, INLINE_MAX_FRAGS, INLINE_MAX_TASKS, INLINE_PAGES_MAX_FRAGS,
    INLINE_PAGES_MAX_TASKS, InlineBatch, InlinePagesBatch, Kernels, ListFormat, PinnedRegion, Stream,
    UNPACK_MAX_TASKS_PER_LAUNCH, UNPACK_WARPS_PER_BLOCK, UnpackTask,
};
use crate::net::abi::loadMeta;

/// Batches in flight before `submit` waits for the oldest.
const SLOTS: usize = 16;
/// Fragments one batch can stage (8 full receives); a larger batch is split transparently.
const SLOT_FRAGS: usize = 8 * 2048;
const META: usize = size_of::<loadMeta>();
/// Cap on blocks per task (a 2048-fragment receive gets 256 blocks: one warp per fragment).
const MAX_BLOCKS_PER_TASK: u32 = 256;

/// Where the kernel reads the fragment lists from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FragSource {
    /// In place, through the host mapping of the ring (lists without a device view are staged
    /// in pinned memory and read through its mapping).
    Mapped,
    /// From a device copy: every list is staged and uploaded with one H2D copy per launch.
    DeviceCopy,
    /// As DeviceCopy, except that a launch whose lists fit the kernel's parameter block (at
    /// most 4 receives and 256 fragments: one or two 512 KiB chunks) carries them there and
    /// needs no upload; so does a launch of up to 16 receives of whole pages (8.8 KiB block).
    Params,
    /// Lists re-encoded compactly at `push` ([`ListFormat`]: 4 bytes per whole page, else 12)
    /// into pinned staging and read by the kernel through its host mapping, a block's entries
    /// in one coalesced read: no copy-engine work at all. The default: the fastest or level with
    /// the fastest at 4 and 16 chunks per batch on the H200 VM (docs/GPU.md), and the closest to
    /// NCCL's in-place reads of the ring, with a quarter of the bytes to cross PCIe.
    #[default]
    PackedMapped,
    /// As `PackedMapped`, with the compact lists uploaded by one H2D copy per launch.
    PackedDevice,
}

pub struct KernelUnpacker {
    gpu: Arc<Gpu>,
    kernels: Arc<Kernels>,
    stream: Stream,
    source: FragSource,
    events: BatchEvents,
    /// SLOTS × SLOT_FRAGS staged fragment lists.
    staging: PinnedRegion,
    /// The device mirror of `staging` (DeviceCopy only).
    mirror: Option<DeviceRegion>,
    /// One error word per slot.
    errs: PinnedRegion,
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
    /// An error found in a slot's error word after its ticket was gone.
    sticky: Option<UnpackError>,
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
            events: BatchEvents::new(gpu, SLOTS)?,
            staging,
            mirror,
            errs: gpu.alloc_pinned(SLOTS * 4)?,
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
            sticky: None,
        })
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
        self.events.stalls()
    }

    fn check_err_word(&mut self, slot: usize) -> Result<Option<UnpackError>, UnpackError> {
        let v = self.errs.load_u32(slot * 4)?;
        Ok((v != 0).then(|| UnpackError::DeviceRejected {
            task: (v - 1) >> 12,
            fragment: (v - 1) & 0xfff,
        }))
    }

    fn open_batch(&mut self) -> Result<usize, UnpackError> {
        if let Some(slot) = self.open {
            return Ok(slot);
        }
        let slot = self.events.reserve()?;
        if let Some(e) = self.check_err_word(slot)? {
            self.sticky.get_or_insert(e);
        }
        self.errs.store_u32(slot * 4, 0)?;
        self.open = Some(slot);
        self.used = 0;
        self.uploaded = 0;
        self.launched = false;
        Ok(slot)
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
    fn try_launch_inline(&mut self, slot: usize) -> Result<bool, UnpackError> {
        if !self.fits_inline() {
            if !self.fits_inline_pages() {
                return Ok(false);
            }
            for &(first, n, bounce, dst, _) in &self.pending {
                let base = slot * SLOT_FRAGS + first;
                self.inline_pages
                    .push(self.staging.typed::<loadMeta>(base * META, n)?, bounce, dst)?;
            }
            let blocks = self.blocks_for(self.inline_pages.max_count());
            self.gpu.launch_unpack_inline_pages(
                &self.kernels,
                &self.stream,
                &mut self.inline_pages,
                blocks,
                &self.errs,
                slot * 4,
            )?;
            self.uploaded = self.used;
            return Ok(true);
        }
        for &(first, n, bounce, dst, _) in &self.pending {
            let base = slot * SLOT_FRAGS + first;
            self.inline
                .push(self.staging.typed::<loadMeta>(base * META, n)?, bounce, dst)?;
        }
        let blocks = self.blocks_for(self.inline.max_count());
        self.gpu.launch_unpack_inline(
            &self.kernels,
            &self.stream,
            &mut self.inline,
            blocks,
            &self.errs,
            slot * 4,
        )?;
        self.uploaded = self.used;
        Ok(true)
    }

    fn launch_pending(&mut self) -> Result<(), UnpackError> {
        let Some(slot) = self.open else {
            return Ok(());
        };
        if self.tasks.is_empty() {
            return Ok(());
        }
        let inline = self.source == FragSource::Params && self.try_launch_inline(slot)?;
        self.pending.clear();
        if inline {
            self.tasks.clear();
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
        self.gpu.launch_unpack(
            &self.kernels,
            &self.stream,
            &self.tasks,
            blocks,
            &self.errs,
            slot * 4,
        )?;
        self.tasks.clear();
        self.max_count = 0;
        self.launched = true;
        Ok(())
    }

    /// Launches what is pending and records the batch's event; `None` if the batch launched
    /// nothing.
    fn close_batch(&mut self) -> Result<Option<Ticket>, UnpackError> {
        self.launch_pending()?;
        if self.open.is_none() || !self.launched {
            return Ok(None);
        }
        let t = self.events.record(&self.stream)?;
        self.open = None;
        self.launched = false;
        Ok(Some(t))
    }
}

impl Unpacker for KernelUnpacker {
    fn name(&self) -> &'static str {
        match self.source {
            FragSource::Mapped => "kernel-mapped",
            FragSource::DeviceCopy => "kernel-device",
            FragSource::Params => "kernel-params",
            FragSource::PackedMapped => "kernel-packed-mapped",
            FragSource::PackedDevice => "kernel-packed-device",
        }
    }

    fn push(&mut self, job: &UnpackJob<'_>) -> Result<(), UnpackError> {
        validate(job)?;
        let count = job.frags.len();
        if count == 0 {
            return Ok(());
        }
        let in_place = match (self.source, job.frags.device_span()) {
            (FragSource::Mapped, Some(span)) => Some(span),
            _ => None,
        };
        let packed = matches!(self.source, FragSource::PackedMapped | FragSource::PackedDevice);
        let format = if packed {
            ListFormat::choose(job.frags.as_slice(), job.dst.len())
        } else {
            ListFormat::Meta
        };
        // Staging is counted in 16-byte units (one loadMeta each).
        let units = (count * format.entry_bytes()).div_ceil(META);
        if in_place.is_none() && self.open.is_some() && self.used + units > SLOT_FRAGS {
            if let Some(t) = self.close_batch()? {
                self.unticketed = Some(t);
            }
        }
        let slot = self.open_batch()?;
        if self.tasks.len() == UNPACK_MAX_TASKS_PER_LAUNCH {
            self.launch_pending()?;
        }
        let frags: DeviceSpan = match in_place {
            Some(span) => span,
            None => {
                let first = slot * SLOT_FRAGS + self.used;
                if packed {
                    let out = self.staging.typed_mut::<u8>(first * META, units * META)?;
                    format.encode(job.frags.as_slice(), out);
                } else {
                    self.staging
                        .typed_mut::<loadMeta>(first * META, count)?
                        .copy_from_slice(job.frags.as_slice());
                }
                self.used += units;
                let view = match &self.mirror {
                    Some(m) => m.span(),
                    None => self.staging.span(),
                };
                view.sub((first * META) as u64, (units * META) as u64)?
            }
        };
        self.tasks.push(UnpackTask::with_format(
            frags,
            count as u32,
            format,
            job.bounce,
            job.dst,
        )?);
        if self.source == FragSource::Params {
            let pages = ListFormat::choose(job.frags.as_slice(), job.dst.len()) == ListFormat::Page32;
            self.pending
                .push((self.used - count, count, job.bounce, job.dst, pages));
        }
        self.max_count = self.max_count.max(count as u32);
        Ok(())
    }

    fn submit(&mut self) -> Result<Option<Ticket>, UnpackError> {
        let t = self.close_batch()?;
        let earlier = self.unticketed.take();
        Ok(t.or(earlier))
    }

    fn is_done(&mut self, t: &Ticket) -> Result<bool, UnpackError> {
        if !self.events.is_done(t)? {
            return Ok(false);
        }
        if let Some(e) = self.sticky.take() {
            return Err(e);
        }
        if let Some(slot) = self.events.slot_of(t) {
            if let Some(e) = self.check_err_word(slot)? {
                self.errs.store_u32(slot * 4, 0)?;
                return Err(e);
            }
        }
        Ok(true)
    }

    fn wait(&mut self, t: &Ticket) -> Result<(), UnpackError> {
        self.events.wait(t)?;
        self.is_done(t).map(|_| ())
    }

    fn stream(&self) -> &Stream {
        &self.stream
    }
}
