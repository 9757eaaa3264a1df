//! Prepared lists through the client API (docs/BLOCKS.md, "Prepared lists"): PrepareBlocks,
//! ReleasePrepared, WritePrepared / ReadPrepared between two daemons over the emulation, host
//! memory, under both protocols: bytes compared pair by pair, the notification delivered once to
//! the target's subscribers after the data (a WRITE of several parts, a READ) and never for a
//! failed transfer; bad input refused naming the field; a session's prepared lists going with it.

use std::time::Duration;

use crate::common::blocks::{list, permutation, strided};
use crate::common::daemons::{self, *};
use tcpxd::api::proto::v1 as pb;
use tcpxd::api::proto::v1::register_blocks_request::Layout as L;
use tcpxd::api::proto::v1::session_event::Event;
use tcpxd::api::proto::v1::session_request::Op;
use tonic::Code;

const MIB: u64 = 1 << 20;
const BS: u64 = 4096;
/// Blocks a list; each prepared list has 16 entries of 4 blocks per list.
const N: u32 = 64;

fn le32(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Entry e: list e / 16, blocks (e % 16) * 4 .. + 4 (two lists: 32 entries).
fn shape() -> Vec<u8> {
    le32(
        &(0..32u32)
            .flat_map(|e| [e / 16, (e % 16) * 4, 4])
            .collect::<Vec<_>>(),
    )
}

/// Uniform blocks at permuted slots (odd offsets).
fn scattered(seed: u64) -> L {
    let offs: Vec<u64> = permutation(N, seed)
        .iter()
        .map(|&s| 7 + u64::from(s) * (BS + 100))
        .collect();
    L::Uniform(pb::UniformBlocks {
        offsets: offs.iter().flat_map(|x| x.to_le_bytes()).collect(),
        length: BS as u32,
    })
}

async fn prepare_local(
    c: &mut Client,
    lists: &[u64],
    entries: Vec<u8>,
) -> Result<pb::PreparedBlocks, tonic::Status> {
    c.prepare_blocks(pb::PrepareBlocksRequest {
        local_list_ids: lists.to_vec(),
        entries,
        ..Default::default()
    })
    .await
    .map(|r| r.into_inner())
}

async fn prepare_remote(
    c: &mut Client,
    tokens: &[String],
    entries: Vec<u8>,
) -> Result<pb::PreparedBlocks, tonic::Status> {
    c.prepare_blocks(pb::PrepareBlocksRequest {
        remote_tokens: tokens.to_vec(),
        entries,
        ..Default::default()
    })
    .await
    .map(|r| r.into_inner())
}

fn write_req(
    local: u64,
    li: &[u32],
    remote: u64,
    ri: &[u32],
    note: &[u8],
    wait: bool,
) -> pb::WritePreparedRequest {
    pb::WritePreparedRequest {
        local_prepared_id: local,
        local_indices: le32(li),
        remote_prepared_id: remote,
        remote_indices: le32(ri),
        notification: note.to_vec(),
        timeout_ms: 60_000,
        wait,
        ..Default::default()
    }
}

fn read_req(
    local: u64,
    li: &[u32],
    remote: u64,
    ri: &[u32],
    note: &[u8],
    wait: bool,
) -> pb::ReadPreparedRequest {
    pb::ReadPreparedRequest {
        local_prepared_id: local,
        local_indices: le32(li),
        remote_prepared_id: remote,
        remote_indices: le32(ri),
        notification: note.to_vec(),
        timeout_ms: 60_000,
        wait,
        ..Default::default()
    }
}

fn assert_refused(r: Result<impl std::fmt::Debug, tonic::Status>, code: Code, starts: &str) {
    let e = r.expect_err("refused");
    assert_eq!(e.code(), code, "{}", e.message());
    assert!(
        e.message().starts_with(starts),
        "{:?} does not start with {starts:?}",
        e.message()
    );
}

/// One node's side: two buffers, a list in each, the list's blocks as (buffer, offset).
struct Side {
    bufs: [u64; 2],
    lists: [pb::BlockList; 2],
}

impl Side {
    async fn new(c: &mut Client, seed: u64) -> Side {
        let b0 = host_buffer(c, MIB, "").await;
        let b1 = host_buffer(c, MIB, "").await;
        if seed > 0 {
            fill_seed(c, b0.id, 0, 0, seed).await;
            fill_seed(c, b1.id, 0, 0, seed + 1).await;
        }
        let l0 = list(c, b0.id, strided(0, BS + 512, BS as u32, N)).await;
        let l1 = list(c, b1.id, scattered(seed + 3)).await;
        Side {
            bufs: [b0.id, b1.id],
            lists: [l0, l1],
        }
    }

    fn list_ids(&self) -> Vec<u64> {
        self.lists.iter().map(|l| l.id).collect()
    }

    fn tokens(&self) -> Vec<String> {
        self.lists.iter().map(|l| l.token.clone()).collect()
    }

    /// Block j of entry e: (buffer position, offset).
    fn block(&self, e: u32, j: u32, seed: u64) -> (usize, usize) {
        let (list, b) = ((e / 16) as usize, (e % 16) * 4 + j);
        let off = if list == 0 {
            u64::from(b) * (BS + 512)
        } else {
            7 + u64::from(permutation(N, seed + 3)[b as usize]) * (BS + 100)
        };
        (list, off as usize)
    }

    async fn bytes(&self, c: &mut Client) -> [Vec<u8>; 2] {
        [
            bytes(c, self.bufs[0], 0, MIB).await,
            bytes(c, self.bufs[1], 0, MIB).await,
        ]
    }
}

/// Each pair's blocks at the destination equal the source's.
#[allow(clippy::too_many_arguments)]
fn assert_pairs(
    what: &str,
    src: (&Side, &[Vec<u8>; 2], u64),
    dst: (&Side, &[Vec<u8>; 2], u64),
    src_idx: &[u32],
    dst_idx: &[u32],
) {
    for (k, (&se, &de)) in src_idx.iter().zip(dst_idx).enumerate() {
        for j in 0..4 {
            let (sb, so) = src.0.block(se, j, src.2);
            let (db, d_off) = dst.0.block(de, j, dst.2);
            assert!(
                src.1[sb][so..][..BS as usize] == dst.1[db][d_off..][..BS as usize],
                "{what}: pair {k} (entries {se} -> {de}), block {j} differs"
            );
        }
    }
}

async fn next_note(sub: &mut tonic::Streaming<pb::Notification>) -> pb::Notification {
    tokio::time::timeout(Duration::from_secs(20), sub.message())
        .await
        .expect("a notification in time")
        .expect("stream")
        .expect("a notification")
}

async fn no_note(sub: &mut tonic::Streaming<pb::Notification>, what: &str) {
    if let Ok(n) = tokio::time::timeout(Duration::from_millis(300), sub.message()).await {
        panic!("{what}: unexpected notification {n:?}");
    }
}

/// Random pairs over 32 entries: sources may repeat, destinations never do.
fn pairs(n: usize, seed: u64) -> (Vec<u32>, Vec<u32>) {
    let dst = permutation(32, seed)[..n].to_vec();
    let src = permutation(32, seed + 7)
        .iter()
        .cycle()
        .step_by(3)
        .take(n)
        .copied()
        .collect();
    (src, dst)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_writes_and_reads_land_exactly_and_notify_once_after_the_data() {
    tcpxd::logging::init("warn");
    for protocol in ["rendezvous", "eager"] {
        let proto = |args: &mut tcpxd::config::DaemonArgs| args.transfer_protocol = Some(protocol.into());
        let mut a = daemons::start("prep-a", proto).await;
        let mut b = daemons::start("prep-b", proto).await;
        connect(&mut a, &b).await;
        let mut sub = b
            .client
            .subscribe(pb::SubscribeRequest::default())
            .await
            .unwrap()
            .into_inner();
        let sa = Side::new(&mut a.client, 11).await;
        let sb = Side::new(&mut b.client, 0).await;
        let local = prepare_local(&mut a.client, &sa.list_ids(), shape())
            .await
            .unwrap();
        assert_eq!((local.entries, local.blocks), (32, 128));
        let remote = prepare_remote(&mut a.client, &sb.tokens(), shape())
            .await
            .unwrap();
        assert_ne!(local.prepared_id, remote.prepared_id);

        // WRITE: 24 pairs over both lists a side (several parts); the notification comes once,
        // after every byte landed.
        let (li, ri) = pairs(24, 5);
        let started = a
            .client
            .write_prepared(write_req(
                local.prepared_id,
                &li,
                remote.prepared_id,
                &ri,
                b"pushed",
                false,
            ))
            .await
            .expect("write_prepared")
            .into_inner();
        assert_eq!(started.total_bytes, 24 * 4 * BS);
        let n = next_note(&mut sub).await;
        assert_eq!(
            (n.from_node.as_str(), n.payload.as_slice()),
            ("prep-a", &b"pushed"[..])
        );
        assert_eq!(n.transfer_id, started.transfer_id, "{protocol}");
        let mut bufs = n.buffer_ids.clone();
        bufs.sort_unstable();
        assert_eq!(bufs, sb.bufs.to_vec(), "{protocol}: the buffers of both lists");
        // The data is there by the time the notification is.
        let (src, dst) = (sa.bytes(&mut a.client).await, sb.bytes(&mut b.client).await);
        assert_pairs(protocol, (&sa, &src, 11), (&sb, &dst, 0), &li, &ri);
        wait_ok(&mut a.client, started.transfer_id).await;
        no_note(&mut sub, protocol).await;

        // READ back into fresh lists of a: the notification goes to b, the holder.
        let back = Side::new(&mut a.client, 0).await;
        let into = prepare_local(&mut a.client, &back.list_ids(), shape())
            .await
            .unwrap();
        let (ri, li) = pairs(20, 9);
        let r = a
            .client
            .read_prepared(read_req(
                into.prepared_id,
                &li,
                remote.prepared_id,
                &ri,
                b"pulled",
                true,
            ))
            .await
            .expect("read_prepared")
            .into_inner();
        let fin = r.r#final.expect("final");
        assert_eq!(fin.status_code, 0, "{protocol}: {}", fin.status_message);
        let n = next_note(&mut sub).await;
        assert_eq!(
            (n.payload.as_slice(), n.transfer_id),
            (&b"pulled"[..], r.transfer_id)
        );
        let got = back.bytes(&mut a.client).await;
        assert_pairs(protocol, (&sb, &dst, 0), (&back, &got, 0), &ri, &li);
        no_note(&mut sub, protocol).await;

        // A failed transfer notifies nobody: one of b's lists is gone (the prepared list on a
        // still names it), so that part is refused there.
        b.client
            .release_blocks(pb::ReleaseBlocksRequest {
                list_id: sb.lists[1].id,
            })
            .await
            .unwrap();
        let fin = a
            .client
            .write_prepared(write_req(
                local.prepared_id,
                &[0, 1],
                remote.prepared_id,
                &[0, 16],
                b"never",
                true,
            ))
            .await
            .expect("write_prepared")
            .into_inner()
            .r#final
            .expect("final");
        assert_eq!(fin.status_code, Code::NotFound as i32, "{}", fin.status_message);
        no_note(&mut sub, "failed transfer").await;

        for c in [&mut a.client, &mut b.client] {
            let s = c.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
            assert_eq!(s.active_transfers, 0);
        }
        assert_lanes_drain(&mut a.client).await;
        assert_lanes_drain(&mut b.client).await;
        a.stop().await;
        b.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_input_is_refused_naming_the_field() {
    tcpxd::logging::init("warn");
    let (mut a, mut b) = daemons::pair("prepbad").await;
    let sa = Side::new(&mut a.client, 3).await;
    let sb = Side::new(&mut b.client, 0).await;
    let c = &mut a.client;
    let local = prepare_local(c, &sa.list_ids(), shape())
        .await
        .unwrap()
        .prepared_id;
    let remote = prepare_remote(c, &sb.tokens(), shape())
        .await
        .unwrap()
        .prepared_id;

    // PrepareBlocks.
    assert_refused(
        prepare_local(c, &sa.list_ids(), vec![0; 13]).await,
        Code::InvalidArgument,
        "entries: 13 bytes are not a whole number of 12-byte entries",
    );
    assert_refused(
        prepare_local(c, &sa.list_ids(), le32(&[0, 60, 5])).await,
        Code::InvalidArgument,
        &format!(
            "entries[0]: blocks 60..65 past the 64 blocks of list {}",
            sa.lists[0].id
        ),
    );
    assert_refused(
        prepare_local(c, &[sa.lists[0].id, 9999], shape()).await,
        Code::NotFound,
        "local_list_ids[1]: list 9999 does not exist",
    );
    let other = sb.lists[1].token.replacen("prepbad-b", "prepbad-c", 1);
    assert_refused(
        prepare_remote(c, &[sb.lists[0].token.clone(), other], shape()).await,
        Code::InvalidArgument,
        "remote_tokens[1]: names node prepbad-c, but remote_tokens[0] names node prepbad-b",
    );
    assert_refused(
        c.prepare_blocks(pb::PrepareBlocksRequest {
            reattach_id: Default::default(),
            local_list_ids: sa.list_ids(),
            remote_tokens: sb.tokens(),
            entries: shape(),
        })
        .await,
        Code::InvalidArgument,
        "local_list_ids, remote_tokens: set exactly one",
    );
    let too_many = vec![0u8; (4_194_304 + 1) * 12];
    assert_refused(
        prepare_local(c, &sa.list_ids(), too_many).await,
        Code::InvalidArgument,
        "entries: 4194305 entries exceed the limit of 4194304",
    );

    // Transfers.
    assert_refused(
        c.write_prepared(write_req(local, &[0, 99], remote, &[0, 1], b"", true))
            .await,
        Code::InvalidArgument,
        &format!("local_indices[1]: entry 99 past the 32 entries of prepared list {local}"),
    );
    let odd = prepare_local(c, &sa.list_ids(), le32(&[0, 0, 4, 1, 0, 3]))
        .await
        .unwrap()
        .prepared_id;
    assert_refused(
        c.write_prepared(write_req(odd, &[0, 1], remote, &[0, 1], b"", true))
            .await,
        Code::InvalidArgument,
        &format!(
            "remote_indices[1]: entry 1 of prepared list {remote} covers 4 blocks, but its partner, entry 1 of prepared list {odd}, covers 3"
        ),
    );
    assert_refused(
        c.read_prepared(read_req(local, &[0], local, &[0], b"", true))
            .await,
        Code::InvalidArgument,
        &format!("remote_prepared_id: prepared list {local} names lists of this node"),
    );
    assert_refused(
        c.write_prepared(write_req(local, &[0, 1], remote, &[2, 2], b"", true))
            .await,
        Code::InvalidArgument,
        "remote_indices[1]: entry 2 names blocks that remote_indices[0] (entry 2) names already",
    );
    let mut torn = write_req(local, &[0], remote, &[0], b"", true);
    torn.local_indices = vec![0; 6];
    assert_refused(
        c.write_prepared(torn).await,
        Code::InvalidArgument,
        "local_indices: 6 bytes are not a whole number of 4-byte",
    );
    // A released prepared list, and a block list released under a prepared list.
    c.release_prepared(pb::ReleasePreparedRequest { prepared_id: odd })
        .await
        .unwrap();
    assert_refused(
        c.release_prepared(pb::ReleasePreparedRequest { prepared_id: odd })
            .await,
        Code::NotFound,
        &format!("prepared_id: prepared list {odd} does not exist"),
    );
    assert_refused(
        c.write_prepared(write_req(odd, &[0], remote, &[0], b"", true))
            .await,
        Code::NotFound,
        &format!("local_prepared_id: prepared list {odd} does not exist"),
    );
    c.release_blocks(pb::ReleaseBlocksRequest {
        list_id: sa.lists[1].id,
    })
    .await
    .unwrap();
    assert_refused(
        c.write_prepared(write_req(local, &[0, 16], remote, &[0, 1], b"", true))
            .await,
        Code::NotFound,
        &format!(
            "local_prepared_id: list {} of prepared list {local} does not exist",
            sa.lists[1].id
        ),
    );
    let s = c.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    assert_eq!(s.active_transfers, 0, "nothing started");
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_prepared_lists_go_with_it() {
    tcpxd::logging::init("warn");
    let (mut a, mut b) = daemons::pair("prepsess").await;
    let sa = Side::new(&mut a.client, 5).await;
    let sb = Side::new(&mut b.client, 0).await;
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let mut events = a
        .client
        .session(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("session")
        .into_inner();
    let send = |tag: u64, op: Op| {
        let tx = tx.clone();
        async move { tx.send(pb::SessionRequest { tag, op: Some(op) }).await.unwrap() }
    };
    let mut next = async || events.message().await.unwrap().expect("event");
    send(
        1,
        Op::PrepareBlocks(pb::PrepareBlocksRequest {
            local_list_ids: sa.list_ids(),
            entries: shape(),
            ..Default::default()
        }),
    )
    .await;
    let ev = next().await;
    let Some(Event::Prepared(local)) = ev.event else {
        panic!("{ev:?}")
    };
    assert_eq!((ev.tag, local.entries), (1, 32));
    send(
        2,
        Op::PrepareBlocks(pb::PrepareBlocksRequest {
            remote_tokens: sb.tokens(),
            entries: shape(),
            ..Default::default()
        }),
    )
    .await;
    let ev = next().await;
    let Some(Event::Prepared(remote)) = ev.event else {
        panic!("{ev:?}")
    };
    let (li, ri) = pairs(16, 3);
    send(
        3,
        Op::WritePrepared(write_req(
            local.prepared_id,
            &li,
            remote.prepared_id,
            &ri,
            b"s",
            false,
        )),
    )
    .await;
    let ev = next().await;
    match ev.event {
        Some(Event::Finished(f)) => assert_eq!((ev.tag, f.status_code), (3, 0), "{}", f.status_message),
        other => panic!("{other:?}"),
    }
    let (src, dst) = (sa.bytes(&mut a.client).await, sb.bytes(&mut b.client).await);
    assert_pairs("session", (&sa, &src, 5), (&sb, &dst, 0), &li, &ri);
    send(4, Op::ReleasePrepared(remote.prepared_id)).await;
    let ev = next().await;
    assert!(matches!(ev.event, Some(Event::Released(_))), "{ev:?}");
    send(5, Op::ReleasePrepared(remote.prepared_id)).await;
    let ev = next().await;
    match ev.event {
        Some(Event::Refused(r)) => assert_eq!((ev.tag, r.code), (5, Code::NotFound as i32), "{}", r.message),
        other => panic!("{other:?}"),
    }
    // The session ends: its local prepared list goes with it.
    drop(tx);
    assert!(events.message().await.unwrap().is_none(), "the session ends");
    assert_refused(
        a.client
            .release_prepared(pb::ReleasePreparedRequest {
                prepared_id: local.prepared_id,
            })
            .await,
        Code::NotFound,
        "prepared_id",
    );
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}
