//! The cdylib as NCCL sees it: loaded with dlopen, exactly one exported symbol, and a working
//! table (a small round trip through the dlopen'ed copy, which has its own state).

use nccl_net_tcpxemu::abi;
use std::ffi::{CStr, CString, c_int, c_void};
use std::ptr;
use std::time::{Duration, Instant};

#[test]
fn only_the_plugin_symbol_is_exported() {
    let so = tcpxd_testkit::emulation_library();
    let out = match std::process::Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&so)
        .output()
    {
        Ok(o) if o.status.success() => o,
        _ => return, // no binutils here: the dlopen test below still checks the symbol
    };
    let text = String::from_utf8_lossy(&out.stdout);
    let syms: Vec<&str> = text.lines().filter_map(|l| l.split_whitespace().nth(2)).collect();
    assert_eq!(syms, ["ncclNetPlugin_v7"], "exported: {syms:?}");
}

#[test]
fn dlopen_and_round_trip() {
    let so = CString::new(tcpxd_testkit::emulation_library().to_str().unwrap()).unwrap();
    // SAFETY: set before the dlopen'ed copy reads it; the only other test in this process
    // touches the environment through std (Command::spawn), which takes the same env lock, and
    // no C code in this process reads it concurrently.
    unsafe {
        std::env::set_var("NCCL_DYNAMIC_CHUNK_SIZE", "524288");
        // The round trip gathers host bounce pages: keep host mode on CUDA machines too.
        std::env::set_var("TCPXEMU_BOUNCE", "host");
    }
    // SAFETY: loading our own cdylib; its initialisers are Rust statics only.
    let h = unsafe { libc::dlopen(so.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!h.is_null(), "dlopen failed");
    // SAFETY: a valid handle and a NUL-terminated symbol name.
    let sym = unsafe { libc::dlsym(h, abi::PLUGIN_SYMBOL_V7.as_ptr().cast()) };
    assert!(!sym.is_null());
    // SAFETY: the symbol is the exported ncclNet_v7_t, immutable and alive while loaded.
    let t: &abi::ncclNet_v7_t = unsafe { &*(sym as *const abi::ncclNet_v7_t) };
    // SAFETY: a static C string.
    assert_eq!(unsafe { CStr::from_ptr(t.name) }, c"tcpxemu_v7");
    assert!(t.regMrDmaBuf.is_none());
    // SAFETY: every call below follows the v7 ABI with live buffers and out-parameters.
    unsafe {
        assert_eq!((t.init.unwrap())(None), 0);
        let mut handle = [0u8; 128];
        let mut lc = ptr::null_mut();
        assert_eq!((t.listen.unwrap())(0, handle.as_mut_ptr().cast(), &mut lc), 0);
        let mut storage = abi::ncclNetDeviceHandle_v7_t {
            netDeviceType: 0,
            netDeviceVersion: 0,
            handle: ptr::null_mut(),
            size: 0,
            needsProxyProgress: 0,
        };
        let (mut sc, mut rc): (*mut c_void, *mut c_void) = (ptr::null_mut(), ptr::null_mut());
        let start = Instant::now();
        while sc.is_null() || rc.is_null() {
            assert!(start.elapsed() < Duration::from_secs(20));
            if sc.is_null() {
                assert_eq!(
                    (t.connect.unwrap())(0, handle.as_mut_ptr().cast(), &mut sc, ptr::null_mut()),
                    0
                );
            }
            if rc.is_null() {
                let mut sp: *mut abi::ncclNetDeviceHandle_v7_t = &mut storage;
                assert_eq!((t.accept.unwrap())(lc, &mut rc, &mut sp), 0);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!((t.closeListen.unwrap())(lc), 0);
        let mut src = tcpxd_pattern::seeded_vec(7, 4097);
        let mut dst = vec![0u8; 4097];
        let (mut smh, mut rmh) = (ptr::null_mut(), ptr::null_mut());
        assert_eq!(
            (t.regMr.unwrap())(sc, src.as_mut_ptr().cast(), 4097, abi::NCCL_PTR_HOST, &mut smh),
            0
        );
        assert_eq!(
            (t.regMr.unwrap())(rc, dst.as_mut_ptr().cast(), 4097, abi::NCCL_PTR_HOST, &mut rmh),
            0
        );
        let (mut sreq, mut rreq) = (ptr::null_mut(), ptr::null_mut());
        assert_eq!(
            (t.isend.unwrap())(sc, src.as_mut_ptr().cast(), 4097, 0, smh, &mut sreq),
            0
        );
        let mut d: *mut c_void = dst.as_mut_ptr().cast();
        let (mut sz, mut tag) = (4097 as c_int, 0 as c_int);
        assert_eq!(
            (t.irecv.unwrap())(rc, 1, &mut d, &mut sz, &mut tag, &mut rmh, &mut rreq),
            0
        );
        let (mut sd, mut rd) = (0, 0);
        let start = Instant::now();
        while sd == 0 || rd == 0 {
            assert!(start.elapsed() < Duration::from_secs(20));
            let mut sizes = -1;
            if sd == 0 {
                assert_eq!((t.test.unwrap())(sreq, &mut sd, &mut sizes), 0);
            }
            if rd == 0 {
                assert_eq!((t.test.unwrap())(rreq, &mut rd, &mut sizes), 0);
            }
            assert_eq!(sizes, -1);
        }
        let uh = ptr::read(storage.handle as *const abi::unpackNetDeviceHandle);
        let n = (*uh.meta).cnt[0] as usize;
        assert_eq!(n, 2);
        let mut out = vec![0u8; 4097];
        for i in 0..n {
            let f = (*uh.meta).mem[0][i];
            let s = std::slice::from_raw_parts(
                (uh.bounce_buf as *const u8).add(f.src_off as usize),
                f.len as usize,
            );
            out[f.dst_off as usize..][..f.len as usize].copy_from_slice(s);
        }
        assert_eq!(out, src);
        assert_eq!((t.irecvConsumed.unwrap())(rc, 1, rreq), 0);
        assert_eq!((t.deregMr.unwrap())(sc, smh), 0);
        assert_eq!((t.deregMr.unwrap())(rc, rmh), 0);
        assert_eq!((t.closeSend.unwrap())(sc), 0);
        assert_eq!((t.closeRecv.unwrap())(rc), 0);
    }
}
