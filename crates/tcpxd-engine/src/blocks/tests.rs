//! Property tests of block lists, index arrays and the per-side planner (a seeded generator, no
//! extra dependency): random layouts and selections are moved byte for byte through the gather
//! and segment tables and compared with a per-block copy. Hostile inputs (refused with the first
//! bad index named) are `tests_refusals.rs`.

use super::*;
use crate::ChunkPlan;

use tcpxd_testkit::Rng;

/// True `percent` times in 100.
pub(super) fn chance(rng: &mut Rng, percent: u64) -> bool {
    rng.below(100) < percent
}

/// A random list: blocks of random or equal lengths, laid out in a random order with random gaps,
/// often none (so neighbours merge). Returns the list and the buffer length.
pub(super) fn random_list(rng: &mut Rng, id: u64, max_blocks: u64) -> BlockList {
    let n = 1 + rng.below(max_blocks) as usize;
    let uniform = chance(rng, 50);
    let ulen = 1 + rng.below(5000) as u32;
    let lens: Vec<u32> = (0..n)
        .map(|_| if uniform { ulen } else { 1 + rng.below(9000) as u32 })
        .collect();
    // Place the blocks in a shuffled order so offsets are not always ascending.
    let mut order: Vec<usize> = (0..n).collect();
    if chance(rng, 50) {
        for i in (1..n).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
    }
    let mut offsets = vec![0u64; n];
    let mut at = rng.below(64);
    for &b in &order {
        offsets[b] = at;
        at += u64::from(lens[b]);
        if chance(rng, 40) {
            at += 1 + rng.below(300);
        }
    }
    let buffer_len = at + rng.below(100);
    let lens64: Vec<u64> = lens.iter().map(|&l| u64::from(l)).collect();
    let layout = if uniform && chance(rng, 50) {
        Layout::compact(offsets, &[u64::from(ulen)]).unwrap()
    } else {
        Layout::compact(offsets, &lens64).unwrap()
    };
    BlockList::new(id, 1, buffer_len, layout).unwrap()
}

/// A random selection of `count` indices of a list of `len`: stretches of consecutive blocks
/// (which merge when the blocks are adjacent) and random jumps, repeats allowed (a source).
fn random_indices(rng: &mut Rng, len: u32, count: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(count);
    while out.len() < count {
        let start = rng.below(u64::from(len)) as u32;
        let stretch = (1 + rng.below(6) as u32).min(len - start);
        for i in start..start + stretch {
            if out.len() == count {
                break;
            }
            out.push(i);
        }
    }
    out
}

/// Pairs blocks of equal length from two lists: for each source block picked, a destination
/// block of the same length (lists built with matching length multisets).
fn matching_lists(rng: &mut Rng) -> (BlockList, BlockList) {
    let n = 1 + rng.below(200) as usize;
    let uniform = chance(rng, 40);
    let ulen = 1 + rng.below(6000) as u32;
    let lens: Vec<u32> = (0..n)
        .map(|_| {
            if uniform {
                ulen
            } else {
                [1, 7, 512, 4096, 4097, 16_384, 70_001][rng.below(7) as usize]
            }
        })
        .collect();
    let place = |rng: &mut Rng, lens: &[u32]| -> (Vec<u64>, u64) {
        let n = lens.len();
        let mut order: Vec<usize> = (0..n).collect();
        if chance(rng, 60) {
            for i in (1..n).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
        }
        let mut offsets = vec![0u64; n];
        let mut at = rng.below(4096);
        for &b in &order {
            offsets[b] = at;
            at += u64::from(lens[b]);
            if chance(rng, 30) {
                at += 1 + rng.below(5000);
            }
        }
        (offsets, at + rng.below(64))
    };
    let (so, sl) = place(rng, &lens);
    let (dof, dl) = place(rng, &lens);
    let lens64: Vec<u64> = lens.iter().map(|&l| u64::from(l)).collect();
    let src = BlockList::new(1, 10, sl, Layout::compact(so, &lens64).unwrap()).unwrap();
    let dst = BlockList::new(2, 20, dl, Layout::compact(dof, &lens64).unwrap()).unwrap();
    (src, dst)
}

fn fill(rng: &mut Rng, n: u64) -> Vec<u8> {
    let mut v: Vec<u8> = (0..n.div_ceil(8))
        .flat_map(|_| rng.next().to_le_bytes())
        .collect();
    v.truncate(n as usize);
    v
}

/// Moves a transfer through the tables, chunk by chunk as the lanes would (sender gathers each
/// chunk into a staging slot, receiver scatters the slot per its segment table), and returns the
/// destination.
fn move_by_tables(src_buf: &[u8], dst_buf: &mut [u8], send: &SidePlan, recv: &SidePlan, chunk_bytes: u32) {
    assert_eq!(send.total(), recv.total());
    let mut gather = Vec::new();
    let mut segments = Vec::new();
    let mut staging = vec![0u8; chunk_bytes as usize];
    // The engine's own chunk plan: one range of `total` bytes.
    let chunks: Vec<_> = ChunkPlan::new(&[send.total()], chunk_bytes, 0, 0..3).collect();
    assert_eq!(chunks.len() as u64, send.chunk_count(chunk_bytes));
    for (k, c) in chunks.iter().enumerate() {
        send.chunk_into(chunk_bytes, k as u64, &mut gather);
        recv.chunk_into(chunk_bytes, k as u64, &mut segments);
        for table in [&gather, &segments] {
            // Contiguous in wire order, each piece non-empty, covering exactly the chunk.
            let mut wire = 0u32;
            for s in table.iter() {
                assert_eq!(s.wire, wire, "pieces are contiguous");
                assert!(s.len > 0);
                wire += s.len;
            }
            assert_eq!(wire, c.len, "chunk {k} is covered exactly");
        }
        staging.fill(0xEE);
        for g in &gather {
            let (o, w, l) = (g.offset as usize, g.wire as usize, g.len as usize);
            staging[w..w + l].copy_from_slice(&src_buf[o..o + l]);
        }
        for s in &segments {
            let (o, w, l) = (s.offset as usize, s.wire as usize, s.len as usize);
            dst_buf[o..o + l].copy_from_slice(&staging[w..w + l]);
        }
    }
}

fn copy_per_block(src: &BlockList, si: &[u32], dst: &BlockList, di: &[u32], sb: &[u8], db: &mut [u8]) {
    for (&s, &d) in si.iter().zip(di) {
        let (so, sl) = src.block(s).unwrap();
        let (doff, dl) = dst.block(d).unwrap();
        assert_eq!(sl, dl);
        db[doff as usize..(doff + u64::from(dl)) as usize]
            .copy_from_slice(&sb[so as usize..(so + u64::from(sl)) as usize]);
    }
}

#[test]
fn tables_reproduce_a_per_block_copy_on_random_layouts() {
    let mut rng = Rng::new(0x9E37_79B9_7F4A_7C15);
    for round in 0..150 {
        let (src, dst) = matching_lists(&mut rng);
        // Pick k pairs of equal-length blocks: pair source block s with a destination block of
        // its length, distinct on the destination.
        let n = src.len();
        let count = 1 + rng.below(u64::from(n)) as usize;
        let si = random_indices(&mut rng, n, count);
        // The lists hold the same lengths at the same index (built from one `lens`), so a
        // destination permutation is valid when it keeps lengths: use identity-length pairing by
        // choosing destination indices with the same length as the source pick.
        let mut by_len: std::collections::HashMap<u32, Vec<u32>> = Default::default();
        for d in 0..n {
            by_len.entry(dst.block(d).unwrap().1).or_default().push(d);
        }
        for v in by_len.values_mut() {
            for i in (1..v.len()).rev() {
                v.swap(i, rng.below(i as u64 + 1) as usize);
            }
            if chance(&mut rng, 50) {
                v.sort_unstable(); // ascending: consecutive blocks, more merges
            }
        }
        let mut di = Vec::with_capacity(count);
        let mut si_kept = Vec::with_capacity(count);
        for &s in &si {
            let len = src.block(s).unwrap().1;
            if let Some(d) = by_len.get_mut(&len).and_then(|v| v.pop()) {
                si_kept.push(s);
                di.push(d);
            }
        }
        let sidx = if chance(&mut rng, 50) {
            IndexArray::compact(&si_kept)
        } else {
            IndexArray::from_indices(&si_kept)
        };
        let didx = IndexArray::compact(&di);
        let total = check_pairs((&src, &sidx, "local_indices"), (&dst, &didx, "remote_indices")).unwrap();
        let send = SidePlan::build(&src, &sidx, "local_indices").unwrap();
        // The receiver rebuilds its half from the header alone.
        let header = BlockHeader {
            list_id: dst.id(),
            access_key: [7; 16],
            indices: didx.clone(),
            lengths: PairLengths::of(&src, &sidx, "local_indices").unwrap(),
            total,
        };
        let mut recv = SidePlan::default();
        header.validate(&dst, &mut recv).unwrap();
        assert_eq!(send.total(), total);
        assert!(send.runs().len() as u64 <= send.blocks());
        for plan in [&send, &recv] {
            let cb = 1 + rng.below(70_000) as u32;
            let most = (0..plan.chunk_count(cb))
                .map(|k| plan.chunk(cb, k).count())
                .max()
                .unwrap_or(0);
            assert_eq!(plan.max_chunk_pieces(cb), most);
            let mut slot = vec![Segment::default(); most];
            for k in 0..plan.chunk_count(cb) {
                let n = plan.chunk_to_slice(cb, k, &mut slot).unwrap();
                assert!(slot[..n].iter().copied().eq(plan.chunk(cb, k)));
                if n > 0 {
                    assert_eq!(plan.chunk_to_slice(cb, k, &mut slot[..n - 1]), None);
                }
            }
        }
        let chunk_bytes = [4096u32, 5000, 65536, 524288, 1 + rng.below(20_000) as u32][round % 5];
        let sb = fill(&mut rng, src.buffer_len());
        let mut want = fill(&mut rng, dst.buffer_len());
        let mut got = want.clone();
        copy_per_block(&src, &si_kept, &dst, &di, &sb, &mut want);
        move_by_tables(&sb, &mut got, &send, &recv, chunk_bytes);
        assert!(got == want, "round {round}: bytes differ from a per-block copy");
    }
}

#[test]
fn adjacent_blocks_merge_on_each_side_independently() {
    // Source: blocks 0..4 contiguous. Destination: pairs (0,1) adjacent, then a gap, (2,3)
    // adjacent.
    let src = BlockList::new(
        1,
        1,
        1 << 20,
        Layout::compact(vec![0, 100, 200, 300], &[100]).unwrap(),
    )
    .unwrap();
    let dst = BlockList::new(
        2,
        2,
        1 << 20,
        Layout::compact(vec![1000, 1100, 5000, 5100], &[100]).unwrap(),
    )
    .unwrap();
    let all = IndexArray::from_ranges(&[(0, 4)]);
    let send = SidePlan::build(&src, &all, "s").unwrap();
    let recv = SidePlan::build(&dst, &all, "d").unwrap();
    assert_eq!(send.runs(), &[Run { offset: 0, wire: 0 }]);
    assert_eq!(
        recv.runs(),
        &[
            Run {
                offset: 1000,
                wire: 0
            },
            Run {
                offset: 5000,
                wire: 200
            }
        ]
    );
    // A chunk of 150 bytes splits runs across chunk boundaries.
    let c1: Vec<Segment> = recv.chunk(150, 1).collect();
    assert_eq!(
        c1,
        vec![
            Segment {
                offset: 1150,
                wire: 0,
                len: 50
            },
            Segment {
                offset: 5000,
                wire: 50,
                len: 100
            }
        ]
    );
    let s2: Vec<Segment> = send.chunk(150, 2).collect();
    assert_eq!(
        s2,
        vec![Segment {
            offset: 300,
            wire: 0,
            len: 100
        }]
    );
    assert_eq!(send.chunk(150, 3).count(), 0, "past the last chunk");
    // Reversed order never merges (blocks are adjacent in the buffer but not in wire order).
    let rev = SidePlan::build(&src, &IndexArray::from_indices(&[1, 0]), "s").unwrap();
    assert_eq!(rev.runs().len(), 2);
    // The same block twice on a source is allowed (and not merged).
    let twice = SidePlan::build(&src, &IndexArray::from_indices(&[2, 2]), "s").unwrap();
    assert_eq!(twice.runs().len(), 2);
    assert_eq!(twice.total(), 200);
}

#[test]
fn registration_names_the_first_bad_block() {
    let e = BlockList::new(1, 1, 1000, Layout::compact(vec![0, 500, 950], &[100]).unwrap()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "offsets[2]: offset 950 + length 100 exceeds the buffer's 1000 bytes"
    );
    let e = BlockList::new(1, 1, 1000, Layout::compact(vec![0, 50], &[100, 10]).unwrap()).unwrap_err();
    assert_eq!(e.to_string(), "offsets[1]: block 1 overlaps block 0");
    // Overlap found when the offsets are not in order too.
    let e = BlockList::new(
        1,
        1,
        1000,
        Layout::compact(vec![600, 0, 550], &[100, 10, 60]).unwrap(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("overlaps"), "{e}");
    let e = BlockList::new(1, 1, 1000, Layout::compact(vec![0, 10], &[0, 10]).unwrap()).unwrap_err();
    assert_eq!(e.to_string(), "offsets[0]: a block must be at least 1 byte long");
    let e = BlockList::new(1, 1, 1000, Layout::compact(vec![], &[]).unwrap()).unwrap_err();
    assert!(e.to_string().contains("at least one block"), "{e}");
    let e = Layout::compact(vec![0, 1], &[1, 2, 3]).unwrap_err();
    assert!(
        e.to_string().starts_with("lengths: 3 lengths for 2 offsets"),
        "{e}"
    );
    let e = Layout::compact(vec![0], &[1 << 32]).unwrap_err();
    assert!(
        e.to_string().starts_with("lengths[0]: 4294967296 bytes exceed"),
        "{e}"
    );
    // Strided: checked arithmetically, the last block against the buffer, overflow caught.
    let s = |first, stride, len, count| Layout::Strided {
        first,
        stride,
        len,
        count,
    };
    assert!(BlockList::new(1, 1, 4 << 30, s(0, 4096, 4096, 1 << 20)).is_ok());
    let e = BlockList::new(1, 1, (4 << 30) - 1, s(0, 4096, 4096, 1 << 20)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "offsets[1048575]: offset 4294963200 + length 4096 exceeds the buffer's 4294967295 bytes"
    );
    let e = BlockList::new(1, 1, u64::MAX, s(1, u64::MAX / 2, 1, 4)).unwrap_err();
    assert!(e.to_string().contains("overflows"), "{e}");
    let e = BlockList::new(1, 1, 1 << 40, s(0, 10, 20, 3)).unwrap_err();
    assert!(e.to_string().contains("overlap"), "{e}");
    let e = BlockList::new(1, 1, u64::MAX, s(0, 1, 1, MAX_LIST_BLOCKS + 1)).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "offsets: {} blocks exceed the limit of {MAX_LIST_BLOCKS}",
            MAX_LIST_BLOCKS + 1
        )
    );
}

#[test]
fn layouts_are_compact() {
    let strided = Layout::compact((0..1000).map(|i| 64 + i * 8192).collect(), &[4096]).unwrap();
    assert_eq!(
        strided,
        Layout::Strided {
            first: 64,
            stride: 8192,
            len: 4096,
            count: 1000
        }
    );
    let l = BlockList::new(3, 9, 64 + 1000 * 8192, strided).unwrap();
    assert_eq!(l.storage_bytes(), 0);
    assert_eq!(l.block(999), Some((64 + 999 * 8192, 4096)));
    assert_eq!(l.block(1000), None);
    assert_eq!(
        (l.id(), l.buffer(), l.len(), l.uniform_len()),
        (3, 9, 1000, Some(4096))
    );
    assert!(matches!(
        Layout::compact(vec![0, 9000, 4096], &[4096]).unwrap(),
        Layout::Uniform { .. }
    ));
    assert!(matches!(
        Layout::compact(vec![0, 4096], &[4096, 10]).unwrap(),
        Layout::Explicit { .. }
    ));
}

#[test]
fn a_list_of_a_million_blocks_registers_and_plans() {
    // Explicit offsets (uneven gaps), one length: 8 bytes per block of storage.
    let n = 1u32 << 20;
    let offsets: Vec<u64> = (0..u64::from(n)).map(|i| i * 4096 + i / 3).collect();
    let list = BlockList::new(
        1,
        1,
        u64::from(n) * 4097,
        Layout::compact(offsets, &[4096]).unwrap(),
    )
    .unwrap();
    assert_eq!(list.storage_bytes(), n as usize * 8);
    let idx = IndexArray::from_ranges(&[(0, n)]);
    let plan = SidePlan::build(&list, &idx, "indices").unwrap();
    assert_eq!(plan.blocks(), u64::from(n));
    assert!(plan.runs().len() < n as usize, "blocks without a gap merge");
    assert_eq!(plan.total(), u64::from(n) * 4096);
    let chunks = plan.chunk_count(524288);
    let mut seen = 0u64;
    let mut table = Vec::new();
    for k in 0..chunks {
        plan.chunk_into(524288, k, &mut table);
        seen += table.iter().map(|s| u64::from(s.len)).sum::<u64>();
    }
    assert_eq!(seen, plan.total());
}

#[test]
fn a_million_scattered_blocks_plan_every_chunk() {
    // 1,048,576 scattered 4 KiB blocks on both sides, every chunk's table produced, every block
    // in exactly one piece. The time a block is printed, never asserted (targets are checked by
    // benchmarks: `tcpxctl bench transfer --blocks N`); a release build's is the one to read.
    let n = 1u32 << 20;
    let mut rng = Rng::new(7);
    let mut perm: Vec<u32> = (0..n).collect();
    for i in (1..perm.len()).rev() {
        perm.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let list = BlockList::new(
        1,
        1,
        u64::from(n) * 4096,
        Layout::Strided {
            first: 0,
            stride: 4096,
            len: 4096,
            count: n,
        },
    )
    .unwrap();
    let idx = IndexArray::from_indices(&perm);
    let t = std::time::Instant::now();
    let plan = SidePlan::build(&list, &idx, "indices").unwrap();
    let mut table = Vec::new();
    let (mut pieces, mut covered) = (0usize, 0u64);
    for k in 0..plan.chunk_count(524288) {
        plan.chunk_into(524288, k, &mut table);
        pieces += table.len();
        covered += table.iter().map(|s| u64::from(s.len)).sum::<u64>();
    }
    let per_block = t.elapsed() / n;
    assert!(pieces >= n as usize / 2, "scattered blocks barely merge");
    assert_eq!(plan.total(), u64::from(n) * 4096);
    assert_eq!(covered, plan.total());
    eprintln!("planning: {per_block:?} per block ({pieces} pieces)");
}

#[test]
fn plain_batch_entries_plan_like_blocks() {
    // 65,536 entries of 64 bytes (the batch size the API must take), every other pair adjacent at
    // the source, scattered at the destination; then moved through the tables.
    let n = 65_536u64;
    let src: Vec<(u64, u64)> = (0..n).map(|i| (i * 64 + (i / 2) * 8, 64)).collect();
    let dst: Vec<(u64, u64)> = (0..n).map(|i| (((i * 7919) % n) * 64, 64)).collect();
    let (mut send, mut recv) = (SidePlan::default(), SidePlan::default());
    send.rebuild_ranges(src.iter().copied());
    recv.rebuild_ranges(dst.iter().copied());
    assert_eq!((send.blocks(), send.total()), (n, n * 64));
    assert_eq!(send.runs().len() as u64, n / 2, "pairs of adjacent entries merge");
    let mut rng = Rng::new(3);
    let sb = fill(&mut rng, n * 64 + n * 4);
    let mut want = vec![0u8; (n * 64) as usize];
    let mut got = want.clone();
    for (&(so, l), &(d, _)) in src.iter().zip(&dst) {
        want[d as usize..(d + l) as usize].copy_from_slice(&sb[so as usize..(so + l) as usize]);
    }
    move_by_tables(&sb, &mut got, &send, &recv, 65_536);
    assert!(got == want);
    // Empty and huge entries: a range longer than 4 GiB is one run, cut by the chunks.
    let mut p = SidePlan::default();
    p.rebuild_ranges([(0, 0), (10, 5 << 30), (0, 0)]);
    assert_eq!((p.blocks(), p.total(), p.runs().len()), (3, 5 << 30, 1));
    assert_eq!(
        p.chunk(MAX_CHUNK, 1279).collect::<Vec<_>>(),
        vec![Segment {
            offset: 10 + (5 << 30) - MAX_CHUNK as u64,
            wire: 0,
            len: MAX_CHUNK
        }]
    );
}

const MAX_CHUNK: u32 = crate::MAX_CHUNK_BYTES;

/// The sorting path of `check_distinct` (ranges out of order, indices few against a large list)
/// agrees with the bitmap on random inputs, and a repeat is still named exactly.
#[test]
fn distinct_checks_agree_whichever_path_runs() {
    let mut rng = Rng::new(0x5eed_d157);
    for round in 0..2000 {
        let list_len = if chance(&mut rng, 50) {
            1 << 24
        } else {
            1 + rng.below(5000) as u32
        };
        let n = 1 + rng.below(200) as usize;
        let arr = if chance(&mut rng, 50) {
            let v: Vec<u32> = (0..n).map(|_| rng.below(u64::from(list_len)) as u32).collect();
            IndexArray::from_indices(&v)
        } else {
            let v: Vec<(u32, u32)> = (0..n)
                .map(|_| {
                    let start = rng.below(u64::from(list_len)) as u32;
                    let count = 1 + rng.below(u64::from((list_len - start).min(8))) as u32;
                    (start, count)
                })
                .collect();
            IndexArray::from_ranges(&v)
        };
        let fast = arr.check_distinct(list_len, "i");
        let exact = arr.check_distinct_bitmap(list_len, "i");
        assert_eq!(fast, exact, "round {round}");
    }
}
