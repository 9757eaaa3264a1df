//! Hostile packed ranges (peer protocol 6, `PackedRanges`) from a fake peer: every malformed or
//! out-of-bounds field of a packed offer or read request is refused naming the field, the limit
//! and the range; a packed header the daemon cannot read fails the pairing; no byte changes.

use super::*;
use ppb::peer_message::Body;

fn le(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn packed(
    buffer_id: u64,
    key: &[u8],
    offsets: &[u64],
    lengths: &[u64],
    uniform_length: u64,
) -> ppb::PackedRanges {
    ppb::PackedRanges {
        buffer_id,
        access_key: key.to_vec(),
        offsets: le(offsets),
        lengths: le(lengths),
        uniform_length,
        offset_slots: Vec::new(),
    }
}

/// Offsets as u32 slots of `uniform_length` (peer protocol 9).
fn slotted(buffer_id: u64, key: &[u8], slots: &[u32], uniform_length: u64) -> ppb::PackedRanges {
    ppb::PackedRanges {
        offset_slots: slots.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ..packed(buffer_id, key, &[], &[], uniform_length)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_packed_ranges_are_refused_and_change_nothing() {
    tcpxd::logging::init("error");
    let cfg = patient_config("packed");
    let mut b = daemons::start("host-b", |a| {
        a.config = Some(cfg.clone());
        a.transfer_protocol = Some("rendezvous".into());
    })
    .await;
    let dst = host_buffer(&mut b.client, SIZE, "dst").await;
    let other = host_buffer(&mut b.client, MIB, "other").await;
    fill_seed(&mut b.client, dst.id, 0, 0, 1).await;
    fill_seed(&mut b.client, other.id, 0, 0, 2).await;
    let before = snapshot(&mut [&mut b.client]).await;
    let (key, other_key) = (key_of(&dst), key_of(&other));
    let mut fake = fake_peer(&b.peer_addr(), "host-p").await;

    // ---- Offers: (name, packed, per-range ranges beside it, code, message start, range) ------
    let good = || packed(dst.id, &key, &[0, 8192], &[], 4096);
    let many: Vec<u64> = (0..4096u64).map(|i| i * 1024).collect();
    let mut past = many.clone();
    past[4095] = SIZE - 1023;
    let offers: Vec<(&str, ppb::PackedRanges, usize, Code, String, u32)> = vec![
        (
            "offsets not whole",
            ppb::PackedRanges {
                offsets: vec![0; 12],
                ..good()
            },
            0,
            Code::InvalidArgument,
            "packed.offsets: 12 bytes are not a whole number of u64 offsets".into(),
            0,
        ),
        (
            "no offsets",
            packed(dst.id, &key, &[], &[], 4096),
            0,
            Code::InvalidArgument,
            "packed.offsets: 0 ranges (1 to 65536 allowed)".into(),
            0,
        ),
        (
            "65,537 offsets",
            packed(dst.id, &key, &vec![0; 65_537], &[], 1),
            0,
            Code::InvalidArgument,
            "packed.offsets: 65537 ranges (1 to 65536 allowed)".into(),
            0,
        ),
        (
            "a 15-byte key",
            ppb::PackedRanges {
                access_key: vec![1; 15],
                ..good()
            },
            0,
            Code::InvalidArgument,
            "packed.access_key: 15 bytes, expected 16".into(),
            0,
        ),
        (
            "neither lengths",
            packed(dst.id, &key, &[0], &[], 0),
            0,
            Code::InvalidArgument,
            "packed.uniform_length: 0 and no lengths (give one of the two)".into(),
            0,
        ),
        (
            "both lengths",
            packed(dst.id, &key, &[0], &[8], 8),
            0,
            Code::InvalidArgument,
            "packed.lengths: given with uniform_length 8 (give one of the two)".into(),
            0,
        ),
        (
            "lengths not whole",
            ppb::PackedRanges {
                lengths: vec![1; 9],
                uniform_length: 0,
                ..good()
            },
            0,
            Code::InvalidArgument,
            "packed.lengths: 9 bytes are not a whole number of u64 lengths".into(),
            0,
        ),
        (
            "fewer lengths",
            packed(dst.id, &key, &[0, 64, 128], &[8, 8], 0),
            0,
            Code::InvalidArgument,
            "packed.lengths: 2 lengths for 3 offsets (one per range)".into(),
            0,
        ),
        (
            "a zero length",
            packed(dst.id, &key, &[0, 64, 128], &[8, 8, 0], 0),
            0,
            Code::InvalidArgument,
            "packed.lengths[2]: 0 (a range is at least 1 byte)".into(),
            0,
        ),
        (
            "an overflowing range",
            packed(dst.id, &key, &[0, u64::MAX - 2], &[], 4),
            0,
            Code::InvalidArgument,
            "packed.offsets[1]: offset 18446744073709551613 + length 4 exceeds 2^64 - 1".into(),
            0,
        ),
        (
            "ranges beside packed",
            good(),
            1,
            Code::InvalidArgument,
            "packed: given with 1 ranges (give one of the two)".into(),
            0,
        ),
        (
            "an unknown buffer",
            packed(other.id + 1000, &key, &[0], &[], 8),
            0,
            Code::NotFound,
            format!("ranges[0]: buffer {} does not exist", other.id + 1000),
            0,
        ),
        (
            "another buffer's key",
            packed(other.id, &key, &[0], &[], 8),
            0,
            Code::PermissionDenied,
            format!("ranges[0]: wrong access key for buffer {}", other.id),
            0,
        ),
        (
            "a range past the end at 4095",
            packed(dst.id, &key, &past, &[], 1024),
            0,
            Code::InvalidArgument,
            "ranges[4095].".into(),
            4095,
        ),
        (
            "a range past a smaller buffer",
            packed(other.id, &other_key, &[0, MIB], &[], 1),
            0,
            Code::InvalidArgument,
            "ranges[1].".into(),
            1,
        ),
        (
            "a slot past the end at 4095",
            slotted(
                dst.id,
                &key,
                &(0..4096u32)
                    .map(|i| if i == 4095 { (SIZE / 1024) as u32 } else { i })
                    .collect::<Vec<_>>(),
                1024,
            ),
            0,
            Code::InvalidArgument,
            "ranges[4095].".into(),
            4095,
        ),
        (
            "slots and offsets both",
            ppb::PackedRanges {
                offsets: le(&[0, 8192]),
                ..slotted(dst.id, &key, &[0, 2], 4096)
            },
            0,
            Code::InvalidArgument,
            "packed.offset_slots: given with offsets (give one of the two)".into(),
            0,
        ),
        (
            "slots not whole",
            ppb::PackedRanges {
                offset_slots: vec![0; 6],
                ..slotted(dst.id, &key, &[], 4096)
            },
            0,
            Code::InvalidArgument,
            "packed.offset_slots: 6 bytes are not a whole number of u32 slots".into(),
            0,
        ),
    ];
    let mut n = 0;
    for (i, (name, p, ranges, code, words, idx)) in offers.into_iter().enumerate() {
        n += 1;
        let o = ppb::Offer {
            offer_id: 1000 + i as u64,
            chunk_bytes: 512 * 1024,
            ranges: vec![range(dst.id, &key, 0, 8); ranges],
            deadline_ms: 10_000,
            coalesced: true,
            packed: Some(p),
            ..Default::default()
        };
        fake.tx.send(msg(Body::Offer(o))).await.unwrap();
        match fake.next().await {
            Body::Reject(r) => {
                assert_eq!(
                    (r.offer_id, r.code),
                    (1000 + i as u64, code as i32),
                    "{name}: {}",
                    r.message
                );
                assert!(
                    r.message.starts_with(&words),
                    "{name}: {:?} should start {words:?}",
                    r.message
                );
                assert_eq!(r.range_index, idx, "{name}");
            }
            other => panic!("{name}: expected a Reject, got {other:?}"),
        }
    }

    // ---- Read requests -------------------------------------------------------------------
    let far = |offsets: &[u64], len: u64| packed(1, &[9; 16], offsets, &[], len);
    let mut past10: Vec<u64> = (0..10u64).map(|i| i * 4096).collect();
    past10[9] = SIZE;
    type ReadCase<'a> = (
        &'a str,
        Option<ppb::PackedRanges>,
        Option<ppb::PackedRanges>,
        usize,
        Code,
        String,
        u32,
    );
    let reads: Vec<ReadCase> = vec![
        (
            "no destinations",
            Some(good()),
            None,
            0,
            Code::InvalidArgument,
            "packed_dest: missing (packed_source given)".into(),
            0,
        ),
        (
            "no sources",
            None,
            Some(far(&[0], 8)),
            0,
            Code::InvalidArgument,
            "packed_source: missing (packed_dest given)".into(),
            0,
        ),
        (
            "counts that differ",
            Some(good()),
            Some(far(&[0], 4096)),
            0,
            Code::InvalidArgument,
            "packed_dest: 1 ranges for 2 in packed_source (one per pair)".into(),
            0,
        ),
        (
            "pairs beside packed",
            Some(good()),
            Some(far(&[0, 1], 4096)),
            1,
            Code::InvalidArgument,
            "packed_source: given with 1 pairs (give one of the two)".into(),
            0,
        ),
        (
            "a destination key of 20 bytes",
            Some(good()),
            Some(ppb::PackedRanges {
                access_key: vec![1; 20],
                ..far(&[0, 1], 4096)
            }),
            0,
            Code::InvalidArgument,
            "packed_dest.access_key: 20 bytes, expected 16".into(),
            0,
        ),
        (
            "65,537 pairs",
            Some(packed(dst.id, &key, &vec![0; 65_537], &[], 1)),
            Some(far(&vec![0; 65_537], 1)),
            0,
            Code::InvalidArgument,
            "packed_source.offsets: 65537 ranges (1 to 65536 allowed)".into(),
            0,
        ),
        (
            "a source with another key",
            Some(packed(dst.id, &other_key, &[0], &[], 8)),
            Some(far(&[0], 8)),
            0,
            Code::PermissionDenied,
            format!("ranges[0]: wrong access key for buffer {}", dst.id),
            0,
        ),
        (
            "a source past the end at 9",
            Some(packed(dst.id, &key, &past10, &[], 4096)),
            Some(far(&past10, 4096)),
            0,
            Code::InvalidArgument,
            "ranges[9].".into(),
            9,
        ),
        (
            "lengths that differ",
            Some(packed(dst.id, &key, &[0], &[], 4096)),
            Some(far(&[0], 4095)),
            0,
            Code::InvalidArgument,
            "ranges[0]: source and destination lengths differ".into(),
            0,
        ),
    ];
    for (i, (name, s, d, pairs, code, words, idx)) in reads.into_iter().enumerate() {
        n += 1;
        let pair = ppb::ReadPair {
            source: Some(range(dst.id, &key, 0, 8)),
            dest: Some(range(1, &[9; 16], 0, 8)),
        };
        let r = ppb::ReadRequest {
            read_id: 5000 + i as u64,
            pairs: vec![pair; pairs],
            deadline_ms: 10_000,
            packed_source: s,
            packed_dest: d,
            ..Default::default()
        };
        fake.tx.send(msg(Body::ReadRequest(r))).await.unwrap();
        match fake.next().await {
            Body::ReadReject(r) => {
                assert_eq!(
                    (r.read_id, r.code),
                    (5000 + i as u64, code as i32),
                    "{name}: {}",
                    r.message
                );
                assert!(
                    r.message.starts_with(&words),
                    "{name}: {:?} should start {words:?}",
                    r.message
                );
                assert_eq!(r.range_index, idx, "{name}");
            }
            other => panic!("{name}: expected a ReadReject, got {other:?}"),
        }
    }
    eprintln!("{n} packed cases");

    // ---- A header it cannot read fails the pairing (its data may be on the lanes) -----------
    let h = ppb::Offer {
        offer_id: 77,
        chunk_bytes: 512 * 1024,
        deadline_ms: 10_000,
        coalesced: true,
        packed: Some(ppb::PackedRanges {
            offsets: vec![0; 7],
            ..good()
        }),
        ..Default::default()
    };
    fake.tx.send(msg(Body::Header(h))).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let peers = b
            .client
            .list_peers(pb::ListPeersRequest {})
            .await
            .unwrap()
            .into_inner()
            .peers;
        let p = peers.iter().find(|p| p.node_id == "host-p").expect("listed");
        if p.state == pb::PeerState::Failed as i32 {
            assert!(
                p.error
                    .contains("header.packed.offsets: 7 bytes are not a whole number of u64 offsets"),
                "{}",
                p.error
            );
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the pairing never failed: {p:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        snapshot(&mut [&mut b.client]).await,
        before,
        "a hostile packed message changed bytes"
    );
    assert_lanes_drain(&mut b.client).await;
    b.stop().await;
}
