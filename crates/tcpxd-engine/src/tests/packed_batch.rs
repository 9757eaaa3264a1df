//! Packed plain batches of one buffer pair (`Engine::start_write_packed`, `start_read_packed`):
//! the arrays carried as they are from the API to the peer's plan. Bytes compared against what
//! each entry must move, at 65,536 entries and with lengths of their own, under every receive
//! protocol; one status for the batch; the refusals naming the field and the limit with nothing
//! changed, on this side and the holder's.

use super::*;

/// Little-endian `u64`s.
fn le(v: impl IntoIterator<Item = u64>) -> Vec<u8> {
    v.into_iter().flat_map(u64::to_le_bytes).collect()
}

/// A packed batch to node 1's buffer `remote`: entry k is (local offset, remote offset, length).
fn batch(local: u64, remote: u64, entries: &[(u64, u64, u64)]) -> PackedBatch {
    let lens: Vec<u64> = entries.iter().map(|e| e.2).collect();
    let uniform = lens.iter().all(|&l| Some(&l) == lens.first());
    PackedBatch {
        local_buffer: local,
        local_offsets: le(entries.iter().map(|e| e.0)),
        peer: P,
        remote: PackedRanges {
            buffer_id: remote,
            access_key: key(remote as u8),
            offsets: le(entries.iter().map(|e| e.1)),
            lengths: if uniform {
                RangeLengths::Uniform(lens.first().copied().unwrap_or(1))
            } else {
                RangeLengths::Each(le(lens))
            },
        },
    }
}

/// A seeded permutation of 0..n.
fn permutation(s: &mut Sim, n: usize) -> Vec<u64> {
    let mut p: Vec<u64> = (0..n as u64).collect();
    for i in (1..n).rev() {
        p.swap(i, s.rand(i + 1));
    }
    p
}

/// What the destination must hold: its old bytes, each entry's source bytes at its destination.
fn expected(src: &[u8], mut dst: Vec<u8>, moves: impl Iterator<Item = (u64, u64, u64)>) -> Vec<u8> {
    for (from, to, len) in moves {
        dst[to as usize..][..len as usize].copy_from_slice(&src[from as usize..][..len as usize]);
    }
    dst
}

const N: usize = DEFAULT_MAX_ENTRIES;
const BLOCK: u64 = 32;

#[test]
fn packed_batches_of_65536_entries_land_byte_exact() {
    every_mode(packed_batches_of_65536_entries_land_byte_exact_in_mode);
}

/// 65,536 entries of 32 bytes, both sides permuted: a WRITE, then a READ back into a third
/// buffer, each byte-exact, with one status and no entry status.
fn packed_batches_of_65536_entries_land_byte_exact_in_mode() {
    let size = N * BLOCK as usize;
    let mut s = Sim::new(3, small_chunks(), 65);
    s.buffer(0, 1, size, 3);
    s.buffer(1, 2, size, 0);
    s.buffer(0, 3, size, 0);
    let (src, dst) = (permutation(&mut s, N), permutation(&mut s, N));
    let entries: Vec<(u64, u64, u64)> = src
        .iter()
        .zip(&dst)
        .map(|(&a, &b)| (a * BLOCK, b * BLOCK, BLOCK))
        .collect();
    let want = expected(&s.nodes[0].bufs[&1], vec![0; size], entries.iter().copied());
    let now = s.now;
    let t = s.nodes[0]
        .eng
        .start_write_packed(
            batch(1, 2, &entries),
            b"b".to_vec(),
            now + Duration::from_secs(60),
            now,
        )
        .unwrap();
    s.run();
    let o = s.outcome(0, t);
    assert_eq!(o.code, Code::Ok, "{}", o.message);
    assert!(o.entries.is_empty(), "one status for the batch");
    assert_eq!(o.landed, size as u64);
    assert!(s.nodes[1].bufs[&2] == want, "the WRITE's destination differs");
    assert_eq!(s.nodes[1].notes.len(), 1, "one notification for the batch");
    s.assert_idle();

    // Back: node 1's buffer 2 (now `want`) read into node 0's buffer 3 by the same pairs
    // reversed, so buffer 3 must equal buffer 1.
    let back: Vec<(u64, u64, u64)> = entries.iter().map(|&(l, r, len)| (l, r, len)).collect();
    let now = s.now;
    let t = s.nodes[0]
        .eng
        .start_read_packed(batch(3, 2, &back), now + Duration::from_secs(60), now)
        .unwrap();
    s.run();
    let o = s.outcome(0, t);
    assert_eq!(o.code, Code::Ok, "{}", o.message);
    assert!(o.entries.is_empty());
    assert!(
        s.nodes[0].bufs[&3] == s.nodes[0].bufs[&1],
        "the READ's destination differs"
    );
    s.assert_idle();
}

#[test]
fn packed_batches_with_lengths_of_their_own_land_byte_exact() {
    every_mode(packed_batches_with_lengths_of_their_own_land_byte_exact_in_mode);
}

/// Entries of 1 to ~9,000 bytes (some longer than a chunk, some adjacent on both sides: merged
/// runs), and a batch of a few entries each longer than a chunk (a place per entry, not
/// coalesced), WRITE and READ.
fn packed_batches_with_lengths_of_their_own_land_byte_exact_in_mode() {
    const SIZE: u64 = 1 << 20;
    for (seed, big) in [(7, false), (8, true)] {
        let mut s = Sim::new(3, small_chunks(), seed);
        s.buffer(0, 1, SIZE as usize, 5);
        s.buffer(1, 2, SIZE as usize, 0);
        s.buffer(0, 3, SIZE as usize, 0);
        // Destinations end to end in a random order of the slots, sources anywhere.
        let n = if big { 6 } else { 700 };
        let lens: Vec<u64> = (0..n)
            .map(|_| {
                if big {
                    9000 + s.rand(4000) as u64
                } else {
                    1 + s.rand(1400) as u64
                }
            })
            .collect();
        let mut at = 0u64;
        let slots: Vec<u64> = lens
            .iter()
            .map(|l| {
                at += l;
                at - l
            })
            .collect();
        let order = permutation(&mut s, n);
        let entries: Vec<(u64, u64, u64)> = order
            .iter()
            .map(|&k| {
                let len = lens[k as usize];
                let src = if k % 3 == 0 {
                    slots[k as usize]
                } else {
                    s.rand((SIZE - len) as usize) as u64
                };
                (src, slots[k as usize], len)
            })
            .collect();
        let want = expected(
            &s.nodes[0].bufs[&1],
            vec![0; SIZE as usize],
            entries.iter().copied(),
        );
        let now = s.now;
        let t = s.nodes[0]
            .eng
            .start_write_packed(
                batch(1, 2, &entries),
                Vec::new(),
                now + Duration::from_secs(60),
                now,
            )
            .unwrap();
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Ok, "{}", s.outcome(0, t).message);
        assert!(s.nodes[1].bufs[&2] == want, "seed {seed}: the WRITE differs");
        s.assert_idle();

        // Read each destination back to where it came from, into buffer 3.
        let want3 = expected(
            &s.nodes[1].bufs[&2],
            vec![0; SIZE as usize],
            entries.iter().map(|&(l, r, len)| (r, l, len)),
        );
        let now = s.now;
        let t = s.nodes[0]
            .eng
            .start_read_packed(batch(3, 2, &entries), now + Duration::from_secs(60), now)
            .unwrap();
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Ok, "{}", s.outcome(0, t).message);
        assert!(s.nodes[0].bufs[&3] == want3, "seed {seed}: the READ differs");
        s.assert_idle();
    }
}

/// Every bad batch is refused naming the field (the API's) and the limit, and nothing changed:
/// no action, no transfer, the buffers unused.
#[test]
fn bad_packed_batches_are_refused_naming_the_field_and_nothing_changes() {
    let mut s = Sim::new(3, small_chunks(), 1);
    s.buffer(0, 1, 4096, 3);
    let ok = || batch(1, 2, &[(0, 0, 100), (100, 4000, 100)]);
    let mut odd = ok();
    odd.local_offsets.push(0);
    let mut fewer = ok();
    fewer.local_offsets.truncate(8);
    let mut unknown = ok();
    unknown.local_buffer = 9;
    let mut no_peer = ok();
    no_peer.peer = PeerIdx(77);
    let cases: Vec<(PackedBatch, &str)> = vec![
        (
            batch(1, 2, &[(0, 0, 100), (4000, 0, 100)]),
            "ranges.local_offsets[1]: 100 bytes from offset 4000 end at 4100, past the end of buffer 1 (4096 bytes; 96 fit there)",
        ),
        (
            batch(1, 2, &[(0, 0, 100), (0, 0, 5000)]),
            "ranges.lengths[1]: 5000 bytes is more than buffer 1 holds (4096 bytes)",
        ),
        (
            batch(1, 2, &[(0, 0, 10), (0, 0, 0)]),
            "ranges.lengths[1]: must be at least 1 byte",
        ),
        (
            batch(1, 2, &[(0, u64::MAX - 5, 10)]),
            "ranges.remote_offsets[0]: 18446744073709551610 + length 10 overflows 64 bits",
        ),
        (odd, "ranges.local_offsets: 17 bytes is not a whole number"),
        (fewer, "ranges.remote_offsets: 2 offsets, but local_offsets has 1"),
        (
            batch(1, 2, &[]),
            "ranges.local_offsets: at least one entry is required",
        ),
        (
            batch(1, 2, &vec![(0, 0, 1); N + 1]),
            "ranges.local_offsets: 65537 entries exceed the limit of 65536",
        ),
        (unknown, "ranges.local_buffer_id: buffer 9 does not exist"),
        (no_peer, "ranges.remote_descriptor: unknown peer"),
    ];
    for (b, want) in cases {
        for read in [false, true] {
            let now = s.now;
            let deadline = now + Duration::from_secs(60);
            let eng = &mut s.nodes[0].eng;
            let e = if read {
                eng.start_read_packed(b.clone(), deadline, now)
            } else {
                eng.start_write_packed(b.clone(), Vec::new(), deadline, now)
            }
            .unwrap_err();
            assert!(e.message.starts_with(want), "{want}: got {}", e.message);
            assert!(eng.poll_action().is_none(), "{want}: an action");
            assert_eq!(eng.active_transfers(), 0, "{want}: a transfer");
            assert_eq!(eng.buffer_users(1), Some(0));
        }
    }
    // The notification's limit, as for entries.
    let now = s.now;
    let e = s.nodes[0]
        .eng
        .start_write_packed(
            ok(),
            vec![0; EngineConfig::default().max_notification + 1],
            now + Duration::from_secs(60),
            now,
        )
        .unwrap_err();
    assert!(e.message.starts_with("notification: "), "{}", e.message);
}

/// The holder checks a packed READ's sources against its buffer: one past it is refused naming
/// the range, the READ fails with that reason and nothing lands.
#[test]
fn a_packed_read_past_the_holders_buffer_fails_naming_the_range() {
    let mut s = Sim::new(3, small_chunks(), 2);
    s.buffer(0, 1, 8192, 0);
    s.buffer(1, 2, 4096, 7);
    let now = s.now;
    let t = s.nodes[0]
        .eng
        .start_read_packed(
            batch(1, 2, &[(0, 0, 64), (64, 4090, 64), (128, 64, 64)]),
            now + Duration::from_secs(60),
            now,
        )
        .unwrap();
    s.run();
    let o = s.outcome(0, t);
    assert_eq!(o.code, Code::InvalidArgument, "{}", o.message);
    assert!(o.message.contains("ranges[1].offset"), "{}", o.message);
    assert!(s.nodes[0].bufs[&1].iter().all(|&b| b == 0), "nothing landed");
    s.assert_idle();
}

/// On a routed pairing (two 8-GPU, 4-NIC nodes) a packed batch is one memory pair: GPU 0 to
/// GPU 5 and back to GPU 6, every byte on that pair's lanes, byte-exact, by rendezvous and by
/// GPU credits.
#[test]
fn a_packed_batch_on_a_routed_pairing_takes_its_memory_pairs_lanes() {
    use crate::topology::Memory;
    const K: u64 = 1024;
    let base = EngineConfig {
        devices: 4,
        lanes_per_device: 2,
        eager_max_bytes: SIM_EAGER_MAX,
        chunk_bytes: 16 * 1024,
        ..small_chunks()
    };
    let credits = EngineConfig {
        protocol: Protocol::Auto,
        eager_lanes: 1,
        gpu_credits: true,
        credit_budget_bytes: 48 * K,
        ..base.clone()
    };
    for (name, c, lanes) in [("rendezvous", base, 8), ("auto, GPU credits", credits, 12)] {
        let mut s = Sim::pair_routed(
            lanes,
            [c.clone(), c],
            9,
            [super::routes::node(8, 4), super::routes::node(8, 4)],
        );
        for (node, id, gpu, fill) in [(0, 1, 0, 3), (1, 11, 5, 0), (0, 4, 6, 0)] {
            s.buffer(node, id, 256 * K as usize, fill);
            s.nodes[node].eng.set_buffer_memory(id, Memory::Gpu(gpu));
        }
        s.run();
        let order = permutation(&mut s, 128);
        let entries: Vec<(u64, u64, u64)> = order
            .iter()
            .enumerate()
            .map(|(k, &slot)| (k as u64 * 2 * K, slot * 2 * K, 2 * K))
            .collect();
        let now = s.now;
        let t = s.nodes[0]
            .eng
            .start_write_packed(
                batch(1, 11, &entries),
                b"n".to_vec(),
                now + Duration::from_secs(60),
                now,
            )
            .unwrap();
        s.run();
        assert_eq!(s.outcome(0, t).code, Code::Ok, "{name}: {:?}", s.outcome(0, t));
        for &(lo, ro, len) in &entries {
            assert!(s.same((0, 1, lo), (1, 11, ro), len), "{name}: {lo} → {ro}");
        }
        let routes = s.nodes[0].eng.peers[&P].routes.as_ref().unwrap();
        let sent = s.nodes[0].eng.peer_counters(P).unwrap().send;
        assert_eq!(sent.iter().map(|l| l.bytes).sum::<u64>(), 256 * K, "{name}");
        for (lane, l) in sent.iter().enumerate() {
            if l.bytes > 0 {
                assert_eq!(
                    routes.send_memory(lane as u32),
                    Some((Memory::Gpu(0), Memory::Gpu(5))),
                    "{name}: send lane {lane}"
                );
            }
        }
        s.assert_idle();

        let now = s.now;
        let r = s.nodes[0]
            .eng
            .start_read_packed(batch(4, 11, &entries), now + Duration::from_secs(60), now)
            .unwrap();
        s.run();
        assert_eq!(
            s.outcome(0, r).code,
            Code::Ok,
            "{name} READ: {:?}",
            s.outcome(0, r)
        );
        for &(lo, ro, len) in &entries {
            assert!(s.same((0, 4, lo), (1, 11, ro), len), "{name} READ: {ro} → {lo}");
        }
        let routes = s.nodes[1].eng.peers[&P].routes.as_ref().unwrap();
        let sent = s.nodes[1].eng.peer_counters(P).unwrap().send;
        assert_eq!(sent.iter().map(|l| l.bytes).sum::<u64>(), 256 * K, "{name} READ");
        for (lane, l) in sent.iter().enumerate() {
            if l.bytes > 0 {
                assert_eq!(
                    routes.send_memory(lane as u32),
                    Some((Memory::Gpu(5), Memory::Gpu(6))),
                    "{name} READ: the holder's send lane {lane}"
                );
            }
        }
        s.assert_idle();
    }
}
