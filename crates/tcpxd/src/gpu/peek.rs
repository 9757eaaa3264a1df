//! Reading a few bytes of device memory whose owner is not known in advance (the plugin's
//! `unpackNetDeviceHandle`, which it allocates on the device current at accept time).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::sys;

use super::error::check;
use super::{Gpu, GpuError, GpuResult};

fn gpus() -> &'static Mutex<HashMap<usize, Arc<Gpu>>> {
    static GPUS: OnceLock<Mutex<HashMap<usize, Arc<Gpu>>>> = OnceLock::new();
    GPUS.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Copies `out.len()` bytes from device address `ptr` (on whichever device owns it).
pub fn read_any_device(ptr: u64, out: &mut [u8]) -> GpuResult<()> {
    shared(device_of(ptr)?)?.read_device(ptr, out)
}

/// The ordinal of the GPU that owns device address `ptr`.
pub fn device_of(ptr: u64) -> GpuResult<usize> {
    super::driver().map_err(|e| GpuError::InvalidArgument(e.to_string()))?;
    shared(0)?.bind_to_thread()?;
    let mut ordinal: i32 = 0;
    // SAFETY: as in `read_any_device`: a plain int written through our pointer; an unknown
    // address is reported as an error, never dereferenced.
    let rc = unsafe {
        sys::cuPointerGetAttribute(
            (&mut ordinal as *mut i32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            ptr,
        )
    };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(GpuError::InvalidArgument(format!(
            "{ptr:#x} is not device memory known to CUDA ({rc:?})"
        )));
    }
    Ok(ordinal as usize)
}

/// The bytes from `ptr` to the end of the device allocation holding it (`cuMemGetAddressRange`
/// on its GPU): how far a kernel may read from the plugin's bounce buffer, which the ABI does
/// not size.
pub fn allocation_extent(ptr: u64) -> GpuResult<u64> {
    let (base, len) = shared(device_of(ptr)?)?.allocation_range(ptr)?;
    Ok(base + len - ptr)
}

/// Lets kernels running on `gpu` read and write memory of GPU `peer` (`cuCtxEnablePeerAccess`;
/// already enabled is fine). An error when the two devices cannot reach each other.
pub fn enable_peer_access(gpu: &Gpu, peer: usize) -> GpuResult<()> {
    if peer == gpu.ordinal {
        return Ok(());
    }
    let other = shared(peer)?;
    let mut can: i32 = 0;
    // SAFETY: writes one int; both device handles are live.
    check("cuDeviceCanAccessPeer", unsafe {
        sys::cuDeviceCanAccessPeer(&mut can, gpu.dev, other.dev)
    })?;
    if can == 0 {
        return Err(GpuError::InvalidArgument(format!(
            "GPU {} cannot access GPU {peer}'s memory (no peer access between them)",
            gpu.ordinal
        )));
    }
    gpu.bind_to_thread()?;
    // SAFETY: `other.ctx` is a retained primary context; the call only records the mapping.
    let rc = unsafe { sys::cuCtxEnablePeerAccess(other.ctx, 0) };
    match rc {
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
        other => check("cuCtxEnablePeerAccess", other),
    }
}

/// The process's handle for GPU `ordinal`, opened on first use and shared afterwards (one
/// retained primary context per device for the whole daemon).
pub fn shared(ordinal: usize) -> GpuResult<Arc<Gpu>> {
    let mut map = gpus().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(g) = map.get(&ordinal) {
        return Ok(g.clone());
    }
    let g = Gpu::open(ordinal)?;
    map.insert(ordinal, g.clone());
    Ok(g)
}

/// Waits until the CUDA event behind an IPC event handle (recorded by a client process) has
/// completed, or `deadline` passes (`Ok(false)`). Polls without blocking a thread in the driver.
pub fn wait_ipc_event(gpu: &Gpu, handle: &[u8; 64], deadline: std::time::Instant) -> GpuResult<bool> {
    gpu.bind_to_thread()?;
    let mut h = sys::CUipcEventHandle { reserved: [0; 64] };
    for (d, s) in h.reserved.iter_mut().zip(handle) {
        *d = *s as std::ffi::c_char;
    }
    let mut event: sys::CUevent = std::ptr::null_mut();
    // SAFETY: `event` receives a new event handle, destroyed below.
    let rc = unsafe { sys::cuIpcOpenEventHandle(&mut event, h) };
    if rc != sys::CUresult::CUDA_SUCCESS {
        return Err(GpuError::InvalidArgument(format!("cuIpcOpenEventHandle: {rc:?}")));
    }
    // The daemon's one backoff, at the poller's pace (spins, then yields, then 50 µs naps).
    let mut idle = crate::idle::Backoff::new();
    let result = loop {
        // SAFETY: `event` is the live event opened above.
        let q = unsafe { sys::cuEventQuery(event) };
        match q {
            sys::CUresult::CUDA_SUCCESS => break Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY if std::time::Instant::now() < deadline => {
                idle.step_or_sleep()
            }
            sys::CUresult::CUDA_ERROR_NOT_READY => break Ok(false),
            other => break Err(GpuError::InvalidArgument(format!("cuEventQuery: {other:?}"))),
        }
    };
    // SAFETY: destroying the event opened above, once.
    unsafe { sys::cuEventDestroy_v2(event) };
    result
}
