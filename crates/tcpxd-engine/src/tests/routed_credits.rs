//! Credits on a routed pairing (`routes.rs`, "Eager (credit) transfers"): an eager transfer
//! from GPU s into GPU d (credits at any size, streamed when large) moves only on the eager
//! lanes of the pair (s, d), host destinations on the eager lanes of (s, host), every credit
//! back; a header naming another pair's lane fails the pairing.

use super::routes::{assert_gpu_pair_lane, node};
use super::sim::*;
use super::*;
use crate::topology::Memory;

/// Auto with GPU credits, 4 devices × 2 rendezvous lanes + 1 eager lane each.
fn cfg() -> EngineConfig {
    EngineConfig {
        protocol: Protocol::Auto,
        devices: 4,
        lanes_per_device: 2,
        eager_lanes: 1,
        eager_max_bytes: SIM_EAGER_MAX,
        gpu_credits: true,
        credit_budget_bytes: 48 * 1024,
        ..small_chunks()
    }
}

fn routed(seed: u64) -> Sim {
    let c = cfg();
    Sim::pair_routed(4 * 3, [c.clone(), c], seed, [node(8, 4), node(8, 4)])
}

/// A buffer of `node` on GPU `gpu` (told to the peer with its ordinal).
fn gpu_buffer(s: &mut Sim, node: usize, id: u64, size: usize, fill: u8, gpu: u32) {
    s.gpu_buffer(node, id, size, fill, gpu);
    // Delivered: the peer knows the buffer's GPU before any transfer starts.
    s.run();
}

/// Send lanes of node 0 whose bytes grew since `before`.
fn grew(s: &Sim, before: &PeerCounters) -> Vec<u32> {
    let now = s.nodes[0].eng.peer_counters(P).unwrap();
    now.send
        .iter()
        .zip(&before.send)
        .enumerate()
        .filter(|(_, (a, b))| a.bytes > b.bytes)
        .map(|(lane, _)| lane as u32)
        .collect()
}

#[test]
fn gpu_to_gpu_credits_go_only_on_the_pairs_eager_lanes() {
    for (s_gpu, d_gpu) in [(3u32, 5u32), (0, 7), (6, 6)] {
        let mut s = routed(31 + u64::from(s_gpu));
        gpu_buffer(&mut s, 0, 1, 512 * 1024, 9, s_gpu);
        gpu_buffer(&mut s, 1, 2, 512 * 1024, 0, d_gpu);
        s.buffer(1, 3, 64 * 1024, 0);
        // Small (eager by size) and large (credits at any size, streamed): no offer.
        let mut at = 0;
        for len in [4096u64, 300 * 1024] {
            let before = s.nodes[0].eng.peer_counters(P).unwrap();
            let t = s.write(0, 1, at, 2, at, len);
            s.run();
            assert_eq!(s.outcome(0, t).code, Code::Ok, "{len}: {:?}", s.outcome(0, t));
            assert!(s.same((0, 1, at), (1, 2, at), len), "{len} byte-exact");
            let c = s.nodes[0].eng.peer_counters(P).unwrap();
            assert_eq!(c.sent_rendezvous, 0, "{len}: credits, no offer");
            let used = grew(&s, &before);
            assert!(!used.is_empty());
            for lane in used {
                assert_gpu_pair_lane(&s, 0, lane, s_gpu, d_gpu);
                assert!(
                    c.send[lane as usize].credit_limit > 0,
                    "lane {lane} is a credit lane"
                );
                assert!(s.nodes[1].eng.recv_lane_is_eager(P, lane), "lane {lane}");
            }
            at += len;
        }
        // Into host memory: eager by size, on the (GPU s, host) pair's eager lanes.
        let before = s.nodes[0].eng.peer_counters(P).unwrap();
        let t = s.write(0, 1, 0, 3, 0, 8192);
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Ok);
        assert!(s.same((0, 1, 0), (1, 3, 0), 8192));
        for lane in grew(&s, &before) {
            let r = s.nodes[0].eng.send_lane_route(P, lane).expect("a routed lane");
            assert_eq!(r.send.gpu, Some(s_gpu), "lane {lane}");
            assert!(s.nodes[1].eng.recv_lane_is_eager(P, lane), "lane {lane}");
            assert_ne!(r.recv.gpu, Some(d_gpu).filter(|&d| d % 2 == 1), "lane {lane}");
        }
        let c = s.nodes[0].eng.peer_counters(P).unwrap();
        assert_eq!((c.sent_eager, c.sent_rendezvous), (3, 0));
        s.assert_idle();
    }
}

#[test]
fn a_header_naming_another_pairs_eager_lane_fails_the_pairing() {
    let mut s = routed(37);
    gpu_buffer(&mut s, 0, 1, 64 * 1024, 4, 3);
    gpu_buffer(&mut s, 1, 2, 64 * 1024, 0, 5);
    let spec = WriteSpec {
        local_buffer: 1,
        local_offset: 0,
        peer: P,
        remote: RemoteRange {
            buffer_id: 2,
            access_key: key(2),
            offset: 0,
            length: 8192,
        },
    };
    let deadline = s.now + Duration::from_secs(60);
    s.nodes[0]
        .eng
        .start_write(vec![spec], Vec::new(), deadline, s.now)
        .unwrap();
    let mut header = None;
    while let Some(a) = s.nodes[0].eng.poll_action() {
        if let Action::Control {
            msg: PeerMsg::Header(h),
            ..
        } = a
        {
            header = Some(h);
        }
    }
    let mut h = header.expect("a header");
    let r = s.nodes[1]
        .eng
        .recv_lane_route(P, h.first_lane)
        .expect("a routed lane");
    assert_eq!((r.send.gpu, r.recv.gpu), (Some(3), Some(5)));
    // An eager lane of GPU 3 → GPU 1 (host routes listen under even GPUs only): lands in
    // another GPU's bounce memory.
    let wrong = (0..s.nodes[1].eng.lane_counts(P).1)
        .find(|&l| {
            s.nodes[1].eng.recv_lane_is_eager(P, l)
                && s.nodes[1]
                    .eng
                    .recv_lane_route(P, l)
                    .is_some_and(|r| r.send.gpu == Some(3) && r.recv.gpu == Some(1))
        })
        .expect("an eager lane of (GPU 3, GPU 1)");
    h.first_lane = wrong;
    s.nodes[1].eng.on_message(P, PeerMsg::Header(h), s.now);
    let failed = s.nodes[1]
        .eng
        .peer_counters(P)
        .unwrap()
        .failed
        .expect("the pairing failed");
    assert!(
        failed.contains("protocol violation") && failed.contains(&format!("first_lane {wrong}")),
        "{failed}"
    );
}

#[test]
fn a_gpu_buffer_not_yet_announced_is_reached_on_the_host_pairs_eager_lanes() {
    let mut s = routed(41);
    gpu_buffer(&mut s, 0, 1, 64 * 1024, 6, 2);
    s.buffer(1, 2, 64 * 1024, 0);
    // Its GpuCredits is still on the control stream when the write starts: the sender takes
    // the buffer for host memory (eager by size, the (GPU 2, host) pair), which the receiver
    // accepts for a GPU destination too.
    s.nodes[1].eng.set_buffer_memory(2, Memory::Gpu(7));
    let before = s.nodes[0].eng.peer_counters(P).unwrap();
    let t = s.write(0, 1, 0, 2, 0, 8192);
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok, "{:?}", s.outcome(0, t));
    assert!(s.same((0, 1, 0), (1, 2, 0), 8192));
    let used = grew(&s, &before);
    assert!(!used.is_empty());
    for lane in used {
        let r = s.nodes[0].eng.send_lane_route(P, lane).expect("a routed lane");
        assert_eq!(r.send.gpu, Some(2), "lane {lane}");
        assert_eq!(
            s.nodes[1].eng.recv_lane_memory(P, lane),
            Some(Memory::Host),
            "lane {lane}: the host pair's"
        );
        assert!(s.nodes[1].eng.recv_lane_is_eager(P, lane));
    }
    // Announced since: the next one takes the (GPU 2, GPU 7) pair.
    let before = s.nodes[0].eng.peer_counters(P).unwrap();
    let t = s.write(0, 1, 8192, 2, 8192, 8192);
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.same((0, 1, 8192), (1, 2, 8192), 8192));
    for lane in grew(&s, &before) {
        assert_eq!(s.nodes[1].eng.recv_lane_memory(P, lane), Some(Memory::Gpu(7)));
    }
    s.assert_idle();
}

#[test]
fn eight_in_flight_between_two_gpus_use_only_their_pairs_lanes_and_return_every_credit() {
    // Two A3-shaped nodes: hundreds of routed lanes a direction. The scans for work walk the
    // lanes in use (`lane_use.rs`): those of the memory pairs that moved bytes, and nothing else.
    let mut s = routed(77);
    let lanes = s.nodes[0].eng.lane_counts(P);
    assert!(lanes.0 > 100 && lanes.1 > 100, "{lanes:?}");
    gpu_buffer(&mut s, 0, 1, 1 << 20, 9, 2);
    gpu_buffer(&mut s, 1, 2, 1 << 20, 0, 6);
    // Eight small and one large (streamed) in flight at once, then run to the end.
    let mut ts = Vec::new();
    for k in 0..8u64 {
        ts.push((s.write(0, 1, k * 8192, 2, k * 8192, 8192), k * 8192, 8192));
    }
    ts.push((
        s.write(0, 1, 512 * 1024, 2, 512 * 1024, 300 * 1024),
        512 * 1024,
        300 * 1024,
    ));
    s.run();
    for (t, at, len) in ts {
        assert_eq!(s.outcome(0, t).code, Code::Ok, "{:?}", s.outcome(0, t));
        assert!(s.same((0, 1, at), (1, 2, at), len), "{len} at {at} byte-exact");
    }
    s.assert_idle();
    let sent = s.nodes[0].eng.peers[&P].send_used.lanes().to_vec();
    let received = s.nodes[1].eng.peers[&P].recv_used.lanes().to_vec();
    assert!(
        !sent.is_empty() && sent.len() <= 2,
        "the pair's eager lanes: {sent:?}"
    );
    for &lane in &sent {
        assert_gpu_pair_lane(&s, 0, lane, 2, 6);
    }
    let (mut a, mut b) = (sent.clone(), received);
    a.sort_unstable();
    b.sort_unstable();
    assert_eq!(a, b, "the receiver lists the same lanes");
    // The lane scan finds no lane with work missing from the lists.
    for n in &mut s.nodes {
        let p = n.eng.peers.get_mut(&P).unwrap();
        assert_eq!(p.mark_lanes_with_work(), 0);
    }
}
