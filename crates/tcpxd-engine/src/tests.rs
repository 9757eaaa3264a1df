//! Two engines wired back to back through a simulated plugin: per lane and direction, the k-th
//! posted send meets the k-th posted receive (tags ignored, FIFO, as TCPX), and the simulator
//! asserts the sender never sends more than the receiver posted. Events (control messages, send
//! completions, receive completions) are delivered in a seeded random order.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::*;

mod auto;
mod block_transfers;
mod coalesced;
mod eager;
mod eager_credits;
mod failed_sends;
mod gather_ahead;
mod gpu_credits;
mod inline;
mod inline_copies;
mod inline_gpu;
mod lane_life;
mod lifecycle;
mod listed_lanes;
mod lone_notice;
mod mixed_routes;
mod owed_credits;
mod packed_batch;
mod pair_life;
mod perf_pair;
mod prepared;
mod prepared_early;
mod release;
mod routed_credits;
mod routes;
mod sim;
mod sim_pair;
mod sim_unpack;
mod sparse_credits;
mod spread;
mod teardown;

use sim::*;
use sim_pair::{rendezvous_peer, small_chunks};

/// Drains the engine's actions; the offer each peer was sent, by peer.
fn offers_by_peer(eng: &mut Engine) -> HashMap<PeerIdx, u64> {
    let mut offers = HashMap::new();
    while let Some(a) = eng.poll_action() {
        if let Action::Control {
            peer,
            msg: PeerMsg::Offer(o),
        } = a
        {
            offers.insert(peer, o.offer_id);
        }
    }
    offers
}

#[test]
fn write_lands_byte_exact_and_completes_after_done() {
    every_mode(write_lands_byte_exact_and_completes_after_done_in_mode);
}

fn write_lands_byte_exact_and_completes_after_done_in_mode() {
    let mut s = Sim::new(2, small_chunks(), 1);
    s.buffer(0, 1, 100_000, 7);
    s.buffer(1, 2, 200_000, 0);
    let t = s.write(0, 1, 10, 2, 5000, 90_000);
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.same((0, 1, 10), (1, 2, 5000), 90_000));
    assert_eq!(s.nodes[0].progress[&t], 90_000);
    assert_eq!(
        s.nodes[1].notes,
        vec![(1, b"note".to_vec())],
        "the receiver delivers the notification"
    );
    assert_eq!(
        s.nodes[1].bufs[&2][..5000],
        vec![0u8; 5000][..],
        "nothing outside the range changed"
    );
    s.assert_idle();
}

#[test]
fn write_completes_only_when_the_receiver_reports_done() {
    every_mode(write_completes_only_when_the_receiver_reports_done_in_mode);
}

fn write_completes_only_when_the_receiver_reports_done_in_mode() {
    let mut s = Sim::new(1, small_chunks(), 2);
    s.buffer(0, 1, 8192, 1);
    s.buffer(1, 2, 8192, 0);
    let t = s.write(0, 1, 0, 2, 0, 8192);
    // Deliver everything but the receiver's completions: sends finish, the write must not.
    for _ in 0..200 {
        s.drain();
        if let Some(msg) = s.ctrl[1].pop_front() {
            s.nodes[1].eng.on_message(P, msg, s.now);
        }
        if let Some(msg) = s.ctrl[0].pop_front() {
            s.nodes[0].eng.on_message(P, msg, s.now);
        }
        while s.wires[0][0].send_done_pending > 0 {
            s.wires[0][0].send_done_pending -= 1;
            s.nodes[0].eng.on_send_done(P, 0);
        }
    }
    s.drain();
    assert!(
        !s.nodes[0].finished.contains_key(&t),
        "a WRITE finished before the receiver unpacked it"
    );
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    s.assert_idle();
}

#[test]
fn read_pulls_remote_bytes() {
    every_mode(read_pulls_remote_bytes_in_mode);
}

fn read_pulls_remote_bytes_in_mode() {
    let mut s = Sim::new(3, small_chunks(), 3);
    s.buffer(0, 1, 50_000, 0);
    s.buffer(1, 9, 60_000, 33);
    let t = s.read(0, 9, 1234, 1, 100, 40_000);
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.same((1, 9, 1234), (0, 1, 100), 40_000));
    assert_eq!(s.nodes[0].progress[&t], 40_000);
    s.assert_idle();
}

#[test]
fn concurrent_transfers_in_both_directions_share_lanes_in_one_order() {
    every_mode(concurrent_transfers_in_both_directions_share_lanes_in_one_order_in_mode);
}

fn concurrent_transfers_in_both_directions_share_lanes_in_one_order_in_mode() {
    for seed in 1..=25 {
        let mut s = Sim::new(3, small_chunks(), seed);
        for id in 1..=6 {
            s.buffer(0, id, 64 * 1024, id as u8 * 10);
            s.buffer(1, 10 + id, 64 * 1024, id as u8 * 20);
        }
        // Transfer k owns slot k (a buffer half) on both nodes, so the ranges never overlap and
        // every transfer's bytes can be checked at the end. Uneven lengths make any disagreement
        // on order show up as a size mismatch in the simulated plugin.
        let mut ts = Vec::new();
        for k in 0..12u64 {
            let len = 1 + (k * 7919) % 30_000;
            let (a, b) = (1 + k % 6, 11 + k % 6);
            let off = (k / 6) * 32 * 1024;
            ts.push(match k % 4 {
                0 => (0, s.write(0, a, off, b, off, len), (0, a, off), (1, b, off), len),
                1 => (1, s.write(1, b, off, a, off, len), (1, b, off), (0, a, off), len),
                2 => (0, s.read(0, b, off, a, off, len), (1, b, off), (0, a, off), len),
                _ => (1, s.read(1, a, off, b, off, len), (0, a, off), (1, b, off), len),
            });
            // Interleave starts with progress.
            for _ in 0..s.rand(20) {
                s.step();
            }
        }
        s.run();
        for (node, t, src, dst, len) in &ts {
            assert_eq!(s.outcome(*node, *t).code, Code::Ok, "seed {seed}");
            assert!(s.same(*src, *dst, *len), "seed {seed}: transfer {t} bytes differ");
        }
        s.assert_idle();
    }
}

#[test]
fn windows_bound_posted_requests() {
    // Rendezvous counters (the eager ones: `eager_sends_stay_within_credits`).
    windows_bound_posted_requests_in_mode();
}

fn windows_bound_posted_requests_in_mode() {
    let cfg = EngineConfig {
        chunk_bytes: MIN_CHUNK_BYTES,
        send_window: 12,
        recv_window: 16,
        ..EngineConfig::default()
    };
    let mut s = Sim::new(1, cfg, 4);
    s.buffer(0, 1, 1 << 20, 3);
    s.buffer(1, 2, 1 << 20, 0);
    let t = s.write(0, 1, 0, 2, 0, 1 << 20); // 256 chunks on one lane
    s.hold_data = true;
    s.run();
    let c0 = s.nodes[0].eng.peer_counters(P).unwrap();
    let c1 = s.nodes[1].eng.peer_counters(P).unwrap();
    assert_eq!(c0.send[0].posted, 12);
    assert_eq!(c0.send[0].queued, 256 - 12);
    assert_eq!(c1.recv[0].posted, 16);
    assert_eq!(c1.recv[0].queued, 256 - 16);
    // One stretch of a full window with chunks waiting, on each side.
    assert_eq!((c0.send[0].window_full, c1.recv[0].window_full), (1, 1));
    // Requests carrying the transfer's bytes are posted: the poller must keep testing them.
    assert!(!s.nodes[0].eng.lanes_idle() && !s.nodes[1].eng.lanes_idle());
    s.hold_data = false;
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    let c0 = s.nodes[0].eng.peer_counters(P).unwrap();
    let c1 = s.nodes[1].eng.peer_counters(P).unwrap();
    // The stretch lasted until the queue emptied: still one.
    assert_eq!((c0.send[0].window_full, c1.recv[0].window_full), (1, 1));
    assert!(s.same((0, 1, 0), (1, 2, 0), 1 << 20));
    s.assert_idle();
}

#[test]
fn a_bad_access_key_is_refused_and_changes_nothing() {
    every_mode(a_bad_access_key_is_refused_and_changes_nothing_in_mode);
}

fn a_bad_access_key_is_refused_and_changes_nothing_in_mode() {
    let mut s = Sim::new(2, small_chunks(), 5);
    s.buffer(0, 1, 8192, 1);
    s.buffer(1, 2, 8192, 0);
    let spec = WriteSpec {
        local_buffer: 1,
        local_offset: 0,
        peer: P,
        remote: RemoteRange {
            buffer_id: 2,
            access_key: key(99),
            offset: 0,
            length: 8192,
        },
    };
    let t = s.nodes[0]
        .eng
        .start_write(vec![spec], vec![], s.now + Duration::from_secs(5), s.now)
        .unwrap();
    s.run();
    let o = s.outcome(0, t);
    assert_eq!(o.code, Code::PermissionDenied);
    assert!(
        o.message.contains("entries[0]") && o.message.contains("wrong access key"),
        "{}",
        o.message
    );
    assert_eq!(s.nodes[1].bufs[&2], vec![0u8; 8192]);
    assert!(s.nodes[1].notes.is_empty());
    s.assert_idle();
}

#[test]
fn remote_bounds_unknown_buffers_and_bad_offers_are_refused() {
    every_mode(remote_bounds_unknown_buffers_and_bad_offers_are_refused_in_mode);
}

fn remote_bounds_unknown_buffers_and_bad_offers_are_refused_in_mode() {
    let mut s = Sim::new(1, small_chunks(), 6);
    s.buffer(0, 1, 8192, 1);
    s.buffer(1, 2, 4096, 0);
    let t1 = s.write(0, 1, 0, 2, 1, 4096); // one byte past the end
    let t2 = s.write(0, 1, 0, 7, 0, 10); // no such remote buffer
    s.run();
    assert_eq!(s.outcome(0, t1).code, Code::InvalidArgument);
    assert!(
        s.outcome(0, t1).message.contains("past the end"),
        "{}",
        s.outcome(0, t1).message
    );
    assert_eq!(s.outcome(0, t2).code, Code::NotFound);
    // A hand-made offer with a bad chunk size and lane.
    let mut eng = Engine::new(EngineConfig::default());
    let p = eng.add_peer("x", 1, 1);
    rendezvous_peer(&mut eng, p);
    eng.add_buffer(5, 100, key(5)).unwrap();
    for (chunk, lane) in [(100u32, 0u32), (4096, 3)] {
        eng.on_message(
            p,
            PeerMsg::Offer(Offer {
                offer_id: 1,
                read_id: 0,
                chunk_bytes: chunk,
                first_lane: lane,
                ranges: vec![RemoteRange {
                    buffer_id: 5,
                    access_key: key(5),
                    offset: 0,
                    length: 10,
                }]
                .into(),
                notification: vec![],
                deadline_ms: 0,
                blocks: None,
                coalesced: false,
                transfer_id: 0,
                announced: None,
            }),
            Instant::now(),
        );
        match eng.poll_action() {
            Some(Action::Control {
                msg:
                    PeerMsg::Reject {
                        code: Code::InvalidArgument,
                        ..
                    },
                ..
            }) => {}
            other => panic!("expected a reject, got {other:?}"),
        }
    }
    assert!(eng.is_idle());
    s.assert_idle();
}

#[test]
fn local_validation_names_the_field_and_changes_nothing() {
    every_mode(local_validation_names_the_field_and_changes_nothing_in_mode);
}

fn local_validation_names_the_field_and_changes_nothing_in_mode() {
    let mut eng = Engine::new(EngineConfig::default());
    let p = eng.add_peer("b", 1, 1);
    rendezvous_peer(&mut eng, p);
    eng.on_lane_ready(p, 0, true);
    eng.add_buffer(1, 1000, key(1)).unwrap();
    let now = Instant::now();
    let dl = now + Duration::from_secs(1);
    let spec = |buf: u64, loff: u64, roff: u64, len: u64| WriteSpec {
        local_buffer: buf,
        local_offset: loff,
        peer: p,
        remote: RemoteRange {
            buffer_id: 1,
            access_key: key(1),
            offset: roff,
            length: len,
        },
    };
    let cases: Vec<(Vec<WriteSpec>, Vec<u8>, Code, &str)> = vec![
        (vec![], vec![], Code::InvalidArgument, "entries: at least one"),
        (
            vec![spec(1, 0, 0, 0)],
            vec![],
            Code::InvalidArgument,
            "entries[0].length",
        ),
        (
            vec![spec(1, 1, 0, 1000)],
            vec![],
            Code::InvalidArgument,
            "entries[0].local_offset: 1000 bytes from offset 1 end at 1001, past the end of buffer 1 (1000 bytes; 999 fit there)",
        ),
        (
            vec![spec(1, 0, 0, 1001)],
            vec![],
            Code::InvalidArgument,
            "entries[0].length: 1001 bytes is more than buffer 1 holds (1000 bytes)",
        ),
        (
            vec![spec(1, 1000, 0, 1)],
            vec![],
            Code::InvalidArgument,
            "entries[0].local_offset: 1000 is past the end of buffer 1",
        ),
        (
            vec![spec(1, u64::MAX, 0, 2)],
            vec![],
            Code::InvalidArgument,
            "overflows 64 bits",
        ),
        (
            vec![spec(1, 0, u64::MAX, 2)],
            vec![],
            Code::InvalidArgument,
            "entries[0].remote_offset",
        ),
        (
            vec![spec(2, 0, 0, 1)],
            vec![],
            Code::NotFound,
            "entries[0].local_buffer_id: buffer 2",
        ),
        (
            vec![spec(1, 0, 0, 1)],
            vec![0; (1 << 20) + 1],
            Code::InvalidArgument,
            "notification",
        ),
        (
            vec![spec(1, 0, 0, 1); DEFAULT_MAX_ENTRIES + 1],
            vec![],
            Code::InvalidArgument,
            "65537 entries exceed the limit of 65536",
        ),
    ];
    for (specs, note, code, words) in cases {
        let e = eng.start_write(specs, note, dl, now).unwrap_err();
        assert_eq!(e.code, code, "{e}");
        assert!(e.message.contains(words), "{e} should mention {words}");
    }
    let mut bad_peer = spec(1, 0, 0, 1);
    bad_peer.peer = PeerIdx(9);
    assert_eq!(
        eng.start_write(vec![bad_peer], vec![], dl, now).unwrap_err().code,
        Code::NotFound
    );
    assert!(eng.poll_action().is_none(), "a refused request emits nothing");
    assert!(eng.is_idle());
    assert_eq!(
        eng.add_buffer(1, 5, key(1)).unwrap_err().code,
        Code::AlreadyExists
    );
}

#[test]
fn buffers_in_use_cannot_be_released() {
    every_mode(buffers_in_use_cannot_be_released_in_mode);
}

fn buffers_in_use_cannot_be_released_in_mode() {
    let mut s = Sim::new(1, small_chunks(), 60);
    s.buffer(0, 1, 65536, 1);
    s.buffer(1, 2, 65536, 0);
    let t = s.write(0, 1, 0, 2, 0, 65536);
    s.drain();
    let e = s.nodes[0].eng.remove_buffer(1).unwrap_err();
    assert_eq!(e.code, Code::FailedPrecondition);
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    s.nodes[0].eng.remove_buffer(1).unwrap();
    assert_eq!(s.nodes[0].eng.remove_buffer(1).unwrap_err().code, Code::NotFound);
}

#[test]
fn a_source_is_free_once_its_sends_completed_before_done() {
    every_mode(a_source_is_free_once_its_sends_completed_before_done_in_mode);
}

fn a_source_is_free_once_its_sends_completed_before_done_in_mode() {
    let mut s = Sim::new(2, small_chunks(), 61);
    s.buffer(0, 1, 65536, 0);
    s.buffer(1, 9, 65536, 5);
    let t = s.read(0, 9, 0, 1, 0, 65536);
    while !s.nodes[0].finished.contains_key(&t) {
        assert!(s.step(), "the read never finished");
    }
    // The reader is done; the holder sees its last sends complete, but not the reader's Done yet.
    for lane in 0..2 {
        while s.wires[1][lane].send_done_pending > 0 {
            s.wires[1][lane].send_done_pending -= 1;
            s.nodes[1].eng.on_send_done(P, lane as u32);
        }
    }
    s.nodes[1]
        .eng
        .remove_buffer(9)
        .expect("the holder's source is free once sent");
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.nodes.iter().all(|n| n.eng.is_idle()));
}

#[test]
fn notifications_follow_their_data_in_completion_order() {
    every_mode(notifications_follow_their_data_in_completion_order_in_mode);
}

fn notifications_follow_their_data_in_completion_order_in_mode() {
    let mut s = Sim::new(1, small_chunks(), 70);
    s.buffer(0, 1, 65536, 1);
    s.buffer(1, 2, 65536, 0);
    let mut ids = Vec::new();
    for k in 0..5u64 {
        let spec = WriteSpec {
            local_buffer: 1,
            local_offset: k * 8192,
            peer: P,
            remote: RemoteRange {
                buffer_id: 2,
                access_key: key(2),
                offset: k * 8192,
                length: 8192,
            },
        };
        ids.push(
            s.nodes[0]
                .eng
                .start_write(
                    vec![spec],
                    vec![k as u8; 3],
                    s.now + Duration::from_secs(5),
                    s.now,
                )
                .unwrap(),
        );
    }
    s.run();
    // One lane, FIFO: offers complete in the order they were made.
    let got: Vec<u8> = s.nodes[1].notes.iter().map(|(_, p)| p[0]).collect();
    assert_eq!(got, vec![0, 1, 2, 3, 4]);
    assert!(s.same((0, 1, 0), (1, 2, 0), 40960));
    s.assert_idle();
}

#[test]
fn multi_peer_batches_report_per_entry_status() {
    every_mode(multi_peer_batches_report_per_entry_status_in_mode);
}

fn multi_peer_batches_report_per_entry_status_in_mode() {
    // Node 0 with two peers: peer 0 accepts, peer 1 refuses (bad key).
    let mut eng = Engine::new(small_chunks());
    let good = eng.add_peer("good", 1, 1);
    let bad = eng.add_peer("bad", 1, 1);
    for p in [good, bad] {
        rendezvous_peer(&mut eng, p);
        eng.on_lane_ready(p, 0, true);
        eng.on_lane_ready(p, 0, false);
    }
    eng.add_buffer(1, 8192, key(1)).unwrap();
    let now = Instant::now();
    let spec = |peer| WriteSpec {
        local_buffer: 1,
        local_offset: 0,
        peer,
        remote: RemoteRange {
            buffer_id: 2,
            access_key: key(2),
            offset: 0,
            length: 4096,
        },
    };
    let t = eng
        .start_write(
            vec![spec(good), spec(bad)],
            vec![],
            now + Duration::from_secs(5),
            now,
        )
        .unwrap();
    let offers = offers_by_peer(&mut eng);
    eng.on_message(
        bad,
        PeerMsg::Reject {
            offer_id: offers[&bad],
            code: Code::PermissionDenied,
            message: "ranges[0]: wrong access key for buffer 2".into(),
            range_index: 0,
        },
        now,
    );
    let mut outcome = None;
    let mut cancels = 0;
    while let Some(a) = eng.poll_action() {
        match a {
            Action::Finished { outcome: o, .. } => outcome = Some(o),
            Action::Control {
                peer,
                msg: PeerMsg::CancelOffer { .. },
            } => {
                assert_eq!(peer, good);
                cancels += 1;
            }
            _ => {}
        }
    }
    let o = outcome.expect("finished");
    assert_eq!(o.code, Code::PermissionDenied);
    assert_eq!(o.entries[1].0, Code::PermissionDenied);
    assert!(
        o.entries[1].1.contains("entries[1]: node bad refused"),
        "{:?}",
        o.entries
    );
    assert_eq!(o.entries[0].0, Code::Aborted);
    assert_eq!(cancels, 1, "the other peer's offer is withdrawn");
    let _ = t;
}

/// Steps until a receive on `receiver` has landed and waits for its unpack to finish (the
/// poller's "unpacking" stage: received, not yet consumed); false if the transfer ended first.
fn step_until_unpacking(s: &mut Sim, receiver: usize) -> bool {
    for _ in 0..10_000 {
        if s.wires[1 - receiver].iter().any(|w| w.recv_done_pending > 0) {
            return true;
        }
        if !s.step() {
            return false;
        }
    }
    false
}

#[test]
fn cancel_and_deadline_while_receives_are_unpacking_drain_both_sides() {
    every_mode(cancel_and_deadline_while_receives_are_unpacking_drain_both_sides_in_mode);
}

fn cancel_and_deadline_while_receives_are_unpacking_drain_both_sides_in_mode() {
    // (write or read, cancel or deadline): the receiving side holds a landed chunk in its
    // unpack stage when the transfer ends; the unpack still finishes, the chunk is consumed,
    // and every slot, window and buffer use comes back to zero on both nodes.
    for (case, (read, by_deadline)) in [(false, false), (false, true), (true, false), (true, true)]
        .into_iter()
        .enumerate()
    {
        let mut s = Sim::new(2, small_chunks(), 60 + case as u64);
        let len = 256 * 1024;
        s.buffer(0, 1, len, if read { 0 } else { 1 });
        s.buffer(1, 2, len, if read { 5 } else { 0 });
        let now = s.now;
        let deadline = now + Duration::from_millis(if by_deadline { 50 } else { 60_000 });
        let remote = RemoteRange {
            buffer_id: 2,
            access_key: key(2),
            offset: 0,
            length: len as u64,
        };
        let t = if read {
            s.nodes[0]
                .eng
                .start_read(
                    vec![ReadSpec {
                        local_buffer: 1,
                        local_offset: 0,
                        peer: P,
                        remote,
                    }],
                    deadline,
                    now,
                )
                .unwrap()
        } else {
            s.nodes[0]
                .eng
                .start_write(
                    vec![WriteSpec {
                        local_buffer: 1,
                        local_offset: 0,
                        peer: P,
                        remote,
                    }],
                    vec![],
                    deadline,
                    now,
                )
                .unwrap()
        };
        let receiver = if read { 0 } else { 1 };
        assert!(
            step_until_unpacking(&mut s, receiver),
            "case {case}: a chunk lands"
        );
        if by_deadline {
            s.nodes[0].eng.on_tick(deadline);
        } else {
            assert!(
                s.nodes[0]
                    .eng
                    .cancel(t, Code::Cancelled, "cancelled by the client")
            );
        }
        s.run();
        let want = if by_deadline {
            Code::DeadlineExceeded
        } else {
            Code::Cancelled
        };
        assert_eq!(s.outcome(0, t).code, want, "case {case}");
        s.assert_idle();
    }
}
