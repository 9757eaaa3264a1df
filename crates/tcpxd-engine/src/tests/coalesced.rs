//! Coalesced plain batches: many small entries of one buffer pair cut into chunks as one stream,
//! gathered and scattered by piece (the simulator copies each piece the engine answers).
//! Random scattered batches with merges and entries split across chunk boundaries, under every
//! receive protocol; cancel, deadlines and a failed peer mid-transfer; the refusals.

use super::*;

/// One entry: (local offset, remote offset, length).
type Entry = (u64, u64, u64);

const SRC: u64 = 512 * 1024;
const DST: u64 = 2 * 1024 * 1024;

/// A random batch: destinations never overlap (so the result is defined), sources may; about a
/// third of the entries continue the previous one locally, half where the space allows remotely
/// (runs the plans merge), one in ten is longer than a chunk. The mean stays below a chunk.
fn random_batch(s: &mut Sim, n: usize, dst_at_local: bool) -> Vec<Entry> {
    let mut used: Vec<(u64, u64)> = Vec::new();
    let free = |used: &[(u64, u64)], off: u64, len: u64| {
        off + len <= DST && used.iter().all(|&(o, l)| off + len <= o || o + l <= off)
    };
    let mut out: Vec<Entry> = Vec::new();
    for _ in 0..n {
        let len = if s.rand(10) == 0 {
            4000 + s.rand(9000) as u64
        } else {
            1 + s.rand(2000) as u64
        };
        let loff = match out.last() {
            Some(&(l, _, pl)) if s.rand(3) == 0 && l + pl + len <= SRC => l + pl,
            _ => s.rand((SRC - len) as usize) as u64,
        };
        let mut roff = match out.last() {
            Some(&(_, r, pl)) if s.rand(2) == 0 => r + pl,
            _ => s.rand((DST - len) as usize) as u64,
        };
        while !free(&used, roff, len) {
            roff = s.rand((DST - len) as usize) as u64;
        }
        used.push((roff, len));
        out.push((loff, roff, len));
    }
    if dst_at_local {
        // A READ: the destinations are the reader's (local) side.
        out.iter_mut().for_each(|e| *e = (e.1, e.0, e.2));
    }
    out
}

fn specs(local: u64, remote: u64, entries: &[Entry]) -> Vec<EntrySpec> {
    entries
        .iter()
        .map(|&(loff, roff, len)| EntrySpec {
            local_buffer: local,
            local_offset: loff,
            peer: P,
            remote: RemoteRange {
                buffer_id: remote,
                access_key: key(remote as u8),
                offset: roff,
                length: len,
            },
        })
        .collect()
}

fn write_batch(s: &mut Sim, entries: &[Entry], deadline: Duration) -> TransferId {
    let now = s.now;
    s.nodes[0]
        .eng
        .start_write(specs(1, 2, entries), b"batch".to_vec(), now + deadline, now)
        .unwrap()
}

fn read_batch(s: &mut Sim, entries: &[Entry], deadline: Duration) -> TransferId {
    let now = s.now;
    s.nodes[0]
        .eng
        .start_read(specs(1, 2, entries), now + deadline, now)
        .unwrap()
}

/// What the destination must hold: zeros, each entry's source bytes at its destination.
fn expected(src: &[u8], dst_len: usize, pairs: impl Iterator<Item = (u64, u64, u64)>) -> Vec<u8> {
    let mut want = vec![0u8; dst_len];
    for (from, to, len) in pairs {
        want[to as usize..][..len as usize].copy_from_slice(&src[from as usize..][..len as usize]);
    }
    want
}

/// A WRITE sim: node 0's buffer 1 (the sources), node 1's buffer 2 (zeros).
fn write_sim(seed: u64) -> Sim {
    let mut s = Sim::new(3, small_chunks(), seed);
    s.buffer(0, 1, SRC as usize, 3);
    s.buffer(1, 2, DST as usize, 0);
    s
}

/// A READ sim: node 0 reads into its buffer 1 (zeros) from node 1's buffer 2.
fn read_sim(seed: u64) -> Sim {
    let mut s = Sim::new(3, small_chunks(), seed);
    s.buffer(0, 1, DST as usize, 0);
    s.buffer(1, 2, SRC as usize, 9);
    s
}

#[test]
fn random_coalesced_writes_land_byte_exact() {
    every_mode(random_coalesced_writes_land_byte_exact_in_mode);
}

fn random_coalesced_writes_land_byte_exact_in_mode() {
    let mut pieces = PieceStats::default();
    for seed in 0..6 {
        let mut s = write_sim(100 + seed);
        let n = 2 + s.rand(150);
        let entries = random_batch(&mut s, n, false);
        let want = expected(&s.nodes[0].bufs[&1], DST as usize, entries.iter().copied());
        let t = write_batch(&mut s, &entries, Duration::from_secs(60));
        s.run();
        let o = s.outcome(0, t);
        assert_eq!(o.code, Code::Ok, "{}", o.message);
        assert_eq!(o.entries.len(), n);
        assert_eq!(o.landed, entries.iter().map(|e| e.2).sum::<u64>());
        assert!(
            s.nodes[1].bufs[&2] == want,
            "seed {seed}: the destination differs"
        );
        assert_eq!(s.nodes[1].notes.len(), 1, "one notification for the batch");
        s.assert_idle();
        pieces.gathers += s.nodes[0].pieces.gathers;
        pieces.scatters += s.nodes[1].pieces.scatters + s.nodes[1].pieces.land_scatters;
    }
    assert!(
        pieces.gathers > 0 && pieces.scatters > 0,
        "chunks of several pieces were gathered and scattered: {pieces:?}"
    );
}

#[test]
fn random_coalesced_reads_land_byte_exact() {
    every_mode(random_coalesced_reads_land_byte_exact_in_mode);
}

fn random_coalesced_reads_land_byte_exact_in_mode() {
    let mut pieces = PieceStats::default();
    for seed in 0..6 {
        let mut s = read_sim(200 + seed);
        let n = 2 + s.rand(150);
        // (local = destination, remote = source, len)
        let entries = random_batch(&mut s, n, true);
        let want = expected(
            &s.nodes[1].bufs[&2],
            DST as usize,
            entries.iter().map(|&(l, r, len)| (r, l, len)),
        );
        let t = read_batch(&mut s, &entries, Duration::from_secs(60));
        s.run();
        let o = s.outcome(0, t);
        assert_eq!(o.code, Code::Ok, "{}", o.message);
        assert!(
            s.nodes[0].bufs[&1] == want,
            "seed {seed}: the destination differs"
        );
        s.assert_idle();
        pieces.gathers += s.nodes[1].pieces.gathers;
        pieces.scatters += s.nodes[0].pieces.scatters + s.nodes[0].pieces.land_scatters;
    }
    assert!(pieces.gathers > 0 && pieces.scatters > 0, "{pieces:?}");
}

#[test]
fn entries_adjacent_on_both_sides_move_as_plain_chunks() {
    every_mode(entries_adjacent_on_both_sides_move_as_plain_chunks_in_mode);
}

fn entries_adjacent_on_both_sides_move_as_plain_chunks_in_mode() {
    let mut s = write_sim(300);
    // 40 entries of 1000 bytes, end to end on both sides: one run each side, so every chunk is
    // one piece and nothing is gathered or scattered; 10 chunks of 4096 carry them, not 40.
    let entries: Vec<Entry> = (0..40).map(|i| (i * 1000, 7 + i * 1000, 1000)).collect();
    let want = expected(&s.nodes[0].bufs[&1], DST as usize, entries.iter().copied());
    let t = write_batch(&mut s, &entries, Duration::from_secs(60));
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.nodes[1].bufs[&2] == want);
    let n = &s.nodes;
    assert_eq!(
        (
            n[0].pieces.gathers,
            n[1].pieces.scatters,
            n[1].pieces.land_scatters
        ),
        (0, 0, 0)
    );
    let chunks: u64 = n[0]
        .eng
        .peer_counters(P)
        .unwrap()
        .send
        .iter()
        .map(|l| l.chunks)
        .sum();
    assert_eq!(chunks, 10, "40,000 bytes in chunks of 4096");
    s.assert_idle();
}

#[test]
fn the_largest_batch_of_tiny_scattered_entries_moves_in_few_chunks() {
    // 65,536 entries of 4 bytes, every other word on the sending side, reversed order at the
    // receiver: every chunk is 1,024 pieces on both sides.
    let mut s = Sim::new(2, small_chunks(), 400);
    let n = DEFAULT_MAX_ENTRIES as u64;
    s.buffer(0, 1, (n * 8) as usize, 5);
    s.buffer(1, 2, (n * 4) as usize, 0);
    let entries: Vec<Entry> = (0..n).map(|i| (i * 8, (n - 1 - i) * 4, 4)).collect();
    let want = expected(&s.nodes[0].bufs[&1], (n * 4) as usize, entries.iter().copied());
    let t = write_batch(&mut s, &entries, Duration::from_secs(60));
    s.run();
    assert_eq!(s.outcome(0, t).code, Code::Ok);
    assert!(s.nodes[1].bufs[&2] == want);
    let c = s.nodes[0].eng.peer_counters(P).unwrap();
    assert_eq!(c.send.iter().map(|l| l.chunks).sum::<u64>(), n * 4 / 4096);
    s.assert_idle();
}

/// Starts a random batch (WRITE or READ), lets it run `steps` events, then stops it by `how`;
/// every slot, credit and buffer user comes back on both sides. True when the stop ended it
/// (not its own completion first).
fn stop_midway(read: bool, how: u8, seed: u64) -> bool {
    let mut s = if read { read_sim(seed) } else { write_sim(seed) };
    let n = 40 + s.rand(120);
    let entries = random_batch(&mut s, n, read);
    let deadline = Duration::from_millis(50);
    let t = if read {
        read_batch(&mut s, &entries, deadline)
    } else {
        write_batch(&mut s, &entries, deadline)
    };
    let steps = s.rand(60);
    for _ in 0..steps {
        s.step();
    }
    match how {
        0 => {
            s.nodes[0].eng.cancel(t, Code::Cancelled, "stop");
        }
        1 => {
            let late = s.now + deadline;
            s.nodes[0].eng.on_tick(late);
        }
        _ => {
            for i in 0..2 {
                s.nodes[i].eng.on_peer_failed(P, "lane 0: connection reset");
            }
            s.drain();
            let o = s.outcome(0, t);
            assert_eq!(o.code, Code::Unavailable, "{}", o.message);
            for n in &s.nodes {
                assert!(n.eng.is_idle() && n.eng.lanes_idle());
                assert_eq!(n.eng.posted(), (0, 0));
            }
            for (i, b) in [(0, 1), (1, 2)] {
                assert_eq!(s.nodes[i].eng.buffer_users(b), Some(0));
                s.nodes[i].eng.remove_buffer(b).expect("no user is left");
            }
            return true;
        }
    }
    s.run();
    let o = s.outcome(0, t);
    let want = [Code::Cancelled, Code::DeadlineExceeded][how as usize];
    // A batch can finish before the stop arrives (a short one, many steps).
    assert!(
        o.code == want || o.code == Code::Ok,
        "{:?}: {}",
        o.code,
        o.message
    );
    s.assert_idle();
    o.code == want
}

#[test]
fn cancel_deadline_and_peer_failure_midway_return_every_slot_and_credit() {
    every_mode(cancel_deadline_and_peer_failure_midway_in_mode);
}

fn cancel_deadline_and_peer_failure_midway_in_mode() {
    let mut stopped = [0; 3];
    for seed in 0..4 {
        for read in [false, true] {
            for how in 0..3 {
                stopped[how as usize] += u32::from(stop_midway(read, how, 500 + seed * 10 + u64::from(how)));
            }
        }
    }
    assert!(
        stopped.iter().all(|&n| n >= 4),
        "most stops land midway: {stopped:?}"
    );
}

/// A coalesced offer or header as a peer might send it: two ranges of 1000 bytes.
fn coalesced_offer(buffers: [u64; 2]) -> Offer {
    Offer {
        offer_id: 77,
        read_id: 0,
        chunk_bytes: MIN_CHUNK_BYTES,
        first_lane: 0,
        ranges: buffers
            .iter()
            .enumerate()
            .map(|(i, &b)| RemoteRange {
                buffer_id: b,
                access_key: key(b as u8),
                offset: 1000 * i as u64,
                length: 1000,
            })
            .collect(),
        notification: Vec::new(),
        deadline_ms: 1000,
        blocks: None,
        coalesced: true,
        transfer_id: 0,
        announced: None,
    }
}

#[test]
fn a_coalesced_offer_over_two_buffers_is_refused_naming_the_range() {
    let mut s = Sim::new(1, small_chunks(), 600);
    s.buffer(1, 2, 8192, 0);
    s.buffer(1, 3, 8192, 0);
    s.nodes[1]
        .eng
        .on_message(P, PeerMsg::Offer(coalesced_offer([2, 3])), s.now);
    let mut got = Vec::new();
    while let Some(a) = s.nodes[1].eng.poll_action() {
        got.push(a);
    }
    assert!(
        !got.iter()
            .any(|a| matches!(a, Action::PostRecv { .. } | Action::PostScatterRecv { .. })),
        "nothing is posted: {got:?}"
    );
    let reject = got.iter().find_map(|a| match a {
        Action::Control {
            msg:
                PeerMsg::Reject {
                    offer_id: 77,
                    code,
                    message,
                    range_index,
                },
            ..
        } => Some((*code, message.clone(), *range_index)),
        _ => None,
    });
    let (code, message, range_index) = reject.expect("a Reject");
    assert_eq!((code, range_index), (Code::InvalidArgument, 1));
    assert!(
        message.starts_with("ranges[1].buffer_id: a coalesced offer's ranges must lie in one buffer"),
        "{message}"
    );
    for b in [2, 3] {
        assert_eq!(s.nodes[1].eng.buffer_users(b), Some(0));
    }
    // The pairing goes on: a good coalesced offer over one buffer is accepted.
    s.nodes[1]
        .eng
        .on_message(P, PeerMsg::Offer(coalesced_offer([2, 2])), s.now);
    let accepted = std::iter::from_fn(|| s.nodes[1].eng.poll_action()).any(|a| {
        matches!(
            a,
            Action::Control {
                msg: PeerMsg::Accept {
                    offer_id: 77,
                    first_lane: None
                },
                ..
            }
        )
    });
    assert!(accepted, "a good offer is accepted");
}

#[test]
fn a_coalesced_header_over_two_buffers_is_consumed_without_landing() {
    let cfg = EngineConfig {
        protocol: Protocol::Eager,
        ..small_chunks()
    };
    let mut eng = Engine::new(cfg);
    eng.add_buffer(2, 8192, key(2)).unwrap();
    eng.add_buffer(3, 8192, key(3)).unwrap();
    let p = eng.add_peer("node-a", 1, 1);
    eng.on_lane_ready(p, 0, true);
    eng.on_lane_ready(p, 0, false);
    rendezvous_peer(&mut eng, p);
    let now = Instant::now();
    eng.on_message(p, PeerMsg::Header(coalesced_offer([2, 3])), now);
    let actions: Vec<Action> = std::iter::from_fn(|| eng.poll_action()).collect();
    assert!(
        actions.iter().any(|a| matches!(a,
            Action::Control { msg: PeerMsg::Reject { offer_id: 77, range_index: 1, message, .. }, .. }
                if message.contains("must lie in one buffer"))),
        "{actions:?}"
    );
    // Its one chunk (2000 bytes) arrives and is consumed without landing; the credit goes back.
    eng.on_recv_landed(p, 0, now);
    let land: Vec<Action> = std::iter::from_fn(|| eng.poll_action()).collect();
    assert_eq!(
        land,
        [Action::Land {
            peer: p,
            lane: 0,
            buffer: None,
            offset: 0,
            len: 2000
        }]
    );
    eng.on_recv_consumed(p, 0, Ok(()));
    let after: Vec<Action> = std::iter::from_fn(|| eng.poll_action()).collect();
    assert!(
        after.iter().any(
            |a| matches!(a, Action::Control { msg: PeerMsg::Credits { returned }, .. } if *returned == ReturnedCredits::from_counts(&[1]))
        ),
        "{after:?}"
    );
    assert!(eng.is_idle());
    assert_eq!((eng.buffer_users(2), eng.buffer_users(3)), (Some(0), Some(0)));
}

#[test]
fn a_batch_of_one_status_moves_the_same_bytes_and_reports_no_entries() {
    // A plain batch started with `report_one_status` (the API's packed ranges): the same plan and
    // bytes as any batch, an outcome without per-entry statuses, OK or failed.
    for read in [false, true] {
        let mut s = if read { read_sim(700) } else { write_sim(700) };
        let entries = random_batch(&mut s, 120, read);
        let want = if read {
            expected(
                &s.nodes[1].bufs[&2],
                DST as usize,
                entries.iter().map(|&(l, r, len)| (r, l, len)),
            )
        } else {
            expected(&s.nodes[0].bufs[&1], DST as usize, entries.iter().copied())
        };
        let t = if read {
            read_batch(&mut s, &entries, Duration::from_secs(60))
        } else {
            write_batch(&mut s, &entries, Duration::from_secs(60))
        };
        s.nodes[0].eng.report_one_status(t);
        s.run();
        let o = s.outcome(0, t);
        assert_eq!(o.code, Code::Ok, "{}", o.message);
        assert!(o.entries.is_empty(), "{} entry statuses", o.entries.len());
        assert_eq!(o.landed, entries.iter().map(|e| e.2).sum::<u64>());
        let got = if read {
            &s.nodes[0].bufs[&1]
        } else {
            &s.nodes[1].bufs[&2]
        };
        assert!(*got == want, "read {read}: the destination differs");
        s.assert_idle();
    }
    // Cancelled before a step: failed, still no entries, everything back.
    let mut s = write_sim(701);
    let entries = random_batch(&mut s, 60, false);
    let t = write_batch(&mut s, &entries, Duration::from_secs(60));
    s.nodes[0].eng.report_one_status(t);
    s.nodes[0].eng.cancel(t, Code::Cancelled, "stop");
    s.run();
    let o = s.outcome(0, t);
    assert_eq!(o.code, Code::Cancelled, "{}", o.message);
    assert!(o.entries.is_empty());
    s.assert_idle();
}
