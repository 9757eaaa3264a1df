//! Bounce mode (the default host receive): fragment lists, shuffling, odd fragments, the
//! request-slot traps. 4 data sockets per comm, 64 KiB plugin chunks.

mod common;
use common::*;
use std::ffi::c_int;
use std::ptr;

const PAGES: usize = 4096;

fn env() -> &'static abi::ncclNet_v7_t {
    setup(&[
        ("NCCL_DYNAMIC_CHUNK_SIZE", "65536"),
        ("NCCL_NSOCKS_PERTHREAD", "2"),
        ("NCCL_SOCKET_NTHREADS", "2"),
        ("TCPXEMU_DEVICES", "2"),
        ("TCPXEMU_DEV1_FRAGMENTS", "odd"),
        ("TCPXEMU_BOUNCE_PAGES", "4096"),
        ("TCPXEMU_SEED", "12345"),
        // Host bounce pages, also on a machine with CUDA (emu/tests/cuda.rs covers that mode).
        ("TCPXEMU_BOUNCE", "host"),
    ])
}

fn check_in_pool(frags: &[abi::loadMeta]) {
    for f in frags {
        assert!(f.len >= 1 && f.len <= 4096, "fragment length {}", f.len);
        assert!(
            (f.src_off as usize % 4096) + f.len as usize <= 4096,
            "fragment crosses its page"
        );
        assert!((f.src_off as usize) + (f.len as usize) <= PAGES * 4096);
    }
}

#[test]
fn roundtrip_page_fragments_are_shuffled() {
    env();
    let mut p = pair(0);
    for (i, size) in [0usize, 1, 4097, 1 << 20, (3 << 20) + 123]
        .into_iter()
        .enumerate()
    {
        let (_, frags) = roundtrip(&mut p, size, i as u64 + 1, true);
        check_in_pool(&frags);
        check_coverage(&frags, size);
        assert_eq!(frags.len(), size.div_ceil(4096));
        assert!(
            frags.iter().all(|f| f.src_off % 4096 == 0),
            "page mode starts fragments at page starts"
        );
        if size >= 1 << 20 {
            let monotonic = frags.windows(2).all(|w| w[0].src_off < w[1].src_off);
            assert!(!monotonic, "bounce pages are not shuffled");
            let dst_sorted = frags.windows(2).all(|w| w[0].dst_off < w[1].dst_off);
            let _ = dst_sorted; // arrival order across 4 sockets may or may not be sorted
        }
    }
}

#[test]
fn roundtrip_odd_fragments_unaligned() {
    env();
    let mut p = pair_with(0, 1, true); // receiver on dev1: odd fragments
    let mut unaligned_off = 0;
    let mut unaligned_len = 0;
    for (i, size) in [1usize, 4097, 1 << 20, 4 << 20].into_iter().enumerate() {
        let (_, frags) = roundtrip(&mut p, size, 100 + i as u64, true);
        check_in_pool(&frags);
        check_coverage(&frags, size);
        assert!(frags.len() <= 2048);
        let (off, len) = count_unaligned(&frags);
        unaligned_off += off;
        unaligned_len += len;
    }
    assert!(unaligned_off > 100, "odd mode should produce unaligned offsets");
    assert!(unaligned_len > 100, "odd mode should produce unaligned lengths");
}

#[test]
fn pipelined_window_of_sixteen() {
    env();
    let mut p = pair(0);
    const N: usize = 16;
    const SZ: usize = 200_000;
    let mut sbufs: Vec<Buf> = (0..N)
        .map(|i| reg(p.send, seeded_vec(1000 + i as u64, SZ)))
        .collect();
    let mut rbufs: Vec<Buf> = (0..N).map(|_| reg(p.recv, vec![0u8; SZ])).collect();
    let mut sreqs = Vec::new();
    let mut rreqs = Vec::new();
    for i in 0..N {
        sreqs.push(isend(&p, &mut sbufs[i], SZ, i as c_int).unwrap());
        rreqs.push(irecv(&mut p, &mut rbufs[i], SZ, i as c_int).unwrap());
    }
    for i in 0..N {
        drive(sreqs[i], rreqs[i].0).unwrap();
    }
    for i in 0..N {
        let mut out = vec![0u8; SZ];
        let frags = gather(&p, rreqs[i].1, &mut out);
        check_coverage(&frags, SZ);
        assert!(out == sbufs[i].data, "message {i}");
        assert_eq!(consumed(&p, rreqs[i].0), 0);
    }
    drop(sbufs);
    drop(rbufs);
}

#[test]
fn seventeenth_request_fails_and_close_with_outstanding() {
    env();
    let mut p = pair(0);
    let mut sb = reg(p.send, vec![1u8; 4096]);
    let mut rb = reg(p.recv, vec![0u8; 4096]);
    for _ in 0..16 {
        isend(&p, &mut sb, 4096, 0).unwrap();
        irecv(&mut p, &mut rb, 4096, 0).unwrap();
    }
    assert_eq!(isend(&p, &mut sb, 4096, 0).unwrap_err(), abi::NCCL_INTERNAL_ERROR);
    assert_eq!(
        irecv(&mut p, &mut rb, 4096, 0).unwrap_err(),
        abi::NCCL_INTERNAL_ERROR
    );
    assert!(logs_contain("unable to allocate requests"));
    drop(sb);
    drop(rb);
    // Closing with 16 outstanding requests on each side neither crashes nor hangs.
    assert_eq!(p.close_send(), 0);
    assert_eq!(p.close_recv(), 0);
}

#[test]
fn receive_slot_frees_only_at_irecv_consumed() {
    env();
    let mut p = pair(0);
    let mut sb = reg(p.send, seeded_vec(5, 100));
    let mut rb = reg(p.recv, vec![0u8; 100]);
    let mut reqs = Vec::new();
    for _ in 0..16 {
        let s = isend(&p, &mut sb, 100, 0).unwrap();
        let r = irecv(&mut p, &mut rb, 100, 0).unwrap();
        drive(s, r.0).unwrap();
        reqs.push(r.0);
    }
    // All 16 receives are done but none consumed: the 17th cannot be posted.
    assert_eq!(
        irecv(&mut p, &mut rb, 100, 0).unwrap_err(),
        abi::NCCL_INTERNAL_ERROR
    );
    assert_eq!(consumed(&p, reqs[0]), 0);
    let s = isend(&p, &mut sb, 100, 0).unwrap();
    let r = irecv(&mut p, &mut rb, 100, 0).unwrap();
    drive(s, r.0).unwrap();
    drop(sb);
    drop(rb);
}

#[test]
fn test_on_non_oldest_request_fails() {
    env();
    let mut p = pair(0);
    let mut sb = reg(p.send, seeded_vec(9, 5000));
    let mut rb = reg(p.recv, vec![0u8; 5000]);
    let s1 = isend(&p, &mut sb, 5000, 0).unwrap();
    let s2 = isend(&p, &mut sb, 5000, 0).unwrap();
    let (r1, _) = irecv(&mut p, &mut rb, 5000, 0).unwrap();
    let (r2, _) = irecv(&mut p, &mut rb, 5000, 0).unwrap();
    assert_eq!(test_once(s2).unwrap_err(), abi::NCCL_INTERNAL_ERROR);
    assert_eq!(test_once(r2).unwrap_err(), abi::NCCL_INTERNAL_ERROR);
    assert!(logs_contain("test called with invalid request"));
    drive(s1, r1).unwrap();
    // A request already reported done is not testable again.
    assert_eq!(test_once(s1).unwrap_err(), abi::NCCL_INTERNAL_ERROR);
    assert_eq!(test_once(r1).unwrap_err(), abi::NCCL_INTERNAL_ERROR);
    assert_eq!(test_once(ptr::null_mut()).unwrap_err(), abi::NCCL_INTERNAL_ERROR);
    drive(s2, r2).unwrap();
    drop(sb);
    drop(rb);
}

#[test]
fn irecv_consumed_rules() {
    env();
    let mut p = pair(0);
    let mut sb = reg(p.send, seeded_vec(11, 3000));
    let mut rb = reg(p.recv, vec![0u8; 3000]);
    let s1 = isend(&p, &mut sb, 3000, 0).unwrap();
    let (r1, _) = irecv(&mut p, &mut rb, 3000, 0).unwrap();
    let s2 = isend(&p, &mut sb, 3000, 0).unwrap();
    let (r2, _) = irecv(&mut p, &mut rb, 3000, 0).unwrap();
    // Not yet complete.
    assert_eq!(consumed(&p, r1), abi::NCCL_INTERNAL_ERROR);
    assert!(logs_contain("irecvConsumed called with invalid request"));
    drive(s1, r1).unwrap();
    drive(s2, r2).unwrap();
    // Out of order.
    assert_eq!(consumed(&p, r2), abi::NCCL_INTERNAL_ERROR);
    assert!(logs_contain("unexpected q_idx"));
    // n != 1.
    // SAFETY: a live recv comm and one of its requests.
    let rc = unsafe { (t().irecvConsumed.unwrap())(p.recv, 2, r1) };
    assert_eq!(rc, abi::NCCL_INTERNAL_ERROR);
    assert_eq!(consumed(&p, r1), 0);
    assert_eq!(consumed(&p, r1), abi::NCCL_INTERNAL_ERROR, "consumed twice");
    assert_eq!(consumed(&p, r2), 0);
    drop(sb);
    drop(rb);
}

#[test]
fn tags_are_ignored_fifo() {
    env();
    let mut p = pair(0);
    let mut a = reg(p.send, seeded_vec(21, 777));
    let mut b = reg(p.send, seeded_vec(22, 777));
    let mut r1 = reg(p.recv, vec![0u8; 777]);
    let mut r2 = reg(p.recv, vec![0u8; 777]);
    let sa = isend(&p, &mut a, 777, 7).unwrap();
    let sb = isend(&p, &mut b, 777, 3).unwrap();
    // The receiver asks for tag 3 first: it still gets the first send (tag 7).
    let (q1, s1) = irecv(&mut p, &mut r1, 777, 3).unwrap();
    let (q2, s2) = irecv(&mut p, &mut r2, 777, 7).unwrap();
    drive(sa, q1).unwrap();
    drive(sb, q2).unwrap();
    let mut o1 = vec![0u8; 777];
    let mut o2 = vec![0u8; 777];
    gather(&p, s1, &mut o1);
    gather(&p, s2, &mut o2);
    assert!(o1 == a.data);
    assert!(o2 == b.data);
    assert_eq!(consumed(&p, q1), 0);
    assert_eq!(consumed(&p, q2), 0);
    drop((a, b, r1, r2));
}

#[test]
fn grouped_irecv_fails() {
    env();
    let p = pair(0);
    let mut rb = reg(p.recv, vec![0u8; 64]);
    let mut data = [rb.ptr(), rb.ptr()];
    let mut sizes = [32 as c_int, 32];
    let mut tags = [0 as c_int, 0];
    let mut mh = [rb.mh, rb.mh];
    let mut req = ptr::null_mut();
    // SAFETY: a live recv comm and two-entry arrays.
    let rc = unsafe {
        (t().irecv.unwrap())(
            p.recv,
            2,
            data.as_mut_ptr(),
            sizes.as_mut_ptr(),
            tags.as_mut_ptr(),
            mh.as_mut_ptr(),
            &mut req,
        )
    };
    assert_eq!(rc, abi::NCCL_INTERNAL_ERROR);
    assert!(req.is_null());
    drop(rb);
}

#[test]
fn receiver_adopts_senders_size() {
    env();
    let mut p = pair(0);
    let mut sb = reg(p.send, seeded_vec(31, 10_000));
    let mut rb = reg(p.recv, vec![0u8; 4096]);
    let s = isend(&p, &mut sb, 10_000, 0).unwrap();
    let (r, q) = irecv(&mut p, &mut rb, 4096, 0).unwrap();
    drive(s, r).unwrap();
    assert!(logs_contain(
        "receiver adopting sender's size 10000 > posted 4096"
    ));
    let frags = fragments(&p, q);
    check_coverage(&frags, 10_000);
    let mut out = vec![0u8; 4096];
    gather(&p, q, &mut out);
    assert!(out[..] == sb.data[..4096]);
    assert_eq!(consumed(&p, r), 0);
    // The stream stays in step afterwards.
    roundtrip(&mut p, 5000, 32, true);
    drop(sb);
    drop(rb);
}

#[test]
fn too_many_pages_fails_the_comm() {
    env();
    let mut p = pair(0);
    let size = (8 << 20) + 4096; // 2049 pages of 4 KiB
    let mut sb = reg(p.send, vec![7u8; size]);
    let mut rb = reg(p.recv, vec![0u8; size]);
    let s = isend(&p, &mut sb, size, 0).unwrap();
    let (r, _) = irecv(&mut p, &mut rb, size, 0).unwrap();
    let start = std::time::Instant::now();
    let err = loop {
        assert!(start.elapsed() < DEADLINE);
        let _ = test_once(s);
        if let Err(e) = test_once(r) {
            break e;
        }
    };
    assert_eq!(err, abi::NCCL_INTERNAL_ERROR);
    assert!(logs_contain("request too many pages"));
    drop(sb);
    drop(rb);
}

#[test]
fn device_handle_and_properties() {
    let t = env();
    // SAFETY: the table's name is a static C string.
    let name = unsafe { std::ffi::CStr::from_ptr(t.name) };
    assert_eq!(name.to_str().unwrap(), "tcpxemu_v7");
    assert!(t.regMrDmaBuf.is_none());
    let mut n: c_int = 0;
    // SAFETY: out-parameter.
    assert_eq!(unsafe { (t.devices.unwrap())(&mut n) }, 0);
    assert_eq!(n, 2);
    let mut props = std::mem::MaybeUninit::<abi::ncclNetProperties_v7_t>::zeroed();
    // SAFETY: out-parameter.
    assert_eq!(unsafe { (t.getProperties.unwrap())(1, props.as_mut_ptr()) }, 0);
    // SAFETY: filled by getProperties.
    let props = unsafe { props.assume_init() };
    // SAFETY: a static C string from the plugin.
    let ifname = unsafe { std::ffi::CStr::from_ptr(props.name) };
    assert_eq!(ifname.to_str().unwrap(), "tcpxemu1");
    // SAFETY: a static C string from the plugin (A3's eth2 by default).
    let pci = unsafe { std::ffi::CStr::from_ptr(props.pciPath) };
    assert_eq!(
        pci.to_str().unwrap(),
        "/sys/devices/pci0000:00/0000:00:02.0/0000:09:00.0/0000:0c:00.0"
    );
    assert_eq!(props.guid, 1);
    assert_eq!(props.ptrSupport, 3);
    assert_eq!(props.speed, 200_000);
    assert_eq!((props.port, props.maxComms, props.maxRecvs), (0, 65536, 1));
    assert_eq!((props.netDeviceType, props.netDeviceVersion), (1, 7));
    let mut bad = std::mem::MaybeUninit::<abi::ncclNetProperties_v7_t>::zeroed();
    // SAFETY: out-parameter.
    let rc = unsafe { (t.getProperties.unwrap())(2, bad.as_mut_ptr()) };
    assert_eq!(rc, abi::NCCL_INVALID_ARGUMENT);

    let p = pair(0);
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
    let h = unpack_handle(&p);
    assert_eq!(h.head, u64::MAX);
    assert!(!h.meta.is_null() && !h.bounce_buf.is_null());
    assert_eq!(h.meta as usize % 16, 0);
    assert_eq!(h.bounce_buf as usize % 4096, 0);
    for q in 0..16 {
        assert_eq!(cnt(&p, q), 0);
    }
    // getDeviceMr and iflush are harmless no-ops.
    let mut out = ptr::dangling_mut::<std::ffi::c_void>();
    // SAFETY: out-parameter.
    let rc = unsafe { (t.getDeviceMr.unwrap())(p.recv, ptr::null_mut(), &mut out) };
    assert_eq!(rc, 0);
    assert!(out.is_null());
}

#[test]
fn no_device_handle_storage_fails_bounce_receives() {
    env();
    let mut p = pair_with(0, 0, false);
    let mut rb = reg(p.recv, vec![0u8; 64]);
    assert_eq!(
        irecv(&mut p, &mut rb, 64, 0).unwrap_err(),
        abi::NCCL_INTERNAL_ERROR
    );
    assert!(logs_contain("no device-handle storage"));
    drop(rb);
}

#[test]
fn memory_registration_rules() {
    env();
    let p = pair(0);
    let mut mh = ptr::null_mut();
    let reg_raw = |addr: usize, ty: c_int, mh: &mut *mut std::ffi::c_void| {
        // SAFETY: regMr only records (or rejects) the range; nothing is dereferenced.
        unsafe { (t().regMr.unwrap())(p.send, addr as *mut _, 8192, ty, mh) }
    };
    assert_eq!(
        reg_raw(0x10010, abi::NCCL_PTR_CUDA, &mut mh),
        abi::NCCL_INTERNAL_ERROR
    );
    assert!(logs_contain("data not aligned"));
    assert_eq!(
        reg_raw(0x10000, abi::NCCL_PTR_CUDA, &mut mh),
        abi::NCCL_INTERNAL_ERROR
    );
    assert!(logs_contain("needs the CUDA mode"));
    assert_eq!(
        reg_raw(0x10000, abi::NCCL_PTR_DMABUF, &mut mh),
        abi::NCCL_INVALID_ARGUMENT
    );
    // isend outside the registered range.
    let mut sb = reg(p.send, vec![0u8; 100]);
    let base = sb.ptr();
    // SAFETY: only the address is computed; the plugin rejects it before reading.
    let inside = unsafe { base.cast::<u8>().add(50) }.cast();
    assert_eq!(
        isend_at(&p, inside, 51, 0, sb.mh).unwrap_err(),
        abi::NCCL_INVALID_ARGUMENT
    );
    drop(sb);
}

#[test]
fn connect_rejects_a_bad_handle() {
    env();
    let (mut handle, lc) = listen(0);
    handle[0] ^= 0xFF;
    let mut sc = ptr::null_mut();
    // SAFETY: a 128-byte handle buffer.
    let rc = unsafe { (t().connect.unwrap())(0, handle.as_mut_ptr().cast(), &mut sc, ptr::null_mut()) };
    assert_eq!(rc, abi::NCCL_INVALID_ARGUMENT);
    assert!(sc.is_null());
    close_listen(lc);
}
