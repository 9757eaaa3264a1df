//! The block-transfer kernels of kernels/blocks.cu: the sender's gather of a chunk's scattered
//! source blocks into a contiguous staging slot, and the receiver's scatter of a received chunk's
//! fragments into its blocks, both driven by the chunk's table of pieces
//! (`engine::blocks::Segment`, 16 bytes each, in wire order). One launch covers up to
//! [`BLOCK_TASKS`] chunks.
//!
//! The kernels are loaded with the others ([`super::Kernels`]: PTX from nvcc at build time, else
//! NVRTC at start-up).

use std::ffi::c_void;

use cudarc::driver::sys;
use tcpxd_abi::loadMeta;

use super::error::{GpuError, GpuResult};
use super::{DeviceRegion, DeviceSpan, Gpu, Kernels, PinnedRegion, Stream};
use crate::engine::blocks::Segment;

/// Chunks per launch (`BLOCK_TASKS` in kernels/blocks.cu).
pub const BLOCK_TASKS: usize = 16;
/// Warps per thread block (`BLOCK_WARPS`).
const BLOCK_WARPS: u32 = 8;
/// Bytes of a chunk each warp of the gather takes at a time (`GATHER_UNIT`).
pub const GATHER_UNIT: u32 = 4096;

/// The table sizes (pieces) of the inline kernels (`INLINE_KERNELS` in kernels/blocks.cu): a
/// launch whose tables hold at most the largest travels whole in its parameter block.
pub const INLINE_CAPS: [usize; 2] = [256, 576];

/// The parameter block of `tcpxd_{gather,scatter}_blocks_inline_<CAP>` (`InlineTables`): the
/// tasks, each with the index of its first piece in `segs` where the table's address would be.
#[repr(C, align(16))]
struct InlineTables<T, const CAP: usize> {
    tasks: [T; BLOCK_TASKS],
    err: u64,
    pad: u64,
    done: BlockSignal,
    segs: [Segment; CAP],
}

/// `struct BlockSignal` of kernels/blocks.cu: how a batch's last launch reports the batch done
/// with no CUDA event. Every thread block of a launch that carries a signal counts itself on a
/// device u32 once its copies are done; the last one resets the count and stores `seq` into a
/// host-mapped u64 (system-scope release after a system fence), so the host sees the batch done
/// with one load and the error word is visible before it. [`BlockSignal::NONE`]: no report
/// (every launch of a batch but its last; tests).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockSignal {
    counter: u64,
    word: u64,
    seq: u64,
    pad: u64,
}

const _: () = assert!(size_of::<BlockSignal>() == 32);

impl BlockSignal {
    /// Reports nothing.
    pub const NONE: BlockSignal = BlockSignal {
        counter: 0,
        word: 0,
        seq: 0,
        pad: 0,
    };

    /// Stores `seq` into the u64 at byte `word_off` of `word` (pinned, host-mapped) once every
    /// block of the launch is done, counting on the u32 at byte 0 of `counter` (device memory,
    /// zero between launches: the last block resets it). Launches carrying a signal on one
    /// counter must not overlap (plain launches on one stream).
    pub fn new(
        counter: &DeviceRegion,
        word: &PinnedRegion,
        word_off: usize,
        seq: u64,
    ) -> GpuResult<BlockSignal> {
        counter.check(0, 4)?;
        word.check(word_off as u64, 8)?;
        if word_off % 8 != 0 {
            return Err(GpuError::InvalidArgument("unaligned completion word".into()));
        }
        Ok(BlockSignal {
            counter: counter.device_ptr(),
            word: word.device_ptr() + word_off as u64,
            seq,
            pad: 0,
        })
    }
}

/// A block task (the gather's or the scatter's): which kernels run it, its piece count, whether
/// its table is placed, and a copy of it pointing at piece `index` of an inline parameter
/// block's table.
pub trait InlineTask: Copy + Default {
    /// Which kernel: 0 the gather, 1 the scatter (`Kernels::blocks_inline`'s first index).
    const KERNEL: usize;
    /// The kernel that reads the task's table where it is placed.
    fn placed_kernel(kernels: &Kernels) -> sys::CUfunction;
    fn pieces(&self) -> u32;
    fn placed(&self) -> bool;
    fn at_inline_index(self, index: u64) -> Self;
}

impl InlineTask for GatherTask {
    const KERNEL: usize = 0;
    fn placed_kernel(kernels: &Kernels) -> sys::CUfunction {
        kernels.gather_blocks
    }
    fn pieces(&self) -> u32 {
        self.nsegs
    }
    fn placed(&self) -> bool {
        GatherTask::placed(self)
    }
    fn at_inline_index(mut self, index: u64) -> Self {
        self.segs = index;
        self
    }
}

impl InlineTask for ScatterTask {
    const KERNEL: usize = 1;
    fn placed_kernel(kernels: &Kernels) -> sys::CUfunction {
        kernels.scatter_blocks
    }
    fn pieces(&self) -> u32 {
        self.nsegs
    }
    fn placed(&self) -> bool {
        ScatterTask::placed(self)
    }
    fn at_inline_index(mut self, index: u64) -> Self {
        self.segs = index;
        self
    }
}

/// Checks that `segs` holds `nsegs` 16-byte-aligned pieces (`engine::blocks::Segment`).
fn check_table(segs: DeviceSpan, nsegs: u32) -> GpuResult<()> {
    if segs.ptr() % 16 != 0 {
        return Err(GpuError::InvalidArgument(
            "a block table must be 16-byte aligned".into(),
        ));
    }
    if u64::from(nsegs) * 16 > segs.len() {
        return Err(GpuError::InvalidArgument(format!(
            "{nsegs} pieces do not fit a {}-byte table",
            segs.len()
        )));
    }
    Ok(())
}

/// One chunk to gather: `struct GatherTask` of kernels/blocks.cu.
#[repr(C, align(16))]
#[derive(Debug, Clone, Copy, Default)]
pub struct GatherTask {
    segs: u64,
    src: u64,
    src_len: u64,
    dst: u64,
    nsegs: u32,
    bytes: u32,
    pad: u64,
}

const _: () = assert!(size_of::<GatherTask>() == 48);

impl GatherTask {
    /// Whether its table is placed (a task is launchable only then).
    pub fn placed(&self) -> bool {
        self.segs != 0
    }

    /// Pieces in the task's table.
    pub fn nsegs(&self) -> u32 {
        self.nsegs
    }

    /// Points the task at another copy of its table (`nsegs` pieces): the batch's copy in
    /// device memory (`unpack::block_batch`), which every thread block of the launch reads
    /// instead of pinned host memory across PCIe.
    pub fn relocate_table(&mut self, segs: DeviceSpan) -> GpuResult<()> {
        check_table(segs, self.nsegs)?;
        self.segs = segs.ptr();
        Ok(())
    }

    /// Chunk of `bytes` bytes into `dst` (the staging slot), from `src` per the `nsegs` pieces
    /// of `segs` (device-visible). The kernel skips (and reports) a piece outside `src` or the
    /// chunk.
    pub fn new(
        segs: DeviceSpan,
        nsegs: u32,
        src: DeviceSpan,
        dst: DeviceSpan,
        bytes: u32,
    ) -> GpuResult<GatherTask> {
        let mut t = GatherTask::unplaced(nsegs, src, dst, bytes)?;
        t.relocate_table(segs)?;
        Ok(t)
    }

    /// As [`GatherTask::new`], its table not placed yet: a batch places it
    /// (`unpack::block_batch`, from the table pushed with the task). Not launchable before.
    pub fn unplaced(nsegs: u32, src: DeviceSpan, dst: DeviceSpan, bytes: u32) -> GpuResult<GatherTask> {
        if u64::from(bytes) > dst.len() {
            return Err(GpuError::InvalidArgument(format!(
                "a {bytes}-byte chunk does not fit a {}-byte staging slot",
                dst.len()
            )));
        }
        Ok(GatherTask {
            segs: 0,
            src: src.ptr(),
            src_len: src.len(),
            dst: dst.ptr(),
            nsegs,
            bytes,
            pad: 0,
        })
    }
}

/// One received chunk to scatter: `struct ScatterTask` of kernels/blocks.cu.
#[repr(C, align(16))]
#[derive(Debug, Clone, Copy, Default)]
pub struct ScatterTask {
    frags: u64,
    bounce: u64,
    bounce_len: u64,
    segs: u64,
    dst: u64,
    dst_len: u64,
    count: u32,
    nsegs: u32,
    bytes: u32,
    pad: u32,
}

const _: () = assert!(size_of::<ScatterTask>() == 64);

impl ScatterTask {
    /// Whether its table is placed (a task is launchable only then).
    pub fn placed(&self) -> bool {
        self.segs != 0
    }

    /// Pieces in the task's table.
    pub fn nsegs(&self) -> u32 {
        self.nsegs
    }

    /// Points the task at another copy of its table (`nsegs` pieces): the batch's copy in
    /// device memory (`unpack::block_batch`), which every thread block of the launch reads
    /// instead of pinned host memory across PCIe.
    pub fn relocate_table(&mut self, segs: DeviceSpan) -> GpuResult<()> {
        check_table(segs, self.nsegs)?;
        self.segs = segs.ptr();
        Ok(())
    }

    /// The `count` fragments of `frags` (device-visible loadMeta, `dst_off` = offset in the
    /// chunk of `bytes` bytes), from `bounce` into `dst` per the `nsegs` pieces of `segs`. The
    /// kernel skips (and reports) a fragment outside the chunk or `bounce`, and a piece outside
    /// `dst`.
    pub fn new(
        frags: DeviceSpan,
        count: u32,
        bounce: DeviceSpan,
        segs: DeviceSpan,
        nsegs: u32,
        bytes: u32,
        dst: DeviceSpan,
    ) -> GpuResult<ScatterTask> {
        let mut t = ScatterTask::unplaced(frags, count, bounce, nsegs, bytes, dst)?;
        t.relocate_table(segs)?;
        Ok(t)
    }

    /// As [`ScatterTask::new`], its table not placed yet (see [`GatherTask::unplaced`]).
    pub fn unplaced(
        frags: DeviceSpan,
        count: u32,
        bounce: DeviceSpan,
        nsegs: u32,
        bytes: u32,
        dst: DeviceSpan,
    ) -> GpuResult<ScatterTask> {
        if u64::from(count) * size_of::<loadMeta>() as u64 > frags.len() {
            return Err(GpuError::InvalidArgument(format!(
                "{count} fragments do not fit a {}-byte list",
                frags.len()
            )));
        }
        Ok(ScatterTask {
            frags: frags.ptr(),
            bounce: bounce.ptr(),
            bounce_len: bounce.len(),
            segs: 0,
            dst: dst.ptr(),
            dst_len: dst.len(),
            count,
            nsegs,
            bytes,
            pad: 0,
        })
    }
}

#[repr(C, align(16))]
struct Tasks<T, const N: usize> {
    t: [T; N],
}

/// The device address of the u32 at `off` of `err` (checked).
fn err_ptr(err: &PinnedRegion, off: usize) -> GpuResult<u64> {
    err.check(off as u64, 4)?;
    if off % 4 != 0 {
        return Err(GpuError::InvalidArgument("unaligned error word".into()));
    }
    Ok(err.device_ptr() + off as u64)
}

impl Gpu {
    /// Gathers up to [`BLOCK_TASKS`] chunks in one launch, `blocks_per_task` blocks of 256
    /// threads each. A piece the kernel finds out of bounds is skipped and
    /// `1 + (task << 12 | unit)` is stored in the u32 at `err_off` of `err`; `done` reports the
    /// launch finished ([`BlockSignal`]).
    #[allow(clippy::too_many_arguments)]
    pub fn launch_gather_blocks(
        &self,
        kernels: &Kernels,
        stream: &Stream,
        tasks: &[GatherTask],
        blocks_per_task: u32,
        err: &PinnedRegion,
        err_off: usize,
        done: BlockSignal,
    ) -> GpuResult<()> {
        self.launch_placed_blocks(kernels, stream, tasks, blocks_per_task, err, err_off, done)
    }

    /// Scatters up to [`BLOCK_TASKS`] received chunks in one launch. A fragment or piece the
    /// kernel finds out of bounds is skipped and `1 + (task << 12 | fragment)` is stored in the
    /// u32 at `err_off` of `err`; `done` reports the launch finished ([`BlockSignal`]).
    #[allow(clippy::too_many_arguments)]
    pub fn launch_scatter_blocks(
        &self,
        kernels: &Kernels,
        stream: &Stream,
        tasks: &[ScatterTask],
        blocks_per_task: u32,
        err: &PinnedRegion,
        err_off: usize,
        done: BlockSignal,
    ) -> GpuResult<()> {
        self.launch_placed_blocks(kernels, stream, tasks, blocks_per_task, err, err_off, done)
    }

    /// Launches up to [`BLOCK_TASKS`] gathers or scatters (by `T`) whose tables are placed
    /// (device-visible): [`Gpu::launch_gather_blocks`] / [`Gpu::launch_scatter_blocks`].
    #[allow(clippy::too_many_arguments)]
    pub fn launch_placed_blocks<T: InlineTask>(
        &self,
        kernels: &Kernels,
        stream: &Stream,
        tasks: &[T],
        blocks_per_task: u32,
        err: &PinnedRegion,
        err_off: usize,
        done: BlockSignal,
    ) -> GpuResult<()> {
        if !tasks.iter().all(T::placed) {
            return Err(unplaced());
        }
        self.launch_blocks(
            T::placed_kernel(kernels),
            stream,
            tasks,
            blocks_per_task,
            err,
            err_off,
            done,
        )
    }

    /// Copies `bytes` (a multiple of 16) of block tables from `src` (pinned host memory's
    /// device view) to `dst` (device memory) with a small kernel on `stream`: on the SMs, not a
    /// copy engine (see kernels/blocks.cu, `tcpxd_copy_tables`).
    pub fn launch_copy_tables(
        &self,
        kernels: &Kernels,
        stream: &Stream,
        src: DeviceSpan,
        dst: DeviceSpan,
        bytes: u64,
    ) -> GpuResult<()> {
        if bytes % 16 != 0
            || bytes > src.len()
            || bytes > dst.len()
            || src.ptr() % 16 != 0
            || dst.ptr() % 16 != 0
        {
            return Err(GpuError::InvalidArgument(format!(
                "a table copy of {bytes} bytes from a {}-byte span into a {}-byte span (16-byte aligned and sized)",
                src.len(),
                dst.len()
            )));
        }
        let words = bytes / 16;
        if words == 0 {
            return Ok(());
        }
        let n = u32::try_from(words)
            .map_err(|_| GpuError::InvalidArgument(format!("a table copy of {bytes} bytes")))?;
        let (mut s, mut d, mut count) = (src.ptr(), dst.ptr(), n);
        let mut params = [
            (&mut s as *mut u64).cast::<c_void>(),
            (&mut d as *mut u64).cast::<c_void>(),
            (&mut count as *mut u32).cast::<c_void>(),
        ];
        let grid = (n.div_ceil(256).clamp(1, 64), 1);
        // SAFETY: both spans are valid for `bytes` bytes until the work completes (DeviceSpan's
        // contract; checked against `bytes` above), 16-byte aligned as the kernel's uint4 access
        // needs; the kernel writes only `dst[..n]` and reads only `src[..n]`. Parameters are
        // copied at launch.
        unsafe { self.launch(kernels.copy_tables, grid, 256, stream, &mut params, false) }
    }

    #[allow(clippy::too_many_arguments)]
    fn launch_blocks<T: Copy + Default>(
        &self,
        f: sys::CUfunction,
        stream: &Stream,
        tasks: &[T],
        blocks_per_task: u32,
        err: &PinnedRegion,
        err_off: usize,
        mut done: BlockSignal,
    ) -> GpuResult<()> {
        if tasks.is_empty() {
            return Ok(());
        }
        if tasks.len() > BLOCK_TASKS {
            return Err(GpuError::InvalidArgument(format!(
                "{} block tasks in one launch (at most {BLOCK_TASKS})",
                tasks.len()
            )));
        }
        let mut err_ptr = err_ptr(err, err_off)?;
        let mut arr = Tasks::<T, BLOCK_TASKS> {
            t: [T::default(); BLOCK_TASKS],
        };
        arr.t[..tasks.len()].copy_from_slice(tasks);
        let mut params = [
            (&mut arr as *mut Tasks<T, BLOCK_TASKS>).cast::<c_void>(),
            (&mut err_ptr as *mut u64).cast::<c_void>(),
            (&mut done as *mut BlockSignal).cast::<c_void>(),
        ];
        let grid = (blocks_per_task.clamp(1, 65_535), tasks.len() as u32);
        // SAFETY: `T` is GatherTask or ScatterTask (the only callers), whose layouts match the
        // kernels' `Tasks<GatherTask, 16>` / `Tasks<ScatterTask, 16>` parameter (sizes asserted
        // above); every address in them comes from a DeviceSpan (valid until the work completes
        // by that type's contract) and is bounds-checked in the kernel; the error word lies in a
        // live pinned allocation (checked), the signal's counter and word in live allocations
        // (BlockSignal::new checked them; NONE is never dereferenced). Parameters are copied at
        // launch.
        unsafe { self.launch(f, grid, BLOCK_WARPS * 32, stream, &mut params, false) }
    }
}

impl Gpu {
    /// Launches up to [`BLOCK_TASKS`] gathers or scatters (by `T`) with their tables in
    /// the parameter block: `table` holds the tasks' pieces back to back, in task order (at most
    /// the largest of [`INLINE_CAPS`]; the smallest size that fits is launched). The tasks need
    /// not be placed. A piece or fragment out of bounds is reported as by the other launches.
    #[allow(clippy::too_many_arguments)]
    pub fn launch_blocks_inline<T: InlineTask>(
        &self,
        kernels: &Kernels,
        stream: &Stream,
        tasks: &[T],
        table: &[Segment],
        blocks_per_task: u32,
        err: &PinnedRegion,
        err_off: usize,
        done: BlockSignal,
    ) -> GpuResult<()> {
        if tasks.is_empty() {
            return Ok(());
        }
        if tasks.len() > BLOCK_TASKS {
            return Err(GpuError::InvalidArgument(format!(
                "{} block tasks in one launch (at most {BLOCK_TASKS})",
                tasks.len()
            )));
        }
        let pieces: u64 = tasks.iter().map(|t| u64::from(t.pieces())).sum();
        if pieces != table.len() as u64 {
            return Err(GpuError::InvalidArgument(format!(
                "{} pieces in the tasks, {} in the inline table",
                pieces,
                table.len()
            )));
        }
        let err = err_ptr(err, err_off)?;
        match INLINE_CAPS.iter().position(|&cap| table.len() <= cap) {
            Some(0) => {
                let f = kernels.blocks_inline[T::KERNEL][0];
                self.launch_tables_inline::<T, { INLINE_CAPS[0] }>(
                    f,
                    stream,
                    tasks,
                    table,
                    blocks_per_task,
                    err,
                    done,
                )
            }
            Some(_) => {
                let f = kernels.blocks_inline[T::KERNEL][1];
                self.launch_tables_inline::<T, { INLINE_CAPS[1] }>(
                    f,
                    stream,
                    tasks,
                    table,
                    blocks_per_task,
                    err,
                    done,
                )
            }
            None => Err(GpuError::InvalidArgument(format!(
                "a {}-piece table does not fit the inline kernels (at most {})",
                table.len(),
                INLINE_CAPS[INLINE_CAPS.len() - 1]
            ))),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn launch_tables_inline<T: InlineTask, const CAP: usize>(
        &self,
        f: sys::CUfunction,
        stream: &Stream,
        tasks: &[T],
        table: &[Segment],
        blocks_per_task: u32,
        err: u64,
        done: BlockSignal,
    ) -> GpuResult<()> {
        let mut p = InlineTables::<T, CAP> {
            tasks: [T::default(); BLOCK_TASKS],
            err,
            pad: 0,
            done,
            segs: [Segment::default(); CAP],
        };
        let mut at = 0u64;
        for (slot, t) in p.tasks.iter_mut().zip(tasks) {
            *slot = t.at_inline_index(at);
            at += u64::from(t.pieces());
        }
        p.segs[..table.len()].copy_from_slice(table);
        let mut params = [(&mut p as *mut InlineTables<T, CAP>).cast::<c_void>()];
        let grid = (blocks_per_task.clamp(1, 65_535), tasks.len() as u32);
        // SAFETY: `f` is `tcpxd_{gather,scatter}_blocks_inline_<CAP>` for this `T` and `CAP`
        // (chosen by the caller), whose one parameter is `InlineTables<T, CAP>`: the same
        // layout (repr(C), 16-byte tasks and pieces; sizes asserted below). Each task's table
        // index plus its piece count lies inside `segs` (the counts were summed against the
        // table); every other address comes from a DeviceSpan, valid until the work completes,
        // and is bounds-checked in the kernel; the error word lies in a live pinned allocation,
        // the signal's counter and word in live allocations (checked by BlockSignal::new).
        // Parameters are copied at launch.
        unsafe { self.launch(f, grid, BLOCK_WARPS * 32, stream, &mut params, false) }
    }
}

const _: () = assert!(size_of::<InlineTables<GatherTask, 256>>() == 48 * 16 + 16 + 32 + 256 * 16);
const _: () = assert!(size_of::<InlineTables<ScatterTask, 576>>() == 64 * 16 + 16 + 32 + 576 * 16);

fn unplaced() -> GpuError {
    GpuError::InvalidArgument("a block task launched before its table was placed".into())
}
