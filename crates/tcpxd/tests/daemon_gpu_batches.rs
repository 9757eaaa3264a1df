//! Coalesced batches (many small scattered entries in one buffer pair) between two daemons on a
//! GPU, over the built-in emulation in CUDA mode: the sender gathers each chunk's pieces with
//! `tcpxd_gather_blocks` into its lane's device staging ring (the send is posted once the batch's
//! launch is done), the receiver scatters the fragments the plugin left in its GPU bounce buffer
//! with `tcpxd_scatter_blocks`, reading the fragment lists in place. GPU to GPU, host to GPU and
//! GPU to host; rendezvous and eager. Every byte compared with a per-entry copy, far fewer chunks
//! than entries, lanes at rest afterwards.
//!
//! Needs a CUDA GPU: `cargo test --release -p tcpxd --test daemon_gpu_batches -- --ignored --test-threads=1`.

mod common;

use common::batches::{SIZE, write_then_read};
use common::daemons::{self, Client, connect, fill_seed, host_buffer};
use tcpxd::api::proto::v1 as pb;

async fn cuda_buffer(c: &mut Client, size: u64) -> pb::Buffer {
    c.register_buffer(pb::RegisterBufferRequest {
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

#[derive(Clone, Copy, Debug)]
enum Mem {
    Host,
    Gpu,
}

async fn buffer(c: &mut Client, mem: Mem, label: &str) -> pb::Buffer {
    match mem {
        Mem::Host => host_buffer(c, SIZE, label).await,
        Mem::Gpu => cuda_buffer(c, SIZE).await,
    }
}

/// `src` and `back` on a, `dst` on b, in the given memories.
async fn run(protocol: &'static str, src_mem: Mem, dst_mem: Mem) {
    tcpxd::logging::init("warn");
    let tag = format!("gpu-batches-{protocol}-{src_mem:?}-{dst_mem:?}").to_lowercase();
    let proto = |a: &mut tcpxd::config::DaemonArgs| a.transfer_protocol = Some(protocol.into());
    let mut a = daemons::start(&format!("{tag}-a"), proto).await;
    let mut b = daemons::start(&format!("{tag}-b"), proto).await;
    connect(&mut a, &b).await;
    let src = buffer(&mut a.client, src_mem, "src").await;
    let back = buffer(&mut a.client, src_mem, "back").await;
    let dst = buffer(&mut b.client, dst_mem, "dst").await;
    fill_seed(&mut a.client, src.id, 0, 0, 31).await;
    fill_seed(&mut a.client, back.id, 0, 0, 32).await;
    fill_seed(&mut b.client, dst.id, 0, 0, 33).await;
    let mut bc = b.client.clone();
    write_then_read(&mut a.client, &mut bc, (&src, &back, &dst), &tag).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU: cargo test --release -p tcpxd --test daemon_gpu_batches -- --ignored --test-threads=1"]
async fn gpu_to_gpu_batches_gather_and_scatter_on_the_gpu_rendezvous() {
    run("rendezvous", Mem::Gpu, Mem::Gpu).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU: cargo test --release -p tcpxd --test daemon_gpu_batches -- --ignored --test-threads=1"]
async fn gpu_to_gpu_batches_gather_and_scatter_on_the_gpu_eager() {
    run("eager", Mem::Gpu, Mem::Gpu).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU: cargo test --release -p tcpxd --test daemon_gpu_batches -- --ignored --test-threads=1"]
async fn host_to_gpu_batches_rendezvous() {
    run("rendezvous", Mem::Host, Mem::Gpu).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU: cargo test --release -p tcpxd --test daemon_gpu_batches -- --ignored --test-threads=1"]
async fn gpu_to_host_batches_rendezvous() {
    run("rendezvous", Mem::Gpu, Mem::Host).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU: cargo test --release -p tcpxd --test daemon_gpu_batches -- --ignored --test-threads=1"]
async fn host_to_gpu_and_back_batches_eager() {
    run("eager", Mem::Host, Mem::Gpu).await;
}
