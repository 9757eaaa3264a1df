//! The pass order of an eager chunk into GPU memory (issue #38's fixed cost per transfer), read
//! from the hop trace of two `tcpxd` processes on the CUDA stand-in (as
//! `daemon_stub_gpus_credits`: credits on GPU lanes, the chunks landing in the bounce pages of
//! the lane's GPU, the `d2d` unpacker). Every poller hop carries the number of the pass it ran in
//! (`pass`), so the order is checked without any timing:
//!
//! - an eager chunk's unpack is launched (`stage.submit`) in the pass whose actions landed it
//!   (`poller.land`, the engine's `Land` once its header and data are both here), not in the next;
//! - on the stand-in a batch is done once launched (its copies run at once, its event is ready),
//!   so the chunk is consumed in that same pass, and the transfer's end — `Done` to the sender
//!   (with the credits), or the READ's `Finished` at the reader — leaves in the pass of its last
//!   consume.
//!
//! Bytes are compared both ways and every credit, credit byte and slot comes back.

use std::fs::File;
use std::path::Path;
use std::process::Stdio;

use crate::common::daemons::{fill_seed, host_buffer, wait_ok, write, write_entry};
use crate::common::gpus::{Compare, Trip, assert_same, cuda_buffer, write_and_read_back};
use crate::daemon_stub_gpus::{Daemon, start_logged};
use crate::daemon_stub_gpus_credits::{credits_back, peer};
use tcpxd_testkit::ScratchDir;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

async fn logged(dir: &ScratchDir, node: &str, env: &[(&str, &str)]) -> Daemon {
    let log = File::create(dir.join(format!("{node}.log"))).expect("a log file");
    // The poller's passes: with `runtime.lane_thread` on (the suite run with
    // `TCPXD_LANE_THREAD=on`) a receive's landing, unpack and consume happen in the lane
    // thread's passes instead, which these hops do not follow; the order is the poller's.
    let env = [
        &[
            ("RUST_LOG", "warn,tcpxd::hop=trace"),
            ("TCPXD_LANE_THREAD", "off"),
        ],
        env,
    ]
    .concat();
    start_logged(dir, node, "d2d", 1, true, &env, Stdio::from(log)).await
}

/// One hop event of the poller's: its name, its pass and its other fields as written.
struct Hop {
    hop: String,
    pass: u64,
    line: String,
}

fn hops(log: &Path) -> Vec<Hop> {
    let text = std::fs::read_to_string(log).expect("the daemon's log");
    text.lines()
        .filter_map(|line| {
            let hop = line.split("hop=\"").nth(1)?.split('"').next()?.to_string();
            let pass = line.split(" pass=").nth(1)?.split(' ').next()?.parse().ok()?;
            Some(Hop {
                hop,
                pass,
                line: line.to_string(),
            })
        })
        .collect()
}

/// What the order checks found in one receiver's log: chunks landed, transfers ended.
#[derive(Debug, Default)]
struct Seen {
    lands: usize,
    ends: usize,
}

/// Checks the order in a receiving daemon's trace; `end` says which hop ends a transfer whose
/// chunks it received (b: the `Done` it sends; a: the `Finished` of its own READs).
/// `gpu`: the chunks land in GPU memory (launched in a batch), else host memory (copied at once).
fn check_order(log: &Path, gpu: bool, end: impl Fn(&Hop) -> bool) -> Seen {
    let hops = hops(log);
    let mut seen = Seen::default();
    let mut last_consumed: Option<u64> = None;
    for (i, h) in hops.iter().enumerate() {
        let next = |name: &str| {
            hops[i..]
                .iter()
                .find(|n| n.hop == name)
                .unwrap_or_else(|| panic!("{}: no {name} after {}", log.display(), h.line))
        };
        match h.hop.as_str() {
            "poller.land" => {
                seen.lands += 1;
                let submit = if gpu { next("stage.submit") } else { h };
                assert_eq!(
                    submit.pass,
                    h.pass,
                    "{}: the unpack of the chunk landed by\n  {}\nwas launched in a later pass:\n  {}",
                    log.display(),
                    h.line,
                    submit.line
                );
                let consumed = next("poller.consumed");
                assert_eq!(
                    consumed.pass,
                    h.pass,
                    "{}: a chunk whose batch was done at its launch was consumed in a later pass:\n  {}\n  {}",
                    log.display(),
                    h.line,
                    consumed.line
                );
            }
            "poller.consumed" => last_consumed = Some(h.pass),
            _ if end(h) => {
                seen.ends += 1;
                assert_eq!(
                    Some(h.pass),
                    last_consumed,
                    "{}: the transfer's end did not leave in the pass of its last consume: {}",
                    log.display(),
                    h.line
                );
            }
            _ => {}
        }
    }
    seen
}

/// The ids of the READs a daemon started (its `poller.cmd` hops).
fn reads(log: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(log).expect("the daemon's log");
    text.lines()
        .filter(|l| l.contains("hop=\"poller.cmd\"") && l.contains("kind=\"read\""))
        .filter_map(|l| Some(l.split(" id=").nth(1)?.split(' ').next()?.to_string()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_gpu_chunks_are_unpacked_in_the_pass_that_lands_them_and_end_their_transfer_in_it() {
    let dir = ScratchDir::fresh("tcpxd-lane-passes", "order");
    std::fs::create_dir_all(&*dir).unwrap();
    // Spread off: the chunk counts below are of 512 KiB chunks (daemon_stub_gpus_spread covers
    // the spread plan).
    let no_spread = [("TCPXD_SPREAD_MIN_CHUNK_BYTES", "0")];
    let mut a = logged(&dir, "passes-a", &no_spread).await;
    let mut b = logged(&dir, "passes-b", &no_spread).await;
    let src = cuda_buffer(&mut a.client, 3, 16 * MIB).await;
    let back = cuda_buffer(&mut a.client, 0, 16 * MIB).await;
    let dst = cuda_buffer(&mut b.client, 5, 16 * MIB).await;
    fill_seed(&mut a.client, src.id, 0, 0, 25).await;
    let trip = Trip {
        src: &src,
        dst: &dst,
        back: &back,
    };
    // One at a time: a WRITE (b receives) and a READ back (a receives) per size; 1 MiB is two
    // chunks on the route's two eager lanes.
    let sizes = [4 * KIB, 64 * KIB, MIB, MIB + 5, 3 * MIB];
    for (k, &len) in sizes.iter().enumerate() {
        let at = [k as u64 * 4096 + 1, k as u64 * 8192 + 7, 3];
        write_and_read_back(
            &mut a.client,
            &mut b.client,
            trip,
            at,
            len,
            Compare::Bytes,
            "GPU 3 -> 5 -> 0",
        )
        .await;
    }
    // Eight 1 MiB WRITEs in flight.
    let mut ids = Vec::new();
    for k in 0..8u64 {
        let at = k * (3 * MIB / 2) + 11;
        let id = write(&mut a.client, write_entry(&src, at, &dst, at + 2, MIB), b"")
            .await
            .unwrap();
        ids.push((id, at));
    }
    for (id, at) in ids {
        wait_ok(&mut a.client, id).await;
        let what = format!("1 MiB at {at}, 8 in flight");
        assert_same(
            &mut a.client,
            (src.id, at),
            &mut b.client,
            (dst.id, at + 2),
            MIB,
            &what,
        )
        .await;
    }
    let pa = peer(&mut a.client).await;
    assert_eq!(pa.sent_rendezvous, 0, "every transfer went by credits: {pa:?}");
    credits_back(&mut a.client).await;
    credits_back(&mut b.client).await;
    drop((a, b));

    // Each size's chunks (512 KiB each): 1, 1, 2, 3, 6; the WRITEs' at b, the READs' at a.
    let chunks: usize = 1 + 1 + 2 + 3 + 6;
    let b_log = dir.join("passes-b.log");
    let at_b = check_order(&b_log, true, |h| {
        h.hop == "poller.out" && h.line.contains("kind=\"done\"")
    });
    assert_eq!(at_b.lands, chunks + 8 * 2, "b: {at_b:?}");
    assert_eq!(at_b.ends, sizes.len() + 8, "b: a Done per WRITE: {at_b:?}");
    let a_log = dir.join("passes-a.log");
    let read_ids = reads(&a_log);
    assert_eq!(
        read_ids.len(),
        sizes.len(),
        "a started a READ per size: {read_ids:?}"
    );
    let finished_read = |h: &Hop| {
        h.hop == "poller.finished"
            && h.line
                .split(" id=")
                .nth(1)
                .is_some_and(|id| read_ids.iter().any(|r| r == id))
    };
    let at_a = check_order(&a_log, true, finished_read);
    assert_eq!(at_a.lands, chunks, "a: {at_a:?}");
    assert_eq!(at_a.ends, sizes.len(), "a: a Finished per READ: {at_a:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_host_chunks_are_consumed_in_the_pass_that_lands_them_and_end_their_transfer_in_it() {
    let dir = ScratchDir::fresh("tcpxd-lane-passes", "host");
    std::fs::create_dir_all(&*dir).unwrap();
    // Every transfer eager (host destinations would go by rendezvous above 64 KiB under auto),
    // none inline.
    let env = [
        ("TCPXD_TRANSFER_PROTOCOL", "eager"),
        ("TCPXD_INLINE_MAX_BYTES", "0"),
    ];
    let mut a = logged(&dir, "host-a", &env).await;
    let mut b = logged(&dir, "host-b", &env).await;
    let src = host_buffer(&mut a.client, 8 * MIB, "src").await;
    let back = host_buffer(&mut a.client, 8 * MIB, "back").await;
    let dst = host_buffer(&mut b.client, 8 * MIB, "dst").await;
    fill_seed(&mut a.client, src.id, 0, 0, 26).await;
    let trip = Trip {
        src: &src,
        dst: &dst,
        back: &back,
    };
    let sizes = [4 * KIB, 64 * KIB, MIB + 5];
    for (k, &len) in sizes.iter().enumerate() {
        let at = [k as u64 * 4096 + 9, k as u64 * 8192 + 1, 5];
        write_and_read_back(
            &mut a.client,
            &mut b.client,
            trip,
            at,
            len,
            Compare::Bytes,
            "host -> host -> host",
        )
        .await;
    }
    let pa = peer(&mut a.client).await;
    assert_eq!(
        (pa.sent_eager, pa.sent_rendezvous),
        (sizes.len() as u64, 0),
        "{pa:?}"
    );
    credits_back(&mut a.client).await;
    credits_back(&mut b.client).await;
    drop((a, b));

    let at_b = check_order(&dir.join("host-b.log"), false, |h| {
        h.hop == "poller.out" && h.line.contains("kind=\"done\"")
    });
    assert!(at_b.lands >= sizes.len(), "b: {at_b:?}");
    assert_eq!(at_b.ends, sizes.len(), "b: a Done per WRITE: {at_b:?}");
    let a_log = dir.join("host-a.log");
    let read_ids = reads(&a_log);
    let at_a = check_order(&a_log, false, |h| {
        h.hop == "poller.finished"
            && h.line
                .split(" id=")
                .nth(1)
                .is_some_and(|id| read_ids.iter().any(|r| r == id))
    });
    assert!(at_a.lands >= sizes.len(), "a: {at_a:?}");
    assert_eq!(at_a.ends, sizes.len(), "a: a Finished per READ: {at_a:?}");
}
