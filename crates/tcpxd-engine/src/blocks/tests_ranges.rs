//! Planning a part range by range (`SidePlan::rebuild_checked`) against block by block, and the
//! timing of a vLLM-sized part's check and plan.

use super::*;

use tcpxd_testkit::Rng;

/// Timing, not a check (`--ignored --nocapture`): the receiver's check and plan of one part of
/// vLLM's pull through `tcpxd.nixl` (1,024 random descriptors of 4 granules of a 32,768-granule
/// list, as ranges).
#[test]
#[ignore = "timing: prints how long validating a vLLM-sized block header takes"]
fn timing_of_a_vllm_sized_header() {
    let mut rng = Rng::new(5);
    let count = 32_768u32;
    let list = BlockList::new(
        1,
        1,
        u64::from(count) * 4096,
        Layout::Strided {
            first: 0,
            stride: 4096,
            len: 4096,
            count,
        },
    )
    .unwrap();
    let mut d: Vec<u32> = (0..count / 4).collect();
    for i in (1..d.len()).rev() {
        d.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let ranges: Vec<(u32, u32)> = d[..1024].iter().map(|&b| (b * 4, 4)).collect();
    let h = BlockHeader {
        list_id: 1,
        access_key: [0; 16],
        indices: IndexArray::from_ranges(&ranges),
        lengths: PairLengths::Uniform(4096),
        total: 4096 * 4096,
    };
    let mut plan = SidePlan::default();
    for round in 0..5 {
        let t0 = std::time::Instant::now();
        h.validate(&list, &mut plan).unwrap();
        println!(
            "round {round}: validate of 4,096 granules in 1,024 ranges: {:?}",
            t0.elapsed()
        );
    }
}

/// `rebuild_checked` makes the plan `rebuild` makes (runs, total, blocks), on strided lists
/// whose blocks touch or not and on other layouts, from ranges and from single indices; and a
/// range past the list is named as `IndexArray::check` names it.
#[test]
fn planning_checked_ranges_matches_planning_block_by_block() {
    let mut rng = Rng::new(0xC4EC);
    for round in 0..300 {
        let count = 1 + rng.below(500) as u32;
        let len = 1 + rng.below(5000) as u32;
        let layout = match round % 3 {
            0 | 1 => Layout::Strided {
                first: rng.below(100),
                stride: u64::from(len) + if round % 3 == 0 { 0 } else { rng.below(3) },
                len,
                count,
            },
            _ => Layout::Uniform {
                offsets: (0..u64::from(count)).map(|i| i * u64::from(len)).collect(),
                len,
            },
        };
        let list = BlockList::new(1, 1, 200 + u64::from(count) * (u64::from(len) + 2), layout).unwrap();
        let mut ranges = Vec::new();
        for _ in 0..1 + rng.below(40) {
            let start = rng.below(u64::from(count)) as u32;
            let n = 1 + rng.below(u64::from(count - start).min(9)) as u32;
            ranges.push((start, n));
        }
        let flat: Vec<u32> = ranges.iter().flat_map(|&(s, n)| s..s + n).collect();
        for idx in [IndexArray::from_ranges(&ranges), IndexArray::from_indices(&flat)] {
            let mut want = SidePlan::default();
            want.rebuild(&list, &idx, "x", |_, _, _| Ok(())).unwrap();
            let mut got = SidePlan::default();
            got.rebuild_checked(&list, &idx, "x").unwrap();
            assert_eq!(got, want, "round {round}");
        }
    }
    let list = BlockList::new(
        1,
        1,
        1 << 20,
        Layout::Strided {
            first: 0,
            stride: 100,
            len: 100,
            count: 50,
        },
    )
    .unwrap();
    let idx = IndexArray::from_ranges(&[(0, 3), (48, 5)]);
    let mut p = SidePlan::default();
    let e = p.rebuild_checked(&list, &idx, "indices").unwrap_err();
    assert_eq!(e, idx.check(50, "indices").unwrap_err());
    assert_eq!((p.total(), p.blocks(), p.runs().len()), (0, 0, 0));
}

/// Ranges appended one at a time (`IndexArray::push_range`, how a prepared transfer packs its
/// parts) make the array `from_ranges` makes of the same ranges with consecutive ones merged:
/// same bytes, same count, same indices; a range of 0 adds nothing; a merge that would overflow
/// a count starts a new range.
#[test]
fn ranges_pushed_one_at_a_time_pack_as_merged_ranges() {
    let mut rng = Rng::new(0x9A3);
    for round in 0..300 {
        let mut pushed = IndexArray::ranges_with_capacity(rng.below(4) as usize);
        let mut merged: Vec<(u32, u32)> = Vec::new();
        let mut at = rng.below(1000) as u32;
        for _ in 0..rng.below(60) {
            let n = rng.below(5) as u32;
            // Mostly continuing the last range, sometimes a jump back or ahead.
            if rng.below(3) == 0 {
                at = rng.below(5000) as u32;
            }
            pushed.push_range(at, n);
            if n > 0 {
                match merged.last_mut() {
                    Some((s, c)) if *s + *c == at => *c += n,
                    _ => merged.push((at, n)),
                }
            }
            at += n;
        }
        let want = IndexArray::from_ranges(&merged);
        assert_eq!(pushed.bytes(), want.bytes(), "round {round}");
        assert_eq!(pushed.count(), want.count(), "round {round}");
        assert_eq!(pushed.iter().collect::<Vec<_>>(), want.iter().collect::<Vec<_>>());
    }
    let mut a = IndexArray::ranges_with_capacity(1);
    a.push_range(0, u32::MAX);
    a.push_range(u32::MAX, 1);
    assert_eq!(
        a.ranges().unwrap().collect::<Vec<_>>(),
        vec![(0, u32::MAX), (u32::MAX, 1)]
    );
    assert_eq!(a.count(), u64::from(u32::MAX) + 1);
}
