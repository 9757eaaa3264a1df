use super::*;
use std::ptr::null_mut;

fn init() {
    assert_eq!(cuInit(0), CUDA_SUCCESS);
}

#[test]
fn device_memory_round_trips_bytes_and_refuses_a_second_free() {
    init();
    let mut d: CUdeviceptr = 0;
    assert_eq!(cuMemAlloc_v2(&mut d, 4096), CUDA_SUCCESS);
    assert_ne!(d, 0);
    let src = tcpxd_pattern::seeded_vec(7, 4096);
    assert_eq!(cuMemcpyHtoD_v2(d, src.as_ptr().cast(), src.len()), CUDA_SUCCESS);
    let mut back = vec![0u8; 4096];
    assert_eq!(
        cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), d, back.len()),
        CUDA_SUCCESS
    );
    assert_eq!(back, src);
    assert_eq!(cuMemFree_v2(d), CUDA_SUCCESS);
    assert_eq!(
        cuMemFree_v2(d),
        CUDA_ERROR_INVALID_VALUE,
        "a freed pointer is not freed twice"
    );
    assert_eq!(cuMemAlloc_v2(null_mut(), 16), CUDA_ERROR_INVALID_VALUE);
}

#[test]
fn host_memory_is_zeroed_and_its_device_pointer_is_itself() {
    init();
    let mut h: *mut c_void = null_mut();
    assert_eq!(cuMemHostAlloc(&mut h, 256, 0), CUDA_SUCCESS);
    // SAFETY: h is 256 fresh bytes from the stand-in.
    let bytes = unsafe { std::slice::from_raw_parts(h.cast::<u8>(), 256) };
    assert!(bytes.iter().all(|&b| b == 0));
    let mut d: CUdeviceptr = 0;
    assert_eq!(cuMemHostGetDevicePointer_v2(&mut d, h, 0), CUDA_SUCCESS);
    assert_eq!(d, h as CUdeviceptr);
    assert_eq!(cuMemFreeHost(h), CUDA_SUCCESS);
    assert_eq!(cuMemFreeHost(h), CUDA_ERROR_INVALID_VALUE);
    let mut junk = 0u8;
    assert_eq!(
        cuMemFreeHost((&mut junk as *mut u8).cast()),
        CUDA_ERROR_INVALID_VALUE,
        "never frees what it did not allocate"
    );
}

#[test]
fn contexts_push_and_pop_per_thread() {
    std::thread::spawn(|| {
        init();
        let mut dev: CUdevice = -1;
        assert_eq!(cuDeviceGet(&mut dev, 0), CUDA_SUCCESS);
        let mut ctx: CUcontext = null_mut();
        assert_eq!(cuDevicePrimaryCtxRetain(&mut ctx, dev), CUDA_SUCCESS);
        assert!(!ctx.is_null());
        let mut got: CUdevice = -1;
        assert_eq!(
            cuCtxGetDevice(&mut got),
            CUDA_ERROR_INVALID_CONTEXT,
            "nothing current yet"
        );
        assert_eq!(cuCtxPushCurrent_v2(ctx), CUDA_SUCCESS);
        assert_eq!(cuCtxGetDevice(&mut got), CUDA_SUCCESS);
        assert_eq!(got, 0);
        let mut popped: CUcontext = null_mut();
        assert_eq!(cuCtxPopCurrent_v2(&mut popped), CUDA_SUCCESS);
        assert_eq!(popped, ctx);
        assert_eq!(cuCtxPopCurrent_v2(&mut popped), CUDA_ERROR_INVALID_CONTEXT);
        let mut bogus = 0u8;
        assert_eq!(
            cuCtxPushCurrent_v2((&mut bogus as *mut u8).cast()),
            CUDA_ERROR_INVALID_CONTEXT
        );
        let mut created: CUcontext = null_mut();
        assert_eq!(cuCtxCreate_v2(&mut created, 0, 0), CUDA_SUCCESS);
        assert_eq!(
            cuCtxGetDevice(&mut got),
            CUDA_SUCCESS,
            "cuCtxCreate makes its context current"
        );
        assert_eq!(cuCtxDestroy_v2(created), CUDA_SUCCESS);
    })
    .join()
    .unwrap();
}

#[test]
fn devices_have_pci_bus_ids_the_runtime_finds_again() {
    init();
    let mut n = 0;
    assert_eq!(cuDeviceGetCount(&mut n), CUDA_SUCCESS);
    assert_eq!(n as usize, device_count());
    assert!(n >= 1);
    let mut buf = [0 as c_char; 32];
    assert_eq!(
        cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as c_int, 0),
        CUDA_SUCCESS
    );
    // SAFETY: the stand-in wrote a NUL-terminated id.
    let id = unsafe { CStr::from_ptr(buf.as_ptr()) }
        .to_str()
        .unwrap()
        .to_string();
    assert_eq!(id, pci_bus_id(0));
    let mut dev = -1;
    let cid = std::ffi::CString::new(id.to_uppercase()).unwrap();
    // SAFETY: a NUL-terminated id and an int to write.
    assert_eq!(
        unsafe { cudaDeviceGetByPCIBusId(&mut dev, cid.as_ptr()) },
        CUDA_RT_SUCCESS
    );
    assert_eq!(dev, 0);
    // SAFETY: as above.
    let unknown = unsafe { cudaDeviceGetByPCIBusId(&mut dev, c"0000:ff:1f.7".as_ptr()) };
    assert_eq!(unknown, CUDA_RT_ERROR_INVALID_DEVICE);
    assert_eq!(
        cuDeviceGetPCIBusId(buf.as_mut_ptr(), 4, 0),
        CUDA_ERROR_INVALID_VALUE,
        "too short a buffer"
    );
    assert_eq!(
        cuDeviceGet(&mut dev, MAX_DEVICES as c_int),
        CUDA_ERROR_INVALID_DEVICE
    );
    assert_eq!(cudaSetDevice(0), CUDA_RT_SUCCESS);
    assert_eq!(cudaGetDevice(&mut dev), CUDA_RT_SUCCESS);
    assert_eq!(dev, 0);
}

#[test]
fn device_memory_exports_as_a_dma_buf_of_its_own_pages() {
    init();
    let mut d: CUdeviceptr = 0;
    assert_eq!(cuMemAlloc_v2(&mut d, 3 * 4096), CUDA_SUCCESS);
    let src = tcpxd_pattern::seeded_vec(11, 3 * 4096);
    assert_eq!(cuMemcpyHtoD_v2(d, src.as_ptr().cast(), src.len()), CUDA_SUCCESS);
    let mut fd: c_int = -1;
    let h = (&mut fd as *mut c_int).cast::<c_void>();
    assert_eq!(
        cuMemGetHandleForAddressRange(h, d + 4096, 2 * 4096, 1, 0),
        CUDA_SUCCESS
    );
    assert!(fd >= 0);
    let (mut off, mut len, mut dev) = (0u64, 0u64, -1);
    assert_eq!(tcpxd_cudastub_dmabuf_range(fd, &mut off, &mut len, &mut dev), 0);
    assert_eq!((off, len), (4096, 2 * 4096));
    assert!(valid_device(dev));
    // The dma-buf's pages are the allocation's: bytes written after the export are there too.
    let later = tcpxd_pattern::seeded_vec(12, 4096);
    assert_eq!(
        cuMemcpyHtoD_v2(d + 8192, later.as_ptr().cast(), 4096),
        CUDA_SUCCESS
    );
    let mut back = vec![0u8; 2 * 4096];
    // SAFETY: reads into our own buffer from the fd just exported.
    let n = unsafe { libc::pread(fd, back.as_mut_ptr().cast(), back.len(), off as libc::off_t) };
    assert_eq!(n, back.len() as isize);
    assert_eq!(&back[..4096], &src[4096..8192]);
    assert_eq!(&back[4096..], &later[..]);
    // Ranges it cannot export: unaligned, past the allocation, host memory, another handle type.
    assert_eq!(
        cuMemGetHandleForAddressRange(h, d + 1, 4096, 1, 0),
        CUDA_ERROR_INVALID_VALUE
    );
    assert_eq!(
        cuMemGetHandleForAddressRange(h, d, 4 * 4096, 1, 0),
        CUDA_ERROR_INVALID_VALUE
    );
    assert_eq!(
        cuMemGetHandleForAddressRange(h, d, 4096, 2, 0),
        CUDA_ERROR_NOT_SUPPORTED
    );
    let mut host: *mut c_void = null_mut();
    assert_eq!(cuMemAllocHost_v2(&mut host, 4096), CUDA_SUCCESS);
    assert_eq!(
        cuMemGetHandleForAddressRange(h, host as CUdeviceptr, 4096, 1, 0),
        CUDA_ERROR_NOT_SUPPORTED
    );
    assert_eq!(cuMemFreeHost(host), CUDA_SUCCESS);
    // The dma-buf outlives the allocation's free (it holds the pages), and an fd that is not
    // one, or no longer one, is not answered.
    assert_eq!(cuMemFree_v2(d), CUDA_SUCCESS);
    // SAFETY: reads into our own buffer from our own fd.
    let n = unsafe { libc::pread(fd, back.as_mut_ptr().cast(), 4096, off as libc::off_t) };
    assert_eq!(n, 4096);
    assert_eq!(&back[..4096], &src[4096..8192]);
    // SAFETY: our own fd, closed once.
    unsafe { libc::close(fd) };
    assert_eq!(tcpxd_cudastub_dmabuf_range(fd, &mut off, &mut len, &mut dev), -1);
    assert_eq!(tcpxd_cudastub_dmabuf_range(0, &mut off, &mut len, &mut dev), -1);
}

#[test]
fn ipc_import_answers_not_supported() {
    let mut d: CUdeviceptr = 0;
    assert_eq!(
        cuIpcOpenMemHandle_v2(&mut d, CUipcMemHandle { reserved: [0; 64] }, 1),
        CUDA_ERROR_NOT_SUPPORTED
    );
    let _ = &mut d;
    let mut text: *const c_char = std::ptr::null();
    assert_eq!(cuGetErrorName(CUDA_ERROR_NOT_SUPPORTED, &mut text), CUDA_SUCCESS);
    // SAFETY: a static NUL-terminated name.
    assert_eq!(unsafe { CStr::from_ptr(text) }, c"CUDA_ERROR_NOT_SUPPORTED");
    // SAFETY: a static NUL-terminated string.
    let s = unsafe { CStr::from_ptr(cudaGetErrorString(CUDA_RT_ERROR_NOT_SUPPORTED)) };
    assert!(s.to_str().unwrap().contains("host memory only"));
}

#[test]
fn runtime_memory_round_trips_and_counts_back() {
    let mut d: *mut c_void = null_mut();
    assert_eq!(cudaMalloc(&mut d, 64), CUDA_RT_SUCCESS);
    assert!(live_allocations() >= 1);
    let src = [0xA5u8; 64];
    assert_eq!(cudaMemcpy(d, src.as_ptr().cast(), 64, 1), CUDA_RT_SUCCESS);
    let mut back = [0u8; 64];
    assert_eq!(cudaMemcpy(back.as_mut_ptr().cast(), d, 64, 2), CUDA_RT_SUCCESS);
    assert_eq!(back, src);
    let mut h: *mut c_void = null_mut();
    assert_eq!(cudaHostAlloc(&mut h, 8, 0), CUDA_RT_SUCCESS);
    let mut hd: *mut c_void = null_mut();
    assert_eq!(cudaHostGetDevicePointer(&mut hd, h, 0), CUDA_RT_SUCCESS);
    assert_eq!(hd, h);
    assert_eq!(cudaFreeHost(h), CUDA_RT_SUCCESS);
    assert_eq!(cudaFree(d), CUDA_RT_SUCCESS);
    assert_eq!(cudaFree(d), CUDA_RT_ERROR_INVALID_VALUE);
    assert_eq!(cudaFree(null_mut()), CUDA_RT_SUCCESS);
}

#[test]
fn eight_a3_gpus_by_default_and_allocations_know_their_device() {
    init();
    // Run with the default device count (the test process sets none).
    if std::env::var_os("TCPXD_CUDASTUB_DEVICES").is_none() {
        assert_eq!(device_count(), 8);
        assert_eq!(pci_bus_id(0), "0000:04:00.0");
        assert_eq!(pci_bus_id(7), "0000:8b:00.0");
    }
    let mut ctx: CUcontext = null_mut();
    assert_eq!(cuDevicePrimaryCtxRetain(&mut ctx, 1), CUDA_SUCCESS);
    assert_eq!(cuCtxSetCurrent(ctx), CUDA_SUCCESS);
    let mut rt_dev: c_int = -1;
    assert_eq!(cudaGetDevice(&mut rt_dev), CUDA_RT_SUCCESS);
    assert_eq!(rt_dev, 1, "the runtime's device follows the current context");
    let mut d: CUdeviceptr = 0;
    assert_eq!(cuMemAlloc_v2(&mut d, 10_000), CUDA_SUCCESS);
    assert_eq!(d % 4096, 0, "page-aligned, as CUDA's allocations are");
    let (mut mt, mut ord) = (0 as c_uint, -1 as c_int);
    // SAFETY: out-parameters of the attributes' types.
    unsafe {
        assert_eq!(
            cuPointerGetAttribute((&mut mt as *mut c_uint).cast(), 2, d + 100),
            CUDA_SUCCESS
        );
        assert_eq!(
            cuPointerGetAttribute((&mut ord as *mut c_int).cast(), 9, d + 9999),
            CUDA_SUCCESS
        );
        assert_eq!(
            cuPointerGetAttribute((&mut ord as *mut c_int).cast(), 9, d + 10_000),
            CUDA_ERROR_INVALID_VALUE
        );
    }
    assert_eq!((mt, ord), (2, 1), "device memory of GPU 1");
    let (mut base, mut size) = (0 as CUdeviceptr, 0usize);
    assert_eq!(cuMemGetAddressRange_v2(&mut base, &mut size, d + 5), CUDA_SUCCESS);
    assert_eq!((base, size), (d, 10_000));
    let mut h = CUipcMemHandle { reserved: [0; 64] };
    assert_eq!(cuIpcGetMemHandle(&mut h, d), CUDA_SUCCESS);
    assert_eq!(
        &h.reserved[..8].iter().map(|&c| c as u8).collect::<Vec<_>>()[..],
        datapath::IPC_MAGIC
    );
    assert_eq!(cuMemFree_v2(d), CUDA_SUCCESS);
    assert_eq!(cuCtxSetCurrent(null_mut()), CUDA_SUCCESS);
}

#[test]
fn streams_events_and_async_copies_complete_at_once() {
    init();
    let mut s: CUstream = null_mut();
    assert_eq!(cuStreamCreate(&mut s, 1), CUDA_SUCCESS);
    let (mut a, mut b) = (0 as CUdeviceptr, 0 as CUdeviceptr);
    assert_eq!(cuMemAlloc_v2(&mut a, 8192), CUDA_SUCCESS);
    assert_eq!(cuMemAlloc_v2(&mut b, 8192), CUDA_SUCCESS);
    let src = tcpxd_pattern::seeded_vec(3, 8192);
    assert_eq!(
        cuMemcpyHtoDAsync_v2(a, src.as_ptr().cast(), 8192, s),
        CUDA_SUCCESS
    );
    assert_eq!(cuMemcpyDtoDAsync_v2(b, a, 8192, s), CUDA_SUCCESS);
    assert_eq!(cuMemsetD8Async(b, 0xAB, 16, s), CUDA_SUCCESS);
    let mut e: CUevent = null_mut();
    assert_eq!(cuEventCreate(&mut e, 0), CUDA_SUCCESS);
    assert_eq!(cuEventRecord(e, s), CUDA_SUCCESS);
    assert_eq!(cuEventQuery(e), CUDA_SUCCESS);
    assert_eq!(cuStreamQuery(s), CUDA_SUCCESS);
    let mut back = vec![0u8; 8192];
    assert_eq!(
        cuMemcpyDtoHAsync_v2(back.as_mut_ptr().cast(), b, 8192, s),
        CUDA_SUCCESS
    );
    assert_eq!(cuStreamSynchronize(s), CUDA_SUCCESS);
    assert!(back[..16].iter().all(|&v| v == 0xAB));
    assert_eq!(back[16..], src[16..]);
    assert_eq!(
        cuMemsetD8_v2(b, 0, 8193),
        CUDA_ERROR_INVALID_VALUE,
        "past the allocation"
    );
    assert_eq!(
        cuModuleLoadData(null_mut(), std::ptr::null()),
        CUDA_ERROR_NOT_SUPPORTED
    );
    assert_eq!(cuEventDestroy_v2(e), CUDA_SUCCESS);
    assert_eq!(cuStreamDestroy_v2(s), CUDA_SUCCESS);
    assert_eq!(
        cuStreamSynchronize(s),
        CUDA_ERROR_INVALID_VALUE,
        "a destroyed stream"
    );
    assert_eq!(cuMemFree_v2(a), CUDA_SUCCESS);
    assert_eq!(cuMemFree_v2(b), CUDA_SUCCESS);
}

#[test]
fn vmm_maps_an_imported_fd_shared() {
    init();
    // SAFETY: a fresh memfd of 8 KiB, closed at the end; the mapping is checked through both views.
    unsafe {
        let fd = libc::memfd_create(c"stub-vmm".as_ptr(), 0);
        assert!(fd >= 0);
        assert_eq!(libc::ftruncate(fd, 8192), 0);
        let mut h: c_ulonglong = 0;
        assert_eq!(
            cuMemImportFromShareableHandle(&mut h, fd as usize as *mut c_void, 1),
            CUDA_SUCCESS
        );
        let mut p: CUdeviceptr = 0;
        assert_eq!(cuMemAddressReserve(&mut p, 8192, 1 << 21, 0, 0), CUDA_SUCCESS);
        assert_eq!(p % (1 << 21), 0);
        assert_eq!(cuMemMap(p, 8192, 0, h, 0), CUDA_SUCCESS);
        let desc = [0u8; 16];
        assert_eq!(cuMemSetAccess(p, 8192, desc.as_ptr().cast(), 1), CUDA_SUCCESS);
        *(p as usize as *mut u8).add(5000) = 0x5a;
        let mut b = [0u8; 1];
        assert_eq!(libc::pread(fd, b.as_mut_ptr().cast(), 1, 5000), 1);
        assert_eq!(b[0], 0x5a, "the mapping is the file's pages");
        assert_eq!(cuMemUnmap(p, 8192), CUDA_SUCCESS);
        assert_eq!(cuMemRelease(h), CUDA_SUCCESS);
        assert_eq!(cuMemRelease(h), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(cuMemAddressFree(p, 8192), CUDA_SUCCESS);
        assert_eq!(cuMemMap(p, 8192, 0, h, 0), CUDA_ERROR_INVALID_VALUE);
        libc::close(fd);
    }
}

#[test]
fn vmm_memory_created_here_outlives_its_mappings_through_the_exported_fd() {
    init();
    let prop = CUmemAllocationProp {
        kind: 1,
        requested_handle_types: 1,
        location_type: 1,
        location_id: 3,
        win32_handle_meta_data: null_mut(),
        alloc_flags: [0; 8],
    };
    let mut gran = 0usize;
    assert_eq!(cuMemGetAllocationGranularity(&mut gran, &prop, 0), CUDA_SUCCESS);
    assert_eq!(gran, VMM_GRANULARITY);
    let mut h: c_ulonglong = 0;
    assert_eq!(
        cuMemCreate(&mut h, gran + 1, &prop, 0),
        CUDA_ERROR_INVALID_VALUE,
        "not a multiple"
    );
    let no_fd = CUmemAllocationProp {
        requested_handle_types: 0,
        ..prop
    };
    assert_eq!(cuMemCreate(&mut h, gran, &no_fd, 0), CUDA_ERROR_NOT_SUPPORTED);
    assert_eq!(cuMemCreate(&mut h, gran, &prop, 0), CUDA_SUCCESS);
    let mut p: CUdeviceptr = 0;
    assert_eq!(cuMemAddressReserve(&mut p, gran, gran, 0, 0), CUDA_SUCCESS);
    assert_eq!(cuMemMap(p, gran, 0, h, 0), CUDA_SUCCESS);
    // Device 3's memory, for pointer attributes; never freed by cuMemFree.
    let mut dev: c_int = -1;
    // SAFETY: an int out-parameter for the ordinal attribute.
    let got = unsafe { cuPointerGetAttribute((&mut dev as *mut c_int).cast(), 9, p + 100) };
    assert_eq!((got, dev), (CUDA_SUCCESS, 3));
    assert_eq!(cuMemFree_v2(p), CUDA_ERROR_INVALID_VALUE);
    let src = [7u8; 4096];
    assert_eq!(cuMemcpyHtoD_v2(p + 4096, src.as_ptr().cast(), 4096), CUDA_SUCCESS);
    let mut fd: c_int = -1;
    assert_eq!(
        cuMemExportToShareableHandle((&mut fd as *mut c_int).cast(), h, 2, 0),
        CUDA_ERROR_NOT_SUPPORTED
    );
    assert_eq!(
        cuMemExportToShareableHandle((&mut fd as *mut c_int).cast(), h, 1, 0),
        CUDA_SUCCESS
    );
    assert!(fd >= 0);
    // Everything of this "process" goes: the handle, the mapping, the reservation.
    assert_eq!(cuMemUnmap(p, gran), CUDA_SUCCESS);
    assert_eq!(cuMemRelease(h), CUDA_SUCCESS);
    assert_eq!(cuMemAddressFree(p, gran), CUDA_SUCCESS);
    // The exported fd still holds the bytes: imported and mapped again, they are there.
    let mut h2: c_ulonglong = 0;
    assert_eq!(
        cuMemImportFromShareableHandle(&mut h2, fd as usize as *mut c_void, 1),
        CUDA_SUCCESS
    );
    // SAFETY: our own fd, closed once; the import holds its own duplicate.
    unsafe { libc::close(fd) };
    let mut q: CUdeviceptr = 0;
    assert_eq!(cuMemAddressReserve(&mut q, gran, gran, 0, 0), CUDA_SUCCESS);
    assert_eq!(cuMemMap(q, gran, 0, h2, 0), CUDA_SUCCESS);
    let mut back = [0u8; 4096];
    assert_eq!(
        cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), q + 4096, 4096),
        CUDA_SUCCESS
    );
    assert_eq!(back, src);
    assert_eq!(cuMemUnmap(q, gran), CUDA_SUCCESS);
    assert_eq!(cuMemRelease(h2), CUDA_SUCCESS);
    assert_eq!(cuMemAddressFree(q, gran), CUDA_SUCCESS);
}
