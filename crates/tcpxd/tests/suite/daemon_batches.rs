//! Plain batches of many small scattered entries between real daemons (issue 23 point 2): one
//! buffer pair per batch, so the engine coalesces them (its offers plan the entries as one wire
//! stream) and the poller gathers each chunk's pieces into a staging slot, sends it as one plugin
//! request, and scatters it on the receiver. WriteBatch and ReadBatch, eager and rendezvous,
//! both emulation host receive modes (bounce pages, direct receives into the landing slots):
//! every byte of the destination compared with a per-entry copy (untouched bytes included), far
//! fewer chunks than entries on the wire, and every lane's slots and credits back at rest.

use crate::common::batches::{Form, List, SIZE, write_then_read, write_then_read_lists};
use crate::common::daemons::{fill_seed, host_buffer};
use crate::common::procs;
use tcpxd::api::proto::v1 as pb;
use tcpxd_testkit::Rng;

/// `chunks`: each daemon's `transfer.chunk_bytes` (0: the default).
async fn run(protocol: &str, host_recv: &str, chunks: (u32, u32)) {
    run_as(protocol, host_recv, chunks, Form::Entries).await;
}

async fn run_as(protocol: &str, host_recv: &str, chunks: (u32, u32), form: Form) {
    run_lists(protocol, host_recv, chunks, form, None, 0).await;
}

/// The batches' host gathers and scatters split across 3 helper threads on both daemons
/// (`transfer.host_copy_threads`, issue 38 point 3): default 512 KiB chunks (each split into
/// parts), then small ones copied by the poller alone beside them; bytes compared as always.
/// The helpers copy with `transfer.host_copy_routine` `stream` (direct receives) or `prefetch`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_copies_split_across_helpers_land_byte_exact() {
    tcpxd::logging::init("error");
    for protocol in ["rendezvous", "eager"] {
        for host_recv in ["bounce", "direct"] {
            run_lists(
                protocol,
                host_recv,
                (0, 0),
                Form::Ranges,
                Some(at_the_limit(7)),
                3,
            )
            .await;
            run_lists(protocol, host_recv, (0, 65536), Form::Entries, None, 3).await;
        }
    }
}

/// `lists`: the WRITE's and the READ's `(source, destination, length)` entries (None: the
/// 600 scattered entries of `write_then_read`); `helpers`: both daemons'
/// `transfer.host_copy_threads` (0: their default).
async fn run_lists(
    protocol: &str,
    host_recv: &str,
    chunks: (u32, u32),
    form: Form,
    lists: Option<(List, List)>,
    helpers: usize,
) {
    let env = [
        ("TCPXD_TRANSFER_PROTOCOL", protocol),
        ("TCPXEMU_HOST_RECV", host_recv),
    ];
    let tag = format!(
        "batches-{protocol}-{host_recv}-{}-{}-{form:?}",
        chunks.0, chunks.1
    );
    let config = |c: u32| {
        let mut t = String::from("[transfer]\n");
        if c != 0 {
            t += &format!("chunk_bytes = {c}\n");
        }
        if helpers != 0 {
            t += &format!("host_copy_threads = {helpers}\n");
            // The copy routines (sessions 23-24): every helper store non-temporal where receives
            // land in place (the landing slot zeroed so too), prefetching copies elsewhere; one
            // helper spinning.
            let routine = if host_recv == "direct" {
                "stream-all"
            } else {
                "prefetch"
            };
            t += &format!("host_copy_routine = \"{routine}\"\nhost_copy_spinners = 1\n");
        }
        t
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

    let bufs = (&src, &back, &dst);
    match lists {
        None => write_then_read(&mut ac, &mut bc, bufs, &tag, form).await,
        Some(lists) => write_then_read_lists(&mut ac, &mut bc, bufs, &tag, form, lists).await,
    }
}

/// 65,536 entries (the limit) of one buffer pair, every destination a distinct 64-byte slot in
/// shuffled order: the WRITE's lengths vary (1 to 64 bytes: packed lengths on the peer wire), the
/// READ's are all 64 bytes (one `uniform_length`), its sources shuffled too.
fn at_the_limit(seed: u64) -> (List, List) {
    let n = 65_536u64;
    let slot = SIZE / n;
    let mut rng = Rng::new(seed);
    let shuffled = |rng: &mut Rng| {
        let mut v: Vec<u64> = (0..n).collect();
        for i in (1..v.len()).rev() {
            v.swap(i, rng.below(i as u64 + 1) as usize);
        }
        v
    };
    let (dst, src) = (shuffled(&mut rng), shuffled(&mut rng));
    let write = dst
        .iter()
        .map(|&d| {
            let len = 1 + rng.below(slot);
            (
                rng.below(SIZE - len + 1),
                d * slot + rng.below(slot - len + 1),
                len,
            )
        })
        .collect();
    let read = dst
        .iter()
        .zip(&src)
        .map(|(&d, &s)| (s * slot, d * slot, slot))
        .collect();
    (write, read)
}

/// Packed batches at the limit between two daemons (issue 38 point 4: packed ranges on the
/// peer wire, peer protocol 6): 65,536 entries WRITE and READ, byte-checked, coalesced, lanes at
/// rest; by rendezvous through bounce pages, then eagerly through direct receives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn packed_batches_of_65536_entries_both_ways() {
    tcpxd::logging::init("error");
    let limit = |seed| Some(at_the_limit(seed));
    run_lists("rendezvous", "bounce", (0, 0), Form::Ranges, limit(5), 0).await;
    run_lists("eager", "direct", (0, 0), Form::Ranges, limit(6), 0).await;
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
