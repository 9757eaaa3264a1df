//! The eager protocol: credits, headers, data before its header, hostile headers. The
//! simulator of the parent module runs both engines; the hostile cases drive one receiving
//! engine by hand, as a peer that breaks the rules would.

use super::*;

fn eager(cfg: EngineConfig) -> EngineConfig {
    EngineConfig {
        protocol: Protocol::Eager,
        ..cfg
    }
}

fn sends_posted(s: &Sim, from: usize) -> usize {
    s.wires[from]
        .iter()
        .map(|w| w.sends.len() + w.send_done_pending)
        .sum()
}

#[test]
fn a_write_posts_its_sends_before_any_answer_and_lands_byte_exact() {
    let mut s = Sim::new(2, eager(small_chunks()), 11);
    s.buffer(0, 1, 100_000, 7);
    s.buffer(1, 2, 200_000, 0);
    let t = s.write(0, 1, 10, 2, 5000, 90_000);
    s.drain();
    // No message from the receiver yet: the header is on its way and the data already moves.
    assert!(
        matches!(s.ctrl[1].front(), Some(PeerMsg::Header(_))),
        "{:?}",
        s.ctrl[1]
    );
    assert!(s.ctrl[0].is_empty());
    assert!(
        sends_posted(&s, 0) > 0,
        "no send posted before the receiver answered"
    );
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.same((0, 1, 10), (1, 2, 5000), 90_000));
    assert_eq!(
        s.nodes[1].bufs[&2][..5000],
        vec![0u8; 5000][..],
        "nothing outside the range"
    );
    assert_eq!(s.nodes[1].notes, vec![(1, b"note".to_vec())]);
    s.assert_idle();
}

#[test]
fn a_read_is_one_request_then_the_holders_eager_write() {
    let mut s = Sim::new(3, eager(small_chunks()), 12);
    s.buffer(0, 1, 50_000, 0);
    s.buffer(1, 9, 60_000, 33);
    let t = s.read(0, 9, 1234, 1, 100, 40_000);
    s.drain();
    let req = s.ctrl[1].pop_front().expect("the read request");
    assert!(matches!(req, PeerMsg::ReadRequest { .. }));
    s.nodes[1].eng.on_message(P, req, s.now);
    s.drain();
    // The holder answers with a header and its sends at once: nothing more from the reader.
    assert!(matches!(s.ctrl[0].front(), Some(PeerMsg::Header(h)) if h.read_id != 0));
    assert!(sends_posted(&s, 1) > 0);
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.same((1, 9, 1234), (0, 1, 100), 40_000));
    s.assert_idle();
}

#[test]
fn data_that_lands_before_its_header_waits_in_its_pages() {
    let mut s = Sim::new(1, eager(small_chunks()), 13);
    s.buffer(0, 1, 32_768, 9);
    s.buffer(1, 2, 32_768, 0);
    let t = s.write(0, 1, 0, 2, 0, 32_768);
    s.drain();
    // Every receive completes while the header is held back.
    let w = &mut s.wires[0][0];
    let landed = w.recv_done_pending;
    assert_eq!(landed, 8, "eight 4 KiB chunks within 16 credits");
    for _ in 0..landed {
        w.recv_done_pending -= 1;
        assert!(w.done_credit.pop_front().unwrap());
        s.nodes[1].eng.on_recv_landed(P, 0, s.now);
    }
    s.drain();
    let c = s.nodes[1].eng.peer_counters(P).unwrap();
    assert_eq!(
        (c.recv[0].posted, c.recv[0].credits),
        (8, 8),
        "landed, waiting: {c:?}"
    );
    assert_eq!(s.wires[0][0].held.len(), 8, "no Land before the header");
    assert!(
        s.nodes[1].bufs[&2].iter().all(|&b| b == 0),
        "no byte moved before the header"
    );
    assert!(
        s.nodes[1].eng.next_deadline().is_some(),
        "waiting data has a deadline"
    );
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.same((0, 1, 0), (1, 2, 0), 32_768));
    s.assert_idle();
}

#[test]
fn sends_stay_within_the_credits_the_receiver_granted() {
    let cfg = EngineConfig {
        credits: 3,
        ..eager(small_chunks())
    };
    let mut s = Sim::new(1, cfg, 14);
    s.buffer(0, 1, 1 << 20, 3);
    s.buffer(1, 2, 1 << 20, 0);
    let t = s.write(0, 1, 0, 2, 0, 1 << 20); // 256 chunks on one lane
    s.hold_data = true;
    s.run();
    let c0 = s.nodes[0].eng.peer_counters(P).unwrap();
    let c1 = s.nodes[1].eng.peer_counters(P).unwrap();
    assert_eq!((c0.send[0].posted, c0.send[0].queued), (3, 253));
    assert_eq!((c0.send[0].credits, c0.send[0].credit_limit), (0, 3));
    assert_eq!(c1.recv[0].queued, 256, "every chunk announced by the header");
    assert!(!s.nodes[0].eng.lanes_idle() && !s.nodes[1].eng.lanes_idle());
    s.hold_data = false;
    // The simulator checks at every step that each posted send meets a posted receive.
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.same((0, 1, 0), (1, 2, 0), 1 << 20));
    s.assert_idle();
}

#[test]
fn a_transfer_refused_after_its_data_left_changes_no_destination_byte() {
    let mut counted_as_sent = false;
    for seed in 1..=10 {
        let mut s = Sim::new(2, eager(small_chunks()), seed);
        s.buffer(0, 1, 64 * 1024, 5);
        s.buffer(1, 2, 64 * 1024, 0);
        // The receiver's key changes while the data is on its way.
        s.nodes[1].eng.rekey_buffer(2, key(99)).unwrap();
        let t = s.write(0, 1, 0, 2, 0, 64 * 1024);
        let later = s.write(0, 1, 0, 2, 0, 0x1000);
        s.run();
        let o = s.outcome(0, t);
        assert_eq!(o.code, Code::PermissionDenied, "seed {seed}: {o:?}");
        assert!(o.message.contains("wrong access key"), "{}", o.message);
        // Its chunks left (progress counted them), but none landed: the final figure says so.
        assert_eq!(o.landed, 0, "seed {seed}: nothing landed");
        counted_as_sent |= s.nodes[0].progress.get(&t).is_some_and(|&b| b > 0);
        assert_eq!(s.outcome(0, later).code, Code::PermissionDenied);
        assert!(
            s.nodes[1].bufs[&2].iter().all(|&b| b == 0),
            "seed {seed}: a byte landed"
        );
        s.assert_idle();
        // The lanes are still in step: a write with the new key lands.
        let ok = s.nodes[0]
            .eng
            .start_write(
                vec![WriteSpec {
                    local_buffer: 1,
                    local_offset: 0,
                    peer: P,
                    remote: RemoteRange {
                        buffer_id: 2,
                        access_key: key(99),
                        offset: 100,
                        length: 20_000,
                    },
                }],
                vec![],
                s.now + Duration::from_secs(60),
                s.now,
            )
            .unwrap();
        s.run();
        assert_eq!(s.outcome(0, ok).code, Code::Ok);
        assert_eq!(s.outcome(0, ok).landed, 20_000);
        assert!(s.same((0, 1, 0), (1, 2, 100), 20_000));
        s.assert_idle();
    }
    assert!(counted_as_sent, "no seed sent data before the refusal came");
}

#[test]
fn cancel_and_deadlines_free_every_credit_and_slot_on_both_sides() {
    for seed in 1..=20 {
        let mut s = Sim::new(2, eager(small_chunks()), seed);
        s.buffer(0, 1, 1 << 20, 1);
        s.buffer(1, 2, 1 << 20, 0);
        s.buffer(1, 3, 1 << 20, 2);
        s.buffer(0, 4, 1 << 20, 0);
        let w = s.write(0, 1, 0, 2, 0, 1 << 20);
        let r = s.read(0, 3, 0, 4, 0, 1 << 20);
        let short = {
            let spec = WriteSpec {
                local_buffer: 1,
                local_offset: 0,
                peer: P,
                remote: RemoteRange {
                    buffer_id: 2,
                    access_key: key(2),
                    offset: 0,
                    length: 1 << 19,
                },
            };
            s.nodes[0]
                .eng
                .start_write(vec![spec], vec![], s.now + Duration::from_millis(10), s.now)
                .unwrap()
        };
        for _ in 0..s.rand(200) {
            s.step();
        }
        s.nodes[0]
            .eng
            .cancel(w, Code::Cancelled, "cancelled by the client");
        s.nodes[0]
            .eng
            .cancel(r, Code::Cancelled, "cancelled by the client");
        s.now += Duration::from_secs(1);
        s.nodes[0].eng.on_tick(s.now);
        s.run();
        for t in [w, r] {
            let code = s.outcome(0, t).code;
            assert!(
                matches!(code, Code::Cancelled | Code::Ok),
                "seed {seed}: {code:?}"
            );
        }
        let code = s.outcome(0, short).code;
        assert!(
            matches!(code, Code::DeadlineExceeded | Code::Ok),
            "seed {seed}: {code:?}"
        );
        // Every credit back with the sender, every credit receive posted again, no slot held.
        s.assert_idle();
    }
}

// ---- one receiving engine driven by hand, as a hostile peer would -----------------------------

pub(super) const MODE: PeerMsg = PeerMsg::ReceiveMode {
    credits: 16,
    chunk_bytes: 4096,
    eager_first_lane: 0,
    eager_max_bytes: 0,
};

/// An eager receiver with one 2-lane peer (whose own mode is eager), buffer 5 (8192 bytes,
/// key 5) and its credit receives posted.
pub(super) fn receiver() -> (Engine, Instant) {
    let mut eng = Engine::new(eager(small_chunks()));
    let p = eng.add_peer("hostile", 2, 2);
    let now = Instant::now();
    eng.on_message(p, MODE, now);
    for l in 0..2 {
        eng.on_lane_ready(p, l, true);
        eng.on_lane_ready(p, l, false);
    }
    let acts = actions(&mut eng);
    assert_eq!(
        acts.iter()
            .filter(|a| matches!(a, Action::PostCredit { len: 4096, .. }))
            .count(),
        32,
        "16 credit receives per lane: {acts:?}"
    );
    eng.add_buffer(5, 8192, key(5)).unwrap();
    (eng, now)
}

pub(super) fn actions(eng: &mut Engine) -> Vec<Action> {
    std::iter::from_fn(|| eng.poll_action()).collect()
}

pub(super) fn header(id: u64, key_byte: u8, offset: u64, length: u64) -> PeerMsg {
    PeerMsg::Header(Offer {
        offer_id: id,
        read_id: 0,
        chunk_bytes: 4096,
        first_lane: 0,
        ranges: vec![RemoteRange {
            buffer_id: 5,
            access_key: key(key_byte),
            offset,
            length,
        }]
        .into(),
        notification: vec![],
        deadline_ms: 1000,
        blocks: None,
        coalesced: false,
        transfer_id: 0,
        announced: None,
    })
}

pub(super) fn closed(acts: &[Action]) -> Option<&str> {
    acts.iter().find_map(|a| match a {
        Action::ClosePeer { reason, .. } => Some(reason.as_str()),
        _ => None,
    })
}

#[test]
fn refused_headers_are_consumed_without_unpacking_and_return_every_credit() {
    for (msg, code, words) in [
        (header(1, 6, 0, 8192), Code::PermissionDenied, "wrong access key"),
        (header(2, 5, 4096, 8192), Code::InvalidArgument, "past the end"),
        (
            header(3, 5, u64::MAX - 10, 8192),
            Code::InvalidArgument,
            "overflows",
        ),
    ] {
        let (mut eng, now) = receiver();
        eng.on_message(P, msg, now);
        let acts = actions(&mut eng);
        assert!(
            acts.iter().any(
                |a| matches!(a, Action::Control { msg: PeerMsg::Reject { code: c, message, .. }, .. }
                if *c == code && message.contains(words))
            ),
            "{words}: {acts:?}"
        );
        // Its two chunks (lanes 0 and 1) arrive: consumed without unpacking.
        for lane in 0..2 {
            eng.on_recv_landed(P, lane, now);
        }
        let acts = actions(&mut eng);
        let lands: Vec<_> = acts.iter().filter(|a| matches!(a, Action::Land { .. })).collect();
        assert_eq!(lands.len(), 2);
        assert!(
            lands
                .iter()
                .all(|a| matches!(a, Action::Land { buffer: None, .. })),
            "a refused chunk must not be unpacked: {lands:?}"
        );
        for lane in 0..2 {
            eng.on_recv_consumed(P, lane, Ok(()));
        }
        let acts = actions(&mut eng);
        assert_eq!(
            acts.iter()
                .filter(|a| matches!(a, Action::PostCredit { .. }))
                .count(),
            2
        );
        assert!(
            acts.iter().any(
                |a| matches!(a, Action::Control { msg: PeerMsg::Credits { returned }, .. }
                if *returned == ReturnedCredits::from_counts(&[1, 1]))
            ),
            "{acts:?}"
        );
        assert!(eng.is_idle() && eng.lanes_idle());
        assert_eq!(eng.buffer_users(5), Some(0));
        let c = eng.peer_counters(P).unwrap();
        assert!(c.failed.is_none() && c.recv.iter().all(|l| l.credits == 16));
    }
}

#[test]
fn headers_that_break_the_lane_order_fail_the_pairing() {
    let bad_chunk = |f: &dyn Fn(&mut Offer)| {
        let PeerMsg::Header(mut o) = header(7, 5, 0, 4096) else {
            unreachable!()
        };
        f(&mut o);
        PeerMsg::Header(o)
    };
    let cases: Vec<(PeerMsg, &str)> = vec![
        (
            bad_chunk(&|o| o.chunk_bytes = 8192),
            "exceeds the 4096-byte credit receives",
        ),
        (bad_chunk(&|o| o.chunk_bytes = 100), "outside"),
        (bad_chunk(&|o| o.first_lane = 2), "first_lane 2"),
        (bad_chunk(&|o| o.ranges = Ranges::default()), "0 ranges"),
        (
            bad_chunk(&|o| o.ranges.to_each()[0].length = (credits::MAX_HEADER_CHUNKS + 1) * 4096),
            "more than",
        ),
        (
            bad_chunk(&|o| o.ranges.to_each()[0].length = u64::MAX),
            "more than",
        ),
    ];
    for (msg, words) in cases {
        let (mut eng, now) = receiver();
        eng.on_message(P, msg, now);
        let acts = actions(&mut eng);
        let why = closed(&acts).unwrap_or_else(|| panic!("{words}: not failed: {acts:?}"));
        assert!(why.contains("protocol violation") && why.contains(words), "{why}");
        assert!(!acts.iter().any(|a| matches!(a, Action::Land { .. })));
        assert_eq!(eng.buffer_users(5), Some(0));
    }
    // The same transfer id twice while the first is active.
    let (mut eng, now) = receiver();
    eng.on_message(P, header(8, 5, 0, 4096), now);
    eng.on_message(P, header(8, 5, 4096, 4096), now);
    let acts = actions(&mut eng);
    assert!(
        closed(&acts).is_some_and(|w| w.contains("already active")),
        "{acts:?}"
    );
}

#[test]
fn data_whose_header_never_comes_fails_the_pairing_at_the_header_deadline() {
    let (mut eng, now) = receiver();
    eng.on_recv_landed(P, 1, now);
    assert!(actions(&mut eng).is_empty(), "nothing to land it into");
    assert_eq!(eng.next_deadline(), Some(now + Duration::from_secs(5)));
    eng.on_tick(now + Duration::from_secs(4));
    assert!(closed(&actions(&mut eng)).is_none());
    eng.on_tick(now + Duration::from_secs(5));
    let acts = actions(&mut eng);
    assert!(
        closed(&acts).is_some_and(|w| w.contains("lane 1") && w.contains("waited")),
        "{acts:?}"
    );
}

#[test]
fn credits_and_modes_that_break_the_rules_fail_the_pairing() {
    let cases: Vec<(PeerMsg, &str)> = vec![
        (
            PeerMsg::Credits {
                returned: ReturnedCredits::from_counts(&[1, 0]),
            },
            "1 credits returned with 16 held of 16",
        ),
        (
            PeerMsg::Credits {
                returned: ReturnedCredits::from_wire(vec![5, 1]),
            },
            "credits for lane 5, the pairing has 2",
        ),
        (MODE, "a second ReceiveMode"),
    ];
    for (msg, words) in cases {
        let (mut eng, now) = receiver();
        eng.on_message(P, msg, now);
        let acts = actions(&mut eng);
        assert!(
            closed(&acts).is_some_and(|w| w.contains(words)),
            "{words}: {acts:?}"
        );
    }
    let fresh = |cfg: EngineConfig, mode: PeerMsg| {
        let mut eng = Engine::new(cfg);
        let p = eng.add_peer("x", 1, 1);
        eng.on_message(p, mode, Instant::now());
        actions(&mut eng)
    };
    let too_many = PeerMsg::ReceiveMode {
        credits: 17,
        chunk_bytes: 4096,
        eager_first_lane: 0,
        eager_max_bytes: 0,
    };
    assert!(closed(&fresh(small_chunks(), too_many)).is_some_and(|w| w.contains("17 credits")));
    let tiny = PeerMsg::ReceiveMode {
        credits: 4,
        chunk_bytes: 10,
        eager_first_lane: 0,
        eager_max_bytes: 0,
    };
    assert!(closed(&fresh(small_chunks(), tiny)).is_some_and(|w| w.contains("outside")));
    // A header to a node that receives by rendezvous: its data would meet the wrong receives.
    let mut eng = Engine::new(small_chunks());
    let p = eng.add_peer("x", 1, 1);
    eng.on_message(p, header(1, 5, 0, 4096), Instant::now());
    assert!(closed(&actions(&mut eng)).is_some_and(|w| w.contains("receives by rendezvous")));
    // An offer to an eager node is refused; nothing was posted for it, so the pairing stays.
    let (mut eng, now) = receiver();
    let PeerMsg::Header(o) = header(9, 5, 0, 4096) else {
        unreachable!()
    };
    eng.on_message(P, PeerMsg::Offer(o), now);
    let acts = actions(&mut eng);
    assert!(
        acts.iter().any(|a| matches!(
            a,
            Action::Control {
                msg: PeerMsg::Reject {
                    code: Code::FailedPrecondition,
                    ..
                },
                ..
            }
        )),
        "{acts:?}"
    );
    assert!(closed(&acts).is_none());
}

#[test]
fn messages_about_unknown_transfers_change_nothing() {
    let (mut eng, now) = receiver();
    for msg in [
        PeerMsg::Done {
            offer_id: 77,
            returned: ReturnedCredits::default(),
        },
        PeerMsg::Accept {
            offer_id: 77,
            first_lane: None,
        },
        PeerMsg::CancelOffer {
            offer_id: 77,
            code: Code::Cancelled,
            message: "x".into(),
        },
        PeerMsg::Reject {
            offer_id: 77,
            code: Code::Internal,
            message: "x".into(),
            range_index: 0,
        },
        PeerMsg::Failed {
            offer_id: 77,
            code: Code::Internal,
            message: "x".into(),
        },
        PeerMsg::CancelRead { read_id: 77 },
        PeerMsg::CancelSeen { offer_id: 77 },
    ] {
        eng.on_message(P, msg, now);
    }
    assert!(actions(&mut eng).is_empty());
    assert!(eng.is_idle());
    // A header for a read this node never asked for: refused, its chunk discarded.
    let PeerMsg::Header(mut o) = header(10, 5, 0, 4096) else {
        unreachable!()
    };
    o.read_id = 42;
    eng.on_message(P, PeerMsg::Header(o), now);
    eng.on_recv_landed(P, 0, now);
    let acts = actions(&mut eng);
    assert!(acts.iter().any(|a| matches!(
        a,
        Action::Control {
            msg: PeerMsg::Reject {
                code: Code::NotFound,
                ..
            },
            ..
        }
    )));
    assert!(
        acts.iter()
            .any(|a| matches!(a, Action::Land { buffer: None, .. }))
    );
}

/// The control messages among `acts`.
pub(super) fn messages(acts: &[Action]) -> Vec<&PeerMsg> {
    acts.iter()
        .filter_map(|a| match a {
            Action::Control { msg, .. } => Some(msg),
            _ => None,
        })
        .collect()
}

#[test]
fn a_finished_transfers_done_carries_the_credits_its_consumes_returned() {
    let (mut eng, now) = receiver();
    // Two 4 KiB chunks, lanes 0 and 1: landed, unpacked, consumed.
    eng.on_message(P, header(1, 5, 0, 8192), now);
    assert!(messages(&actions(&mut eng)).is_empty(), "nothing to answer yet");
    for lane in 0..2 {
        eng.on_recv_landed(P, lane, now);
    }
    let acts = actions(&mut eng);
    assert_eq!(
        acts.iter().filter(|a| matches!(a, Action::Land { .. })).count(),
        2
    );
    eng.on_recv_consumed(P, 0, Ok(()));
    // One chunk consumed, the transfer not finished, its other chunk still to be consumed on a
    // lane that owes nothing: the credit waits for the transfer's Done (no message now).
    let acts = actions(&mut eng);
    assert!(messages(&acts).is_empty(), "{acts:?}");
    assert_eq!(
        acts.iter()
            .filter(|a| matches!(a, Action::PostCredit { lane: 0, .. }))
            .count(),
        1,
        "the receive is posted again at once: {acts:?}"
    );
    eng.on_recv_consumed(P, 1, Ok(()));
    let acts = actions(&mut eng);
    // The `Done` that returns its credit first, written at once (`SendNow`: its sender's client
    // waits for it), then its receive posted again (issue #38: the credit is the consumed
    // chunk's bounce memory; the sender's next send may reach the plugin before the receive).
    let at = |f: &dyn Fn(&Action) -> bool| acts.iter().position(f);
    let repost = at(&|a| matches!(a, Action::PostCredit { lane: 1, .. }));
    let done = at(&|a| {
        matches!(
            a,
            Action::Control {
                msg: PeerMsg::Done { .. },
                ..
            }
        )
    });
    let now_ = at(&|a| matches!(a, Action::SendNow { peer } if *peer == P));
    assert!(done.is_some() && done < now_ && now_ < repost, "{acts:?}");
    assert_eq!(
        messages(&acts),
        vec![&PeerMsg::Done {
            offer_id: 1,
            returned: ReturnedCredits::from_counts(&[1, 1])
        }],
        "one message ends the transfer and returns both credits: {acts:?}"
    );
    assert!(eng.is_idle() && eng.lanes_idle());
    let c = eng.peer_counters(P).unwrap();
    assert!(c.recv.iter().all(|l| l.credits == 16), "{c:?}");
}

#[test]
fn credits_a_done_carries_are_taken_back_as_a_credits_message_would_be() {
    // The sender's side, over the simulator: every credit is back after small transfers,
    // whose receivers' last consumes returned their credits inside `Done`.
    let mut s = Sim::new(2, eager(small_chunks()), 21);
    s.buffer(0, 1, 64 * 1024, 7);
    s.buffer(1, 2, 64 * 1024, 0);
    for (i, len) in [4096u64, 8192, 4096, 65_536].into_iter().enumerate() {
        let t = s.write(0, 1, 0, 2, 0, len);
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Ok, "transfer {i}");
        assert!(s.same((0, 1, 0), (1, 2, 0), len));
    }
    s.assert_idle();
    // And hostile ones: credits inside a `Done` are checked as a `Credits` message's are.
    for (returned, words) in [
        (
            ReturnedCredits::from_counts(&[1, 0]),
            "1 credits returned with 16 held of 16",
        ),
        (ReturnedCredits::from_wire(vec![0]), "credits as 1 numbers"),
    ] {
        let (mut eng, now) = receiver();
        eng.on_message(
            P,
            PeerMsg::Done {
                offer_id: 77,
                returned,
            },
            now,
        );
        let acts = actions(&mut eng);
        assert!(
            closed(&acts).is_some_and(|w| w.contains(words)),
            "{words}: {acts:?}"
        );
    }
}

#[test]
fn transfers_ending_in_one_batch_ask_for_one_write_at_once_after_the_first_done() {
    // Two WRITEs of one chunk each (lanes 0 and 1), landed, then consumed in one batch: both
    // `Done`s, one `SendNow` right after the first (what came before it goes at once, the rest
    // with the batch), the credits' receives posted again after both. A transfer of two chunks
    // consumed in one pass: its `Done` ahead of both receives. The next batch may ask again.
    let (mut eng, now) = receiver();
    eng.on_message(P, header(1, 5, 0, 4096), now);
    let mut second = header(2, 5, 4096, 4096);
    if let PeerMsg::Header(o) = &mut second {
        o.first_lane = 1;
    }
    eng.on_message(P, second, now);
    for lane in 0..2 {
        eng.on_recv_landed(P, lane, now);
    }
    let acts = actions(&mut eng);
    assert_eq!(
        acts.iter().filter(|a| matches!(a, Action::Land { .. })).count(),
        2,
        "{acts:?}"
    );
    eng.on_recv_consumed(P, 0, Ok(()));
    eng.on_recv_consumed(P, 1, Ok(()));
    let acts = actions(&mut eng);
    let kinds: Vec<&str> = acts
        .iter()
        .map(|a| match a {
            Action::Control {
                msg: PeerMsg::Done { .. },
                ..
            } => "done",
            Action::SendNow { .. } => "now",
            Action::PostCredit { .. } => "repost",
            _ => "other",
        })
        .collect();
    // The second `Done` goes ahead of the first chunk's receive too (written with the batch).
    assert_eq!(kinds, ["done", "now", "done", "repost", "repost"], "{acts:?}");
    assert!(eng.is_idle() && eng.lanes_idle());
    // One transfer of two chunks consumed in one pass: its `Done` ahead of both re-posts.
    eng.on_message(P, header(4, 5, 0, 8192), now);
    for lane in 0..2 {
        eng.on_recv_landed(P, lane, now);
    }
    actions(&mut eng);
    eng.on_recv_consumed(P, 0, Ok(()));
    eng.on_recv_consumed(P, 1, Ok(()));
    let acts = actions(&mut eng);
    let kinds: Vec<&str> = acts
        .iter()
        .map(|a| match a {
            Action::Control {
                msg: PeerMsg::Done { .. },
                ..
            } => "done",
            Action::SendNow { .. } => "now",
            Action::PostCredit { .. } => "repost",
            _ => "other",
        })
        .collect();
    assert_eq!(kinds, ["done", "now", "repost", "repost"], "{acts:?}");
    // A later batch asks again.
    eng.on_message(P, header(3, 5, 0, 4096), now);
    eng.on_recv_landed(P, 0, now);
    actions(&mut eng);
    eng.on_recv_consumed(P, 0, Ok(()));
    let acts = actions(&mut eng);
    assert_eq!(
        acts.iter()
            .filter(|a| matches!(a, Action::SendNow { peer } if *peer == P))
            .count(),
        1,
        "{acts:?}"
    );
}

#[test]
fn a_reads_end_comes_before_its_done_which_comes_before_its_credits_repost() {
    // The reader's side: its READ's one chunk lands and is consumed. The client hears first
    // (`Finished`), then the `Done` that returns the credit, then its receive is posted again.
    let (mut eng, now) = receiver();
    let spec = ReadSpec {
        peer: P,
        remote: RemoteRange {
            buffer_id: 77,
            access_key: key(1),
            offset: 0,
            length: 4096,
        },
        local_buffer: 5,
        local_offset: 0,
    };
    let t = eng
        .start_read(vec![spec], now + Duration::from_secs(5), now)
        .unwrap();
    let read_id = actions(&mut eng)
        .iter()
        .find_map(|a| match a {
            Action::Control {
                msg: PeerMsg::ReadRequest { read_id, .. },
                ..
            } => Some(*read_id),
            _ => None,
        })
        .expect("the read request");
    let PeerMsg::Header(mut o) = header(3, 5, 0, 4096) else {
        unreachable!()
    };
    o.read_id = read_id;
    eng.on_message(P, PeerMsg::Header(o), now);
    eng.on_recv_landed(P, 0, now);
    assert!(
        actions(&mut eng)
            .iter()
            .any(|a| matches!(a, Action::Land { buffer: Some(5), .. }))
    );
    eng.on_recv_consumed(P, 0, Ok(()));
    let acts = actions(&mut eng);
    let at = |f: &dyn Fn(&Action) -> bool| acts.iter().position(f).unwrap_or_else(|| panic!("{acts:?}"));
    let finished = at(
        &|a| matches!(a, Action::Finished { transfer, outcome } if *transfer == t && outcome.code == Code::Ok),
    );
    let repost = at(&|a| matches!(a, Action::PostCredit { lane: 0, .. }));
    let done = at(&|a| {
        matches!(
            a,
            Action::Control {
                msg: PeerMsg::Done { offer_id: 3, .. },
                ..
            }
        )
    });
    // The client's answer, then the `Done` (with the credit), then the credit's receive again:
    // our own READ's `Done` is not written at once (no `SendNow`).
    assert!(finished < done && done < repost, "{acts:?}");
    assert!(
        !acts.iter().any(|a| matches!(a, Action::SendNow { .. })),
        "{acts:?}"
    );
    assert_eq!(
        messages(&acts),
        vec![&PeerMsg::Done {
            offer_id: 3,
            returned: ReturnedCredits::from_counts(&[1, 0])
        }]
    );
    assert!(eng.is_idle() && eng.lanes_idle());
}
