//! Spread plans between two `tcpxd` processes on the CUDA stand-in (issue #38, as
//! `daemon_stub_gpus_credits`): with `transfer.spread_min_chunk_bytes` (here through
//! `TCPXD_SPREAD_MIN_CHUNK_BYTES`, 128 KiB) a transfer of fewer than two chunks per lane of its
//! protocol is cut into smaller chunks — a 1 MiB WRITE or READ by GPU credits over the two credit
//! lanes goes as four of 256 KiB, 512 KiB + 3 bytes as four of 128 KiB and the 3 bytes, a 1 MiB
//! rendezvous transfer into host memory as four of 256 KiB — while 64 KiB (too small to halve)
//! and 16 MiB (enough chunks) keep 512 KiB. The chunk sizes are read from each daemon's hop trace
//! (`lane.isend len=…`); bytes are compared and every credit comes back.

use std::fs::File;
use std::path::Path;
use std::process::Stdio;

use crate::common::daemons::{fill_seed, wait_ok, write, write_entry};
use crate::common::gpus::{
    Compare, Trip, cuda_buffer, eight_writes_then_reads, host_to_and_from_gpus, write_and_read_back,
};
use crate::daemon_stub_gpus::{Daemon, start_logged};
use crate::daemon_stub_gpus_credits::credits_back;
use tcpxd_testkit::ScratchDir;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

async fn spread(dir: &ScratchDir, node: &str) -> Daemon {
    spread_per_lane(dir, node, "2").await
}

/// As [`spread`], aiming at `per_lane` chunks a lane (`TCPXD_SPREAD_CHUNKS_PER_LANE`).
async fn spread_per_lane(dir: &ScratchDir, node: &str, per_lane: &str) -> Daemon {
    let log = File::create(dir.join(format!("{node}.log"))).expect("a log file");
    let env = [
        ("RUST_LOG", "warn,tcpxd::hop=trace"),
        ("TCPXD_SPREAD_MIN_CHUNK_BYTES", "131072"),
        ("TCPXD_SPREAD_CHUNKS_PER_LANE", per_lane),
    ];
    start_logged(dir, node, "d2d", 1, true, &env, Stdio::from(log)).await
}

/// The control messages of `kind` a daemon sent, from its trace (`poller.out`): their lines.
fn control_out(log: &Path, kind: &str) -> Vec<String> {
    let text = std::fs::read_to_string(log).expect("the daemon's log");
    let needle = format!("kind=\"{kind}\"");
    text.lines()
        .filter(|l| l.contains("hop=\"poller.out\"") && l.contains(&needle))
        .map(str::to_string)
        .collect()
}

/// The sends of `len` bytes a daemon's lanes posted, from its trace.
fn sends_of(log: &Path, len: u64) -> usize {
    let text = std::fs::read_to_string(log).expect("the daemon's log");
    let needle = format!("hop=\"lane.isend\" len={len} ");
    text.lines().filter(|l| l.contains(&needle)).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_of_few_chunks_go_as_smaller_ones_and_land_whole() {
    let dir = ScratchDir::fresh("tcpxd-stub-spread", "sizes");
    std::fs::create_dir_all(&*dir).unwrap();
    let mut a = spread(&dir, "spread-a").await;
    let mut b = spread(&dir, "spread-b").await;
    let src = cuda_buffer(&mut a.client, 3, 32 * MIB).await;
    let back = cuda_buffer(&mut a.client, 0, 32 * MIB).await;
    let dst = cuda_buffer(&mut b.client, 5, 32 * MIB).await;
    fill_seed(&mut a.client, src.id, 0, 0, 26).await;
    // Pair first, so every transfer below knows the peer's GPU buffers (credits at any size).
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 4096), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    let trip = Trip {
        src: &src,
        dst: &dst,
        back: &back,
    };
    for (k, len) in [MIB, 512 * KIB + 3, 64 * KIB, 16 * MIB].into_iter().enumerate() {
        let at = [k as u64 * 4096 + 5, k as u64 * 8192 + 1, 13];
        let what = "GPU 3 -> GPU 5 -> GPU 0, spread";
        write_and_read_back(&mut a.client, &mut b.client, trip, at, len, Compare::Bytes, what).await;
    }
    // Into and out of host memory: 1 MiB above eager_max goes by rendezvous, spread the same way.
    host_to_and_from_gpus(&mut a.client, &mut b.client, &src, &dst, MIB, Compare::Bytes).await;
    credits_back(&mut a.client).await;
    credits_back(&mut b.client).await;
    let (la, lb) = (dir.join("spread-a.log"), dir.join("spread-b.log"));
    // a sent the WRITEs (1 MiB by credits, then two by rendezvous), b the READs' data.
    assert_eq!(
        sends_of(&la, 256 * KIB),
        4 + 8,
        "a's 1 MiB transfers in 256 KiB chunks"
    );
    assert_eq!(
        sends_of(&lb, 256 * KIB),
        4,
        "b's 1 MiB READ data in 256 KiB chunks"
    );
    for log in [&la, &lb] {
        assert_eq!(
            sends_of(log, 128 * KIB),
            4,
            "{}: 512 KiB + 3 in 128 KiB chunks",
            log.display()
        );
        assert_eq!(sends_of(log, 3), 1, "{}: and its 3 bytes", log.display());
        assert_eq!(sends_of(log, 64 * KIB), 1, "{}: 64 KiB whole", log.display());
        assert_eq!(
            sends_of(log, 512 * KIB),
            32,
            "{}: 16 MiB in 512 KiB chunks",
            log.display()
        );
    }
}

/// Session 32, onemib3 (`transfer.spread_chunks_per_lane`): at four chunks a lane a 1 MiB WRITE
/// or READ by GPU credits goes as eight chunks of 128 KiB (four a credit lane, one on each of a
/// comm's data sockets) and 2 MiB as eight of 256 KiB, while 16 MiB keeps 512 KiB; a lane then
/// owes up to four credits in one transfer. Read from each daemon's trace; bytes compared,
/// every credit back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_chunks_a_lane_cut_one_mib_into_eight_and_land_whole() {
    let dir = ScratchDir::fresh("tcpxd-stub-spread", "per-lane");
    std::fs::create_dir_all(&*dir).unwrap();
    let mut a = spread_per_lane(&dir, "four-a", "4").await;
    let mut b = spread_per_lane(&dir, "four-b", "4").await;
    let src = cuda_buffer(&mut a.client, 3, 32 * MIB).await;
    let back = cuda_buffer(&mut a.client, 0, 32 * MIB).await;
    let dst = cuda_buffer(&mut b.client, 5, 32 * MIB).await;
    fill_seed(&mut a.client, src.id, 0, 0, 32).await;
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 4096), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    let trip = Trip {
        src: &src,
        dst: &dst,
        back: &back,
    };
    let rounds = 4u64;
    for k in 0..rounds {
        let at = [k * MIB + 4096, k * MIB + 8192, k * MIB];
        let what = "1 MiB at four chunks a lane";
        write_and_read_back(&mut a.client, &mut b.client, trip, at, MIB, Compare::Bytes, what).await;
    }
    for len in [2 * MIB, 16 * MIB] {
        let at = [5, 8 * MIB + 1, 13];
        let what = "GPU 3 -> GPU 5 -> GPU 0, four a lane";
        write_and_read_back(&mut a.client, &mut b.client, trip, at, len, Compare::Bytes, what).await;
    }
    credits_back(&mut a.client).await;
    credits_back(&mut b.client).await;
    // a sent the WRITEs, b the READs' data: the same chunks each way.
    for log in [dir.join("four-a.log"), dir.join("four-b.log")] {
        assert_eq!(
            sends_of(&log, 128 * KIB),
            8 * rounds as usize,
            "{}: each 1 MiB in eight 128 KiB chunks",
            log.display()
        );
        assert_eq!(
            sends_of(&log, 256 * KIB),
            8,
            "{}: 2 MiB in eight 256 KiB chunks",
            log.display()
        );
        assert_eq!(
            sends_of(&log, 512 * KIB),
            32,
            "{}: 16 MiB in 512 KiB chunks",
            log.display()
        );
    }
}

/// Issue #38, session 27 (`credits.rs`, "Liveness"): a spread 1 MiB transfer goes as two chunks
/// per credit lane, so its receiver owes two credits a lane; they ride with its `Done`, never in a
/// `Credits` message before it (session 26's rule sent one whenever the consumes fell in separate
/// passes: 123 of 220 WRITEs on the 2-core VM). Both ways: b receives the WRITEs, a the READs'
/// data. Counted from the daemons' traces; bytes compared, every credit back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spread_transfers_return_their_credits_in_their_done() {
    let dir = ScratchDir::fresh("tcpxd-stub-spread", "done-credits");
    std::fs::create_dir_all(&*dir).unwrap();
    let mut a = spread(&dir, "credits-a").await;
    let mut b = spread(&dir, "credits-b").await;
    let src = cuda_buffer(&mut a.client, 3, 32 * MIB).await;
    let back = cuda_buffer(&mut a.client, 0, 32 * MIB).await;
    let dst = cuda_buffer(&mut b.client, 5, 32 * MIB).await;
    fill_seed(&mut a.client, src.id, 0, 0, 27).await;
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 4096), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    let trip = Trip {
        src: &src,
        dst: &dst,
        back: &back,
    };
    let rounds = 8;
    for k in 0..rounds {
        let at = [k * MIB + 4096, k * MIB + 8192, k * MIB];
        let what = "1 MiB spread";
        write_and_read_back(&mut a.client, &mut b.client, trip, at, MIB, Compare::Bytes, what).await;
    }
    credits_back(&mut a.client).await;
    credits_back(&mut b.client).await;
    let (la, lb) = (dir.join("credits-a.log"), dir.join("credits-b.log"));
    assert_eq!(sends_of(&la, 256 * KIB), 4 * rounds as usize, "a's WRITEs spread");
    assert_eq!(
        sends_of(&lb, 256 * KIB),
        4 * rounds as usize,
        "b's READ data spread"
    );
    for (log, what) in [(&lb, "the WRITEs' receiver"), (&la, "the READs' receiver")] {
        assert!(
            control_out(log, "done").len() >= rounds as usize,
            "{what}: a `Done` a transfer, traced"
        );
        let credits = control_out(log, "credits");
        assert!(
            credits.is_empty(),
            "{what}: no `Credits` message, every credit in a `Done`: {credits:#?}"
        );
    }
}

/// Issue #38, session 31 (engine `Action::SendNow`): the receiver of a WRITE puts its `Done` on
/// the wire before it posts the consumed chunks' credit receives again, so the sender's client
/// hears without waiting for the `irecv`s; the `Done` returns those credits all the same (their
/// bounce memory is the plugin's again once consumed, and a send the sender posts on one meets
/// the receive posted just after). Read from b's trace (the WRITEs' receiver): after each
/// `poller.out done`, its `poller.flush` comes before any `lane.irecv`. Spread 1 MiB WRITEs and
/// READs back, bytes compared, every credit back, no `Credits` message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writes_done_goes_on_the_wire_before_its_credit_receives_are_posted_again() {
    let dir = ScratchDir::fresh("tcpxd-stub-spread", "done-first");
    std::fs::create_dir_all(&*dir).unwrap();
    let mut a = spread(&dir, "first-a").await;
    let mut b = spread(&dir, "first-b").await;
    let src = cuda_buffer(&mut a.client, 3, 32 * MIB).await;
    let back = cuda_buffer(&mut a.client, 0, 32 * MIB).await;
    let dst = cuda_buffer(&mut b.client, 5, 32 * MIB).await;
    fill_seed(&mut a.client, src.id, 0, 0, 31).await;
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 4096), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    let trip = Trip {
        src: &src,
        dst: &dst,
        back: &back,
    };
    let rounds = 8;
    for k in 0..rounds {
        let at = [k * MIB + 4096, k * MIB + 12288, k * MIB];
        let what = "1 MiB spread, the Done first";
        write_and_read_back(&mut a.client, &mut b.client, trip, at, MIB, Compare::Bytes, what).await;
    }
    credits_back(&mut a.client).await;
    credits_back(&mut b.client).await;
    let lb = dir.join("first-b.log");
    let text = std::fs::read_to_string(&lb).expect("b's log");
    // A `Done` is behind a re-post when a `lane.irecv` comes between the last consume and it
    // (the chunks consumed in its pass), or between it and its `poller.flush`.
    let (mut first, mut behind) = (0, Vec::new());
    let (mut done, mut reposted): (Option<&str>, Option<&str>) = (None, None);
    for line in text.lines() {
        if line.contains("hop=\"poller.consumed\"") {
            reposted = None;
        } else if line.contains("hop=\"poller.out\"") && line.contains("kind=\"done\"") {
            if let Some(r) = reposted {
                behind.push((r.to_string(), line.to_string()));
            }
            done = done.or(Some(line));
        } else if line.contains("hop=\"poller.flush\"") && done.take().is_some() {
            first += 1;
        } else if line.contains("hop=\"lane.irecv\"") {
            reposted = Some(line);
            if let Some(d) = done.take() {
                behind.push((d.to_string(), line.to_string()));
            }
        }
    }
    assert!(behind.is_empty(), "a `Done` behind a credit receive: {behind:#?}");
    assert!(
        first >= rounds,
        "b's `Done`s, each written before the re-posts: {first}"
    );
    assert!(control_out(&lb, "credits").is_empty(), "every credit in a `Done`");
}

/// A landed chunk's unpack is launched before the rest of its batch of actions (issue #38,
/// session 33, onemib4): after a run of `poller.land`s the GPU stage submits their batch
/// (`stage.submit`) before the credit receives the same batch posts again (`lane.irecv`), so the
/// GPU unpacks while the poller re-posts. Read from both traces (b receives the WRITEs, a the
/// READs back): no `lane.irecv` between a `poller.land` and the next `stage.submit`. Spread 1 MiB
/// WRITEs and READs back, bytes compared, every credit back. (On the stand-in an unpack is done
/// at its launch, so an earlier batch's consume never shares a batch of actions with a landing,
/// as on a GPU: the order holds here before the change too; the next test holds the GPU's work
/// in flight, where it did not.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_landed_chunks_unpack_is_launched_before_the_credit_receives_are_posted_again() {
    let dir = ScratchDir::fresh("tcpxd-stub-spread", "launch-first");
    std::fs::create_dir_all(&*dir).unwrap();
    let mut a = spread(&dir, "launch-a").await;
    let mut b = spread(&dir, "launch-b").await;
    let src = cuda_buffer(&mut a.client, 3, 32 * MIB).await;
    let back = cuda_buffer(&mut a.client, 0, 32 * MIB).await;
    let dst = cuda_buffer(&mut b.client, 5, 32 * MIB).await;
    fill_seed(&mut a.client, src.id, 0, 0, 37).await;
    let trip = Trip {
        src: &src,
        dst: &dst,
        back: &back,
    };
    let rounds = 8;
    for k in 0..rounds {
        let at = [k * MIB + 8192, k * MIB + 4096, k * MIB];
        let what = "1 MiB spread, the unpack launched first";
        write_and_read_back(&mut a.client, &mut b.client, trip, at, MIB, Compare::Bytes, what).await;
    }
    credits_back(&mut a.client).await;
    credits_back(&mut b.client).await;
    for node in ["launch-a", "launch-b"] {
        launched_before_reposts(&dir.join(format!("{node}.log")), rounds as usize);
    }
}

/// From a daemon's trace: no `lane.irecv` between a `poller.land` and the next `stage.submit`,
/// and at least `at_least` runs of landings launched.
fn launched_before_reposts(log: &Path, at_least: usize) {
    let text = std::fs::read_to_string(log).expect("the log");
    let (mut landed, mut submits, mut behind) = (None::<&str>, 0, Vec::new());
    for line in text.lines() {
        if line.contains("hop=\"poller.land\"") {
            landed = landed.or(Some(line));
        } else if line.contains("hop=\"stage.submit\"") {
            if landed.take().is_some() {
                submits += 1;
            }
        } else if line.contains("hop=\"lane.irecv\"")
            && let Some(l) = landed
        {
            behind.push((l.to_string(), line.to_string()));
        }
    }
    let at = log.display();
    assert!(
        behind.is_empty(),
        "{at}: an unpack launched behind a credit receive: {behind:#?}"
    );
    assert!(
        submits >= at_least,
        "{at}: its landings' unpacks, each launched before the re-posts: {submits}"
    );
}

/// As above with the GPU's work held "in flight" 1 ms (`TCPXD_CUDASTUB_EVENT_DELAY_MS`) and
/// eight 1 MiB WRITEs then READs in flight at once: earlier batches' consumes can share a batch
/// of actions with later landings, as on a GPU, and the landings' launch still comes first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_landed_chunks_unpack_is_launched_before_the_reposts_while_others_unpack() {
    let dir = ScratchDir::fresh("tcpxd-stub-spread", "launch-loaded");
    std::fs::create_dir_all(&*dir).unwrap();
    let env = [
        ("RUST_LOG", "warn,tcpxd::hop=trace"),
        ("TCPXD_CUDASTUB_EVENT_DELAY_MS", "1"),
    ];
    let log = |node: &str| Stdio::from(File::create(dir.join(format!("{node}.log"))).expect("a log"));
    let mut a = start_logged(&dir, "loaded-a", "d2d", 1, true, &env, log("loaded-a")).await;
    let mut b = start_logged(&dir, "loaded-b", "d2d", 1, true, &env, log("loaded-b")).await;
    let src = cuda_buffer(&mut a.client, 3, 32 * MIB).await;
    let back = cuda_buffer(&mut a.client, 0, 32 * MIB).await;
    let dst = cuda_buffer(&mut b.client, 5, 32 * MIB).await;
    fill_seed(&mut a.client, src.id, 0, 0, 41).await;
    for k in 0..3 {
        let what = "eight 1 MiB in flight, unpacks held 1 ms";
        let bufs = (&src, &back, &dst);
        eight_writes_then_reads(&mut a.client, &mut b.client, bufs, MIB, k * 4096, 8192, what).await;
    }
    credits_back(&mut a.client).await;
    credits_back(&mut b.client).await;
    for node in ["loaded-a", "loaded-b"] {
        launched_before_reposts(&dir.join(format!("{node}.log")), 3);
    }
}
