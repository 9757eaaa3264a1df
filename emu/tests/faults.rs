//! Injected faults and pacing, one knob per device: dev0 clean, dev1 FAIL_AFTER_BYTES,
//! dev2 RATE_GBPS, dev3 DELAY_US. Plus closes with outstanding requests and dead ports.

mod common;
use common::*;
use std::ffi::c_int;
use std::ptr;
use std::time::{Duration, Instant};

fn env() {
    setup(&[
        ("NCCL_DYNAMIC_CHUNK_SIZE", "65536"),
        ("TCPXEMU_DEVICES", "4"),
        ("TCPXEMU_DEV1_FAIL_AFTER_BYTES", "1000000"),
        ("TCPXEMU_DEV2_RATE_GBPS", "2"),
        ("TCPXEMU_DEV3_DELAY_US", "300000"),
        ("NCCL_GPUDIRECTTCPX_CONNECTION_RETRY", "2"),
        ("TCPXEMU_BOUNCE", "host"),
    ]);
}

/// Test both requests until each has either completed or failed; returns their outcomes.
fn until_settled(
    s: *mut std::ffi::c_void,
    r: *mut std::ffi::c_void,
) -> (Result<(), c_int>, Result<(), c_int>) {
    let start = Instant::now();
    let (mut so, mut ro) = (None, None);
    while so.is_none() || ro.is_none() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "requests neither completed nor failed"
        );
        if so.is_none() {
            match test_once(s) {
                Ok(true) => so = Some(Ok(())),
                Ok(false) => {}
                Err(e) => so = Some(Err(e)),
            }
        }
        if ro.is_none() {
            match test_once(r) {
                Ok(true) => ro = Some(Ok(())),
                Ok(false) => {}
                Err(e) => ro = Some(Err(e)),
            }
        }
        std::thread::sleep(Duration::from_micros(500));
    }
    (so.unwrap(), ro.unwrap())
}

#[test]
fn fail_after_bytes_fails_both_sides() {
    env();
    let mut p = pair_with(1, 0, true);
    let size = 4 << 20;
    let mut sb = reg(p.send, vec![3u8; size]);
    let mut rb = reg(p.recv, vec![0u8; size]);
    let s = isend(&p, &mut sb, size, 0).unwrap();
    let (r, _) = irecv(&mut p, &mut rb, size, 0).unwrap();
    let (so, ro) = until_settled(s, r);
    assert_eq!(so, Err(abi::NCCL_SYSTEM_ERROR));
    assert_eq!(ro, Err(abi::NCCL_SYSTEM_ERROR));
    assert!(logs_contain(
        "tcpxemu: injected connection failure after 1000000 bytes"
    ));
    assert!(logs_contain("Connection closed by remote peer"));
    // Later posts on a failed comm fail too.
    assert_eq!(isend(&p, &mut sb, 10, 0).unwrap_err(), abi::NCCL_SYSTEM_ERROR);
    drop(sb);
    drop(rb);
}

#[test]
fn clean_device_unaffected_by_faulty_one() {
    env();
    let mut p = pair(0);
    roundtrip(&mut p, 3 << 20, 5, true);
}

#[test]
fn rate_limit_paces_sends() {
    env();
    let mut props = std::mem::MaybeUninit::<abi::ncclNetProperties_v7_t>::zeroed();
    // SAFETY: out-parameter.
    assert_eq!(unsafe { (t().getProperties.unwrap())(2, props.as_mut_ptr()) }, 0);
    // SAFETY: filled by getProperties.
    assert_eq!(unsafe { props.assume_init() }.speed, 2000);
    let mut p = pair_with(2, 0, true);
    let start = Instant::now();
    for i in 0..16 {
        roundtrip(&mut p, 4 << 20, i, true);
    }
    // 64 MiB at 2 Gbit/s is 0.268 s of wire time.
    let el = start.elapsed();
    assert!(
        el >= Duration::from_millis(200),
        "64 MiB took only {el:?} at 2 Gbit/s"
    );
}

#[test]
fn delay_holds_dispatch() {
    env();
    let mut p = pair_with(3, 0, true);
    let start = Instant::now();
    roundtrip(&mut p, 1, 9, true);
    let el = start.elapsed();
    assert!(
        el >= Duration::from_millis(290),
        "DELAY_US=300000 but done after {el:?}"
    );
}

#[test]
fn closing_the_sender_fails_pending_receives_promptly() {
    env();
    let mut p = pair(0);
    let mut sb = reg(p.send, vec![1u8; 1 << 20]);
    let mut rb = reg(p.recv, vec![0u8; 1 << 20]);
    for _ in 0..3 {
        isend(&p, &mut sb, 1 << 20, 0).unwrap(); // never tested: never dispatched
    }
    let (r, _) = irecv(&mut p, &mut rb, 1 << 20, 0).unwrap();
    irecv(&mut p, &mut rb, 1 << 20, 0).unwrap();
    assert!(!test_once(r).unwrap());
    drop(sb);
    assert_eq!(p.close_send(), 0);
    let start = Instant::now();
    let err = loop {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "receiver never noticed the close"
        );
        match test_once(r) {
            Ok(false) => std::thread::sleep(Duration::from_millis(1)),
            Ok(true) => panic!("receive completed without data"),
            Err(e) => break e,
        }
    };
    assert_eq!(err, abi::NCCL_SYSTEM_ERROR);
    drop(rb);
    assert_eq!(p.close_recv(), 0);
}

#[test]
fn closing_the_receiver_fails_pending_sends_promptly() {
    env();
    let mut p = pair(0);
    // Far more than loopback socket buffers hold: the sender blocks until the receiver goes.
    let size = 48 << 20;
    let mut sb = reg(p.send, vec![1u8; size]);
    let mut rb = reg(p.recv, vec![0u8; 4096]);
    let s = isend(&p, &mut sb, size, 0).unwrap();
    irecv(&mut p, &mut rb, 4096, 0).unwrap(); // never tested: never reads
    assert!(!test_once(s).unwrap());
    std::thread::sleep(Duration::from_millis(20));
    assert!(!test_once(s).unwrap());
    drop(rb);
    assert_eq!(p.close_recv(), 0);
    let start = Instant::now();
    let err = loop {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "sender never noticed the close"
        );
        match test_once(s) {
            Ok(false) => std::thread::sleep(Duration::from_millis(1)),
            Ok(true) => panic!("48 MiB send completed into a closed receiver"),
            Err(e) => break e,
        }
    };
    assert_eq!(err, abi::NCCL_SYSTEM_ERROR);
    drop(sb);
    assert_eq!(p.close_send(), 0);
}

#[test]
fn connect_to_a_dead_port_fails_after_retries() {
    env();
    let (mut handle, lc) = listen(0);
    close_listen(lc);
    let mut sc = ptr::null_mut();
    let start = Instant::now();
    let rc = loop {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "connect to a dead port hangs"
        );
        // SAFETY: the same 128-byte handle buffer on every call.
        let rc = unsafe { (t().connect.unwrap())(0, handle.as_mut_ptr().cast(), &mut sc, ptr::null_mut()) };
        if rc != 0 || !sc.is_null() {
            break rc;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(rc, abi::NCCL_SYSTEM_ERROR);
    assert!(sc.is_null());
    assert!(
        start.elapsed() >= Duration::from_millis(190),
        "the retries were skipped"
    );
    let port = u16::from_le_bytes([handle[12], handle[13]]);
    assert!(logs_contain(&format!(
        "127.0.0.1:{port} failed after 3 attempt(s)"
    )));
}

#[test]
fn garbage_connections_are_dropped() {
    env();
    let (mut handle, lc) = listen(0);
    let port = u16::from_le_bytes([handle[12], handle[13]]);
    {
        use std::io::Write;
        let mut junk = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        junk.write_all(&[0x42; 64]).unwrap();
    }
    // A real connection on the same listener still works.
    let mut sc: *mut std::ffi::c_void = ptr::null_mut();
    let mut rc_: *mut std::ffi::c_void = ptr::null_mut();
    let mut dh = Box::new(abi::ncclNetDeviceHandle_v7_t {
        netDeviceType: 0,
        netDeviceVersion: 0,
        handle: ptr::null_mut(),
        size: 0,
        needsProxyProgress: 0,
    });
    let start = Instant::now();
    while sc.is_null() || rc_.is_null() {
        assert!(start.elapsed() < DEADLINE);
        if sc.is_null() {
            let h = handle.as_mut_ptr().cast();
            // SAFETY: the same handle buffer on every call.
            let rc = unsafe { (t().connect.unwrap())(0, h, &mut sc, ptr::null_mut()) };
            assert_eq!(rc, 0);
        }
        if rc_.is_null() {
            let mut storage: *mut abi::ncclNetDeviceHandle_v7_t = &mut *dh;
            // SAFETY: a live listen comm and caller-owned storage.
            assert_eq!(unsafe { (t().accept.unwrap())(lc, &mut rc_, &mut storage) }, 0);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(logs_contain("dropping a connection"));
    close_listen(lc);
    // SAFETY: live comms, closed once.
    unsafe {
        assert_eq!((t().closeSend.unwrap())(sc), 0);
        assert_eq!((t().closeRecv.unwrap())(rc_), 0);
    }
}
