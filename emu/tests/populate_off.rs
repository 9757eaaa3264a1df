//! `TCPXEMU_BOUNCE_POPULATE=0`: the bounce pages are left to fault in on their first receive
//! (the emulation's behaviour before the pool was populated at comm creation).

mod common;
use common::*;

const PAGES: usize = 1000;

#[test]
fn bounce_pages_fault_in_on_first_use_when_not_populated() {
    setup(&[
        ("NCCL_DYNAMIC_CHUNK_SIZE", "524288"),
        ("NCCL_NSOCKS_PERTHREAD", "1"),
        ("NCCL_SOCKET_NTHREADS", "1"),
        ("TCPXEMU_BOUNCE_PAGES", "1000"),
        ("TCPXEMU_BOUNCE_POPULATE", "0"),
        ("TCPXEMU_BOUNCE", "host"),
    ]);
    let mut p = pair(0);
    roundtrip(&mut p, 4096, 1, true);
    let h = unpack_handle(&p);
    let mut vec = vec![0u8; PAGES];
    // SAFETY: as in populate.rs: the plugin's page-aligned PAGES-page mapping, alive until
    // closeRecv; one byte per page.
    let rc = unsafe { libc::mincore(h.bounce_buf.cast(), PAGES * 4096, vec.as_mut_ptr()) };
    assert_eq!(rc, 0);
    let resident = vec.iter().filter(|&&b| b & 1 != 0).count();
    // The page the 4 KiB receive landed in (and nothing close to all of them).
    assert!((1..PAGES / 2).contains(&resident), "{resident} pages resident");
    assert!(logs_contain("bounce pages=1000 (faulted on first use)"));
    assert_eq!(p.close_send(), 0);
    assert_eq!(p.close_recv(), 0);
}
