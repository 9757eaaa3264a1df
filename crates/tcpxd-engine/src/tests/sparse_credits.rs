//! Returned credits in their sparse form (peer protocol 12, `wire::ReturnedCredits`): the
//! receiver names only the lanes that owe, in lane order; the sender refuses a list that is not
//! whole pairs, names a lane twice, out of order or out of range, returns none on a lane, or
//! more than the lane has out — in a `Credits` message or inside a `Done` alike, as it refused
//! a dense list of the wrong length before.

use super::eager::{actions, closed, header, messages, receiver};
use super::*;

#[test]
fn a_done_names_only_the_lanes_that_owe_in_lane_order() {
    let (mut eng, now) = receiver();
    // Two 4 KiB chunks from lane 1 on: lane 1 is used (and listed) before lane 0.
    let PeerMsg::Header(mut o) = header(1, 5, 0, 8192) else {
        unreachable!()
    };
    o.first_lane = 1;
    eng.on_message(P, PeerMsg::Header(o), now);
    for lane in [1, 0] {
        eng.on_recv_landed(P, lane, now);
    }
    actions(&mut eng);
    eng.on_recv_consumed(P, 1, Ok(()));
    assert!(
        messages(&actions(&mut eng)).is_empty(),
        "its credit waits for the Done"
    );
    eng.on_recv_consumed(P, 0, Ok(()));
    let acts = actions(&mut eng);
    assert_eq!(
        messages(&acts),
        vec![&PeerMsg::Done {
            offer_id: 1,
            returned: ReturnedCredits::from_wire(vec![0, 1, 1, 1]),
        }],
        "{acts:?}"
    );
    // A later transfer on lane 0 alone: its Done names lane 0 only.
    eng.on_message(P, header(2, 5, 0, 4096), now);
    eng.on_recv_landed(P, 0, now);
    actions(&mut eng);
    eng.on_recv_consumed(P, 0, Ok(()));
    let acts = actions(&mut eng);
    assert_eq!(
        messages(&acts),
        vec![&PeerMsg::Done {
            offer_id: 2,
            returned: ReturnedCredits::from_wire(vec![0, 1]),
        }],
        "{acts:?}"
    );
    assert!(eng.is_idle() && eng.lanes_idle());
}

#[test]
fn malformed_returned_credits_fail_the_pairing_in_credits_and_in_done() {
    // The receiver's peer has 2 lanes; it holds all 16 credits of each.
    let cases: [(Vec<u32>, &str); 9] = [
        (vec![0], "credits as 1 numbers, not (lane, count) pairs"),
        (vec![0, 1, 1], "credits as 3 numbers"),
        (vec![2, 1], "credits for lane 2, the pairing has 2"),
        (vec![u32::MAX, 1], "the pairing has 2"),
        (
            vec![1, 1, 0, 1],
            "credits for lane 0 after lane 1: lanes must increase",
        ),
        (vec![1, 1, 1, 1], "credits for lane 1 after lane 1"),
        (vec![0, 0], "0 credits for lane 0"),
        (vec![0, 1], "lane 0: 1 credits returned with 16 held of 16"),
        (
            vec![1, u32::MAX],
            "lane 1: 4294967295 credits returned with 16 held of 16",
        ),
    ];
    for (wire, words) in cases {
        for in_done in [false, true] {
            let (mut eng, now) = receiver();
            let returned = ReturnedCredits::from_wire(wire.clone());
            let msg = if in_done {
                PeerMsg::Done {
                    offer_id: 77,
                    returned,
                }
            } else {
                PeerMsg::Credits { returned }
            };
            eng.on_message(P, msg, now);
            let acts = actions(&mut eng);
            assert!(
                closed(&acts).is_some_and(|w| w.contains("protocol violation") && w.contains(words)),
                "{wire:?} (in a Done: {in_done}): {words}: {acts:?}"
            );
        }
    }
}

#[test]
fn the_sparse_form_round_trips_and_keeps_lanes_in_order() {
    let mut r = ReturnedCredits::default();
    assert!(r.is_empty() && r.check(0).is_ok());
    for (lane, n) in [(7, 2), (3, 1), (300, 16), (0, 4), (5, 1)] {
        r.insert(lane, n);
    }
    assert_eq!(r.wire(), &[0, 4, 3, 1, 5, 1, 7, 2, 300, 16]);
    assert_eq!(r.check(301), Ok(()));
    assert_eq!(
        r.check(300),
        Err("credits for lane 300, the pairing has 300".into())
    );
    assert_eq!((r.on_lane(7), r.on_lane(8), r.total()), (2, 0, 24));
    let mut dense = vec![0u32; 301];
    for (lane, n) in r.pairs() {
        dense[lane as usize] = n;
    }
    assert_eq!(ReturnedCredits::from_counts(&dense), r);
    assert_eq!(ReturnedCredits::from_wire(r.clone().into_wire()), r);
}
