//! Loading the kernels of `kernels/`: PTX embedded at build time (when build.rs found nvcc), else
//! NVRTC at start-up from the embedded source. `TCPXD_GPU_KERNELS=nvrtc` forces NVRTC.

use std::ffi::{CString, c_void};

use cudarc::driver::sys;

use super::error::{GpuResult, check};
use super::{Gpu, nvrtc};

const UNPACK_CU: &str = include_str!("../../kernels/unpack.cu");
const CHECKSUM_CU: &str = include_str!("../../kernels/checksum.cu");
const BLOCKS_CU: &str = include_str!("../../kernels/blocks.cu");

#[cfg(tcpxd_ptx)]
const EMBEDDED_PTX: Option<[&str; 3]> = Some([
    include_str!(concat!(env!("OUT_DIR"), "/unpack.ptx")),
    include_str!(concat!(env!("OUT_DIR"), "/checksum.ptx")),
    include_str!(concat!(env!("OUT_DIR"), "/blocks.ptx")),
]);
#[cfg(not(tcpxd_ptx))]
const EMBEDDED_PTX: Option<[&str; 3]> = None;

/// Where the loaded kernels came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelSource {
    /// PTX compiled by nvcc at build time (`-arch=sm_90 -O3`).
    EmbeddedPtx,
    /// Compiled at start-up by NVRTC (`compiler`), for `arch`.
    Nvrtc { compiler: String, arch: String },
}

/// The loaded kernels of one device.
pub struct Kernels {
    ctx: sys::CUcontext,
    modules: [sys::CUmodule; 3],
    pub(crate) unpack_8: sys::CUfunction,
    pub(crate) unpack_16: sys::CUfunction,
    pub(crate) unpack_64: sys::CUfunction,
    pub(crate) unpack_inline_small: sys::CUfunction,
    pub(crate) unpack_inline_pages: sys::CUfunction,
    pub(crate) unpack_persistent: sys::CUfunction,
    pub(crate) crc32c_blocks: sys::CUfunction,
    pub(crate) gather_blocks: sys::CUfunction,
    pub(crate) scatter_blocks: sys::CUfunction,
    pub(crate) copy_tables: sys::CUfunction,
    /// `[gather, scatter][cap]`: the inline-table kernels, one per size of
    /// `blocks::INLINE_CAPS`.
    pub(crate) blocks_inline: [[sys::CUfunction; 2]; 2],
    source: KernelSource,
}

// SAFETY: module and function handles are usable from any thread of the process.
unsafe impl Send for Kernels {}
// SAFETY: as above; the handles are immutable.
unsafe impl Sync for Kernels {}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernels").field("source", &self.source).finish()
    }
}

impl Kernels {
    pub fn source(&self) -> &KernelSource {
        &self.source
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

fn compile_and_load(gpu: &Gpu) -> GpuResult<([sys::CUmodule; 3], KernelSource)> {
    let (major, minor) = gpu.compute_capability();
    let virt = if (major, minor) == (9, 0) {
        "compute_90".to_string()
    } else {
        format!("compute_{major}{minor}")
    };
    let mut modules = Vec::new();
    let mut compiler = String::new();
    let mut arch = virt.clone();
    for (src, name) in [
        (UNPACK_CU, "unpack.cu"),
        (CHECKSUM_CU, "checksum.cu"),
        (BLOCKS_CU, "blocks.cu"),
    ] {
        let (ptx, who) = nvrtc::compile(src, name, &virt, nvrtc::Output::Ptx)?;
        compiler = who;
        let m = match load_image(&ptx) {
            Ok(m) => m,
            // NVRTC newer than the driver writes a PTX ISA the driver cannot JIT: fall back to
            // machine code for this exact device.
            Err(e) if e.driver_code() == Some(sys::CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION as i32) => {
                arch = format!("sm_{major}{minor}");
                tracing::info!("the driver cannot JIT NVRTC's PTX ({e}); compiling a cubin for {arch}");
                let (cubin, _) = nvrtc::compile(src, name, &arch, nvrtc::Output::Cubin)?;
                load_image(&cubin)?
            }
            Err(e) => return Err(e),
        };
        modules.push(m);
    }
    Ok((
        [modules[0], modules[1], modules[2]],
        KernelSource::Nvrtc { compiler, arch },
    ))
}

pub(crate) fn load(gpu: &Gpu) -> GpuResult<Kernels> {
    let force_nvrtc = std::env::var("TCPXD_GPU_KERNELS").is_ok_and(|v| v == "nvrtc");
    let usable_ptx = EMBEDDED_PTX.filter(|_| !force_nvrtc && gpu.compute_capability() >= (9, 0));
    let (modules, source) = match usable_ptx {
        Some([unpack, checksum, blocks]) => (
            [
                load_image(unpack.as_bytes())?,
                load_image(checksum.as_bytes())?,
                load_image(blocks.as_bytes())?,
            ],
            KernelSource::EmbeddedPtx,
        ),
        None => compile_and_load(gpu)?,
    };
    let mut k = Kernels {
        ctx: gpu.ctx,
        modules,
        unpack_8: std::ptr::null_mut(),
        unpack_16: std::ptr::null_mut(),
        unpack_64: std::ptr::null_mut(),
        unpack_inline_small: std::ptr::null_mut(),
        unpack_inline_pages: std::ptr::null_mut(),
        unpack_persistent: std::ptr::null_mut(),
        crc32c_blocks: std::ptr::null_mut(),
        gather_blocks: std::ptr::null_mut(),
        scatter_blocks: std::ptr::null_mut(),
        copy_tables: std::ptr::null_mut(),
        blocks_inline: [[std::ptr::null_mut(); 2]; 2],
        source,
    };
    k.unpack_8 = function(modules[0], "tcpxd_unpack_8")?;
    k.unpack_16 = function(modules[0], "tcpxd_unpack_16")?;
    k.unpack_64 = function(modules[0], "tcpxd_unpack_64")?;
    k.unpack_inline_small = function(modules[0], "tcpxd_unpack_inline_small")?;
    k.unpack_inline_pages = function(modules[0], "tcpxd_unpack_inline_pages")?;
    k.unpack_persistent = function(modules[0], "tcpxd_unpack_persistent")?;
    k.crc32c_blocks = function(modules[1], "tcpxd_crc32c_blocks")?;
    k.gather_blocks = function(modules[2], "tcpxd_gather_blocks")?;
    k.scatter_blocks = function(modules[2], "tcpxd_scatter_blocks")?;
    k.copy_tables = function(modules[2], "tcpxd_copy_tables")?;
    for (i, op) in ["gather", "scatter"].into_iter().enumerate() {
        for (j, cap) in super::blocks::INLINE_CAPS.into_iter().enumerate() {
            k.blocks_inline[i][j] = function(modules[2], &format!("tcpxd_{op}_blocks_inline_{cap}"))?;
        }
    }
    match &k.source {
        KernelSource::EmbeddedPtx => tracing::info!(
            gpu = gpu.ordinal(),
            "GPU kernels: PTX embedded at build time (nvcc -arch=sm_90)"
        ),
        KernelSource::Nvrtc { compiler, arch } => tracing::info!(
            gpu = gpu.ordinal(),
            "GPU kernels: compiled at start-up by {compiler} for {arch}"
        ),
    }
    Ok(k)
}

impl Drop for Kernels {
    fn drop(&mut self) {
        // SAFETY: the context is still retained (Gpu drops its kernels before releasing it); the
        // modules are this value's own, unloaded once.
        unsafe {
            if sys::cuCtxSetCurrent(self.ctx) != sys::CUresult::CUDA_SUCCESS {
                return;
            }
            for m in self.modules {
                let _ = check("cuModuleUnload", sys::cuModuleUnload(m));
            }
        }
    }
}
