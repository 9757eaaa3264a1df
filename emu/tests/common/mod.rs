//! Shared helpers for the emulation tests: raw FFI through `plugin_table()`, driven the way
//! NCCL's proxy drives the real plugin (non-blocking connect/accept, test after every post).
#![allow(dead_code)]

use abi::{loadMeta, ncclNetDeviceHandle_v7_t, ncclResult_t, netUnpackMeta, unpackNetDeviceHandle};
pub use nccl_net_tcpxemu::abi;
use std::ffi::{c_int, c_void};
use std::ptr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};
/// The test byte pattern every crate shares.
pub use tcpxd_pattern::seeded_vec;

pub const DEADLINE: Duration = Duration::from_secs(20);

static LOGS: Mutex<Vec<(i32, String)>> = Mutex::new(Vec::new());
static SETUP: Once = Once::new();

fn hook(level: i32, msg: &str) {
    // TCPXEMU_TEST_ECHO=1: print WARN and INFO lines as they come (for runs on other machines).
    static ECHO: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *ECHO.get_or_init(|| std::env::var_os("TCPXEMU_TEST_ECHO").is_some()) && level <= abi::NCCL_LOG_INFO {
        eprintln!("[plugin {level}] {msg}");
    }
    LOGS.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((level, msg.to_string()));
}

/// Set the environment once for this test process, then init the plugin.
pub fn setup(env: &[(&str, &str)]) -> &'static abi::ncclNet_v7_t {
    SETUP.call_once(|| {
        for (k, v) in env {
            // SAFETY: runs once, inside Once, before the plugin (or any other code in this test
            // process that reads the environment) starts a thread that could read it; the other
            // test threads are blocked on this Once until it completes.
            unsafe { std::env::set_var(k, v) };
        }
        nccl_net_tcpxemu::set_log_hook(Some(hook));
        let t = nccl_net_tcpxemu::plugin_table();
        // SAFETY: the table's init accepts a NULL logger.
        let rc = unsafe { (t.init.unwrap())(None) };
        assert_eq!(rc, 0);
    });
    nccl_net_tcpxemu::plugin_table()
}

pub fn logs_contain(needle: &str) -> bool {
    LOGS.lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .any(|(_, m)| m.contains(needle))
}

pub fn logs_matching(needle: &str) -> Vec<(i32, String)> {
    LOGS.lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|(_, m)| m.contains(needle))
        .cloned()
        .collect()
}

pub fn t() -> &'static abi::ncclNet_v7_t {
    nccl_net_tcpxemu::plugin_table()
}

/// A connected send/recv comm pair plus the device-handle storage accept filled.
pub struct Pair {
    pub send: *mut c_void,
    pub recv: *mut c_void,
    pub dev_handle: Box<ncclNetDeviceHandle_v7_t>,
    /// Receives posted so far (the next receive takes ring slot `posted % 16`).
    pub recvs_posted: u64,
    closed_send: bool,
    closed_recv: bool,
}

fn empty_dev_handle() -> Box<ncclNetDeviceHandle_v7_t> {
    Box::new(ncclNetDeviceHandle_v7_t {
        netDeviceType: -1,
        netDeviceVersion: -1,
        handle: ptr::null_mut(),
        size: 0,
        needsProxyProgress: -1,
    })
}

pub fn listen(dev: c_int) -> ([u8; 128], *mut c_void) {
    let mut handle = [0xAAu8; 128];
    let mut lc: *mut c_void = ptr::null_mut();
    // SAFETY: a 128-byte handle buffer and an out-pointer, as the ABI requires.
    let rc = unsafe { (t().listen.unwrap())(dev, handle.as_mut_ptr().cast(), &mut lc) };
    assert_eq!(rc, 0, "listen");
    assert!(!lc.is_null());
    (handle, lc)
}

pub fn close_listen(lc: *mut c_void) {
    // SAFETY: a listen comm from listen, closed once.
    assert_eq!(unsafe { (t().closeListen.unwrap())(lc) }, 0);
}

/// Connect `send_dev` to a listener on `recv_dev`, driving connect and accept from one thread.
pub fn pair_with(send_dev: c_int, recv_dev: c_int, give_storage: bool) -> Pair {
    let (mut handle, lc) = listen(recv_dev);
    let mut dev_handle = empty_dev_handle();
    let mut sc: *mut c_void = ptr::null_mut();
    let mut rc_: *mut c_void = ptr::null_mut();
    let start = Instant::now();
    while sc.is_null() || rc_.is_null() {
        assert!(start.elapsed() < DEADLINE, "connect/accept did not finish");
        if sc.is_null() {
            // SAFETY: the same 128-byte handle buffer on every call, as NCCL does.
            let r = unsafe {
                (t().connect.unwrap())(send_dev, handle.as_mut_ptr().cast(), &mut sc, ptr::null_mut())
            };
            assert_eq!(r, 0, "connect");
        }
        if rc_.is_null() {
            let mut storage: *mut ncclNetDeviceHandle_v7_t = if give_storage {
                &mut *dev_handle
            } else {
                ptr::null_mut()
            };
            // SAFETY: a live listen comm; `storage` points at caller-owned storage or is NULL.
            let r = unsafe { (t().accept.unwrap())(lc, &mut rc_, &mut storage) };
            assert_eq!(r, 0, "accept");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    close_listen(lc);
    Pair {
        send: sc,
        recv: rc_,
        dev_handle,
        recvs_posted: 0,
        closed_send: false,
        closed_recv: false,
    }
}

pub fn pair(dev: c_int) -> Pair {
    pair_with(dev, dev, true)
}

/// Host memory registered on a comm.
pub struct Buf {
    pub data: Vec<u8>,
    pub mh: *mut c_void,
    comm: *mut c_void,
}

impl Buf {
    pub fn ptr(&mut self) -> *mut c_void {
        self.data.as_mut_ptr().cast()
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: registered on `comm` by `reg`, deregistered once.
            unsafe { (t().deregMr.unwrap())(self.comm, self.mh) };
        }
    }
}

pub fn reg(comm: *mut c_void, data: Vec<u8>) -> Buf {
    let mut data = data;
    let mut mh: *mut c_void = ptr::null_mut();
    // SAFETY: a live comm and a host buffer that outlives the registration.
    let rc = unsafe {
        (t().regMr.unwrap())(
            comm,
            data.as_mut_ptr().cast(),
            data.len() as c_int,
            abi::NCCL_PTR_HOST,
            &mut mh,
        )
    };
    assert_eq!(rc, 0, "regMr");
    Buf { data, mh, comm }
}

pub fn isend_at(
    p: &Pair,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mh: *mut c_void,
) -> Result<*mut c_void, ncclResult_t> {
    let mut req: *mut c_void = ptr::null_mut();
    // SAFETY: a live send comm; `data..data+size` inside the registered buffer (or deliberately not).
    let rc = unsafe { (t().isend.unwrap())(p.send, data, size as c_int, tag, mh, &mut req) };
    if rc == 0 {
        assert!(!req.is_null());
        Ok(req)
    } else {
        Err(rc)
    }
}

pub fn isend(p: &Pair, b: &mut Buf, size: usize, tag: c_int) -> Result<*mut c_void, ncclResult_t> {
    let mh = b.mh;
    isend_at(p, b.ptr(), size, tag, mh)
}

/// Post a receive; returns (request, ring slot q).
pub fn irecv(
    p: &mut Pair,
    b: &mut Buf,
    size: usize,
    tag: c_int,
) -> Result<(*mut c_void, usize), ncclResult_t> {
    let mut req: *mut c_void = ptr::null_mut();
    let mut data = b.ptr();
    let mut sizes = size as c_int;
    let mut tags = tag;
    let mut mh = b.mh;
    // SAFETY: a live recv comm and one-entry arrays.
    let rc = unsafe { (t().irecv.unwrap())(p.recv, 1, &mut data, &mut sizes, &mut tags, &mut mh, &mut req) };
    if rc == 0 {
        let q = (p.recvs_posted % 16) as usize;
        p.recvs_posted += 1;
        Ok((req, q))
    } else {
        Err(rc)
    }
}

pub const SIZES_SENTINEL: c_int = -0x5EED;

/// One test call; asserts `*sizes` is never written.
pub fn test_once(req: *mut c_void) -> Result<bool, ncclResult_t> {
    let mut done: c_int = -7;
    let mut sizes: c_int = SIZES_SENTINEL;
    // SAFETY: a request from isend/irecv (or deliberately a stale one: the plugin checks).
    let rc = unsafe { (t().test.unwrap())(req, &mut done, &mut sizes) };
    assert_eq!(sizes, SIZES_SENTINEL, "test wrote *sizes");
    if rc == 0 {
        assert!(done == 0 || done == 1);
        Ok(done == 1)
    } else {
        Err(rc)
    }
}

/// Test a send and a receive alternately until both are done.
pub fn drive(sreq: *mut c_void, rreq: *mut c_void) -> Result<(), ncclResult_t> {
    let (mut sd, mut rd) = (sreq.is_null(), rreq.is_null());
    let start = Instant::now();
    while !(sd && rd) {
        assert!(start.elapsed() < DEADLINE, "transfer did not finish");
        if !sd {
            sd = test_once(sreq)?;
        }
        if !rd {
            rd = test_once(rreq)?;
        }
        if !(sd && rd) {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    Ok(())
}

pub fn consumed(p: &Pair, req: *mut c_void) -> ncclResult_t {
    // SAFETY: a live recv comm and a request from it (or deliberately a wrong one).
    unsafe { (t().irecvConsumed.unwrap())(p.recv, 1, req) }
}

/// Did `init` pick the CUDA mode (TCPXEMU_BOUNCE=auto on a machine with a GPU)?
pub fn cuda_mode() -> bool {
    logs_contain("bounce=cuda (")
}

/// `len` bytes of device memory at `addr`, copied device-to-host with device 0's primary
/// context current for the copy (CUDA mode only).
pub fn read_device(addr: u64, len: usize) -> Vec<u8> {
    use cudarc::driver::sys;
    static PRIMARY: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let ctx = *PRIMARY.get_or_init(|| {
        let mut dev: sys::CUdevice = 0;
        let mut ctx: sys::CUcontext = ptr::null_mut();
        // SAFETY: the plugin's init ran cuInit (CUDA mode); out-parameters on the stack.
        unsafe {
            assert_eq!(sys::cuDeviceGet(&mut dev, 0), sys::CUresult::CUDA_SUCCESS);
            assert_eq!(
                sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
                sys::CUresult::CUDA_SUCCESS
            );
        }
        ctx as usize
    }) as sys::CUcontext;
    let mut out = vec![0u8; len];
    let mut prev: sys::CUcontext = ptr::null_mut();
    // SAFETY: a retained context made current for the copy, then the previous one restored;
    // `addr..addr+len` is device memory the plugin keeps alive (the comm is open).
    unsafe {
        assert_eq!(sys::cuCtxGetCurrent(&mut prev), sys::CUresult::CUDA_SUCCESS);
        assert_eq!(sys::cuCtxSetCurrent(ctx), sys::CUresult::CUDA_SUCCESS);
        let r = sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), addr, len);
        sys::cuCtxSetCurrent(prev);
        assert_eq!(r, sys::CUresult::CUDA_SUCCESS, "cuMemcpyDtoH");
    }
    out
}

/// The unpack handle accept filled in: host memory in host mode, device memory (read
/// device-to-host, as a consumer must) in CUDA mode.
pub fn unpack_handle(p: &Pair) -> unpackNetDeviceHandle {
    assert!(!p.dev_handle.handle.is_null());
    if cuda_mode() {
        let b = read_device(
            p.dev_handle.handle as u64,
            std::mem::size_of::<unpackNetDeviceHandle>(),
        );
        // SAFETY: 24 bytes of a #[repr(C)] struct of three 8-byte fields.
        return unsafe { ptr::read_unaligned(b.as_ptr().cast()) };
    }
    // SAFETY: host memory in host mode; the plugin keeps it alive until closeRecv.
    unsafe { ptr::read(p.dev_handle.handle as *const unpackNetDeviceHandle) }
}

pub fn cnt(p: &Pair, q: usize) -> u64 {
    let h = unpack_handle(p);
    // SAFETY: cnt[q] inside the live ring; read with acquire as a consumer must.
    unsafe { AtomicU64::from_ptr(ptr::addr_of_mut!((*h.meta).cnt[q])).load(Ordering::Acquire) }
}

/// The fragment list of slot `q` (after test reported done).
pub fn fragments(p: &Pair, q: usize) -> Vec<loadMeta> {
    let h = unpack_handle(p);
    let n = cnt(p, q) as usize;
    assert!(n <= 2048);
    let meta: *const netUnpackMeta = h.meta;
    // SAFETY: entries 0..cnt[q] were published before cnt[q] (release/acquire).
    (0..n)
        .map(|i| unsafe { ptr::read(ptr::addr_of!((*meta).mem[q][i])) })
        .collect()
}

/// Gather the bounce fragments of slot `q` into `dst` (entries with dst_off beyond `dst` are
/// skipped, as a careful consumer must). Returns the fragment list.
pub fn gather(p: &Pair, q: usize, dst: &mut [u8]) -> Vec<loadMeta> {
    assert!(
        !cuda_mode(),
        "common::gather reads host bounce pages (host mode only; tests/cuda.rs gathers from the device)"
    );
    let h = unpack_handle(p);
    let frags = fragments(p, q);
    for f in &frags {
        let (d, l) = (f.dst_off as usize, f.len as usize);
        if d + l > dst.len() {
            continue;
        }
        // SAFETY: src_off + len lies in the bounce buffer the plugin owns (checked by tests
        // against the pool size); the slice bounds are checked above.
        let src =
            unsafe { std::slice::from_raw_parts((h.bounce_buf as *const u8).add(f.src_off as usize), l) };
        dst[d..d + l].copy_from_slice(src);
    }
    frags
}

/// The fragments cover [0, size) of the destination exactly once.
pub fn check_coverage(frags: &[loadMeta], size: usize) {
    let mut v: Vec<(u64, u32)> = frags.iter().map(|f| (f.dst_off, f.len)).collect();
    v.sort();
    let mut at = 0u64;
    for (d, l) in v {
        assert_eq!(d, at, "gap or overlap in the fragment list");
        at += u64::from(l);
    }
    assert_eq!(at, size as u64);
}

/// How many fragments start at an offset, and how many have a length, that is not a multiple of 16.
pub fn count_unaligned(frags: &[loadMeta]) -> (usize, usize) {
    (
        frags.iter().filter(|f| f.src_off % 16 != 0).count(),
        frags.iter().filter(|f| f.len % 16 != 0).count(),
    )
}

/// Send `size` bytes and receive them into a fresh buffer; returns (received bytes, fragments).
/// `bounce` says whether to gather from the fragment list or read the destination directly.
pub fn roundtrip(p: &mut Pair, size: usize, salt: u64, bounce: bool) -> (Vec<u8>, Vec<loadMeta>) {
    let mut sb = reg(p.send, seeded_vec(salt, size.max(1)));
    let mut rb = reg(p.recv, vec![0u8; size.max(1)]);
    let sreq = isend(p, &mut sb, size, 1).expect("isend");
    let (rreq, q) = irecv(p, &mut rb, size, 1).expect("irecv");
    drive(sreq, rreq).expect("transfer");
    let mut out = vec![0u8; size];
    let frags = if bounce {
        gather(p, q, &mut out)
    } else {
        assert_eq!(cnt(p, q), 0, "direct mode must leave cnt[q] at 0");
        out.copy_from_slice(&rb.data[..size]);
        Vec::new()
    };
    assert_eq!(consumed(p, rreq), 0);
    assert!(out == sb.data[..size], "payload mismatch for size {size}");
    (out, frags)
}

impl Pair {
    pub fn close_send(&mut self) -> ncclResult_t {
        self.closed_send = true;
        // SAFETY: a live send comm, closed once.
        unsafe { (t().closeSend.unwrap())(self.send) }
    }
    pub fn close_recv(&mut self) -> ncclResult_t {
        self.closed_recv = true;
        // SAFETY: a live recv comm, closed once.
        unsafe { (t().closeRecv.unwrap())(self.recv) }
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        if !self.closed_send {
            self.close_send();
        }
        if !self.closed_recv {
            self.close_recv();
        }
    }
}
