//! Credits on GPU lanes (issue #38) between two `tcpxd` processes on the CUDA stand-in (as
//! `daemon_stub_gpus`: eight "GPUs" over host memory, the emulation in its CUDA mode, the `d2d`
//! unpacker): `transfer.gpu_credits` is on by default on a node with GPUs, so every transfer into
//! a GPU buffer goes by credits at any size — a header, no offer/accept round trip — landing in
//! the bounce pages of the lane's GPU and unpacked into its destination. GetStats counts each
//! transfer's protocol (`sent_eager`, `sent_rendezvous`) and every credit and credit byte comes
//! back after completions, cancels and deadlines.

use crate::common::daemons::{Client, fill_seed, host_buffer, wait, wait_ok, write, write_entry};
use crate::common::gpus::{
    Compare, Trip, assert_same, cuda_buffer, large_and_small_in_flight, scattered_batch, write_and_read_back,
};
use crate::daemon_stub_gpus::{Daemon, start, start_with};
use tcpxd::api::proto::v1 as pb;
use tcpxd_testkit::ScratchDir;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

async fn pair(name: &str) -> (ScratchDir, Daemon, Daemon) {
    let dir = ScratchDir::fresh("tcpxd-gpu-credits", name);
    std::fs::create_dir_all(&*dir).unwrap();
    let a = start(&dir, &format!("{name}-a"), "d2d", 1, true).await;
    let b = start(&dir, &format!("{name}-b"), "d2d", 1, true).await;
    (dir, a, b)
}

/// This node's stats of its one peer.
pub(crate) async fn peer(c: &mut Client) -> pb::PeerStats {
    let s = c.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    assert_eq!(s.peers.len(), 1, "{s:?}");
    s.peers.into_iter().next().unwrap()
}

/// Waits (bounded) until nothing is in flight and every credit and credit byte is back.
pub(crate) async fn credits_back(c: &mut Client) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let s = c.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
        let back = s.active_transfers == 0
            && s.peers.iter().flat_map(|p| &p.lanes).all(|l| {
                l.send_credits == l.send_credit_limit
                    && l.recv_credits == l.recv_credit_limit
                    && l.send_credit_bytes_out == 0
                    && l.sends_in_flight + l.recvs_in_flight + l.sends_queued + l.recvs_queued == 0
            });
        if back {
            let credit_lanes = s
                .peers
                .iter()
                .flat_map(|p| &p.lanes)
                // GetStats lists the lanes in use: a sender's credit lanes are its send lanes.
                .filter(|l| l.recv_credit_limit > 0 || l.send_credit_limit > 0);
            assert!(credit_lanes.count() > 0, "no credit lane: {s:?}");
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "credits never came back: {s:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_to_gpu_writes_and_reads_take_credits_at_every_size() {
    let (_dir, mut a, mut b) = pair("sizes").await;
    let src = cuda_buffer(&mut a.client, 3, 32 * MIB).await;
    let back = cuda_buffer(&mut a.client, 0, 32 * MIB).await;
    let dst = cuda_buffer(&mut b.client, 5, 32 * MIB).await;
    fill_seed(&mut a.client, src.id, 0, 0, 38).await;
    let sizes = [4 * KIB, 64 * KIB, MIB, 16 * MIB];
    let trip = Trip {
        src: &src,
        dst: &dst,
        back: &back,
    };
    for (k, &len) in sizes.iter().enumerate() {
        let at = [k as u64 * 4096 + 7, k as u64 * 8192 + 3, 11];
        let what = "GPU 3 -> GPU 5 -> GPU 0";
        write_and_read_back(&mut a.client, &mut b.client, trip, at, len, Compare::Bytes, what).await;
    }
    // No offer went either way: the writes were a's headers, the reads b's.
    let (pa, pb_) = (peer(&mut a.client).await, peer(&mut b.client).await);
    assert_eq!((pa.sent_eager, pa.sent_rendezvous), (4, 0), "{pa:?}");
    assert_eq!((pb_.sent_eager, pb_.sent_rendezvous), (4, 0), "{pb_:?}");
    assert_eq!((pb_.received_eager, pb_.received_rendezvous), (4, 0), "{pb_:?}");
    credits_back(&mut a.client).await;
    credits_back(&mut b.client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_large_and_many_small_transfers_in_flight_all_complete() {
    let (_dir, mut a, mut b) = pair("mix").await;
    let src = cuda_buffer(&mut a.client, 1, 32 * MIB).await;
    let dst = cuda_buffer(&mut b.client, 2, 32 * MIB).await;
    let back = cuda_buffer(&mut a.client, 4, 32 * MIB).await;
    fill_seed(&mut a.client, src.id, 0, 0, 7).await;
    fill_seed(&mut b.client, dst.id, 24 * MIB, 8 * MIB, 8).await;
    // Pair first (a small transfer), then everything at once.
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 4096), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    let trip = Trip {
        src: &src,
        dst: &dst,
        back: &back,
    };
    let (read, small) = ((24 * MIB, 8 * MIB), (32, 16 * MIB, 8 * KIB));
    large_and_small_in_flight(
        &mut a.client,
        &mut b.client,
        trip,
        16 * MIB,
        read,
        small,
        Compare::Bytes,
    )
    .await;
    let pa = peer(&mut a.client).await;
    assert_eq!((pa.sent_eager, pa.sent_rendezvous), (34, 0), "{pa:?}");
    credits_back(&mut a.client).await;
    credits_back(&mut b.client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_and_deadline_return_every_credit_and_the_lanes_stay_in_step() {
    let (_dir, mut a, mut b) = pair("cancel").await;
    let src = cuda_buffer(&mut a.client, 2, 64 * MIB).await;
    let dst = cuda_buffer(&mut b.client, 6, 64 * MIB).await;
    fill_seed(&mut a.client, src.id, 0, 0, 9).await;
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 4096), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    // Cancelled at once: whatever was announced goes out empty.
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, 64 * MIB), b"")
        .await
        .unwrap();
    a.client
        .cancel(pb::CancelRequest { transfer_id: id })
        .await
        .unwrap();
    let e = wait(&mut a.client, id).await;
    assert!(
        [tonic::Code::Cancelled as i32, 0].contains(&e.status_code),
        "{}",
        e.status_message
    );
    credits_back(&mut a.client).await;
    credits_back(&mut b.client).await;
    // A deadline too short for 64 MiB.
    let req = pb::WriteRequest {
        entry: Some(write_entry(&src, 0, &dst, 0, 64 * MIB)),
        timeout_ms: 1,
        ..Default::default()
    };
    let id = a.client.write(req).await.unwrap().into_inner().transfer_id;
    let e = wait(&mut a.client, id).await;
    assert!(
        [tonic::Code::DeadlineExceeded as i32, 0].contains(&e.status_code),
        "{}",
        e.status_message
    );
    credits_back(&mut a.client).await;
    credits_back(&mut b.client).await;
    // The lanes are in step: the next transfer is byte-exact, by credits.
    let id = write(&mut a.client, write_entry(&src, 5, &dst, 9, 3 * MIB + 1), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    assert_same(
        &mut a.client,
        (src.id, 5),
        &mut b.client,
        (dst.id, 9),
        3 * MIB + 1,
        "after",
    )
    .await;
    let pa = peer(&mut a.client).await;
    assert_eq!(pa.sent_rendezvous, 0, "{pa:?}");
}

/// What else lands through GPU credit receives: small transfers into host memory (copied out of
/// the GPU's bounce pages), WRITE and READ, and a coalesced batch of small entries into host
/// memory (scattered from the bounce pages). (A batch from or into GPU memory gathers or scatters
/// with the GPU's block kernels, which the stand-in cannot run: `daemon_gpu_credits::` on a GPU.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_destinations_and_coalesced_batches_through_gpu_credit_receives() {
    let (_dir, mut a, mut b) = pair("batches").await;
    let src = cuda_buffer(&mut a.client, 7, 4 * MIB).await;
    let host_dst = host_buffer(&mut b.client, 4 * MIB, "").await;
    let host_back = host_buffer(&mut a.client, 4 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 21).await;
    // Small WRITE and READ into host memory: eager, through the GPU landing.
    let trip = Trip {
        src: &src,
        dst: &host_dst,
        back: &host_back,
    };
    for len in [1, 4 * KIB + 1, 64 * KIB] {
        let what = "GPU -> host -> host";
        write_and_read_back(
            &mut a.client,
            &mut b.client,
            trip,
            [13, 5, 9],
            len,
            Compare::Bytes,
            what,
        )
        .await;
    }
    // A coalesced batch of 48 scattered 1 KiB entries (48 KiB: eager) into host memory.
    let src = host_buffer(&mut a.client, 4 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 22).await;
    scattered_batch(&mut a.client, &mut b.client, &src, &host_dst, Compare::Bytes).await;
    credits_back(&mut a.client).await;
    credits_back(&mut b.client).await;
}

/// Lanes closed when idle (`peer.lane_idle_close_ms`) and opened again: each reopened credit lane
/// makes its GPU landing again, and the next transfers go by credits, byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credit_lanes_closed_when_idle_land_in_gpu_memory_again_when_reopened() {
    let dir = ScratchDir::fresh("tcpxd-gpu-credits", "idle");
    std::fs::create_dir_all(&*dir).unwrap();
    let idle = [("TCPXD_LANE_IDLE_CLOSE_MS", "200")];
    let mut a = start_with(&dir, "idle-a", "d2d", 1, true, &idle).await;
    let mut b = start_with(&dir, "idle-b", "d2d", 1, true, &idle).await;
    let src = cuda_buffer(&mut a.client, 3, 8 * MIB).await;
    let dst = cuda_buffer(&mut b.client, 4, 8 * MIB).await;
    fill_seed(&mut a.client, src.id, 0, 0, 31).await;
    for round in 0..3u64 {
        for len in [4 * KIB, 3 * MIB] {
            let at = round * 4096 + len / 8;
            let id = write(&mut a.client, write_entry(&src, at, &dst, at + 1, len), b"")
                .await
                .unwrap();
            wait_ok(&mut a.client, id).await;
            let what = format!("round {round}: WRITE of {len} bytes");
            assert_same(
                &mut a.client,
                (src.id, at),
                &mut b.client,
                (dst.id, at + 1),
                len,
                &what,
            )
            .await;
        }
        // Every lane closes (both sides idle), then the next round opens them again.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let s = a
                .client
                .get_stats(pb::GetStatsRequest {})
                .await
                .unwrap()
                .into_inner();
            let lanes: Vec<&pb::LaneStats> = s.peers.iter().flat_map(|p| &p.lanes).collect();
            if !lanes.is_empty() && lanes.iter().all(|l| l.send_state == "closed") {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "lanes never closed: {lanes:?}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
    let pa = peer(&mut a.client).await;
    assert_eq!((pa.sent_eager, pa.sent_rendezvous), (6, 0), "{pa:?}");
}

/// Eight transfers in flight between two GPUs at each of 4 KiB, 64 KiB and 1 MiB (the pattern of
/// `tcpxctl bench transfer --concurrency 8`) on the stand-in's eight GPUs, whose routed pairing
/// has hundreds of lanes: all by credits, byte-exact, every credit back, and bytes only on the
/// memory pair's eager lanes (the passes walk the lanes in use: `engine::lane_use`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_in_flight_between_two_gpus_land_by_credits_and_return_every_credit() {
    let (_dir, mut a, mut b) = pair("inflight").await;
    let src = cuda_buffer(&mut a.client, 1, 16 * MIB).await;
    let dst = cuda_buffer(&mut b.client, 6, 16 * MIB).await;
    fill_seed(&mut a.client, src.id, 0, 0, 23).await;
    let mut sent = 0;
    for len in [4 * KIB, 64 * KIB, MIB] {
        // All eight started before any is waited for.
        let mut ids = Vec::new();
        for k in 0..8u64 {
            let at = k * (2 * MIB) + len / 3;
            let id = write(&mut a.client, write_entry(&src, at, &dst, at + 5, len), b"")
                .await
                .unwrap();
            ids.push((id, at));
        }
        for (id, at) in ids {
            wait_ok(&mut a.client, id).await;
            let what = format!("{len} bytes at {at}, 8 in flight");
            assert_same(
                &mut a.client,
                (src.id, at),
                &mut b.client,
                (dst.id, at + 5),
                len,
                &what,
            )
            .await;
        }
        sent += 8;
    }
    let pa = peer(&mut a.client).await;
    assert_eq!((pa.sent_eager, pa.sent_rendezvous), (sent, 0), "{pa:?}");
    let used: Vec<&pb::LaneStats> = pa.lanes.iter().filter(|l| l.bytes_sent > 0).collect();
    assert!(!used.is_empty() && used.len() <= 2, "{used:?}");
    for l in &used {
        assert_eq!(
            (l.send_kind.as_str(), l.send_memory.as_str()),
            ("eager", "gpu1>gpu6"),
            "{l:?}"
        );
    }
    assert!(
        pa.send_lanes > 100,
        "the stand-in's routed pairing has hundreds of lanes: {}",
        pa.send_lanes
    );
    credits_back(&mut a.client).await;
    credits_back(&mut b.client).await;
}
