//! Host mode populates each receive comm's bounce pages before its socket threads take their
//! first receive (`TCPXEMU_BOUNCE_POPULATE`, on by default), as the real plugin's bounce buffer is
//! backed from accept on: no receive page-faults in the pool. One socket per comm, so the one
//! socket thread has populated the whole pool once the first receive completed.

mod common;
use common::*;

const PAGES: usize = 1000;

fn env() -> &'static abi::ncclNet_v7_t {
    setup(&[
        ("NCCL_DYNAMIC_CHUNK_SIZE", "524288"),
        ("NCCL_NSOCKS_PERTHREAD", "1"),
        ("NCCL_SOCKET_NTHREADS", "1"),
        ("TCPXEMU_BOUNCE_PAGES", "1000"),
        ("TCPXEMU_SEED", "99"),
        ("TCPXEMU_BOUNCE", "host"),
    ])
}

/// Pages of the comm's bounce buffer resident in RAM (`mincore`).
fn resident_bounce_pages(p: &Pair) -> usize {
    let h = unpack_handle(p);
    let mut vec = vec![0u8; PAGES];
    // SAFETY: the bounce buffer is the plugin's page-aligned mapping of PAGES pages, alive until
    // closeRecv; `vec` holds one byte per page, as mincore requires.
    let rc = unsafe { libc::mincore(h.bounce_buf.cast(), PAGES * 4096, vec.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    vec.iter().filter(|&&b| b & 1 != 0).count()
}

#[test]
fn bounce_pages_are_resident_before_the_first_receive_lands() {
    env();
    let mut p = pair(0);
    // One page's worth of data lands in one page: the rest were never touched by a receive.
    let (_, frags) = roundtrip(&mut p, 4096, 1, true);
    assert_eq!(frags.len(), 1);
    assert_eq!(resident_bounce_pages(&p), PAGES, "every bounce page is resident");
    assert!(
        logs_contain("bounce pages=1000 (populated)"),
        "the init line says so"
    );
    // Data still moves (and lands in pages populated while nothing was written to them).
    for (i, size) in [1usize, 65537, 1 << 20].into_iter().enumerate() {
        roundtrip(&mut p, size, 2 + i as u64, true);
    }
    assert_eq!(p.close_send(), 0);
    assert_eq!(p.close_recv(), 0);
}
