//! The lane pass (`tcpxd::lanes`) over the built-in emulation, host memory: receives posted
//! within a window, heads tested, unpacked and consumed in ring order, bytes compared and every
//! slot back; and a landing slot dropped without unpacking (`discard`) that hands none of its
//! bytes on to a later emptied chunk, in the emulation's direct receive mode (as the real plugin
//! receives host memory).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tcpxd::lanes::{self, Dest, GpuStage, RecvQueue, Tag, Target, Wait};
use tcpxd::net::{HostRegion, MemHandle, Plugin, RecvComm, Region, RequestId, SendComm, loopback_pair};
use tcpxd_testkit::Rng;

const MODE_ENV: &str = "TCPXEMU_HOST_RECV";
const CHILD_ENV: &str = "TCPXD_LANE_PASS_CHILD";

fn pair() -> (SendComm, RecvComm) {
    let plugin = Plugin::builtin_emulation().expect("built-in emulation");
    loopback_pair(&plugin, 0, Duration::from_secs(20)).expect("a loopback pair")
}

fn region(len: usize) -> (Arc<HostRegion>, Vec<u8>) {
    let r = Arc::new(HostRegion::new(len).unwrap());
    (r, vec![0u8; len])
}

fn read(r: &HostRegion) -> Vec<u8> {
    let mut v = vec![0u8; r.len()];
    r.read(0, &mut v).unwrap();
    v
}

fn no_stage(_: &Arc<tcpxd::gpu::Gpu>) -> Result<&'static mut GpuStage, String> {
    Err("host memory only".into())
}

fn host_dest(region: &HostRegion, offset: u64, len: u32, staged: bool) -> Dest<'_> {
    Dest {
        target: Target::Host(region),
        offset,
        len,
        staged,
    }
}

/// 40 chunks of odd sizes through a window of 5 receives: every chunk lands where it was
/// posted, receives are consumed in the order they were posted, and every slot comes back.
#[test]
fn a_pass_posts_within_the_window_unpacks_and_consumes_in_ring_order() {
    let (mut s, mut r) = pair();
    let mut rng = Rng::new(0x1a_4e5);
    let lens: Vec<u32> = (0..40).map(|_| 1 + rng.below(70_000) as u32).collect();
    let total: u64 = lens.iter().map(|&l| u64::from(l)).sum();
    let (src, _) = region(total as usize);
    let (dst, _) = region(total as usize);
    let data = rng.bytes(total as usize);
    src.write(0, &data).unwrap();
    let smh = s.register(src.clone()).unwrap();
    let rmh = r.register(dst.clone()).unwrap();

    let offsets: Vec<u64> = lens
        .iter()
        .scan(0u64, |at, &l| {
            let o = *at;
            *at += u64::from(l);
            Some(o)
        })
        .collect();
    let mut queue: RecvQueue<(u64, usize), usize> = RecvQueue::default();
    let (mut tag, mut sent, mut posted, mut sends_done) = (Tag::default(), 0usize, 0usize, 0usize);
    let mut consumed = Vec::new();
    let window = 5;
    let deadline = Instant::now() + Duration::from_secs(30);
    while consumed.len() < lens.len() {
        assert!(Instant::now() < deadline, "stuck at {} consumed", consumed.len());
        while posted < lens.len() && r.outstanding() < window {
            let at = offsets[posted];
            assert!(
                queue
                    .post(&mut r, &rmh, at as usize, lens[posted], (at, posted))
                    .unwrap()
            );
            posted += 1;
        }
        assert!(r.outstanding() <= window, "the window holds");
        while sent < posted && s.can_post() {
            let at = offsets[sent] as usize;
            assert!(lanes::post_send(&mut s, &mut tag, &smh, at, lens[sent]).unwrap());
            sent += 1;
        }
        sends_done += lanes::test_sends(&mut s, || {}).unwrap();
        queue
            .test_heads(&mut r, |comm, p| {
                let (at, k) = p.meta;
                (
                    lanes::start_unpack(comm, p.id, host_dest(&dst, at, p.len, false), no_stage),
                    k,
                )
            })
            .unwrap();
        queue
            .consume_ready(
                &mut r,
                |_, _| unreachable!("no GPU batch"),
                |landed, result| {
                    result.unwrap();
                    consumed.push(landed.meta);
                },
            )
            .unwrap();
    }
    while sends_done < lens.len() {
        assert!(Instant::now() < deadline, "sends stuck");
        sends_done += lanes::test_sends(&mut s, || {}).unwrap();
    }
    assert_eq!(consumed, (0..lens.len()).collect::<Vec<_>>(), "ring order");
    assert_eq!(read(&dst), data, "every byte where it was posted");
    assert_eq!((queue.posted(), queue.landed()), (0, 0));
    assert_eq!((r.outstanding(), s.outstanding()), (0, 0), "every slot back");
}

/// Receives whose copies run out of their own posted range (`Wait::Slot`) give their plugin
/// slots back before the copies finish, in ring order, never past one whose unpack still needs
/// the plugin (`Wait::Host`), and are reported consumed only once their copies are done, in ring
/// order; the slots given back take new receives meanwhile.
#[test]
fn receives_landed_in_place_give_their_plugin_slots_back_before_their_copies_end() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use tcpxd::net::host_copies::CopyTicket;
    let (mut s, mut r) = pair();
    const LEN: u32 = 4096;
    let (src, _) = region(5 * LEN as usize);
    let (slots, _) = region(5 * LEN as usize);
    let smh = s.register(src.clone()).unwrap();
    let rmh = r.register(slots.clone()).unwrap();
    let mut queue: RecvQueue<usize, usize> = RecvQueue::default();
    let mut tag = Tag::default();
    let gates: Vec<Arc<AtomicU64>> = (0..5).map(|_| Arc::new(AtomicU64::new(0))).collect();
    // Receive k's copies: out of its own slot, except receive 1's (as from bounce pages).
    let wait = |k: usize| {
        let t = CopyTicket::gated(gates[k].clone());
        if k == 1 { Wait::Host(t) } else { Wait::Slot(t) }
    };
    let mut post = |queue: &mut RecvQueue<usize, usize>, r: &mut RecvComm, s: &mut SendComm, k: usize| {
        let at = k * LEN as usize;
        assert!(queue.post(r, &rmh, at, LEN, k).unwrap());
        assert!(lanes::post_send(s, &mut tag, &smh, at, LEN).unwrap());
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let land_all = |queue: &mut RecvQueue<usize, usize>, r: &mut RecvComm, s: &mut SendComm| {
        while queue.posted() > 0 {
            assert!(Instant::now() < deadline, "chunks stuck");
            lanes::test_sends(s, || {}).unwrap();
            queue.test_heads(r, |_, p| (wait(p.meta), p.meta)).unwrap();
        }
    };
    for k in 0..3 {
        post(&mut queue, &mut r, &mut s, k);
    }
    land_all(&mut queue, &mut r, &mut s);
    let mut done = Vec::new();
    let consume = |queue: &mut RecvQueue<usize, usize>, r: &mut RecvComm, done: &mut Vec<usize>| {
        queue
            .consume_ready(
                r,
                |_, _| None,
                |l, result| {
                    result.unwrap();
                    done.push(l.meta);
                },
            )
            .unwrap()
    };
    // Nothing copied yet: receive 0 gives its slot back, receive 1 (and so 2) keeps theirs.
    assert_eq!(consume(&mut queue, &mut r, &mut done), 0);
    assert_eq!((queue.landed(), r.outstanding()), (3, 2));
    gates[0].store(1, Ordering::Release);
    assert_eq!(consume(&mut queue, &mut r, &mut done), 1);
    assert_eq!(
        (queue.landed(), r.outstanding()),
        (2, 2),
        "receive 1 still needs its slot"
    );
    gates[1].store(1, Ordering::Release);
    assert_eq!(consume(&mut queue, &mut r, &mut done), 1);
    assert_eq!(
        (queue.landed(), r.outstanding()),
        (1, 0),
        "receive 2 gave its slot back"
    );
    // Its slot takes new receives while its copies run.
    for k in 3..5 {
        post(&mut queue, &mut r, &mut s, k);
    }
    land_all(&mut queue, &mut r, &mut s);
    assert_eq!(consume(&mut queue, &mut r, &mut done), 0);
    assert_eq!((queue.landed(), r.outstanding()), (3, 0));
    for g in &gates[2..] {
        g.store(1, Ordering::Release);
    }
    assert_eq!(consume(&mut queue, &mut r, &mut done), 3);
    assert_eq!(done, [0, 1, 2, 3, 4], "reported as their copies ended");
    while s.outstanding() > 0 {
        assert!(Instant::now() < deadline, "sends stuck");
        lanes::test_sends(&mut s, || {}).unwrap();
    }
    assert_eq!((queue.posted(), queue.landed(), r.outstanding()), (0, 0, 0));
}

/// Receives released early (`Wait::Slot`) are reported consumed as their copies end, in any
/// order (issue 38 point 3: one slow copy no longer holds the lane's window, and the engine is
/// told which chunk each is); a receive whose unpack still needs the plugin (`Wait::Host`) keeps
/// its plugin slot (and the slots behind it) until it is done, and is reported in ring order,
/// after every older receive.
#[test]
fn receives_released_early_are_reported_as_their_copies_end_in_any_order() {
    use std::sync::atomic::{AtomicU64, Ordering};
    use tcpxd::net::host_copies::CopyTicket;
    let (mut s, mut r) = pair();
    const LEN: u32 = 4096;
    const N: usize = 5;
    let (src, _) = region(N * LEN as usize);
    let (slots, _) = region(N * LEN as usize);
    let smh = s.register(src.clone()).unwrap();
    let rmh = r.register(slots.clone()).unwrap();
    let mut queue: RecvQueue<usize, usize> = RecvQueue::default();
    let mut tag = Tag::default();
    let gates: Vec<Arc<AtomicU64>> = (0..N).map(|_| Arc::new(AtomicU64::new(0))).collect();
    // Receive 3's copies need the plugin's pages (`Wait::Host`); the others' run out of their
    // own slots.
    let wait = |k: usize| {
        let t = CopyTicket::gated(gates[k].clone());
        if k == 3 { Wait::Host(t) } else { Wait::Slot(t) }
    };
    for k in 0..N {
        let at = k * LEN as usize;
        assert!(queue.post(&mut r, &rmh, at, LEN, k).unwrap());
        assert!(lanes::post_send(&mut s, &mut tag, &smh, at, LEN).unwrap());
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while queue.posted() > 0 {
        assert!(Instant::now() < deadline, "chunks stuck");
        lanes::test_sends(&mut s, || {}).unwrap();
        queue.test_heads(&mut r, |_, p| (wait(p.meta), p.meta)).unwrap();
    }
    let mut done = Vec::new();
    let mut consume = |queue: &mut RecvQueue<usize, usize>, r: &mut RecvComm| {
        queue
            .consume_ready(
                r,
                |_, _| None,
                |l, result| {
                    result.unwrap();
                    done.push(l.meta);
                },
            )
            .unwrap()
    };
    // Nothing copied: receives 0-2 give their plugin slots back, 3 (and so 4) keep theirs.
    assert_eq!(consume(&mut queue, &mut r), 0);
    assert_eq!((queue.landed(), r.outstanding()), (N, 2));
    // Receive 2's copies end first, then 0's: each reported as it ends.
    gates[2].store(1, Ordering::Release);
    assert_eq!(consume(&mut queue, &mut r), 1);
    gates[0].store(1, Ordering::Release);
    assert_eq!(consume(&mut queue, &mut r), 1);
    assert_eq!((queue.landed(), r.outstanding()), (3, 2));
    // Receive 4 is done but still holds its plugin slot behind 3: not reported yet.
    gates[4].store(1, Ordering::Release);
    assert_eq!(consume(&mut queue, &mut r), 0);
    // 3's unpack ends, but a receive that was not released goes in ring order: after 1.
    gates[3].store(1, Ordering::Release);
    assert_eq!(consume(&mut queue, &mut r), 0);
    assert_eq!((queue.landed(), r.outstanding()), (3, 2));
    // 1's copies end: 1, 3 and 4 are reported, and the plugin has every slot back.
    gates[1].store(1, Ordering::Release);
    assert_eq!(consume(&mut queue, &mut r), 3);
    assert_eq!((queue.landed(), r.outstanding()), (0, 0));
    assert_eq!(
        done,
        [2, 0, 1, 3, 4],
        "released ones as their copies ended, the others in ring order"
    );
    while s.outstanding() > 0 {
        assert!(Instant::now() < deadline, "sends stuck");
        lanes::test_sends(&mut s, || {}).unwrap();
    }
    assert_eq!((queue.posted(), queue.landed(), r.outstanding()), (0, 0, 0));
}

/// Posts a receive of `len` bytes into the landing slot and a send of `send_len` bytes of `src`;
/// returns the receive once both completed, in the lane's landing queue.
fn land(
    s: &mut SendComm,
    r: &mut RecvComm,
    queue: &mut RecvQueue<(), ()>,
    (smh, rmh): (&MemHandle, &MemHandle),
    len: u32,
    send_len: u32,
) -> RequestId {
    let mut tag = Tag::default();
    assert!(queue.post(r, rmh, 0, len, ()).unwrap());
    assert!(lanes::post_send(s, &mut tag, smh, 0, send_len).unwrap());
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut id = None;
    let mut sent = 0;
    while id.is_none() || sent == 0 {
        assert!(Instant::now() < deadline, "chunk stuck");
        sent += lanes::test_sends(s, || {}).unwrap();
        queue
            .test_heads(r, |_, p| {
                id = Some(p.id);
                (Wait::Header, ())
            })
            .unwrap();
    }
    id.unwrap()
}

/// The eager path of a refused chunk, then an emptied chunk landing into a destination through
/// the same slot: with `discard` the destination gets zeros; consumed without it (the old path),
/// the refused chunk's bytes.
fn stale_bytes(discard: bool) -> Vec<u8> {
    let (mut s, mut r) = pair();
    const LEN: u32 = 8192;
    let (src, _) = region(LEN as usize);
    src.write(0, &Rng::new(5).bytes(LEN as usize)).unwrap();
    let slot = Arc::new(HostRegion::populated(LEN as usize).unwrap());
    let (dst, _) = region(LEN as usize);
    let smh = s.register(src.clone()).unwrap();
    let rmh = r.register(slot.clone()).unwrap();
    let mut queue: RecvQueue<(), ()> = RecvQueue::default();

    // A refused transfer's chunk: consumed without unpacking.
    let refused = land(&mut s, &mut r, &mut queue, (&smh, &rmh), LEN, LEN);
    let landed = queue.awaiting_header().expect("landed");
    landed.wait = if discard {
        lanes::discard(&r, refused)
    } else {
        Wait::Ready(Ok(()))
    };
    let n = queue
        .consume_ready(&mut r, |_, _| None, |_, result| result.unwrap())
        .unwrap();
    assert_eq!(n, 1);

    // A cancelled transfer's emptied chunk, landed into a destination (`Action::Land`).
    let emptied = land(&mut s, &mut r, &mut queue, (&smh, &rmh), LEN, 0);
    let landed = queue.awaiting_header().expect("landed");
    landed.wait = lanes::start_unpack(&r, emptied, host_dest(&dst, 0, LEN, true), no_stage);
    queue
        .consume_ready(&mut r, |_, _| None, |_, result| result.unwrap())
        .unwrap();
    assert_eq!((r.outstanding(), s.outstanding()), (0, 0), "every slot back");
    read(&dst)
}

fn in_direct_mode(test: &str) {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            &crate::common::test_name(module_path!(), test),
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .env(MODE_ENV, "direct")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{test}: {text}");
    assert!(text.contains("1 passed"), "{test}: the child ran no test: {text}");
}

#[test]
fn a_discarded_landing_slot_hands_none_of_its_bytes_to_a_later_emptied_chunk() {
    in_direct_mode("child_discarded_slot");
}

/// The child's body (ignored on its own: the receive mode is read when the plugin starts).
#[test]
#[ignore = "run by the test above, in a child process with TCPXEMU_HOST_RECV=direct"]
fn child_discarded_slot() {
    let stale = stale_bytes(false);
    let expected = Rng::new(5).bytes(8192);
    assert_eq!(
        stale, expected,
        "without the zeroing a direct receive's stale bytes reach the destination (the hazard)"
    );
    assert!(
        stale_bytes(true).iter().all(|&b| b == 0),
        "discarded: no stale byte reaches the destination"
    );
}
