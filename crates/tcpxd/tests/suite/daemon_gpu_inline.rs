//! GPU memory inline with its device copies off the pollers (poller `inline_copies.rs`) on a real
//! GPU: two daemons, GPU inline on with eight GPU transfers in flight per pairing, eight 64 KiB
//! GPU → GPU WRITEs then eight READs back in flight at once, every one inline (GetStats), every
//! byte compared. Needs a CUDA GPU (two daemons on GPU 0; a second GPU is used when present):
//! `cargo test --release -p tcpxd --test suite -- --ignored --test-threads=1 daemon_gpu_inline::`.

use crate::common::daemons::{self, *};
use crate::common::gpus::{assert_same, cuda_buffer, with_config};
use tcpxd::api::proto::v1 as pb;

const KIB: u64 = 1 << 10;

const CONFIG: &str =
    "[transfer]\ninline_gpu = \"on\"\ninline_gpu_in_flight = 8\ninline_window_bytes = 1048576\n";

/// This node's stats of its one peer.
async fn peer_stats(c: &mut Client) -> pb::PeerStats {
    let s = c
        .get_stats(pb::GetStatsRequest {})
        .await
        .expect("stats")
        .into_inner();
    assert_eq!(s.peers.len(), 1, "{s:?}");
    s.peers.into_iter().next().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU: cargo test --release -p tcpxd --test suite -- --ignored daemon_gpu_inline::"]
async fn gpu_inline_eight_64k_writes_and_reads_in_flight_byte_exact() {
    tcpxd::logging::init("warn");
    let mut a = daemons::start("gpu-inline-a", with_config("gpu-inline-a", CONFIG)).await;
    let mut b = daemons::start("gpu-inline-b", with_config("gpu-inline-b", CONFIG)).await;
    connect(&mut a, &b).await;
    let gpus = a
        .client
        .describe_node(pb::DescribeNodeRequest {})
        .await
        .expect("describe")
        .into_inner()
        .gpus
        .len();
    let peer_gpu = u32::from(gpus > 1);
    let len = 64 * KIB;
    let span = 8 * 2 * len;
    let src = cuda_buffer(&mut a.client, 0, span).await;
    let back = cuda_buffer(&mut a.client, 0, span).await;
    let dst = cuda_buffer(&mut b.client, peer_gpu, span + 4096).await;
    for round in 0..4u64 {
        fill_seed(&mut a.client, src.id, 0, 0, 300 + round).await;
        let mut writes = Vec::new();
        for k in 0..8u64 {
            let at = k * 2 * len + round * 3;
            let id = write(&mut a.client, write_entry(&src, at, &dst, at + 1000, len), b"")
                .await
                .unwrap();
            writes.push((id, at));
        }
        for &(id, _) in &writes {
            wait_ok(&mut a.client, id).await;
        }
        let mut reads = Vec::new();
        for &(_, at) in &writes {
            reads.push(
                read(&mut a.client, read_entry(&dst, at + 1000, &back, at, len))
                    .await
                    .unwrap(),
            );
        }
        for id in reads {
            wait_ok(&mut a.client, id).await;
        }
        for &(_, at) in &writes {
            let what = format!("round {round}: 64 KiB at {at}, 8 in flight");
            assert_same(
                &mut a.client,
                (src.id, at),
                &mut b.client,
                (dst.id, at + 1000),
                len,
                &what,
            )
            .await;
            let mut again = a.client.clone();
            assert_same(&mut a.client, (src.id, at), &mut again, (back.id, at), len, &what).await;
        }
    }
    let s = peer_stats(&mut a.client).await;
    assert_eq!(
        (s.sent_inline, s.received_inline),
        (32, 32),
        "every transfer inline: {s:?}"
    );
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}
