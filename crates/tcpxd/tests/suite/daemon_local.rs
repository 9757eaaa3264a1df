//! The framed local session on the API unix socket (#15): the `Session` RPC's semantics driven
//! with a plain `UnixStream`, the preface, the frame limits, half-close, resets, and gRPC still
//! served on the same socket. Every test compares bytes or statuses and checks that the lanes and
//! transfer slots of both daemons drain back to zero. A test that needs a transfer in flight holds
//! it with the emulation's hold gate (`common::hold`: closed before the post, the transfer moves
//! 16 MiB and then waits until the test opens it), whatever the machine's load.

use std::collections::HashMap;
use std::time::Duration;

use crate::common::daemons::*;
use crate::common::framed::*;
use crate::common::hold;
use tcpxd::api::proto::v1 as pb;
use tcpxd::api::proto::v1::session_event::Event;
use tcpxd::api::proto::v1::session_request::Op;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
/// Transfers of `c` that ended with `status` (a metrics label: "ok", "cancelled", ...).
async fn total(c: &mut Client, status: &str) -> u64 {
    let stats = c.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    stats
        .transfer_totals
        .iter()
        .filter(|t| t.status == status)
        .map(|t| t.transfers)
        .sum()
}

async fn cancelled_total(c: &mut Client) -> u64 {
    total(c, "cancelled").await
}

/// Waits until `want` transfers of `c` have ended cancelled (the engine ends a cancelled transfer
/// at once, its chunks held at the gate or not).
async fn until_cancelled(c: &mut Client, want: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while cancelled_total(c).await < want {
        assert!(
            std::time::Instant::now() < deadline,
            "{want} transfers not cancelled within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The hold gate on for this test's process (before any daemon starts), and logs at `warn`.
fn held() {
    hold::gate_on();
    tcpxd::logging::init("warn");
}

async fn active(c: &mut Client) -> u32 {
    c.get_stats(pb::GetStatsRequest {})
        .await
        .unwrap()
        .into_inner()
        .active_transfers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_and_reads_round_trip_many_in_flight() {
    tcpxd::logging::init("warn");
    let (mut a, mut b) = pair("local-many").await;
    // Clients can tell the socket speaks the framed session without trying.
    let node = a
        .client
        .describe_node(pb::DescribeNodeRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(node.local_session, "TCPXD/1");
    let src = host_buffer(&mut a.client, 8 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 8 * MIB, "").await;
    let back = host_buffer(&mut a.client, 8 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 1515).await;
    let mut s = Framed::open(&a.daemon.api_socket).await;
    // A 4 KiB WRITE, alone: the event, then the bytes are there.
    s.send(1, write_op(write_entry(&src, 0, &dst, 0, 4 * KIB))).await;
    let ev = s.next().await;
    assert_eq!(ev.tag, 1);
    let t = finished(&ev);
    assert_eq!(
        (t.status_code, t.total_bytes),
        (0, 4 * KIB),
        "{}",
        t.status_message
    );
    assert_eq!(
        crc(&mut b.client, dst.id, 0, 4 * KIB).await,
        crc(&mut a.client, src.id, 0, 4 * KIB).await
    );
    // 32 WRITEs of 256 KiB in flight at once: one event per tag, any order.
    let block = 256 * KIB;
    for i in 0..32u64 {
        s.send(
            100 + i,
            write_op(write_entry(&src, i * block, &dst, i * block, block)),
        )
        .await;
    }
    let mut seen = HashMap::new();
    for _ in 0..32 {
        let ev = s.next().await;
        let t = finished(&ev);
        assert_eq!(t.status_code, 0, "tag {}: {}", ev.tag, t.status_message);
        assert_eq!(t.total_bytes, block);
        assert!((100..132).contains(&ev.tag), "unknown tag {}", ev.tag);
        assert!(
            seen.insert(ev.tag, t.transfer_id).is_none(),
            "tag {} twice",
            ev.tag
        );
    }
    // READ it all back: single READs and a batch in flight together.
    for i in 0..4u64 {
        s.send(200 + i, read_op(read_entry(&dst, i * MIB, &back, i * MIB, MIB)))
            .await;
    }
    s.send(
        300,
        Op::ReadBatch(pb::ReadBatchRequest {
            entries: (4..8)
                .map(|i| read_entry(&dst, i * MIB, &back, i * MIB, MIB))
                .collect(),
            timeout_ms: 60_000,
            ..Default::default()
        }),
    )
    .await;
    let mut tags = Vec::new();
    for _ in 0..5 {
        let ev = s.next().await;
        let t = finished(&ev);
        assert_eq!(t.status_code, 0, "tag {}: {}", ev.tag, t.status_message);
        if ev.tag == 300 {
            assert_eq!(t.entries.len(), 4);
        }
        tags.push(ev.tag);
    }
    tags.sort();
    assert_eq!(tags, [200, 201, 202, 203, 300]);
    let want = crc(&mut a.client, src.id, 0, 8 * MIB).await;
    assert_eq!(crc(&mut b.client, dst.id, 0, 8 * MIB).await, want);
    assert_eq!(crc(&mut a.client, back.id, 0, 8 * MIB).await, want);
    // Half-closed with nothing in flight: the daemon closes.
    half_close(&mut s).await;
    s.assert_eof().await;
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_and_the_session_goes_on() {
    tcpxd::logging::init("warn");
    let (mut a, mut b) = pair("local-bad").await;
    let src = host_buffer(&mut a.client, MIB, "").await;
    let dst = host_buffer(&mut b.client, MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 6).await;
    let mut s = Framed::open(&a.daemon.api_socket).await;
    // Tag zero.
    s.send(0, write_op(write_entry(&src, 0, &dst, 0, 10))).await;
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (0, tonic::Code::InvalidArgument as i32));
    assert!(msg.starts_with("tag:"), "{msg}");
    // Unknown local buffer.
    let mut e = write_entry(&src, 0, &dst, 0, 10);
    e.local_buffer_id = 9999;
    s.send(1, write_op(e)).await;
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (1, tonic::Code::NotFound as i32));
    assert!(msg.contains("entries[0].local_buffer_id"), "{msg}");
    // A range past the remote buffer's end.
    s.send(2, write_op(write_entry(&src, 0, &dst, MIB - 10, 4096)))
        .await;
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (2, tonic::Code::InvalidArgument as i32));
    assert!(msg.contains("entries[0].remote_offset"), "{msg}");
    // Past the local end, on a READ.
    s.send(3, read_op(read_entry(&dst, 0, &src, MIB - 1, 2))).await;
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (3, tonic::Code::InvalidArgument as i32));
    assert!(
        msg.contains("entries[0].local_offset") && msg.contains("past the end"),
        "{msg}"
    );
    // No op; a cancel of an unknown tag.
    s.send_request(pb::SessionRequest { tag: 4, op: None }).await;
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (4, tonic::Code::InvalidArgument as i32));
    assert!(msg.starts_with("op:"), "{msg}");
    s.send(5, Op::CancelTag(424242)).await;
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (5, tonic::Code::NotFound as i32));
    assert!(msg.contains("cancel_tag"), "{msg}");
    // Nothing changed at the destination; a good request on the same connection still works.
    assert_eq!(
        crc(&mut b.client, dst.id, 0, MIB).await,
        crc32c::crc32c(&vec![0u8; MIB as usize])
    );
    s.send(6, write_op(write_entry(&src, 0, &dst, 0, MIB))).await;
    let ev = s.next().await;
    assert_eq!(ev.tag, 6);
    assert_eq!(finished(&ev).status_code, 0);
    assert_eq!(
        crc(&mut b.client, dst.id, 0, MIB).await,
        crc(&mut a.client, src.id, 0, MIB).await
    );
    assert_lanes_drain(&mut a.client).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_by_tag_and_half_close_finishes_in_flight() {
    held();
    let (mut a, mut b) = pair("local-cancel").await;
    let src = host_buffer(&mut a.client, 128 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 128 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 10).await;
    let mut s = Framed::open(&a.daemon.api_socket).await;
    // A finished transfer's tag: cancelling it says so and changes nothing.
    s.send(9, write_op(write_entry(&src, 0, &dst, 0, 4 * KIB))).await;
    assert_eq!(finished(&s.next().await).status_code, 0);
    s.send(8, Op::CancelTag(9)).await;
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (8, tonic::Code::FailedPrecondition as i32), "{msg}");
    assert_eq!(
        msg,
        "cancel_tag: tag 9 already finished (OK); nothing was cancelled"
    );
    assert_eq!(cancelled_total(&mut a.client).await, 0);
    // A long WRITE, held in flight, cancelled by its tag.
    hold::close_gate();
    s.send(10, write_op(write_entry(&src, 0, &dst, 0, 120 * MIB)))
        .await;
    // A tag in use is refused (the request is ordered after the WRITE's start).
    s.send(10, write_op(write_entry(&src, 0, &dst, 0, 10))).await;
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (10, tonic::Code::InvalidArgument as i32));
    assert!(msg.starts_with("tag:"), "{msg}");
    s.send(11, Op::CancelTag(10)).await;
    let mut got = HashMap::new();
    for _ in 0..2 {
        let ev = s.next().await;
        got.insert(ev.tag, ev.event.expect("an event"));
    }
    assert!(
        matches!(got[&11], Event::Cancelled(pb::CancelResponse { cancelled: true })),
        "{got:?}"
    );
    match &got[&10] {
        Event::Finished(t) => {
            assert_eq!(
                t.status_code,
                tonic::Code::Cancelled as i32,
                "{}",
                t.status_message
            );
            assert!(t.bytes_done < 120 * MIB);
        }
        other => panic!("{other:?}"),
    }
    // Cancelled again once it ended: refused, with how it ended.
    s.send(13, Op::CancelTag(10)).await;
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (13, tonic::Code::FailedPrecondition as i32), "{msg}");
    assert!(
        msg.starts_with("cancel_tag: tag 10 already finished (CANCELLED: "),
        "{msg}"
    );
    assert_eq!(cancelled_total(&mut a.client).await, 1);
    hold::open_gate();
    // A transfer that finished before its cancel was read, its event not read yet: the same
    // answer, whichever the session saw first (the event, or the cancel of a transfer ended).
    let ok_before = total(&mut a.client, "ok").await;
    s.send(14, write_op(write_entry(&src, 0, &dst, 0, 4 * KIB))).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while total(&mut a.client, "ok").await == ok_before {
        assert!(
            std::time::Instant::now() < deadline,
            "a 4 KiB write unfinished after 30 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    s.send(15, Op::CancelTag(14)).await;
    let mut got = HashMap::new();
    for _ in 0..2 {
        let ev = s.next().await;
        got.insert(ev.tag, ev);
    }
    assert_eq!(finished(&got[&14]).status_code, 0);
    let (_, code, msg) = refused(got.remove(&15).expect("the cancel's answer"));
    assert_eq!(code, tonic::Code::FailedPrecondition as i32, "{msg}");
    assert!(msg.contains("tag 14 already finished (OK)"), "{msg}");
    assert_eq!(cancelled_total(&mut a.client).await, 1);
    // Half-close with a transfer held in flight: it finishes, its event comes, then EOF.
    hold::close_gate();
    s.send(12, write_op(write_entry(&src, 0, &dst, 0, 32 * MIB)))
        .await;
    half_close(&mut s).await;
    hold::open_gate();
    let ev = s.next().await;
    assert_eq!(ev.tag, 12);
    let t = finished(&ev);
    assert_eq!(
        (t.status_code, t.bytes_done),
        (0, 32 * MIB),
        "{}",
        t.status_message
    );
    s.assert_eof().await;
    assert_eq!(
        crc(&mut b.client, dst.id, 0, 32 * MIB).await,
        crc(&mut a.client, src.id, 0, 32 * MIB).await
    );
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}

/// Starts a long WRITE and a long READ on a framed connection, held in flight by the hold gate
/// (closed here: the caller opens it), and waits until both run.
async fn two_long_transfers(a: &mut TestDaemon, b: &mut TestDaemon) -> Framed {
    let src = host_buffer(&mut a.client, 128 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 128 * MIB, "").await;
    let mut s = Framed::open(&a.daemon.api_socket).await;
    hold::close_gate();
    s.send(1, write_op(write_entry(&src, 0, &dst, 0, 120 * MIB)))
        .await;
    s.send(2, read_op(read_entry(&dst, 0, &src, 0, 120 * MIB))).await;
    // A cancel of a tag no request has: its refusal comes after both requests were read. Their
    // starts reach the engine on their own way (a start's checks are not awaited before the next
    // request is read: CI saw the refusal ahead of the READ's start under load), so wait until
    // the poller counts both.
    s.send(3, Op::CancelTag(99)).await;
    let (tag, code, _) = refused(s.next().await);
    assert_eq!((tag, code), (3, tonic::Code::NotFound as i32));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let n = active(&mut a.client).await;
        if n == 2 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "both in flight: {n} active after 20 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_connection_cancels_its_transfers_on_both_sides() {
    held();
    let (mut a, mut b) = pair("local-drop").await;
    let s = two_long_transfers(&mut a, &mut b).await;
    drop(s);
    // Both cancelled while held; then their chunks go on (emptied) and the lanes drain.
    until_cancelled(&mut a.client, 2).await;
    hold::open_gate();
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    assert_eq!(active(&mut b.client).await, 0);
    assert_eq!(cancelled_total(&mut a.client).await, 2);
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_dropped_after_its_half_close_cancels_its_transfers() {
    held();
    let (mut a, mut b) = pair("local-hup").await;
    let mut s = two_long_transfers(&mut a, &mut b).await;
    half_close(&mut s).await;
    assert_eq!(active(&mut a.client).await, 2, "a half-close cancels nothing");
    // Gone after its half-close (whether or not the daemon saw that first): only the hang-up
    // tells, the transfers (held at the gate) would otherwise run on and finish.
    drop(s);
    until_cancelled(&mut a.client, 2).await;
    hold::open_gate();
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    assert_eq!(cancelled_total(&mut a.client).await, 2);
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_frames_are_refused_under_tag_zero_then_closed() {
    held();
    let (mut a, mut b) = pair("local-broken").await;
    let src = host_buffer(&mut a.client, 128 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 128 * MIB, "").await;
    // Over the limit, with a transfer held in flight: one refusal, EOF, the transfer cancelled.
    let mut s = Framed::open(&a.daemon.api_socket).await;
    hold::close_gate();
    s.send(1, write_op(write_entry(&src, 0, &dst, 0, 120 * MIB)))
        .await;
    s.send(2, Op::CancelTag(99)).await;
    let (tag, _, _) = refused(s.next().await);
    assert_eq!(tag, 2);
    s.send_raw(&(67_108_865u32).to_be_bytes()).await;
    // Some of the oversized body follows, as a real client would send it.
    s.send_raw(&vec![7u8; 64 << 10]).await;
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (0, tonic::Code::ResourceExhausted as i32));
    assert_eq!(msg, "frame: 67108865 bytes is over the 67108864-byte limit");
    s.assert_eof().await;
    until_cancelled(&mut a.client, 1).await;
    hold::open_gate();
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    assert_eq!(cancelled_total(&mut a.client).await, 1);
    // A frame that is not a SessionRequest.
    let mut s = Framed::open(&a.daemon.api_socket).await;
    s.send_raw(&[0, 0, 0, 3, 0xff, 0xff, 0xff]).await;
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (0, tonic::Code::InvalidArgument as i32));
    assert!(msg.starts_with("frame: not a SessionRequest: "), "{msg}");
    s.assert_eof().await;
    // A half-close in the middle of a frame.
    let mut s = Framed::open(&a.daemon.api_socket).await;
    s.send_raw(&[0, 0, 0, 9, 8]).await;
    half_close(&mut s).await;
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (0, tonic::Code::InvalidArgument as i32));
    assert!(msg.starts_with("frame: "), "{msg}");
    s.assert_eof().await;
    // The daemon still serves gRPC on the socket, and new framed sessions.
    let mut fresh = unix_client(a.daemon.api_socket.clone()).await;
    let node = fresh
        .describe_node(pb::DescribeNodeRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(node.node_id, "local-broken-a");
    let mut s = Framed::open(&a.daemon.api_socket).await;
    s.send(1, write_op(write_entry(&src, 0, &dst, 0, 4 * KIB))).await;
    assert_eq!(finished(&s.next().await).status_code, 0);
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_connection_blocks_no_one_and_is_closed() {
    tcpxd::logging::init("warn");
    let (mut a, mut b) = pair("local-silent").await;
    let src = host_buffer(&mut a.client, MIB, "").await;
    let dst = host_buffer(&mut b.client, MIB, "").await;
    // Three bytes of a preface, then nothing.
    let mut silent = UnixStream::connect(&a.daemon.api_socket).await.unwrap();
    silent.write_all(b"TCP").await.unwrap();
    // Meanwhile new gRPC and framed clients are served.
    let mut c = unix_client(a.daemon.api_socket.clone()).await;
    c.describe_node(pb::DescribeNodeRequest {}).await.unwrap();
    let mut s = Framed::open(&a.daemon.api_socket).await;
    s.send(1, write_op(write_entry(&src, 0, &dst, 0, MIB))).await;
    assert_eq!(finished(&s.next().await).status_code, 0);
    // The silent one is closed after its 10 s, unanswered.
    let mut rest = Vec::new();
    let n = tokio::time::timeout(Duration::from_secs(30), silent.read_to_end(&mut rest))
        .await
        .expect("closed within 30 s")
        .expect("EOF");
    assert_eq!(n, 0);
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_daemon_finishes_framed_transfers_then_closes() {
    held();
    let (mut a, mut b) = pair("local-drain").await;
    let src = host_buffer(&mut a.client, 64 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 64 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 3).await;
    let mut s = Framed::open(&a.daemon.api_socket).await;
    hold::close_gate();
    s.send(1, write_op(write_entry(&src, 0, &dst, 0, 32 * MIB))).await;
    s.send(2, Op::CancelTag(99)).await;
    let (tag, _, _) = refused(s.next().await);
    assert_eq!(tag, 2);
    let want = crc(&mut a.client, src.id, 0, 32 * MIB).await;
    let mut probe = a.client.clone();
    let stopping = tokio::spawn(a.stop());
    // The drain has begun once a new transfer is refused (one started before waits at the gate
    // too, and finishes in the grace period with the rest); only then does the WRITE go on.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let r = probe
            .write(pb::WriteRequest {
                entry: Some(write_entry(&src, 48 * MIB, &dst, 48 * MIB, 1)),
                ..Default::default()
            })
            .await;
        match r {
            Err(e) if e.code() == tonic::Code::Unavailable => break,
            Err(e) => panic!("a probe write while draining: {e}"),
            Ok(_) => {}
        }
        assert!(std::time::Instant::now() < deadline, "no drain within 30 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    hold::open_gate();
    // The in-flight WRITE finishes within the grace period; then the daemon closes.
    let ev = s.next().await;
    assert_eq!(ev.tag, 1);
    let t = finished(&ev);
    assert_eq!(t.status_code, 0, "{}", t.status_message);
    s.assert_eof().await;
    stopping.await.unwrap();
    assert_eq!(crc(&mut b.client, dst.id, 0, 32 * MIB).await, want);
    b.stop().await;
}
