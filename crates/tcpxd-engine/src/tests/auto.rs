//! `auto`: eager lanes and rendezvous lanes on one pairing, the protocol chosen per transfer by
//! its size against the receiver's `eager_max_bytes`; mixed pairs (an auto node with an eager or
//! a rendezvous one); the old form of `ReceiveMode`; lane rules a hostile peer could break.

use super::*;

/// Auto with 2 rendezvous lanes and 1 eager lane per peer (lane 2), 4 KiB chunks, eager up to
/// 16 KiB.
fn auto_cfg() -> EngineConfig {
    EngineConfig {
        protocol: Protocol::Auto,
        eager_lanes: 1,
        eager_max_bytes: 16 * 1024,
        ..small_chunks()
    }
}

fn with(protocol: Protocol) -> EngineConfig {
    EngineConfig {
        protocol,
        ..small_chunks()
    }
}

fn actions(eng: &mut Engine) -> Vec<Action> {
    std::iter::from_fn(|| eng.poll_action()).collect()
}

fn closed(acts: &[Action]) -> Option<&str> {
    acts.iter().find_map(|a| match a {
        Action::ClosePeer { reason, .. } => Some(reason.as_str()),
        _ => None,
    })
}

/// Bytes sent by `node` on each of its send lanes so far.
fn lane_bytes(s: &Sim, node: usize) -> Vec<u64> {
    s.nodes[node]
        .eng
        .peer_counters(P)
        .unwrap()
        .send
        .iter()
        .map(|l| l.bytes)
        .collect()
}

fn delta(before: &[u64], after: &[u64]) -> Vec<u64> {
    after.iter().zip(before).map(|(a, b)| a - b).collect()
}

/// (sent eager, sent rendezvous, received eager, received rendezvous) of a node.
fn choices(s: &Sim, node: usize) -> (u64, u64, u64, u64) {
    let c = s.nodes[node].eng.peer_counters(P).unwrap();
    (
        c.sent_eager,
        c.sent_rendezvous,
        c.received_eager,
        c.received_rendezvous,
    )
}

#[test]
fn the_choice_follows_the_size_and_each_protocol_keeps_to_its_lanes() {
    let mut s = Sim::new(2, auto_cfg(), 21);
    // Pairing: each side announced its split, and credits stand on the eager lane only.
    for i in 0..2 {
        let c = s.nodes[i].eng.peer_counters(P).unwrap();
        let limits: Vec<u32> = c.recv.iter().map(|l| l.credit_limit).collect();
        assert_eq!(limits, vec![0, 0, 16], "credits on lane 2 only");
        let limits: Vec<u32> = c.send.iter().map(|l| l.credit_limit).collect();
        assert_eq!(limits, vec![0, 0, 16], "the peer's eager lane holds credits");
        assert!(s.nodes[i].eng.recv_lane_is_eager(P, 2) && !s.nodes[i].eng.recv_lane_is_eager(P, 1));
    }
    s.buffer(0, 1, 1 << 20, 5);
    s.buffer(1, 2, 1 << 20, 0);

    // Small: a header, its sends at once, on the eager lane only.
    let before = lane_bytes(&s, 0);
    let t = s.write(0, 1, 0, 2, 0, 12_000);
    s.drain();
    assert!(
        matches!(s.ctrl[1].front(), Some(PeerMsg::Header(h)) if h.first_lane == 2),
        "{:?}",
        s.ctrl[1]
    );
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.same((0, 1, 0), (1, 2, 0), 12_000));
    assert_eq!(delta(&before, &lane_bytes(&s, 0)), vec![0, 0, 12_000]);
    assert_eq!(choices(&s, 0), (1, 0, 0, 0));
    assert_eq!(choices(&s, 1), (0, 0, 1, 0));

    // Large: an offer, sends only after the accept, over both rendezvous lanes (the parallelism
    // rendezvous has without the eager lane).
    let before = lane_bytes(&s, 0);
    let t = s.write(0, 1, 100_000, 2, 100_000, 200_000);
    s.drain();
    assert!(
        matches!(s.ctrl[1].front(), Some(PeerMsg::Offer(o)) if o.first_lane < 2),
        "{:?}",
        s.ctrl[1]
    );
    assert!(
        s.wires[0].iter().all(|w| w.sends.is_empty()),
        "no send before the accept"
    );
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.same((0, 1, 100_000), (1, 2, 100_000), 200_000));
    let d = delta(&before, &lane_bytes(&s, 0));
    assert_eq!(d[2], 0, "nothing large on the eager lane: {d:?}");
    assert!(d[0] > 0 && d[1] > 0, "both rendezvous lanes carry it: {d:?}");
    assert_eq!(d[0] + d[1], 200_000);
    assert_eq!(choices(&s, 0), (1, 1, 0, 0));
    assert_eq!(choices(&s, 1), (0, 0, 1, 1));
    s.assert_idle();
}

#[test]
fn the_limit_counts_a_transfers_total_bytes_at_the_receivers_setting() {
    let mut s = Sim::new(2, auto_cfg(), 22);
    s.buffer(0, 1, 1 << 16, 9);
    s.buffer(1, 2, 1 << 16, 0);
    // Exactly the limit: eager. One byte more: rendezvous.
    s.write(0, 1, 0, 2, 0, 16 * 1024);
    s.run();
    assert_eq!(choices(&s, 0), (1, 0, 0, 0));
    s.write(0, 1, 0, 2, 0, 16 * 1024 + 1);
    s.run();
    assert_eq!(choices(&s, 0), (1, 1, 0, 0));
    // Two entries of 10 000 bytes each: 20 000 in total, over the limit.
    let entry = |loff: u64, roff: u64| WriteSpec {
        local_buffer: 1,
        local_offset: loff,
        peer: P,
        remote: RemoteRange {
            buffer_id: 2,
            access_key: key(2),
            offset: roff,
            length: 10_000,
        },
    };
    let deadline = s.now + Duration::from_secs(60);
    let t = s.nodes[0]
        .eng
        .start_write(
            vec![entry(0, 30_000), entry(10_000, 40_000)],
            vec![],
            deadline,
            s.now,
        )
        .unwrap();
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.same((0, 1, 0), (1, 2, 30_000), 20_000));
    assert_eq!(choices(&s, 0), (1, 2, 0, 0));
    // The receiver's setting decides, not the sender's: a sender with a 1-byte limit of its own
    // still sends 16 KiB eagerly to a receiver whose limit is 16 KiB.
    let small = EngineConfig {
        eager_max_bytes: 1,
        ..auto_cfg()
    };
    let mut s = Sim::pair(2, [small, auto_cfg()], 23);
    s.buffer(0, 1, 1 << 16, 9);
    s.buffer(1, 2, 1 << 16, 0);
    s.write(0, 1, 0, 2, 0, 16 * 1024);
    s.run();
    assert_eq!(choices(&s, 0), (1, 0, 0, 0));
    // And the other way round, node 0's limit of 1 byte sends even 2 bytes by rendezvous.
    s.write(1, 2, 0, 1, 0, 2);
    s.run();
    assert_eq!(choices(&s, 1), (0, 1, 1, 0));
    s.assert_idle();
}

/// A transfer started by the simulator: (node that started it, its id, source (node, buffer,
/// offset), destination, length).
type Started = (usize, TransferId, (usize, u64, u64), (usize, u64, u64), u64);

/// Small and large transfers, WRITEs and READs, both directions, all in flight at once.
fn mixed_traffic(s: &mut Sim, seed: u64) -> Vec<Started> {
    for id in 1..=4 {
        s.buffer(0, id, 512 * 1024, id as u8 * 10);
        s.buffer(1, 10 + id, 512 * 1024, id as u8 * 20);
    }
    let mut ts = Vec::new();
    for k in 0..16u64 {
        // Alternately under and over the 16 KiB limit, uneven lengths.
        let len = if k % 2 == 0 {
            1 + (k * 7919 + seed) % 16_000
        } else {
            16_385 + (k * 104_729 + seed) % 100_000
        };
        let (a, b) = (1 + k % 4, 11 + k % 4);
        // Transfer k owns its 128 KiB slot of a buffer pair: no two ranges overlap.
        let off = (k / 4) * 128 * 1024;
        ts.push(match (k / 2) % 4 {
            0 => (0, s.write(0, a, off, b, off, len), (0, a, off), (1, b, off), len),
            1 => (1, s.write(1, b, off, a, off, len), (1, b, off), (0, a, off), len),
            2 => (0, s.read(0, b, off, a, off, len), (1, b, off), (0, a, off), len),
            _ => (1, s.read(1, a, off, b, off, len), (0, a, off), (1, b, off), len),
        });
        for _ in 0..s.rand(10) {
            s.step();
        }
    }
    ts
}

#[test]
fn small_and_large_transfers_in_both_directions_at_once_land_byte_exact() {
    for seed in 1..=20 {
        let mut s = Sim::new(2, auto_cfg(), seed);
        let ts = mixed_traffic(&mut s, seed);
        s.run();
        for (node, t, src, dst, len) in &ts {
            assert_eq!(s.outcome(*node, *t).code, Code::Ok, "seed {seed}");
            assert!(s.same(*src, *dst, *len), "seed {seed}: transfer {t} bytes differ");
        }
        // Eight small and eight large, half WRITEs, half READs (sent by the data holder).
        let (a, b) = (choices(&s, 0), choices(&s, 1));
        assert_eq!((a.0 + b.0, a.1 + b.1), (8, 8), "seed {seed}: {a:?} {b:?}");
        assert_eq!((a.0, a.1), (b.2, b.3), "what one sent the other received");
        s.assert_idle();
    }
}

#[test]
fn mixed_pairs_follow_each_receivers_mode() {
    for other in [Protocol::Eager, Protocol::Rendezvous] {
        for seed in 1..=5 {
            // Node 0 auto, node 1 eager or rendezvous, each receiving its own way.
            let mut s = Sim::pair(2, [auto_cfg(), with(other)], seed);
            let c1 = s.nodes[1].eng.peer_counters(P).unwrap();
            assert_eq!(c1.send.len(), 3, "node 1 sends on node 0's three lanes");
            assert_eq!(s.nodes[0].eng.peer_counters(P).unwrap().send.len(), 2);
            let ts = mixed_traffic(&mut s, seed);
            s.run();
            for (node, t, src, dst, len) in &ts {
                assert_eq!(s.outcome(*node, *t).code, Code::Ok, "{other:?} seed {seed}");
                assert!(s.same(*src, *dst, *len), "{other:?} seed {seed}: transfer {t}");
            }
            let (a, b) = (choices(&s, 0), choices(&s, 1));
            // Towards node 1 everything goes its way; towards node 0 the size decides.
            match other {
                Protocol::Eager => assert_eq!((a.0, a.1), (8, 0), "{a:?}"),
                _ => assert_eq!((a.0, a.1), (0, 8), "{a:?}"),
            }
            assert_eq!((b.0, b.1), (4, 4), "{b:?}");
            s.assert_idle();
        }
    }
}

#[test]
fn the_old_form_of_receive_mode_means_every_lane_for_any_size() {
    // An auto node paired with peers announcing only credits and chunk size.
    for (credits, header) in [(16, true), (0, false)] {
        let mut eng = Engine::new(auto_cfg());
        let p = eng.add_peer("old", 3, 3);
        for l in 0..3 {
            eng.on_lane_ready(p, l, true);
        }
        eng.add_buffer(1, 1 << 20, key(1)).unwrap();
        eng.on_message(
            p,
            PeerMsg::ReceiveMode {
                credits,
                chunk_bytes: 4096,
                eager_first_lane: 0,
                eager_max_bytes: 0,
            },
            Instant::now(),
        );
        actions(&mut eng);
        let spec = WriteSpec {
            local_buffer: 1,
            local_offset: 0,
            peer: p,
            remote: RemoteRange {
                buffer_id: 9,
                access_key: key(9),
                offset: 0,
                length: 1 << 20,
            },
        };
        let now = Instant::now();
        eng.start_write(vec![spec], vec![], now + Duration::from_secs(9), now)
            .unwrap();
        let acts = actions(&mut eng);
        let sent_header = acts.iter().any(|a| {
            matches!(
                a,
                Action::Control {
                    msg: PeerMsg::Header(_),
                    ..
                }
            )
        });
        assert_eq!(sent_header, header, "1 MiB with {credits} credits: {acts:?}");
        if header {
            // Every lane carries credits, so every lane takes sends (16 each).
            let lanes: BTreeSet<u32> = acts
                .iter()
                .filter_map(|a| match a {
                    Action::PostSend { lane, .. } => Some(*lane),
                    _ => None,
                })
                .collect();
            assert_eq!(lanes, BTreeSet::from([0, 1, 2]));
        }
    }
}

/// An auto receiver (2 rendezvous lanes, eager lane 2) paired with a hand-driven peer.
fn receiver() -> (Engine, Vec<Action>) {
    let mut eng = Engine::new(auto_cfg());
    let p = eng.add_peer("hostile", 3, 3);
    assert_eq!(p, P);
    eng.on_message(
        P,
        PeerMsg::ReceiveMode {
            credits: 0,
            chunk_bytes: 4096,
            eager_first_lane: 0,
            eager_max_bytes: 0,
        },
        Instant::now(),
    );
    for l in 0..3 {
        eng.on_lane_ready(P, l, true);
        eng.on_lane_ready(P, l, false);
    }
    eng.add_buffer(5, 1 << 16, key(5)).unwrap();
    let acts = actions(&mut eng);
    (eng, acts)
}

fn transfer(first_lane: u32, length: u64) -> Offer {
    Offer {
        offer_id: 7,
        read_id: 0,
        chunk_bytes: 4096,
        first_lane,
        ranges: vec![RemoteRange {
            buffer_id: 5,
            access_key: key(5),
            offset: 0,
            length,
        }]
        .into(),
        notification: vec![],
        deadline_ms: 1000,
        blocks: None,
        coalesced: false,
        transfer_id: 0,
        announced: None,
    }
}

#[test]
fn an_auto_receiver_announces_its_split_and_posts_credits_on_its_eager_lanes_only() {
    let (_, acts) = receiver();
    let mode = acts.iter().find_map(|a| match a {
        Action::Control {
            msg: m @ PeerMsg::ReceiveMode { .. },
            ..
        } => Some(m.clone()),
        _ => None,
    });
    assert_eq!(
        mode,
        Some(PeerMsg::ReceiveMode {
            credits: 16,
            chunk_bytes: 4096,
            eager_first_lane: 2,
            eager_max_bytes: 16 * 1024,
        })
    );
    let credit_lanes: Vec<u32> = acts
        .iter()
        .filter_map(|a| match a {
            Action::PostCredit { lane, .. } => Some(*lane),
            _ => None,
        })
        .collect();
    assert_eq!(credit_lanes, vec![2; 16]);
    // The credit receives are as large as the largest eager transfer needs, in 4 KiB steps, and
    // never larger than chunk_bytes: 64 KiB by default, not the 512 KiB chunks.
    for (eager_max_bytes, want) in [
        (DEFAULT_EAGER_MAX_BYTES, 65536),
        (100, 4096),
        (65537, 69632),
        (8 << 20, DEFAULT_CHUNK_BYTES),
    ] {
        let mut eng = Engine::new(EngineConfig {
            protocol: Protocol::Auto,
            eager_max_bytes,
            ..EngineConfig::default()
        });
        eng.add_peer("x", 2, 2);
        eng.on_lane_ready(P, 1, false);
        let acts = actions(&mut eng);
        assert!(
            matches!(&acts[0], Action::Control { msg: PeerMsg::ReceiveMode { chunk_bytes, eager_first_lane: 1, .. }, .. } if *chunk_bytes == want),
            "{eager_max_bytes}: {acts:?}"
        );
        assert!(
            acts[1..]
                .iter()
                .all(|a| matches!(a, Action::PostCredit { lane: 1, len, .. } if *len == want)),
            "{eager_max_bytes}: {acts:?}"
        );
        assert_eq!(acts.len(), 17);
    }
    // Eager mode and rendezvous mode announce the old form.
    for (protocol, credits) in [(Protocol::Eager, 16), (Protocol::Rendezvous, 0)] {
        let mut eng = Engine::new(with(protocol));
        eng.add_peer("x", 2, 2);
        let first = actions(&mut eng).into_iter().next();
        assert_eq!(
            first,
            Some(Action::Control {
                peer: P,
                msg: PeerMsg::ReceiveMode {
                    credits,
                    chunk_bytes: 4096,
                    eager_first_lane: 0,
                    eager_max_bytes: 0
                }
            })
        );
    }
}

#[test]
fn plans_on_the_wrong_lanes_are_refused_and_sound_ones_taken() {
    // A header on a rendezvous lane: its data would sit in front of a rendezvous receive.
    let (mut eng, _) = receiver();
    eng.on_message(P, PeerMsg::Header(transfer(1, 4096)), Instant::now());
    let acts = actions(&mut eng);
    let why = closed(&acts).unwrap_or_else(|| panic!("not failed: {acts:?}"));
    assert!(
        why.contains("first_lane 1 is not one of the eager lanes 2..3"),
        "{why}"
    );
    // An offer on the eager lane: refused (nothing was posted), the pairing stays.
    let (mut eng, _) = receiver();
    eng.on_message(P, PeerMsg::Offer(transfer(2, 4096)), Instant::now());
    let acts = actions(&mut eng);
    assert!(closed(&acts).is_none(), "{acts:?}");
    assert!(
        acts.iter().any(|a| matches!(a, Action::Control {
            msg: PeerMsg::Reject { code: Code::InvalidArgument, message, .. }, ..
        } if message.contains("rendezvous lanes"))),
        "{acts:?}"
    );
    assert!(!acts.iter().any(|a| matches!(a, Action::PostRecv { .. })));
    // Sound ones: an offer's receives on lanes 0 and 1, a header's chunks announced on lane 2.
    let (mut eng, _) = receiver();
    eng.on_message(P, PeerMsg::Offer(transfer(1, 3 * 4096)), Instant::now());
    let lanes: Vec<u32> = actions(&mut eng)
        .iter()
        .filter_map(|a| match a {
            Action::PostRecv { lane, .. } => Some(*lane),
            _ => None,
        })
        .collect();
    // Chunks 0, 1, 2 on lanes 1, 0, 1 (posted lane by lane).
    assert_eq!(lanes, vec![0, 1, 1]);
    let mut h = transfer(2, 2 * 4096);
    h.offer_id = 8;
    eng.on_message(P, PeerMsg::Header(h), Instant::now());
    let acts = actions(&mut eng);
    assert!(closed(&acts).is_none(), "{acts:?}");
    let c = eng.peer_counters(P).unwrap();
    let queued: Vec<usize> = c.recv.iter().map(|l| l.queued).collect();
    assert_eq!(
        queued,
        vec![0, 0, 2],
        "the header's chunks wait on the eager lane"
    );
    assert_eq!((c.received_eager, c.received_rendezvous), (1, 1));
}

#[test]
fn receive_modes_and_credits_that_break_the_split_fail_the_pairing() {
    let fresh = |mode: PeerMsg| {
        let mut eng = Engine::new(auto_cfg());
        let p = eng.add_peer("x", 3, 3);
        eng.on_message(p, mode, Instant::now());
        actions(&mut eng)
    };
    let mode = |credits, eager_first_lane| PeerMsg::ReceiveMode {
        credits,
        chunk_bytes: 4096,
        eager_first_lane,
        eager_max_bytes: 4096,
    };
    let why = closed(&fresh(mode(16, 3))).unwrap_or_default().to_string();
    assert!(why.contains("eager_first_lane 3"), "{why}");
    let why = closed(&fresh(mode(0, 1))).unwrap_or_default().to_string();
    assert!(why.contains("eager_first_lane 1 with 0 credits"), "{why}");
    assert!(closed(&fresh(mode(16, 2))).is_none());
    // Credits returned on one of the peer's rendezvous lanes: it never granted any there.
    let mut eng = Engine::new(auto_cfg());
    let p = eng.add_peer("x", 3, 3);
    eng.on_message(p, mode(16, 2), Instant::now());
    eng.on_message(
        p,
        PeerMsg::Credits {
            returned: ReturnedCredits::from_counts(&[1, 0, 0]),
        },
        Instant::now(),
    );
    let acts = actions(&mut eng);
    assert!(
        closed(&acts).is_some_and(|w| w.contains("lane 0: 1 credits returned")),
        "{acts:?}"
    );
}

#[test]
fn cancel_and_deadlines_in_auto_free_every_credit_and_slot_on_both_sides() {
    for seed in 1..=10 {
        let mut s = Sim::new(2, auto_cfg(), 30 + seed);
        s.buffer(0, 1, 1 << 20, 4);
        s.buffer(1, 2, 1 << 20, 0);
        let small = s.write(0, 1, 0, 2, 0, 12_000);
        let large = s.write(0, 1, 100_000, 2, 100_000, 300_000);
        let read = s.read(1, 1, 500_000, 2, 500_000, 10_000);
        for _ in 0..s.rand(30) {
            s.step();
        }
        s.nodes[0].eng.cancel(small, Code::Cancelled, "test");
        s.nodes[0].eng.cancel(large, Code::Cancelled, "test");
        // Every control message delivered first: no data waits for its header when time jumps
        // (that would fail the pairing at the header deadline, a rule of its own).
        loop {
            s.drain();
            let mut any = false;
            for i in 0..2 {
                while let Some(m) = s.ctrl[i].pop_front() {
                    s.nodes[i].eng.on_message(P, m, s.now);
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
        s.now += Duration::from_secs(61);
        s.nodes[1].eng.on_tick(s.now);
        s.run();
        for (node, t) in [(0, small), (0, large), (1, read)] {
            // Each ended: cancelled, past its deadline, or done before either.
            let code = s.outcome(node, t).code;
            assert!(
                matches!(code, Code::Ok | Code::Cancelled | Code::DeadlineExceeded),
                "seed {seed}: {code:?}"
            );
        }
        s.assert_idle();
    }
}
