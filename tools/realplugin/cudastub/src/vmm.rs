//! The virtual memory management calls over a shared file: what Google's plugin does at accept to
//! import RxDM's GPU receive memory (`CuIpcMemfdHandle`: `cuMemImportFromShareableHandle` of the
//! POSIX fd RxDM sent, `cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess`), and what tcpxd does
//! to allocate CUDA memory that outlives its process (`cuMemCreate` requesting a POSIX fd,
//! `cuMemExportToShareableHandle`; docs/OPERATIONS.md, "Restarts"). Here the fd is a file (the
//! fake RxDM's memfd, or a memfd `cuMemCreate` makes), the reservation an inaccessible anonymous
//! mapping, and mapping the handle maps the file there, shared: the "device" memory is the file's
//! pages, so bytes written through one process's mapping are there in another's, and after the
//! first process died for as long as someone holds the fd.

use super::*;

/// Imported or created handles: handle value -> the process's own fd of the memory, and the
/// device it is memory of.
static HANDLES: Mutex<Option<HashMap<u64, (c_int, CUdevice)>>> = Mutex::new(None);
/// Reservations: start -> (the mapping's start, its length), kept for cuMemAddressFree.
static RESERVED: Mutex<Option<HashMap<u64, (usize, usize)>>> = Mutex::new(None);
/// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`.
const POSIX_FD: c_int = 1;
/// `CU_MEM_ALLOCATION_TYPE_PINNED`.
const ALLOCATION_PINNED: c_int = 1;
/// `CU_MEM_LOCATION_TYPE_DEVICE`.
const LOCATION_DEVICE: c_int = 1;
/// What `cuMemGetAllocationGranularity` answers: a GPU's 2 MiB pages.
pub const VMM_GRANULARITY: usize = 2 << 20;

/// `CUmemAllocationProp` (CUDA 12).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct CUmemAllocationProp {
    pub kind: c_int,
    pub requested_handle_types: c_int,
    pub location_type: c_int,
    pub location_id: c_int,
    pub win32_handle_meta_data: *mut c_void,
    pub alloc_flags: [u8; 8],
}

/// The property and its device, if it is a pinned allocation on a device of this stand-in.
fn prop_device(prop: *const CUmemAllocationProp) -> Option<(CUmemAllocationProp, CUdevice)> {
    if prop.is_null() {
        return None;
    }
    // SAFETY: non-null, and the CUDA contract is a pointer to a CUmemAllocationProp.
    let p = unsafe { prop.read() };
    (p.kind == ALLOCATION_PINNED && p.location_type == LOCATION_DEVICE && valid_device(p.location_id))
        .then_some((p, p.location_id))
}

fn handle_of(fd: c_int) -> u64 {
    0x4d45_4d00_0000_0000u64 | fd as u64
}

fn add_handle(fd: c_int, device: CUdevice) -> u64 {
    let h = handle_of(fd);
    HANDLES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(h, (fd, device));
    h
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemGetAllocationGranularity(
    granularity: *mut usize,
    prop: *const CUmemAllocationProp,
    _option: c_int,
) -> CUresult {
    driver!();
    if prop_device(prop).is_none() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    ok_or(put(granularity, VMM_GRANULARITY), CUDA_ERROR_INVALID_VALUE)
}

/// A new "physical allocation": a memfd of `size` bytes (zeroed, as the pages of a new file are).
/// Only what can be exported as a POSIX fd is made (what tcpxd asks for).
#[unsafe(no_mangle)]
pub extern "C" fn cuMemCreate(
    handle: *mut c_ulonglong,
    size: usize,
    prop: *const CUmemAllocationProp,
    _flags: c_ulonglong,
) -> CUresult {
    driver!();
    let Some((p, device)) = prop_device(prop) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    let wanted = p.requested_handle_types;
    if handle.is_null() || size == 0 || size % VMM_GRANULARITY != 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    if wanted & POSIX_FD == 0 {
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    // SAFETY: a fresh memfd (close-on-exec); the name is a NUL-terminated literal.
    let fd = unsafe { libc::memfd_create(c"tcpxd-cudastub-vmm".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    // SAFETY: our own new fd; sizes the file (sparse: no memory until touched).
    if unsafe { libc::ftruncate(fd, size as libc::off_t) } != 0 {
        // SAFETY: our own fd, closed once.
        unsafe { libc::close(fd) };
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    ok_or(put(handle, add_handle(fd, device)), CUDA_ERROR_INVALID_VALUE)
}

/// A new fd of the allocation's memory, the caller's to close (as CUDA's).
#[unsafe(no_mangle)]
pub extern "C" fn cuMemExportToShareableHandle(
    shareable: *mut c_void,
    handle: c_ulonglong,
    kind: c_int,
    _flags: c_ulonglong,
) -> CUresult {
    driver!();
    if kind != POSIX_FD {
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    let fd = HANDLES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .and_then(|m| m.get(&handle).map(|h| h.0));
    let Some(fd) = fd else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    if shareable.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: duplicates our own live fd, close-on-exec.
    let out = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if out < 0 {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    ok_or(put(shareable.cast::<c_int>(), out), CUDA_ERROR_INVALID_VALUE)
}

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
    let fd = unsafe { libc::fcntl(os as usize as c_int, libc::F_DUPFD_CLOEXEC, 0) };
    if fd < 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // The memory is the current device's (what the importer maps it as).
    let device = current_device().unwrap_or_else(default_device);
    ok_or(put(handle, add_handle(fd, device)), CUDA_ERROR_INVALID_VALUE)
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
    let found = HANDLES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .and_then(|m| m.get(&handle).copied());
    let Some((fd, device)) = found else {
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
    if p == libc::MAP_FAILED {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // Device memory from here on, for pointer attributes and copies' checks.
    mapped(ptr as usize, size, device);
    CUDA_SUCCESS
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
    unmapped(ptr as usize);
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
        Some((fd, _)) => {
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
