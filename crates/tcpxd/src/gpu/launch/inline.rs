//! Inline launches of the unpack kernel: the receives' fragment lists travel in the kernel's
//! parameters (up to 4 KiB classic, 8832 bytes on CUDA 12.1+), so a small batch needs neither an
//! upload nor a read of host memory.

use std::ffi::c_void;
use std::ops::Range;

use cudarc::driver::sys;

use super::{LaunchReport, LaunchSignal, ListFormat, UNPACK_WARPS_PER_BLOCK, page32};
use crate::gpu::error::{GpuError, GpuResult};
use crate::gpu::memory::DeviceSpan;
use crate::gpu::stream::Stream;
use crate::gpu::{Gpu, Kernels};
use tcpxd_abi::loadMeta;

/// Receives and fragment entries one inline launch carries at most (3232 bytes of parameters,
/// under the classic 4 KiB limit).
pub const INLINE_MAX_TASKS: usize = 4;
pub const INLINE_MAX_FRAGS: usize = 256;

/// `struct InlineTask` of kernels/unpack.cu (40 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct InlineTask {
    bounce: u64,
    bounce_len: u64,
    dst: u64,
    dst_len: u64,
    first: u32,
    count: u32,
}

/// `struct PackedMeta` (12 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct PackedMeta {
    src_off: u32,
    len: u32,
    dst_off: u32,
}

const _: () = assert!(size_of::<InlineTask>() == 40);
const _: () = assert!(size_of::<PackedMeta>() == 12);

#[repr(C)]
struct InlineParams<const T: usize, const F: usize> {
    t: [InlineTask; T],
    m: [PackedMeta; F],
}

const _: () = assert!(size_of::<InlineParams<INLINE_MAX_TASKS, INLINE_MAX_FRAGS>>() == 3232);

/// What an inline batch holds so far: receives, entries, the largest receive.
#[derive(Debug, Default, Clone, Copy)]
struct InlineFill {
    tasks: usize,
    frags: usize,
    max_count: u32,
}

impl InlineFill {
    fn has_room(&self, tasks: usize, frags: usize, max_tasks: usize, max_frags: usize) -> bool {
        self.tasks + tasks <= max_tasks && self.frags + frags <= max_frags
    }

    /// Counts in a receive of `count` entries: its task slot, its descriptor and the range of
    /// its entries.
    fn add(
        &mut self,
        bounce: DeviceSpan,
        dst: DeviceSpan,
        count: usize,
    ) -> (usize, InlineTask, Range<usize>) {
        let slot = self.tasks;
        let first = self.frags;
        let task = InlineTask {
            bounce: bounce.ptr(),
            bounce_len: bounce.len(),
            dst: dst.ptr(),
            dst_len: dst.len(),
            first: first as u32,
            count: count as u32,
        };
        self.tasks += 1;
        self.frags += count;
        self.max_count = self.max_count.max(count as u32);
        (slot, task, first..first + count)
    }

    fn refusal(&self, what: &str, count: usize) -> GpuError {
        GpuError::InvalidArgument(format!(
            "{count} fragments do not fit the {what} ({} receives, {} fragments queued)",
            self.tasks, self.frags
        ))
    }
}

/// Receives whose fragment lists travel inside the kernel's parameters (no upload before the
/// launch). Allocated once; filled by [`InlineBatch::push`], emptied by
/// [`Gpu::launch_unpack_inline`].
pub struct InlineBatch {
    params: InlineParams<INLINE_MAX_TASKS, INLINE_MAX_FRAGS>,
    fill: InlineFill,
}

impl std::fmt::Debug for InlineBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InlineBatch").field("fill", &self.fill).finish()
    }
}

impl Default for InlineBatch {
    fn default() -> Self {
        Self::new()
    }
}

impl InlineBatch {
    pub fn new() -> InlineBatch {
        InlineBatch {
            params: InlineParams {
                t: [InlineTask::default(); INLINE_MAX_TASKS],
                m: [PackedMeta::default(); INLINE_MAX_FRAGS],
            },
            fill: InlineFill::default(),
        }
    }

    /// Whether a receive with `dst` can go inline at all (offsets must fit 32 bits).
    pub fn accepts(dst: DeviceSpan, count: usize) -> bool {
        dst.len() <= u64::from(u32::MAX) && count <= INLINE_MAX_FRAGS
    }

    /// Whether a receive of `count` fragments still fits this batch.
    pub fn has_room(&self, count: usize) -> bool {
        self.fill.has_room(1, count, INLINE_MAX_TASKS, INLINE_MAX_FRAGS)
    }

    pub fn is_empty(&self) -> bool {
        self.fill.tasks == 0
    }

    /// Adds a receive (the caller checked [`InlineBatch::accepts`] and
    /// [`InlineBatch::has_room`]; refused otherwise).
    pub fn push(&mut self, frags: &[loadMeta], bounce: DeviceSpan, dst: DeviceSpan) -> GpuResult<()> {
        if !Self::accepts(dst, frags.len()) || !self.has_room(frags.len()) {
            return Err(self.fill.refusal("inline batch", frags.len()));
        }
        let (slot, task, entries) = self.fill.add(bounce, dst, frags.len());
        self.params.t[slot] = task;
        for (d, f) in self.params.m[entries].iter_mut().zip(frags) {
            // Entries past 32 bits would not be in `dst` (validated) — clamp into an
            // out-of-bounds value the kernel rejects rather than wrapping.
            *d = PackedMeta {
                src_off: f.src_off,
                len: f.len,
                dst_off: u32::try_from(f.dst_off).unwrap_or(u32::MAX),
            };
        }
        Ok(())
    }

    /// The largest receive queued (fragments), to size the grid.
    pub fn max_count(&self) -> u32 {
        self.fill.max_count
    }

    /// Drops what was pushed without launching it (a batch that failed half-filled must not
    /// carry its receives into the next launch).
    pub fn discard(&mut self) {
        self.fill = InlineFill::default();
    }
}

impl Gpu {
    /// Launches the inline unpack kernel over `batch` and empties the batch. Errors are reported as by [`Gpu::launch_unpack`].
    pub fn launch_unpack_inline(
        &self,
        kernels: &Kernels,
        stream: &Stream,
        batch: &mut InlineBatch,
        blocks_per_task: u32,
        report: LaunchReport<'_>,
    ) -> GpuResult<()> {
        let params =
            (&mut batch.params as *mut InlineParams<INLINE_MAX_TASKS, INLINE_MAX_FRAGS>).cast::<c_void>();
        // SAFETY: `params` is `tcpxd_unpack_inline_small`'s `InlineParams<4, 256>` (size asserted
        // above), live for the call, and `batch.fill` counts what `push` put in it; its addresses
        // come from DeviceSpans and every entry is bounds-checked in the kernel.
        unsafe {
            self.launch_inline(
                kernels.unpack_inline_small,
                stream,
                params,
                &mut batch.fill,
                blocks_per_task,
                report,
            )
        }
    }
}

/// Receives and whole-page entries one page-inline launch carries at most (8832 bytes of
/// parameters: CUDA 12.1+).
pub const INLINE_PAGES_MAX_TASKS: usize = 16;
pub const INLINE_PAGES_MAX_FRAGS: usize = 2048;

#[repr(C)]
struct InlinePages<const T: usize, const F: usize> {
    t: [InlineTask; T],
    m: [u32; F],
}

const _: () = assert!(size_of::<InlinePages<INLINE_PAGES_MAX_TASKS, INLINE_PAGES_MAX_FRAGS>>() == 8832);

/// Receives made only of whole 4 KiB pages ([`ListFormat::Page32`]) whose lists travel in the
/// kernel's parameters: up to 16 receives and 2048 pages, so a batch of sixteen 512 KiB chunks
/// needs neither an upload nor a read of host memory. Allocated once; filled by
/// [`InlinePagesBatch::push`], emptied by [`Gpu::launch_unpack_inline_pages`].
pub struct InlinePagesBatch {
    params: Box<InlinePages<INLINE_PAGES_MAX_TASKS, INLINE_PAGES_MAX_FRAGS>>,
    fill: InlineFill,
}

impl std::fmt::Debug for InlinePagesBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InlinePagesBatch")
            .field("fill", &self.fill)
            .finish()
    }
}

impl Default for InlinePagesBatch {
    fn default() -> Self {
        Self::new()
    }
}

impl InlinePagesBatch {
    pub fn new() -> InlinePagesBatch {
        InlinePagesBatch {
            params: Box::new(InlinePages {
                t: [InlineTask::default(); INLINE_PAGES_MAX_TASKS],
                m: [0; INLINE_PAGES_MAX_FRAGS],
            }),
            fill: InlineFill::default(),
        }
    }

    /// Whether `n` more receives holding `frags` pages in all still fit.
    pub fn has_room(&self, n: usize, frags: usize) -> bool {
        self.fill
            .has_room(n, frags, INLINE_PAGES_MAX_TASKS, INLINE_PAGES_MAX_FRAGS)
    }

    pub fn is_empty(&self) -> bool {
        self.fill.tasks == 0
    }

    /// Adds a receive whose fragments are all whole pages ([`ListFormat::choose`] said
    /// `Page32`); refused otherwise, or when it does not fit.
    pub fn push(&mut self, frags: &[loadMeta], bounce: DeviceSpan, dst: DeviceSpan) -> GpuResult<()> {
        if !self.has_room(1, frags.len()) || ListFormat::choose(frags, dst.len()) != ListFormat::Page32 {
            return Err(self.fill.refusal("page-inline batch", frags.len()));
        }
        let (slot, task, entries) = self.fill.add(bounce, dst, frags.len());
        self.params.t[slot] = task;
        for (o, f) in self.params.m[entries].iter_mut().zip(frags) {
            *o = page32(f);
        }
        Ok(())
    }

    pub fn max_count(&self) -> u32 {
        self.fill.max_count
    }

    /// Drops what was pushed without launching it (see [`InlineBatch::discard`]).
    pub fn discard(&mut self) {
        self.fill = InlineFill::default();
    }
}

impl Gpu {
    /// Launches the page-inline unpack kernel over `batch` and empties the batch. Errors are
    /// reported as by [`Gpu::launch_unpack`].
    pub fn launch_unpack_inline_pages(
        &self,
        kernels: &Kernels,
        stream: &Stream,
        batch: &mut InlinePagesBatch,
        blocks_per_task: u32,
        report: LaunchReport<'_>,
    ) -> GpuResult<()> {
        let params = (&mut *batch.params as *mut InlinePages<INLINE_PAGES_MAX_TASKS, INLINE_PAGES_MAX_FRAGS>)
            .cast::<c_void>();
        // SAFETY: `params` is `tcpxd_unpack_inline_pages`'s `InlinePages<16, 2048>` (size asserted
        // above), live for the call, and `batch.fill` counts what `push` put in it; its addresses
        // come from DeviceSpans and every entry is bounds-checked in the kernel.
        unsafe {
            self.launch_inline(
                kernels.unpack_inline_pages,
                stream,
                params,
                &mut batch.fill,
                blocks_per_task,
                report,
            )
        }
    }
}

impl Gpu {
    /// What both inline launches do with their batch: nothing when it is empty; otherwise
    /// checks the error word, launches `func` with (`params`, error pointer, signal) on a grid of
    /// `blocks_per_task` × `fill.tasks` blocks, and empties the batch (`fill`) whatever the
    /// outcome.
    ///
    /// # Safety
    /// `params` must point at the parameter struct `func` takes, alive for the call (the driver
    /// copies it at launch), `fill` must count what it holds, and every address in it must stay
    /// valid until the work completes.
    unsafe fn launch_inline(
        &self,
        func: sys::CUfunction,
        stream: &Stream,
        params: *mut c_void,
        fill: &mut InlineFill,
        blocks_per_task: u32,
        report: LaunchReport<'_>,
    ) -> GpuResult<()> {
        if fill.tasks == 0 {
            return Ok(());
        }
        // Emptied whatever the outcome; only the count is reset, `params` stays as filled.
        let tasks = std::mem::take(fill).tasks;
        let mut err_ptr = report.err_ptr()?;
        let grid = (blocks_per_task.clamp(1, 65_535), tasks as u32);
        let block = UNPACK_WARPS_PER_BLOCK * 32;
        let mut signal = report.signal;
        let mut args = [
            params,
            (&mut err_ptr as *mut u64).cast::<c_void>(),
            (&mut signal as *mut LaunchSignal).cast::<c_void>(),
        ];
        // SAFETY: the caller vouches for `params` and `fill`; the error word is inside a live
        // pinned allocation (checked above), and so is the signal's done word (LaunchSignal::new).
        unsafe { self.launch(func, grid, block, stream, &mut args, false) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(ptr: u64, len: u64) -> DeviceSpan {
        DeviceSpan::for_validation_tests(ptr, len)
    }

    fn pages(n: u32) -> Vec<loadMeta> {
        (0..n)
            .map(|i| loadMeta {
                src_off: i * 4096,
                len: 4096,
                dst_off: u64::from(i) * 4096,
            })
            .collect()
    }

    #[test]
    fn a_discarded_batch_is_empty_and_takes_a_full_batch_again() {
        let mut b = InlineBatch::new();
        let frags = pages(4);
        while b.has_room(frags.len()) {
            b.push(&frags, span(1 << 20, 1 << 20), span(1 << 30, 1 << 20))
                .unwrap();
        }
        assert!(!b.is_empty());
        assert!(
            b.push(&frags, span(1 << 20, 1 << 20), span(1 << 30, 1 << 20))
                .is_err()
        );
        b.discard();
        assert!(b.is_empty() && b.max_count() == 0 && b.has_room(frags.len()));

        let mut p = InlinePagesBatch::new();
        p.push(&frags, span(1 << 20, 1 << 20), span(1 << 30, 1 << 20))
            .unwrap();
        assert!(!p.is_empty() && p.max_count() == 4);
        p.discard();
        assert!(p.is_empty() && p.max_count() == 0);
    }
}
