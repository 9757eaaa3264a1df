//! Safe launch of the unpack kernel (`kernels/unpack.cu`).

use std::ffi::c_void;

use super::error::{GpuError, GpuResult};
use super::memory::{DeviceSpan, PinnedRegion};
use super::stream::Stream;
use super::{Gpu, Kernels};
use crate::net::abi::loadMeta;

/// Tasks one launch carries (passed by value as a kernel parameter: 64 × 48 = 3 KiB).
pub const UNPACK_MAX_TASKS_PER_LAUNCH: usize = 64;
/// Warps per block of the unpack kernel (256 threads).
pub const UNPACK_WARPS_PER_BLOCK: u32 = 8;
const SMALL_LAUNCH: usize = 8;

/// One receive for the unpack kernel: `struct UnpackTask` of kernels/unpack.cu.
#[repr(C, align(16))]
#[derive(Debug, Clone, Copy, Default)]
pub struct UnpackTask {
    frags: u64,
    bounce: u64,
    bounce_len: u64,
    dst: u64,
    dst_len: u64,
    count: u32,
    pad: u32,
}

const _: () = assert!(size_of::<UnpackTask>() == 48);

impl UnpackTask {
    /// `count` fragments read from `frags` (device-visible), copied from `bounce` into `dst`.
    /// The kernel skips (and reports) any fragment outside `bounce` or `dst`.
    pub fn new(frags: DeviceSpan, count: u32, bounce: DeviceSpan, dst: DeviceSpan) -> GpuResult<UnpackTask> {
        if u64::from(count) * size_of::<loadMeta>() as u64 > frags.len() {
            return Err(GpuError::InvalidArgument(format!(
                "{count} fragments do not fit a {}-byte list",
                frags.len()
            )));
        }
        Ok(UnpackTask {
            frags: frags.ptr(),
            bounce: bounce.ptr(),
            bounce_len: bounce.len(),
            dst: dst.ptr(),
            dst_len: dst.len(),
            count,
            pad: 0,
        })
    }

    pub fn count(&self) -> u32 {
        self.count
    }
}

#[repr(C, align(16))]
struct TaskArray<const N: usize> {
    t: [UnpackTask; N],
}

impl Gpu {
    /// Launches the unpack kernel over `tasks` (at most [`UNPACK_MAX_TASKS_PER_LAUNCH`]) with
    /// `blocks_per_task` blocks of 256 threads per task. A fragment the kernel finds out of
    /// bounds is skipped and `1 + (task << 12 | fragment)` is stored in the u32 at byte `err_off`
    /// of `err`.
    pub fn launch_unpack(
        &self,
        kernels: &Kernels,
        stream: &Stream,
        tasks: &[UnpackTask],
        blocks_per_task: u32,
        err: &PinnedRegion,
        err_off: usize,
    ) -> GpuResult<()> {
        if tasks.is_empty() {
            return Ok(());
        }
        if tasks.len() > UNPACK_MAX_TASKS_PER_LAUNCH {
            return Err(GpuError::InvalidArgument(format!(
                "{} unpack tasks in one launch (at most {UNPACK_MAX_TASKS_PER_LAUNCH})",
                tasks.len()
            )));
        }
        err.check(err_off as u64, 4)?;
        if err_off % 4 != 0 {
            return Err(GpuError::InvalidArgument("unaligned error word".into()));
        }
        let mut err_ptr = err.device_ptr() + err_off as u64;
        let grid = (blocks_per_task.clamp(1, 65_535), tasks.len() as u32);
        let block = UNPACK_WARPS_PER_BLOCK * 32;
        if tasks.len() <= SMALL_LAUNCH {
            let mut arr = TaskArray::<SMALL_LAUNCH> {
                t: [UnpackTask::default(); SMALL_LAUNCH],
            };
            arr.t[..tasks.len()].copy_from_slice(tasks);
            let mut params = [
                (&mut arr as *mut TaskArray<SMALL_LAUNCH>).cast::<c_void>(),
                (&mut err_ptr as *mut u64).cast::<c_void>(),
            ];
            // SAFETY: the parameters match `tcpxd_unpack_8(TaskArray<8>, u32*)` (layout asserted
            // above); every address the kernel uses comes from a DeviceSpan (valid until the work
            // completes by that type's contract) and is bounds-checked in the kernel; the error
            // word is inside a live pinned allocation (checked). Parameters are copied at launch.
            unsafe { self.launch(kernels.unpack_8, grid, block, stream, &mut params) }
        } else {
            let mut arr = TaskArray::<UNPACK_MAX_TASKS_PER_LAUNCH> {
                t: [UnpackTask::default(); UNPACK_MAX_TASKS_PER_LAUNCH],
            };
            arr.t[..tasks.len()].copy_from_slice(tasks);
            let mut params = [
                (&mut arr as *mut TaskArray<UNPACK_MAX_TASKS_PER_LAUNCH>).cast::<c_void>(),
                (&mut err_ptr as *mut u64).cast::<c_void>(),
            ];
            // SAFETY: as above, for `tcpxd_unpack_64(TaskArray<64>, u32*)`.
            unsafe { self.launch(kernels.unpack_64, grid, block, stream, &mut params) }
        }
    }
}

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

/// Receives whose fragment lists travel inside the kernel's parameters (no upload before the
/// launch). Allocated once; filled by [`InlineBatch::push`], emptied by
/// [`Gpu::launch_unpack_inline`].
pub struct InlineBatch {
    params: InlineParams<INLINE_MAX_TASKS, INLINE_MAX_FRAGS>,
    tasks: usize,
    frags: usize,
    max_count: u32,
}

impl std::fmt::Debug for InlineBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InlineBatch")
            .field("tasks", &self.tasks)
            .field("frags", &self.frags)
            .finish()
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
            tasks: 0,
            frags: 0,
            max_count: 0,
        }
    }

    /// Whether a receive with `dst` can go inline at all (offsets must fit 32 bits).
    pub fn accepts(dst: DeviceSpan, count: usize) -> bool {
        dst.len() <= u64::from(u32::MAX) && count <= INLINE_MAX_FRAGS
    }

    /// Whether a receive of `count` fragments still fits this batch.
    pub fn has_room(&self, count: usize) -> bool {
        self.tasks < INLINE_MAX_TASKS && self.frags + count <= INLINE_MAX_FRAGS
    }

    pub fn is_empty(&self) -> bool {
        self.tasks == 0
    }

    /// Adds a receive (the caller checked [`InlineBatch::accepts`] and
    /// [`InlineBatch::has_room`]; refused otherwise).
    pub fn push(&mut self, frags: &[loadMeta], bounce: DeviceSpan, dst: DeviceSpan) -> GpuResult<()> {
        if !Self::accepts(dst, frags.len()) || !self.has_room(frags.len()) {
            return Err(GpuError::InvalidArgument(format!(
                "{} fragments do not fit the inline batch ({} receives, {} fragments queued)",
                frags.len(),
                self.tasks,
                self.frags
            )));
        }
        for (d, f) in self.params.m[self.frags..self.frags + frags.len()]
            .iter_mut()
            .zip(frags)
        {
            // Entries past 32 bits would not be in `dst` (validated) — clamp into an
            // out-of-bounds value the kernel rejects rather than wrapping.
            *d = PackedMeta {
                src_off: f.src_off,
                len: f.len,
                dst_off: u32::try_from(f.dst_off).unwrap_or(u32::MAX),
            };
        }
        self.params.t[self.tasks] = InlineTask {
            bounce: bounce.ptr(),
            bounce_len: bounce.len(),
            dst: dst.ptr(),
            dst_len: dst.len(),
            first: self.frags as u32,
            count: frags.len() as u32,
        };
        self.tasks += 1;
        self.frags += frags.len();
        self.max_count = self.max_count.max(frags.len() as u32);
        Ok(())
    }

    /// The largest receive queued (fragments), to size the grid.
    pub fn max_count(&self) -> u32 {
        self.max_count
    }

    fn clear(&mut self) {
        self.tasks = 0;
        self.frags = 0;
        self.max_count = 0;
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
        err: &PinnedRegion,
        err_off: usize,
    ) -> GpuResult<()> {
        if batch.is_empty() {
            return Ok(());
        }
        err.check(err_off as u64, 4)?;
        if err_off % 4 != 0 {
            return Err(GpuError::InvalidArgument("unaligned error word".into()));
        }
        let mut err_ptr = err.device_ptr() + err_off as u64;
        let grid = (blocks_per_task.clamp(1, 65_535), batch.tasks as u32);
        let block = UNPACK_WARPS_PER_BLOCK * 32;
        let mut params = [
            (&mut batch.params as *mut InlineParams<INLINE_MAX_TASKS, INLINE_MAX_FRAGS>).cast::<c_void>(),
            (&mut err_ptr as *mut u64).cast::<c_void>(),
        ];
        // SAFETY: the parameters match `tcpxd_unpack_inline_small(InlineParams<4, 256>, u32*)`
        // (size asserted above); addresses come from DeviceSpans and every entry is
        // bounds-checked in the kernel; the error word is in live pinned memory. The driver
        // copies the parameter block at launch.
        let result = unsafe { self.launch(kernels.unpack_inline_small, grid, block, stream, &mut params) };
        batch.clear();
        result
    }
}
