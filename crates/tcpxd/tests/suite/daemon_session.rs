//! One client round trip per transfer: `wait` on the unary calls and the `Session` stream. Every
//! test compares bytes or statuses, and checks that the lanes and transfer slots of both daemons
//! drain back to zero after cancels and resets.

use std::collections::HashMap;
use std::time::Duration;

use crate::common::daemons::*;
use crate::common::hold::{self, freeze_once_lanes_move};
use crate::common::procs::ProcDaemon;
use tcpxd::api::proto::v1 as pb;
use tcpxd::api::proto::v1::session_event::Event;
use tcpxd::api::proto::v1::session_request::Op;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// Payload bytes on `c`'s lanes so far, (sent, received), over every pairing.
async fn lane_bytes(c: &mut Client) -> (u64, u64) {
    let s = c.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    let lanes = s.peers.iter().flat_map(|p| &p.lanes);
    lanes.fold((0, 0), |(tx, rx), l| (tx + l.bytes_sent, rx + l.bytes_received))
}

/// A session: the request sender and the event stream.
struct Session {
    tx: mpsc::Sender<pb::SessionRequest>,
    events: tonic::Streaming<pb::SessionEvent>,
}

/// `a` in process and its peer `b` as a process, which the tests hold stopped (SIGSTOP) to keep a
/// transfer in flight on any plugin (`common::hold`), paired; the hold gate on, closed by a test
/// before each transfer it holds, so that none ends before `b` is stopped.
async fn held_pair(name: &str) -> (TestDaemon, ProcDaemon, Client) {
    hold::gate_on();
    tcpxd::logging::init("warn");
    let mut a = start(&format!("{name}-a"), |_| {}).await;
    let (b, bc) = hold::peer_process(&mut a, &format!("{name}-b"), &[]).await;
    (a, b, bc)
}

async fn open(c: &mut Client) -> Session {
    let (tx, rx) = mpsc::channel(64);
    let events = c
        .session(ReceiverStream::new(rx))
        .await
        .expect("session")
        .into_inner();
    Session { tx, events }
}

impl Session {
    async fn send(&self, tag: u64, op: Op) {
        self.tx
            .send(pb::SessionRequest { tag, op: Some(op) })
            .await
            .expect("session open");
    }

    async fn next(&mut self) -> pb::SessionEvent {
        tokio::time::timeout(Duration::from_secs(30), self.events.message())
            .await
            .expect("an event within 30 s")
            .expect("stream ok")
            .expect("stream not ended")
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_transfers_on_one_session_land_exactly() {
    tcpxd::logging::init("warn");
    let (mut a, mut b) = pair("sess-many").await;
    let src = host_buffer(&mut a.client, 8 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 8 * MIB, "").await;
    let back = host_buffer(&mut a.client, 8 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 77).await;
    let mut s = open(&mut a.client).await;
    // 32 WRITEs of 256 KiB each (several chunk sizes' worth in flight at once), then a batch.
    let block = 256 * KIB;
    for i in 0..32u64 {
        s.send(
            i + 1,
            write_op(write_entry(&src, i * block, &dst, i * block, block)),
        )
        .await;
    }
    let mut seen = HashMap::new();
    for _ in 0..32 {
        let ev = s.next().await;
        let Some(Event::Finished(t)) = ev.event else {
            panic!("expected a finished event, got {ev:?}");
        };
        assert_eq!(t.status_code, 0, "tag {}: {}", ev.tag, t.status_message);
        assert_eq!(t.total_bytes, block);
        assert!(
            seen.insert(ev.tag, t.transfer_id).is_none(),
            "tag {} twice",
            ev.tag
        );
    }
    assert_eq!(seen.len(), 32);
    // READ it back with a batch, on the same session.
    s.send(
        100,
        Op::ReadBatch(pb::ReadBatchRequest {
            entries: (0..8)
                .map(|i| read_entry(&dst, i * MIB, &back, i * MIB, MIB))
                .collect(),
            timeout_ms: 60_000,
            ..Default::default()
        }),
    )
    .await;
    let ev = s.next().await;
    assert_eq!(ev.tag, 100);
    let Some(Event::Finished(t)) = ev.event else {
        panic!("{ev:?}")
    };
    assert_eq!(t.status_code, 0, "{}", t.status_message);
    assert_eq!(t.entries.len(), 8);
    let want = crc(&mut a.client, src.id, 0, 8 * MIB).await;
    assert_eq!(crc(&mut b.client, dst.id, 0, 8 * MIB).await, want);
    assert_eq!(crc(&mut a.client, back.id, 0, 8 * MIB).await, want);
    // Half-closed with nothing in flight: the stream ends OK.
    drop(s.tx);
    assert!(s.events.message().await.expect("ends OK").is_none());
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_and_the_session_goes_on() {
    tcpxd::logging::init("warn");
    let (mut a, mut b) = pair("sess-bad").await;
    let src = host_buffer(&mut a.client, MIB, "").await;
    let dst = host_buffer(&mut b.client, MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 5).await;
    let mut s = open(&mut a.client).await;
    let refused = |ev: pb::SessionEvent| match ev.event {
        Some(Event::Refused(st)) => (ev.tag, st.code, st.message),
        other => panic!("expected a refusal, got {other:?}"),
    };
    // Zero length.
    s.send(1, write_op(write_entry(&src, 0, &dst, 0, 0))).await;
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (1, tonic::Code::InvalidArgument as i32));
    assert!(msg.contains("entries[0].length"), "{msg}");
    // Past the remote end.
    s.send(2, write_op(write_entry(&src, 0, &dst, MIB - 10, 4096)))
        .await;
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (2, tonic::Code::InvalidArgument as i32));
    assert!(msg.contains("entries[0].remote_offset"), "{msg}");
    // Unknown local buffer.
    let mut e = write_entry(&src, 0, &dst, 0, 10);
    e.local_buffer_id = 9999;
    s.send(3, write_op(e)).await;
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (3, tonic::Code::NotFound as i32));
    assert!(msg.contains("entries[0].local_buffer_id"), "{msg}");
    // No entry, no op, tag zero, cancel of an unknown tag.
    s.send(4, Op::Write(pb::WriteRequest::default())).await;
    let (_, code, msg) = refused(s.next().await);
    assert_eq!(code, tonic::Code::InvalidArgument as i32);
    assert!(msg.contains("entry"), "{msg}");
    s.tx.send(pb::SessionRequest { tag: 5, op: None }).await.unwrap();
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (5, tonic::Code::InvalidArgument as i32));
    assert!(msg.starts_with("op:"), "{msg}");
    s.send(0, write_op(write_entry(&src, 0, &dst, 0, 10))).await;
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (0, tonic::Code::InvalidArgument as i32));
    assert!(msg.starts_with("tag:"), "{msg}");
    s.send(6, Op::CancelTag(424242)).await;
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (6, tonic::Code::NotFound as i32));
    assert!(msg.contains("cancel_tag"), "{msg}");
    // Nothing changed at the destination; a good request on the same session still works.
    assert_eq!(
        crc(&mut b.client, dst.id, 0, MIB).await,
        crc32c::crc32c(&vec![0u8; MIB as usize])
    );
    s.send(7, write_op(write_entry(&src, 0, &dst, 0, MIB))).await;
    let ev = s.next().await;
    assert_eq!(ev.tag, 7);
    assert!(
        matches!(ev.event, Some(Event::Finished(ref t)) if t.status_code == 0),
        "{ev:?}"
    );
    assert_eq!(
        crc(&mut b.client, dst.id, 0, MIB).await,
        crc(&mut a.client, src.id, 0, MIB).await
    );
    assert_lanes_drain(&mut a.client).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_by_tag_and_half_close_drains() {
    let (mut a, b, mut bc) = held_pair("sess-cancel").await;
    let src = host_buffer(&mut a.client, 128 * MIB, "").await;
    let dst = host_buffer(&mut bc, 128 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 9).await;
    let mut s = open(&mut a.client).await;
    // A long WRITE, held in flight.
    hold::close_gate();
    s.send(10, write_op(write_entry(&src, 0, &dst, 0, 120 * MIB)))
        .await;
    let frozen = freeze_once_lanes_move(&mut a.client, &b, 1).await;
    // A tag in use is refused.
    s.send(10, write_op(write_entry(&src, 0, &dst, 0, 10))).await;
    let ev = s.next().await;
    assert_eq!(ev.tag, 10);
    assert!(
        matches!(ev.event, Some(Event::Refused(ref st)) if st.code == tonic::Code::InvalidArgument as i32 && st.message.starts_with("tag:")),
        "{ev:?}"
    );
    s.send(11, Op::CancelTag(10)).await;
    // b goes on once the cancel is answered (the transfer's own event may come before or after).
    let mut frozen = Some(frozen);
    let mut got = HashMap::new();
    for _ in 0..2 {
        let ev = s.next().await;
        if ev.tag == 11 {
            frozen.take().expect("one answer").thaw();
        }
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
    // Half-close with a transfer held in flight: it finishes, its event comes, then the stream
    // ends.
    hold::close_gate();
    s.send(12, write_op(write_entry(&src, 0, &dst, 0, 120 * MIB)))
        .await;
    let frozen = freeze_once_lanes_move(&mut a.client, &b, 1).await;
    drop(s.tx);
    frozen.thaw();
    let ev = tokio::time::timeout(Duration::from_secs(30), s.events.message())
        .await
        .unwrap()
        .unwrap()
        .expect("the in-flight transfer's event");
    assert_eq!(ev.tag, 12);
    assert!(
        matches!(ev.event, Some(Event::Finished(ref t)) if t.status_code == 0),
        "{ev:?}"
    );
    assert!(s.events.message().await.expect("ends OK").is_none());
    assert_eq!(
        crc(&mut bc, dst.id, 0, 120 * MIB).await,
        crc(&mut a.client, src.id, 0, 120 * MIB).await
    );
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut bc).await;
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_cancels_its_transfers_on_both_sides() {
    let (mut a, b, mut bc) = held_pair("sess-reset").await;
    let src = host_buffer(&mut a.client, 128 * MIB, "").await;
    let dst = host_buffer(&mut bc, 128 * MIB, "").await;
    // A session on its own connection, reset mid-transfer: WRITE and READ held in flight.
    let mut own = unix_client(a.daemon.api_socket.clone()).await;
    let s = open(&mut own).await;
    hold::close_gate();
    s.send(1, write_op(write_entry(&src, 0, &dst, 0, 120 * MIB)))
        .await;
    s.send(2, read_op(read_entry(&dst, 0, &src, 0, 120 * MIB))).await;
    let frozen = freeze_once_lanes_move(&mut a.client, &b, 2).await;
    drop(s);
    drop(own);
    // Once b goes on, both sides drain, the WRITE not having run to its end: a's lanes sent less
    // than it (its rest went as empty chunks). (The READ's holder may have posted every chunk
    // whole before the cancel reached it.)
    frozen.thaw();
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut bc).await;
    let (sent, _) = lane_bytes(&mut a.client).await;
    assert!(sent < 120 * MIB, "{sent} bytes sent");
    let stats = bc.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    assert_eq!(stats.active_transfers, 0);
    // Both were counted as cancelled.
    let stats = a
        .client
        .get_stats(pb::GetStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    let cancelled: u64 = stats
        .transfer_totals
        .iter()
        .filter(|t| t.status == "cancelled")
        .map(|t| t.transfers)
        .sum();
    assert_eq!(cancelled, 2, "{:?}", stats.transfer_totals);
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_answers_with_the_final_event_in_one_call() {
    let (mut a, b, mut bc) = held_pair("sess-wait").await;
    let src = host_buffer(&mut a.client, 128 * MIB, "").await;
    let dst = host_buffer(&mut bc, 128 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 31).await;
    // Success: the final event is in the answer; the bytes are there when it comes.
    let r = a
        .client
        .write(pb::WriteRequest {
            entry: Some(write_entry(&src, 0, &dst, 0, 4 * MIB)),
            timeout_ms: 60_000,
            wait: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let f = r.r#final.expect("final event");
    assert_eq!((f.status_code, f.transfer_id), (0, r.transfer_id));
    assert_eq!((f.bytes_done, f.total_bytes), (4 * MIB, 4 * MIB));
    assert_eq!(f.state, pb::TransferState::Finished as i32);
    assert_eq!(
        crc(&mut bc, dst.id, 0, 4 * MIB).await,
        crc(&mut a.client, src.id, 0, 4 * MIB).await
    );
    // A READ batch, per-entry statuses in the final event.
    let r = a
        .client
        .read_batch(pb::ReadBatchRequest {
            entries: vec![
                read_entry(&dst, 0, &src, 8 * MIB, MIB),
                read_entry(&dst, MIB, &src, 9 * MIB, MIB),
            ],
            timeout_ms: 60_000,
            wait: true,
            ranges: None,
        })
        .await
        .unwrap()
        .into_inner();
    let f = r.r#final.expect("final event");
    assert_eq!(f.status_code, 0, "{}", f.status_message);
    assert_eq!(f.entries.len(), 2);
    assert_eq!(
        crc(&mut a.client, src.id, 8 * MIB, 2 * MIB).await,
        crc(&mut a.client, src.id, 0, 2 * MIB).await
    );
    // Failure: the call still answers OK, with the transfer's status in the final event (the
    // transfer held in flight past its deadline, which leaves the test a generous second to see
    // it move and stop b; the gate keeps it from ending first).
    hold::close_gate();
    let mut caller = a.client.clone();
    let (s2, d2) = (src.clone(), dst.clone());
    let call = tokio::spawn(async move {
        caller
            .write(pb::WriteRequest {
                entry: Some(write_entry(&s2, 0, &d2, 0, 120 * MIB)),
                timeout_ms: 1000,
                wait: true,
                ..Default::default()
            })
            .await
    });
    let frozen = freeze_once_lanes_move(&mut a.client, &b, 1).await;
    let r = call.await.unwrap().unwrap().into_inner();
    frozen.thaw();
    let f = r.r#final.expect("final event");
    assert_eq!(
        f.status_code,
        tonic::Code::DeadlineExceeded as i32,
        "{}",
        f.status_message
    );
    // Input refused before the start is still an error status.
    let err = a
        .client
        .write(pb::WriteRequest {
            entry: Some(write_entry(&src, 0, &dst, 0, 0)),
            wait: true,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(err.message().contains("entries[0].length"), "{}", err.message());
    // Without `wait` nothing changes: no final event.
    let r = a
        .client
        .write(pb::WriteRequest {
            entry: Some(write_entry(&src, 0, &dst, 0, MIB)),
            timeout_ms: 60_000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(r.r#final.is_none());
    wait_ok(&mut a.client, r.transfer_id).await;
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut bc).await;
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_waiting_call_cancels_its_transfer() {
    let (mut a, b, mut bc) = held_pair("sess-drop").await;
    let src = host_buffer(&mut a.client, 128 * MIB, "").await;
    let dst = host_buffer(&mut bc, 128 * MIB, "").await;
    let before = lane_bytes(&mut a.client).await.0;
    hold::close_gate();
    let mut caller = a.client.clone();
    let call = tokio::spawn(async move {
        caller
            .write(pb::WriteRequest {
                entry: Some(write_entry(&src, 0, &dst, 0, 120 * MIB)),
                timeout_ms: 60_000,
                wait: true,
                ..Default::default()
            })
            .await
    });
    let frozen = freeze_once_lanes_move(&mut a.client, &b, 1).await;
    call.abort();
    frozen.thaw();
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut bc).await;
    // Cancelled, not run to its end: its rest went as empty chunks.
    let sent = lane_bytes(&mut a.client).await.0 - before;
    assert!(sent < 120 * MIB, "{sent} bytes sent");
    let stats = a
        .client
        .get_stats(pb::GetStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    let cancelled: u64 = stats
        .transfer_totals
        .iter()
        .filter(|t| t.status == "cancelled")
        .map(|t| t.transfers)
        .sum();
    assert_eq!(cancelled, 1, "{:?}", stats.transfer_totals);
    a.stop().await;
}

/// The gRPC session reads on while its starts are on their way (src/api/session/grpc_pending.rs):
/// a tag reused right behind its request is refused, a cancel right behind its request finds
/// the transfer (the session's task polls the start it waits for), and a deep queue sent at once
/// lands byte for byte, each tag answered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_right_behind_a_start_see_it() {
    tcpxd::logging::init("warn");
    let (mut a, mut b) = pair("sess-behind").await;
    let src = host_buffer(&mut a.client, 128 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 128 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 41).await;
    let mut s = open(&mut a.client).await;
    // The same tag twice, then a cancel of it, in one burst: the second is refused, the cancel
    // answered (a 120 MiB WRITE cannot end in the meantime on the emulation; if it did, the
    // cancel is refused FAILED_PRECONDITION and the WRITE's event is OK).
    s.send(1, write_op(write_entry(&src, 0, &dst, 0, 120 * MIB)))
        .await;
    s.send(1, write_op(write_entry(&src, 0, &dst, 0, 10))).await;
    s.send(2, Op::CancelTag(1)).await;
    let mut got: HashMap<u64, Vec<Event>> = HashMap::new();
    for _ in 0..3 {
        let ev = s.next().await;
        got.entry(ev.tag).or_default().push(ev.event.expect("an event"));
    }
    let one = &got[&1];
    assert_eq!(one.len(), 2, "{got:?}");
    assert!(
        one.iter().any(|e| matches!(e, Event::Refused(st) if st.code == tonic::Code::InvalidArgument as i32 && st.message.starts_with("tag:"))),
        "{got:?}"
    );
    let finished = one
        .iter()
        .find_map(|e| match e {
            Event::Finished(t) => Some(t),
            _ => None,
        })
        .expect("the WRITE's event");
    match &got[&2][..] {
        [Event::Cancelled(pb::CancelResponse { cancelled: true })] => {
            assert_eq!(finished.status_code, tonic::Code::Cancelled as i32, "{got:?}")
        }
        [Event::Refused(st)] if st.code == tonic::Code::FailedPrecondition as i32 => {
            assert_eq!(finished.status_code, 0, "{got:?}")
        }
        other => panic!("cancel_tag answered {other:?}"),
    }
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    // 64 WRITEs of 64 KiB sent at once, then READs of them back: every tag answered once, OK,
    // the bytes where they belong.
    let block = 64 * KIB;
    for i in 0..64u64 {
        s.send(
            100 + i,
            write_op(write_entry(&src, i * block, &dst, i * block, block)),
        )
        .await;
    }
    let mut seen = HashMap::new();
    for _ in 0..64 {
        let ev = s.next().await;
        let Some(Event::Finished(t)) = ev.event else {
            panic!("expected a finished event, got {ev:?}");
        };
        assert_eq!(t.status_code, 0, "tag {}: {}", ev.tag, t.status_message);
        assert!(
            seen.insert(ev.tag, t.transfer_id).is_none(),
            "tag {} twice",
            ev.tag
        );
    }
    assert_eq!(seen.keys().copied().min(), Some(100));
    assert_eq!(seen.keys().copied().max(), Some(163));
    for i in 0..64u64 {
        let at = 64 * MIB + i * block;
        s.send(200 + i, read_op(read_entry(&dst, i * block, &src, at, block)))
            .await;
    }
    for _ in 0..64 {
        let ev = s.next().await;
        assert!(
            matches!(ev.event, Some(Event::Finished(ref t)) if t.status_code == 0),
            "{ev:?}"
        );
    }
    let want = crc(&mut a.client, src.id, 0, 64 * block).await;
    assert_eq!(crc(&mut b.client, dst.id, 0, 64 * block).await, want);
    assert_eq!(crc(&mut a.client, src.id, 64 * MIB, 64 * block).await, want);
    drop(s.tx);
    assert!(s.events.message().await.expect("ends OK").is_none());
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}

/// A client that goes away right behind a burst of requests, their starts still on their way:
/// whatever the daemon started is cancelled or ends, on both sides (nothing left active, the
/// lanes and credits back to zero), and the daemon serves the next session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_behind_its_starts_leaves_nothing_running() {
    tcpxd::logging::init("warn");
    let (mut a, mut b) = pair("sess-gone-starts").await;
    let src = host_buffer(&mut a.client, 64 * MIB, "").await;
    let dst = host_buffer(&mut b.client, 64 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 43).await;
    for round in 0..4u64 {
        let mut own = unix_client(a.daemon.api_socket.clone()).await;
        let s = open(&mut own).await;
        for i in 0..16u64 {
            s.send(
                i + 1,
                write_op(write_entry(&src, i * 4 * MIB, &dst, i * 4 * MIB, 4 * MIB)),
            )
            .await;
        }
        // Dropped after a first event in the later rounds: some starts known, some not.
        let mut s = s;
        if round > 0 {
            let _ = s.next().await;
        }
        drop(s);
        drop(own);
        assert_lanes_drain(&mut a.client).await;
        assert_lanes_drain(&mut b.client).await;
    }
    let stats = b
        .client
        .get_stats(pb::GetStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.active_transfers, 0);
    // A new session on the same daemons moves bytes exactly.
    let mut s = open(&mut a.client).await;
    s.send(1, write_op(write_entry(&src, 0, &dst, 0, 8 * MIB))).await;
    let ev = s.next().await;
    assert!(
        matches!(ev.event, Some(Event::Finished(ref t)) if t.status_code == 0),
        "{ev:?}"
    );
    assert_eq!(
        crc(&mut b.client, dst.id, 0, 8 * MIB).await,
        crc(&mut a.client, src.id, 0, 8 * MIB).await
    );
    a.stop().await;
    b.stop().await;
}
