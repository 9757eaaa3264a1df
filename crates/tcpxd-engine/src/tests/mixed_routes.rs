//! Transfers whose ranges lie in several memories on a side (`route_parts.rs`): between two
//! 8-GPU, 4-NIC nodes a WRITE or READ mixing GPU 0, GPU 3 and host memory on one end with
//! GPU 5, GPU 1 and host memory on the other moves each memory pair's bytes only on that
//! pair's lanes (counted at both ends), byte-exact, as ONE transfer: one outcome, one
//! notification after every part landed, counted once; the first failure fails all and a
//! cancel or deadline stops all, every slot and credit back.

use std::collections::BTreeMap;

use super::routes::node;
use super::sim::*;
use super::*;
use crate::topology::Memory;

const K: u64 = 1024;

fn cfgs() -> Vec<(&'static str, EngineConfig, u32)> {
    // 16 KiB chunks: a few per part (the sims of 528 lanes a direction are slow per event).
    let base = EngineConfig {
        devices: 4,
        lanes_per_device: 2,
        eager_max_bytes: SIM_EAGER_MAX,
        chunk_bytes: 16 * 1024,
        ..small_chunks()
    };
    vec![
        (
            "rendezvous",
            EngineConfig {
                protocol: Protocol::Rendezvous,
                ..base.clone()
            },
            8,
        ),
        (
            "auto",
            EngineConfig {
                protocol: Protocol::Auto,
                ..base.clone()
            },
            8,
        ),
        (
            "auto, GPU credits",
            EngineConfig {
                protocol: Protocol::Auto,
                eager_lanes: 1,
                gpu_credits: true,
                credit_budget_bytes: 48 * K,
                ..base
            },
            12,
        ),
    ]
}

fn routed(c: &EngineConfig, lanes: u32, seed: u64) -> Sim {
    Sim::pair_routed(lanes, [c.clone(), c.clone()], seed, [node(8, 4), node(8, 4)])
}

/// Node 0: buffer 1 on GPU 0, 2 on GPU 3, 3 in host memory; node 1: 11 on GPU 5, 12 on GPU 1,
/// 13 in host memory (node 1's told to node 0 when GPU credits are on). Node 0's for READs
/// back: 4 on GPU 6, 5 in host memory, 6 on GPU 0.
fn buffers(s: &mut Sim) {
    let size = 256 * K as usize;
    for (node, id, gpu, fill) in [
        (0, 1, Some(0), 3),
        (0, 2, Some(3), 7),
        (0, 3, None, 11),
        (0, 4, Some(6), 0),
        (0, 5, None, 0),
        (0, 6, Some(0), 0),
        (1, 11, Some(5), 0),
        (1, 12, Some(1), 0),
        (1, 13, None, 0),
    ] {
        s.buffer(node, id, size, fill);
        if let Some(g) = gpu {
            s.nodes[node].eng.set_buffer_memory(id, Memory::Gpu(g));
        }
    }
    // Delivered: with GPU credits node 0 knows node 1's GPU buffers before any transfer.
    s.run();
}

fn memory(id: u64) -> Memory {
    match id {
        1 | 6 => Memory::Gpu(0),
        2 => Memory::Gpu(3),
        4 => Memory::Gpu(6),
        11 => Memory::Gpu(5),
        12 => Memory::Gpu(1),
        _ => Memory::Host,
    }
}

/// (local buffer, offset, remote buffer, offset, length): each memory pair 32 KiB or more
/// (over the sims' eager size), GPU 0 → GPU 5 twice, in two entries apart.
const MIXED: [(u64, u64, u64, u64, u64); 8] = [
    (1, 0, 11, 0, 32 * K),
    (2, 0, 12, 0, 32 * K),
    (3, 0, 13, 0, 32 * K),
    (1, 32 * K, 13, 32 * K, 32 * K),
    (3, 32 * K, 11, 32 * K, 40 * K),
    (2, 32 * K, 11, 72 * K, 32 * K),
    (1, 64 * K, 11, 104 * K, 24 * K),
    (3, 72 * K, 12, 32 * K, 32 * K),
];

fn specs(entries: &[(u64, u64, u64, u64, u64)]) -> Vec<EntrySpec> {
    entries
        .iter()
        .map(|&(lb, lo, rb, ro, len)| EntrySpec {
            local_buffer: lb,
            local_offset: lo,
            peer: P,
            remote: RemoteRange {
                buffer_id: rb,
                access_key: key(rb as u8),
                offset: ro,
                length: len,
            },
        })
        .collect()
}

fn write_mixed(s: &mut Sim, entries: &[(u64, u64, u64, u64, u64)]) -> TransferId {
    let deadline = s.now + Duration::from_secs(60);
    s.nodes[0]
        .eng
        .start_write(specs(entries), b"note".to_vec(), deadline, s.now)
        .unwrap()
}

/// Bytes per memory pair that node `from` sent (its send lanes) and that the other node
/// received (its receive lanes), each lane counted under its group's memory pair.
type PairBytes = BTreeMap<(Memory, Memory), u64>;
fn pair_bytes(s: &Sim, from: usize) -> (PairBytes, PairBytes) {
    let mut sent = PairBytes::new();
    let (a, b) = (&s.nodes[from].eng, &s.nodes[1 - from].eng);
    for (lane, l) in a.peer_counters(P).unwrap().send.iter().enumerate() {
        if l.bytes > 0 {
            let pair = a.peers[&P]
                .routes
                .as_ref()
                .unwrap()
                .send_memory(lane as u32)
                .unwrap();
            *sent.entry(pair).or_default() += l.bytes;
        }
    }
    let mut got = PairBytes::new();
    for (lane, l) in b.peer_counters(P).unwrap().recv.iter().enumerate() {
        if l.bytes > 0 {
            let pair = b.peers[&P]
                .routes
                .as_ref()
                .unwrap()
                .recv_memory(lane as u32)
                .unwrap();
            *got.entry(pair).or_default() += l.bytes;
        }
    }
    (sent, got)
}

fn expected(entries: &[(u64, u64, u64, u64, u64)], read: bool) -> PairBytes {
    let mut m = PairBytes::new();
    for &(lb, _, rb, _, len) in entries {
        let pair = if read {
            (memory(rb), memory(lb))
        } else {
            (memory(lb), memory(rb))
        };
        *m.entry(pair).or_default() += len;
    }
    m
}

#[test]
fn a_mixed_write_and_read_move_each_pairs_bytes_only_on_its_lanes() {
    for (name, c, lanes) in cfgs() {
        let mut s = routed(&c, lanes, 41);
        buffers(&mut s);
        let t = write_mixed(&mut s, &MIXED);
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Ok, "{name}: {:?}", s.outcome(0, t));
        assert_eq!(s.outcome(0, t).entries.len(), MIXED.len(), "{name}");
        for &(lb, lo, rb, ro, len) in &MIXED {
            assert!(
                s.same((0, lb, lo), (1, rb, ro), len),
                "{name}: {lb}@{lo} → {rb}@{ro}"
            );
        }
        let want = expected(&MIXED, false);
        assert_eq!(want.len(), 7, "seven memory pairs");
        let (sent, got) = pair_bytes(&s, 0);
        assert_eq!(sent, want, "{name}: node 0's send lanes, per memory pair");
        assert_eq!(got, want, "{name}: node 1's receive lanes, per memory pair");
        // One transfer: one notification, after every part, naming each buffer written once;
        // counted once on the pairing.
        assert_eq!(s.nodes[1].notes, vec![(t.0, b"note".to_vec())], "{name}");
        assert_eq!(s.nodes[1].noted_buffers, vec![vec![11, 12, 13]], "{name}");
        let c0 = s.nodes[0].eng.peer_counters(P).unwrap();
        assert_eq!((c0.transfers_started, c0.transfers_ok), (1, 1), "{name}");
        assert_eq!(
            s.nodes[0].progress[&t],
            MIXED.iter().map(|e| e.4).sum::<u64>(),
            "{name}"
        );
        s.assert_idle();

        // READ it back into other memories: node 1 (the holder) sends each pair on its lanes.
        let back: Vec<(u64, u64, u64, u64, u64)> = MIXED
            .iter()
            .enumerate()
            .map(|(i, &(_, _, rb, ro, len))| ([4, 5, 6][i % 3], 40 * K * (i as u64 / 3), rb, ro, len))
            .collect();
        let deadline = s.now + Duration::from_secs(60);
        let r = s.nodes[0].eng.start_read(specs(&back), deadline, s.now).unwrap();
        s.run();
        assert_eq!(
            s.outcome(0, r).code,
            Code::Ok,
            "{name} READ: {:?}",
            s.outcome(0, r)
        );
        for &(lb, lo, rb, ro, len) in &back {
            assert!(
                s.same((0, lb, lo), (1, rb, ro), len),
                "{name} READ: {rb}@{ro} → {lb}@{lo}"
            );
        }
        let (sent, got) = pair_bytes(&s, 1);
        assert_eq!(sent, expected(&back, true), "{name} READ: node 1's send lanes");
        assert_eq!(got, expected(&back, true), "{name} READ: node 0's receive lanes");
        let c0 = s.nodes[0].eng.peer_counters(P).unwrap();
        assert_eq!((c0.transfers_started, c0.transfers_ok), (2, 2), "{name}");
        s.assert_idle();
    }
}

#[test]
fn one_refused_part_fails_the_whole_and_returns_every_slot() {
    for (name, c, lanes) in cfgs() {
        let mut s = routed(&c, lanes, 43);
        buffers(&mut s);
        let mut sp = specs(&MIXED);
        // Entry 3 (GPU 0 → host) names a wrong key: its part is refused.
        sp[3].remote.access_key = key(99);
        let deadline = s.now + Duration::from_secs(60);
        let t = s.nodes[0]
            .eng
            .start_write(sp, b"note".to_vec(), deadline, s.now)
            .unwrap();
        s.run();
        let o = s.outcome(0, t);
        assert_ne!(o.code, Code::Ok, "{name}");
        assert!(o.message.contains("entries[3]"), "{name}: {}", o.message);
        assert_eq!(o.entries[3].0, o.code, "{name}");
        for (i, e) in o.entries.iter().enumerate() {
            // The others: aborted or, as the refused part's range 6 shares it, the same.
            assert_ne!(e.0, Code::Ok, "{name}: entry {i} of a failed transfer");
        }
        assert!(
            s.nodes[1].notes.is_empty(),
            "{name}: no notification for a failed transfer"
        );
        let c0 = s.nodes[0].eng.peer_counters(P).unwrap();
        assert_eq!((c0.transfers_started, c0.transfers_failed), (1, 1), "{name}");
        s.assert_idle();
        // The pairing still works: the same mixed WRITE, keys right, lands.
        let t = write_mixed(&mut s, &MIXED);
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Ok, "{name}");
        s.assert_idle();
    }
}

#[test]
fn a_cancel_or_deadline_mid_way_stops_every_part() {
    for (name, c, lanes) in cfgs() {
        // The deadline's path is the cancel's (`fail_transfer`): once, with GPU credits.
        let ways: &[bool] = if c.gpu_credits { &[false, true] } else { &[false] };
        for &deadline in ways {
            let mut s = routed(&c, lanes, 47);
            buffers(&mut s);
            let t = write_mixed(&mut s, &MIXED);
            // Some chunks move, then it ends.
            for _ in 0..40 {
                s.step();
            }
            assert!(!s.nodes[0].finished.contains_key(&t), "{name}: still running");
            let moved = s.nodes[0].progress.get(&t).copied().unwrap_or(0);
            assert!(moved > 0, "{name}: some chunks left before the end");
            if deadline {
                s.now += Duration::from_secs(61);
                s.nodes[0].eng.on_tick(s.now);
            } else {
                assert!(s.nodes[0].eng.cancel(t, Code::Cancelled, "stop"));
            }
            s.run();
            let want = if deadline {
                Code::DeadlineExceeded
            } else {
                Code::Cancelled
            };
            assert_eq!(s.outcome(0, t).code, want, "{name}: {:?}", s.outcome(0, t));
            assert!(s.nodes[1].notes.is_empty(), "{name}");
            s.assert_idle();
            // READ of a mixed set, cancelled mid-way, the same.
            let back: Vec<_> = MIXED
                .iter()
                .enumerate()
                .map(|(i, &(_, _, rb, ro, len))| ([4, 5, 6][i % 3], 40 * K * (i as u64 / 3), rb, ro, len))
                .collect();
            let dl = s.now + Duration::from_secs(60);
            let r = s.nodes[0].eng.start_read(specs(&back), dl, s.now).unwrap();
            for _ in 0..40 {
                s.step();
            }
            assert!(s.nodes[0].eng.cancel(r, Code::Cancelled, "stop"));
            s.run();
            assert_eq!(s.outcome(0, r).code, Code::Cancelled, "{name}");
            s.assert_idle();
        }
    }
}

#[test]
fn a_pairing_not_routed_keeps_one_part_per_peer() {
    let c = EngineConfig {
        protocol: Protocol::Rendezvous,
        ..small_chunks()
    };
    let mut s = Sim::pair(2, [c.clone(), c], 5);
    buffers(&mut s);
    let t = write_mixed(&mut s, &MIXED);
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert_eq!(
        s.nodes[0].eng.peer_counters(P).unwrap().sent_rendezvous,
        1,
        "one offer"
    );
    // Carried on the offer: delivered naming each range's buffer.
    assert_eq!(s.nodes[1].notes.len(), 1);
    s.assert_idle();
}

#[test]
fn remote_buffers_of_unknown_memory_split_up_to_the_limit() {
    let (_, c, lanes) = cfgs().remove(0);
    let mut s = routed(&c, lanes, 53);
    s.buffer(0, 1, 512 * K as usize, 9);
    s.nodes[0].eng.set_buffer_memory(1, Memory::Gpu(2));
    // Node 1's host buffers: their memory is not known on node 0.
    for id in 100..100 + MAX_SPLIT_PARTS as u64 + 1 {
        s.buffer(1, id, 8 * K as usize, 0);
    }
    for n in [10, MAX_SPLIT_PARTS as u64, MAX_SPLIT_PARTS as u64 + 1] {
        let entries: Vec<_> = (0..n).map(|i| (1, i * 4 * K, 100 + i, 1, 4 * K)).collect();
        let before = s.nodes[0].eng.peer_counters(P).unwrap().sent_rendezvous;
        let t = write_mixed(&mut s, &entries);
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Ok, "{n}");
        for &(lb, lo, rb, ro, len) in &entries {
            assert!(s.same((0, lb, lo), (1, rb, ro), len), "{n}: buffer {rb}");
        }
        let offers = s.nodes[0].eng.peer_counters(P).unwrap().sent_rendezvous - before;
        let want = if n as usize > MAX_SPLIT_PARTS { 1 } else { n };
        assert_eq!(offers, want, "{n} remote buffers of unknown memory");
        // Every part into host memory: GPU 2 → host lanes only.
        let (sent, _) = pair_bytes(&s, 0);
        assert_eq!(
            sent.keys().collect::<Vec<_>>(),
            [&(Memory::Gpu(2), Memory::Host)],
            "{n}"
        );
        s.assert_idle();
    }
}
