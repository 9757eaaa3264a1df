//! Hostile offers on a routed pairing, in CI: a fake peer announcing GPUs makes its pairing
//! with a daemon without any routed (its lanes are the memory pairs' catalogue: `routes.rs`), so
//! an offer must name a rendezvous lane of its source memory's group. Eager lanes and lanes past
//! the catalogue are refused naming `first_lane`, and change nothing; the group's lane is
//! accepted, on a lane of the (host, host) group.

use super::*;
use ppb::peer_message::Body;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offers_on_a_routed_pairing_must_name_their_memory_pairs_lanes() {
    tcpxd::logging::init("error");
    let cfg = patient_config("routed");
    let mut b = daemons::start("host-routed-b", |a| {
        a.config = Some(cfg.clone());
        a.transfer_protocol = Some("rendezvous".into());
    })
    .await;
    let dst = host_buffer(&mut b.client, SIZE, "dst").await;
    fill_seed(&mut b.client, dst.id, 0, 0, 1).await;
    let before = snapshot(&mut [&mut b.client]).await;
    let key = key_of(&dst);
    let mut fake = fake_peer_with(&b.peer_addr(), "host-routed-p", Some(gpu_topology(2))).await;
    let lanes = fake.lanes.clone();
    assert!(lanes.routed, "{lanes:?}");
    let offer = |id: u64, first_lane: u32| ppb::Offer {
        offer_id: id,
        chunk_bytes: 512 * 1024,
        first_lane,
        ranges: vec![range(dst.id, &key, 0, 4096)],
        deadline_ms: 10_000,
        ..Default::default()
    };
    let bad = lanes.bad_offer_lanes();
    assert!(bad.len() >= 6, "{bad:?}");
    for (i, fl) in bad.into_iter().enumerate() {
        let id = 100 + i as u64;
        fake.tx.send(msg(Body::Offer(offer(id, fl)))).await.unwrap();
        match fake.next().await {
            Body::Reject(r) => {
                assert_eq!(
                    (r.offer_id, r.code),
                    (id, Code::InvalidArgument as i32),
                    "first_lane {fl}: {}",
                    r.message
                );
                assert!(r.message.contains("first_lane"), "{}", r.message);
            }
            other => panic!("first_lane {fl}: expected a Reject, got {other:?}"),
        }
    }
    // The group's own lane: accepted, naming a lane of the same group (the receiver rotates over
    // its rendezvous lanes).
    fake.tx
        .send(msg(Body::Offer(offer(200, lanes.offer_lane))))
        .await
        .unwrap();
    match fake.next().await {
        Body::Accept(a) => {
            assert_eq!(a.offer_id, 200);
            let l = a.first_lane.expect("a routed accept names its first lane");
            assert!(lanes.offer_lanes.contains(&l), "{l}: {lanes:?}");
        }
        other => panic!("expected an Accept, got {other:?}"),
    }
    // The fake never sends: dropping it fails the pairing, which gives the receives back.
    drop(fake);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let peers = b
            .client
            .list_peers(pb::ListPeersRequest {})
            .await
            .unwrap()
            .into_inner()
            .peers;
        let p = peers
            .iter()
            .find(|p| p.node_id == "host-routed-p")
            .expect("listed");
        if p.state == pb::PeerState::Failed as i32 {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never failed: {p:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        snapshot(&mut [&mut b.client]).await,
        before,
        "a hostile offer changed bytes"
    );
    assert_lanes_drain(&mut b.client).await;
    b.stop().await;
    std::fs::remove_file(cfg).ok();
}
