//! Rendezvous lanes routed by memory pair (`routes.rs`): between two 8-GPU, 4-NIC nodes a
//! transfer from GPU s to GPU d moves only on lanes nic(s) → (nic(d), d), host memory on every
//! NIC, byte-exact both ways and by READ, and only the lanes used are opened.

use super::sim::*;
use super::*;
use crate::topology::{Memory, Topology};

/// `gpus` GPUs spread evenly over `nics` NICs (A3: GPU g on NIC g / 2).
pub(super) fn node(gpus: u32, nics: i32) -> Topology {
    Topology::synthetic(gpus, nics).unwrap()
}

fn cfg(protocol: Protocol) -> EngineConfig {
    EngineConfig {
        protocol,
        devices: 4,
        lanes_per_device: 2,
        eager_max_bytes: SIM_EAGER_MAX,
        ..small_chunks()
    }
}

fn routed(protocol: Protocol, seed: u64) -> Sim {
    let c = cfg(protocol);
    Sim::pair_routed(
        4 * c.lanes_per_device,
        [c.clone(), c],
        seed,
        [node(8, 4), node(8, 4)],
    )
}

/// Node `i`'s send lanes that carried bytes, with their routes.
fn used_send_lanes(s: &Sim, i: usize) -> Vec<(u32, Option<crate::topology::Route>)> {
    let c = s.nodes[i].eng.peer_counters(P).unwrap();
    c.send
        .iter()
        .enumerate()
        .filter(|(_, l)| l.bytes > 0)
        .map(|(lane, _)| (lane as u32, s.nodes[i].eng.send_lane_route(P, lane as u32)))
        .collect()
}

/// Asserts that node `from`'s send lane `lane` is a lane of the pair (its GPU `s_gpu` → the
/// other node's GPU `d_gpu`), from nic(s) to nic(d) (A3: GPU g on NIC g / 2), and the other
/// node's receive lane of the same number the same route.
pub(super) fn assert_gpu_pair_lane(s: &Sim, from: usize, lane: u32, s_gpu: u32, d_gpu: u32) {
    let r = s.nodes[from]
        .eng
        .send_lane_route(P, lane)
        .unwrap_or_else(|| panic!("lane {lane} is not a routed lane"));
    assert_eq!(
        (r.send.nic, r.send.gpu),
        (s_gpu as usize / 2, Some(s_gpu)),
        "lane {lane}"
    );
    assert_eq!(
        (r.recv.nic, r.recv.gpu),
        (d_gpu as usize / 2, Some(d_gpu)),
        "lane {lane}"
    );
    assert_eq!(
        s.nodes[1 - from].eng.recv_lane_route(P, lane),
        Some(r),
        "lane {lane}"
    );
}

fn reset_bytes(s: &mut Sim) -> [u64; 2] {
    // Counters only grow: remember the totals so far.
    let mut t = [0; 2];
    for (i, n) in s.nodes.iter().enumerate() {
        t[i] = n.eng.peer_counters(P).unwrap().send.iter().map(|l| l.bytes).sum();
    }
    t
}

#[test]
fn a_gpu_pairs_bytes_go_only_on_its_route_both_ways() {
    for protocol in [Protocol::Rendezvous, Protocol::Auto] {
        for (s_gpu, d_gpu) in [(5u32, 2u32), (0, 7), (3, 3)] {
            let mut s = routed(protocol, 7 + u64::from(s_gpu));
            s.buffer(0, 1, 96 * 1024, 9);
            s.buffer(1, 2, 96 * 1024, 0);
            s.nodes[0].eng.set_buffer_memory(1, Memory::Gpu(s_gpu));
            s.nodes[1].eng.set_buffer_memory(2, Memory::Gpu(d_gpu));
            // Larger than SIM_EAGER_MAX: rendezvous under auto too.
            let t = s.write(0, 1, 0, 2, 0, 96 * 1024);
            s.run();
            assert!(
                s.outcome(0, t).code == Code::Ok,
                "{protocol:?}: {:?}",
                s.outcome(0, t)
            );
            assert!(s.same((0, 1, 0), (1, 2, 0), 96 * 1024));
            let used = used_send_lanes(&s, 0);
            assert!(!used.is_empty());
            for (lane, _) in &used {
                assert_gpu_pair_lane(&s, 0, *lane, s_gpu, d_gpu);
            }
            // Both lanes of the pair's group carried the 24 chunks; no other lane opened.
            assert_eq!(used.len(), 2, "{used:?}");
            let open = s.nodes[0]
                .eng
                .peer_counters(P)
                .unwrap()
                .send
                .iter()
                .filter(|l| l.state != "closed")
                .count();
            assert_eq!(open, 2);
            // A READ of it back lands byte-exact, on the reverse pair's lanes.
            s.buffer(0, 3, 96 * 1024, 0);
            s.nodes[0].eng.set_buffer_memory(3, Memory::Gpu(s_gpu));
            let r = s.read(0, 2, 0, 3, 0, 96 * 1024);
            s.run();
            assert!(s.outcome(0, r).code == Code::Ok);
            assert!(s.same((0, 1, 0), (0, 3, 0), 96 * 1024));
            for (lane, _) in used_send_lanes(&s, 1) {
                assert_gpu_pair_lane(&s, 1, lane, d_gpu, s_gpu);
            }
            s.assert_idle();
        }
    }
}

#[test]
fn host_memory_uses_every_nic_and_host_to_gpu_lands_on_the_gpus_nic() {
    let mut s = routed(Protocol::Rendezvous, 11);
    s.buffer(0, 1, 256 * 1024, 5);
    s.buffer(1, 2, 256 * 1024, 0);
    s.buffer(1, 4, 256 * 1024, 0);
    s.nodes[1].eng.set_buffer_memory(4, Memory::Gpu(6));
    let before = reset_bytes(&mut s);
    let t = s.write(0, 1, 0, 2, 0, 256 * 1024);
    s.run();
    assert!(s.outcome(0, t).code == Code::Ok);
    assert!(s.same((0, 1, 0), (1, 2, 0), 256 * 1024));
    let nics: std::collections::BTreeSet<usize> = used_send_lanes(&s, 0)
        .iter()
        .map(|(_, r)| r.unwrap().send.nic)
        .collect();
    assert_eq!(nics.len(), 4, "host to host spreads over every NIC");
    assert!(reset_bytes(&mut s)[0] > before[0]);
    // Host to GPU 6: every sending NIC, all into the receiver's NIC 3 under GPU 6.
    let mark = s.nodes[0].eng.peer_counters(P).unwrap();
    let t = s.write(0, 1, 0, 4, 0, 256 * 1024);
    s.run();
    assert!(s.outcome(0, t).code == Code::Ok);
    assert!(s.same((0, 1, 0), (1, 4, 0), 256 * 1024));
    let after = s.nodes[0].eng.peer_counters(P).unwrap();
    for (lane, (a, b)) in after.send.iter().zip(&mark.send).enumerate() {
        if a.bytes > b.bytes {
            let r = s.nodes[0].eng.send_lane_route(P, lane as u32).unwrap();
            assert_eq!((r.recv.nic, r.recv.gpu), (3, Some(6)), "lane {lane}");
        }
    }
    s.assert_idle();
}

#[test]
fn a_smaller_peers_gpu_is_reached_on_its_own_nic() {
    // Node 1 has four GPUs over two NICs: GPU 7 of node 0 to GPU 3 of node 1 takes node 0's
    // NIC 3 and node 1's NIC 1.
    let c = cfg(Protocol::Rendezvous);
    let mut s = Sim::pair_routed(8, [c.clone(), c], 5, [node(8, 4), node(4, 2)]);
    s.buffer(0, 1, 64 * 1024, 3);
    s.buffer(1, 2, 64 * 1024, 0);
    s.nodes[0].eng.set_buffer_memory(1, Memory::Gpu(7));
    s.nodes[1].eng.set_buffer_memory(2, Memory::Gpu(3));
    let t = s.write(0, 1, 0, 2, 0, 64 * 1024);
    s.run();
    assert!(
        s.outcome(0, t).code == Code::Ok,
        "GPU 7 → GPU 3 on a smaller node: {:?}",
        s.outcome(0, t)
    );
    assert!(s.same((0, 1, 0), (1, 2, 0), 64 * 1024));
    for (lane, r) in used_send_lanes(&s, 0) {
        let r = r.unwrap();
        assert_eq!((r.send.nic, r.send.gpu), (3, Some(7)), "lane {lane}");
        // GPU 3 of a 4-GPU, 2-NIC node is on its NIC 1.
        assert_eq!((r.recv.nic, r.recv.gpu), (1, Some(3)), "lane {lane}");
    }
    s.assert_idle();
}

#[test]
fn an_offer_naming_no_routed_lane_is_refused_naming_it_and_changes_nothing() {
    let mut s = routed(Protocol::Rendezvous, 13);
    s.buffer(1, 2, 64 * 1024, 0);
    let offer = Offer {
        offer_id: 900,
        read_id: 0,
        chunk_bytes: MIN_CHUNK_BYTES,
        // An eager lane of (host, host): routed offers name a rendezvous lane of their source
        // memory's group.
        first_lane: 12,
        ranges: vec![RemoteRange {
            buffer_id: 2,
            access_key: key(2),
            offset: 0,
            length: 64 * 1024,
        }]
        .into(),
        notification: Vec::new(),
        deadline_ms: 60_000,
        blocks: None,
        coalesced: false,
        transfer_id: 0,
        announced: None,
    };
    s.nodes[1].eng.on_message(P, PeerMsg::Offer(offer), s.now);
    let mut refused = None;
    while let Some(a) = s.nodes[1].eng.poll_action() {
        match a {
            Action::Control {
                msg: PeerMsg::Reject { message, code, .. },
                ..
            } => refused = Some((code, message)),
            Action::PostRecv { .. } | Action::ListenLane { .. } => panic!("{a:?} for a refused offer"),
            _ => {}
        }
    }
    let (code, m) = refused.expect("a Reject");
    // Invalid, as a first lane past the layout's rendezvous lanes on a pairing not routed.
    assert_eq!(code, Code::InvalidArgument, "{m}");
    assert!(
        m.contains("first_lane 12 is not a rendezvous lane of the routed lanes 0.."),
        "{m}"
    );
    assert_eq!(s.nodes[1].eng.buffer_users(2), Some(0));
}

#[test]
fn routed_lanes_close_when_idle_and_the_next_transfer_reopens_them() {
    let idle = Duration::from_secs(1);
    let c = EngineConfig {
        lane_idle_close: Some(idle),
        ..cfg(Protocol::Auto)
    };
    let mut s = Sim::pair_routed(8, [c.clone(), c], 17, [node(8, 4), node(8, 4)]);
    s.buffer(0, 1, 96 * 1024, 4);
    s.buffer(1, 2, 96 * 1024, 0);
    s.nodes[0].eng.set_buffer_memory(1, Memory::Gpu(1));
    s.nodes[1].eng.set_buffer_memory(2, Memory::Gpu(4));
    for round in 0..3u8 {
        s.nodes[0].bufs.get_mut(&1).unwrap()[0] = round;
        let t = s.write(0, 1, 0, 2, 0, 96 * 1024);
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Ok, "round {round}");
        assert!(s.same((0, 1, 0), (1, 2, 0), 96 * 1024), "round {round}");
        assert_eq!(
            s.nodes[0].eng.lanes_open().0,
            2,
            "round {round}: GPU 1 -> GPU 4's two lanes"
        );
        for step in [Duration::from_millis(200), idle + Duration::from_millis(200)] {
            s.now += step;
            for i in 0..2 {
                s.nodes[i].eng.on_tick(s.now);
            }
            s.run();
        }
        assert_eq!(
            s.nodes[0].eng.lanes_open(),
            (0, 0),
            "round {round}: closed when idle"
        );
        assert_eq!(s.nodes[1].eng.lanes_open(), (0, 0), "round {round}");
    }
    assert!(s.closed_lanes[0] + s.closed_lanes[1] >= 6);
    s.assert_idle();
}

#[test]
fn a_transfer_from_two_gpus_goes_from_each_gpus_own_nic() {
    let mut s = routed(Protocol::Rendezvous, 19);
    s.buffer(0, 1, 64 * 1024, 2);
    s.buffer(0, 3, 64 * 1024, 6);
    s.buffer(1, 2, 128 * 1024, 0);
    s.nodes[0].eng.set_buffer_memory(1, Memory::Gpu(0));
    s.nodes[0].eng.set_buffer_memory(3, Memory::Gpu(7));
    s.nodes[1].eng.set_buffer_memory(2, Memory::Gpu(4));
    let spec = |local: u64, offset: u64| WriteSpec {
        local_buffer: local,
        local_offset: 0,
        peer: P,
        remote: RemoteRange {
            buffer_id: 2,
            access_key: key(2),
            offset,
            length: 64 * 1024,
        },
    };
    let deadline = s.now + Duration::from_secs(60);
    let t = s.nodes[0]
        .eng
        .start_write(vec![spec(1, 0), spec(3, 64 * 1024)], Vec::new(), deadline, s.now)
        .unwrap();
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.same((0, 1, 0), (1, 2, 0), 64 * 1024));
    assert!(s.same((0, 3, 0), (1, 2, 64 * 1024), 64 * 1024));
    // Split per memory pair (`route_parts.rs`): GPU 0's range from NIC 0 under GPU 0, GPU 7's
    // from NIC 3 under GPU 7, both into NIC 2 under GPU 4; no other sending NIC.
    let used = used_send_lanes(&s, 0);
    let nics: std::collections::BTreeSet<usize> = used.iter().map(|(_, r)| r.unwrap().send.nic).collect();
    assert_eq!(nics, [0, 3].into(), "each GPU's own NIC only");
    for (lane, r) in used {
        let r = r.unwrap();
        assert!(r.send.gpu == Some(0) || r.send.gpu == Some(7), "lane {lane}");
        assert_gpu_pair_lane(&s, 0, lane, r.send.gpu.unwrap(), 4);
    }
    assert_eq!(s.nodes[0].eng.peer_counters(P).unwrap().transfers_started, 1);
    s.assert_idle();
}

#[test]
fn an_accept_naming_another_memorys_lane_fails_the_pairing() {
    let mut s = routed(Protocol::Rendezvous, 23);
    s.buffer(0, 1, 64 * 1024, 8);
    s.nodes[0].eng.set_buffer_memory(1, Memory::Gpu(2));
    let spec = WriteSpec {
        local_buffer: 1,
        local_offset: 0,
        peer: P,
        remote: RemoteRange {
            buffer_id: 9,
            access_key: key(9),
            offset: 0,
            length: 64 * 1024,
        },
    };
    let deadline = s.now + Duration::from_secs(60);
    s.nodes[0]
        .eng
        .start_write(vec![spec], Vec::new(), deadline, s.now)
        .unwrap();
    let mut offer = None;
    while let Some(a) = s.nodes[0].eng.poll_action() {
        if let Action::Control {
            msg: PeerMsg::Offer(o),
            ..
        } = a
        {
            offer = Some(o);
        }
    }
    let o = offer.expect("an offer");
    // The offer names the first lane of (GPU 2, host): a routed lane.
    let route = s.nodes[0]
        .eng
        .send_lane_route(P, o.first_lane)
        .expect("a routed lane");
    assert_eq!(route.send.gpu, Some(2));
    // An accept naming a lane of GPU 0's pairs (the first routed lanes are host's, then GPU 0's).
    let wrong = (0..o.first_lane)
        .find(|&l| {
            s.nodes[0]
                .eng
                .send_lane_route(P, l)
                .is_some_and(|r| r.send.gpu == Some(0))
        })
        .expect("a lane of GPU 0");
    s.nodes[0].eng.on_message(
        P,
        PeerMsg::Accept {
            offer_id: o.offer_id,
            first_lane: Some(wrong),
        },
        s.now,
    );
    let failed = s.nodes[0]
        .eng
        .peer_counters(P)
        .unwrap()
        .failed
        .expect("the pairing failed");
    assert!(
        failed.contains("protocol violation") && failed.contains(&format!("accepted first lane {wrong}")),
        "{failed}"
    );
}
