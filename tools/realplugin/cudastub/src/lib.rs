//! A CUDA stand-in over host memory: the driver (`cu*`) and runtime (`cuda*`) calls that Google's
//! TCPX plugin makes on its host path, so the real plugin runs on a machine without a GPU
//! (tools/realplugin/build.sh installs this library as `libcuda.so.1` beside the plugin), and
//! those of the emulation's CUDA mode and of tcpxd's GPU data path without kernels (streams,
//! events, asynchronous copies, pointer attributes: `datapath.rs`), so that both run over "GPUs"
//! in CI (`tcpxd_testkit::cudastub`).
//!
//! "Device" memory is host memory: `cuMemAlloc` is an allocation the process can read (a memfd's
//! pages, so that it can be exported as a dma-buf: dmabuf.rs), a device
//! pointer of host memory is the host pointer, and copies are `memcpy` (asynchronous ones done at
//! once: every stream is always idle). Devices are `TCPXD_CUDASTUB_DEVICES` (default 8, at most
//! 16) with A3's GPU PCI bus ids in ordinal order (0000:04:00.0, 05, 0a, 0b, 84, 85, 8a, 8b;
//! `0000:NN:00.0` with NN = 0x10 + ordinal beyond eight), or the comma-separated
//! `TCPXD_CUDASTUB_PCI_BUS_IDS`; a thread's current device is its current context's, else the
//! runtime's (`cudaSetDevice`), else `TCPXD_CUDASTUB_CURRENT_DEVICE` (default 0). Module loading and
//! kernel launches and IPC import answer `CUDA_ERROR_NOT_SUPPORTED`: the stand-in runs no kernel. Device memory is shared between processes only through the VMM calls over a
//! POSIX fd (vmm.rs), where the fd is a real file whose pages the processes map.
//!
//! Every function is an FFI edge called by C++ with C pointers; each checks its pointers for null
//! and answers `CUDA_ERROR_INVALID_VALUE` rather than writing through one.

use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong, c_void};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

pub type CUresult = c_int;
pub type CUdevice = c_int;
pub type CUcontext = *mut c_void;
pub type CUdeviceptr = c_ulonglong;
pub type CudaError = c_int;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
pub const CUDA_ERROR_INVALID_DEVICE: CUresult = 101;
pub const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
pub const CUDA_ERROR_NOT_SUPPORTED: CUresult = 801;

// The runtime's codes for the same conditions share the driver's numbers.
pub const CUDA_RT_SUCCESS: CudaError = 0;
pub const CUDA_RT_ERROR_INVALID_VALUE: CudaError = 1;
pub const CUDA_RT_ERROR_MEMORY_ALLOCATION: CudaError = 2;
pub const CUDA_RT_ERROR_INVALID_DEVICE: CudaError = 101;
pub const CUDA_RT_ERROR_NOT_SUPPORTED: CudaError = 801;

const MAX_DEVICES: usize = 16;
/// One byte per device: its address is the device's (primary) context handle.
static CONTEXTS: [u8; MAX_DEVICES] = [0; MAX_DEVICES];
static INITIALISED: AtomicBool = AtomicBool::new(false);
/// Live allocations (address → bytes and, for "device" memory, its device): frees of unknown
/// addresses are refused, pointer attributes answered from here, and tests count them.
static ALLOCATIONS: Mutex<Option<HashMap<usize, Allocation>>> = Mutex::new(None);

#[derive(Debug, Clone, Copy)]
struct Allocation {
    bytes: usize,
    /// `None`: host memory (pinned); `Some(d)`: device `d`'s memory (`cuMemAlloc`, `cuMemMap`).
    device: Option<CUdevice>,
    /// A file's pages `cuMemMap` put there (vmm.rs): unmapped by `cuMemUnmap`, never freed.
    mapped: bool,
    /// `cuMemAlloc`'s memory is a memfd's pages mapped here (so it can be exported as a dma-buf,
    /// dmabuf.rs); -1 for host memory and `cuMemMap`'s.
    memfd: c_int,
}

/// A3's eight GPUs' PCI bus ids (RxDM's a3vm preset), in CUDA ordinal order.
pub const A3_GPU_BUS_IDS: [&str; 8] = [
    "0000:04:00.0",
    "0000:05:00.0",
    "0000:0a:00.0",
    "0000:0b:00.0",
    "0000:84:00.0",
    "0000:85:00.0",
    "0000:8a:00.0",
    "0000:8b:00.0",
];

thread_local! {
    static CTX_STACK: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The runtime's current device; -1 until `cudaSetDevice` (then [`default_device`]).
    static RT_DEVICE: std::cell::Cell<c_int> = const { std::cell::Cell::new(-1) };
}

/// The number of stand-in devices.
pub fn device_count() -> usize {
    std::env::var("TCPXD_CUDASTUB_DEVICES")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(A3_GPU_BUS_IDS.len())
        .min(MAX_DEVICES)
}

/// The runtime's current device on a thread that has not set one: `TCPXD_CUDASTUB_CURRENT_DEVICE`
/// (default 0). tools/realplugin/run.sh makes it 1 of 2, an odd ordinal: with
/// `NCCL_TCPX_RXMEM_IMPORT_SKIP_ODDS=1` the plugin then does not import RxDM's GPU receive buffer
/// for its receive comms (a dma-buf the stand-in cannot map), which host receives never use.
pub fn default_device() -> c_int {
    std::env::var("TCPXD_CUDASTUB_CURRENT_DEVICE")
        .ok()
        .and_then(|v| v.trim().parse::<c_int>().ok())
        .filter(|&d| valid_device(d))
        .unwrap_or(0)
}

/// Device `ordinal`'s PCI bus id.
pub fn pci_bus_id(ordinal: usize) -> String {
    if let Ok(list) = std::env::var("TCPXD_CUDASTUB_PCI_BUS_IDS")
        && let Some(id) = list
            .split(',')
            .nth(ordinal)
            .map(str::trim)
            .filter(|s| !s.is_empty())
    {
        return id.to_string();
    }
    match A3_GPU_BUS_IDS.get(ordinal) {
        Some(id) => id.to_string(),
        None => format!("0000:{:02x}:00.0", 0x10 + ordinal),
    }
}

/// How many stand-in allocations are live (host or "device").
pub fn live_allocations() -> usize {
    ALLOCATIONS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .map_or(0, HashMap::len)
}

fn valid_device(dev: CUdevice) -> bool {
    dev >= 0 && (dev as usize) < device_count()
}

fn context_of(dev: CUdevice) -> CUcontext {
    std::ptr::addr_of!(CONTEXTS[dev as usize]) as *mut c_void
}

fn device_of(ctx: CUcontext) -> Option<CUdevice> {
    let base = CONTEXTS.as_ptr() as usize;
    let at = ctx as usize;
    (at >= base && at < base + device_count()).then(|| (at - base) as CUdevice)
}

/// The device of the context current on this thread, if any.
fn current_device() -> Option<CUdevice> {
    CTX_STACK
        .with(|s| s.borrow().last().copied())
        .and_then(|c| device_of(c as CUcontext))
}

/// The allocation holding `addr`: (its start, the allocation).
fn allocation_at(addr: usize) -> Option<(usize, Allocation)> {
    let map = ALLOCATIONS.lock().unwrap_or_else(|e| e.into_inner());
    map.as_ref()?
        .iter()
        .find(|(start, a)| addr >= **start && addr < **start + a.bytes.max(1))
        .map(|(start, a)| (*start, *a))
}

fn alloc(bytes: usize) -> Option<*mut c_void> {
    alloc_on(bytes, None)
}

fn alloc_on(bytes: usize, device: Option<CUdevice>) -> Option<*mut c_void> {
    let (p, memfd) = match device {
        Some(_) => device_pages(bytes)?,
        None => (host_pages(bytes)?, -1),
    };
    ALLOCATIONS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(
            p as usize,
            Allocation {
                bytes,
                device,
                mapped: false,
                memfd,
            },
        );
    Some(p)
}

/// Host memory: page-aligned, as CUDA's allocations are (a plugin's regMr needs 4 KiB), zeroed.
fn host_pages(bytes: usize) -> Option<*mut c_void> {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: out-parameter on the stack; 4096 is a power of two and a multiple of the pointer
    // size; one byte at least so the address is unique.
    if unsafe { libc::posix_memalign(&mut p, 4096, bytes.max(1)) } != 0 || p.is_null() {
        return None;
    }
    // SAFETY: a fresh allocation of at least `bytes.max(1)` bytes; zeroed as calloc would.
    unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, bytes.max(1)) };
    Some(p)
}

/// The length of the mapping behind a device allocation of `bytes`.
fn device_map_len(bytes: usize) -> usize {
    bytes.max(1).next_multiple_of(4096)
}

/// "Device" memory: a memfd's pages (zeroed, as a new file's are), mapped shared, so that the
/// allocation can be exported as a dma-buf (`cuMemGetHandleForAddressRange`, dmabuf.rs) whose
/// pages are the allocation's.
fn device_pages(bytes: usize) -> Option<(*mut c_void, c_int)> {
    let len = device_map_len(bytes);
    // SAFETY: a fresh memfd (close-on-exec); the name is a NUL-terminated literal.
    let fd = unsafe { libc::memfd_create(c"tcpxd-cudastub-mem".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: sizes our own new fd; maps `len` bytes of it, shared, at an address the kernel picks.
    let p = unsafe {
        if libc::ftruncate(fd, len as libc::off_t) != 0 {
            libc::MAP_FAILED
        } else {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        }
    };
    if p == libc::MAP_FAILED {
        // SAFETY: our own fd, closed once.
        unsafe { libc::close(fd) };
        return None;
    }
    Some((p, fd))
}

/// Device `device`'s memory mapped at `start` (vmm.rs's `cuMemMap`).
fn mapped(start: usize, bytes: usize, device: CUdevice) {
    ALLOCATIONS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(
            start,
            Allocation {
                bytes,
                device: Some(device),
                mapped: true,
                memfd: -1,
            },
        );
}

/// The mapping at `start` is gone (`cuMemUnmap`).
fn unmapped(start: usize) {
    if let Some(m) = ALLOCATIONS.lock().unwrap_or_else(|e| e.into_inner()).as_mut()
        && m.get(&start).is_some_and(|a| a.mapped)
    {
        m.remove(&start);
    }
}

fn release(p: *mut c_void) -> bool {
    let gone = ALLOCATIONS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_mut()
        .and_then(|m| match m.get(&(p as usize)) {
            Some(a) if !a.mapped => m.remove(&(p as usize)),
            _ => None,
        });
    match gone {
        Some(a) if a.memfd >= 0 => {
            // SAFETY: the mapping and memfd `device_pages` made for this allocation, still
            // registered until just now, so unmapped and closed once. A dma-buf exported from it
            // holds its own fd (the pages live on for it, as a dma-buf keeps GPU memory).
            unsafe {
                libc::munmap(p, device_map_len(a.bytes));
                libc::close(a.memfd);
            }
            true
        }
        Some(_) => {
            // SAFETY: p came from posix_memalign in `host_pages` and was still registered, so it
            // is freed once.
            unsafe { libc::free(p) };
            true
        }
        None => false,
    }
}

/// Writes `text` NUL-terminated into `buf` of `len` bytes.
fn write_c_string(buf: *mut c_char, len: c_int, text: &str) -> bool {
    if buf.is_null() || len <= text.len() as c_int {
        return false;
    }
    // SAFETY: buf holds len > text.len() bytes (checked above): the text and its NUL fit.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), buf.cast::<u8>(), text.len());
        *buf.add(text.len()) = 0;
    }
    true
}

/// Stores `value` through `out`, or says the pointer was null.
fn put<T>(out: *mut T, value: T) -> bool {
    if out.is_null() {
        return false;
    }
    // SAFETY: non-null, and the caller passes a pointer to a T by the CUDA API's contract.
    unsafe { out.write(value) };
    true
}

fn ok_or(done: bool, err: CUresult) -> CUresult {
    if done { CUDA_SUCCESS } else { err }
}

macro_rules! driver {
    () => {
        if !INITIALISED.load(Ordering::Acquire) {
            return CUDA_ERROR_NOT_INITIALIZED;
        }
    };
}

/// The text of a driver or runtime code (they share numbers).
fn error_text(code: c_int) -> (&'static CStr, &'static CStr) {
    match code {
        0 => (c"CUDA_SUCCESS", c"no error"),
        1 => (c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
        2 => (c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
        3 => (c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
        101 => (c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
        201 => (c"CUDA_ERROR_INVALID_CONTEXT", c"invalid device context"),
        801 => (
            c"CUDA_ERROR_NOT_SUPPORTED",
            c"operation not supported (tcpxd CUDA stand-in: host memory only)",
        ),
        _ => (c"CUDA_ERROR_UNKNOWN", c"unknown error"),
    }
}

// ---- driver API ------------------------------------------------------------------------------

#[unsafe(no_mangle)]
pub extern "C" fn cuInit(_flags: c_uint) -> CUresult {
    INITIALISED.store(true, Ordering::Release);
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    ok_or(put(version, 12040), CUDA_ERROR_INVALID_VALUE)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    driver!();
    ok_or(put(count, device_count() as c_int), CUDA_ERROR_INVALID_VALUE)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGet(device: *mut CUdevice, ordinal: c_int) -> CUresult {
    driver!();
    if !valid_device(ordinal) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    ok_or(put(device, ordinal), CUDA_ERROR_INVALID_VALUE)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    driver!();
    if !valid_device(dev) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    ok_or(
        write_c_string(name, len, "tcpxd CUDA stand-in (host memory)"),
        CUDA_ERROR_INVALID_VALUE,
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGetPCIBusId(bus_id: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    driver!();
    if !valid_device(dev) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    ok_or(
        write_c_string(bus_id, len, &pci_bus_id(dev as usize)),
        CUDA_ERROR_INVALID_VALUE,
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    driver!();
    if !valid_device(dev) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    ok_or(put(ctx, context_of(dev)), CUDA_ERROR_INVALID_VALUE)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    driver!();
    if valid_device(dev) {
        CUDA_SUCCESS
    } else {
        CUDA_ERROR_INVALID_DEVICE
    }
}

/// A created context is the device's one context, made current as CUDA does.
#[unsafe(no_mangle)]
pub extern "C" fn cuCtxCreate_v2(ctx: *mut CUcontext, _flags: c_uint, dev: CUdevice) -> CUresult {
    driver!();
    if !valid_device(dev) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    if !put(ctx, context_of(dev)) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    CTX_STACK.with(|s| s.borrow_mut().push(context_of(dev) as usize));
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult {
    driver!();
    if device_of(ctx).is_none() {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    CTX_STACK.with(|s| s.borrow_mut().retain(|&c| c != ctx as usize));
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxPushCurrent_v2(ctx: CUcontext) -> CUresult {
    driver!();
    if device_of(ctx).is_none() {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    CTX_STACK.with(|s| s.borrow_mut().push(ctx as usize));
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxPopCurrent_v2(ctx: *mut CUcontext) -> CUresult {
    driver!();
    match CTX_STACK.with(|s| s.borrow_mut().pop()) {
        Some(top) => {
            if !ctx.is_null() {
                put(ctx, top as CUcontext);
            }
            CUDA_SUCCESS
        }
        None => CUDA_ERROR_INVALID_CONTEXT,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxGetCurrent(ctx: *mut CUcontext) -> CUresult {
    driver!();
    let top = CTX_STACK.with(|s| s.borrow().last().copied()).unwrap_or(0);
    ok_or(put(ctx, top as CUcontext), CUDA_ERROR_INVALID_VALUE)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetCurrent(ctx: CUcontext) -> CUresult {
    driver!();
    if !ctx.is_null() && device_of(ctx).is_none() {
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    CTX_STACK.with(|s| {
        let mut s = s.borrow_mut();
        s.pop();
        if !ctx.is_null() {
            s.push(ctx as usize);
        }
    });
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxGetDevice(dev: *mut CUdevice) -> CUresult {
    driver!();
    match CTX_STACK
        .with(|s| s.borrow().last().copied())
        .and_then(|c| device_of(c as CUcontext))
    {
        Some(d) => ok_or(put(dev, d), CUDA_ERROR_INVALID_VALUE),
        None => CUDA_ERROR_INVALID_CONTEXT,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    driver!();
    CUDA_SUCCESS
}

fn host_alloc(out: *mut *mut c_void, bytes: usize) -> CUresult {
    if out.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    match alloc(bytes) {
        Some(p) => ok_or(put(out, p), CUDA_ERROR_INVALID_VALUE),
        None => CUDA_ERROR_OUT_OF_MEMORY,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemHostAlloc(out: *mut *mut c_void, bytes: usize, _flags: c_uint) -> CUresult {
    driver!();
    host_alloc(out, bytes)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAllocHost_v2(out: *mut *mut c_void, bytes: usize) -> CUresult {
    driver!();
    host_alloc(out, bytes)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    driver!();
    ok_or(release(p), CUDA_ERROR_INVALID_VALUE)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAlloc_v2(out: *mut CUdeviceptr, bytes: usize) -> CUresult {
    driver!();
    if out.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    match alloc_on(bytes, Some(current_device().unwrap_or(0))) {
        Some(p) => ok_or(put(out, p as CUdeviceptr), CUDA_ERROR_INVALID_VALUE),
        None => CUDA_ERROR_OUT_OF_MEMORY,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(p: CUdeviceptr) -> CUresult {
    driver!();
    ok_or(release(p as usize as *mut c_void), CUDA_ERROR_INVALID_VALUE)
}

/// Host memory's device pointer is the host pointer.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemHostGetDevicePointer_v2(
    out: *mut CUdeviceptr,
    host: *mut c_void,
    _flags: c_uint,
) -> CUresult {
    driver!();
    if host.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    ok_or(put(out, host as CUdeviceptr), CUDA_ERROR_INVALID_VALUE)
}

fn copy(dst: *mut c_void, src: *const c_void, bytes: usize) -> bool {
    if bytes == 0 {
        return true;
    }
    if dst.is_null() || src.is_null() {
        return false;
    }
    // SAFETY: both are the caller's buffers of at least `bytes` bytes (the CUDA copy contract);
    // ptr::copy tolerates overlap.
    unsafe { std::ptr::copy(src.cast::<u8>(), dst.cast::<u8>(), bytes) };
    true
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, bytes: usize) -> CUresult {
    driver!();
    ok_or(
        copy(dst as usize as *mut c_void, src, bytes),
        CUDA_ERROR_INVALID_VALUE,
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, bytes: usize) -> CUresult {
    driver!();
    ok_or(
        copy(dst, src as usize as *const c_void, bytes),
        CUDA_ERROR_INVALID_VALUE,
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGetErrorString(code: CUresult, text: *mut *const c_char) -> CUresult {
    ok_or(put(text, error_text(code).1.as_ptr()), CUDA_ERROR_INVALID_VALUE)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuGetErrorName(code: CUresult, text: *mut *const c_char) -> CUresult {
    ok_or(put(text, error_text(code).0.as_ptr()), CUDA_ERROR_INVALID_VALUE)
}

/// `CUipcMemHandle`, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUipcMemHandle {
    pub reserved: [c_char; 64],
}

// IPC import: not over host memory. (dma-buf export is in dmabuf.rs; the virtual memory
// management calls, over mmap of a shared file, in vmm.rs.)
#[unsafe(no_mangle)]
pub extern "C" fn cuIpcOpenMemHandle_v2(
    _ptr: *mut CUdeviceptr,
    _handle: CUipcMemHandle,
    _flags: c_uint,
) -> CUresult {
    CUDA_ERROR_NOT_SUPPORTED
}

// ---- runtime API (initialises the driver implicitly, as the real runtime does) -----------------

fn rt(code: CUresult) -> CudaError {
    match code {
        CUDA_SUCCESS => CUDA_RT_SUCCESS,
        CUDA_ERROR_OUT_OF_MEMORY => CUDA_RT_ERROR_MEMORY_ALLOCATION,
        CUDA_ERROR_INVALID_DEVICE => CUDA_RT_ERROR_INVALID_DEVICE,
        CUDA_ERROR_NOT_SUPPORTED => CUDA_RT_ERROR_NOT_SUPPORTED,
        _ => CUDA_RT_ERROR_INVALID_VALUE,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaGetDeviceCount(count: *mut c_int) -> CudaError {
    cuInit(0);
    rt(cuDeviceGetCount(count))
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaGetDevice(dev: *mut c_int) -> CudaError {
    rt(ok_or(
        put(
            dev,
            current_device().unwrap_or_else(|| {
                let current = RT_DEVICE.with(|d| d.get());
                if current < 0 { default_device() } else { current }
            }),
        ),
        CUDA_ERROR_INVALID_VALUE,
    ))
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaSetDevice(dev: c_int) -> CudaError {
    if !valid_device(dev) {
        return CUDA_RT_ERROR_INVALID_DEVICE;
    }
    RT_DEVICE.with(|d| d.set(dev));
    // As the runtime does: the device's primary context becomes the thread's current one.
    CTX_STACK.with(|s| {
        let mut s = s.borrow_mut();
        s.pop();
        s.push(context_of(dev) as usize);
    });
    CUDA_RT_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaDeviceGetPCIBusId(bus_id: *mut c_char, len: c_int, dev: c_int) -> CudaError {
    cuInit(0);
    rt(cuDeviceGetPCIBusId(bus_id, len, dev))
}

/// Finds the device whose PCI bus id matches (case-insensitive, with or without the domain).
///
/// # Safety
/// `bus_id` is null or a NUL-terminated string; `dev` is null or points at an int.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cudaDeviceGetByPCIBusId(dev: *mut c_int, bus_id: *const c_char) -> CudaError {
    if bus_id.is_null() {
        return CUDA_RT_ERROR_INVALID_VALUE;
    }
    // SAFETY: non-null, and the runtime's contract is a NUL-terminated string.
    let wanted = unsafe { CStr::from_ptr(bus_id) }
        .to_string_lossy()
        .to_ascii_lowercase();
    let norm = |s: &str| {
        s.rsplit_once(':')
            .map(|(a, b)| format!("{}:{b}", a.rsplit(':').next().unwrap_or(a)))
            .unwrap_or_default()
    };
    match (0..device_count()).find(|&i| norm(&pci_bus_id(i).to_ascii_lowercase()) == norm(&wanted)) {
        Some(i) => rt(ok_or(put(dev, i as c_int), CUDA_ERROR_INVALID_VALUE)),
        None => CUDA_RT_ERROR_INVALID_DEVICE,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaHostAlloc(out: *mut *mut c_void, bytes: usize, _flags: c_uint) -> CudaError {
    rt(host_alloc(out, bytes))
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaMallocHost(out: *mut *mut c_void, bytes: usize) -> CudaError {
    rt(host_alloc(out, bytes))
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaMalloc(out: *mut *mut c_void, bytes: usize) -> CudaError {
    cuInit(0);
    let dev = current_device().unwrap_or_else(|| {
        let d = RT_DEVICE.with(|d| d.get());
        if d < 0 { default_device() } else { d }
    });
    match alloc_on(bytes, Some(dev)) {
        Some(p) => rt(ok_or(put(out, p), CUDA_ERROR_INVALID_VALUE)),
        None => CUDA_RT_ERROR_MEMORY_ALLOCATION,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaFreeHost(p: *mut c_void) -> CudaError {
    rt(ok_or(release(p), CUDA_ERROR_INVALID_VALUE))
}

/// `cudaFree(NULL)` is a no-op, as in CUDA.
#[unsafe(no_mangle)]
pub extern "C" fn cudaFree(p: *mut c_void) -> CudaError {
    if p.is_null() {
        return CUDA_RT_SUCCESS;
    }
    rt(ok_or(release(p), CUDA_ERROR_INVALID_VALUE))
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaMemcpy(dst: *mut c_void, src: *const c_void, bytes: usize, _kind: c_int) -> CudaError {
    rt(ok_or(copy(dst, src, bytes), CUDA_ERROR_INVALID_VALUE))
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaHostGetDevicePointer(
    out: *mut *mut c_void,
    host: *mut c_void,
    _flags: c_uint,
) -> CudaError {
    if host.is_null() {
        return CUDA_RT_ERROR_INVALID_VALUE;
    }
    rt(ok_or(put(out, host), CUDA_ERROR_INVALID_VALUE))
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaGetErrorString(code: CudaError) -> *const c_char {
    error_text(code).1.as_ptr()
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaGetErrorName(code: CudaError) -> *const c_char {
    error_text(code).0.as_ptr()
}

#[unsafe(no_mangle)]
pub extern "C" fn cudaGetLastError() -> CudaError {
    CUDA_RT_SUCCESS
}

mod datapath;
mod dmabuf;
mod vmm;
pub use datapath::*;
pub use dmabuf::*;
pub use vmm::*;

#[cfg(test)]
mod tests;
