//! WRITE and READ between two daemons on one GPU, over the built-in emulation in CUDA mode:
//! received bytes land scattered in a GPU bounce buffer and the daemon's unpacker gathers them.
//! Needs a CUDA GPU: `cargo test --release -p tcpxd --test suite -- --ignored daemon_gpu::`.

use crate::common::daemons::{self, *};
use tcpxd::api::proto::v1 as pb;

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

fn with_unpacker(name: &'static str) -> impl FnOnce(&mut tcpxd::config::DaemonArgs) {
    move |args| {
        let path = std::env::temp_dir().join(format!("tcpxd-gpu-{name}-{}.toml", std::process::id()));
        std::fs::write(&path, format!("[transfer]\nunpack_impl = \"{name}\"\n")).unwrap();
        args.config = Some(path);
    }
}

async fn gpu_to_gpu(unpacker: &'static str, sizes: &[u64]) {
    tcpxd::logging::init("warn");
    let mut a = daemons::start(&format!("gpu-a-{unpacker}"), with_unpacker(unpacker)).await;
    let mut b = daemons::start(&format!("gpu-b-{unpacker}"), with_unpacker(unpacker)).await;
    connect(&mut a, &b).await;
    let max = *sizes.iter().max().unwrap() + 8192;
    let src = cuda_buffer(&mut a.client, max).await;
    let dst = cuda_buffer(&mut b.client, max).await;
    let back = cuda_buffer(&mut a.client, max).await;
    assert_eq!(src.kind, pb::BufferKind::Cuda as i32);
    assert_eq!(src.cuda_ipc_handle.len(), 64);
    fill_seed(&mut a.client, src.id, 0, 0, 77).await;
    for (k, &len) in sizes.iter().enumerate() {
        let (soff, doff) = (k as u64 * 7, 4096 + k as u64 * 3);
        let id = write(&mut a.client, write_entry(&src, soff, &dst, doff, len), b"")
            .await
            .unwrap();
        wait_ok(&mut a.client, id).await;
        let want = crc(&mut a.client, src.id, soff, len).await;
        assert_eq!(
            crc(&mut b.client, dst.id, doff, len).await,
            want,
            "{unpacker}: WRITE of {len} bytes"
        );
        let id = read(&mut a.client, read_entry(&dst, doff, &back, 0, len))
            .await
            .unwrap();
        wait_ok(&mut a.client, id).await;
        assert_eq!(
            crc(&mut a.client, back.id, 0, len).await,
            want,
            "{unpacker}: READ of {len} bytes"
        );
    }
    // Host to GPU and GPU to host on the same pairing.
    let host = host_buffer(&mut a.client, 8 * MIB, "").await;
    fill_seed(&mut a.client, host.id, 0, 0, 5).await;
    let id = write(&mut a.client, write_entry(&host, 0, &dst, 0, 8 * MIB), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    assert_eq!(
        crc(&mut a.client, host.id, 0, 8 * MIB).await,
        crc(&mut b.client, dst.id, 0, 8 * MIB).await
    );
    let hb = host_buffer(&mut b.client, 8 * MIB, "").await;
    let id = write(&mut a.client, write_entry(&src, 0, &hb, 0, 8 * MIB), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    assert_eq!(
        crc(&mut a.client, src.id, 0, 8 * MIB).await,
        crc(&mut b.client, hb.id, 0, 8 * MIB).await
    );
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
