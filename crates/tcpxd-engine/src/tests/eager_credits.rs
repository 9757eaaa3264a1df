//! Owed credits that wait for the transfer's `Done` (`credits.rs`, "Liveness"; issue #38's fixed
//! cost per transfer): while the sender needs none of them for the chunks announced and a `Done`
//! is coming; driven by hand as the receiver of `eager.rs`'s hostile cases.

use super::eager::{MODE, actions, header, messages, receiver};
use super::*;

/// A header of `length` bytes into buffer 6 (16 KiB), made here.
fn header_into_6(eng: &mut Engine, id: u64, length: u64) -> PeerMsg {
    if eng.buffer_users(6).is_none() {
        eng.add_buffer(6, 4 * 4096, key(6)).unwrap();
    }
    let PeerMsg::Header(mut o) = header(id, 6, 0, length) else {
        unreachable!()
    };
    o.ranges = vec![RemoteRange {
        buffer_id: 6,
        access_key: key(6),
        offset: 0,
        length,
    }]
    .into();
    PeerMsg::Header(o)
}

/// Lands `lanes` in order, then hands every chunk to the driver (`Land` actions drained).
fn land(eng: &mut Engine, now: Instant, lanes: &[u32]) {
    for &lane in lanes {
        eng.on_recv_landed(P, lane, now);
    }
    actions(eng);
}

/// Consumes the oldest chunk of `lane` and returns the messages its batch sent.
fn consume(eng: &mut Engine, lane: u32) -> Vec<PeerMsg> {
    eng.on_recv_consumed(P, lane, Ok(()));
    messages(&actions(eng)).into_iter().cloned().collect()
}

fn every_credit_posted(eng: &Engine) {
    let c = eng.peer_counters(P).unwrap();
    assert!(c.recv.iter().all(|l| l.credits == 16), "{c:?}");
}

#[test]
fn a_spread_transfers_credits_ride_with_its_done_however_its_consumes_fall() {
    let (mut eng, now) = receiver();
    // Four 4 KiB chunks, two a lane (lane 0: 1st and 3rd, lane 1: 2nd and 4th), as a spread
    // 1 MiB goes over two credit lanes; every order of consumes, each in a batch of its own.
    let orders: [[u32; 4]; 4] = [[0, 1, 0, 1], [0, 0, 1, 1], [1, 1, 0, 0], [1, 0, 1, 0]];
    for (k, order) in orders.iter().enumerate() {
        let id = k as u64 + 1;
        let h = header_into_6(&mut eng, id, 4 * 4096);
        eng.on_message(P, h, now);
        assert!(messages(&actions(&mut eng)).is_empty());
        // Each chunk lands just before its consume: the other lane's are still on their way.
        for (i, &lane) in order.iter().enumerate() {
            land(&mut eng, now, &[lane]);
            let msgs = consume(&mut eng, lane);
            if i < 3 {
                // Each lane owes up to two while the sender holds 14 more: nothing goes back.
                assert!(msgs.is_empty(), "{order:?}, consume {i}: {msgs:?}");
            } else {
                assert_eq!(
                    msgs,
                    vec![PeerMsg::Done {
                        offer_id: id,
                        returned: ReturnedCredits::from_counts(&[2, 2])
                    }],
                    "{order:?}: one message back, every credit in it"
                );
            }
        }
    }
    assert!(eng.is_idle() && eng.lanes_idle());
    every_credit_posted(&eng);
}

#[test]
fn credits_wait_while_a_lane_opened_on_first_use_is_not_ready_yet() {
    // Lane 1's receives are not posted yet (its comm still opening, as a lane opened on first
    // use): the sender already holds its 16 credits from the `ReceiveMode`, so lane 0's owed
    // credits may still wait for the `Done`.
    let mut eng = Engine::new(EngineConfig {
        protocol: Protocol::Eager,
        ..small_chunks()
    });
    let p = eng.add_peer("late-lane", 2, 2);
    let now = Instant::now();
    eng.on_message(p, MODE, now);
    eng.on_lane_ready(p, 0, true);
    eng.on_lane_ready(p, 0, false);
    actions(&mut eng);
    let h = header_into_6(&mut eng, 1, 4 * 4096);
    eng.on_message(P, h, now);
    actions(&mut eng);
    for _ in 0..2 {
        land(&mut eng, now, &[0]);
        assert!(
            consume(&mut eng, 0).is_empty(),
            "lane 1 not ready: nothing goes back"
        );
    }
    eng.on_lane_ready(p, 1, false);
    let posted = actions(&mut eng)
        .iter()
        .filter(|a| matches!(a, Action::PostCredit { lane: 1, .. }))
        .count();
    assert_eq!(posted, 16);
    land(&mut eng, now, &[1, 1]);
    assert!(consume(&mut eng, 1).is_empty());
    assert_eq!(
        consume(&mut eng, 1),
        vec![PeerMsg::Done {
            offer_id: 1,
            returned: ReturnedCredits::from_counts(&[2, 2])
        }]
    );
    every_credit_posted(&eng);
}

#[test]
fn owed_credits_go_back_at_once_when_the_sender_needs_them_for_what_it_announced() {
    let (mut eng, now) = receiver();
    eng.add_buffer(7, 36 * 4096, key(7)).unwrap();
    // Transfer 1: three chunks (lanes 0, 1, 0); lane 0's two consumed, lane 1's still coming.
    let h = header_into_6(&mut eng, 1, 3 * 4096);
    eng.on_message(P, h, now);
    land(&mut eng, now, &[0, 0]);
    assert!(consume(&mut eng, 0).is_empty());
    assert!(
        consume(&mut eng, 0).is_empty(),
        "lane 0 owes two, the sender holds 14 more"
    );
    // Transfer 2 announces 16 chunks a lane: every credit of lane 0, two of which are owed. Its
    // header's batch returns them: without them its sender would wait for a `Done` that waits
    // for its chunks.
    let PeerMsg::Header(mut o) = header(2, 7, 0, 32 * 4096) else {
        unreachable!()
    };
    o.ranges = vec![RemoteRange {
        buffer_id: 7,
        access_key: key(7),
        offset: 0,
        length: 32 * 4096,
    }]
    .into();
    eng.on_message(P, PeerMsg::Header(o), now);
    let acts = actions(&mut eng);
    assert_eq!(
        messages(&acts),
        vec![&PeerMsg::Credits {
            returned: ReturnedCredits::from_counts(&[2, 0])
        }],
        "{acts:?}"
    );
    // Everything lands and is consumed: each transfer's `Done` (or a `Credits` message) returns
    // the rest, and every credit comes back exactly once.
    let mut back = [2u32, 0];
    land(&mut eng, now, &[1]);
    let mut msgs = consume(&mut eng, 1);
    for _ in 0..16 {
        land(&mut eng, now, &[0, 1]);
        msgs.extend(consume(&mut eng, 0));
        msgs.extend(consume(&mut eng, 1));
    }
    let mut dones = Vec::new();
    for m in &msgs {
        match m {
            PeerMsg::Credits { returned } => {
                back[0] += returned.on_lane(0);
                back[1] += returned.on_lane(1);
            }
            PeerMsg::Done { offer_id, returned } => {
                dones.push(*offer_id);
                back[0] += returned.on_lane(0);
                back[1] += returned.on_lane(1);
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(dones, vec![1, 2]);
    assert_eq!(back, [18, 17], "every consume's credit, once");
    assert!(eng.is_idle() && eng.lanes_idle());
    every_credit_posted(&eng);
}

#[test]
fn owed_credits_wait_only_for_a_done_that_is_coming() {
    // A transfer cancelled by its sender lands nothing and sends no `Done`: what its consumes
    // owe goes back once no other transfer's `Done` is coming.
    let (mut eng, now) = receiver();
    let h = header_into_6(&mut eng, 1, 4 * 4096);
    eng.on_message(P, h, now);
    land(&mut eng, now, &[0, 1]);
    assert!(consume(&mut eng, 0).is_empty());
    assert!(
        consume(&mut eng, 1).is_empty(),
        "each lane owes one, its `Done` is coming"
    );
    eng.on_message(
        P,
        PeerMsg::CancelOffer {
            offer_id: 1,
            code: Code::Cancelled,
            message: "client cancelled".into(),
        },
        now,
    );
    let acts = actions(&mut eng);
    assert_eq!(
        messages(&acts),
        vec![
            &PeerMsg::CancelSeen { offer_id: 1 },
            &PeerMsg::Credits {
                returned: ReturnedCredits::from_counts(&[1, 1])
            }
        ],
        "its `Done` will not come: {acts:?}"
    );
    // Its last chunks still meet their receives, consumed without landing; their credits too.
    land(&mut eng, now, &[0, 1]);
    let mut msgs = consume(&mut eng, 0);
    msgs.extend(consume(&mut eng, 1));
    assert_eq!(
        msgs,
        vec![PeerMsg::Credits {
            returned: ReturnedCredits::from_counts(&[1, 1])
        }]
    );
    assert!(eng.is_idle() && eng.lanes_idle());
    every_credit_posted(&eng);
}

#[test]
fn a_credit_that_waits_goes_back_when_the_transfer_fails_instead() {
    let (mut eng, now) = receiver();
    eng.on_message(P, header(1, 5, 0, 8192), now);
    for lane in 0..2 {
        eng.on_recv_landed(P, lane, now);
    }
    actions(&mut eng);
    eng.on_recv_consumed(P, 0, Ok(()));
    assert!(messages(&actions(&mut eng)).is_empty());
    // The second chunk's unpack failed: the transfer fails, and every credit goes back.
    eng.on_recv_consumed(P, 1, Err("unpack on GPU 0: boom".into()));
    let acts = actions(&mut eng);
    let returned: u32 = messages(&acts)
        .iter()
        .map(|m| match m {
            PeerMsg::Credits { returned } | PeerMsg::Done { returned, .. } => returned.total() as u32,
            _ => 0,
        })
        .sum();
    assert_eq!(returned, 2, "{acts:?}");
    assert!(eng.is_idle() && eng.lanes_idle());
    let c = eng.peer_counters(P).unwrap();
    assert!(c.recv.iter().all(|l| l.credits == 16), "{c:?}");
}
