//! The GPU layer: CUDA through the driver API (cudarc, loaded at run time), so tcpxd builds and
//! runs on machines without CUDA and only the GPU data path needs it. It sits below the plugin
//! layer (`crate::net` reads the unpack ring through it) and knows only the ABI's `loadMeta`.
//!
//! - [`Gpu`]: a device and its *primary* context (the one NCCL and PyTorch use, so IPC handles and
//!   host-mapped pointers interoperate with them), made current on each thread that calls in.
//! - [`DeviceRegion`] / [`PinnedRegion`]: device memory and mapped pinned host memory (the plugin
//!   layer registers both as regions); IPC export/import ([`IpcExport`], [`Gpu::import_ipc`]).
//! - [`Stream`], [`Event`], [`StreamPool`], [`EventPool`]: created once, reused per batch.
//! - Kernels (`kernels/*.cu`): PTX embedded at build time when nvcc was found, else compiled at
//!   start-up with NVRTC ([`KernelSource`]).
//! - Buffer helpers: [`DeviceRegion::fill_with`], [`DeviceRegion::read_into`],
//!   [`DeviceRegion::crc32c`] (a per-4-KiB-block CRC kernel folded on the host).
//!
//! Every `unsafe` block of the GPU data path lives in this module.

pub mod blocks;
mod crc;
mod error;
mod launch;
mod memory;
mod module;
mod nvrtc;
mod ops;
mod peek;
mod persist;
mod stream;
mod vmm;

use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys;

pub use crc::{crc32c_fold_blocks, shift_4096};
pub use error::{GpuError, GpuResult};
pub use launch::{
    INLINE_MAX_FRAGS, INLINE_MAX_TASKS, INLINE_PAGES_MAX_FRAGS, INLINE_PAGES_MAX_TASKS, InlineBatch,
    InlinePagesBatch, LaunchReport, LaunchSignal, ListFormat, ListScan, UNPACK_MAX_TASKS_PER_LAUNCH,
    UNPACK_WARPS_PER_BLOCK, UnpackTask,
};
pub use memory::plain::Plain;
pub use memory::{DeviceRegion, DeviceSpan, FragmentList, IpcExport, PinnedRegion};
pub use module::{KernelSource, Kernels};
pub use peek::{allocation_extent, device_of, enable_peer_access, read_any_device, shared, wait_ipc_event};
pub use persist::{PERSIST_MAX_TASKS, PERSIST_QUEUE, PersistConfig, PersistentGrid, PostedLists};
pub use stream::{Event, EventPool, Stream, StreamPool};

pub(crate) use error::check;

/// How the driver library was found (or not), decided once per process.
#[derive(Debug, Clone, Copy)]
enum DriverState {
    Missing,
    InitFailed(sys::CUresult),
    Ready,
}

fn driver() -> GpuResult<()> {
    static STATE: OnceLock<DriverState> = OnceLock::new();
    let state = *STATE.get_or_init(|| {
        if !driver_library_present() {
            return DriverState::Missing;
        }
        // SAFETY: the library is present (probed above), so cudarc's loader will not panic;
        // cuInit(0) has no pointer arguments.
        let code = unsafe { sys::cuInit(0) };
        if code == sys::CUresult::CUDA_SUCCESS {
            DriverState::Ready
        } else {
            DriverState::InitFailed(code)
        }
    });
    match state {
        DriverState::Missing => Err(GpuError::DriverNotFound),
        DriverState::InitFailed(code) => check("cuInit", code),
        DriverState::Ready => Ok(()),
    }
}

/// Whether libcuda can be loaded, checked without touching cudarc (whose loader panics when the
/// library is missing).
fn driver_library_present() -> bool {
    for name in ["libcuda.so.1", "libcuda.so"] {
        // SAFETY: loading the CUDA driver runs its initialisers, which have no preconditions;
        // the handle is dropped at once (cudarc keeps its own).
        if let Ok(lib) = unsafe { libloading::Library::new(name) } {
            if let Some(sym) = missing_driver_symbol(&lib) {
                // cudarc panics at the first call of a missing entry point: a library without
                // them (tools/realplugin's host-memory stand-in, which Google's plugin loads as
                // libcuda.so.1) is no driver for tcpxd.
                tracing::warn!(
                    library = name,
                    missing = sym,
                    "libcuda lacks a CUDA driver entry point tcpxd calls: treated as no CUDA driver"
                );
                return false;
            }
            // SAFETY: only probes the same candidates cudarc will load; no symbol is called.
            return unsafe { sys::is_culib_present() };
        }
    }
    false
}

/// Entry points tcpxd's CUDA paths call (device listing, kernels, pointer queries): a library
/// lacking one is not a usable driver.
const DRIVER_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGetAttribute",
    "cuDeviceTotalMem_v2",
    "cuPointerGetAttribute",
    "cuMemGetAddressRange_v2",
    "cuModuleLoadData",
    "cuLaunchKernel",
];

fn missing_driver_symbol(lib: &libloading::Library) -> Option<&'static str> {
    DRIVER_SYMBOLS.iter().copied().find(|sym| {
        // SAFETY: looks the symbol up without calling it; the pointer type is irrelevant.
        unsafe { lib.get::<*const std::ffi::c_void>(sym.as_bytes()) }.is_err()
    })
}

/// Whether a CUDA driver is installed and initialises (never panics).
pub fn driver_available() -> bool {
    driver().is_ok()
}

/// What `DescribeNode` reports of a CUDA device (read without creating a context).
#[derive(Debug, Clone)]
pub struct GpuSummary {
    pub ordinal: usize,
    pub name: String,
    pub pci_bus_id: String,
    pub total_memory: u64,
    pub compute_capability: (i32, i32),
}

/// Every CUDA device of the machine; empty when there is no driver.
pub fn list_devices() -> GpuResult<Vec<GpuSummary>> {
    if driver().is_err() {
        return Ok(Vec::new());
    }
    let count = Gpu::device_count()?;
    let mut out = Vec::with_capacity(count);
    for ordinal in 0..count {
        let mut dev: sys::CUdevice = 0;
        // SAFETY: writes one device handle; the ordinal is below the device count.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut dev, ordinal as c_int)
        })?;
        let text =
            |f: &dyn Fn(&mut [std::ffi::c_char]) -> sys::CUresult, what: &'static str| -> GpuResult<String> {
                let mut buf = [0 as std::ffi::c_char; 256];
                check(what, f(&mut buf))?;
                // SAFETY: the driver wrote a NUL-terminated string into the zeroed buffer.
                Ok(unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
                    .to_string_lossy()
                    .into_owned())
            };
        let name = text(
            // SAFETY: writes at most `len` bytes (NUL included) into the buffer it is given.
            &|b| unsafe { sys::cuDeviceGetName(b.as_mut_ptr(), b.len() as c_int, dev) },
            "cuDeviceGetName",
        )?;
        let pci_bus_id = text(
            // SAFETY: writes at most `len` bytes (NUL included) into the buffer it is given.
            &|b| unsafe { sys::cuDeviceGetPCIBusId(b.as_mut_ptr(), b.len() as c_int, dev) },
            "cuDeviceGetPCIBusId",
        )?;
        let mut total: usize = 0;
        // SAFETY: writes one size_t for a valid device.
        check("cuDeviceTotalMem", unsafe {
            sys::cuDeviceTotalMem_v2(&mut total, dev)
        })?;
        let attr = |a: sys::CUdevice_attribute| -> GpuResult<i32> {
            let mut v: c_int = 0;
            // SAFETY: writes one int for a valid device.
            check("cuDeviceGetAttribute", unsafe {
                sys::cuDeviceGetAttribute(&mut v, a, dev)
            })?;
            Ok(v)
        };
        out.push(GpuSummary {
            ordinal,
            name,
            pci_bus_id,
            total_memory: total as u64,
            compute_capability: (
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
        });
    }
    Ok(out)
}

/// One CUDA device, with its primary context retained for as long as this value lives.
pub struct Gpu {
    ordinal: usize,
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    name: String,
    compute_capability: (i32, i32),
    sm_count: u32,
    kernels: Mutex<Option<Arc<Kernels>>>,
}

// SAFETY: a CUcontext handle may be used from any thread (the driver is thread-safe); the
// primary context is made current per thread by `bind_to_thread` before each use.
unsafe impl Send for Gpu {}
// SAFETY: as above; the only mutable state is behind a Mutex.
unsafe impl Sync for Gpu {}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("compute_capability", &self.compute_capability)
            .field("sm_count", &self.sm_count)
            .finish()
    }
}

impl Gpu {
    /// The number of CUDA devices (an error when the driver is missing).
    pub fn device_count() -> GpuResult<usize> {
        driver()?;
        let mut n: c_int = 0;
        // SAFETY: writes one int.
        check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
        Ok(n.max(0) as usize)
    }

    /// Opens device `ordinal`: retains its primary context and makes it current on this thread.
    pub fn open(ordinal: usize) -> GpuResult<Arc<Gpu>> {
        let count = Self::device_count()?;
        if ordinal >= count {
            return Err(GpuError::NoDevice { ordinal, count });
        }
        let mut dev: sys::CUdevice = 0;
        // SAFETY: writes one device handle; the ordinal is in range.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut dev, ordinal as c_int)
        })?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle; released in Drop.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)
        })?;
        let attr = |a: sys::CUdevice_attribute| -> GpuResult<i32> {
            let mut v: c_int = 0;
            // SAFETY: writes one int for a valid device.
            check("cuDeviceGetAttribute", unsafe {
                sys::cuDeviceGetAttribute(&mut v, a, dev)
            })?;
            Ok(v)
        };
        let mut name_buf = [0 as std::ffi::c_char; 256];
        // SAFETY: the driver writes a NUL-terminated name of at most 256 bytes.
        check("cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(name_buf.as_mut_ptr(), name_buf.len() as c_int, dev)
        })?;
        // SAFETY: NUL-terminated by the driver (and the buffer was zeroed).
        let name = unsafe { std::ffi::CStr::from_ptr(name_buf.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let gpu = Gpu {
            ordinal,
            dev,
            ctx,
            name,
            compute_capability: (
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
            sm_count: attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as u32,
            kernels: Mutex::new(None),
        };
        gpu.bind_to_thread()?;
        tracing::debug!(ordinal, name = %gpu.name, cc = ?gpu.compute_capability, "opened CUDA device");
        Ok(Arc::new(gpu))
    }

    /// Makes this device's primary context current on the calling thread (cheap when it already is).
    pub fn bind_to_thread(&self) -> GpuResult<()> {
        let mut cur: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: writes one context handle.
        check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut cur) })?;
        if cur != self.ctx {
            // SAFETY: `ctx` is retained for this value's lifetime.
            check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx) })?;
        }
        Ok(())
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// Waits for all work on the device's primary context.
    pub fn synchronize(&self) -> GpuResult<()> {
        self.bind_to_thread()?;
        // SAFETY: no arguments; the context is current.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    /// The tcpxd kernels, loaded on first use (embedded PTX, or NVRTC from the embedded source).
    pub fn kernels(&self) -> GpuResult<Arc<Kernels>> {
        let mut slot = self.kernels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(k) = slot.as_ref() {
            return Ok(k.clone());
        }
        self.bind_to_thread()?;
        let k = Arc::new(module::load(self)?);
        *slot = Some(k.clone());
        Ok(k)
    }

    /// Launches `f` on `stream`; with `overlap`, as a programmatic dependent launch (sm_90): the
    /// grid may start while the previous one on `stream` finishes, and the kernel itself waits
    /// (`griddepcontrol.wait`) before touching anything the previous grid wrote.
    ///
    /// # Safety
    /// `params` must match the kernel's parameter list (one pointer per parameter, each to a
    /// value of the parameter's type and size), and every address the kernel dereferences must be
    /// valid for its accesses until the launch completes. With `overlap`, `f` must wait for the
    /// previous grid before any access that depends on it.
    pub(crate) unsafe fn launch(
        &self,
        f: sys::CUfunction,
        grid: (u32, u32),
        block: u32,
        stream: &Stream,
        params: &mut [*mut c_void],
        overlap: bool,
    ) -> GpuResult<()> {
        self.bind_to_thread()?;
        // SAFETY: a plain-data union of attribute values; zero is a valid bit pattern.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: 1,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: stream.raw(),
            attrs: &mut attr,
            numAttrs: u32::from(overlap),
        };
        // SAFETY: the caller vouches for the parameters (and, overlapping, for the kernel's
        // wait); the grid and block are plain numbers the driver validates; `config` and its
        // attribute live across the call.
        check("cuLaunchKernelEx", unsafe {
            sys::cuLaunchKernelEx(&config, f, params.as_mut_ptr(), std::ptr::null_mut())
        })
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // The modules go first, while the context still exists.
        drop(self.kernels.get_mut().unwrap_or_else(|e| e.into_inner()).take());
        // SAFETY: balances the retain in `open`; every resource holding an Arc<Gpu> is gone.
        let code = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
        if let Err(e) = check("cuDevicePrimaryCtxRelease", code) {
            tracing::warn!("releasing the primary context of GPU {}: {e}", self.ordinal);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opening_never_panics_and_names_a_missing_driver() {
        match Gpu::open(0) {
            Ok(g) => assert_eq!(g.ordinal(), 0),
            Err(GpuError::DriverNotFound) => {
                assert!(!driver_available());
                assert!(GpuError::DriverNotFound.to_string().contains("libcuda.so"));
                assert!(matches!(Gpu::device_count(), Err(GpuError::DriverNotFound)));
            }
            Err(e) => assert!(!e.to_string().is_empty()),
        }
    }

    #[test]
    fn a_library_without_driver_entry_points_is_no_driver() {
        // SAFETY: the C library is loaded in every process already.
        let libc = unsafe { libloading::Library::new("libc.so.6") }.expect("libc");
        assert_eq!(missing_driver_symbol(&libc), Some("cuInit"));
    }
}
