//! dma-buf export of "device" memory (`cuMemGetHandleForAddressRange` with
//! `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`), what Google's plugin does in `regMr` of CUDA memory to
//! send from it (`src/gpu/tx_pool.cu`, `get_gpumem_dmabuf_pages_fd`). The "dma-buf" is a new fd
//! of the allocation's memfd (lib.rs, `device_pages`); the range it covers (offset into that file,
//! length) and its device are kept here and answered by [`tcpxd_cudastub_dmabuf_range`], which
//! the devmem shim (tools/realplugin/devmem-shim) asks when the plugin turns the dma-buf into a
//! pages fd (`DMA_BUF_CREATE_PAGES`) and sends from it: the bytes sent are the allocation's.

use super::*;

/// `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD`.
const DMA_BUF_FD: c_int = 1;

/// One exported dma-buf: (the file's inode, offset, length, device). The inode tells a live
/// export from a later file that reuses a closed export's fd number.
type Export = (u64, u64, u64, CUdevice);

/// Exported dma-bufs by fd.
static DMABUFS: Mutex<Option<HashMap<c_int, Export>>> = Mutex::new(None);

fn inode(fd: c_int) -> Option<u64> {
    // SAFETY: fstat into a zeroed stat on the stack; an invalid fd is an error, nothing else.
    unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        (libc::fstat(fd, &mut st) == 0).then_some(st.st_ino)
    }
}

/// A dma-buf fd of `size` bytes of device memory at `ptr` (page-aligned, inside one
/// `cuMemAlloc` allocation), the caller's to close.
#[unsafe(no_mangle)]
pub extern "C" fn cuMemGetHandleForAddressRange(
    handle: *mut c_void,
    ptr: CUdeviceptr,
    size: usize,
    kind: c_int,
    _flags: c_ulonglong,
) -> CUresult {
    driver!();
    if kind != DMA_BUF_FD {
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    if handle.is_null() || size == 0 || ptr % 4096 != 0 || size % 4096 != 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let Some((start, a)) = allocation_at(ptr as usize) else {
        return CUDA_ERROR_INVALID_VALUE;
    };
    if ptr as usize + size > start + device_map_len(a.bytes) {
        return CUDA_ERROR_INVALID_VALUE;
    }
    let (Some(device), true) = (a.device, a.memfd >= 0) else {
        // Host memory, or a cuMemMap of a shared file (vmm.rs): not exported here.
        return CUDA_ERROR_NOT_SUPPORTED;
    };
    // SAFETY: duplicates the allocation's own live memfd, close-on-exec.
    let fd = unsafe { libc::fcntl(a.memfd, libc::F_DUPFD_CLOEXEC, 0) };
    let Some(ino) = (fd >= 0).then(|| inode(fd)).flatten() else {
        return CUDA_ERROR_OUT_OF_MEMORY;
    };
    DMABUFS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(fd, (ino, (ptr as usize - start) as u64, size as u64, device));
    ok_or(put(handle.cast::<c_int>(), fd), CUDA_ERROR_INVALID_VALUE)
}

/// What dma-buf `fd` covers: its offset into the file `fd` is, its length and its device; 0, or
/// -1 when `fd` is no dma-buf this stand-in exported (or a pointer is null). For the devmem shim.
#[unsafe(no_mangle)]
pub extern "C" fn tcpxd_cudastub_dmabuf_range(
    fd: c_int,
    offset: *mut u64,
    len: *mut u64,
    device: *mut c_int,
) -> c_int {
    let found = DMABUFS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .and_then(|m| m.get(&fd).copied());
    match found {
        Some((ino, off, l, dev))
            if inode(fd) == Some(ino) && put(offset, off) && put(len, l) && put(device, dev) =>
        {
            0
        }
        _ => -1,
    }
}
