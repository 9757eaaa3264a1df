//! Refusals of block input: malformed index bytes, hostile indices (named, first bad one), a
//! header that disagrees with its list, and random hostile selections that must never plan past
//! a list. The layouts and their planning are `tests.rs`.

use super::tests::{chance, random_list};
use super::*;

use tcpxd_testkit::Rng;

#[test]
fn index_arrays_decode_and_refuse_malformed_bytes() {
    let plain = IndexArray::from_indices(&[5, 6, 7, 9, 2]);
    assert_eq!(plain.iter().collect::<Vec<_>>(), vec![5, 6, 7, 9, 2]);
    let ranges = IndexArray::from_ranges(&[(5, 3), (9, 1), (2, 1)]);
    assert_eq!(ranges.iter().collect::<Vec<_>>(), vec![5, 6, 7, 9, 2]);
    assert_eq!(ranges.count(), 5);
    // Parsing what was packed gives it back.
    for a in [&plain, &ranges] {
        let b = IndexArray::parse(a.encoding(), a.bytes().to_vec(), "x").unwrap();
        assert_eq!(&b, a);
    }
    // compact picks ranges only when they are smaller.
    let long: Vec<u32> = (100..1100).collect();
    assert_eq!(IndexArray::compact(&long).encoding(), IndexEncoding::Ranges);
    assert_eq!(IndexArray::compact(&long).bytes().len(), 8);
    assert_eq!(IndexArray::compact(&[3, 1, 2]).encoding(), IndexEncoding::U32Le);
    assert_eq!(IndexArray::compact(&long).iter().collect::<Vec<_>>(), long);

    let e = IndexArray::parse(IndexEncoding::U32Le, vec![0; 7], "local_indices").unwrap_err();
    assert_eq!(
        e.to_string(),
        "local_indices: 7 bytes are not a whole number of 4-byte indices"
    );
    let e = IndexArray::parse(IndexEncoding::Ranges, vec![0; 12], "remote_indices").unwrap_err();
    assert!(e.to_string().contains("8-byte (start, count) ranges"), "{e}");
    let mut zero = Vec::new();
    zero.extend_from_slice(&4u32.to_le_bytes());
    zero.extend_from_slice(&0u32.to_le_bytes());
    let e = IndexArray::parse(IndexEncoding::Ranges, zero, "r").unwrap_err();
    assert_eq!(e.to_string(), "r: range 0 (4, 0) is empty");
    let mut wrap = Vec::new();
    wrap.extend_from_slice(&u32::MAX.to_le_bytes());
    wrap.extend_from_slice(&2u32.to_le_bytes());
    assert!(IndexArray::parse(IndexEncoding::Ranges, wrap, "r").is_err());
    let e = IndexArray::parse(IndexEncoding::U32Le, vec![], "r").unwrap_err();
    assert_eq!(e.to_string(), "r: at least one block is required");
    // More than the limit, both encodings (ranges stop summing early).
    let mut big = Vec::new();
    for _ in 0..3 {
        big.extend_from_slice(&0u32.to_le_bytes());
        big.extend_from_slice(&(1u32 << 21).to_le_bytes());
    }
    let e = IndexArray::parse(IndexEncoding::Ranges, big, "remote_indices").unwrap_err();
    assert!(
        e.to_string().starts_with("remote_indices: ")
            && e.to_string()
                .ends_with(&format!("exceed the limit of {MAX_TRANSFER_BLOCKS}")),
        "{e}"
    );
    let e = IndexArray::parse(
        IndexEncoding::U32Le,
        vec![0; (MAX_TRANSFER_BLOCKS as usize + 1) * 4],
        "local_indices",
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "local_indices: {} blocks exceed the limit of {MAX_TRANSFER_BLOCKS}",
            MAX_TRANSFER_BLOCKS + 1
        )
    );
    // At the limit: accepted (a transfer of 4,194,304 blocks).
    let at_limit = IndexArray::from_ranges(&[(0, MAX_TRANSFER_BLOCKS as u32)]);
    assert!(IndexArray::parse(IndexEncoding::Ranges, at_limit.bytes().to_vec(), "r").is_ok());
}

#[test]
fn hostile_indices_are_named() {
    let list = BlockList::new(
        5,
        1,
        1 << 20,
        Layout::compact((0..100).map(|i| i * 1000).collect(), &[1000]).unwrap(),
    )
    .unwrap();
    // Past the list, plain and in a range (the flattened position is named).
    let e = SidePlan::build(
        &list,
        &IndexArray::from_indices(&[1, 2, 100, 300]),
        "local_indices",
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "local_indices[2]: block 100 is past the list's 100 blocks"
    );
    let e = IndexArray::from_ranges(&[(0, 10), (95, 10)])
        .check(100, "remote_indices")
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "remote_indices[15]: block 100 is past the list's 100 blocks"
    );
    let e = IndexArray::from_indices(&[0, 99, 4_000_000_000])
        .check(100, "x")
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "x[2]: block 4000000000 is past the list's 100 blocks"
    );
    assert!(IndexArray::from_ranges(&[(90, 10)]).check(100, "x").is_ok());
    // A plan that failed is empty and reusable.
    let mut plan = SidePlan::build(&list, &IndexArray::from_indices(&[1, 2]), "x").unwrap();
    assert!(
        plan.rebuild(&list, &IndexArray::from_indices(&[1, 200]), "x", |_, _, _| Ok(()))
            .is_err()
    );
    assert_eq!((plan.total(), plan.runs().len()), (0, 0));
    plan.rebuild(&list, &IndexArray::from_indices(&[3]), "x", |_, _, _| Ok(()))
        .unwrap();
    assert_eq!(plan.total(), 1000);

    // Count mismatch and length mismatch between the sides.
    let odd = BlockList::new(
        6,
        2,
        1 << 20,
        Layout::compact(vec![0, 5000], &[1000, 999]).unwrap(),
    )
    .unwrap();
    let e = check_pairs(
        (&list, &IndexArray::from_indices(&[0, 1]), "local_indices"),
        (&odd, &IndexArray::from_indices(&[0]), "remote_indices"),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "remote_indices: 1 blocks, but local_indices names 2"
    );
    let e = check_pairs(
        (&list, &IndexArray::from_indices(&[0, 1]), "local_indices"),
        (&odd, &IndexArray::from_indices(&[0, 1]), "remote_indices"),
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "remote_indices[1]: block 1 is 999 bytes, but its partner is 1000 bytes (pairs must be equal in length)"
    );
    // Duplicates on a destination.
    let e = IndexArray::from_indices(&[4, 5, 6, 5])
        .check_distinct(100, "remote_indices")
        .unwrap_err();
    assert_eq!(e.to_string(), "remote_indices[3]: block 5 is already named at 1");
    let e = IndexArray::from_ranges(&[(0, 10), (9, 1)])
        .check_distinct(100, "r")
        .unwrap_err();
    assert_eq!(e.to_string(), "r[10]: block 9 is already named at 9");
    assert!(
        IndexArray::from_ranges(&[(0, 10), (20, 5)])
            .check_distinct(100, "r")
            .is_ok()
    );
}

#[test]
fn a_header_that_disagrees_with_the_list_is_refused() {
    let dst = BlockList::new(
        9,
        3,
        1 << 20,
        Layout::compact(vec![0, 4096, 8192, 20000], &[4096, 4096, 4096, 512]).unwrap(),
    )
    .unwrap();
    let good = BlockHeader {
        list_id: 9,
        access_key: [1; 16],
        indices: IndexArray::from_indices(&[2, 0, 3]),
        lengths: PairLengths::Each(
            [4096u32, 4096, 512]
                .iter()
                .flat_map(|l| l.to_le_bytes())
                .collect(),
        ),
        total: 4096 * 2 + 512,
    };
    let mut plan = SidePlan::default();
    good.validate(&dst, &mut plan).unwrap();
    assert_eq!(plan.total(), good.total);
    let refused = |h: BlockHeader| {
        let mut p = SidePlan::default();
        let e = h.validate(&dst, &mut p).unwrap_err().to_string();
        assert_eq!(
            (p.total(), p.runs().len()),
            (0, 0),
            "nothing planned after a refusal"
        );
        e
    };
    // The segment table would disagree: a length differs.
    let mut h = good.clone();
    h.lengths = PairLengths::Uniform(4096);
    assert_eq!(
        refused(h),
        "indices[2]: block 3 is 512 bytes, but its partner is 4096 bytes (pairs must be equal in length)"
    );
    // The total lies.
    let mut h = good.clone();
    h.total += 1;
    assert_eq!(
        refused(h),
        "total: the header says 8705 bytes, but its 3 blocks hold 8704"
    );
    // Fewer lengths than indices; lengths not whole u32s.
    let mut h = good.clone();
    h.lengths = PairLengths::Each(vec![0; 8]);
    assert_eq!(refused(h), "indices: 3 blocks, but lengths names 2");
    let mut h = good.clone();
    h.lengths = PairLengths::Each(vec![0; 9]);
    assert!(refused(h).starts_with("lengths: 9 bytes"));
    // An index past the list, a block named twice.
    let mut h = good.clone();
    h.indices = IndexArray::from_indices(&[2, 0, 4]);
    assert_eq!(refused(h), "indices[2]: block 4 is past the list's 4 blocks");
    let mut h = good.clone();
    h.indices = IndexArray::from_indices(&[2, 0, 2]);
    assert_eq!(refused(h), "indices[2]: block 2 is already named at 0");
    // Lengths of a uniform selection travel as one number.
    let src = BlockList::new(
        1,
        1,
        1 << 20,
        Layout::compact(vec![0, 4096], &[4096, 100]).unwrap(),
    )
    .unwrap();
    assert_eq!(
        PairLengths::of(&src, &IndexArray::from_indices(&[0, 0]), "l").unwrap(),
        PairLengths::Uniform(4096)
    );
    assert!(matches!(
        PairLengths::of(&src, &IndexArray::from_indices(&[0, 1]), "l").unwrap(),
        PairLengths::Each(b) if b.len() == 8
    ));
    assert!(PairLengths::of(&src, &IndexArray::from_indices(&[2]), "l").is_err());
}

#[test]
fn random_hostile_selections_never_plan_past_a_list() {
    // Random lists and random index bytes: either refused, or every piece lies inside the list's
    // buffer.
    let mut rng = Rng::new(0xDEAD_BEEF);
    for _ in 0..500 {
        let list = random_list(&mut rng, 1, 300);
        let n = 1 + rng.below(50) as usize;
        let bytes: Vec<u8> = (0..n * 4)
            .map(|_| if chance(&mut rng, 80) { 0 } else { rng.next() as u8 })
            .collect();
        let enc = if chance(&mut rng, 50) {
            IndexEncoding::U32Le
        } else {
            IndexEncoding::Ranges
        };
        let Ok(idx) = IndexArray::parse(enc, bytes, "x") else {
            continue;
        };
        let Ok(plan) = SidePlan::build(&list, &idx, "x") else {
            assert!(idx.check(list.len(), "x").is_err());
            continue;
        };
        let chunk = 1 + rng.below(10_000) as u32;
        for k in 0..plan.chunk_count(chunk) {
            for s in plan.chunk(chunk, k) {
                assert!(s.offset + u64::from(s.len) <= list.buffer_len());
            }
        }
    }
}
