//! Block chunks over the plugin, below the poller: a chunk's scattered pieces gathered from a
//! host buffer into a staging slot (`net::blocks::gather_region`), sent, received into a landing
//! slot and scattered into another host buffer's pieces (`RecvComm::scatter_landed`), over the
//! built-in emulation in both of its host receive modes (bounce pages with a fragment list; direct
//! receives into the slot, as the real plugin does for host memory). Bytes compared with a
//! per-block copy; bad tables refused before a byte moves.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tcpxd::engine::blocks::{BlockList, IndexArray, Layout, Segment, SidePlan};
use tcpxd::net::host_copies::Place;
use tcpxd::net::{HostRegion, Plugin, RecvComm, Region, SendComm, loopback_pair};
use tcpxd_testkit::Rng;

const MODE_ENV: &str = "TCPXEMU_HOST_RECV";
const CHILD_ENV: &str = "TCPXD_NET_BLOCKS_CHILD";

fn pair() -> (SendComm, RecvComm) {
    let plugin = Plugin::builtin_emulation().expect("built-in emulation");
    loopback_pair(&plugin, 0, Duration::from_secs(20)).expect("a loopback pair")
}

fn read(r: &HostRegion) -> Vec<u8> {
    let mut v = vec![0u8; r.len()];
    r.read(0, &mut v).unwrap();
    v
}

/// Sends `len` bytes at `off` of the staging ring and receives them into slot `slot_off` of the
/// landing ring; returns the completed receive once both are done.
fn move_chunk(
    s: &mut SendComm,
    r: &mut RecvComm,
    (smh, off): (&tcpxd::net::MemHandle, usize),
    (rmh, slot_off): (&tcpxd::net::MemHandle, usize),
    len: usize,
) -> tcpxd::net::RequestId {
    let rid = r.irecv(rmh, slot_off, len, 1).unwrap().expect("receive taken");
    let sid = s.isend(smh, off, len, 1).unwrap().expect("send taken");
    let deadline = Instant::now() + Duration::from_secs(20);
    let (mut sent, mut got) = (false, false);
    while !(sent && got) {
        assert!(Instant::now() < deadline, "chunk stuck");
        if !sent {
            sent = s.test(sid).unwrap();
        }
        if !got {
            got = r.test(rid).unwrap().is_some();
        }
    }
    rid
}

fn round_trip() {
    let (mut s, mut r) = pair();
    let mut rng = Rng::new(0x5eed_b10c);
    // 300 blocks of odd sizes and strides, both sides scattered and shuffled.
    let n = 300u32;
    let len = 1000u32;
    let src = BlockList::new(
        1,
        1,
        2_000_000,
        Layout::Strided {
            first: 5,
            stride: 3001,
            len,
            count: n,
        },
    )
    .unwrap();
    let dst = BlockList::new(
        2,
        2,
        2_000_000,
        Layout::Strided {
            first: 17,
            stride: 1777,
            len,
            count: n,
        },
    )
    .unwrap();
    let mut si: Vec<u32> = (0..n).collect();
    let mut di: Vec<u32> = (0..n).collect();
    for v in [&mut si, &mut di] {
        for i in (1..v.len()).rev() {
            v.swap(i, rng.below(i as u64 + 1) as usize);
        }
    }
    let send = SidePlan::build(&src, &IndexArray::compact(&si), "s").unwrap();
    let recv = SidePlan::build(&dst, &IndexArray::compact(&di), "d").unwrap();
    let sbuf = Arc::new(HostRegion::new(2_000_000).unwrap());
    let bytes: Vec<u8> = (0..sbuf.len()).map(|_| rng.next() as u8).collect();
    sbuf.write(0, &bytes).unwrap();
    let dbuf = Arc::new(HostRegion::new(2_000_000).unwrap());
    dbuf.write(0, &vec![0x5A; dbuf.len()]).unwrap();
    let mut want = read(&dbuf);
    for (&a, &b) in si.iter().zip(&di) {
        let (so, l) = src.block(a).unwrap();
        let (doff, _) = dst.block(b).unwrap();
        want[doff as usize..(doff + u64::from(l)) as usize]
            .copy_from_slice(&bytes[so as usize..(so + u64::from(l)) as usize]);
    }

    // 64 KiB chunks copied by one thread, 256 KiB ones split across 3 helpers and this thread,
    // then queued whole on 3 helpers (each send after its gather's ticket, each consume after
    // its scatter's).
    for (chunk, helpers, queued) in [(65536u32, 0usize, false), (262_144, 3, false), (262_144, 3, true)] {
        dbuf.write(0, &vec![0x5A; dbuf.len()]).unwrap();
        chunks(
            &mut s,
            &mut r,
            (&send, &recv),
            (&sbuf, &dbuf),
            chunk,
            (helpers, queued),
        );
        assert!(
            read(&dbuf) == want,
            "{chunk}-byte chunks, {helpers} helpers (queued: {queued}): the destination differs from a per-block copy"
        );
    }
}

/// Waits for a queued copy's ticket (none: copied at once).
fn done(ticket: Option<tcpxd::net::host_copies::CopyTicket>) {
    let since = Instant::now();
    while ticket.as_ref().is_some_and(|t| !t.is_done()) {
        assert!(
            since.elapsed() < Duration::from_secs(20),
            "a queued copy never finished"
        );
        std::thread::yield_now();
    }
}

/// Moves `plans`' chunks of `chunk` bytes from `sbuf` into `dbuf` (gather, send, receive,
/// scatter), `helpers` threads splitting the host copies (`queued`: each chunk's copies queued
/// whole on a helper).
fn chunks(
    s: &mut SendComm,
    r: &mut RecvComm,
    (send, recv): (&SidePlan, &SidePlan),
    (sbuf, dbuf): (&Arc<HostRegion>, &Arc<HostRegion>),
    chunk: u32,
    (helpers, queued): (usize, bool),
) {
    let (sdyn, ddyn): (Arc<dyn Region>, Arc<dyn Region>) = (sbuf.clone(), dbuf.clone());
    let copies =
        tcpxd::net::host_copies::HostCopies::new(helpers, tcpxd::net::host_copies::HelperSpin::auto(true));
    let window = 4usize;
    let staging = Arc::new(HostRegion::populated(window * chunk as usize).unwrap());
    let landing = Arc::new(HostRegion::new(window * chunk as usize).unwrap());
    let smh = s.register(staging.clone()).unwrap();
    let rmh = r.register(landing.clone()).unwrap();
    let (mut gt, mut st) = (Vec::<Segment>::new(), Vec::<Segment>::new());
    for k in 0..send.chunk_count(chunk) {
        send.chunk_into(chunk, k, &mut gt);
        recv.chunk_into(chunk, k, &mut st);
        let slot = (k as usize % window) * chunk as usize;
        let n = if queued {
            let sdyn_staging: Arc<dyn Region> = staging.clone();
            let (n, t) = tcpxd::net::blocks::gather_region_queued(
                &sdyn,
                &gt,
                &sdyn_staging,
                slot,
                chunk as usize,
                &copies,
                // Every second chunk queued behind: bytes the same either way.
                [Place::Next, Place::Due, Place::Behind][k as usize % 3],
            )
            .unwrap();
            done(t);
            n
        } else {
            tcpxd::net::blocks::gather_region(&**sbuf, &gt, &*staging, slot, chunk as usize, &copies).unwrap()
        };
        if k % 3 == 0 {
            // A table that reaches past the destination is refused before a byte lands, and the
            // landing slot is left holding nothing of the chunk.
            let rid = move_chunk(s, r, (&smh, slot), (&rmh, slot), n as usize);
            let mut past = st.clone();
            past.last_mut().unwrap().offset = dbuf.len() as u64;
            let before = read(dbuf);
            assert!(r.scatter_landed(rid, &past, n, &**dbuf, &copies).is_err());
            assert!(read(dbuf) == before, "chunk {k}: a refused scatter wrote");
            r.consume(rid).unwrap();
            let mut left = vec![1u8; n as usize];
            landing.read(slot, &mut left).unwrap();
            assert!(left.iter().all(|&b| b == 0), "chunk {k}: the slot kept bytes");
        }
        let rid = move_chunk(s, r, (&smh, slot), (&rmh, slot), n as usize);
        if queued {
            let (copied, t) = r.scatter_landed_queued(rid, &st, n, &ddyn, &copies).unwrap();
            assert_eq!(copied, u64::from(n));
            done(t);
        } else {
            assert_eq!(
                r.scatter_landed(rid, &st, n, &**dbuf, &copies).unwrap(),
                u64::from(n)
            );
        }
        r.consume(rid).unwrap();
        if queued {
            // A direct receive's slot is zeroed by the job once copied out (into bounce pages
            // nothing lands in the slot).
            let mut left = vec![1u8; n as usize];
            landing.read(slot, &mut left).unwrap();
            assert!(left.iter().all(|&b| b == 0), "chunk {k}: the slot kept bytes");
        }
    }
    // A gather whose table reaches past the source copies nothing.
    let bad = [Segment {
        offset: sbuf.len() as u64 - 10,
        wire: 0,
        len: 11,
    }];
    assert!(tcpxd::net::blocks::gather_region(&**sbuf, &bad, &*staging, 0, chunk as usize, &copies).is_err());
    assert!(
        tcpxd::net::blocks::gather_region(
            &**sbuf,
            &gt,
            &*staging,
            3 * chunk as usize + 1,
            chunk as usize,
            &copies
        )
        .is_err()
    );
}

/// Runs `round_trip` in a child process with the emulation's host receive mode `mode` (read once,
/// when the plugin starts).
fn in_mode(mode: &str) {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            &crate::common::test_name(module_path!(), "child_round_trip"),
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .env(MODE_ENV, mode)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{mode}: {text}");
    assert!(text.contains("1 passed"), "{mode}: the child ran no test: {text}");
}

#[test]
fn gathered_chunks_scatter_byte_exact_through_bounce_pages() {
    in_mode("bounce");
}

#[test]
fn gathered_chunks_scatter_byte_exact_through_direct_receives() {
    in_mode("direct");
}

/// The child's body, run by `in_mode` (ignored on its own: it needs the mode set before the
/// plugin starts).
#[test]
#[ignore = "run by the two tests above, in a child process with the emulation's receive mode set"]
fn child_round_trip() {
    round_trip();
}
