//! The framed local session's events written from where they are known (session 21): a
//! transfer's final event from the thread that finished it, a notification from the thread that
//! published it, every event through the connection's one outbox (src/api/local/outbox.rs,
//! inline.rs). What must hold: one event per tag, whole frames in order, a tag free again once
//! its event came, a client that reads nothing is not read from (backpressure) and loses
//! nothing but notifications, which it is told it missed.

use std::collections::HashSet;

use crate::common::daemons::*;
use crate::common::framed::*;
use prost::Message;
use tcpxd::api::proto::v1 as pb;
use tcpxd::api::proto::v1::session_event::Event;
use tcpxd::api::proto::v1::session_request::Op;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn frame(tag: u64, op: Op) -> Vec<u8> {
    let body = pb::SessionRequest { tag, op: Some(op) }.encode_to_vec();
    let mut f = (body.len() as u32).to_be_bytes().to_vec();
    f.extend(body);
    f
}

async fn read_event(rd: &mut (impl AsyncReadExt + Unpin)) -> pb::SessionEvent {
    let mut head = [0u8; 4];
    rd.read_exact(&mut head).await.expect("an event");
    let mut body = vec![0u8; u32::from_be_bytes(head) as usize];
    rd.read_exact(&mut body).await.expect("a whole frame");
    pb::SessionEvent::decode(&body[..]).expect("a SessionEvent")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tag_is_free_again_as_soon_as_its_event_came() {
    tcpxd::logging::init("warn");
    let (mut a, mut b) = pair("inline-tags").await;
    let src = host_buffer(&mut a.client, MIB, "").await;
    let dst = host_buffer(&mut b.client, MIB, "").await;
    let near = host_buffer(&mut a.client, MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 2121).await;
    let mut s = Framed::open(&a.daemon.api_socket).await;
    // 4 KiB WRITEs to the peer, then READs back within the node, all under tag 1: each is
    // accepted the moment the previous one's event is read (its delivery freed the tag first).
    for i in 0..64u64 {
        s.send(
            1,
            write_op(write_entry(&src, i * 4 * KIB, &dst, i * 4 * KIB, 4 * KIB)),
        )
        .await;
        let ev = s.next().await;
        let t = finished(&ev);
        assert_eq!((ev.tag, t.status_code), (1, 0), "WRITE {i}: {}", t.status_message);
        assert_eq!(t.total_bytes, 4 * KIB);
    }
    for i in 0..64u64 {
        s.send(
            1,
            read_op(read_entry(&src, i * 4 * KIB, &near, i * 4 * KIB, 4 * KIB)),
        )
        .await;
        let ev = s.next().await;
        let t = finished(&ev);
        assert_eq!((ev.tag, t.status_code), (1, 0), "READ {i}: {}", t.status_message);
    }
    let want = crc(&mut a.client, src.id, 0, 256 * KIB).await;
    assert_eq!(crc(&mut b.client, dst.id, 0, 256 * KIB).await, want);
    assert_eq!(crc(&mut a.client, near.id, 0, 256 * KIB).await, want);
    // A failure is delivered the same way, its status naming the field.
    s.send(1, write_op(write_entry(&src, 0, &dst, MIB - KIB, 4 * KIB)))
        .await;
    let (tag, code, msg) = refused(s.next().await);
    assert_eq!((tag, code), (1, tonic::Code::InvalidArgument as i32), "{msg}");
    assert!(msg.contains("entries[0].remote_offset"), "{msg}");
    half_close(&mut s).await;
    s.assert_eof().await;
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
}

async fn ok_total(c: &mut Client) -> u64 {
    let stats = c.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    stats
        .transfer_totals
        .iter()
        .filter(|t| t.status == "ok")
        .map(|t| t.transfers)
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reads_no_events_is_not_read_from_and_then_gets_them_all() {
    tcpxd::logging::init("warn");
    let mut a = start("inline-backlog", |_| {}).await;
    let src = host_buffer(&mut a.client, MIB, "").await;
    let dst = host_buffer(&mut a.client, MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 4242).await;
    let s = Framed::open(&a.daemon.api_socket).await;
    let (mut rd, mut wr) = s.io.into_split();
    // 40,000 copies within the node (each finished as its request is read), sent without
    // reading an event: their events (~1 MiB) are more than the outbox keeps with the socket
    // full (BACKLOG, 256 KiB, and the socket buffers), so the daemon stops
    // reading requests until the client reads, and the client's writes stop too.
    const N: u64 = 40_000;
    let mut all = Vec::new();
    for i in 0..N {
        let off = (i % 256) * 4 * KIB;
        all.extend(frame(i + 1, write_op(write_entry(&src, off, &dst, off, 4 * KIB))));
    }
    let writer = tokio::spawn(async move {
        wr.write_all(&all).await.expect("the requests written");
        wr
    });
    // The daemon's count of finished transfers stops short of N (a count that stays put for a
    // second: a daemon merely slow only makes it stop sooner).
    let (mut last, mut still) = (u64::MAX, 0);
    while still < 10 {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let now = ok_total(&mut a.client).await;
        still = if now == last { still + 1 } else { 0 };
        last = now;
    }
    assert!(
        last < N,
        "the daemon read all {N} requests while none of their events was read"
    );
    assert!(!writer.is_finished());
    let mut seen = HashSet::new();
    for _ in 0..N {
        let ev = read_event(&mut rd).await;
        let t = finished(&ev);
        assert_eq!(t.status_code, 0, "tag {}: {}", ev.tag, t.status_message);
        assert!(seen.insert(ev.tag), "tag {} twice", ev.tag);
    }
    assert_eq!(seen.len() as u64, N);
    let mut wr = writer.await.unwrap();
    assert_eq!(
        crc(&mut a.client, dst.id, 0, MIB).await,
        crc(&mut a.client, src.id, 0, MIB).await
    );
    wr.shutdown().await.unwrap();
    let mut rest = Vec::new();
    rd.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty(), "{} bytes after the last event", rest.len());
    assert_lanes_drain(&mut a.client).await;
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_that_reads_nothing_is_told_how_many_it_missed() {
    tcpxd::logging::init("warn");
    let mut a = start("inline-lag", |_| {}).await;
    let src = host_buffer(&mut a.client, MIB, "").await;
    let dst = host_buffer(&mut a.client, MIB, "").await;
    let mut sub = Framed::open(&a.daemon.api_socket).await;
    sub.send(5, Op::Subscribe(pb::SubscribeRequest::default())).await;
    assert!(matches!(sub.next().await.event, Some(Event::Subscribed(_))));
    // Same-node WRITEs with 1 KiB notifications, more than the outbox keeps and the node's
    // notification queue (4,096) holds together, while the subscriber reads nothing.
    const N: u64 = 6_000;
    let note = vec![7u8; 1024];
    let mut w = Framed::open(&a.daemon.api_socket).await;
    for i in 0..N {
        let mut op = write_entry(&src, 0, &dst, 0, 4 * KIB);
        op.local_offset = (i % 16) * 4 * KIB;
        w.send(
            i + 1,
            Op::Write(pb::WriteRequest {
                entry: Some(op),
                notification: note.clone(),
                timeout_ms: 60_000,
                ..Default::default()
            }),
        )
        .await;
        let ev = w.next().await;
        assert_eq!(finished(&ev).status_code, 0);
    }
    let (mut got, mut missed) = (0u64, 0u64);
    while got + missed < N {
        let ev = sub.next().await;
        assert_eq!(ev.tag, 5);
        match ev.event {
            Some(Event::Notification(n)) => {
                assert_eq!(n.payload, note);
                got += 1;
            }
            Some(Event::Refused(st)) => {
                assert_eq!(st.code, tonic::Code::DataLoss as i32, "{}", st.message);
                let k: u64 = st
                    .message
                    .strip_prefix("subscribe: this session fell behind and missed ")
                    .and_then(|m| m.split(' ').next())
                    .and_then(|k| k.parse().ok())
                    .unwrap_or_else(|| panic!("{}", st.message));
                missed += k;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(got + missed, N);
    assert!(missed > 0 && got > 0, "got {got}, missed {missed}");
    // Still subscribed: the next one comes.
    w.send(N + 1, write_op(write_entry(&src, 0, &dst, 0, KIB))).await;
    finished(&w.next().await);
    for s in [&mut sub, &mut w] {
        half_close(s).await;
    }
    sub.assert_eof().await;
    w.assert_eof().await;
    a.stop().await;
}
