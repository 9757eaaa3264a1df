//! WRITE and READ between two daemons on one GPU, over the built-in emulation in CUDA mode:
//! received bytes land scattered in a GPU bounce buffer and the daemon's unpacker gathers them.
//! Needs a CUDA GPU: `cargo test --release -p tcpxd --test suite -- --ignored daemon_gpu::`.

use crate::common::daemons::{self, *};
use crate::common::gpus::{
    Compare, Trip, assert_equal, cuda_buffer, host_to_and_from_gpus, with_config, write_and_read_back,
};
use tcpxd::api::proto::v1 as pb;

const MIB: u64 = 1 << 20;

async fn gpu_to_gpu(unpacker: &'static str, sizes: &[u64]) {
    tcpxd::logging::init("warn");
    let config = format!("[transfer]\nunpack_impl = \"{unpacker}\"\n");
    let mut a = daemons::start(
        &format!("gpu-a-{unpacker}"),
        with_config(&format!("gpu-{unpacker}-a"), &config),
    )
    .await;
    let mut b = daemons::start(
        &format!("gpu-b-{unpacker}"),
        with_config(&format!("gpu-{unpacker}-b"), &config),
    )
    .await;
    connect(&mut a, &b).await;
    let max = *sizes.iter().max().unwrap() + 8192;
    let src = cuda_buffer(&mut a.client, 0, max).await;
    let dst = cuda_buffer(&mut b.client, 0, max).await;
    let back = cuda_buffer(&mut a.client, 0, max).await;
    assert_eq!(src.kind, pb::BufferKind::Cuda as i32);
    assert_eq!(src.cuda_ipc_handle.len(), 64);
    fill_seed(&mut a.client, src.id, 0, 0, 77).await;
    let trip = Trip {
        src: &src,
        dst: &dst,
        back: &back,
    };
    for (k, &len) in sizes.iter().enumerate() {
        let at = [k as u64 * 7, 4096 + k as u64 * 3, 0];
        write_and_read_back(
            &mut a.client,
            &mut b.client,
            trip,
            at,
            len,
            Compare::Crc,
            unpacker,
        )
        .await;
    }
    // Host to GPU and GPU to host on the same pairing.
    host_to_and_from_gpus(&mut a.client, &mut b.client, &src, &dst, 8 * MIB, Compare::Crc).await;
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU: cargo test --release -p tcpxd --test suite -- --ignored daemon_gpu::"]
async fn gpu_write_read_kernel_unpacker_1_byte_to_1_gib() {
    gpu_to_gpu("kernel", &[1, 4095, 4097, MIB + 3, 64 * MIB, 1 << 30]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU: cargo test --release -p tcpxd --test suite -- --ignored daemon_gpu::"]
async fn gpu_write_read_d2d_unpacker() {
    gpu_to_gpu("d2d", &[1, 4097, 16 * MIB]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU: cargo test --release -p tcpxd --test suite -- --ignored daemon_gpu::"]
async fn gpu_write_read_host_unpacker() {
    gpu_to_gpu("host", &[1, 4097, 16 * MIB]).await;
}

/// A WriteBatch and a ReadBatch mixing GPU 0 and host memory on both ends (engine
/// `route_parts.rs`) with the kernel unpacker: byte-exact, each memory pair's bytes only on its
/// own lanes at both ends (the suite's `topology_mixed::` does the same on the CUDA stand-in's
/// eight GPUs). Run on the stand-in too with UNPACK "d2d" and HOW `Compare::Bytes` (the stand-in
/// has no kernels), `LD_LIBRARY_PATH=target/debug/cudastub TCPXD_CUDASTUB_DEVICES=1
/// TCPXEMU_BOUNCE=cuda`: passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU: cargo test --release -p tcpxd --test suite -- --ignored daemon_gpu::"]
async fn gpu_mixed_batch_goes_per_memory_pair() {
    const UNPACK: &str = "kernel";
    const HOW: Compare = Compare::Crc;
    use crate::topology::lane_bytes;
    use crate::topology_mixed::{expected, per_pair};
    tcpxd::logging::init("warn");
    let config = format!("[transfer]\nunpack_impl = \"{UNPACK}\"\n");
    let config = config.as_str();
    let mut a = daemons::start("gpu-mixed-a", with_config("gpu-mixed-a", config)).await;
    let mut b = daemons::start("gpu-mixed-b", with_config("gpu-mixed-b", config)).await;
    connect(&mut a, &b).await;
    let size = 64 * MIB;
    let src = [
        cuda_buffer(&mut a.client, 0, size).await,
        host_buffer(&mut a.client, size, "a-host").await,
        cuda_buffer(&mut a.client, 0, size).await,
    ];
    let dst = [
        cuda_buffer(&mut b.client, 0, size).await,
        host_buffer(&mut b.client, size, "b-host").await,
        cuda_buffer(&mut b.client, 0, size).await,
    ];
    let mem = ["gpu0", "host", "gpu0"];
    for (i, s) in src.iter().enumerate() {
        fill_seed(&mut a.client, s.id, 0, 0, 91 + i as u64).await;
    }
    // Every pair of {GPU 0, host} both ways, large (rendezvous) and small (eager) entries.
    let entries: [(usize, u64, usize, u64, u64); 6] = [
        (0, 0, 0, 0, 16 * MIB + 3),
        (0, 16 * MIB, 1, 0, 8 * MIB + 1),
        (1, 0, 0, 32 * MIB, 8 * MIB + 5),
        (1, 8 * MIB, 1, 16 * MIB, 4 * MIB),
        (2, 0, 2, 0, 4097),
        (1, 16 * MIB, 2, MIB, 1000),
    ];
    let (a0, b0) = (lane_bytes(&mut a.client).await, lane_bytes(&mut b.client).await);
    let r = a
        .client
        .write_batch(pb::WriteBatchRequest {
            entries: entries
                .iter()
                .map(|&(s, so, d, doff, len)| write_entry(&src[s], so, &dst[d], doff, len))
                .collect(),
            timeout_ms: 120_000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    wait_ok(&mut a.client, r.transfer_id).await;
    for &(s, so, d, doff, len) in &entries {
        let what = format!("WRITE {} -> {}, {len} bytes", mem[s], mem[d]);
        assert_equal(
            HOW,
            &mut a.client,
            (src[s].id, so),
            &mut b.client,
            (dst[d].id, doff),
            len,
            &what,
        )
        .await;
    }
    let (a1, b1) = (lane_bytes(&mut a.client).await, lane_bytes(&mut b.client).await);
    let want = expected(&entries, mem, mem);
    assert_eq!(per_pair(&a0, &a1, true, "WRITE, a sent"), want);
    assert_eq!(per_pair(&b0, &b1, false, "WRITE, b received"), want);
    // Back by one ReadBatch into the other memory of a, each range after the last in its buffer.
    let back = [
        cuda_buffer(&mut a.client, 0, size).await,
        host_buffer(&mut a.client, size, "a-back").await,
        cuda_buffer(&mut a.client, 0, size).await,
    ];
    let mut at = [0u64; 3];
    let reads: Vec<(usize, u64, usize, u64, u64)> = entries
        .iter()
        .map(|&(s, _, d, doff, len)| {
            let k = [1, 0, 1][s];
            at[k] += len + 4096;
            (d, doff, k, at[k] - len - 4096, len)
        })
        .collect();
    let r = a
        .client
        .read_batch(pb::ReadBatchRequest {
            entries: reads
                .iter()
                .map(|&(d, doff, k, koff, len)| read_entry(&dst[d], doff, &back[k], koff, len))
                .collect(),
            timeout_ms: 120_000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    wait_ok(&mut a.client, r.transfer_id).await;
    for &(d, doff, k, koff, len) in &reads {
        let what = format!("READ {} -> {}, {len} bytes", mem[d], mem[k]);
        assert_equal(
            HOW,
            &mut b.client,
            (dst[d].id, doff),
            &mut a.client,
            (back[k].id, koff),
            len,
            &what,
        )
        .await;
    }
    let (a2, b2) = (lane_bytes(&mut a.client).await, lane_bytes(&mut b.client).await);
    let want = expected(&reads, mem, mem);
    assert_eq!(per_pair(&b1, &b2, true, "READ, b sent"), want);
    assert_eq!(per_pair(&a1, &a2, false, "READ, a received"), want);
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}
