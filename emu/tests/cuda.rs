//! The CUDA mode on a real GPU: device buffers registered as NCCL_PTR_CUDA, the unpack ring in
//! host-mapped memory, device bounce pages, the 24-byte handle in device memory, and the
//! consumer's side done as a client of the real plugin would: read the handle device-to-host,
//! read the ring on the host, copy each fragment from `bounce_buf + src_off`, then
//! `irecvConsumed`. 4 data sockets per comm, 128 KiB plugin chunks, dev1 with odd fragments.
//!
//! Every test needs a CUDA GPU: `cargo test -p tcpxemu --release -- --ignored`.

mod common;
use abi::{loadMeta, netUnpackMeta, unpackNetDeviceHandle};
use common::*;
use cudarc::driver::sys;
use std::ffi::{c_int, c_uint, c_void};
use std::ptr;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const PAGES: usize = 8192;
const SIZES: [usize; 5] = [0, 1, 4097, 512 << 10, 4 << 20];

fn ok(what: &str, r: sys::CUresult) {
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "{what}");
}

/// Device 0's primary context, retained once for the process.
fn primary() -> sys::CUcontext {
    static CTX: OnceLock<usize> = OnceLock::new();
    *CTX.get_or_init(|| {
        let mut dev: sys::CUdevice = 0;
        let mut ctx: sys::CUcontext = ptr::null_mut();
        // SAFETY: the plugin's init ran cuInit; out-parameters on the stack.
        unsafe {
            ok("cuDeviceGet", sys::cuDeviceGet(&mut dev, 0));
            ok(
                "cuDevicePrimaryCtxRetain",
                sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
            );
        }
        ctx as usize
    }) as sys::CUcontext
}

/// Init the plugin (CUDA mode expected) and make device 0's primary context current here, as
/// NCCL's proxy thread has it.
fn env() {
    setup(&[
        ("NCCL_DYNAMIC_CHUNK_SIZE", "131072"),
        ("NCCL_NSOCKS_PERTHREAD", "2"),
        ("NCCL_SOCKET_NTHREADS", "2"),
        ("TCPXEMU_DEVICES", "2"),
        ("TCPXEMU_DEV1_FRAGMENTS", "odd"),
        ("TCPXEMU_BOUNCE_PAGES", "8192"),
        ("TCPXEMU_SEED", "4242"),
    ]);
    assert!(
        logs_contain("bounce=cuda (TCPXEMU_BOUNCE=auto"),
        "TCPXEMU_BOUNCE=auto did not pick the CUDA mode: {:?}",
        logs_matching("bounce=")
    );
    // SAFETY: a live (retained) context.
    ok("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(primary()) });
}

fn memory_type(addr: u64) -> Result<u32, sys::CUresult> {
    let mut t: c_uint = 0;
    // SAFETY: MEMORY_TYPE writes one unsigned int.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut t as *mut c_uint).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            addr,
        )
    };
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(t)
    } else {
        Err(r)
    }
}

const DEVICE: u32 = sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32;
const HOST: u32 = sys::CUmemorytype::CU_MEMORYTYPE_HOST as u32;

fn dtoh(dst: &mut [u8], src: u64) {
    if dst.is_empty() {
        return;
    }
    // SAFETY: `src..src+len` is device memory the caller knows to be live; `dst` is a live slice.
    ok("cuMemcpyDtoH", unsafe {
        sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len())
    });
}

/// Device memory, 4096-aligned, optionally registered on a comm.
struct DevBuf {
    raw: u64,
    addr: u64,
    len: usize,
    mh: *mut c_void,
    comm: *mut c_void,
}

impl DevBuf {
    fn alloc(content: &[u8], len: usize) -> DevBuf {
        let mut raw: u64 = 0;
        // SAFETY: out-parameter; a context is current (env()).
        ok("cuMemAlloc", unsafe {
            sys::cuMemAlloc_v2(&mut raw, len.max(1) + 4096)
        });
        let addr = raw.next_multiple_of(4096);
        assert!(content.len() <= len.max(1));
        if !content.is_empty() {
            // SAFETY: destination inside the allocation; `content` is a live slice.
            ok("cuMemcpyHtoD", unsafe {
                sys::cuMemcpyHtoD_v2(addr, content.as_ptr().cast(), content.len())
            });
        }
        DevBuf {
            raw,
            addr,
            len,
            mh: ptr::null_mut(),
            comm: ptr::null_mut(),
        }
    }

    fn register(&mut self, comm: *mut c_void) {
        let mut mh = ptr::null_mut();
        // SAFETY: a live comm and a live device range.
        let rc =
            unsafe { (t().regMr.unwrap())(comm, self.ptr(), self.len as c_int, abi::NCCL_PTR_CUDA, &mut mh) };
        assert_eq!(rc, 0, "regMr(NCCL_PTR_CUDA)");
        self.mh = mh;
        self.comm = comm;
    }

    fn reg(comm: *mut c_void, content: &[u8], len: usize) -> DevBuf {
        let mut b = DevBuf::alloc(content, len);
        b.register(comm);
        b
    }

    fn ptr(&self) -> *mut c_void {
        self.addr as usize as *mut c_void
    }

    /// Deregister now (before the comm closes); the memory stays until drop.
    fn dereg(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: registered on `comm`, deregistered once.
            assert_eq!(unsafe { (t().deregMr.unwrap())(self.comm, self.mh) }, 0);
            self.comm = ptr::null_mut();
        }
    }

    fn read(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len];
        dtoh(&mut v, self.addr);
        v
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: registered on `comm`, deregistered once.
            unsafe { (t().deregMr.unwrap())(self.comm, self.mh) };
        }
        // SAFETY: the allocation made in `alloc`, freed once; bind the context first since the
        // drop may run on a thread without it.
        unsafe {
            sys::cuCtxSetCurrent(primary());
            sys::cuMemFree_v2(self.raw);
        }
    }
}

/// Post a receive of `size` bytes at `data` with memory handle `mh`; returns (request, q).
fn irecv_at(
    p: &mut Pair,
    data: *mut c_void,
    size: usize,
    mh: *mut c_void,
) -> Result<(*mut c_void, usize), c_int> {
    let mut req: *mut c_void = ptr::null_mut();
    let mut data = data;
    let mut sizes = size as c_int;
    let mut tags: c_int = 0;
    let mut mh = mh;
    // SAFETY: a live recv comm and one-entry arrays.
    let rc = unsafe { (t().irecv.unwrap())(p.recv, 1, &mut data, &mut sizes, &mut tags, &mut mh, &mut req) };
    if rc != 0 {
        return Err(rc);
    }
    let q = (p.recvs_posted % 16) as usize;
    p.recvs_posted += 1;
    Ok((req, q))
}

/// The 24-byte handle, read device-to-host as a consumer must; checks where everything lives.
fn handle(p: &Pair) -> unpackNetDeviceHandle {
    let dh = &*p.dev_handle;
    assert_eq!(
        (
            dh.netDeviceType,
            dh.netDeviceVersion,
            dh.size,
            dh.needsProxyProgress
        ),
        (1, 7, 24, 1)
    );
    assert_eq!(
        memory_type(dh.handle as u64),
        Ok(DEVICE),
        "the handle is not device memory"
    );
    let mut b = [0u8; 24];
    dtoh(&mut b, dh.handle as u64);
    // SAFETY: 24 bytes of a #[repr(C)] struct of three 8-byte fields.
    let h: unpackNetDeviceHandle = unsafe { ptr::read_unaligned(b.as_ptr().cast()) };
    assert_eq!(
        memory_type(h.bounce_buf as u64),
        Ok(DEVICE),
        "bounce_buf is not device memory"
    );
    assert_eq!(
        memory_type(h.meta as u64),
        Ok(HOST),
        "the ring is not host memory"
    );
    assert_eq!(h.bounce_buf as usize % 4096, 0);
    assert_eq!(h.meta as usize % 16, 0);
    h
}

fn cnt(h: &unpackNetDeviceHandle, q: usize) -> u64 {
    // SAFETY: under unified addressing the ring's device pointer is its host address; cnt[q] is
    // read with acquire, as a consumer must.
    unsafe { AtomicU64::from_ptr(ptr::addr_of_mut!((*h.meta).cnt[q])).load(Ordering::Acquire) }
}

/// The fragments of slot `q` (after test reported done), each copied device-to-host from
/// `bounce_buf + src_off` into a host image of the destination.
fn gather(h: &unpackNetDeviceHandle, q: usize, size: usize) -> (Vec<u8>, Vec<loadMeta>) {
    let n = cnt(h, q) as usize;
    assert!(n <= 2048);
    let meta: *const netUnpackMeta = h.meta;
    // SAFETY: entries 0..cnt[q] were published before cnt[q] (release/acquire), host-readable.
    let frags: Vec<loadMeta> = (0..n)
        .map(|i| unsafe { ptr::read_volatile(ptr::addr_of!((*meta).mem[q][i])) })
        .collect();
    let mut img = vec![0u8; size];
    for f in &frags {
        assert!(f.len >= 1 && f.len <= 4096, "fragment length {}", f.len);
        assert!(
            (f.src_off as usize % 4096) + f.len as usize <= 4096,
            "fragment crosses its page"
        );
        assert!(
            f.src_off as usize + f.len as usize <= PAGES * 4096,
            "fragment outside the pool"
        );
        let (d, l) = (f.dst_off as usize, f.len as usize);
        assert!(d + l <= size, "fragment beyond the request");
        dtoh(&mut img[d..d + l], h.bounce_buf as u64 + u64::from(f.src_off));
    }
    (img, frags)
}

#[derive(Clone, Copy, Debug)]
enum Src {
    Cuda,
    Host,
}

/// Send `size` bytes (from device or host memory) into a CUDA receive; check the fragments and
/// that the destination itself was not written. Returns the fragment list.
fn roundtrip_into_cuda(p: &mut Pair, src: Src, size: usize, salt: u64) -> Vec<loadMeta> {
    let h = handle(p);
    let data = seeded_vec(salt, size);
    let mut hb;
    let db;
    let (sptr, smh) = match src {
        Src::Cuda => {
            db = DevBuf::reg(p.send, &data, size);
            (db.ptr(), db.mh)
        }
        Src::Host => {
            hb = reg(p.send, if size == 0 { vec![0u8; 1] } else { data.clone() });
            (hb.ptr(), hb.mh)
        }
    };
    let rb = DevBuf::reg(p.recv, &vec![0xEEu8; size.max(1)], size.max(1));
    let start = Instant::now();
    let s = isend_at(p, sptr, size, 0, smh).expect("isend");
    let (r, q) = irecv_at(p, rb.ptr(), size, rb.mh).expect("irecv");
    drive(s, r).expect("transfer");
    let el = start.elapsed();
    let (img, frags) = gather(&h, q, size);
    check_coverage(&frags, size);
    assert!(img == data, "payload mismatch ({src:?} -> CUDA, {size} bytes)");
    assert!(
        rb.read().iter().all(|&b| b == 0xEE),
        "a CUDA receive wrote its destination (the payload belongs in the bounce buffer)"
    );
    assert_eq!(consumed(p, r), 0);
    if size >= 4 << 20 {
        eprintln!(
            "{src:?} -> CUDA {size} bytes: {:?} ({:.2} GB/s), {} fragments",
            el,
            size as f64 / el.as_secs_f64() / 1e9,
            frags.len()
        );
    }
    frags
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test -p tcpxemu --release -- --ignored"]
fn gpu_device_handle_ring_and_bounce_placement() {
    env();
    let p = pair(0);
    let h = handle(&p);
    assert_eq!(h.head, u64::MAX);
    for q in 0..16 {
        assert_eq!(cnt(&h, q), 0);
    }
    // The bounce pool and the handle are separate device allocations; the ring is host-mapped.
    let mut hp: u64 = 0;
    // SAFETY: HOST_POINTER writes one pointer.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut hp as *mut u64).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_HOST_POINTER,
            h.meta as u64,
        )
    };
    ok("cuPointerGetAttribute(HOST_POINTER)", r);
    assert_eq!(
        hp, h.meta as u64,
        "the ring's device pointer is not its host address (no UVA?)"
    );
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test -p tcpxemu --release -- --ignored"]
fn gpu_cuda_to_cuda_roundtrip() {
    env();
    let mut p = pair(0);
    for (i, size) in SIZES.into_iter().enumerate() {
        let frags = roundtrip_into_cuda(&mut p, Src::Cuda, size, 10 + i as u64);
        assert_eq!(frags.len(), size.div_ceil(4096));
        assert!(frags.iter().all(|f| f.src_off % 4096 == 0));
        if size >= 512 << 10 {
            assert!(
                !frags.windows(2).all(|w| w[0].src_off < w[1].src_off),
                "bounce pages are not shuffled"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test -p tcpxemu --release -- --ignored"]
fn gpu_host_to_cuda_roundtrip() {
    env();
    let mut p = pair(0);
    for (i, size) in SIZES.into_iter().enumerate() {
        roundtrip_into_cuda(&mut p, Src::Host, size, 20 + i as u64);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test -p tcpxemu --release -- --ignored"]
fn gpu_cuda_to_host_is_direct() {
    env();
    let mut p = pair(0);
    let h = handle(&p);
    let before = logs_matching("requested receive on host mem buffer").len();
    for (i, size) in SIZES.into_iter().enumerate() {
        let data = seeded_vec(30 + i as u64, size);
        let sb = DevBuf::reg(p.send, &data, size);
        let mut rb = reg(p.recv, vec![0u8; size.max(1)]);
        let s = isend_at(&p, sb.ptr(), size, 0, sb.mh).expect("isend");
        let (r, q) = irecv(&mut p, &mut rb, size, 0).expect("irecv");
        drive(s, r).expect("transfer");
        assert_eq!(cnt(&h, q), 0, "a host receive must leave cnt[q] at 0");
        assert!(
            rb.data[..size] == data[..],
            "payload mismatch (CUDA -> host, {size} bytes)"
        );
        assert_eq!(consumed(&p, r), 0);
    }
    let info = logs_matching("requested receive on host mem buffer");
    assert!(info.len() >= before + SIZES.len());
    assert!(info.iter().all(|(level, _)| *level == abi::NCCL_LOG_INFO));
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test -p tcpxemu --release -- --ignored"]
fn gpu_odd_fragments() {
    env();
    let mut p = pair_with(0, 1, true); // receiver on dev1: odd fragments
    let (mut unaligned_off, mut unaligned_len) = (0, 0);
    for (i, size) in [1usize, 4097, 1 << 20, 4 << 20].into_iter().enumerate() {
        let frags = roundtrip_into_cuda(&mut p, Src::Cuda, size, 40 + i as u64);
        assert!(frags.len() <= 2048);
        let (off, len) = count_unaligned(&frags);
        unaligned_off += off;
        unaligned_len += len;
    }
    assert!(unaligned_off > 100, "odd mode should produce unaligned offsets");
    assert!(unaligned_len > 100, "odd mode should produce unaligned lengths");
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test -p tcpxemu --release -- --ignored"]
fn gpu_window_of_sixteen_and_ring_wraparound() {
    env();
    let mut p = pair(0);
    let h = handle(&p);
    const ROUNDS: usize = 20; // 320 requests: the ring wraps 20 times
    const MAX: usize = 300_000;
    let sbufs: Vec<DevBuf> = (0..16).map(|_| DevBuf::reg(p.send, &[], MAX)).collect();
    let rbufs: Vec<DevBuf> = (0..16).map(|_| DevBuf::reg(p.recv, &[], MAX)).collect();
    let mut n = 0u64;
    let (start, mut bytes) = (Instant::now(), 0usize);
    for round in 0..ROUNDS {
        let mut posted = Vec::new();
        for i in 0..16 {
            let size = ((n * 7919 + 13) % MAX as u64) as usize;
            let data = seeded_vec(1000 + n, size);
            if size > 0 {
                // SAFETY: inside the live allocation.
                ok("cuMemcpyHtoD", unsafe {
                    sys::cuMemcpyHtoD_v2(sbufs[i].addr, data.as_ptr().cast(), size)
                });
            }
            let s = isend_at(&p, sbufs[i].ptr(), size, 0, sbufs[i].mh).expect("isend");
            let (r, q) = irecv_at(&mut p, rbufs[i].ptr(), size, rbufs[i].mh).expect("irecv");
            assert_eq!(q, i, "ring slot");
            posted.push((s, r, q, size, data));
            n += 1;
        }
        if round == 0 {
            // The window is full on both sides.
            assert_eq!(
                isend_at(&p, sbufs[0].ptr(), 1, 0, sbufs[0].mh).unwrap_err(),
                abi::NCCL_INTERNAL_ERROR
            );
            assert_eq!(
                irecv_at(&mut p, rbufs[0].ptr(), 1, rbufs[0].mh).unwrap_err(),
                abi::NCCL_INTERNAL_ERROR
            );
        }
        for (s, r, _, _, _) in &posted {
            drive(*s, *r).expect("transfer");
        }
        for (_, r, q, size, data) in &posted {
            let (img, frags) = gather(&h, *q, *size);
            check_coverage(&frags, *size);
            assert!(img == *data, "request of {size} bytes in slot {q}, round {round}");
            assert_eq!(consumed(&p, *r), 0);
            bytes += size;
        }
    }
    eprintln!(
        "{} requests, {bytes} bytes CUDA -> CUDA in {:?} (host-side gather included)",
        ROUNDS * 16,
        start.elapsed()
    );
    drop(sbufs);
    drop(rbufs);
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test -p tcpxemu --release -- --ignored"]
fn gpu_close_with_outstanding_requests() {
    env();
    let mut p = pair(0);
    const SZ: usize = 1 << 20;
    let sbufs: Vec<DevBuf> = (0..16)
        .map(|i| DevBuf::reg(p.send, &seeded_vec(i, SZ), SZ))
        .collect();
    let rbufs: Vec<DevBuf> = (0..16).map(|_| DevBuf::reg(p.recv, &[], SZ)).collect();
    let mut reqs = Vec::new();
    for i in 0..16 {
        let s = isend_at(&p, sbufs[i].ptr(), SZ, 0, sbufs[i].mh).unwrap();
        let (r, _) = irecv_at(&mut p, rbufs[i].ptr(), SZ, rbufs[i].mh).unwrap();
        reqs.push((s, r));
    }
    // Get a few in flight (dispatched, partly received), then close both sides.
    let (s0, r0) = reqs[0];
    drive(s0, r0).unwrap();
    let (mut sd, mut rd) = (false, false);
    for _ in 0..20 {
        sd = sd || test_once(reqs[1].0).unwrap();
        rd = rd || test_once(reqs[1].1).unwrap();
    }
    // Deregister first (as NCCL does), close, and free the memory only once the comms (whose
    // threads may still be copying from or to it) are gone.
    let (mut sbufs, mut rbufs) = (sbufs, rbufs);
    sbufs.iter_mut().chain(rbufs.iter_mut()).for_each(DevBuf::dereg);
    let start = Instant::now();
    assert_eq!(p.close_send(), 0);
    assert_eq!(p.close_recv(), 0);
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "close took {:?}",
        start.elapsed()
    );
    drop(sbufs);
    drop(rbufs);
    // The plugin still works afterwards.
    let mut q = pair(0);
    roundtrip_into_cuda(&mut q, Src::Cuda, 100_000, 77);
}

/// Moves plugin objects (raw pointers) to a helper thread and back.
struct Carry<T>(T);
// SAFETY: the pair, buffers and comm pointers inside are used by one thread at a time, and the
// plugin's objects may be used from any thread (NCCL's proxy does).
unsafe impl<T> Send for Carry<T> {}

fn assert_no_current_context() {
    let mut cur: sys::CUcontext = ptr::null_mut();
    // SAFETY: out-parameter.
    ok("cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut cur) });
    assert!(cur.is_null(), "a fresh thread has no current context");
}

/// Comms and registrations made on threads with no current context: the plugin retains device
/// 0's primary context itself (TCPXEMU_CUDA_DEVICE defaults to 0).
#[test]
#[ignore = "needs a CUDA GPU: cargo test -p tcpxemu --release -- --ignored"]
fn gpu_comms_made_without_a_current_context() {
    env();
    const SZ: usize = (2 << 20) + 77;
    let data = seeded_vec(99, SZ);
    let sb = DevBuf::alloc(&data, SZ);
    let rb = DevBuf::alloc(&[], SZ);
    let Carry(mut p) = std::thread::spawn(|| {
        assert_no_current_context();
        Carry(pair(0))
    })
    .join()
    .expect("pair thread");
    let comms = (p.send as usize, p.recv as usize);
    let bufs = Carry((sb, rb));
    let Carry((sb, rb)) = std::thread::spawn(move || {
        assert_no_current_context();
        let whole = bufs; // move the wrapper, not its (non-Send) fields
        let Carry((mut sb, mut rb)) = whole;
        sb.register(comms.0 as *mut c_void);
        rb.register(comms.1 as *mut c_void);
        Carry((sb, rb))
    })
    .join()
    .expect("register thread");
    let h = handle(&p);
    let s = isend_at(&p, sb.ptr(), SZ, 0, sb.mh).unwrap();
    let (r, q) = irecv_at(&mut p, rb.ptr(), SZ, rb.mh).unwrap();
    drive(s, r).unwrap();
    let (img, frags) = gather(&h, q, SZ);
    check_coverage(&frags, SZ);
    assert!(img == data);
    assert_eq!(consumed(&p, r), 0);
    assert!(logs_contain("CUDA device 0 context"));
    drop(sb);
    drop(rb);
}

#[test]
#[ignore = "needs a CUDA GPU: cargo test -p tcpxemu --release -- --ignored"]
fn gpu_registration_rules() {
    env();
    let p = pair(0);
    let b = DevBuf::alloc(&[], 8192);
    let reg_raw = |addr: u64, ty: c_int| {
        let mut mh = ptr::null_mut();
        // SAFETY: regMr checks the range; nothing is written.
        let rc = unsafe { (t().regMr.unwrap())(p.send, addr as usize as *mut c_void, 4096, ty, &mut mh) };
        if rc == 0 {
            // SAFETY: just registered.
            unsafe { (t().deregMr.unwrap())(p.send, mh) };
        }
        rc
    };
    assert_eq!(reg_raw(b.addr + 16, abi::NCCL_PTR_CUDA), abi::NCCL_INTERNAL_ERROR);
    assert!(logs_contain("data not aligned"));
    assert_eq!(reg_raw(b.addr, abi::NCCL_PTR_CUDA), 0);
    // An address CUDA does not know is refused as CUDA memory.
    assert_eq!(reg_raw(0x10000, abi::NCCL_PTR_CUDA), abi::NCCL_SYSTEM_ERROR);
    assert!(logs_contain("is not CUDA device memory"));
}
