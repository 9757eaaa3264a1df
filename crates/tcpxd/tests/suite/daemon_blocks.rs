//! Block lists and block transfers through the client API (docs/BLOCKS.md): RegisterBlocks,
//! DescribeBlocks, ReleaseBlocks, WriteBlocks / ReadBlocks (unary and in a Session) between
//! daemons on loopback over the built-in emulation; bad input refused naming the field.

use crate::common::blocks::{permutation, register, strided, u32s, write_request};
use crate::common::daemons::{self, *};
use tcpxd::api::proto::v1 as pb;
use tcpxd::api::proto::v1::register_blocks_request::Layout as L;
use tcpxd::api::proto::v1::session_event::Event;
use tcpxd::api::proto::v1::session_request::Op;
use tonic::Code;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn le64(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn ranges(v: &[(u32, u32)]) -> pb::BlockIndices {
    pb::BlockIndices {
        encoding: pb::IndexEncoding::Ranges as i32,
        data: v
            .iter()
            .flat_map(|(s, n)| s.to_le_bytes().into_iter().chain(n.to_le_bytes()))
            .collect(),
    }
}

async fn describe(c: &mut Client, list: u64) -> Result<pb::BlockList, tonic::Status> {
    c.describe_blocks(pb::DescribeBlocksRequest { list_id: list })
        .await
        .map(|r| r.into_inner())
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_register_describe_release_and_go_with_their_buffer() {
    tcpxd::logging::init("warn");
    let mut a = daemons::start("lists-a", |_| {}).await;
    let c = &mut a.client;
    let buf = host_buffer(c, MIB, "").await;

    // Strided, uniform (stepping evenly: the same list) and explicit.
    let s = register(c, buf.id, strided(0, 8 * KIB, 4096, 100)).await.unwrap();
    assert_eq!((s.buffer_id, s.count, s.block_length), (buf.id, 100, 4096));
    let head = format!("tcpxd1b:lists-a:{}:100:4096:", s.id);
    assert!(s.token.starts_with(&head), "{}", s.token);
    assert!(
        s.token.contains('@'),
        "the token carries the peer address: {}",
        s.token
    );
    let offs: Vec<u64> = (0..10).map(|i| 100 + i * 5000).collect();
    let u = register(
        c,
        buf.id,
        L::Uniform(pb::UniformBlocks {
            offsets: le64(&offs),
            length: 4096,
        }),
    )
    .await
    .unwrap();
    assert_eq!((u.count, u.block_length), (10, 4096));
    assert_ne!(u.id, s.id);
    let e = register(
        c,
        buf.id,
        L::Explicit(pb::ExplicitBlocks {
            offsets: le64(&[0, 10, 100]),
            lengths: [10u32, 90, 1].iter().flat_map(|x| x.to_le_bytes()).collect(),
        }),
    )
    .await
    .unwrap();
    assert_eq!((e.count, e.block_length), (3, 0));
    assert_eq!(describe(c, s.id).await.unwrap(), s);

    // Bad lists: refused naming the block and the limit; nothing registered.
    assert_refused(
        register(c, buf.id, strided(MIB - 100, 4096, 4096, 1)).await,
        Code::InvalidArgument,
        "offsets[0]: offset 1048476 + length 4096 exceeds the buffer's 1048576 bytes",
    );
    assert_refused(
        register(c, buf.id, strided(0, 100, 4096, 2)).await,
        Code::InvalidArgument,
        "offsets[1]: blocks of 4096 bytes every 100 bytes overlap",
    );
    assert_refused(
        register(c, buf.id + 100, strided(0, 4096, 4096, 2)).await,
        Code::NotFound,
        "buffer_id",
    );
    assert_refused(
        register(
            c,
            buf.id,
            L::Uniform(pb::UniformBlocks {
                offsets: vec![0; 9],
                length: 1,
            }),
        )
        .await,
        Code::InvalidArgument,
        "uniform.offsets: 9 bytes",
    );
    assert_refused(
        c.register_blocks(pb::RegisterBlocksRequest {
            reattach_id: Default::default(),
            buffer_id: buf.id,
            layout: None,
        })
        .await,
        Code::InvalidArgument,
        "layout",
    );
    let next = register(c, buf.id, strided(0, 4096, 4096, 1)).await.unwrap();
    assert_eq!(next.id, e.id + 1, "refused registrations take no id");

    // A rekey: the token carries the new key.
    c.rekey_buffer(pb::RekeyBufferRequest { buffer_id: buf.id })
        .await
        .unwrap();
    let rekeyed = describe(c, s.id).await.unwrap();
    assert!(rekeyed.token.starts_with(&head));
    assert_ne!(rekeyed.token, s.token, "a rekey changes the list's token");

    // Release; a second release and a describe are NOT_FOUND.
    c.release_blocks(pb::ReleaseBlocksRequest { list_id: s.id })
        .await
        .unwrap();
    assert_refused(
        c.release_blocks(pb::ReleaseBlocksRequest { list_id: s.id }).await,
        Code::NotFound,
        "list_id",
    );
    assert_refused(describe(c, s.id).await, Code::NotFound, "list_id");

    // The lists go with their buffer.
    c.release_buffer(pb::ReleaseBufferRequest { buffer_id: buf.id })
        .await
        .unwrap();
    for list in [u.id, e.id, next.id] {
        assert_refused(describe(c, list).await, Code::NotFound, "list_id");
    }
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_transfers_refuse_malformed_requests_naming_the_field() {
    tcpxd::logging::init("warn");
    let (mut a, mut b) = pair("blockbad").await;
    let src = host_buffer(&mut a.client, MIB, "").await;
    let dst = host_buffer(&mut b.client, MIB, "").await;
    let mine = register(&mut a.client, src.id, strided(0, 4096, 4096, 16))
        .await
        .unwrap();
    let theirs = register(&mut b.client, dst.id, strided(0, 4096, 4096, 16))
        .await
        .unwrap();
    let req = |token: &str, local: Option<pb::BlockIndices>, remote: Option<pb::BlockIndices>| {
        pb::WriteBlocksRequest {
            local_list_id: mine.id,
            local_indices: local,
            remote_token: token.to_string(),
            remote_indices: remote,
            timeout_ms: 10_000,
            ..Default::default()
        }
    };
    let good = Some(u32s(&[0, 1]));
    for (r, code, starts) in [
        (
            req("tcpxd1b:x", good.clone(), good.clone()),
            Code::InvalidArgument,
            "remote_token: malformed block-list token",
        ),
        (
            req(&theirs.token, None, good.clone()),
            Code::InvalidArgument,
            "local_indices: at least one block is required",
        ),
        (
            req(
                &theirs.token,
                good.clone(),
                Some(pb::BlockIndices {
                    encoding: 0,
                    data: vec![1, 2, 3],
                }),
            ),
            Code::InvalidArgument,
            "remote_indices: 3 bytes are not a whole number of 4-byte indices",
        ),
        (
            req(
                &theirs.token,
                Some(pb::BlockIndices {
                    encoding: 5,
                    data: vec![0; 4],
                }),
                good.clone(),
            ),
            Code::InvalidArgument,
            "local_indices.encoding: 5",
        ),
        (
            req(&theirs.token, Some(ranges(&[(3, 0)])), good.clone()),
            Code::InvalidArgument,
            "local_indices: range 0 (3, 0) is empty",
        ),
    ] {
        assert_refused(a.client.write_blocks(r.clone()).await, code, starts);
        let read = pb::ReadBlocksRequest {
            remote_token: r.remote_token,
            remote_indices: r.remote_indices,
            local_list_id: r.local_list_id,
            local_indices: r.local_indices,
            timeout_ms: 10_000,
            wait: false,
        };
        assert_refused(a.client.read_blocks(read).await, code, starts);
    }
    let s = a
        .client
        .get_stats(pb::GetStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(s.active_transfers, 0, "nothing started");
    assert_eq!(
        crc(&mut b.client, dst.id, 0, 0).await,
        crc_zero(MIB),
        "nothing landed"
    );
    a.stop().await;
    b.stop().await;
}

fn crc_zero(n: u64) -> u32 {
    crc32c::crc32c(&vec![0u8; n as usize])
}

/// WriteBlocks and ReadBlocks move scattered blocks pair by pair, byte-exact, unary and in a
/// Session, under both protocols, and by rendezvous with each chunk's host copies queued on 2
/// helper threads (`transfer.host_copy_threads`: the send waits for its gather, the receive's
/// consume for its scatter), and on 3 copying with the `stream` and `stream-all` routines, chunks
/// whole (`transfer.host_copy_routine`, `host_copy_split` off); a stale token (after a rekey) is
/// refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn block_writes_and_reads_land_scattered_blocks_exactly() {
    tcpxd::logging::init("warn");
    for (protocol, helpers, routine) in [
        ("rendezvous", 0, "plain"),
        ("eager", 0, "plain"),
        ("rendezvous", 2, "plain"),
        ("rendezvous", 3, "stream"),
        ("rendezvous", 3, "stream-all"),
    ] {
        let proto = |args: &mut tcpxd::config::DaemonArgs| {
            args.transfer_protocol = Some(protocol.into());
            if helpers > 0 {
                args.host_copy_threads = Some(helpers);
                // Session 23: one helper spinning, chunks whole, the routine given.
                args.host_copy.host_copy_routine = Some(routine.into());
                args.host_copy.host_copy_spinners = Some("1".into());
                args.host_copy.host_copy_split = Some(if routine == "plain" { "on" } else { "off" }.into());
            }
        };
        let mut a = daemons::start("blocks-a", proto).await;
        let mut b = daemons::start("blocks-b", proto).await;
        connect(&mut a, &b).await;
        const N: u32 = 200;
        const BS: u64 = 4096;
        // Source: strided with gaps; destination: uniform at permuted slots of odd offsets.
        let src = host_buffer(&mut a.client, MIB, "").await;
        let dst = host_buffer(&mut b.client, MIB, "").await;
        fill_seed(&mut a.client, src.id, 0, 0, 11).await;
        let sl = register(&mut a.client, src.id, strided(0, BS + 512, BS as u32, N))
            .await
            .unwrap();
        let slots = permutation(N, 3);
        let doffs: Vec<u64> = slots.iter().map(|&s| 7 + u64::from(s) * BS).collect();
        let dl = register(
            &mut b.client,
            dst.id,
            L::Uniform(pb::UniformBlocks {
                offsets: le64(&doffs),
                length: BS as u32,
            }),
        )
        .await
        .unwrap();
        let li = permutation(N, 5);
        let ri = permutation(N, 9);
        let started = a
            .client
            .write_blocks(pb::WriteBlocksRequest {
                notification: b"blocks".to_vec(),
                ..write_request(&sl, u32s(&li), &dl, u32s(&ri), true)
            })
            .await
            .expect("write_blocks")
            .into_inner();
        assert_eq!(started.total_bytes, u64::from(N) * BS);
        let fin = started.r#final.expect("final");
        assert_eq!(fin.status_code, 0, "{}", fin.status_message);
        let s = bytes(&mut a.client, src.id, 0, MIB).await;
        let d = bytes(&mut b.client, dst.id, 0, MIB).await;
        for k in 0..N as usize {
            let so = (u64::from(li[k]) * (BS + 512)) as usize;
            let d_o = doffs[ri[k] as usize] as usize;
            assert_eq!(
                &s[so..so + BS as usize],
                &d[d_o..d_o + BS as usize],
                "{protocol}: pair {k} differs"
            );
        }
        assert!(d[..7].iter().all(|&x| x == 0), "nothing before the first block");

        // READ back, in a session, ranges on both sides: dst's blocks 0..N into a second list.
        let back = host_buffer(&mut a.client, MIB, "").await;
        let bl = register(&mut a.client, back.id, strided(0, BS, BS as u32, N))
            .await
            .unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut events = a
            .client
            .session(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .expect("session")
            .into_inner();
        tx.send(pb::SessionRequest {
            tag: 1,
            op: Some(Op::ReadBlocks(pb::ReadBlocksRequest {
                remote_token: dl.token.clone(),
                remote_indices: Some(ranges(&[(0, N)])),
                local_list_id: bl.id,
                local_indices: Some(ranges(&[(0, N)])),
                timeout_ms: 60_000,
                wait: false,
            })),
        })
        .await
        .unwrap();
        drop(tx);
        let ev = events.message().await.unwrap().expect("event");
        match ev.event {
            Some(Event::Finished(f)) => assert_eq!(f.status_code, 0, "{}", f.status_message),
            other => panic!("{other:?}"),
        }
        let r = bytes(&mut a.client, back.id, 0, MIB).await;
        for (k, &off) in doffs.iter().enumerate() {
            let d_o = off as usize;
            let ro = k * BS as usize;
            assert_eq!(
                &r[ro..ro + BS as usize],
                &d[d_o..d_o + BS as usize],
                "{protocol}: block {k}"
            );
        }

        // A rekey makes the old token stale.
        b.client
            .rekey_buffer(pb::RekeyBufferRequest { buffer_id: dst.id })
            .await
            .unwrap();
        let stale = a
            .client
            .write_blocks(write_request(
                &sl,
                ranges(&[(0, 1)]),
                &dl,
                ranges(&[(0, 1)]),
                true,
            ))
            .await
            .expect("write_blocks")
            .into_inner()
            .r#final
            .expect("final");
        assert_eq!(
            stale.status_code,
            Code::PermissionDenied as i32,
            "{}",
            stale.status_message
        );
        assert_lanes_drain(&mut a.client).await;
        assert_lanes_drain(&mut b.client).await;
        a.stop().await;
        b.stop().await;
    }
}

/// The 64 MiB message limits: a list of 1,000,000 explicit blocks (a 12 MB request) registers,
/// and a WRITE naming 1,000,000 scattered blocks on each side (4 MB of indices a side) moves
/// every pair.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_million_scattered_blocks_a_side_fit_in_one_call() {
    tcpxd::logging::init("warn");
    let (mut a, mut b) = pair("million").await;
    const N: u32 = 1_000_000;
    const BS: u64 = 16;
    let src = host_buffer(&mut a.client, u64::from(N) * BS, "").await;
    let dst = host_buffer(&mut b.client, u64::from(N) * BS, "").await;
    let offsets: Vec<u64> = (0..u64::from(N)).map(|i| i * BS).collect();
    let lengths: Vec<u8> = (0..N).flat_map(|i| (16 - i % 2).to_le_bytes()).collect();
    let explicit = register(
        &mut a.client,
        src.id,
        L::Explicit(pb::ExplicitBlocks {
            offsets: le64(&offsets),
            lengths,
        }),
    )
    .await
    .expect("a 12 MB registration");
    assert_eq!((explicit.count, explicit.block_length), (N, 0));
    a.client
        .release_blocks(pb::ReleaseBlocksRequest { list_id: explicit.id })
        .await
        .unwrap();

    fill_seed(&mut a.client, src.id, 0, 0, 3).await;
    let sl = register(&mut a.client, src.id, strided(0, BS, BS as u32, N))
        .await
        .unwrap();
    let dl = register(&mut b.client, dst.id, strided(0, BS, BS as u32, N))
        .await
        .unwrap();
    let li = permutation(N, 1);
    let ri = permutation(N, 2);
    let done = a
        .client
        .write_blocks(pb::WriteBlocksRequest {
            timeout_ms: 120_000,
            ..write_request(&sl, u32s(&li), &dl, u32s(&ri), true)
        })
        .await
        .expect("4 MB of indices a side")
        .into_inner();
    let fin = done.r#final.expect("final");
    assert_eq!(fin.status_code, 0, "{}", fin.status_message);
    assert_eq!(fin.bytes_done, u64::from(N) * BS);
    let s = bytes(&mut a.client, src.id, 0, u64::from(N) * BS).await;
    let d = bytes(&mut b.client, dst.id, 0, u64::from(N) * BS).await;
    let bs = BS as usize;
    for k in 0..N as usize {
        let (x, y) = (li[k] as usize * bs, ri[k] as usize * bs);
        assert_eq!(&s[x..x + bs], &d[y..y + bs], "pair {k}");
    }
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}
