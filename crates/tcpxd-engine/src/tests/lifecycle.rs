//! The engine's lifecycle decisions: a drain (no new transfer, the grace period, what it did),
//! a buffer's last user ending (`Action::BufferIdle`) and a malformed request from a peer.

use super::*;

#[test]
fn a_drain_refuses_new_transfers_and_lets_running_ones_finish() {
    every_mode(a_drain_refuses_new_transfers_and_lets_running_ones_finish_in_mode);
}

fn a_drain_refuses_new_transfers_and_lets_running_ones_finish_in_mode() {
    let mut s = Sim::new(2, small_chunks(), 71);
    s.buffer(0, 1, 256 * 1024, 1);
    s.buffer(1, 2, 256 * 1024, 0);
    let t = s.write(0, 1, 0, 2, 0, 256 * 1024);
    assert_eq!(s.nodes[0].eng.is_drained(s.now), None, "no drain began");
    s.nodes[0].eng.begin_drain(s.now + Duration::from_secs(60));
    assert!(s.nodes[0].eng.is_draining());
    assert_eq!(s.nodes[0].eng.is_drained(s.now), None, "a transfer still runs");
    let spec = WriteSpec {
        local_buffer: 1,
        local_offset: 0,
        peer: P,
        remote: RemoteRange {
            buffer_id: 2,
            access_key: key(2),
            offset: 0,
            length: 10,
        },
    };
    let e = s.nodes[0]
        .eng
        .start_write(vec![spec], vec![], s.now + Duration::from_secs(1), s.now)
        .unwrap_err();
    assert_eq!(e.code, Code::Unavailable);
    assert!(e.message.contains("shutting down"), "{}", e.message);
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.same((0, 1, 0), (1, 2, 0), 256 * 1024));
    assert_eq!(
        s.nodes[0].eng.is_drained(s.now),
        Some(DrainReport {
            finished_in_grace: 1,
            failed_at_deadline: 0
        })
    );
    s.assert_idle();
}

#[test]
fn a_drain_fails_what_is_left_when_its_grace_period_ends() {
    every_mode(a_drain_fails_what_is_left_when_its_grace_period_ends_in_mode);
}

fn a_drain_fails_what_is_left_when_its_grace_period_ends_in_mode() {
    let mut s = Sim::new(2, small_chunks(), 72);
    s.buffer(0, 1, 256 * 1024, 1);
    s.buffer(1, 2, 256 * 1024, 0);
    let t = s.write(0, 1, 0, 2, 0, 256 * 1024);
    for _ in 0..10 {
        s.step();
    }
    let deadline = s.now + Duration::from_millis(5);
    s.nodes[0].eng.begin_drain(deadline);
    assert_eq!(s.nodes[0].eng.next_deadline(), Some(deadline));
    s.nodes[0].eng.on_tick(deadline);
    assert_eq!(
        s.nodes[0].eng.is_drained(deadline),
        None,
        "the grace period is not over"
    );
    let later = deadline + Duration::from_millis(1);
    s.nodes[0].eng.on_tick(later);
    assert_eq!(
        s.nodes[0].eng.is_drained(later),
        Some(DrainReport {
            finished_in_grace: 0,
            failed_at_deadline: 1
        })
    );
    s.run();
    let o = s.outcome(0, t);
    assert_eq!(o.code, Code::Unavailable);
    assert!(o.message.contains("grace period over"), "{}", o.message);
    s.assert_idle();
}

#[test]
fn closing_the_comms_gets_the_rest_of_the_grace_period_or_at_least_a_second() {
    let mut s = Sim::new(2, small_chunks(), 74);
    let now = s.now;
    // No drain (a stop without one): a second.
    assert_eq!(s.nodes[0].eng.close_by(now), now + CLOSE_AT_LEAST);
    // Drained early: until the grace period's end.
    let deadline = now + Duration::from_secs(30);
    s.nodes[0].eng.begin_drain(deadline);
    assert_eq!(
        s.nodes[0].eng.is_drained(now).map(|r| r.failed_at_deadline),
        Some(0)
    );
    assert_eq!(s.nodes[0].eng.close_by(now), deadline);
    // Drained at (or past) the deadline: a second more, never a wait without end.
    let late = deadline + Duration::from_millis(1);
    assert_eq!(s.nodes[0].eng.close_by(late), late + CLOSE_AT_LEAST);
    s.run();
    s.assert_idle();
}

#[test]
fn a_buffer_watched_while_in_use_is_reported_idle_once_its_last_user_ends() {
    every_mode(a_buffer_watched_while_in_use_is_reported_idle_once_its_last_user_ends_in_mode);
}

fn a_buffer_watched_while_in_use_is_reported_idle_once_its_last_user_ends_in_mode() {
    let mut s = Sim::new(2, small_chunks(), 73);
    s.buffer(0, 1, 256 * 1024, 1);
    s.buffer(1, 2, 256 * 1024, 0);
    let t = s.write(0, 1, 0, 2, 0, 256 * 1024);
    // The sender's source is in use from the start; watch it, and (once it has users) the
    // receiver's destination.
    assert!(!s.nodes[0].eng.watch_buffer(1), "the source is in use");
    assert!(s.nodes[0].eng.remove_buffer(1).is_err(), "refused while in use");
    let mut watched_dest = false;
    while s.step() {
        if !watched_dest && s.nodes[1].eng.buffer_users(2).unwrap() > 0 {
            assert!(!s.nodes[1].eng.watch_buffer(2));
            watched_dest = true;
        }
    }
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert_eq!(s.nodes[0].idle, [1], "the source, once");
    if watched_dest {
        assert_eq!(s.nodes[1].idle, [2], "the destination, once");
    }
    // Idle now: no action, the answer straight away; an unknown buffer is never in use.
    assert!(s.nodes[0].eng.watch_buffer(1));
    assert!(s.nodes[0].eng.watch_buffer(99));
    s.drain();
    assert_eq!(s.nodes[0].idle, [1]);
    s.assert_idle();
    s.nodes[0].eng.remove_buffer(1).unwrap();
}

#[test]
fn a_malformed_offer_or_read_request_is_refused_naming_the_field() {
    let mut s = Sim::new(2, small_chunks(), 74);
    s.run();
    let eng = &mut s.nodes[1].eng;
    eng.on_malformed(
        P,
        Malformed::Offer {
            offer_id: 7,
            why: "ranges[1]: missing".into(),
        },
    );
    eng.on_malformed(
        P,
        Malformed::ReadRequest {
            read_id: 9,
            why: "pairs[0].dest: missing".into(),
        },
    );
    let sent: Vec<Action> = std::iter::from_fn(|| eng.poll_action()).collect();
    assert_eq!(
        sent,
        [
            Action::Control {
                peer: P,
                msg: PeerMsg::Reject {
                    offer_id: 7,
                    code: Code::InvalidArgument,
                    message: "ranges[1]: missing".into(),
                    range_index: 0,
                },
            },
            Action::Control {
                peer: P,
                msg: PeerMsg::ReadReject {
                    read_id: 9,
                    code: Code::InvalidArgument,
                    message: "pairs[0].dest: missing".into(),
                    range_index: 0,
                },
            },
        ]
    );
    // Nothing else changed; a failed or unknown pairing gets no answer.
    assert!(eng.is_idle());
    eng.on_peer_failed(P, "gone");
    while eng.poll_action().is_some() {}
    eng.on_malformed(
        P,
        Malformed::Offer {
            offer_id: 8,
            why: "x".into(),
        },
    );
    eng.on_malformed(
        PeerIdx(77),
        Malformed::Offer {
            offer_id: 8,
            why: "x".into(),
        },
    );
    assert_eq!(eng.poll_action(), None);
}
