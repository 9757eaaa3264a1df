//! Hostile inline transfers (peer protocol 11, engine `inline.rs`): a fake peer sends
//! `InlineTransfer` messages that break each rule the receiver checks before any byte lands —
//! a wrong key, a payload that is not the ranges' total, one past the daemon's inline limit, a
//! READ it never asked for, no ranges, ranges that cannot be read — each refused with `Reject`
//! naming the field or range, nothing written, the pairing up; then a good one lands and is
//! answered `Done`.

use super::*;
use ppb::peer_message::Body;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_inline_transfers_are_refused_and_change_nothing() {
    tcpxd::logging::init("error");
    let cfg = patient_config("inline");
    let mut b = daemons::start("host-inline-b", |a| {
        a.config = Some(cfg.clone());
        a.inline.inline_max_bytes = Some(8192);
    })
    .await;
    let dst = host_buffer(&mut b.client, SIZE, "dst").await;
    fill_seed(&mut b.client, dst.id, 0, 0, 1).await;
    let before = snapshot(&mut [&mut b.client]).await;
    let key = key_of(&dst);
    let mut bad_key = key.clone();
    bad_key[3] ^= 1;
    let mut fake = fake_peer(&b.peer_addr(), "host-inline-p").await;
    let inline = |id: u64, read_id: u64, ranges: Vec<ppb::RemoteRange>, payload: usize| {
        msg(Body::InlineTransfer(ppb::InlineTransfer {
            header: Some(ppb::Offer {
                offer_id: id,
                read_id,
                ranges,
                deadline_ms: 10_000,
                ..Default::default()
            }),
            payload: vec![0xAB; payload],
        }))
    };
    let cases: Vec<(ppb::PeerMessage, Code, u32, &str)> = vec![
        (
            inline(
                1,
                0,
                vec![range(dst.id, &key, 0, 10), range(dst.id, &bad_key, 10, 10)],
                20,
            ),
            Code::PermissionDenied,
            1,
            "ranges[1]: wrong access key",
        ),
        (
            inline(2, 0, vec![range(dst.id, &key, 0, 10)], 9),
            Code::InvalidArgument,
            0,
            "payload: 9 bytes inline for ranges of 10",
        ),
        (
            inline(3, 0, vec![range(dst.id, &key, 0, 8193)], 8193),
            Code::InvalidArgument,
            0,
            "inline limit of 8192",
        ),
        (
            inline(4, 77, vec![range(dst.id, &key, 0, 10)], 10),
            Code::NotFound,
            0,
            "read 77 is unknown",
        ),
        (
            inline(5, 0, vec![], 0),
            Code::InvalidArgument,
            0,
            "ranges: 0 ranges",
        ),
        (
            inline(6, 0, vec![range(dst.id, &key, SIZE - 5, 10)], 10),
            Code::InvalidArgument,
            0,
            "ranges[0].offset",
        ),
        (
            inline(7, 0, vec![range(dst.id + 100, &key, 0, 10)], 10),
            Code::NotFound,
            0,
            "does not exist",
        ),
    ];
    for (m, code, index, words) in cases {
        fake.tx.send(m).await.unwrap();
        match fake.next().await {
            Body::Reject(r) => {
                assert_eq!(
                    (r.code, r.range_index),
                    (code as i32, index),
                    "{words}: {}",
                    r.message
                );
                assert!(r.message.contains(words), "{words}: {}", r.message);
            }
            other => panic!("{words}: expected a Reject, got {other:?}"),
        }
    }
    // Packed ranges that cannot be read: refused naming the field, the pairing up.
    fake.tx
        .send(msg(Body::InlineTransfer(ppb::InlineTransfer {
            header: Some(ppb::Offer {
                offer_id: 8,
                packed: Some(ppb::PackedRanges {
                    buffer_id: dst.id,
                    access_key: key.clone(),
                    offsets: vec![1, 2, 3],
                    ..Default::default()
                }),
                ..Default::default()
            }),
            payload: vec![1; 4],
        })))
        .await
        .unwrap();
    match fake.next().await {
        Body::Reject(r) => assert!(r.message.starts_with("header.packed"), "{}", r.message),
        other => panic!("unreadable ranges: expected a Reject, got {other:?}"),
    }
    assert_eq!(snapshot(&mut [&mut b.client]).await, before, "nothing written");

    // A good one: landed, answered Done.
    fake.tx
        .send(inline(
            9,
            0,
            vec![range(dst.id, &key, 100, 7), range(dst.id, &key, 5000, 3)],
            10,
        ))
        .await
        .unwrap();
    match fake.next().await {
        Body::Done(d) => assert_eq!(d.offer_id, 9),
        other => panic!("expected Done, got {other:?}"),
    }
    assert_eq!(bytes(&mut b.client, dst.id, 100, 7).await, vec![0xAB; 7]);
    assert_eq!(bytes(&mut b.client, dst.id, 5000, 3).await, vec![0xAB; 3]);
    let s = b
        .client
        .get_stats(pb::GetStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    let p = s
        .peers
        .iter()
        .find(|p| p.node_id == "host-inline-p")
        .expect("the fake peer");
    assert_eq!(p.state, pb::PeerState::Up as i32, "{p:?}");
    assert_eq!(
        p.received_inline, 8,
        "the unreadable one never reached the engine: {p:?}"
    );
    drop(fake);
    b.stop().await;
}
