//! Credits on GPU lanes on a real GPU (issue #38): two daemons on GPU 0 over the built-in
//! emulation in CUDA mode with the kernel unpacker. Every transfer into a GPU buffer goes by
//! credits at any size (no offer/accept round trip: `sent_rendezvous` stays 0), its chunks
//! unpacked by the kernel from the bounce pages of the lane's GPU; a large transfer and many small
//! ones in flight together all complete; a coalesced batch is scattered from the bounce pages by
//! the GPU's scatter kernel; every credit and credit byte comes back. Needs a CUDA
//! GPU (one is enough): `cargo nextest run --release -p tcpxd --test suite --run-ignored only
//! daemon_gpu_credits::` (or `cargo test --release -p tcpxd --test suite -- --ignored
//! daemon_gpu_credits::`).

use crate::common::daemons::{self, *};
use crate::common::gpus::{
    Compare, Trip, cuda_buffer, large_and_small_in_flight, scattered_batch, with_config, write_and_read_back,
};
use tcpxd::api::proto::v1 as pb;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// GPU inline off: these transfers follow the credits (GPU memory inline is `daemon_inline`'s).
const CONFIG: &str = "[transfer]\nunpack_impl = \"kernel\"\ngpu_credits = \"on\"\ninline_gpu = \"off\"\n";

async fn peer(c: &mut Client) -> pb::PeerStats {
    let s = c.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    s.peers.into_iter().next().expect("one peer")
}

async fn credit_bytes_back(c: &mut Client) {
    assert_lanes_drain(c).await;
    let s = c.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    let lanes: Vec<&pb::LaneStats> = s.peers.iter().flat_map(|p| &p.lanes).collect();
    assert!(lanes.iter().all(|l| l.send_credit_bytes_out == 0), "{lanes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU: cargo nextest run --release -p tcpxd --test suite --run-ignored only daemon_gpu_credits::"]
async fn gpu_credits_kernel_unpacker_4k_to_256m_write_read_mix() {
    tcpxd::logging::init("warn");
    let mut a = daemons::start("gpu-credits-a", with_config("gpu-credits-a", CONFIG)).await;
    let mut b = daemons::start("gpu-credits-b", with_config("gpu-credits-b", CONFIG)).await;
    // Buffers before pairing: the pairing tells each side the other's GPU buffers.
    let size = 256 * MIB + 64 * KIB;
    let src = cuda_buffer(&mut a.client, 0, size).await;
    let back = cuda_buffer(&mut a.client, 0, size).await;
    let dst = cuda_buffer(&mut b.client, 0, size).await;
    fill_seed(&mut a.client, src.id, 0, 0, 38).await;
    connect(&mut a, &b).await;
    let sizes = [4 * KIB, 64 * KIB, MIB, 16 * MIB, 256 * MIB];
    let trip = Trip {
        src: &src,
        dst: &dst,
        back: &back,
    };
    for (k, &len) in sizes.iter().enumerate() {
        let at = [k as u64 * 4096 + 7, k as u64 * 8192 + 3, 5];
        let what = "GPU 0 -> GPU 0";
        write_and_read_back(&mut a.client, &mut b.client, trip, at, len, Compare::Crc, what).await;
    }
    let (pa, pb_) = (peer(&mut a.client).await, peer(&mut b.client).await);
    assert_eq!((pa.sent_eager, pa.sent_rendezvous), (5, 0), "{pa:?}");
    assert_eq!((pb_.sent_eager, pb_.sent_rendezvous), (5, 0), "{pb_:?}");
    // One large WRITE, one large READ and 64 small WRITEs in flight together.
    let (read, small) = ((128 * MIB, 64 * MIB), (64, 200 * MIB, 16 * KIB));
    large_and_small_in_flight(
        &mut a.client,
        &mut b.client,
        trip,
        128 * MIB,
        read,
        small,
        Compare::Crc,
    )
    .await;
    assert_eq!(peer(&mut a.client).await.sent_rendezvous, 0);
    // A coalesced batch of 48 scattered 1 KiB entries (eager): its chunk lands in the bounce
    // pages and the GPU's scatter kernel puts each piece in place.
    scattered_batch(&mut a.client, &mut b.client, &src, &dst, Compare::Crc).await;
    credit_bytes_back(&mut a.client).await;
    credit_bytes_back(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}
