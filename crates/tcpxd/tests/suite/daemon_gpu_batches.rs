//! Coalesced batches (many small scattered entries in one buffer pair) between two daemons on a
//! GPU, over the built-in emulation in CUDA mode: the sender gathers each chunk's pieces with
//! `tcpxd_gather_blocks` into its lane's device staging ring (the send is posted once the batch's
//! launch is done), the receiver scatters the fragments the plugin left in its GPU bounce buffer
//! with `tcpxd_scatter_blocks`, reading the fragment lists in place. GPU to GPU, host to GPU and
//! GPU to host; rendezvous and eager. Every byte compared with a per-entry copy, far fewer chunks
//! than entries, lanes at rest afterwards.
//!
//! Needs a CUDA GPU: `cargo test --release -p tcpxd --test suite -- --ignored --test-threads=1 daemon_gpu_batches::`.

use crate::common::batches::{Form, SIZE, bytes, write_then_read};
use crate::common::blocks::{list, permutation, read_request, strided, u32s, write_request};
use crate::common::daemons::{self, Client, assert_lanes_drain, connect, fill_seed, host_buffer};
use crate::common::gpus::cuda_buffer;
use tcpxd::api::proto::v1 as pb;

#[derive(Clone, Copy, Debug)]
enum Mem {
    Host,
    Gpu,
}

async fn buffer(c: &mut Client, mem: Mem, label: &str) -> pb::Buffer {
    match mem {
        Mem::Host => host_buffer(c, SIZE, label).await,
        Mem::Gpu => cuda_buffer(c, 0, SIZE).await,
    }
}

/// `src` and `back` on a, `dst` on b, in the given memories.
async fn run(protocol: &'static str, src_mem: Mem, dst_mem: Mem) {
    run_as(protocol, src_mem, dst_mem, Form::Entries).await;
}

async fn run_as(protocol: &'static str, src_mem: Mem, dst_mem: Mem, form: Form) {
    tcpxd::logging::init("warn");
    let tag = format!("gpu-batches-{protocol}-{src_mem:?}-{dst_mem:?}-{form:?}").to_lowercase();
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
    write_then_read(&mut a.client, &mut bc, (&src, &back, &dst), &tag, form).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU: cargo test --release -p tcpxd --test suite -- --ignored --test-threads=1 daemon_gpu_batches::"]
async fn gpu_to_gpu_batches_gather_and_scatter_on_the_gpu_rendezvous() {
    run("rendezvous", Mem::Gpu, Mem::Gpu).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU: cargo test --release -p tcpxd --test suite -- --ignored --test-threads=1 daemon_gpu_batches::"]
async fn gpu_to_gpu_batches_gather_and_scatter_on_the_gpu_eager() {
    run("eager", Mem::Gpu, Mem::Gpu).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU: cargo test --release -p tcpxd --test suite -- --ignored --test-threads=1 daemon_gpu_batches::"]
async fn host_to_gpu_batches_rendezvous() {
    run("rendezvous", Mem::Host, Mem::Gpu).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU: cargo test --release -p tcpxd --test suite -- --ignored --test-threads=1 daemon_gpu_batches::"]
async fn gpu_to_host_batches_rendezvous() {
    run("rendezvous", Mem::Gpu, Mem::Host).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU: cargo test --release -p tcpxd --test suite -- --ignored --test-threads=1 daemon_gpu_batches::"]
async fn host_to_gpu_and_back_batches_eager() {
    run("eager", Mem::Host, Mem::Gpu).await;
}

/// The batches as packed ranges of one buffer pair (issue 38), GPU to GPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU: cargo test --release -p tcpxd --test suite -- --ignored --test-threads=1 daemon_gpu_batches::"]
async fn gpu_to_gpu_packed_batches_rendezvous() {
    run_as("rendezvous", Mem::Gpu, Mem::Gpu, Form::Ranges).await;
}

/// A block WRITE from a's list into b's, then a block READ of b's blocks into a third list on
/// a, with `len`-byte blocks scattered (shuffled indices) on both sides; every pair compared.
async fn blocks(protocol: &'static str, src_mem: Mem, dst_mem: Mem, len: u32) {
    tcpxd::logging::init("warn");
    let tag = format!("gpu-blocks-{protocol}-{src_mem:?}-{dst_mem:?}-{len}").to_lowercase();
    let proto = |a: &mut tcpxd::config::DaemonArgs| a.transfer_protocol = Some(protocol.into());
    let mut a = daemons::start(&format!("{tag}-a"), proto).await;
    let mut b = daemons::start(&format!("{tag}-b"), proto).await;
    connect(&mut a, &b).await;
    let src = buffer(&mut a.client, src_mem, "src").await;
    let back = buffer(&mut a.client, src_mem, "back").await;
    let dst = buffer(&mut b.client, dst_mem, "dst").await;
    fill_seed(&mut a.client, src.id, 0, 0, 41).await;
    fill_seed(&mut a.client, back.id, 0, 0, 42).await;
    fill_seed(&mut b.client, dst.id, 0, 0, 43).await;
    let n = ((SIZE - 64) / (u64::from(len) + 13)).min(2000) as u32;
    let (sstride, dstride) = (u64::from(len) + 13, u64::from(len) + 5);
    let sl = list(&mut a.client, src.id, strided(3, sstride, len, n)).await;
    let dl = list(&mut b.client, dst.id, strided(11, dstride, len, n)).await;
    let bl = list(&mut a.client, back.id, strided(7, sstride, len, n)).await;
    let (li, ri) = (permutation(n, 5), permutation(n, 9));
    let started = a
        .client
        .write_blocks(write_request(&sl, u32s(&li), &dl, u32s(&ri), true))
        .await
        .expect("write_blocks")
        .into_inner();
    let fin = started.r#final.expect("final");
    assert_eq!(fin.status_code, 0, "{tag}: {}", fin.status_message);
    let s = bytes(&mut a.client, src.id).await;
    let d = bytes(&mut b.client, dst.id).await;
    let l = len as usize;
    for k in 0..n as usize {
        let so = 3 + li[k] as usize * sstride as usize;
        let d_o = 11 + ri[k] as usize * dstride as usize;
        assert_eq!(&s[so..so + l], &d[d_o..d_o + l], "{tag}: write pair {k}");
    }
    // READ: b's blocks ri[k] into a's back blocks li[k].
    let started = a
        .client
        .read_blocks(read_request(&dl, u32s(&ri), &bl, u32s(&li), true))
        .await
        .expect("read_blocks")
        .into_inner();
    let fin = started.r#final.expect("final");
    assert_eq!(fin.status_code, 0, "{tag}: {}", fin.status_message);
    let r = bytes(&mut a.client, back.id).await;
    for k in 0..n as usize {
        let ro = 7 + li[k] as usize * sstride as usize;
        let d_o = 11 + ri[k] as usize * dstride as usize;
        assert_eq!(&r[ro..ro + l], &d[d_o..d_o + l], "{tag}: read pair {k}");
    }
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU: cargo test --release -p tcpxd --test suite -- --ignored --test-threads=1 daemon_gpu_batches::"]
async fn gpu_block_transfers_rendezvous() {
    blocks("rendezvous", Mem::Gpu, Mem::Gpu, 4096).await;
    blocks("rendezvous", Mem::Gpu, Mem::Gpu, 1001).await;
    blocks("rendezvous", Mem::Host, Mem::Gpu, 777).await;
    blocks("rendezvous", Mem::Gpu, Mem::Host, 2049).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU: cargo test --release -p tcpxd --test suite -- --ignored --test-threads=1 daemon_gpu_batches::"]
async fn gpu_block_transfers_eager() {
    blocks("eager", Mem::Gpu, Mem::Gpu, 4096).await;
    blocks("eager", Mem::Gpu, Mem::Host, 1001).await;
}
