//! The stand-in's data-path calls: streams, events, asynchronous copies, memset, pointer
//! attributes, address ranges and device attributes: what the emulation's CUDA mode and tcpxd's
//! GPU data path without kernels (the `d2d` and `host` unpackers) call. Every copy happens at once
//! (host memory), so every stream is always idle and every event has always completed. Modules
//! and kernel launches answer `CUDA_ERROR_NOT_SUPPORTED`, IPC too.

use super::*;
use std::sync::atomic::AtomicUsize;
use std::time::Instant;

pub type CUstream = *mut c_void;
pub type CUevent = *mut c_void;

/// `CUipcEventHandle`, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CUipcEventHandle {
    pub reserved: [c_char; 64],
}

/// Handles of live streams and events (distinct non-null values; never dereferenced).
static NEXT_HANDLE: AtomicUsize = AtomicUsize::new(0x5157_0000);
/// Live stream → the device current when it was made (`None`: no current device).
static STREAMS: Mutex<Option<HashMap<usize, Option<CUdevice>>>> = Mutex::new(None);
/// Event → when it was last recorded (for cuEventElapsedTime).
static EVENTS: Mutex<Option<HashMap<usize, Option<Instant>>>> = Mutex::new(None);

fn new_handle() -> usize {
    NEXT_HANDLE.fetch_add(16, Ordering::Relaxed)
}

/// The null stream (0) and the per-thread / legacy streams (1, 2) are always valid.
fn valid_stream(s: CUstream) -> bool {
    (s as usize) <= 2
        || STREAMS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(|m| m.contains_key(&(s as usize)))
}

/// `TCPXD_CUDASTUB_MAX_STREAMS`: at most this many streams exist at once on a device (the
/// current one when made); a `cuStreamCreate` beyond them answers `CUDA_ERROR_OUT_OF_MEMORY` (as
/// a driver out of resources does), so a test makes the creation of a pool of streams fail
/// while single streams are still made. Unset: no limit.
fn max_streams() -> Option<usize> {
    static MAX: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        std::env::var("TCPXD_CUDASTUB_MAX_STREAMS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamCreate(out: *mut CUstream, _flags: c_uint) -> CUresult {
    driver!();
    let mut streams = STREAMS.lock().unwrap_or_else(|e| e.into_inner());
    let streams = streams.get_or_insert_with(HashMap::new);
    let device = current_device();
    if max_streams().is_some_and(|max| streams.values().filter(|d| **d == device).count() >= max) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    let h = new_handle();
    if !put(out, h as CUstream) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    streams.insert(h, device);
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamCreateWithPriority(
    out: *mut CUstream,
    flags: c_uint,
    _priority: c_int,
) -> CUresult {
    cuStreamCreate(out, flags)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamDestroy_v2(s: CUstream) -> CUresult {
    driver!();
    let known = STREAMS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_mut()
        .is_some_and(|m| m.remove(&(s as usize)).is_some());
    ok_or(known, CUDA_ERROR_INVALID_VALUE)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamSynchronize(s: CUstream) -> CUresult {
    driver!();
    ok_or(valid_stream(s), CUDA_ERROR_INVALID_VALUE)
}

/// Always idle: every copy finished when it was queued.
#[unsafe(no_mangle)]
pub extern "C" fn cuStreamQuery(s: CUstream) -> CUresult {
    driver!();
    ok_or(valid_stream(s), CUDA_ERROR_INVALID_VALUE)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamWaitEvent(s: CUstream, _e: CUevent, _flags: c_uint) -> CUresult {
    driver!();
    ok_or(valid_stream(s), CUDA_ERROR_INVALID_VALUE)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventCreate(out: *mut CUevent, _flags: c_uint) -> CUresult {
    driver!();
    let h = new_handle();
    if !put(out, h as CUevent) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    EVENTS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(h, None);
    CUDA_SUCCESS
}

fn with_event<R>(e: CUevent, f: impl FnOnce(&mut Option<Instant>) -> R) -> Option<R> {
    let mut m = EVENTS.lock().unwrap_or_else(|e| e.into_inner());
    m.as_mut()?.get_mut(&(e as usize)).map(f)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecord(e: CUevent, s: CUstream) -> CUresult {
    driver!();
    if !valid_stream(s) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    ok_or(
        with_event(e, |t| *t = Some(Instant::now())).is_some(),
        CUDA_ERROR_INVALID_VALUE,
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecordWithFlags(e: CUevent, s: CUstream, _flags: c_uint) -> CUresult {
    cuEventRecord(e, s)
}

/// `TCPXD_CUDASTUB_EVENT_DELAY_MS`: an event reports its work done only this long after it was
/// recorded (the copies themselves are done at once): a test holds the daemon's asynchronous
/// copies "in flight" for that long. Unset: 0.
fn event_delay() -> std::time::Duration {
    static DELAY: std::sync::OnceLock<std::time::Duration> = std::sync::OnceLock::new();
    *DELAY.get_or_init(|| {
        let ms = std::env::var("TCPXD_CUDASTUB_EVENT_DELAY_MS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        std::time::Duration::from_millis(ms)
    })
}

/// When a recorded event's work counts as done (`None`: never recorded, done).
fn event_ready(e: CUevent) -> Option<Option<Instant>> {
    with_event(e, |t| t.map(|at| at + event_delay()))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventQuery(e: CUevent) -> CUresult {
    driver!();
    match event_ready(e) {
        None => CUDA_ERROR_INVALID_VALUE,
        Some(Some(at)) if Instant::now() < at => CUDA_ERROR_NOT_READY,
        Some(_) => CUDA_SUCCESS,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventSynchronize(e: CUevent) -> CUresult {
    driver!();
    match event_ready(e) {
        None => CUDA_ERROR_INVALID_VALUE,
        Some(at) => {
            if let Some(wait) = at.and_then(|at| at.checked_duration_since(Instant::now())) {
                std::thread::sleep(wait);
            }
            CUDA_SUCCESS
        }
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventDestroy_v2(e: CUevent) -> CUresult {
    driver!();
    let known = EVENTS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_mut()
        .is_some_and(|m| m.remove(&(e as usize)).is_some());
    ok_or(known, CUDA_ERROR_INVALID_VALUE)
}

/// Milliseconds between two recordings, measured on the host clock.
#[unsafe(no_mangle)]
pub extern "C" fn cuEventElapsedTime(ms: *mut f32, start: CUevent, end: CUevent) -> CUresult {
    driver!();
    let (Some(Some(a)), Some(Some(b))) = (with_event(start, |t| *t), with_event(end, |t| *t)) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    let d = b.saturating_duration_since(a).as_secs_f32() * 1000.0;
    ok_or(put(ms, d), CUDA_ERROR_INVALID_VALUE)
}

fn copy_on(dst: *mut c_void, src: *const c_void, bytes: usize, s: CUstream) -> CUresult {
    if !valid_stream(s) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    ok_or(copy(dst, src, bytes), CUDA_ERROR_INVALID_VALUE)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    bytes: usize,
    s: CUstream,
) -> CUresult {
    driver!();
    copy_on(dst as usize as *mut c_void, src, bytes, s)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: CUdeviceptr,
    bytes: usize,
    s: CUstream,
) -> CUresult {
    driver!();
    copy_on(dst, src as usize as *const c_void, bytes, s)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    bytes: usize,
    s: CUstream,
) -> CUresult {
    driver!();
    copy_on(
        dst as usize as *mut c_void,
        src as usize as *const c_void,
        bytes,
        s,
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize) -> CUresult {
    driver!();
    copy_on(
        dst as usize as *mut c_void,
        src as usize as *const c_void,
        bytes,
        std::ptr::null_mut(),
    )
}

/// `cuMemcpy` / `cuMemcpyAsync` (unified addressing: any two addresses).
#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpy(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize) -> CUresult {
    cuMemcpyDtoD_v2(dst, src, bytes)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemcpyAsync(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize, s: CUstream) -> CUresult {
    cuMemcpyDtoDAsync_v2(dst, src, bytes, s)
}

fn memset(dst: CUdeviceptr, value: u8, bytes: usize) -> CUresult {
    if bytes == 0 {
        return CUDA_SUCCESS;
    }
    let Some((start, a)) = allocation_at(dst as usize) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    if dst as usize + bytes > start + a.bytes {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: [dst, dst + bytes) lies inside a live allocation of this library (checked above).
    unsafe { std::ptr::write_bytes(dst as usize as *mut u8, value, bytes) };
    CUDA_SUCCESS
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD8_v2(dst: CUdeviceptr, value: u8, bytes: usize) -> CUresult {
    driver!();
    memset(dst, value, bytes)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemsetD8Async(dst: CUdeviceptr, value: u8, bytes: usize, s: CUstream) -> CUresult {
    driver!();
    if !valid_stream(s) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    memset(dst, value, bytes)
}

// CUpointer_attribute and CUmemorytype values (cuda.h).
const ATTR_CONTEXT: c_int = 1;
const ATTR_MEMORY_TYPE: c_int = 2;
const ATTR_DEVICE_POINTER: c_int = 3;
const ATTR_HOST_POINTER: c_int = 4;
const ATTR_IS_MANAGED: c_int = 8;
const ATTR_DEVICE_ORDINAL: c_int = 9;
const ATTR_RANGE_START_ADDR: c_int = 11;
const ATTR_RANGE_SIZE: c_int = 12;
const MEMORYTYPE_HOST: c_uint = 1;
const MEMORYTYPE_DEVICE: c_uint = 2;

/// Answers for allocations of this library; an unknown address is `CUDA_ERROR_INVALID_VALUE`, as
/// CUDA answers for memory it does not know.
///
/// # Safety
/// `data` points at storage of the attribute's type (CUDA's contract).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuPointerGetAttribute(
    data: *mut c_void,
    attribute: c_int,
    ptr: CUdeviceptr,
) -> CUresult {
    driver!();
    let Some((start, a)) = allocation_at(ptr as usize) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    let device = a.device.unwrap_or(0);
    let done = match attribute {
        ATTR_CONTEXT => put(data.cast::<CUcontext>(), context_of(device)),
        ATTR_MEMORY_TYPE => put(
            data.cast::<c_uint>(),
            if a.device.is_some() {
                MEMORYTYPE_DEVICE
            } else {
                MEMORYTYPE_HOST
            },
        ),
        ATTR_DEVICE_POINTER | ATTR_HOST_POINTER => put(data.cast::<CUdeviceptr>(), ptr),
        ATTR_IS_MANAGED => put(data.cast::<c_uint>(), 0),
        ATTR_DEVICE_ORDINAL => put(data.cast::<c_int>(), device),
        ATTR_RANGE_START_ADDR => put(data.cast::<CUdeviceptr>(), start as CUdeviceptr),
        ATTR_RANGE_SIZE => put(data.cast::<usize>(), a.bytes),
        _ => return CUDA_ERROR_NOT_SUPPORTED,
    };
    ok_or(done, CUDA_ERROR_INVALID_VALUE)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemGetAddressRange_v2(
    base: *mut CUdeviceptr,
    size: *mut usize,
    ptr: CUdeviceptr,
) -> CUresult {
    driver!();
    let Some((start, a)) = allocation_at(ptr as usize) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    if !base.is_null() {
        put(base, start as CUdeviceptr);
    }
    if !size.is_null() {
        put(size, a.bytes);
    }
    CUDA_SUCCESS
}

// CUdevice_attribute values the daemon and NCCL-style callers ask for.
const DEV_ATTR_MULTIPROCESSOR_COUNT: c_int = 16;
const DEV_ATTR_PCI_BUS_ID: c_int = 33;
const DEV_ATTR_PCI_DEVICE_ID: c_int = 34;
const DEV_ATTR_UNIFIED_ADDRESSING: c_int = 41;
const DEV_ATTR_PCI_DOMAIN_ID: c_int = 50;
const DEV_ATTR_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
const DEV_ATTR_COMPUTE_CAPABILITY_MINOR: c_int = 76;

/// An H100's compute capability (9.0) and multiprocessors (132); the PCI ids from the bus id.
#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceGetAttribute(out: *mut c_int, attribute: c_int, dev: CUdevice) -> CUresult {
    driver!();
    if !valid_device(dev) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    let id = pci_bus_id(dev as usize);
    let field = |i: usize| {
        id.split([':', '.'])
            .nth(i)
            .and_then(|f| c_int::from_str_radix(f, 16).ok())
            .unwrap_or(0)
    };
    let v = match attribute {
        DEV_ATTR_MULTIPROCESSOR_COUNT => 132,
        DEV_ATTR_PCI_DOMAIN_ID => field(0),
        DEV_ATTR_PCI_BUS_ID => field(1),
        DEV_ATTR_PCI_DEVICE_ID => field(2),
        DEV_ATTR_UNIFIED_ADDRESSING => 1,
        DEV_ATTR_COMPUTE_CAPABILITY_MAJOR => 9,
        DEV_ATTR_COMPUTE_CAPABILITY_MINOR => 0,
        _ => 0,
    };
    ok_or(put(out, v), CUDA_ERROR_INVALID_VALUE)
}

/// 80 GiB, an H100's.
#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    driver!();
    if !valid_device(dev) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    ok_or(put(bytes, 80usize << 30), CUDA_ERROR_INVALID_VALUE)
}

/// All "devices" share the host's memory: every pair can reach each other.
#[unsafe(no_mangle)]
pub extern "C" fn cuDeviceCanAccessPeer(can: *mut c_int, dev: CUdevice, peer: CUdevice) -> CUresult {
    driver!();
    if !valid_device(dev) || !valid_device(peer) {
        return CUDA_ERROR_INVALID_DEVICE;
    }
    ok_or(put(can, 1), CUDA_ERROR_INVALID_VALUE)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxEnablePeerAccess(ctx: CUcontext, _flags: c_uint) -> CUresult {
    driver!();
    ok_or(device_of(ctx).is_some(), CUDA_ERROR_INVALID_CONTEXT)
}

// No kernels: a module cannot be loaded, so nothing can be launched.
#[unsafe(no_mangle)]
pub extern "C" fn cuModuleLoadData(_module: *mut *mut c_void, _image: *const c_void) -> CUresult {
    CUDA_ERROR_NOT_SUPPORTED
}

#[unsafe(no_mangle)]
pub extern "C" fn cuModuleUnload(_module: *mut c_void) -> CUresult {
    CUDA_ERROR_NOT_SUPPORTED
}

#[unsafe(no_mangle)]
pub extern "C" fn cuModuleGetFunction(
    _f: *mut *mut c_void,
    _module: *mut c_void,
    _name: *const c_char,
) -> CUresult {
    CUDA_ERROR_NOT_SUPPORTED
}

#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchKernel(
    _f: *mut c_void,
    _gx: c_uint,
    _gy: c_uint,
    _gz: c_uint,
    _bx: c_uint,
    _by: c_uint,
    _bz: c_uint,
    _shared: c_uint,
    _s: CUstream,
    _params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    CUDA_ERROR_NOT_SUPPORTED
}

#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchKernelEx(
    _config: *const c_void,
    _f: *mut c_void,
    _params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CUresult {
    CUDA_ERROR_NOT_SUPPORTED
}

#[unsafe(no_mangle)]
pub extern "C" fn cuOccupancyMaxActiveBlocksPerMultiprocessor(
    _blocks: *mut c_int,
    _f: *mut c_void,
    _block_size: c_int,
    _shared: usize,
) -> CUresult {
    CUDA_ERROR_NOT_SUPPORTED
}

/// The first bytes of the stand-in's IPC handles.
pub const IPC_MAGIC: &[u8; 8] = b"TCPXSTUB";

/// IPC: a "device" allocation is this process's host memory and cannot be opened by another
/// process (`cuIpcOpenMemHandle` answers `CUDA_ERROR_NOT_SUPPORTED`), but exporting names it:
/// the handle holds `TCPXSTUB`, the pid, the allocation's start and size, so that a daemon that
/// exports every CUDA buffer it allocates can run.
#[unsafe(no_mangle)]
pub extern "C" fn cuIpcGetMemHandle(handle: *mut CUipcMemHandle, ptr: CUdeviceptr) -> CUresult {
    driver!();
    let Some((start, a)) = allocation_at(ptr as usize) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    if a.device.is_none() || start != ptr as usize {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let mut bytes = [0u8; 64];
    bytes[..8].copy_from_slice(IPC_MAGIC);
    bytes[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    bytes[16..24].copy_from_slice(&(start as u64).to_le_bytes());
    bytes[24..32].copy_from_slice(&(a.bytes as u64).to_le_bytes());
    let mut h = CUipcMemHandle { reserved: [0; 64] };
    for (d, s) in h.reserved.iter_mut().zip(bytes) {
        *d = s as c_char;
    }
    ok_or(put(handle, h), CUDA_ERROR_INVALID_VALUE)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuIpcCloseMemHandle(_ptr: CUdeviceptr) -> CUresult {
    CUDA_ERROR_NOT_SUPPORTED
}

#[unsafe(no_mangle)]
pub extern "C" fn cuIpcOpenEventHandle(_event: *mut CUevent, _handle: CUipcEventHandle) -> CUresult {
    CUDA_ERROR_NOT_SUPPORTED
}
