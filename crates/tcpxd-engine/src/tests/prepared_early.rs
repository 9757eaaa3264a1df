//! The early first part of a large prepared READ (`prepared::plan` module doc): checked whole,
//! its first part's read request leaves at once and the other parts follow a slice at a time
//! (`plan_pending`, which the simulator runs between its other events, and `on_tick`); a bad
//! pair anywhere is refused at once; a cancel in between drops the plan; a prepared list
//! released meanwhile changes nothing; pairs that hop between lists still land. Bytes compared
//! through the simulator.

use super::*;
use crate::EARLY_PART_MIN_PAIRS;
use crate::blocks::Layout;

const LISTS: u32 = 4;
const BLOCKS: u32 = 2048;
const LEN: u32 = 64;

/// Four lists a node of 2048 blocks of 64 bytes, each in its own buffer (node 0's zeros, node
/// 1's a pattern); on node 0 a local prepared list of every block (entry l × 2048 + b: list l,
/// block b) and the same over node 1's lists.
struct Early {
    s: Sim,
    local: u64,
    remote: u64,
}

fn early_setup(seed: u64) -> Early {
    let mut s = Sim::new(2, small_chunks(), seed);
    let mut lists = [Vec::new(), Vec::new()];
    for (node, ids) in lists.iter_mut().enumerate() {
        for l in 0..LISTS {
            let id = 10 + u64::from(l) + 100 * node as u64;
            s.buffer(
                node,
                id,
                (BLOCKS * LEN) as usize,
                if node == 1 { 3 + l as u8 } else { 0 },
            );
            let layout = Layout::Strided {
                first: 0,
                stride: u64::from(LEN),
                len: LEN,
                count: BLOCKS,
            };
            ids.push(s.nodes[node].eng.register_blocks(id, layout).unwrap());
        }
    }
    let shape: Vec<PreparedEntry> = (0..LISTS * BLOCKS)
        .map(|e| PreparedEntry {
            list: e / BLOCKS,
            first: e % BLOCKS,
            count: 1,
        })
        .collect();
    let local = s.nodes[0]
        .eng
        .prepare_local(lists[0].clone(), shape.clone())
        .unwrap()
        .id;
    let rl: Vec<RemoteList> = lists[1]
        .iter()
        .map(|&id| {
            let l = s.nodes[1].eng.block_list(id).unwrap();
            RemoteList {
                list_id: id,
                access_key: s.nodes[1].eng.buffer_key(l.buffer()).unwrap(),
                blocks: l.len(),
                block_len: LEN,
            }
        })
        .collect();
    let remote = s.nodes[0].eng.prepare_remote(P, rl, shape).unwrap().id;
    Early { s, local, remote }
}

/// vLLM's pull: per list (region), `per` distinct random blocks on each side, region by region.
fn pull_pairs(s: &mut Sim, per: usize) -> (Vec<u32>, Vec<u32>) {
    let side = |s: &mut Sim| -> Vec<u32> {
        let mut out = Vec::new();
        for l in 0..LISTS {
            let mut b: Vec<u32> = (0..BLOCKS).collect();
            for i in (1..b.len()).rev() {
                b.swap(i, s.rand(i + 1));
            }
            out.extend(b[..per].iter().map(|&x| l * BLOCKS + x));
        }
        out
    };
    (side(s), side(s))
}

/// Node 0 starts a prepared READ of these pairs (deadline a minute away).
fn start(e: &mut Early, local: &[u32], remote: &[u32], note: Vec<u8>) -> EngineResult<TransferId> {
    let (now, dl) = (e.s.now, e.s.now + Duration::from_secs(60));
    e.s.nodes[0]
        .eng
        .start_read_prepared(e.local, local, e.remote, remote, note, dl, now)
}

/// The read requests node 0 sent so far and node 1 has not taken yet.
fn read_requests_sent(s: &mut Sim) -> usize {
    s.drain();
    s.ctrl[1]
        .iter()
        .filter(|m| matches!(m, PeerMsg::ReadRequest { .. }))
        .count()
}

/// Node 0's buffers after each pair's block was read from node 1.
fn expected(e: &Early, local: &[u32], remote: &[u32]) -> HashMap<u64, Vec<u8>> {
    let mut want = e.s.nodes[0].bufs.clone();
    for (&l, &r) in local.iter().zip(remote) {
        let (sb, so) = (110 + u64::from(r / BLOCKS), ((r % BLOCKS) * LEN) as usize);
        let (db, d_off) = (10 + u64::from(l / BLOCKS), ((l % BLOCKS) * LEN) as usize);
        let data = e.s.nodes[1].bufs[&sb][so..][..LEN as usize].to_vec();
        want.get_mut(&db).unwrap()[d_off..][..LEN as usize].copy_from_slice(&data);
    }
    want
}

#[test]
fn a_large_prepared_read_sends_its_first_part_at_once_and_the_rest_once_planned() {
    let per = EARLY_PART_MIN_PAIRS / LISTS as usize;
    for seed in 0..3u64 {
        let mut e = early_setup(40 + seed);
        let (local, remote) = pull_pairs(&mut e.s, per);
        let want = expected(&e, &local, &remote);
        let t = start(&mut e, &local, &remote, b"pulled".to_vec()).unwrap();
        // The first region's part only: its read request, no progress yet.
        e.s.drain();
        let first: Vec<_> = e.s.ctrl[1].iter().cloned().collect();
        assert_eq!(first.len(), 1, "seed {seed}: one read request at once");
        let PeerMsg::ReadRequest { blocks: Some(b), .. } = &first[0] else {
            panic!("seed {seed}: {:?}", first[0]);
        };
        assert_eq!(b.source_indices.count(), per as u64, "the first region's blocks");
        assert!(e.s.nodes[0].eng.planning());
        // The rest: every pair checked, one part per other region.
        assert!(e.s.nodes[0].eng.plan_pending());
        assert!(!e.s.nodes[0].eng.planning());
        assert!(!e.s.nodes[0].eng.plan_pending(), "nothing left");
        e.s.drain();
        let reads = e.s.ctrl[1]
            .iter()
            .filter(|m| matches!(m, PeerMsg::ReadRequest { .. }))
            .count();
        assert_eq!(reads, LISTS as usize, "seed {seed}");
        e.s.run();
        let o = e.s.outcome(0, t);
        assert_eq!(o.code, Code::Ok, "seed {seed}: {}", o.message);
        assert_eq!(o.landed, (per * LISTS as usize) as u64 * u64::from(LEN));
        for (b, data) in &want {
            assert!(e.s.nodes[0].bufs[b] == *data, "seed {seed}: buffer {b} differs");
        }
        assert_eq!(
            e.s.nodes[1].notes,
            vec![(t.0, b"pulled".to_vec())],
            "once, after the data"
        );
        e.s.assert_idle();
    }
}

#[test]
fn planned_a_slice_at_a_time_between_other_events_it_lands_and_a_tick_plans_too() {
    let per = EARLY_PART_MIN_PAIRS / LISTS as usize;
    for seed in 0..4u64 {
        let mut e = early_setup(51 + seed);
        let (local, remote) = pull_pairs(&mut e.s, per);
        let want = expected(&e, &local, &remote);
        let t = start(&mut e, &local, &remote, b"n".to_vec()).unwrap();
        // The simulator plans in its own turn, among messages and completions, in random order.
        e.s.run();
        let o = e.s.outcome(0, t);
        assert_eq!(o.code, Code::Ok, "seed {seed}: {}", o.message);
        for (b, data) in &want {
            assert!(e.s.nodes[0].bufs[b] == *data, "seed {seed}: buffer {b} differs");
        }
        assert_eq!(e.s.nodes[1].notes, vec![(t.0, b"n".to_vec())]);
        e.s.assert_idle();
    }
    // A tick plans a slice too.
    let mut e = early_setup(59);
    let (local, remote) = pull_pairs(&mut e.s, per);
    let t = start(&mut e, &local, &remote, Vec::new()).unwrap();
    assert!(e.s.nodes[0].eng.planning());
    e.s.nodes[0].eng.on_tick(e.s.now);
    assert!(!e.s.nodes[0].eng.planning());
    assert_eq!(read_requests_sent(&mut e.s), LISTS as usize);
    assert!(e.s.nodes[0].eng.cancel(t, Code::Cancelled, "done"));
}

#[test]
fn a_bad_pair_anywhere_is_refused_at_once_naming_it_and_nothing_starts() {
    let per = EARLY_PART_MIN_PAIRS / LISTS as usize;
    let mut e = early_setup(61);
    let (mut local, remote) = pull_pairs(&mut e.s, per);
    // A destination named twice, in the last region.
    let last = local.len() - 1;
    local[last] = local[last - 7];
    let err = start(&mut e, &local, &remote, b"never".to_vec()).unwrap_err();
    assert_eq!(err.code, Code::InvalidArgument);
    assert!(
        err.message.contains(&format!("local_indices[{last}]"))
            && err.message.contains(&format!("local_indices[{}]", last - 7)),
        "{}",
        err.message
    );
    assert_eq!(e.s.nodes[0].eng.active_transfers(), 0);
    assert!(!e.s.nodes[0].eng.planning());
    assert_eq!(read_requests_sent(&mut e.s), 0, "nothing sent");
}

#[test]
fn a_prepared_list_released_while_planning_changes_nothing() {
    let per = EARLY_PART_MIN_PAIRS / LISTS as usize;
    let mut e = early_setup(65);
    let (local, remote) = pull_pairs(&mut e.s, per);
    let want = expected(&e, &local, &remote);
    let t = start(&mut e, &local, &remote, Vec::new()).unwrap();
    e.s.nodes[0].eng.release_prepared(e.local).unwrap();
    e.s.nodes[0].eng.release_prepared(e.remote).unwrap();
    e.s.run();
    assert_eq!(e.s.outcome(0, t).code, Code::Ok, "{}", e.s.outcome(0, t).message);
    for (b, data) in &want {
        assert!(e.s.nodes[0].bufs[b] == *data, "buffer {b} differs");
    }
    e.s.assert_idle();
}

#[test]
fn pairs_hopping_between_lists_land_in_few_parts() {
    for seed in 0..3u64 {
        let mut e = early_setup(75 + seed);
        // Destinations a random permutation of every block; sources random (repeats allowed).
        let n = EARLY_PART_MIN_PAIRS + 1000;
        let mut local: Vec<u32> = (0..LISTS * BLOCKS).collect();
        for i in (1..local.len()).rev() {
            local.swap(i, e.s.rand(i + 1));
        }
        local.truncate(n);
        let remote: Vec<u32> = (0..n)
            .map(|_| e.s.rand((LISTS * BLOCKS) as usize) as u32)
            .collect();
        let want = expected(&e, &local, &remote);
        let t = start(&mut e, &local, &remote, Vec::new()).unwrap();
        while e.s.nodes[0].eng.plan_pending() {}
        let reads = read_requests_sent(&mut e.s);
        // At most one open part per list pair at the end, plus those sealed at 256 blocks.
        let bound = (LISTS * LISTS) as usize + n / crate::SEAL_MIN_BLOCKS as usize + 1;
        assert!(reads <= bound, "seed {seed}: {reads} parts");
        e.s.run();
        let o = e.s.outcome(0, t);
        assert_eq!(o.code, Code::Ok, "seed {seed}: {}", o.message);
        for (b, data) in &want {
            assert!(e.s.nodes[0].bufs[b] == *data, "seed {seed}: buffer {b} differs");
        }
        e.s.assert_idle();
    }
}

#[test]
fn a_cancel_before_the_rest_is_planned_drops_the_plan() {
    let per = EARLY_PART_MIN_PAIRS / LISTS as usize;
    let mut e = early_setup(71);
    let (local, remote) = pull_pairs(&mut e.s, per);
    let before = e.s.nodes[0].bufs.clone();
    let t = start(&mut e, &local, &remote, b"never".to_vec()).unwrap();
    assert!(e.s.nodes[0].eng.cancel(t, Code::Cancelled, "the caller gave up"));
    assert!(!e.s.nodes[0].eng.planning());
    assert!(!e.s.nodes[0].eng.plan_pending());
    e.s.run();
    assert_eq!(e.s.outcome(0, t).code, Code::Cancelled);
    assert!(e.s.nodes[0].bufs == before);
    assert!(e.s.nodes[1].notes.is_empty());
    e.s.assert_idle();
}

#[test]
fn fewer_pairs_or_a_leading_bad_pair_take_the_whole_plan_at_once() {
    let mut e = early_setup(81);
    let (local, remote) = pull_pairs(&mut e.s, EARLY_PART_MIN_PAIRS / LISTS as usize);
    // One pair short of the threshold: planned whole, every read request at once.
    let n = EARLY_PART_MIN_PAIRS - 1;
    let t = start(&mut e, &local[..n], &remote[..n], Vec::new()).unwrap();
    assert!(!e.s.nodes[0].eng.planning());
    assert_eq!(read_requests_sent(&mut e.s), LISTS as usize);
    assert!(e.s.nodes[0].eng.cancel(t, Code::Cancelled, "counted"));
    // A bad pair the early part would cover is refused at once, nothing started.
    let mut bad = local.clone();
    bad[3] = bad[1];
    let before = e.s.nodes[0].eng.active_transfers();
    let err = start(&mut e, &bad, &remote, Vec::new()).unwrap_err();
    assert_eq!(err.code, Code::InvalidArgument);
    assert!(err.message.contains("local_indices[3]"), "{}", err.message);
    assert_eq!(e.s.nodes[0].eng.active_transfers(), before);
}
