//! Plain batches of many small scattered entries between real daemons (issue 23 point 2): one
//! buffer pair per batch, so the engine coalesces them (its offers plan the entries as one wire
//! stream) and the poller gathers each chunk's pieces into a staging slot, sends it as one plugin
//! request, and scatters it on the receiver. WriteBatch and ReadBatch, eager and rendezvous,
//! both emulation host receive modes (bounce pages, direct receives into the landing slots):
//! every byte of the destination compared with a per-entry copy (untouched bytes included), far
//! fewer chunks than entries on the wire, and every lane's slots and credits back at rest.

use crate::common::batches::{Form, SIZE, write_then_read};
use crate::common::daemons::{fill_seed, host_buffer};
use crate::common::procs;
use tcpxd::api::proto::v1 as pb;

/// `chunks`: each daemon's `transfer.chunk_bytes` (0: the default).
async fn run(protocol: &str, host_recv: &str, chunks: (u32, u32)) {
    run_as(protocol, host_recv, chunks, Form::Entries).await;
}

async fn run_as(protocol: &str, host_recv: &str, chunks: (u32, u32), form: Form) {
    let env = [
        ("TCPXD_TRANSFER_PROTOCOL", protocol),
        ("TCPXEMU_HOST_RECV", host_recv),
    ];
    let tag = format!(
        "batches-{protocol}-{host_recv}-{}-{}-{form:?}",
        chunks.0, chunks.1
    );
    let config = |c: u32| match c {
        0 => String::new(),
        c => format!("[transfer]\nchunk_bytes = {c}\n"),
    };
    let a = procs::spawn(&format!("{tag}-a"), 0, &config(chunks.0), &env).await;
    let b = procs::spawn(&format!("{tag}-b"), 0, &config(chunks.1), &env).await;
    let (mut ac, mut bc) = (a.client().await, b.client().await);
    ac.connect_peer(pb::ConnectPeerRequest {
        address: b.peer_addr.clone(),
    })
    .await
    .expect("a pairs with b");
    let src = host_buffer(&mut ac, SIZE, "src").await;
    let back = host_buffer(&mut ac, SIZE, "back").await;
    let dst = host_buffer(&mut bc, SIZE, "dst").await;
    fill_seed(&mut ac, src.id, 0, 0, 21).await;
    fill_seed(&mut ac, back.id, 0, 0, 22).await;
    fill_seed(&mut bc, dst.id, 0, 0, 23).await;

    write_then_read(&mut ac, &mut bc, (&src, &back, &dst), &tag, form).await;
}

/// The same batches as packed ranges of one buffer pair (issue 38): the same bytes and chunks,
/// no per-entry statuses in the final event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packed_rendezvous_batches_through_bounce_pages() {
    tcpxd::logging::init("error");
    run_as("rendezvous", "bounce", (0, 0), Form::Ranges).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packed_eager_batches_through_direct_receives() {
    tcpxd::logging::init("error");
    run_as("eager", "direct", (0, 0), Form::Ranges).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rendezvous_batches_through_bounce_pages() {
    tcpxd::logging::init("error");
    run("rendezvous", "bounce", (0, 0)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rendezvous_batches_through_direct_receives() {
    tcpxd::logging::init("error");
    run("rendezvous", "direct", (0, 0)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_batches_through_bounce_pages() {
    tcpxd::logging::init("error");
    run("eager", "bounce", (0, 0)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_batches_through_direct_receives() {
    tcpxd::logging::init("error");
    run("eager", "direct", (0, 0)).await;
}

/// Small chunks (many more than a lane's window: the staging and landing rings wrap many times),
/// and a receiver whose chunks differ from the sender's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_and_unequal_chunks_wrap_the_rings() {
    tcpxd::logging::init("error");
    run("rendezvous", "bounce", (16384, 16384)).await;
    run("eager", "direct", (16384, 16384)).await;
    run("rendezvous", "direct", (16384, 65536)).await;
    run("eager", "bounce", (65536, 16384)).await;
    run("eager", "direct", (16384, 65536)).await;
}
