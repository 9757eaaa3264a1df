//! The block-transfer kernels of kernels/blocks.cu: the sender's gather of a chunk's scattered
//! source blocks into a contiguous staging slot, and the receiver's scatter of a received chunk's
//! fragments into its blocks, both driven by the chunk's table of pieces
//! (`engine::blocks::Segment`, 16 bytes each, in wire order). One launch covers up to
//! [`BLOCK_TASKS`] chunks.
//!
//! The module is compiled by NVRTC when first loaded (the unpack and checksum kernels may come
//! embedded as PTX; folding this one into [`super::Kernels`] and build.rs's nvcc list is the next
//! step of the block-transfer work).

use std::ffi::{CString, c_void};

use cudarc::driver::sys;

use super::error::{GpuError, GpuResult, check};
use super::{DeviceSpan, Gpu, PinnedRegion, Stream, nvrtc};
use crate::engine::blocks::Segment;
use crate::net::abi::loadMeta;

const BLOCKS_CU: &str = include_str!("../../kernels/blocks.cu");

/// Chunks per launch (`BLOCK_TASKS` in kernels/blocks.cu).
pub const BLOCK_TASKS: usize = 16;
/// Warps per thread block (`BLOCK_WARPS`).
const BLOCK_WARPS: u32 = 8;
/// Bytes of a chunk each warp of the gather takes at a time (`GATHER_UNIT`).
pub const GATHER_UNIT: u32 = 4096;

const _: () = assert!(size_of::<Segment>() == 16);

/// The loaded block kernels of one device.
pub struct BlockKernels {
    ctx: sys::CUcontext,
    module: sys::CUmodule,
    gather: sys::CUfunction,
    scatter: sys::CUfunction,
    compiler: String,
}

// SAFETY: module and function handles are usable from any thread of the process.
unsafe impl Send for BlockKernels {}
// SAFETY: as above; the handles are immutable.
unsafe impl Sync for BlockKernels {}

impl std::fmt::Debug for BlockKernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockKernels")
            .field("compiler", &self.compiler)
            .finish()
    }
}

impl BlockKernels {
    /// Compiles kernels/blocks.cu for `gpu` (PTX for its virtual architecture; a cubin when the
    /// driver cannot JIT that PTX) and loads it into the GPU's context.
    pub fn load(gpu: &Gpu) -> GpuResult<BlockKernels> {
        gpu.bind_to_thread()?;
        let (major, minor) = gpu.compute_capability();
        let virt = format!("compute_{major}{minor}");
        let (ptx, compiler) = nvrtc::compile(BLOCKS_CU, "blocks.cu", &virt, nvrtc::Output::Ptx)?;
        let module = match load_image(&ptx) {
            Ok(m) => m,
            Err(e) if e.driver_code() == Some(sys::CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION as i32) => {
                let arch = format!("sm_{major}{minor}");
                let (cubin, _) = nvrtc::compile(BLOCKS_CU, "blocks.cu", &arch, nvrtc::Output::Cubin)?;
                load_image(&cubin)?
            }
            Err(e) => return Err(e),
        };
        let mut k = BlockKernels {
            ctx: gpu.ctx,
            module,
            gather: std::ptr::null_mut(),
            scatter: std::ptr::null_mut(),
            compiler,
        };
        k.gather = function(module, "tcpxd_gather_blocks")?;
        k.scatter = function(module, "tcpxd_scatter_blocks")?;
        Ok(k)
    }
}

impl Drop for BlockKernels {
    fn drop(&mut self) {
        // SAFETY: the module is this value's own, unloaded once, in its context.
        unsafe {
            if sys::cuCtxSetCurrent(self.ctx) == sys::CUresult::CUDA_SUCCESS {
                let _ = check("cuModuleUnload", sys::cuModuleUnload(self.module));
            }
        }
    }
}

fn load_image(image: &[u8]) -> GpuResult<sys::CUmodule> {
    let mut owned = image.to_vec();
    if owned.last() != Some(&0) {
        owned.push(0);
    }
    let mut m: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: `owned` is a NUL-terminated PTX text or a cubin image, alive during the call.
    check("cuModuleLoadData", unsafe {
        sys::cuModuleLoadData(&mut m, owned.as_ptr() as *const c_void)
    })?;
    Ok(m)
}

fn function(m: sys::CUmodule, name: &str) -> GpuResult<sys::CUfunction> {
    let cname = CString::new(name).expect("static name");
    let mut f: sys::CUfunction = std::ptr::null_mut();
    // SAFETY: writes one function handle of a loaded module.
    check("cuModuleGetFunction", unsafe {
        sys::cuModuleGetFunction(&mut f, m, cname.as_ptr())
    })?;
    Ok(f)
}

/// Checks that `segs` holds `nsegs` 16-byte-aligned [`Segment`]s.
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
        check_table(segs, nsegs)?;
        if u64::from(bytes) > dst.len() {
            return Err(GpuError::InvalidArgument(format!(
                "a {bytes}-byte chunk does not fit a {}-byte staging slot",
                dst.len()
            )));
        }
        Ok(GatherTask {
            segs: segs.ptr(),
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
        check_table(segs, nsegs)?;
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
            segs: segs.ptr(),
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
    /// `1 + (task << 12 | unit)` is stored in the u32 at `err_off` of `err`.
    pub fn launch_gather_blocks(
        &self,
        kernels: &BlockKernels,
        stream: &Stream,
        tasks: &[GatherTask],
        blocks_per_task: u32,
        err: &PinnedRegion,
        err_off: usize,
    ) -> GpuResult<()> {
        self.launch_blocks(kernels.gather, stream, tasks, blocks_per_task, err, err_off)
    }

    /// Scatters up to [`BLOCK_TASKS`] received chunks in one launch. A fragment or piece the
    /// kernel finds out of bounds is skipped and `1 + (task << 12 | fragment)` is stored in the
    /// u32 at `err_off` of `err`.
    pub fn launch_scatter_blocks(
        &self,
        kernels: &BlockKernels,
        stream: &Stream,
        tasks: &[ScatterTask],
        blocks_per_task: u32,
        err: &PinnedRegion,
        err_off: usize,
    ) -> GpuResult<()> {
        self.launch_blocks(kernels.scatter, stream, tasks, blocks_per_task, err, err_off)
    }

    fn launch_blocks<T: Copy + Default>(
        &self,
        f: sys::CUfunction,
        stream: &Stream,
        tasks: &[T],
        blocks_per_task: u32,
        err: &PinnedRegion,
        err_off: usize,
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
        ];
        let grid = (blocks_per_task.clamp(1, 65_535), tasks.len() as u32);
        // SAFETY: `T` is GatherTask or ScatterTask (the only callers), whose layouts match the
        // kernels' `Tasks<GatherTask, 16>` / `Tasks<ScatterTask, 16>` parameter (sizes asserted
        // above); every address in them comes from a DeviceSpan (valid until the work completes
        // by that type's contract) and is bounds-checked in the kernel; the error word lies in a
        // live pinned allocation (checked). Parameters are copied at launch.
        unsafe { self.launch(f, grid, BLOCK_WARPS * 32, stream, &mut params, false) }
    }
}
