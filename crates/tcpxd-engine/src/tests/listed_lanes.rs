//! The lanes statistics list (`Engine::listed_counters`): only those in use — opening, open,
//! closing, or with counters since the pairing — so a routed pairing's hundreds of catalogue
//! lanes are not listed until used, and a lane that moved bytes stays listed once closed (no
//! total vanishes).

use super::routes::node;
use super::sim::*;
use super::*;
use crate::topology::Memory;

fn cfg(idle: Duration) -> EngineConfig {
    EngineConfig {
        protocol: Protocol::Auto,
        devices: 4,
        lanes_per_device: 2,
        eager_max_bytes: SIM_EAGER_MAX,
        lane_idle_close: Some(idle),
        ..small_chunks()
    }
}

fn totals(c: &PeerCounters) -> (u64, u64) {
    (
        c.send.iter().map(|l| l.bytes).sum(),
        c.recv.iter().map(|l| l.bytes).sum(),
    )
}

#[test]
fn a_routed_pairing_lists_only_the_lanes_it_used_and_keeps_them_once_closed() {
    let idle = Duration::from_secs(1);
    let c = cfg(idle);
    let mut s = Sim::pair_routed(8, [c.clone(), c], 23, [node(8, 4), node(8, 4)]);
    for i in 0..2 {
        let all = s.nodes[i].eng.peer_counters(P).unwrap();
        let listed = s.nodes[i].eng.listed_counters(P).unwrap();
        // The catalogue's lanes only (8 x 8 GPU pairs, host pairs: 528 each way); the layout's
        // (12) would never be used and are not allocated.
        assert!(all.routed, "{all:?}");
        assert_eq!((all.send_lanes, all.recv_lanes), (528, 528));
        assert_eq!(
            (listed.send_lanes, listed.recv_lanes),
            (all.send.len() as u32, all.recv.len() as u32)
        );
        assert!(
            listed.send.is_empty() && listed.recv.is_empty(),
            "nothing used yet: {listed:?}"
        );
    }
    s.buffer(0, 1, 96 * 1024, 4);
    s.buffer(1, 2, 96 * 1024, 0);
    s.nodes[0].eng.set_buffer_memory(1, Memory::Gpu(1));
    s.nodes[1].eng.set_buffer_memory(2, Memory::Gpu(4));
    let t = s.write(0, 1, 0, 2, 0, 96 * 1024);
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.same((0, 1, 0), (1, 2, 0), 96 * 1024));

    let check = |s: &Sim, state: &str| {
        let sent = s.nodes[0].eng.listed_counters(P).unwrap();
        let got = s.nodes[1].eng.listed_counters(P).unwrap();
        // GPU 1 -> GPU 4: one route, its 2 rendezvous lanes (96 KiB is past the eager limit).
        let lanes: Vec<u32> = sent.send.iter().map(|l| l.lane).collect();
        assert_eq!(lanes.len(), 2, "{state}: {sent:?}");
        assert_eq!(
            got.recv.iter().map(|l| l.lane).collect::<Vec<_>>(),
            lanes,
            "{state}"
        );
        assert!(sent.recv.is_empty() && got.send.is_empty(), "{state}");
        for l in sent.send.iter().chain(&got.recv) {
            assert_eq!(l.memory, Some((Memory::Gpu(1), Memory::Gpu(4))), "{state}: {l:?}");
            assert!(!l.eager && l.bytes > 0 && l.state == state, "{state}: {l:?}");
        }
        // Nothing the unlisted lanes counted: the listed totals are the pairing's.
        assert_eq!(totals(&sent).0, 96 * 1024, "{state}");
        assert_eq!(totals(&got).1, 96 * 1024, "{state}");
        assert_eq!(totals(&s.nodes[0].eng.peer_counters(P).unwrap()), totals(&sent));
    };
    check(&s, "open");
    for step in [Duration::from_millis(200), idle + Duration::from_millis(200)] {
        s.now += step;
        for i in 0..2 {
            s.nodes[i].eng.on_tick(s.now);
        }
        s.run();
    }
    assert_eq!(s.nodes[0].eng.lanes_open(), (0, 0), "closed when idle");
    check(&s, "closed");
    s.assert_idle();
}

#[test]
fn an_unrouted_pairing_lists_its_layout_lanes_once_used_with_their_kind() {
    let c = cfg(Duration::from_secs(60));
    // 4 devices x (2 + 1 eager) lanes, no topology: the layout only.
    let mut s = Sim::pair_lazy(8, [c.clone(), c], 29);
    let listed = s.nodes[0].eng.listed_counters(P).unwrap();
    assert!(!listed.routed && listed.send_lanes == 12 && listed.send.is_empty());
    s.buffer(0, 1, 256 * 1024, 4);
    s.buffer(1, 2, 256 * 1024, 0);
    let small = s.write(0, 1, 0, 2, 0, 4096);
    let large = s.write(0, 1, 0, 2, 0, 256 * 1024);
    s.run();
    assert_eq!(s.outcome(0, small).code, Code::Ok);
    assert_eq!(s.outcome(0, large).code, Code::Ok);
    let sent = s.nodes[0].eng.listed_counters(P).unwrap();
    assert!(!sent.send.is_empty());
    for l in &sent.send {
        // Under auto the receiver's last lane per device keeps credits: lanes 8..12.
        assert_eq!(l.eager, l.lane >= 8, "{l:?}");
        assert_eq!(l.memory, None);
    }
    assert!(sent.send.iter().any(|l| l.eager) && sent.send.iter().any(|l| !l.eager));
    s.assert_idle();
}
