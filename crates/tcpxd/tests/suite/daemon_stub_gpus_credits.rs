//! Credits on GPU lanes (issue #38) between two `tcpxd` processes on the CUDA stand-in (as
//! `daemon_stub_gpus`: eight "GPUs" over host memory, the emulation in its CUDA mode, the `d2d`
//! unpacker): `transfer.gpu_credits` is on by default on a node with GPUs, so every transfer into
//! a GPU buffer goes by credits at any size — a header, no offer/accept round trip — landing in
//! the bounce pages of the lane's GPU and unpacked into its destination. GetStats counts each
//! transfer's protocol (`sent_eager`, `sent_rendezvous`) and every credit and credit byte comes
//! back after completions, cancels and deadlines.

use crate::common::daemons::{Client, fill_seed, read, read_entry, wait, wait_ok, write, write_entry};
use crate::daemon_stub_gpus::{Daemon, assert_same, cuda_buffer, start, start_with};
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
async fn peer(c: &mut Client) -> pb::PeerStats {
    let s = c.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    assert_eq!(s.peers.len(), 1, "{s:?}");
    s.peers.into_iter().next().unwrap()
}

/// Waits (bounded) until nothing is in flight and every credit and credit byte is back.
async fn credits_back(c: &mut Client) {
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
    for (k, &len) in sizes.iter().enumerate() {
        let (soff, doff) = (k as u64 * 4096 + 7, k as u64 * 8192 + 3);
        let id = write(&mut a.client, write_entry(&src, soff, &dst, doff, len), b"")
            .await
            .unwrap();
        wait_ok(&mut a.client, id).await;
        let what = format!("WRITE GPU 3 -> GPU 5 of {len} bytes");
        assert_same(
            &mut a.client,
            (src.id, soff),
            &mut b.client,
            (dst.id, doff),
            len,
            &what,
        )
        .await;
        let id = read(&mut a.client, read_entry(&dst, doff, &back, 11, len))
            .await
            .unwrap();
        wait_ok(&mut a.client, id).await;
        let what = format!("READ GPU 5 -> GPU 0 of {len} bytes");
        assert_same(
            &mut b.client,
            (dst.id, doff),
            &mut a.client,
            (back.id, 11),
            len,
            &what,
        )
        .await;
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
    let large = write(&mut a.client, write_entry(&src, 0, &dst, 0, 16 * MIB), b"")
        .await
        .unwrap();
    let large_read = read(&mut a.client, read_entry(&dst, 24 * MIB, &back, 0, 8 * MIB))
        .await
        .unwrap();
    let mut small = Vec::new();
    for k in 0..32u64 {
        let at = 16 * MIB + k * 8 * KIB;
        let id = write(&mut a.client, write_entry(&src, at, &dst, at, 4 * KIB), b"")
            .await
            .unwrap();
        small.push((id, at));
    }
    for &(id, _) in &small {
        wait_ok(&mut a.client, id).await;
    }
    wait_ok(&mut a.client, large).await;
    wait_ok(&mut a.client, large_read).await;
    assert_same(
        &mut a.client,
        (src.id, 0),
        &mut b.client,
        (dst.id, 0),
        16 * MIB,
        "the large WRITE",
    )
    .await;
    assert_same(
        &mut b.client,
        (dst.id, 24 * MIB),
        &mut a.client,
        (back.id, 0),
        8 * MIB,
        "the large READ",
    )
    .await;
    for (_, at) in small {
        assert_same(
            &mut a.client,
            (src.id, at),
            &mut b.client,
            (dst.id, at),
            4 * KIB,
            "a small WRITE",
        )
        .await;
    }
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
    let host_dst = crate::common::daemons::host_buffer(&mut b.client, 4 * MIB, "").await;
    let host_back = crate::common::daemons::host_buffer(&mut a.client, 4 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 21).await;
    // Small WRITE and READ into host memory: eager, through the GPU landing.
    for len in [1, 4 * KIB + 1, 64 * KIB] {
        let id = write(&mut a.client, write_entry(&src, 13, &host_dst, 5, len), b"")
            .await
            .unwrap();
        wait_ok(&mut a.client, id).await;
        let what = format!("WRITE GPU -> host of {len} bytes");
        assert_same(
            &mut a.client,
            (src.id, 13),
            &mut b.client,
            (host_dst.id, 5),
            len,
            &what,
        )
        .await;
        let id = read(&mut a.client, read_entry(&host_dst, 5, &host_back, 9, len))
            .await
            .unwrap();
        wait_ok(&mut a.client, id).await;
        let what = format!("READ host -> host of {len} bytes");
        assert_same(
            &mut b.client,
            (host_dst.id, 5),
            &mut a.client,
            (host_back.id, 9),
            len,
            &what,
        )
        .await;
    }
    // A coalesced batch of 48 scattered 1 KiB entries (48 KiB: eager) into host memory.
    let src = crate::common::daemons::host_buffer(&mut a.client, 4 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 22).await;
    for dst in [&host_dst] {
        let entries: Vec<pb::WriteEntry> = (0..48u64)
            .map(|k| write_entry(&src, MIB + k * 3 * KIB, dst, 2 * MIB + (47 - k) * 2 * KIB, KIB))
            .collect();
        let id = a
            .client
            .write_batch(pb::WriteBatchRequest {
                entries,
                timeout_ms: 60_000,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner()
            .transfer_id;
        wait_ok(&mut a.client, id).await;
        for k in 0..48u64 {
            let (s, d) = (MIB + k * 3 * KIB, 2 * MIB + (47 - k) * 2 * KIB);
            assert_same(
                &mut a.client,
                (src.id, s),
                &mut b.client,
                (dst.id, d),
                KIB,
                "a batch entry",
            )
            .await;
        }
    }
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
