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
use tcpxd::api::proto::v1 as pb;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

async fn cuda_buffer(c: &mut Client, size: u64) -> pb::Buffer {
    c.register_buffer(pb::RegisterBufferRequest {
        reattach_id: Default::default(),
        reattach_key: Default::default(),
        source: Some(pb::register_buffer_request::Source::Cuda(pb::CudaAllocation {
            device: 0,
            size,
        })),
        label: String::new(),
    })
    .await
    .expect("CUDA buffer")
    .into_inner()
}

fn kernel_unpacker(args: &mut tcpxd::config::DaemonArgs) {
    let path = std::env::temp_dir().join(format!("tcpxd-gpu-credits-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        "[transfer]\nunpack_impl = \"kernel\"\ngpu_credits = \"on\"\n",
    )
    .unwrap();
    args.config = Some(path);
}

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
    let mut a = daemons::start("gpu-credits-a", kernel_unpacker).await;
    let mut b = daemons::start("gpu-credits-b", kernel_unpacker).await;
    // Buffers before pairing: the pairing tells each side the other's GPU buffers.
    let size = 256 * MIB + 64 * KIB;
    let src = cuda_buffer(&mut a.client, size).await;
    let back = cuda_buffer(&mut a.client, size).await;
    let dst = cuda_buffer(&mut b.client, size).await;
    fill_seed(&mut a.client, src.id, 0, 0, 38).await;
    connect(&mut a, &b).await;
    let sizes = [4 * KIB, 64 * KIB, MIB, 16 * MIB, 256 * MIB];
    for (k, &len) in sizes.iter().enumerate() {
        let (soff, doff) = (k as u64 * 4096 + 7, k as u64 * 8192 + 3);
        let id = write(&mut a.client, write_entry(&src, soff, &dst, doff, len), b"")
            .await
            .unwrap();
        wait_ok(&mut a.client, id).await;
        let want = crc(&mut a.client, src.id, soff, len).await;
        assert_eq!(
            crc(&mut b.client, dst.id, doff, len).await,
            want,
            "WRITE of {len} bytes"
        );
        let id = read(&mut a.client, read_entry(&dst, doff, &back, 5, len))
            .await
            .unwrap();
        wait_ok(&mut a.client, id).await;
        assert_eq!(
            crc(&mut a.client, back.id, 5, len).await,
            want,
            "READ of {len} bytes"
        );
    }
    let (pa, pb_) = (peer(&mut a.client).await, peer(&mut b.client).await);
    assert_eq!((pa.sent_eager, pa.sent_rendezvous), (5, 0), "{pa:?}");
    assert_eq!((pb_.sent_eager, pb_.sent_rendezvous), (5, 0), "{pb_:?}");
    // One large WRITE, one large READ and 64 small WRITEs in flight together.
    let large = write(&mut a.client, write_entry(&src, 0, &dst, 0, 128 * MIB), b"")
        .await
        .unwrap();
    let large_read = read(&mut a.client, read_entry(&dst, 128 * MIB, &back, 0, 64 * MIB))
        .await
        .unwrap();
    let mut small = Vec::new();
    for k in 0..64u64 {
        let at = 200 * MIB + k * 16 * KIB;
        small.push((
            write(&mut a.client, write_entry(&src, at, &dst, at, 4 * KIB), b"")
                .await
                .unwrap(),
            at,
        ));
    }
    for &(id, _) in &small {
        wait_ok(&mut a.client, id).await;
    }
    wait_ok(&mut a.client, large).await;
    wait_ok(&mut a.client, large_read).await;
    assert_eq!(
        crc(&mut a.client, src.id, 0, 128 * MIB).await,
        crc(&mut b.client, dst.id, 0, 128 * MIB).await,
        "the large WRITE"
    );
    assert_eq!(
        crc(&mut b.client, dst.id, 128 * MIB, 64 * MIB).await,
        crc(&mut a.client, back.id, 0, 64 * MIB).await,
        "the large READ"
    );
    for (_, at) in small {
        assert_eq!(
            crc(&mut a.client, src.id, at, 4 * KIB).await,
            crc(&mut b.client, dst.id, at, 4 * KIB).await,
            "a small WRITE at {at}"
        );
    }
    assert_eq!(peer(&mut a.client).await.sent_rendezvous, 0);
    // A coalesced batch of 48 scattered 1 KiB entries (eager): its chunk lands in the bounce
    // pages and the GPU's scatter kernel puts each piece in place.
    let entries: Vec<pb::WriteEntry> = (0..48u64)
        .map(|k| write_entry(&src, MIB + k * 3 * KIB, &dst, 2 * MIB + (47 - k) * 2 * KIB, KIB))
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
        assert_eq!(
            crc(&mut a.client, src.id, s, KIB).await,
            crc(&mut b.client, dst.id, d, KIB).await,
            "batch entry {k}"
        );
    }
    credit_bytes_back(&mut a.client).await;
    credit_bytes_back(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}
