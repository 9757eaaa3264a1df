//! The CUDA mode's block allocation (16-page blocks taken at random, pages shuffled inside the
//! blocks a batch takes, blocks returned at irecvConsumed), run in host mode through
//! `TCPXEMU_HOST_BLOCK_PAGES=16` so it is checked without a GPU. The pool (1000 pages) is not a
//! multiple of 16: its last block is short.

mod common;
use common::*;
use std::ffi::c_int;

const PAGES: usize = 1000;

fn env() -> &'static abi::ncclNet_v7_t {
    setup(&[
        ("NCCL_DYNAMIC_CHUNK_SIZE", "524288"),
        ("NCCL_NSOCKS_PERTHREAD", "4"),
        ("NCCL_SOCKET_NTHREADS", "1"),
        ("TCPXEMU_DEVICES", "2"),
        ("TCPXEMU_DEV1_FRAGMENTS", "odd"),
        ("TCPXEMU_BOUNCE_PAGES", "1000"),
        ("TCPXEMU_HOST_BLOCK_PAGES", "16"),
        ("TCPXEMU_SEED", "777"),
        ("TCPXEMU_BOUNCE", "host"),
    ])
}

/// Every fragment inside one page of the pool; no page used twice in one request; the
/// fragments cover [0, size) exactly once.
fn check(frags: &[abi::loadMeta], size: usize) {
    let mut pages = std::collections::HashSet::new();
    for f in frags {
        assert!(f.len >= 1 && f.len <= 4096, "fragment length {}", f.len);
        assert!(
            (f.src_off as usize % 4096) + f.len as usize <= 4096,
            "fragment crosses its page"
        );
        assert!(
            (f.src_off as usize) + (f.len as usize) <= PAGES * 4096,
            "outside the pool"
        );
        assert!(pages.insert(f.src_off / 4096), "page used twice in one request");
    }
    check_coverage(frags, size);
}

#[test]
fn block_pages_roundtrip_shuffled() {
    env();
    let mut p = pair(0);
    for (i, size) in [1usize, 4096, 65537, 1 << 20, (3 << 20) + 5]
        .into_iter()
        .enumerate()
    {
        let (_, frags) = roundtrip(&mut p, size, 40 + i as u64, true);
        check(&frags, size);
        assert_eq!(frags.len(), size.div_ceil(4096));
        assert!(frags.iter().all(|f| f.src_off % 4096 == 0));
        if size >= 1 << 20 {
            // In dst order, consecutive fragments rarely sit in consecutive pages.
            let mut by_dst = frags.clone();
            by_dst.sort_by_key(|f| f.dst_off);
            let adjacent = by_dst
                .windows(2)
                .filter(|w| w[1].src_off == w[0].src_off + 4096)
                .count();
            assert!(
                adjacent * 4 < by_dst.len(),
                "pages are not shuffled inside blocks: {adjacent} adjacent"
            );
        }
    }
}

#[test]
fn block_pages_odd_fragments() {
    env();
    let mut p = pair_with(0, 1, true);
    for (i, size) in [3usize, 70_000, 2 << 20].into_iter().enumerate() {
        let (_, frags) = roundtrip(&mut p, size, 60 + i as u64, true);
        check(&frags, size);
    }
}

/// 16 receives of 240 KiB in flight over 96 requests: each holds 4 blocks (64 pages) until
/// irecvConsumed, so 16 of them (1024 pages) would not fit in the 1000-page pool — receives wait
/// for blocks coming back. Afterwards a 3 MiB receive (768 pages) still fits, so every block
/// came back.
#[test]
fn block_pages_recycle_through_a_small_pool() {
    env();
    let mut p = pair(0);
    const N: usize = 16;
    const SZ: usize = 240 << 10;
    const TOTAL: usize = 96;
    let mut sbufs: Vec<Buf> = (0..N)
        .map(|i| reg(p.send, seeded_vec(500 + i as u64, SZ)))
        .collect();
    let mut rbufs: Vec<Buf> = (0..N).map(|_| reg(p.recv, vec![0u8; SZ])).collect();
    let mut inflight = std::collections::VecDeque::new();
    let (mut posted, mut done) = (0usize, 0usize);
    let start = std::time::Instant::now();
    while done < TOTAL {
        assert!(start.elapsed() < DEADLINE, "window did not drain ({done} done)");
        while posted < TOTAL && inflight.len() < N {
            let w = posted % N;
            let s = isend(&p, &mut sbufs[w], SZ, w as c_int).unwrap();
            let (r, q) = irecv(&mut p, &mut rbufs[w], SZ, w as c_int).unwrap();
            inflight.push_back((s, r, q, w, false));
            posted += 1;
        }
        let front = inflight.front_mut().unwrap();
        if !front.4 {
            front.4 = test_once(front.0).unwrap();
        }
        if front.4 && test_once(front.1).unwrap() {
            let (_, r, q, w, _) = inflight.pop_front().unwrap();
            let mut out = vec![0u8; SZ];
            let frags = gather(&p, q, &mut out);
            check(&frags, SZ);
            assert!(out == sbufs[w].data, "message {done}");
            assert_eq!(consumed(&p, r), 0);
            done += 1;
        } else {
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    }
    let (_, frags) = roundtrip(&mut p, 3 << 20, 99, true);
    check(&frags, 3 << 20);
}
