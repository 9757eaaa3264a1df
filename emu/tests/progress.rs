//! Where a request moves (`TCPXEMU_PROGRESS` unset: faithful), as in Google's plugin
//! (src/net_tcpx.cc `tcpxTest` → `tcpxCommProgress`): only inside `test`, each call activating
//! at most one posted request and moving only the oldest active one, a send by at most one chunk
//! per data socket. Direct host receives, so what has landed can be read in the destination.

mod common;
use common::*;
use std::time::{Duration, Instant};

const CHUNK: usize = 4096;
const NSOCKS: usize = 2;

fn env() {
    setup(&[
        ("NCCL_DYNAMIC_CHUNK_SIZE", "4096"),
        ("NCCL_NSOCKS_PERTHREAD", "2"),
        ("NCCL_SOCKET_NTHREADS", "1"),
        ("TCPXEMU_HOST_RECV", "direct"),
        ("TCPXEMU_BOUNCE", "host"),
    ]);
}

/// Chunks of `dst` equal to `src` (the destination starts zeroed; the pattern is not).
fn landed_chunks(dst: &[u8], src: &[u8]) -> usize {
    dst.chunks(CHUNK)
        .zip(src.chunks(CHUNK))
        .filter(|(d, s)| d == s)
        .count()
}

/// Tests the receive `n` times, 2 ms apart; whether it completed.
fn poll_recv(r: *mut std::ffi::c_void, n: usize) -> bool {
    for _ in 0..n {
        let done = test_once(r)
            .unwrap_or_else(|e| panic!("recv test failed ({e}): {:?}", logs_matching("tcpxemu: ")));
        if done {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    false
}

#[test]
fn the_init_line_says_faithful() {
    env();
    assert!(logs_contain("progress=faithful"));
}

#[test]
fn each_send_test_hands_at_most_one_chunk_per_socket() {
    env();
    let mut p = pair(0);
    let len = 16 * CHUNK;
    let src = seeded_vec(330, len);
    let mut sb = reg(p.send, src.clone());
    let mut rb = reg(p.recv, vec![0u8; len]);
    let s = isend(&p, &mut sb, len, 0).unwrap();
    let (r, q) = irecv(&mut p, &mut rb, len, 0).unwrap();
    // Untested, the send never moves.
    assert!(!poll_recv(r, 25));
    assert_eq!(landed_chunks(&rb.data, &src), 0);
    let (mut calls, start) = (0usize, Instant::now());
    let (mut send_done, mut recv_done) = (false, false);
    loop {
        assert!(start.elapsed() < DEADLINE, "the send did not complete");
        if !send_done {
            send_done = test_once(s).unwrap();
            calls += 1;
        }
        recv_done = recv_done || poll_recv(r, 5);
        let landed = landed_chunks(&rb.data, &src);
        assert!(
            landed <= NSOCKS * calls,
            "{landed} chunks landed after {calls} send test(s) on {NSOCKS} sockets"
        );
        if recv_done && send_done {
            break;
        }
    }
    assert!(
        calls >= 16 / NSOCKS,
        "16 chunks on {NSOCKS} sockets took only {calls} test calls"
    );
    assert_eq!(rb.data, src);
    assert_eq!(consumed(&p, r), 0);
    let _ = q;
}

#[test]
fn each_receive_test_activates_at_most_one_receive() {
    env();
    let p = pair(0);
    const N: usize = 3;
    let src = seeded_vec(331, N * CHUNK);
    let mut sb = reg(p.send, src.clone());
    let mut rb = reg(p.recv, vec![0u8; N * CHUNK]);
    let mut sends = Vec::new();
    for k in 0..N {
        // SAFETY: chunk k of the registered source.
        let at = unsafe { sb.ptr().cast::<u8>().add(k * CHUNK) };
        sends.push(isend_at(&p, at.cast(), CHUNK, 0, sb.mh).unwrap());
    }
    // Every send out (they complete once written; nobody receives yet).
    let start = Instant::now();
    for s in &sends {
        while !test_once(*s).unwrap() {
            assert!(start.elapsed() < DEADLINE, "a send did not complete");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let mut recvs = Vec::new();
    for k in 0..N {
        // SAFETY: chunk k of the registered destination.
        let at = unsafe { rb.ptr().cast::<u8>().add(k * CHUNK) };
        let mut req = std::ptr::null_mut();
        let (mut data, mut size, mut tag, mut mh) = (at.cast(), CHUNK as i32, 0, rb.mh);
        // SAFETY: a live recv comm and one-entry arrays.
        let rc =
            unsafe { (t().irecv.unwrap())(p.recv, 1, &mut data, &mut size, &mut tag, &mut mh, &mut req) };
        assert_eq!(rc, 0);
        recvs.push(req);
    }
    // Every byte is on the receiver's sockets; let it arrive, untested: nothing lands.
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(landed_chunks(&rb.data, &src), 0);
    let mut calls = 0;
    for r in &recvs {
        loop {
            assert!(start.elapsed() < DEADLINE, "a receive did not complete");
            let done = test_once(*r).unwrap();
            calls += 1;
            std::thread::sleep(Duration::from_millis(10));
            let landed = landed_chunks(&rb.data, &src);
            assert!(
                landed <= calls,
                "{landed} receives landed after {calls} receive test(s)"
            );
            if done {
                break;
            }
        }
    }
    assert_eq!(rb.data, src);
    for r in recvs {
        assert_eq!(consumed(&p, r), 0);
    }
}
