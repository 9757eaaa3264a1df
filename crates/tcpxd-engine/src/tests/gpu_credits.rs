//! Credits at any size into a receiver's GPU memory (`streams.rs`): the choice, streamed
//! headers, byte budgets, the rule that keeps a large transfer from starving small ones, and
//! every credit back after refusals, cancels and deadlines.

use super::*;
use crate::topology::Memory;

/// Auto with 1 rendezvous lane and 1 credit lane per peer (lane 1), 4 KiB chunks, eager up to
/// 16 KiB, credit receives landing in GPU memory.
pub(super) fn gpu_cfg() -> EngineConfig {
    EngineConfig {
        protocol: Protocol::Auto,
        eager_lanes: 1,
        eager_max_bytes: 16 * 1024,
        gpu_credits: true,
        credit_budget_bytes: 48 * 1024,
        ..small_chunks()
    }
}

impl Sim {
    /// A buffer of `node` on GPU `gpu` (told to its peer with its ordinal; queued, not yet
    /// delivered).
    pub(super) fn gpu_buffer(&mut self, node: usize, id: u64, size: usize, fill: u8, gpu: u32) {
        self.buffer(node, id, size, fill);
        self.nodes[node].eng.set_buffer_memory(id, Memory::Gpu(gpu));
        self.drain();
    }
}

/// (sent eager, sent rendezvous) of a node.
fn sent(s: &Sim, node: usize) -> (u64, u64) {
    let c = s.nodes[node].eng.peer_counters(P).unwrap();
    (c.sent_eager, c.sent_rendezvous)
}

fn headers(msgs: &VecDeque<PeerMsg>) -> Vec<(u64, Option<u64>)> {
    msgs.iter()
        .filter_map(|m| match m {
            PeerMsg::Header(h) => Some((h.offer_id, h.announced)),
            _ => None,
        })
        .collect()
}

#[test]
fn gpu_destinations_take_credits_at_every_size_and_host_ones_keep_the_size_rule() {
    let mut s = Sim::new(1, gpu_cfg(), 41);
    s.gpu_buffer(1, 2, 4 << 20, 0, 0);
    s.buffer(1, 3, 1 << 20, 0);
    s.buffer(0, 1, 4 << 20, 7);
    // Pairing: the credit receives are chunk-sized (not eager_max), the budget announced.
    let c = s.nodes[0].eng.peer_counters(P).unwrap();
    assert_eq!(
        c.send.iter().map(|l| l.credit_limit).collect::<Vec<_>>(),
        vec![0, 16]
    );
    let mut at = 0;
    for (i, len) in [4096u64, 16 * 1024, 200_000, 1 << 20, 3 << 20]
        .into_iter()
        .enumerate()
    {
        let t = s.write(0, 1, at, 2, at, len);
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Ok, "{len}");
        assert!(s.same((0, 1, at), (1, 2, at), len), "{len} bytes byte-exact");
        assert_eq!(sent(&s, 0), (i as u64 + 1, 0), "{len}: credits, no offer");
        at += len / 2;
    }
    // READ: the holder sends into the reader's GPU buffer the same way.
    s.gpu_buffer(0, 4, 2 << 20, 0, 0);
    s.buffer(1, 5, 2 << 20, 3);
    let t = s.read(0, 5, 0, 4, 0, 2 << 20);
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.same((1, 5, 0), (0, 4, 0), 2 << 20));
    assert_eq!(sent(&s, 1), (1, 0), "the holder sent by credits");
    // A host destination: above eager_max it is an offer.
    let t = s.write(0, 1, 0, 3, 0, 100_000);
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.same((0, 1, 0), (1, 3, 0), 100_000));
    assert_eq!(sent(&s, 0), (5, 1));
    s.assert_idle();
}

#[test]
fn a_large_transfer_is_streamed_within_its_share_of_the_credits() {
    let mut s = Sim::new(1, gpu_cfg(), 42);
    s.gpu_buffer(1, 2, 1 << 20, 0, 0);
    s.buffer(0, 1, 1 << 20, 9);
    s.run();
    let t = s.write(0, 1, 0, 2, 0, 1 << 20);
    s.drain();
    // 16 credits, a 48 KiB budget: a large transfer takes 12 credits and 36 KiB, so 9 chunks.
    assert_eq!(headers(&s.ctrl[1]).len(), 1);
    assert_eq!(
        headers(&s.ctrl[1])[0].1,
        Some(9),
        "the first 9 of 256 chunks announced"
    );
    let c = s.nodes[0].eng.peer_counters(P).unwrap();
    assert_eq!(c.send[1].credit_bytes_out, 9 * 4096, "9 chunks' bytes out");
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.same((0, 1, 0), (1, 2, 0), 1 << 20));
    s.assert_idle();
}

#[test]
fn a_large_transfer_cannot_starve_small_ones() {
    let mut s = Sim::new(1, gpu_cfg(), 43);
    s.gpu_buffer(1, 2, 4 << 20, 0, 0);
    s.buffer(0, 1, 4 << 20, 9);
    s.run();
    let large = s.write(0, 1, 0, 2, 0, 2 << 20);
    s.drain();
    // Several small ones while the large one streams: each goes at once, into the reserve.
    let mut small = Vec::new();
    for k in 0..4u64 {
        // Let the large transfer fill its share again.
        for _ in 0..40 {
            s.step();
        }
        let at = (2 << 20) + k * 8192;
        small.push((s.write(0, 1, at, 2, at, 8192), at));
        s.drain();
    }
    let mut steps = 0;
    while small.iter().any(|(t, _)| !s.nodes[0].finished.contains_key(t)) {
        assert!(s.step(), "stalled");
        steps += 1;
    }
    assert!(
        !s.nodes[0].finished.contains_key(&large),
        "every small transfer finished while the large one still streams ({steps} steps)"
    );
    let done = s.nodes[0].progress.get(&large).copied().unwrap_or(0);
    assert!(
        done < (1 << 20),
        "{done} of 2 MiB done: the small ones did not wait for it"
    );
    s.run();
    assert_eq!(s.outcome(0, large).code, Code::Ok);
    assert!(s.same((0, 1, 0), (1, 2, 0), 2 << 20));
    for (t, at) in small {
        assert_eq!(s.outcome(0, t).code, Code::Ok);
        assert!(s.same((0, 1, at), (1, 2, at), 8192));
    }
    s.assert_idle();
}

#[test]
fn two_large_transfers_and_a_read_stream_together() {
    every_seed(|seed| {
        let mut s = Sim::new(2, gpu_cfg(), seed);
        s.gpu_buffer(1, 2, 2 << 20, 0, 0);
        s.gpu_buffer(0, 4, 1 << 20, 0, 0);
        s.buffer(0, 1, 2 << 20, 5);
        s.buffer(1, 5, 1 << 20, 6);
        let a = s.write(0, 1, 0, 2, 0, 700_000);
        let b = s.write(0, 1, 700_000, 2, 700_000, 300_001);
        let r = s.read(0, 5, 0, 4, 0, 1 << 20);
        s.run();
        for t in [a, b, r] {
            assert_eq!(s.outcome(0, t).code, Code::Ok);
        }
        assert!(s.same((0, 1, 0), (1, 2, 0), 1_000_001));
        assert!(s.same((1, 5, 0), (0, 4, 0), 1 << 20));
        s.assert_idle();
    });
}

fn every_seed(test: impl Fn(u64)) {
    for seed in 50..56 {
        test(seed);
    }
}

#[test]
fn cancel_deadline_and_refusal_of_a_streamed_transfer_return_every_credit() {
    every_seed(|seed| {
        let mut s = Sim::new(1, gpu_cfg(), seed);
        s.gpu_buffer(1, 2, 1 << 20, 0, 0);
        s.buffer(0, 1, 1 << 20, 5);
        s.run();
        // Cancelled by its sender after a few steps: the rest goes out empty.
        let t = s.write(0, 1, 0, 2, 0, 1 << 20);
        for _ in 0..(seed % 7) * 5 {
            s.step();
        }
        assert!(s.nodes[0].eng.cancel(t, Code::Cancelled, "client cancelled"));
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Cancelled);
        s.assert_idle();
        // A deadline on the receiving side (a READ into GPU memory).
        s.gpu_buffer(0, 4, 1 << 20, 0, 0);
        s.buffer(1, 5, 1 << 20, 6);
        s.run();
        let spec = ReadSpec {
            peer: P,
            remote: RemoteRange {
                buffer_id: 5,
                access_key: key(5),
                offset: 0,
                length: 1 << 20,
            },
            local_buffer: 4,
            local_offset: 0,
        };
        let r = s.nodes[0]
            .eng
            .start_read(vec![spec], s.now + Duration::from_millis(10), s.now)
            .unwrap();
        for _ in 0..(seed % 5) * 7 {
            s.step();
        }
        s.now += Duration::from_millis(20);
        s.nodes[0].eng.on_tick(s.now);
        s.run();
        assert_eq!(s.outcome(0, r).code, Code::DeadlineExceeded);
        s.assert_idle();
        // Refused (a wrong key): every chunk is consumed without unpacking.
        s.gpu_buffer(1, 6, 1 << 20, 0, 0);
        s.run();
        let spec = WriteSpec {
            local_buffer: 1,
            local_offset: 0,
            peer: P,
            remote: RemoteRange {
                buffer_id: 6,
                access_key: key(99),
                offset: 0,
                length: 300_000,
            },
        };
        let w = s.nodes[0]
            .eng
            .start_write(vec![spec], Vec::new(), s.now + Duration::from_secs(60), s.now)
            .unwrap();
        s.run();
        assert_eq!(s.outcome(0, w).code, Code::PermissionDenied);
        assert!(s.nodes[1].bufs[&6].iter().all(|&b| b == 0), "nothing landed");
        assert_eq!(
            sent(&s, 0).1,
            0,
            "every transfer by credits: {:?}",
            s.nodes[0].eng.peer_counters(P)
        );
        s.assert_idle();
    });
}

#[test]
fn more_chunks_beyond_the_plan_or_for_no_stream_fail_the_pairing() {
    for (msg, want) in [
        (
            PeerMsg::MoreChunks {
                offer_id: 77,
                count: 1,
            },
            "not streaming",
        ),
        (
            PeerMsg::GpuCredits {
                budget_bytes: 1,
                buffer_ids: vec![],
                buffer_gpus: vec![],
            },
            "budget 1 bytes after",
        ),
    ] {
        let mut s = Sim::new(1, gpu_cfg(), 44);
        s.nodes[1].eng.on_message(P, msg, s.now);
        let closed: Vec<String> = std::iter::from_fn(|| s.nodes[1].eng.poll_action())
            .filter_map(|a| match a {
                Action::ClosePeer { reason, .. } => Some(reason),
                _ => None,
            })
            .collect();
        assert!(closed.iter().any(|r| r.contains(want)), "{closed:?}");
    }
    // Beyond the plan: a streamed header's announcement of more chunks than it has.
    let mut s = Sim::new(1, gpu_cfg(), 45);
    s.gpu_buffer(1, 2, 1 << 20, 0, 0);
    s.buffer(0, 1, 1 << 20, 9);
    s.run();
    s.write(0, 1, 0, 2, 0, 1 << 20);
    s.drain();
    let (id, n) = headers(&s.ctrl[1])[0];
    let header = s.ctrl[1].pop_front().unwrap();
    s.nodes[1].eng.on_message(P, header, s.now);
    let more = PeerMsg::MoreChunks {
        offer_id: id,
        count: 257 - n.unwrap(),
    };
    s.nodes[1].eng.on_message(P, more, s.now);
    let closed: Vec<String> = std::iter::from_fn(|| s.nodes[1].eng.poll_action())
        .filter_map(|a| match a {
            Action::ClosePeer { reason, .. } => Some(reason),
            _ => None,
        })
        .collect();
    assert!(
        closed.iter().any(|r| r.contains("of 256 chunks announced")),
        "{closed:?}"
    );
}
