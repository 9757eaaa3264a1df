//! Hostile peers: handshakes, control-stream openings and every control message from a fake peer.
//! The cases are built in `peer/handshake.rs` (handshakes, malformed protobuf, control-stream
//! openings), `peer/messages.rs` (offers, read requests, messages about unknown ids) and
//! `peer/blocks.rs` (block offers and reads); this file starts the daemon, sends them, and checks
//! what a rekey, the ignored messages and protocol violations do.

use super::*;

mod blocks;
mod handshake;
mod messages;

use messages::{Ids, Names};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_peer_messages_are_refused_and_change_nothing() {
    tcpxd::logging::init("error");
    let cfg = patient_config("b");
    // Offers are the rendezvous protocol's (an eager daemon refuses them all alike); eager
    // headers have their own test below.
    let mut b = daemons::start("host-b", |a| {
        a.config = Some(cfg.clone());
        a.transfer_protocol = Some("rendezvous".into());
    })
    .await;
    let dst = host_buffer(&mut b.client, SIZE, "dst").await;
    let other = host_buffer(&mut b.client, MIB, "other").await;
    fill_seed(&mut b.client, dst.id, 0, 0, 1).await;
    fill_seed(&mut b.client, other.id, 0, 0, 2).await;
    // Block lists for the block offers and reads below: 16 blocks of 4 KiB, and three of 4096,
    // 1000 and 4096 bytes.
    let blk = host_buffer(&mut b.client, MIB, "blk").await;
    fill_seed(&mut b.client, blk.id, 0, 0, 3).await;
    let mut register = async |layout| {
        b.client
            .register_blocks(pb::RegisterBlocksRequest {
                reattach_id: Default::default(),
                buffer_id: blk.id,
                layout: Some(layout),
            })
            .await
            .unwrap()
            .into_inner()
            .id
    };
    use pb::register_blocks_request::Layout as L;
    let uniform = register(L::Strided(pb::StridedBlocks {
        first: 0,
        stride: 8192,
        length: 4096,
        count: 16,
    }))
    .await;
    let mixed = register(L::Explicit(pb::ExplicitBlocks {
        offsets: [0u64, 100_000, 200_000]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        lengths: [4096u32, 1000, 4096]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
    }))
    .await;
    let blk_key = key_of(&blk);
    let before = snapshot(&mut [&mut b.client]).await;
    let key = key_of(&dst);
    let mut n = 0usize;

    handshake::handshake_and_openings(&mut b, &mut n).await;

    // ---- Control messages --------------------------------------------------------------------
    let mut fake = fake_peer(&b.peer_addr(), "host-p").await;
    let names = Names {
        dst: dst.clone(),
        key: key.clone(),
        other: other.clone(),
        blk_key: blk_key.clone(),
        uniform,
        mixed,
    };
    let mut ids = Ids::new(fake.lanes.offer_lane);
    let mut ctl: Vec<(String, Ctl)> = Vec::new();
    messages::offer_cases(&names, &mut ids, &fake.lanes, &mut ctl);
    messages::read_cases(&names, &mut ids, &mut ctl);
    blocks::block_cases(&names, &mut ids, &mut ctl);
    messages::ignored_cases(&mut ctl);
    use ppb::peer_message::Body;

    for (name, case) in ctl {
        n += 1;
        match case {
            Ctl::Offer(o, code, words, idx) => {
                let id = o.offer_id;
                fake.tx.send(msg(Body::Offer(o))).await.unwrap();
                match fake.next().await {
                    Body::Reject(r) => {
                        assert_eq!(r.offer_id, id, "{name}");
                        assert_eq!(r.code, code as i32, "{name}: {}", r.message);
                        assert!(
                            r.message.contains(words),
                            "{name}: {:?} lacks {words:?}",
                            r.message
                        );
                        assert_eq!(r.range_index, idx, "{name}");
                    }
                    other => panic!("{name}: expected a Reject, got {other:?}"),
                }
            }
            Ctl::Read(r, code, words, idx) => {
                let id = r.read_id;
                fake.tx.send(msg(Body::ReadRequest(r))).await.unwrap();
                match fake.next().await {
                    Body::ReadReject(r) => {
                        assert_eq!(r.read_id, id, "{name}");
                        assert_eq!(r.code, code as i32, "{name}: {}", r.message);
                        assert!(
                            r.message.contains(words),
                            "{name}: {:?} lacks {words:?}",
                            r.message
                        );
                        assert_eq!(r.range_index, idx, "{name}");
                    }
                    other => panic!("{name}: expected a ReadReject, got {other:?}"),
                }
            }
            Ctl::Ignored(body) => fake.tx.send(msg(body)).await.unwrap(),
        }
    }
    // A rekey makes the list's tokens stale: the old key is refused for block offers and reads.
    b.client
        .rekey_buffer(pb::RekeyBufferRequest { buffer_id: blk.id })
        .await
        .unwrap();
    n += 1;
    let mut o = ids.offer(Vec::new());
    o.blocks = Some(names.on_list(uniform, &[1], 4096, 4096));
    let id = o.offer_id;
    fake.tx.send(msg(Body::Offer(o))).await.unwrap();
    match fake.next().await {
        Body::Reject(r) => {
            assert_eq!(
                (r.offer_id, r.code),
                (id, Code::PermissionDenied as i32),
                "{}",
                r.message
            );
            assert!(
                r.message.starts_with("blocks.access_key: wrong access key"),
                "{}",
                r.message
            );
        }
        other => panic!("stale block offer: {other:?}"),
    }
    n += 1;
    let mut r = ids.read(Vec::new());
    r.blocks = Some(ppb::ReadBlocks {
        source_key: blk_key.clone(),
        ..names.read_blocks(uniform, blocks::le(&[0]))
    });
    let id = r.read_id;
    fake.tx.send(msg(Body::ReadRequest(r))).await.unwrap();
    match fake.next().await {
        Body::ReadReject(r) => {
            assert_eq!(
                (r.read_id, r.code),
                (id, Code::PermissionDenied as i32),
                "{}",
                r.message
            );
            assert!(
                r.message.starts_with("blocks.source_key: wrong access key"),
                "{}",
                r.message
            );
        }
        other => panic!("stale block read: {other:?}"),
    }
    // The ignored messages did no harm: the stream answers in order and the peer is not failed.
    let probe = ids.offer(vec![range(dst.id, &key, SIZE, 1)]);
    let probe_id = probe.offer_id;
    fake.tx.send(msg(Body::Offer(probe))).await.unwrap();
    match fake.next().await {
        Body::Reject(r) => assert_eq!(r.offer_id, probe_id),
        other => panic!("after the ignored messages: {other:?}"),
    }
    let peers = b
        .client
        .list_peers(pb::ListPeersRequest {})
        .await
        .unwrap()
        .into_inner()
        .peers;
    let p = peers
        .iter()
        .find(|p| p.node_id == "host-p")
        .expect("the fake peer");
    assert_ne!(p.state, pb::PeerState::Failed as i32, "{p:?}");

    // Protocol violations end the pairing (and nothing else).
    n += 1;
    fake.tx.send(ppb::PeerMessage { body: None }).await.unwrap();
    let end = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match fake.rx.message().await {
                Ok(Some(_)) => continue,
                other => return other.map(|_| ()),
            }
        }
    })
    .await
    .expect("the daemon closes the stream");
    let _ = end;
    let second = fake_peer(&b.peer_addr(), "host-q").await;
    n += 1;
    second
        .tx
        .send(msg(Body::Hello(ppb::Hello {
            session_id: 1,
            node_id: "host-q".into(),
            proof: Vec::new(),
        })))
        .await
        .unwrap();
    for (node, why) in [("host-p", "without a body"), ("host-q", "second Hello")] {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let peers = b
                .client
                .list_peers(pb::ListPeersRequest {})
                .await
                .unwrap()
                .into_inner()
                .peers;
            let p = peers.iter().find(|p| p.node_id == node).expect("listed");
            if p.state == pb::PeerState::Failed as i32 {
                assert!(p.error.contains(why), "{node}: {}", p.error);
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{node} never failed: {p:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    eprintln!("{n} peer-service cases");
    assert!(n >= 150, "{n} peer-service cases");
    assert_eq!(
        snapshot(&mut [&mut b.client]).await,
        before,
        "a hostile message changed bytes"
    );
    assert_lanes_drain(&mut b.client).await;
    b.stop().await;
    std::fs::remove_file(cfg).ok();
}
