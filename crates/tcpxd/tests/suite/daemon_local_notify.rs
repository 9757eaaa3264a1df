//! Notifications on the framed local session (#39 point 4): a session that subscribes gets each
//! notification its node receives as an event under the subscription's tag, after the data
//! landed, so a client polling its own socket learns of one without another thread; one
//! subscription a session, ended by `cancel_tag` (a second `cancel_tag` is refused saying how it
//! ended); it does not keep a half-closed session open.

use crate::common::daemons::*;
use crate::common::framed::*;
use tcpxd::api::proto::v1 as pb;
use tcpxd::api::proto::v1::session_event::Event;
use tcpxd::api::proto::v1::session_request::Op;

const MIB: u64 = 1 << 20;

fn notification(ev: pb::SessionEvent) -> (u64, pb::Notification) {
    match ev.event {
        Some(Event::Notification(n)) => (ev.tag, n),
        other => panic!("tag {}: expected a notification, got {other:?}", ev.tag),
    }
}

async fn subscribe(s: &mut Framed, tag: u64) {
    s.send(tag, Op::Subscribe(pb::SubscribeRequest::default())).await;
    let ev = s.next().await;
    assert!(
        matches!(ev.event, Some(Event::Subscribed(_))) && ev.tag == tag,
        "{ev:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscribed_session_gets_each_notification_after_its_data() {
    tcpxd::logging::init("warn");
    let (mut a, mut b) = pair("local-notify").await;
    let src = host_buffer(&mut a.client, MIB, "").await;
    let dst = host_buffer(&mut b.client, MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 3939).await;
    let mut one = Framed::open(&b.daemon.api_socket).await;
    let mut two = Framed::open(&b.daemon.api_socket).await;
    subscribe(&mut one, 7).await;
    subscribe(&mut two, 1).await;
    // One subscription a session, refused by name; the tag is taken while subscribed.
    one.send(8, Op::Subscribe(pb::SubscribeRequest::default())).await;
    assert_eq!(
        refused(one.next().await),
        (
            8,
            tonic::Code::InvalidArgument as i32,
            "subscribe: this session is subscribed already (tag 7); one subscription a session".into()
        )
    );
    one.send(7, Op::CancelTag(99)).await;
    let (tag, code, msg) = refused(one.next().await);
    assert_eq!((tag, code), (7, tonic::Code::InvalidArgument as i32), "{msg}");
    // A WRITE into b with a notification: both sessions get it, the bytes already there.
    for (i, note) in [b"first".as_slice(), b"second"].into_iter().enumerate() {
        let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, MIB), note)
            .await
            .unwrap();
        for (s, tag) in [(&mut one, 7), (&mut two, 1)] {
            let (got_tag, n) = notification(s.next().await);
            assert_eq!(got_tag, tag);
            assert_eq!(
                (n.payload.as_slice(), n.transfer_id, n.buffer_ids.as_slice()),
                (note, id, [dst.id].as_slice()),
                "notification {i}"
            );
            assert_eq!(n.from_node, "local-notify-a");
            assert_eq!(
                crc(&mut b.client, dst.id, 0, 0).await,
                crc(&mut a.client, src.id, 0, 0).await
            );
        }
    }
    // Unsubscribed by cancel_tag: the next notification reaches `two` only. (Had `one` still
    // been subscribed, it would have had the notification queued before the request that
    // follows: the session hands notifications out before it reads requests.)
    one.send(9, Op::CancelTag(7)).await;
    let ev = one.next().await;
    assert_eq!(ev.tag, 9);
    assert!(
        matches!(
            ev.event,
            Some(Event::Cancelled(pb::CancelResponse { cancelled: true }))
        ),
        "{ev:?}"
    );
    write(&mut a.client, write_entry(&src, 0, &dst, 0, 4096), b"third")
        .await
        .unwrap();
    assert_eq!(notification(two.next().await).1.payload, b"third");
    // Cancelled again once it ended: refused, saying how it ended; still unsubscribed.
    one.send(10, Op::CancelTag(7)).await;
    let (tag, code, msg) = refused(one.next().await);
    assert_eq!((tag, code), (10, tonic::Code::FailedPrecondition as i32), "{msg}");
    assert_eq!(
        msg,
        "cancel_tag: tag 7 already finished (a subscription, cancelled by tag 9); nothing was cancelled"
    );
    write(&mut a.client, write_entry(&src, 0, &dst, 0, 4096), b"fourth")
        .await
        .unwrap();
    assert_eq!(notification(two.next().await).1.payload, b"fourth");
    // A tag never used is still NOT_FOUND.
    one.send(11, Op::CancelTag(424_242)).await;
    let (tag, code, _) = refused(one.next().await);
    assert_eq!((tag, code), (11, tonic::Code::NotFound as i32));
    // A subscription does not keep a half-closed session open.
    for s in [&mut one, &mut two] {
        half_close(s).await;
        s.assert_eof().await;
    }
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
}
