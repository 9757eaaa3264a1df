//! Releasing failed pairings: a node keeps its live pairings and its newest failed one; older
//! failed ones go once nothing names them, their totals kept per node.

use super::*;

/// Runs the engine's actions: the pairings it released, in order. Each release comes after the
/// pairing's `ClosePeer` (in this call or an earlier one: `closed` keeps them).
fn released(eng: &mut Engine, closed: &mut Vec<PeerIdx>) -> Vec<PeerIdx> {
    let mut gone = Vec::new();
    while let Some(a) = eng.poll_action() {
        match a {
            Action::ClosePeer { peer, .. } => closed.push(peer),
            Action::ReleasePeer { peer } => {
                assert!(closed.contains(&peer), "{peer:?} released before it was closed");
                gone.push(peer);
            }
            _ => {}
        }
    }
    gone
}

fn paired(eng: &mut Engine, node: &str) -> PeerIdx {
    let p = eng.add_peer(node, 1, 1);
    rendezvous_peer(eng, p);
    eng.on_lane_ready(p, 0, true);
    eng.on_lane_ready(p, 0, false);
    while eng.poll_action().is_some() {}
    p
}

#[test]
fn a_node_keeps_its_live_and_its_newest_failed_pairing_only() {
    let mut eng = Engine::new(EngineConfig::default());
    let mut closed = Vec::new();
    let c = paired(&mut eng, "c");
    eng.on_peer_failed(c, "c went away");
    assert!(
        released(&mut eng, &mut closed).is_empty(),
        "a node's only failed pairing stays"
    );
    let mut live = paired(&mut eng, "b");
    let mut ids = vec![c, live];
    for round in 0..10 {
        let next = paired(&mut eng, "b");
        assert!(ids.iter().all(|&i| i != next), "ids are never reused");
        ids.push(next);
        let before = eng.pairings();
        eng.on_peer_failed(live, &format!("restart {round}"));
        let gone = released(&mut eng, &mut closed);
        let kept = eng.pairings();
        // c's failed pairing, b's newest failed one (the one that just failed) and its live one.
        assert_eq!(kept, vec![c, live, next], "round {round}");
        if round == 0 {
            assert!(gone.is_empty());
        } else {
            assert_eq!(gone.len(), 1, "round {round}: the previous failed one goes");
            assert!(before.contains(&gone[0]) && !kept.contains(&gone[0]));
        }
        assert_eq!(
            eng.peer_counters(live).unwrap().failed.as_deref(),
            Some(format!("restart {round}").as_str())
        );
        live = next;
    }
    // A late message or failure for a released pairing changes nothing.
    let old = ids[1];
    assert!(eng.peer_counters(old).is_none());
    eng.on_message(
        old,
        PeerMsg::Done {
            offer_id: 1,
            returned: ReturnedCredits::default(),
        },
        Instant::now(),
    );
    eng.on_peer_failed(old, "late");
    assert!(released(&mut eng, &mut closed).is_empty());
    assert_eq!(eng.pairings().len(), 3);
}

#[test]
fn a_failed_pairing_a_transfer_still_names_goes_when_the_transfer_ends() {
    let mut eng = Engine::new(EngineConfig::default());
    let mut closed = Vec::new();
    let b1 = paired(&mut eng, "b");
    let c = paired(&mut eng, "c");
    eng.add_buffer(1, 8192, key(1)).unwrap();
    let now = Instant::now();
    let entry = |peer| WriteSpec {
        local_buffer: 1,
        local_offset: 0,
        peer,
        remote: RemoteRange {
            buffer_id: 9,
            access_key: key(9),
            offset: 0,
            length: 4096,
        },
    };
    // One WRITE to b1 and c: b1's share completes, c's does not.
    let t = eng
        .start_write(
            vec![entry(b1), entry(c)],
            vec![],
            now + Duration::from_secs(60),
            now,
        )
        .unwrap();
    let offers = offers_by_peer(&mut eng);
    eng.on_message(
        b1,
        PeerMsg::Accept {
            offer_id: offers[&b1],
            first_lane: None,
        },
        now,
    );
    let mut posted = 0;
    while let Some(a) = eng.poll_action() {
        posted += usize::from(matches!(a, Action::PostSend { peer, .. } if peer == b1));
    }
    assert_eq!(posted, 1);
    eng.on_send_done(b1, 0);
    eng.on_message(
        b1,
        PeerMsg::Done {
            offer_id: offers[&b1],
            returned: ReturnedCredits::default(),
        },
        now,
    );
    assert!(released(&mut eng, &mut closed).is_empty());
    assert_eq!(eng.active_transfers(), 1, "c's share is still running");

    // b1 fails (nothing of it is in flight: the WRITE goes on), then b's next pairing fails too.
    eng.on_peer_failed(b1, "b restarted");
    assert!(released(&mut eng, &mut closed).is_empty());
    assert_eq!(eng.active_transfers(), 1);
    let b2 = paired(&mut eng, "b");
    eng.on_peer_failed(b2, "b restarted again");
    assert!(
        released(&mut eng, &mut closed).is_empty(),
        "the running WRITE names b1"
    );
    assert_eq!(eng.pairings(), vec![b1, c, b2]);

    // The WRITE ends: it counts on b1, then b1 goes, its totals kept for b.
    assert!(eng.cancel(t, Code::Cancelled, "cancelled by the client"));
    assert_eq!(released(&mut eng, &mut closed), vec![b1]);
    assert_eq!(eng.pairings(), vec![c, b2]);
    let retired: Vec<&PeerCounters> = eng.retired_counters().collect();
    assert_eq!(retired.len(), 1);
    assert_eq!(retired[0].node_id, "b");
    assert_eq!(
        (retired[0].transfers_started, retired[0].transfers_failed),
        (1, 1)
    );
    assert_eq!((retired[0].send[0].bytes, retired[0].send[0].chunks), (4096, 1));
    assert_eq!(retired[0].send[0].posted, 0);
}

#[test]
fn absorbing_adds_running_totals_lane_by_lane() {
    let lane = |lane, bytes, posted| LaneCounters {
        lane,
        bytes,
        chunks: 1,
        posted,
        queued: 2,
        window_full: 1,
        credits: 3,
        credit_limit: 16,
        credit_bytes_out: 0,
        state: "open",
        eager: false,
        memory: None,
    };
    let mut sum = PeerCounters {
        node_id: "b".into(),
        transfers_ok: 1,
        send: vec![lane(0, 10, 0), lane(7, 3, 0)],
        ..PeerCounters::default()
    };
    // Lists of lanes in use leave lanes out: they add up by lane number.
    sum.absorb(&PeerCounters {
        node_id: "b".into(),
        failed: Some("gone".into()),
        transfers_ok: 2,
        transfers_failed: 1,
        received_eager: 4,
        send: vec![lane(0, 5, 7), lane(3, 6, 7), lane(7, 1, 0)],
        recv: vec![lane(2, 1, 1)],
        send_lanes: 540,
        ..PeerCounters::default()
    });
    assert_eq!(
        (sum.transfers_ok, sum.transfers_failed, sum.received_eager),
        (3, 1, 4)
    );
    assert_eq!(sum.send.iter().map(|l| l.lane).collect::<Vec<_>>(), [0, 3, 7]);
    assert_eq!(
        (sum.send[0].bytes, sum.send[0].chunks, sum.send[0].window_full),
        (15, 2, 2)
    );
    assert_eq!(
        (sum.send[1].bytes, sum.send[1].posted, sum.send[1].credits),
        (6, 0, 0)
    );
    assert_eq!(sum.send[2].bytes, 4);
    assert_eq!(
        (sum.recv[0].lane, sum.recv[0].bytes, sum.recv[0].queued),
        (2, 1, 0)
    );
    assert_eq!(sum.send_lanes, 540);
    assert_eq!(sum.failed, None);
}
