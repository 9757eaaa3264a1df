//! GPU memory inline with its device copies off the pollers (poller `inline_copies.rs`) on a real
//! GPU: two daemons, GPU inline on with eight GPU transfers in flight per pairing, eight 64 KiB
//! GPU → GPU WRITEs then eight READs back in flight at once, every one inline (GetStats), every
//! byte compared. Needs a CUDA GPU (two daemons on GPU 0; a second GPU is used when present):
//! `cargo test --release -p tcpxd --test suite -- --ignored --test-threads=1 daemon_gpu_inline::`.

use crate::common::daemons::{self, *};
use crate::common::gpus::{cuda_buffer, eight_writes_then_reads, with_config};
use crate::common::peer_stats::only_peer;
use tcpxd::api::proto::v1 as pb;

const KIB: u64 = 1 << 10;

const CONFIG: &str =
    "[transfer]\ninline_gpu = \"on\"\ninline_gpu_in_flight = 8\ninline_window_bytes = 1048576\n";

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
        let bufs = (&src, &back, &dst);
        let what = format!("round {round}");
        eight_writes_then_reads(&mut a.client, &mut b.client, bufs, len, round * 3, 1000, &what).await;
    }
    let s = only_peer(&mut a.client).await;
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
