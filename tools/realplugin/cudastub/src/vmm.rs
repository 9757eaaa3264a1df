//! The virtual memory management calls over a shared file: what Google's plugin does at accept to
//! import RxDM's GPU receive memory (`CuIpcMemfdHandle`: `cuMemImportFromShareableHandle` of the
//! POSIX fd RxDM sent, `cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess`). Here the fd is a
//! file (the fake RxDM's memfd), the reservation an inaccessible anonymous mapping, and mapping
//! the handle maps the file there, shared: the "device" memory is the file's pages.

use super::*;

/// Imported handles: handle value -> the process's own duplicate of the fd.
static HANDLES: Mutex<Option<HashMap<u64, c_int>>> = Mutex::new(None);
/// Reservations: start -> (the mapping's start, its length), kept for cuMemAddressFree.
static RESERVED: Mutex<Option<HashMap<u64, (usize, usize)>>> = Mutex::new(None);
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
const POSIX_FD: c_int = 1;

#[unsafe(no_mangle)]
pub extern "C" fn cuMemImportFromShareableHandle(
    handle: *mut c_ulonglong,
    os: *mut c_void,
    kind: c_int,
) -> CUresult {
    driver!();
    if handle.is_null() || kind != POSIX_FD {
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    // SAFETY: dup of the caller's fd (the handle type says the pointer carries one); an invalid
    // fd is an error, nothing else happens.
    let fd = unsafe { libc::dup(os as usize as c_int) };
    if fd < 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let h = 0x4d45_4d00_0000_0000u64 | fd as u64;
    HANDLES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(h, fd);
    ok_or(put(handle, h), CUDA_ERROR_INVALID_VALUE)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAddressReserve(
    ptr: *mut CUdeviceptr,
    size: usize,
    align: usize,
    _addr: CUdeviceptr,
    _flags: c_ulonglong,
) -> CUresult {
    driver!();
    if ptr.is_null() || size == 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let align = align.max(4096).next_power_of_two();
    let len = size + align;
    // SAFETY: a fresh anonymous mapping with no access; nothing is read or written through it.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    let start = (base as usize).next_multiple_of(align) as u64;
    RESERVED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(start, (base as usize, len));
    ok_or(put(ptr, start), CUDA_ERROR_INVALID_VALUE)
}

fn reserved(ptr: CUdeviceptr, size: usize) -> bool {
    RESERVED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .is_some_and(|m| {
            m.iter()
                .any(|(&s, &(base, len))| ptr >= s && ptr as usize + size <= base + len)
        })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemMap(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: c_ulonglong,
    _flags: c_ulonglong,
) -> CUresult {
    driver!();
    let fd = HANDLES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .and_then(|m| m.get(&handle).copied());
    let Some(fd) = fd else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    if !reserved(ptr, size) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: replaces part of our own reservation (checked above) with the file's pages.
    let p = unsafe {
        libc::mmap(
            ptr as usize as *mut c_void,
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_FIXED,
            fd,
            offset as libc::off_t,
        )
    };
    ok_or(p != libc::MAP_FAILED, CUDA_ERROR_INVALID_VALUE)
}

/// Access is granted by the mapping itself.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemSetAccess(
    ptr: CUdeviceptr,
    size: usize,
    desc: *const c_void,
    count: usize,
) -> CUresult {
    driver!();
    ok_or(
        !desc.is_null() && count > 0 && reserved(ptr, size),
        CUDA_ERROR_INVALID_VALUE,
    )
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    driver!();
    if !reserved(ptr, size) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: puts an inaccessible anonymous mapping back over our own reservation.
    let p = unsafe {
        libc::mmap(
            ptr as usize as *mut c_void,
            size,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
            -1,
            0,
        )
    };
    ok_or(p != libc::MAP_FAILED, CUDA_ERROR_INVALID_VALUE)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemRelease(handle: c_ulonglong) -> CUresult {
    driver!();
    let fd = HANDLES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_mut()
        .and_then(|m| m.remove(&handle));
    match fd {
        Some(fd) => {
            // SAFETY: our own duplicate, closed once (removed from the table above).
            unsafe { libc::close(fd) };
            CUDA_SUCCESS
        }
        None => CUDA_ERROR_INVALID_VALUE,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemAddressFree(ptr: CUdeviceptr, _size: usize) -> CUresult {
    driver!();
    let r = RESERVED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_mut()
        .and_then(|m| m.remove(&ptr));
    match r {
        Some((base, len)) => {
            // SAFETY: the whole mapping cuMemAddressReserve made, unmapped once.
            unsafe { libc::munmap(base as *mut c_void, len) };
            CUDA_SUCCESS
        }
        None => CUDA_ERROR_INVALID_VALUE,
    }
}
