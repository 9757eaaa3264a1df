//! Pairings closed when idle (`pair_life.rs`): both sides agree, however the questions and
//! transfers interleave; a transfer that meets a closing or closed pairing is refused for a retry
//! (never failed), and the node's next pairing carries its totals on.

use super::sim::*;
use super::*;

const LANE_IDLE: Duration = Duration::from_secs(1);
const PAIR_IDLE: Duration = Duration::from_secs(3);

fn cfg(protocol: Protocol, pairing_idle: Option<Duration>) -> EngineConfig {
    EngineConfig {
        protocol,
        eager_max_bytes: SIM_EAGER_MAX,
        lane_idle_close: Some(LANE_IDLE),
        pairing_idle_close: pairing_idle,
        ..small_chunks()
    }
}

/// Node 0 closes idle pairings after `PAIR_IDLE`; node 1 after `other` (`None`: never asks).
fn pair(protocol: Protocol, other: Option<Duration>) -> Sim {
    Sim::pair_lazy(2, [cfg(protocol, Some(PAIR_IDLE)), cfg(protocol, other)], 5)
}

fn every_protocol(test: fn(Protocol)) {
    for p in [Protocol::Rendezvous, Protocol::Eager, Protocol::Auto] {
        test(p);
    }
}

/// Moves time on by `step`, ticking both nodes, without delivering anything.
fn tick(s: &mut Sim, step: Duration) {
    s.now += step;
    for i in 0..2 {
        s.nodes[i].eng.on_tick(s.now);
    }
    s.drain();
}

/// Ticks in lane-scan steps, delivering the control messages (lanes closing), until node 0
/// asked to close the pairing (bounded); the question is left in flight.
fn until_asked(s: &mut Sim) {
    for _ in 0..100 {
        if s.ctrl[1].iter().any(|m| *m == PeerMsg::PairingClose) {
            return;
        }
        deliver_control(s);
        tick(s, Duration::from_millis(250));
    }
    panic!("node 0 never asked to close the pairing");
}

/// Delivers every control message in flight, in order (no data moves).
fn deliver_control(s: &mut Sim) {
    s.drain();
    while !s.ctrl[0].is_empty() || !s.ctrl[1].is_empty() {
        for i in 0..2 {
            while let Some(msg) = s.ctrl[i].pop_front() {
                s.nodes[i].eng.on_message(P, msg, s.now);
            }
        }
        s.drain();
    }
}

fn write_spec(local: u64, remote: u64, len: u64) -> WriteSpec {
    WriteSpec {
        local_buffer: local,
        local_offset: 0,
        peer: P,
        remote: RemoteRange {
            buffer_id: remote,
            access_key: key(remote as u8),
            offset: 0,
            length: len,
        },
    }
}

/// A transfer start on node `i` is refused as "closed pairing" (for a retry), naming the node.
fn assert_refused_for_retry(s: &mut Sim, i: usize) {
    let deadline = s.now + Duration::from_secs(60);
    let (local, remote) = if i == 0 { (1, 2) } else { (2, 1) };
    let e = s.nodes[i]
        .eng
        .start_write(vec![write_spec(local, remote, 100)], Vec::new(), deadline, s.now)
        .expect_err("refused");
    let other = if i == 0 { "node-b" } else { "node-a" };
    assert_eq!(e.closed_pairing.as_deref(), Some(other), "{e:?}");
    assert_eq!(e.code, Code::Unavailable);
}

fn buffers(s: &mut Sim) {
    s.buffer(0, 1, 60_000, 7);
    s.buffer(1, 2, 60_000, 0);
}

#[test]
fn an_idle_pairing_closes_on_both_sides_by_agreement_after_its_lanes() {
    every_protocol(|protocol| {
        let mut s = pair(protocol, None);
        buffers(&mut s);
        let t = s.write(0, 1, 0, 2, 0, 50_000);
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Ok);
        until_asked(&mut s);
        assert_eq!(s.nodes[0].pairing, vec![PairLife::Closing]);
        assert_refused_for_retry(&mut s, 0);
        deliver_control(&mut s);
        assert_eq!(
            s.nodes[0].pairing,
            vec![PairLife::Closing, PairLife::Closed],
            "{protocol:?}"
        );
        assert_eq!(s.nodes[1].pairing, vec![PairLife::Closed]);
        for i in 0..2 {
            let n = &s.nodes[i];
            assert!(n.closed.is_empty(), "not a failure: {:?}", n.closed);
            assert_eq!(n.eng.pairing_life(P), Some(PairLife::Closed));
            assert_eq!(n.eng.lanes_open(), (0, 0));
            let c = n.eng.peer_counters(P).unwrap();
            assert_eq!((c.idle_closes, c.failed.as_deref()), (1, None));
            assert_eq!(c.transfers_started, if i == 0 { 1 } else { 0 }, "totals kept");
        }
        assert_refused_for_retry(&mut s, 1);
        // Its stream's end, or a late message, changes nothing.
        s.nodes[1]
            .eng
            .on_peer_failed(P, "control stream closed by the peer");
        s.nodes[1]
            .eng
            .on_message(P, PeerMsg::PairingCloseAnswer { closed: true }, s.now);
        s.drain();
        assert!(s.nodes[1].closed.is_empty());
        assert_eq!(s.nodes[1].eng.peer_counters(P).unwrap().failed, None);
        s.assert_idle();
    });
}

#[test]
fn a_pairing_used_within_the_idle_time_stays_open() {
    let mut s = pair(Protocol::Auto, None);
    buffers(&mut s);
    for _ in 0..6 {
        // A transfer that starts and ends between two scans counts as use.
        let t = s.write(0, 1, 0, 2, 0, 1000);
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Ok);
        tick(&mut s, PAIR_IDLE / 2);
    }
    assert!(s.ctrl[1].iter().all(|m| *m != PeerMsg::PairingClose));
    assert!(s.nodes[0].pairing.is_empty());
}

#[test]
fn both_sides_asking_at_once_both_close() {
    every_protocol(|protocol| {
        let mut s = pair(protocol, Some(PAIR_IDLE));
        buffers(&mut s);
        let t = s.write(0, 1, 0, 2, 0, 20_000);
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Ok);
        until_asked(&mut s);
        assert!(
            s.ctrl[0].contains(&PeerMsg::PairingClose),
            "both asked in one scan"
        );
        deliver_control(&mut s);
        for i in 0..2 {
            assert_eq!(s.nodes[i].pairing, vec![PairLife::Closing, PairLife::Closed]);
            assert!(s.nodes[i].closed.is_empty(), "{:?}", s.nodes[i].closed);
        }
        s.assert_idle();
    });
}

#[test]
fn a_transfer_the_peer_posted_before_the_question_keeps_the_pairing() {
    every_protocol(|protocol| {
        let mut s = pair(protocol, None);
        buffers(&mut s);
        s.buffer(1, 3, 30_000, 9);
        s.buffer(0, 4, 30_000, 0);
        until_asked(&mut s);
        // Node 1 writes before it sees the question: its offer (or header) crosses it.
        let spec = WriteSpec {
            local_buffer: 3,
            local_offset: 0,
            peer: P,
            remote: RemoteRange {
                buffer_id: 4,
                access_key: key(4),
                offset: 0,
                length: 30_000,
            },
        };
        let deadline = s.now + Duration::from_secs(60);
        let t = s.nodes[1]
            .eng
            .start_write(vec![spec], Vec::new(), deadline, s.now)
            .unwrap();
        // Node 0, closing, refuses its own new transfers until the answer.
        assert_refused_for_retry(&mut s, 0);
        s.run();
        assert_eq!(s.outcome(1, t).code, Code::Ok, "{protocol:?}");
        assert!(s.same((1, 3, 0), (0, 4, 0), 30_000));
        assert_eq!(s.nodes[0].pairing, vec![PairLife::Closing, PairLife::Live]);
        assert!(s.nodes[1].pairing.is_empty());
        // Kept: node 0's retried transfer runs on the same pairing.
        let t = s.write(0, 1, 0, 2, 0, 50_000);
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Ok);
        assert!(s.same((0, 1, 0), (1, 2, 0), 50_000));
        s.assert_idle();
    });
}

#[test]
fn a_read_posted_after_the_answer_is_refused_for_a_retry_not_failed() {
    let mut s = pair(Protocol::Auto, None);
    buffers(&mut s);
    until_asked(&mut s);
    // Node 1 answers (closed) before its READ arrives at its engine.
    deliver_control(&mut s);
    let spec = ReadSpec {
        peer: P,
        remote: RemoteRange {
            buffer_id: 1,
            access_key: key(1),
            offset: 0,
            length: 100,
        },
        local_buffer: 2,
        local_offset: 0,
    };
    let e = s.nodes[1]
        .eng
        .start_read(vec![spec], s.now + Duration::from_secs(5), s.now)
        .expect_err("refused");
    assert_eq!(e.closed_pairing.as_deref(), Some("node-a"));
    assert_eq!(s.nodes[1].eng.active_transfers(), 0, "nothing started");
}

#[test]
fn a_closed_answer_while_this_side_is_busy_or_unasked_fails_the_pairing() {
    // Unasked.
    let mut s = pair(Protocol::Rendezvous, None);
    s.nodes[0]
        .eng
        .on_message(P, PeerMsg::PairingCloseAnswer { closed: true }, s.now);
    s.drain();
    assert!(s.nodes[0].closed[0].contains("an answer to a PairingClose never sent"));
    // Asked, then an offer came: a `closed` answer contradicts it.
    let mut s = pair(Protocol::Rendezvous, None);
    buffers(&mut s);
    s.buffer(1, 3, 30_000, 9);
    s.buffer(0, 4, 30_000, 0);
    until_asked(&mut s);
    s.ctrl[1].clear();
    let spec = WriteSpec {
        local_buffer: 3,
        local_offset: 0,
        peer: P,
        remote: RemoteRange {
            buffer_id: 4,
            access_key: key(4),
            offset: 0,
            length: 30_000,
        },
    };
    let deadline = s.now + Duration::from_secs(60);
    s.nodes[1]
        .eng
        .start_write(vec![spec], Vec::new(), deadline, s.now)
        .unwrap();
    s.drain();
    while let Some(m) = s.ctrl[0].pop_front() {
        s.nodes[0].eng.on_message(P, m, s.now);
    }
    s.nodes[0]
        .eng
        .on_message(P, PeerMsg::PairingCloseAnswer { closed: true }, s.now);
    s.drain();
    assert!(
        s.nodes[0].closed.iter().any(|c| c.contains("protocol violation")),
        "{:?}",
        s.nodes[0].closed
    );
}

#[test]
fn a_live_or_closing_pairing_still_fails_when_its_peer_dies() {
    let mut s = pair(Protocol::Auto, None);
    s.nodes[1]
        .eng
        .on_peer_failed(P, "no control message or heartbeat for 3s");
    s.drain();
    assert_eq!(s.nodes[1].closed.len(), 1);
    let mut s = pair(Protocol::Auto, None);
    until_asked(&mut s);
    s.nodes[0]
        .eng
        .on_peer_failed(P, "no control message or heartbeat for 3s");
    s.drain();
    assert_eq!(s.nodes[0].closed.len(), 1, "closing, the pairing still fails");
    let c = s.nodes[0].eng.peer_counters(P).unwrap();
    assert!(c.failed.is_some());
}

#[test]
fn the_next_pairing_takes_over_the_closed_ones_totals_and_releases_it() {
    let mut s = pair(Protocol::Auto, None);
    buffers(&mut s);
    let t = s.write(0, 1, 0, 2, 0, 50_000);
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    until_asked(&mut s);
    deliver_control(&mut s);
    let before = s.nodes[0].eng.peer_counters(P).unwrap();
    let eng = &mut s.nodes[0].eng;
    let (send, recv) = eng.lane_counts(P);
    let next = eng.add_peer("node-b", send, recv);
    assert_ne!(next, P);
    let mut released = Vec::new();
    while let Some(a) = eng.poll_action() {
        if let Action::ReleasePeer { peer } = a {
            released.push(peer);
        }
    }
    assert_eq!(released, vec![P]);
    assert_eq!(eng.pairings(), vec![next]);
    let after = eng.peer_counters(next).unwrap();
    assert_eq!(after.transfers_started, before.transfers_started);
    assert_eq!(after.transfers_ok, 1);
    assert_eq!(after.idle_closes, 1);
    let bytes = |c: &PeerCounters| c.send.iter().map(|l| l.bytes).sum::<u64>();
    assert_eq!(bytes(&after), 50_000);
    assert_eq!(eng.pairing_life(next), Some(PairLife::Live));
}

#[test]
fn a_pairing_the_peer_replaced_while_this_side_was_closing_hands_its_totals_over() {
    let mut eng = Engine::new(EngineConfig {
        pairing_idle_close: Some(Duration::from_secs(1)),
        ..EngineConfig::default()
    });
    let old = eng.add_peer("n", 1, 1);
    rendezvous_peer(&mut eng, old);
    let t = Instant::now();
    eng.on_tick(t);
    eng.on_tick(t + Duration::from_millis(1200));
    assert_eq!(eng.pairing_life(old), Some(PairLife::Closing));
    while eng.poll_action().is_some() {}
    // The peer closed its side and dialled again: a new pairing, while this one still waits for
    // its answer (on the old stream).
    let new = eng.add_peer("n", 1, 1);
    assert_eq!(eng.pairings(), vec![old, new]);
    eng.on_message(old, PeerMsg::PairingCloseAnswer { closed: true }, t);
    let mut released = Vec::new();
    while let Some(a) = eng.poll_action() {
        if let Action::ReleasePeer { peer } = a {
            released.push(peer);
        }
    }
    assert_eq!(released, vec![old]);
    assert_eq!(eng.pairings(), vec![new]);
    assert_eq!(eng.peer_counters(new).unwrap().idle_closes, 1);
    assert_eq!(eng.pairing_life(new), Some(PairLife::Live));
}

#[test]
fn an_idle_engine_asks_to_be_woken_only_for_what_is_due_to_close() {
    let mut eng = Engine::new(EngineConfig {
        pairing_idle_close: Some(Duration::from_secs(10)),
        ..EngineConfig::default()
    });
    assert_eq!(eng.next_deadline(), None, "no pairing: nothing to wake for");
    let p = eng.add_peer("n", 1, 1);
    rendezvous_peer(&mut eng, p);
    let t = Instant::now();
    eng.on_tick(t);
    // Noted idle at `t`: woken when its idle time is over, not before.
    assert_eq!(eng.next_deadline(), Some(t + Duration::from_secs(10)));
    eng.on_tick(t + Duration::from_secs(10));
    while eng.poll_action().is_some() {}
    eng.on_message(p, PeerMsg::PairingCloseAnswer { closed: true }, t);
    while eng.poll_action().is_some() {}
    assert_eq!(eng.pairing_life(p), Some(PairLife::Closed));
    assert_eq!(eng.next_deadline(), None, "closed: nothing left to wake for");
}
