//! The real plugin's defaults: NCCL_DYNAMIC_CHUNK_SIZE unset (nothing progresses) and a
//! flow-steering wait before accept completes.

mod common;
use common::*;
use std::time::{Duration, Instant};

fn env() {
    setup(&[
        ("NCCL_DYNAMIC_CHUNK_SIZE", ""),
        ("NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS", "200000"),
        ("TCPXEMU_BOUNCE", "host"),
    ]);
}

#[test]
fn zero_chunk_size_warns_and_sends_never_complete() {
    env();
    assert!(logs_contain(
        "NCCL_DYNAMIC_CHUNK_SIZE is 0: sends will never complete; set it to 524288"
    ));
    let mut p = pair(0);
    // A zero-byte send still completes.
    roundtrip(&mut p, 0, 1, true);
    let mut sb = reg(p.send, vec![1u8; 1000]);
    let mut rb = reg(p.recv, vec![0u8; 1000]);
    let s = isend(&p, &mut sb, 1000, 0).unwrap();
    let (r, _) = irecv(&mut p, &mut rb, 1000, 0).unwrap();
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(300) {
        assert!(!test_once(s).unwrap());
        assert!(!test_once(r).unwrap());
        std::thread::sleep(Duration::from_millis(2));
    }
    drop(sb);
    drop(rb);
}

#[test]
fn flow_steering_wait_delays_accept() {
    env();
    let start = Instant::now();
    let _p = pair(0);
    assert!(start.elapsed() >= Duration::from_millis(200));
}

#[test]
fn init_again_succeeds() {
    env();
    let t = t();
    // SAFETY: init accepts a NULL logger; later calls only replace it.
    assert_eq!(unsafe { (t.init.unwrap())(None) }, 0);
}
