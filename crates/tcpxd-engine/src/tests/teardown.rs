//! Tearing transfers down: cancel (before the accept, midway, of a READ), deadlines, a failed peer
//! and a failed unpack; each drains every slot on both sides.

use super::*;

#[test]
fn cancel_before_accept_and_midway_drains_every_slot() {
    every_mode(cancel_before_accept_and_midway_drains_every_slot_in_mode);
}

fn cancel_before_accept_and_midway_drains_every_slot_in_mode() {
    for stage in 0..3 {
        let mut s = Sim::new(2, small_chunks(), 10 + stage);
        s.buffer(0, 1, 256 * 1024, 1);
        s.buffer(1, 2, 256 * 1024, 0);
        let t = s.write(0, 1, 0, 2, 0, 256 * 1024);
        match stage {
            0 => {} // before the offer is even delivered
            1 => {
                s.drain();
                let m = s.ctrl[1].pop_front().unwrap();
                s.nodes[1].eng.on_message(P, m, s.now); // accepted, accept in flight
            }
            _ => {
                for _ in 0..40 {
                    s.step(); // some chunks moved
                }
            }
        }
        assert!(
            s.nodes[0]
                .eng
                .cancel(t, Code::Cancelled, "cancelled by the client")
        );
        assert!(
            !s.nodes[0].eng.cancel(t, Code::Cancelled, "again"),
            "a second cancel is a no-op"
        );
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Cancelled);
        assert!(
            s.nodes[1].notes.is_empty(),
            "no notification for a cancelled write (stage {stage})"
        );
        s.assert_idle();
    }
}

#[test]
fn cancelling_a_read_drains_both_sides() {
    every_mode(cancelling_a_read_drains_both_sides_in_mode);
}

fn cancelling_a_read_drains_both_sides_in_mode() {
    for stage in 0..3 {
        let mut s = Sim::new(2, small_chunks(), 20 + stage);
        s.buffer(0, 1, 128 * 1024, 0);
        s.buffer(1, 2, 128 * 1024, 5);
        let t = s.read(0, 2, 0, 1, 0, 128 * 1024);
        for _ in 0..(stage * 15) {
            s.step();
        }
        assert!(s.nodes[0].eng.cancel(t, Code::Cancelled, "stop"));
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Cancelled);
        s.assert_idle();
    }
}

#[test]
fn deadlines_fail_transfers_at_tick() {
    every_mode(deadlines_fail_transfers_at_tick_in_mode);
}

fn deadlines_fail_transfers_at_tick_in_mode() {
    let mut s = Sim::new(1, small_chunks(), 30);
    s.buffer(0, 1, 65536, 1);
    s.buffer(1, 2, 65536, 0);
    let spec = WriteSpec {
        local_buffer: 1,
        local_offset: 0,
        peer: P,
        remote: RemoteRange {
            buffer_id: 2,
            access_key: key(2),
            offset: 0,
            length: 65536,
        },
    };
    let now = s.now;
    let t = s.nodes[0]
        .eng
        .start_write(vec![spec], vec![], now + Duration::from_millis(50), now)
        .unwrap();
    for _ in 0..5 {
        s.step();
    }
    assert_eq!(
        s.nodes[0].eng.next_deadline(),
        Some(now + Duration::from_millis(50))
    );
    s.nodes[0].eng.on_tick(now + Duration::from_millis(49));
    s.drain();
    assert!(!s.nodes[0].finished.contains_key(&t));
    s.nodes[0].eng.on_tick(now + Duration::from_millis(50));
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::DeadlineExceeded);
    assert_eq!(s.nodes[0].eng.next_deadline(), None);
    s.assert_idle();
}

#[test]
fn a_failed_peer_fails_every_transfer_touching_it() {
    every_mode(a_failed_peer_fails_every_transfer_touching_it_in_mode);
}

fn a_failed_peer_fails_every_transfer_touching_it_in_mode() {
    let mut s = Sim::new(2, small_chunks(), 40);
    s.buffer(0, 1, 65536, 1);
    s.buffer(1, 2, 65536, 0);
    let w = s.write(0, 1, 0, 2, 0, 65536);
    let r = s.read(0, 2, 0, 1, 0, 1000);
    for _ in 0..10 {
        s.step();
    }
    s.nodes[0]
        .eng
        .on_peer_failed(P, "lane 1: Connection closed by remote peer");
    s.drain();
    for t in [w, r] {
        let o = s.outcome(0, t);
        assert_eq!(o.code, Code::Unavailable);
        assert!(
            o.message.contains("peer node-b failed") && o.message.contains("Connection closed"),
            "{}",
            o.message
        );
    }
    assert_eq!(s.nodes[0].closed.len(), 1);
    assert!(s.nodes[0].eng.is_idle());
    assert_eq!(s.nodes[0].eng.posted(), (0, 0));
    s.nodes[0].eng.remove_buffer(1).expect("no user is left");
    // New work towards the failed peer is refused up front.
    s.buffer(0, 3, 10, 0);
    let e = s.nodes[0]
        .eng
        .start_write(
            vec![WriteSpec {
                local_buffer: 3,
                local_offset: 0,
                peer: P,
                remote: RemoteRange {
                    buffer_id: 2,
                    access_key: key(2),
                    offset: 0,
                    length: 1,
                },
            }],
            vec![],
            s.now + Duration::from_secs(1),
            s.now,
        )
        .unwrap_err();
    assert_eq!(e.code, Code::Unavailable);
}

#[test]
fn an_unpack_failure_fails_the_write_and_still_drains() {
    every_mode(an_unpack_failure_fails_the_write_and_still_drains_in_mode);
}

fn an_unpack_failure_fails_the_write_and_still_drains_in_mode() {
    let mut s = Sim::new(1, small_chunks(), 50);
    s.buffer(0, 1, 40_000, 1);
    s.buffer(1, 2, 40_000, 0);
    s.wires[0][0]
        .recv_results
        .push_back(Err("fragment past the posted size".into()));
    let t = s.write(0, 1, 0, 2, 0, 40_000);
    s.run();
    let o = s.outcome(0, t);
    assert_eq!(o.code, Code::Internal);
    assert!(
        o.message.contains("fragment past the posted size"),
        "{}",
        o.message
    );
    assert!(s.nodes[1].notes.is_empty());
    s.assert_idle();
}

/// A READ that ended here (cancelled, or its deadline passed) with its chunks in flight both
/// ways — some already arrived in the bounce pages, some sent by the holder before it learned,
/// the rest still queued — changes no byte of its destination from the moment it is reported
/// ended: arrived chunks are not unpacked (`Engine::recv_lands`), receives not yet posted go into
/// the lane's own place (`Action::PostDropRecv`), and every slot still drains. (The daemon's
/// numpy array found zeroed after a timed-out READ: its emptied chunks were scattered from
/// zeroed landing slots into the client's pages after the READ had failed.)
#[test]
fn a_read_that_ended_changes_no_byte_of_its_destination_afterwards() {
    every_mode(a_read_that_ended_changes_no_byte_of_its_destination_afterwards_in_mode);
}

fn a_read_that_ended_changes_no_byte_of_its_destination_afterwards_in_mode() {
    for (seed, deadline) in [(60, false), (61, true)] {
        // A receive window smaller than the send window: the holder has data sends posted that
        // no receive met yet when the READ ends.
        let cfg = EngineConfig {
            recv_window: 4,
            credits: 4,
            ..small_chunks()
        };
        let mut s = Sim::new(2, cfg, seed);
        s.buffer(0, 1, 256 * 1024, 0);
        s.buffer(1, 2, 256 * 1024, 9);
        let source = s.nodes[1].bufs[&2].clone();
        s.hold_data = true;
        let t = s.read(0, 2, 0, 1, 0, 256 * 1024);
        s.run(); // control messages only: offers, accepts, headers; data posted and met
        assert!(!s.nodes[0].finished.contains_key(&t));
        if deadline {
            let late = s.now + Duration::from_secs(61);
            s.nodes[0].eng.on_tick(late);
        } else {
            assert!(s.nodes[0].eng.cancel(t, Code::Cancelled, "stop"));
        }
        s.drain();
        let code = s.outcome(0, t).code;
        assert_eq!(
            code,
            if deadline {
                Code::DeadlineExceeded
            } else {
                Code::Cancelled
            }
        );
        let at_end = s.nodes[0].bufs[&1].clone();
        s.hold_data = false;
        s.run();
        assert!(
            s.nodes[0].bufs[&1] == at_end,
            "{:?}: bytes of the destination changed after the READ ended",
            mode_now()
        );
        assert!(
            s.nodes[0].dropped > 0,
            "{:?}: no chunk with data came after the end",
            mode_now()
        );
        if mode_now() == Protocol::Rendezvous {
            assert!(
                s.nodes[0].drop_posts > 0,
                "receives posted after the end went into the lanes' own place"
            );
        }
        assert!(
            s.nodes[1].bufs[&2] == source,
            "the holder's source is never written"
        );
        s.assert_idle();
    }
}

/// A WRITE its sender cancelled: its source is never written; it is reported at once; its chunks
/// that go out empty wait until the receiver said it discards the offer (`CancelSeen`), so none
/// reaches a receive that still lands the offer (the daemon would land a staged one, its zeroed
/// landing slot, as zeros), even when the cancel is slow to reach the receiver and every other
/// chunk moves first; and from the moment the receiver has the cancel no byte of the destination
/// changes.
#[test]
fn a_cancelled_writes_emptied_chunks_wait_until_its_receiver_discards() {
    every_mode(a_cancelled_writes_emptied_chunks_wait_until_its_receiver_discards_in_mode);
}

fn a_cancelled_writes_emptied_chunks_wait_until_its_receiver_discards_in_mode() {
    let cfg = EngineConfig {
        recv_window: 4,
        credits: 4,
        ..small_chunks()
    };
    let mut s = Sim::new(2, cfg, 70);
    s.buffer(0, 1, 256 * 1024, 3);
    s.buffer(1, 2, 256 * 1024, 0);
    let source = s.nodes[0].bufs[&1].clone();
    s.hold_data = true;
    let t = s.write(0, 1, 0, 2, 0, 256 * 1024);
    s.run(); // offer and accept (or header); data posted and met, nothing completed
    assert!(s.nodes[0].eng.cancel(t, Code::Cancelled, "stop"));
    s.drain();
    assert_eq!(s.outcome(0, t).code, Code::Cancelled);
    // The cancel is slow to reach the receiver: everything else moves first.
    let slow: Vec<PeerMsg> = s.ctrl[1].drain(..).collect();
    assert!(
        slow.iter().any(|m| matches!(m, PeerMsg::CancelOffer { .. })),
        "{:?}: the receiver is told",
        mode_now()
    );
    s.hold_data = false;
    s.run();
    assert!(
        !s.nodes[0].eng.is_idle(),
        "{:?}: the emptied chunks wait",
        mode_now()
    );
    for m in slow {
        let now = s.now;
        s.nodes[1].eng.on_message(P, m, now);
    }
    let at_cancel = s.nodes[1].bufs[&2].clone();
    s.run();
    assert!(
        s.nodes[1].bufs[&2] == at_cancel,
        "{:?}: the destination changed after the receiver had the cancel",
        mode_now()
    );
    assert_eq!(
        s.nodes[1].emptied_live,
        0,
        "{:?}: an emptied chunk reached a receive still landing it",
        mode_now()
    );
    assert!(s.nodes[0].bufs[&1] == source, "the source is never written");
    assert!(s.nodes[1].notes.is_empty());
    s.assert_idle();
}
