//! `TCPXEMU_PROGRESS=eager`: the emulation before session 33, for A/B measurements: one `test`
//! call dispatches every posted send whole (Google's plugin moves one more per call).

mod common;
use common::*;
use std::time::{Duration, Instant};

fn env() {
    setup(&[
        ("NCCL_DYNAMIC_CHUNK_SIZE", "4096"),
        ("NCCL_NSOCKS_PERTHREAD", "2"),
        ("TCPXEMU_HOST_RECV", "direct"),
        ("TCPXEMU_BOUNCE", "host"),
        ("TCPXEMU_PROGRESS", "eager"),
    ]);
}

#[test]
fn one_send_test_moves_every_posted_send() {
    env();
    assert!(logs_contain("progress=eager"));
    let p = pair(0);
    const N: usize = 3;
    const LEN: usize = 4 * 4096;
    let src = seeded_vec(332, N * LEN);
    let mut sb = reg(p.send, src.clone());
    let mut rb = reg(p.recv, vec![0u8; N * LEN]);
    let mut sends = Vec::new();
    for k in 0..N {
        // SAFETY: part k of the registered source.
        let at = unsafe { sb.ptr().cast::<u8>().add(k * LEN) };
        sends.push(isend_at(&p, at.cast(), LEN, 0, sb.mh).unwrap());
    }
    let mut recvs = Vec::new();
    for k in 0..N {
        // SAFETY: part k of the registered destination.
        let at = unsafe { rb.ptr().cast::<u8>().add(k * LEN) };
        let mut req = std::ptr::null_mut();
        let (mut data, mut size, mut tag, mut mh) = (at.cast(), LEN as i32, 0, rb.mh);
        // SAFETY: a live recv comm and one-entry arrays.
        let rc =
            unsafe { (t().irecv.unwrap())(p.recv, 1, &mut data, &mut size, &mut tag, &mut mh, &mut req) };
        assert_eq!(rc, 0);
        recvs.push(req);
    }
    // One test call on the send comm; the receives then complete without another.
    let _ = test_once(sends[0]).unwrap();
    let start = Instant::now();
    for r in &recvs {
        while !test_once(*r).unwrap() {
            assert!(
                start.elapsed() < DEADLINE,
                "eager: a receive did not complete after one send test"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    assert_eq!(rb.data, src);
    for s in &sends {
        while !test_once(*s).unwrap() {
            assert!(start.elapsed() < DEADLINE, "a send did not complete");
        }
    }
    for r in recvs {
        assert_eq!(consumed(&p, r), 0);
    }
}
