//! Inline GPU copies off the poller (poller `inline_copies.rs`, engine `inline.rs`) on the CUDA
//! stand-in (two daemon processes, `daemon_stub_gpus`): eight GPU → GPU WRITEs and READs in
//! flight all inline and byte-exact; a cancel while the source's copy runs ends the WRITE once,
//! sends nothing and gives the window back when the copy ends; a destination released, or the
//! peer lost, while its landing copy runs waits for the copy. The stand-in's copies are done at
//! once; `TCPXD_CUDASTUB_EVENT_DELAY_MS` holds their events "not ready" that long, so the
//! daemon's copies stay in flight while the test acts.

use crate::common::peer_stats::{lane_bytes_total, only_peer};
use std::time::{Duration, Instant};

use crate::common::daemons::{Client, bytes, fill_seed, wait, wait_ok, write, write_entry};
use crate::common::gpus::{assert_same, cuda_buffer, eight_writes_then_reads};
use crate::daemon_stub_gpus::{Daemon, start_with};
use tcpxd::api::proto::v1 as pb;

const KIB: u64 = 1 << 10;

/// A pair of daemons on the stand-in with GPU inline on, eight GPU transfers and 1 MiB inline
/// per pairing; `delay_ms` for each one's copies' events.
async fn pair(name: &str, delay_ms: [u64; 2], window: u64) -> (Daemon, Daemon) {
    pair_windows(name, delay_ms, [window; 2]).await
}

/// [`pair`] with each daemon's own inline window (its staging is that, at least 64 KiB).
async fn pair_windows(name: &str, delay_ms: [u64; 2], windows: [u64; 2]) -> (Daemon, Daemon) {
    pair_env(name, delay_ms, windows, &[]).await
}

/// [`pair_windows`] with more of the daemons' environment (the stand-in's knobs).
async fn pair_env(
    name: &str,
    delay_ms: [u64; 2],
    windows: [u64; 2],
    more: &[(&str, &str)],
) -> (Daemon, Daemon) {
    let dir = tcpxd_testkit::ScratchDir::fresh("tcpxd-inline-copies", name);
    std::fs::create_dir_all(&*dir).unwrap();
    let mut out = Vec::new();
    for ((side, delay), window) in ["a", "b"].into_iter().zip(delay_ms).zip(windows) {
        let delay = delay.to_string();
        let window = window.to_string();
        let env = [
            ("TCPXD_INLINE_GPU", "on"),
            ("TCPXD_INLINE_GPU_IN_FLIGHT", "8"),
            ("TCPXD_INLINE_WINDOW_BYTES", window.as_str()),
            ("TCPXD_CUDASTUB_EVENT_DELAY_MS", delay.as_str()),
        ];
        let env: Vec<(&str, &str)> = env.into_iter().chain(more.iter().copied()).collect();
        out.push(start_with(&dir, &format!("{name}-{side}"), "d2d", 1, true, &env).await);
    }
    let b = out.pop().unwrap();
    (out.pop().unwrap(), b)
}

/// Waits (generously) until `c`'s peer has received `n` inline transfers: the last one's
/// landing copy is then under way (its events held by the stand-in's delay).
async fn until_received_inline(c: &mut Client, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = c
            .get_stats(pb::GetStatsRequest {})
            .await
            .expect("stats")
            .into_inner();
        if s.peers.first().is_some_and(|p| p.received_inline >= n) {
            return;
        }
        assert!(Instant::now() < deadline, "no inline transfer arrived: {s:?}");
        tokio::task::yield_now().await;
    }
}

async fn release(c: &mut Client, id: u64) {
    c.release_buffer(pb::ReleaseBufferRequest { buffer_id: id })
        .await
        .expect("release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_gpu_writes_and_reads_in_flight_all_go_inline_byte_exact() {
    let (mut a, mut b) = pair("eight", [20, 20], 1 << 20).await;
    let len = 16 * KIB;
    let src = cuda_buffer(&mut a.client, 2, 8 * 2 * len).await;
    let back = cuda_buffer(&mut a.client, 1, 8 * 2 * len).await;
    let dst = cuda_buffer(&mut b.client, 4, 8 * 2 * len + 64).await;
    for round in 0..2u64 {
        fill_seed(&mut a.client, src.id, 0, 0, 90 + round).await;
        let bufs = (&src, &back, &dst);
        let what = format!("round {round}");
        eight_writes_then_reads(&mut a.client, &mut b.client, bufs, len, round, 5, &what).await;
    }
    let s = only_peer(&mut a.client).await;
    let r = only_peer(&mut b.client).await;
    // Eight GPU transfers fit both the GPU bound and the window: every one went inline.
    assert_eq!((s.sent_inline, s.received_inline), (16, 16), "{s:?}");
    assert_eq!((r.sent_inline, r.received_inline), (16, 16), "{r:?}");
    assert_eq!(lane_bytes_total(&s), 0, "no lane carried a byte: {s:?}");
}

/// A GPU whose streams for the inline copies cannot be made (the stand-in's
/// `TCPXD_CUDASTUB_MAX_STREAMS`: the copier's pool of four fails, while the one stream of a
/// synchronous copy is still made): the failure is remembered for the GPU (logged once) and its
/// inline transfers copy synchronously, still inline and byte-exact. Before, each GPU inline
/// transfer tried to make the pool again and failed with its error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_inline_transfers_copy_synchronously_where_the_copy_streams_cannot_be_made() {
    // Two streams a GPU: a lane's unpack stage's and a synchronous copy's; the pool needs four.
    let more = [("TCPXD_CUDASTUB_MAX_STREAMS", "2")];
    let (mut a, mut b) = pair_env("no-streams", [0, 0], [1 << 20; 2], &more).await;
    let len = 16 * KIB;
    let src = cuda_buffer(&mut a.client, 2, 8 * 2 * len).await;
    let back = cuda_buffer(&mut a.client, 1, 8 * 2 * len).await;
    let dst = cuda_buffer(&mut b.client, 4, 8 * 2 * len + 64).await;
    for round in 0..2u64 {
        fill_seed(&mut a.client, src.id, 0, 0, 70 + round).await;
        let bufs = (&src, &back, &dst);
        let what = format!("round {round}");
        eight_writes_then_reads(&mut a.client, &mut b.client, bufs, len, round, 5, &what).await;
    }
    let s = only_peer(&mut a.client).await;
    let r = only_peer(&mut b.client).await;
    assert_eq!((s.sent_inline, s.received_inline), (16, 16), "{s:?}");
    assert_eq!((r.sent_inline, r.received_inline), (16, 16), "{r:?}");
    assert_eq!(lane_bytes_total(&s), 0, "no lane carried a byte: {s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_while_the_source_copy_runs_sends_nothing_and_the_window_comes_back() {
    // A window of one 4 KiB transfer: the next goes inline only once the first gave it back.
    let (mut a, mut b) = pair("cancel", [1000, 0], 4096).await;
    let len = 4 * KIB;
    let src = cuda_buffer(&mut a.client, 2, len).await;
    let other = cuda_buffer(&mut a.client, 3, len).await;
    let dst = cuda_buffer(&mut b.client, 4, 2 * len).await;
    fill_seed(&mut a.client, src.id, 0, 0, 7).await;
    fill_seed(&mut a.client, other.id, 0, 0, 8).await;
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, len), b"")
        .await
        .unwrap();
    let c = a
        .client
        .cancel(pb::CancelRequest { transfer_id: id })
        .await
        .expect("cancel")
        .into_inner();
    assert!(c.cancelled, "the copy takes a second: the WRITE still runs");
    let e = wait(&mut a.client, id).await;
    assert_eq!(e.status_code, tonic::Code::Cancelled as i32, "{e:?}");
    // The source's release waits for its copy; then the window is back too.
    release(&mut a.client, src.id).await;
    let id = write(&mut a.client, write_entry(&other, 0, &dst, len, len), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    assert_same(
        &mut a.client,
        (other.id, 0),
        &mut b.client,
        (dst.id, len),
        len,
        "after the cancel",
    )
    .await;
    assert_eq!(
        bytes(&mut b.client, dst.id, 0, len).await,
        vec![0u8; len as usize],
        "nothing of the cancelled WRITE landed"
    );
    let s = only_peer(&mut a.client).await;
    let r = only_peer(&mut b.client).await;
    assert_eq!(s.sent_inline, 2, "both went inline (the window came back): {s:?}");
    assert_eq!(r.received_inline, 1, "the cancelled one was never sent: {r:?}");
    assert_eq!(lane_bytes_total(&s), 0, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_released_or_the_peer_lost_while_its_copy_runs_waits_for_it() {
    for lost in [false, true] {
        let name = if lost { "lost" } else { "release" };
        let (mut a, mut b) = pair(name, [0, 1000], 1 << 20).await;
        let len = 16 * KIB;
        let src = cuda_buffer(&mut a.client, 2, len).await;
        let dst = cuda_buffer(&mut b.client, 4, len).await;
        fill_seed(&mut a.client, src.id, 0, 0, 11).await;
        let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, len), b"")
            .await
            .unwrap();
        until_received_inline(&mut b.client, 1).await;
        if lost {
            drop(a);
            // b's landing copy still runs: the release waits for it, b stays up.
            release(&mut b.client, dst.id).await;
            b.client
                .describe_node(pb::DescribeNodeRequest {})
                .await
                .expect("b serves after losing its peer mid-copy");
        } else {
            let mut other = b.client.clone();
            let released = tokio::spawn(async move { release(&mut other, dst.id).await });
            wait_ok(&mut a.client, id).await;
            released.await.unwrap();
            let s = only_peer(&mut a.client).await;
            assert_eq!((s.sent_inline, lane_bytes_total(&s)), (1, 0), "{s:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn landings_past_the_receivers_staging_copy_synchronously_byte_exact() {
    // a may send eight 16 KiB inline at once; b's staging (its 4 KiB window, at least 64 KiB)
    // holds four landings, held in flight by the delay: the others land synchronously.
    let (mut a, mut b) = pair_windows("full", [0, 300], [1 << 20, 4096]).await;
    let len = 16 * KIB;
    let src = cuda_buffer(&mut a.client, 2, 8 * len).await;
    let dst = cuda_buffer(&mut b.client, 4, 8 * len).await;
    fill_seed(&mut a.client, src.id, 0, 0, 21).await;
    let mut ids = Vec::new();
    for k in 0..8u64 {
        ids.push(
            write(&mut a.client, write_entry(&src, k * len, &dst, k * len, len), b"")
                .await
                .unwrap(),
        );
    }
    for id in ids {
        wait_ok(&mut a.client, id).await;
    }
    assert_same(
        &mut a.client,
        (src.id, 0),
        &mut b.client,
        (dst.id, 0),
        8 * len,
        "staging full",
    )
    .await;
    let r = only_peer(&mut b.client).await;
    assert_eq!(r.received_inline, 8, "{r:?}");
    release(&mut b.client, dst.id).await;
}
