//! Owed credits that wait for the transfer's `Done` (`credits_may_wait`, issue #38's fixed cost
//! per transfer): only while each lane owes at most one and a lane that owes nothing still
//! expects a chunk; driven by hand as the receiver of `eager.rs`'s hostile cases.

use super::eager::{actions, header, messages, receiver};
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

#[test]
fn credits_wait_for_the_done_only_while_a_lane_that_owes_nothing_expects_a_chunk() {
    let (mut eng, now) = receiver();
    // Three 4 KiB chunks: lane 0 gets the first and third, lane 1 the second.
    let h = header_into_6(&mut eng, 1, 3 * 4096);
    eng.on_message(P, h, now);
    assert!(messages(&actions(&mut eng)).is_empty());
    for lane in [0, 1, 0] {
        eng.on_recv_landed(P, lane, now);
    }
    actions(&mut eng);
    // Lane 0's first consumed: lane 1 owes nothing and still expects its chunk, so lane 0's one
    // credit waits.
    eng.on_recv_consumed(P, 0, Ok(()));
    assert!(messages(&actions(&mut eng)).is_empty());
    // Lane 0's second: it owes two, more than one credit per lane waits: both go back now.
    eng.on_recv_consumed(P, 0, Ok(()));
    let acts = actions(&mut eng);
    assert_eq!(
        messages(&acts),
        vec![&PeerMsg::Credits { returned: vec![2, 0] }],
        "{acts:?}"
    );
    eng.on_recv_consumed(P, 1, Ok(()));
    let acts = actions(&mut eng);
    assert_eq!(
        messages(&acts),
        vec![&PeerMsg::Done {
            offer_id: 1,
            returned: vec![0, 1]
        }],
        "{acts:?}"
    );

    // The same transfer consumed in the other order of lanes: lane 0's first waits while lane 1
    // expects its chunk; lane 1's consume leaves no lane that owes nothing and expects one, so
    // both credits go back before the transfer's last chunk.
    let h = header_into_6(&mut eng, 2, 3 * 4096);
    eng.on_message(P, h, now);
    actions(&mut eng);
    for lane in [0, 1, 0] {
        eng.on_recv_landed(P, lane, now);
    }
    actions(&mut eng);
    eng.on_recv_consumed(P, 0, Ok(()));
    assert!(messages(&actions(&mut eng)).is_empty());
    eng.on_recv_consumed(P, 1, Ok(()));
    let acts = actions(&mut eng);
    assert_eq!(
        messages(&acts),
        vec![&PeerMsg::Credits { returned: vec![1, 1] }],
        "{acts:?}"
    );
    eng.on_recv_consumed(P, 0, Ok(()));
    let acts = actions(&mut eng);
    assert_eq!(
        messages(&acts),
        vec![&PeerMsg::Done {
            offer_id: 2,
            returned: vec![1, 0]
        }],
        "{acts:?}"
    );
    assert!(eng.is_idle() && eng.lanes_idle());
    let c = eng.peer_counters(P).unwrap();
    assert!(c.recv.iter().all(|l| l.credits == 16), "{c:?}");
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
            PeerMsg::Credits { returned } | PeerMsg::Done { returned, .. } => returned.iter().sum(),
            _ => 0,
        })
        .sum();
    assert_eq!(returned, 2, "{acts:?}");
    assert!(eng.is_idle() && eng.lanes_idle());
    let c = eng.peer_counters(P).unwrap();
    assert!(c.recv.iter().all(|l| l.credits == 16), "{c:?}");
}
