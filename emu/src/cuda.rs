//! The CUDA driver API for the CUDA mode (`TCPXEMU_BOUNCE=auto|cuda`), loaded at run time.
//!
//! Everything goes through `cudarc`'s dynamically loaded `sys` bindings. Those panic when
//! `libcuda` or one of its symbols is missing, so [`probe`] first opens `libcuda.so.1` with
//! `libloading` and checks every symbol this module uses; only after a successful probe does any
//! other function here run (the configuration picks host mode otherwise). The types below own
//! one CUDA object each and free it on drop, with their context made current for the call.
//!
//! Contexts: the emulation shares the caller's context. [`Ctx::current_or_primary`] takes the
//! context current on the calling thread, or else the primary context of the configured device.
//! Primary contexts are retained once per device for the life of the process. Helper threads
//! [`bind`] the comm's context before any CUDA call.

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;
use std::ffi::{c_uint, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;
use std::sync::{Arc, Mutex, OnceLock};

/// Every driver symbol this module (through cudarc) may call.
const NEEDED: &[&str] = &[
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetPCIBusId",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxGetDevice",
    "cuDevicePrimaryCtxRetain",
    "cuMemHostAlloc",
    "cuMemHostGetDevicePointer_v2",
    "cuMemFreeHost",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuPointerGetAttribute",
    "cuGetErrorName",
    "cuGetErrorString",
];

/// Kept open for the life of the process once the probe succeeded (cudarc opens its own handle
/// to the same library; this one only guarantees the symbols were checked on a loaded copy).
static LIB: OnceLock<libloading::Library> = OnceLock::new();

/// A driver error as text: `CUDA_ERROR_… (description)`.
pub(crate) fn describe(e: DriverError) -> String {
    let name = format!("{:?}", e.0);
    match e.error_string() {
        Ok(s) => format!("{name} ({})", s.to_string_lossy()),
        Err(_) => name,
    }
}

fn check(what: &str, r: sys::CUresult) -> Result<(), String> {
    r.result().map_err(|e| format!("{what} failed: {}", describe(e)))
}

/// Can the CUDA mode run here? Loads `libcuda.so.1`, checks the symbols, `cuInit(0)`, and
/// returns the number of CUDA devices (at least 1), or why not.
pub(crate) fn probe() -> Result<i32, String> {
    match catch_unwind(AssertUnwindSafe(probe_inner)) {
        Ok(r) => r,
        Err(_) => Err("loading the CUDA driver API failed (panic in the loader)".into()),
    }
}

fn probe_inner() -> Result<i32, String> {
    let lib = match LIB.get() {
        Some(l) => l,
        None => {
            // SAFETY: loading the NVIDIA driver library runs its initialisers, which are designed
            // to run in any process; nothing of ours runs during the load.
            let l = unsafe { libloading::Library::new("libcuda.so.1") }
                .map_err(|e| format!("libcuda.so.1 cannot be loaded ({e})"))?;
            LIB.get_or_init(|| l)
        }
    };
    for name in NEEDED {
        // SAFETY: only the symbol's presence is checked; the pointer is never called through
        // this (deliberately wrong) type.
        unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }
            .map_err(|e| format!("libcuda.so.1 lacks {name} ({e})"))?;
    }
    // SAFETY: cuInit takes flags 0 and may be called any number of times.
    check("cuInit", unsafe { sys::cuInit(0) })?;
    let mut n = 0;
    // SAFETY: out-parameter on the stack.
    check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
    if n <= 0 {
        return Err("no CUDA device".into());
    }
    Ok(n)
}

/// Device `ordinal`'s PCI bus id, lower case (`0000:04:00.0`). Only after a successful [`probe`].
pub(crate) fn pci_bus_id(ordinal: i32) -> Result<String, String> {
    let mut dev: sys::CUdevice = 0;
    // SAFETY: out-parameter; the ordinal is checked by the driver.
    check(&format!("cuDeviceGet({ordinal})"), unsafe {
        sys::cuDeviceGet(&mut dev, ordinal)
    })?;
    let mut buf = [0 as std::ffi::c_char; 32];
    // SAFETY: `buf` holds 32 bytes; the driver writes a NUL-terminated id into the first 31.
    check("cuDeviceGetPCIBusId", unsafe {
        sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32 - 1, dev)
    })?;
    // SAFETY: NUL-terminated inside `buf` (the driver's contract; the last byte stays 0).
    let s = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    Ok(s.to_string_lossy().to_ascii_lowercase())
}

/// Primary contexts this process retained, one reference each, kept until the process exits
/// (as the CUDA runtime does): a primary context the emulation uses is never torn down and
/// re-created behind the back of other users of the device between two comms.
static PRIMARIES: Mutex<Vec<(sys::CUdevice, usize)>> = Mutex::new(Vec::new());

/// `dev`'s primary context, retained once for the life of the process.
fn primary(dev: sys::CUdevice) -> Result<sys::CUcontext, String> {
    let mut held = PRIMARIES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&(_, c)) = held.iter().find(|(d, _)| *d == dev) {
        return Ok(c as sys::CUcontext);
    }
    let mut prim: sys::CUcontext = ptr::null_mut();
    // SAFETY: `dev` is a valid device handle (from cuDeviceGet or cuCtxGetDevice); out-parameter
    // on the stack. Never released: see PRIMARIES.
    check("cuDevicePrimaryCtxRetain", unsafe {
        sys::cuDevicePrimaryCtxRetain(&mut prim, dev)
    })?;
    held.push((dev, prim as usize));
    Ok(prim)
}

/// A CUDA context the emulation works in: a primary context (retained for the life of the
/// process) or the caller's own context (borrowed: it must outlive the comms and registrations
/// made under it).
#[derive(Debug)]
pub(crate) struct Ctx {
    raw: sys::CUcontext,
    device: sys::CUdevice,
}

// SAFETY: a CUcontext handle may be used (made current) from any thread; the driver serialises
// what needs serialising.
unsafe impl Send for Ctx {}
// SAFETY: as above; `&Ctx` only hands out the handle.
unsafe impl Sync for Ctx {}

impl Ctx {
    /// The context current on the calling thread, else the primary context of `fallback`.
    /// Only valid after a successful [`probe`].
    pub(crate) fn current_or_primary(fallback: i32) -> Result<Arc<Ctx>, String> {
        let mut cur: sys::CUcontext = ptr::null_mut();
        // SAFETY: out-parameter on the stack.
        check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut cur) })?;
        if !cur.is_null() {
            let mut dev: sys::CUdevice = 0;
            // SAFETY: out-parameter; a context is current on this thread.
            check("cuCtxGetDevice", unsafe { sys::cuCtxGetDevice(&mut dev) })?;
            // Keep the device's primary context alive in case the current one is it.
            primary(dev)?;
            return Ok(Arc::new(Ctx {
                raw: cur,
                device: dev,
            }));
        }
        let mut dev: sys::CUdevice = 0;
        // SAFETY: out-parameter; the ordinal is checked by the driver.
        check(&format!("cuDeviceGet({fallback})"), unsafe {
            sys::cuDeviceGet(&mut dev, fallback)
        })?;
        Ok(Arc::new(Ctx {
            raw: primary(dev)?,
            device: dev,
        }))
    }

    pub(crate) fn device(&self) -> i32 {
        self.device
    }

    pub(crate) fn raw(&self) -> usize {
        self.raw as usize
    }
}

/// `ctx` made current on this thread until the guard drops (then the previous one is restored).
pub(crate) struct Bound {
    prev: sys::CUcontext,
    changed: bool,
}

pub(crate) fn bind(ctx: &Ctx) -> Result<Bound, String> {
    let mut prev: sys::CUcontext = ptr::null_mut();
    // SAFETY: out-parameter on the stack.
    check("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut prev) })?;
    if prev == ctx.raw {
        return Ok(Bound { prev, changed: false });
    }
    // SAFETY: `ctx.raw` is a live context (held by `ctx`).
    check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx.raw) })?;
    Ok(Bound { prev, changed: true })
}

impl Drop for Bound {
    fn drop(&mut self) {
        if self.changed {
            // SAFETY: restores what was current before (NULL or a context the thread had).
            let _ = unsafe { sys::cuCtxSetCurrent(self.prev) };
        }
    }
}

/// Page-locked host memory (`cuMemHostAlloc`, PORTABLE, optionally DEVICEMAP), zeroed.
#[derive(Debug)]
pub(crate) struct Pinned {
    ctx: Arc<Ctx>,
    host: *mut u8,
    dev: u64,
    len: usize,
}

// SAFETY: plain memory owned by this value; concurrent access to the bytes is coordinated by
// the owners (atomics, one thread per staging buffer).
unsafe impl Send for Pinned {}
// SAFETY: as above; `&Pinned` only exposes addresses.
unsafe impl Sync for Pinned {}

impl Pinned {
    pub(crate) fn new(ctx: &Arc<Ctx>, len: usize, mapped: bool) -> Result<Pinned, String> {
        let _b = bind(ctx)?;
        let flags: c_uint =
            sys::CU_MEMHOSTALLOC_PORTABLE | if mapped { sys::CU_MEMHOSTALLOC_DEVICEMAP } else { 0 };
        let mut p: *mut c_void = ptr::null_mut();
        // SAFETY: out-parameter; `len` > 0 is the caller's; a context is current.
        check(&format!("cuMemHostAlloc({len})"), unsafe {
            sys::cuMemHostAlloc(&mut p, len.max(1), flags)
        })?;
        let mut pinned = Pinned {
            ctx: ctx.clone(),
            host: p.cast(),
            dev: 0,
            len,
        };
        // SAFETY: `p` is a fresh allocation of at least `len` bytes.
        unsafe { ptr::write_bytes(pinned.host, 0, len) };
        if mapped {
            let mut d: sys::CUdeviceptr = 0;
            // SAFETY: `p` came from cuMemHostAlloc with DEVICEMAP; flags must be 0.
            check("cuMemHostGetDevicePointer", unsafe {
                sys::cuMemHostGetDevicePointer_v2(&mut d, p, 0)
            })?;
            pinned.dev = d;
        }
        Ok(pinned)
    }

    pub(crate) fn host(&self) -> *mut u8 {
        self.host
    }

    /// The device address of a DEVICEMAP allocation (0 otherwise).
    pub(crate) fn device(&self) -> u64 {
        self.dev
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let _b = bind(&self.ctx);
        // SAFETY: `host` came from cuMemHostAlloc and is freed once; its users (helper threads,
        // the stream copies they synchronised) are done.
        let _ = unsafe { sys::cuMemFreeHost(self.host.cast()) };
    }
}

/// Device memory (`cuMemAlloc`), its start rounded up to `align`.
#[derive(Debug)]
pub(crate) struct DeviceMem {
    ctx: Arc<Ctx>,
    raw: sys::CUdeviceptr,
    addr: u64,
}

impl DeviceMem {
    pub(crate) fn new(ctx: &Arc<Ctx>, len: usize, align: usize) -> Result<DeviceMem, String> {
        let _b = bind(ctx)?;
        let total = len.max(1) + align.saturating_sub(1);
        let mut d: sys::CUdeviceptr = 0;
        // SAFETY: out-parameter; a context is current.
        check(&format!("cuMemAlloc({total})"), unsafe {
            sys::cuMemAlloc_v2(&mut d, total)
        })?;
        let addr = if align > 1 {
            d.next_multiple_of(align as u64)
        } else {
            d
        };
        Ok(DeviceMem {
            ctx: ctx.clone(),
            raw: d,
            addr,
        })
    }

    pub(crate) fn addr(&self) -> u64 {
        self.addr
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        let _b = bind(&self.ctx);
        // SAFETY: `raw` came from cuMemAlloc and is freed once, after every user (helper
        // threads, synchronised streams) is done; consumers were told not to use it after close.
        let _ = unsafe { sys::cuMemFree_v2(self.raw) };
    }
}

/// A stream of the context (`cuStreamCreate`, non-blocking). Its copies are issued by the
/// thread that owns it, with the context bound.
#[derive(Debug)]
pub(crate) struct Stream {
    ctx: Arc<Ctx>,
    raw: sys::CUstream,
}

// SAFETY: a stream handle may be used from any thread that has its context current; each
// Stream is used by one thread at a time (it is moved into its helper thread).
unsafe impl Send for Stream {}

impl Stream {
    pub(crate) fn new(ctx: &Arc<Ctx>) -> Result<Stream, String> {
        let _b = bind(ctx)?;
        let mut s: sys::CUstream = ptr::null_mut();
        // SAFETY: out-parameter; a context is current.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as c_uint)
        })?;
        Ok(Stream {
            ctx: ctx.clone(),
            raw: s,
        })
    }

    pub(crate) fn ctx(&self) -> &Arc<Ctx> {
        &self.ctx
    }

    /// Queue a host-to-device copy.
    ///
    /// SAFETY: `src..src+len` is pinned host memory and `dst..dst+len` device memory, both
    /// alive and untouched by others until [`Stream::sync`] returns.
    pub(crate) unsafe fn htod(&self, dst: u64, src: *const u8, len: usize) -> Result<(), String> {
        // SAFETY: the caller's contract.
        check("cuMemcpyHtoDAsync", unsafe {
            sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, self.raw)
        })
    }

    /// Queue a device-to-host copy.
    ///
    /// SAFETY: `src..src+len` is device memory and `dst..dst+len` pinned host memory, both
    /// alive and untouched by others until [`Stream::sync`] returns.
    pub(crate) unsafe fn dtoh(&self, dst: *mut u8, src: u64, len: usize) -> Result<(), String> {
        // SAFETY: the caller's contract.
        check("cuMemcpyDtoHAsync", unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, self.raw)
        })
    }

    /// Wait for every copy queued so far.
    pub(crate) fn sync(&self) -> Result<(), String> {
        // SAFETY: a live stream of a context current on this thread (or any thread: the driver
        // accepts synchronising a stream of another context).
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(self.raw)
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let _b = bind(&self.ctx);
        // SAFETY: a live stream, destroyed once; pending work (none: every user synchronises
        // before giving up its buffers) would still complete.
        let _ = unsafe { sys::cuStreamSynchronize(self.raw) };
        // SAFETY: as above.
        let _ = unsafe { sys::cuStreamDestroy_v2(self.raw) };
    }
}

/// What `cuPointerGetAttribute(MEMORY_TYPE)` says about an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MemoryType {
    Host,
    Device,
    Other(u32),
}

/// The memory type of `addr`, with `ctx` bound for the query; an error when CUDA does not know
/// the address at all.
pub(crate) fn memory_type(ctx: &Ctx, addr: u64) -> Result<MemoryType, String> {
    let _b = bind(ctx)?;
    let mut t: c_uint = 0;
    // SAFETY: MEMORY_TYPE writes one unsigned int into the out-parameter.
    check("cuPointerGetAttribute(MEMORY_TYPE)", unsafe {
        sys::cuPointerGetAttribute(
            (&mut t as *mut c_uint).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            addr,
        )
    })?;
    Ok(match t {
        x if x == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32 => MemoryType::Host,
        x if x == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 => MemoryType::Device,
        x => MemoryType::Other(x),
    })
}
