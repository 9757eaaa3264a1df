//! WRITE and READ between two daemons on one GPU, over the built-in emulation in CUDA mode:
//! received bytes land scattered in a GPU bounce buffer and the daemon's unpacker gathers them.
//! Needs a CUDA GPU: `cargo test --release -p tcpxd --test suite -- --ignored daemon_gpu::`.

use crate::common::daemons::{self, *};
use crate::common::gpus::{
    Compare, Trip, cuda_buffer, host_to_and_from_gpus, with_config, write_and_read_back,
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
