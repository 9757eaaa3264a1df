//! Addressed feeds (session 31, feeds; #39 point 5): a subscriber that names itself
//! (`SubscribeRequest.addressed_to`) gets only the notifications addressed to it — tcpxd.nixl's
//! frames whose `to` is that name — in order, and nothing addressed to another agent on the same
//! daemon; a subscriber that names nothing (tcpxctl subscribe, a plain client) still gets every
//! notification of the node. On the framed local session and on the gRPC stream alike.

use crate::common::daemons::*;
use crate::common::framed::*;
use tcpxd::api::proto::v1 as pb;
use tcpxd::api::proto::v1::session_event::Event;
use tcpxd::api::proto::v1::session_request::Op;

/// tcpxd.nixl's framing (python/src/tcpxd/nixl/_notify.py, `frame`).
fn frame(from: &str, to: &str, msg: &str) -> Vec<u8> {
    let mut f = b"\0NIXL1".to_vec();
    f.extend_from_slice(&(from.len() as u16).to_be_bytes());
    f.extend_from_slice(&(to.len() as u16).to_be_bytes());
    f.extend_from_slice(from.as_bytes());
    f.extend_from_slice(to.as_bytes());
    f.extend_from_slice(msg.as_bytes());
    f
}

async fn subscribe(s: &mut Framed, tag: u64, to: &str) {
    let req = pb::SubscribeRequest {
        addressed_to: to.into(),
    };
    s.send(tag, Op::Subscribe(req)).await;
    let ev = s.next().await;
    assert!(
        matches!(ev.event, Some(Event::Subscribed(_))) && ev.tag == tag,
        "{ev:?}"
    );
}

async fn payload(s: &mut Framed, tag: u64) -> Vec<u8> {
    let ev = s.next().await;
    match ev.event {
        Some(Event::Notification(n)) if ev.tag == tag => n.payload,
        other => panic!(
            "tag {}: expected a notification under {tag}, got {other:?}",
            ev.tag
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_addressed_feed_gets_only_its_own_notifications() {
    tcpxd::logging::init("warn");
    let (mut a, mut b) = pair("addressed-feeds").await;
    let src = host_buffer(&mut a.client, 4096, "").await;
    let dst = host_buffer(&mut b.client, 4096, "").await;
    let mut to_b = Framed::open(&b.daemon.api_socket).await;
    let mut to_c = Framed::open(&b.daemon.api_socket).await;
    let mut all = Framed::open(&b.daemon.api_socket).await;
    subscribe(&mut to_b, 3, "agent-b").await;
    subscribe(&mut to_c, 4, "agent-c").await;
    subscribe(&mut all, 5, "").await;
    let mut grpc_b = b
        .client
        .subscribe(pb::SubscribeRequest {
            addressed_to: "agent-b".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let sent = [
        frame("agent-a", "agent-b", "one"),
        frame("agent-a", "agent-c", "two"),
        b"not a frame".to_vec(),
        frame("agent-b", "agent-bb", "three"), // from b, to a longer name
        frame("agent-a", "agent-b", "four"),
        frame("agent-a", "agent-c", "five"),
    ];
    for note in &sent {
        write(&mut a.client, write_entry(&src, 0, &dst, 0, 4096), note)
            .await
            .unwrap();
    }
    // Each feed's notifications in order, none between: the next after "one" is "four".
    for want in [&sent[0], &sent[4]] {
        assert_eq!(&payload(&mut to_b, 3).await, want);
        let n = grpc_b.message().await.unwrap().expect("the stream goes on");
        assert_eq!(&n.payload, want);
    }
    for want in [&sent[1], &sent[5]] {
        assert_eq!(&payload(&mut to_c, 4).await, want);
    }
    for want in &sent {
        assert_eq!(&payload(&mut all, 5).await, want, "the unaddressed feed gets all");
    }
    // Nothing else was queued on the addressed feeds: their next event is the answer to this.
    for (s, tag) in [(&mut to_b, 3), (&mut to_c, 4)] {
        s.send(9, Op::CancelTag(tag)).await;
        let ev = s.next().await;
        assert!(
            ev.tag == 9 && matches!(ev.event, Some(Event::Cancelled(_))),
            "expected the cancel's answer, got {ev:?}"
        );
    }
    for s in [&mut to_b, &mut to_c, &mut all] {
        half_close(s).await;
        s.assert_eof().await;
    }
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
}
