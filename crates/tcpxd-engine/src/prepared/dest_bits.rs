//! Finding a destination block named twice among a prepared transfer's pairs: a bit per block
//! as the pairs go by ([`DestBits`]), and the sorting check that decides and names the pairs
//! when the bits cannot ([`check_distinct_dests`]).

use super::*;

/// A destination block range named by pair `at`: (list position, first, count, at).
pub(super) type DestRange = (u32, u32, u32, usize);

/// Whether any destination block is named twice, found by marking each destination list's
/// blocks in a bitmap (by list position) as the pairs go by. It gives up (and the sorting check,
/// [`check_distinct_dests`], decides and names the pairs) when a list's size is unknown, a range
/// lies past it, two overlap, or the bitmaps would be large against the pairs.
pub(super) struct DestBits<'a> {
    sizes: &'a [u32],
    bits: Vec<Vec<u64>>,
    /// Words the bitmaps may still take: 64 a pair (vLLM's pull: 32 lists of 32,768 granules,
    /// 16,384 words for 32,768 pairs); past that, sorting is the cheaper test.
    budget: usize,
    ok: bool,
}

impl<'a> DestBits<'a> {
    pub(super) fn new(sizes: &'a [u32], pairs: usize) -> DestBits<'a> {
        // A prepared list naming more lists than there are pairs is left to the sort.
        let ok = sizes.len() <= pairs;
        DestBits {
            sizes,
            bits: if ok {
                vec![Vec::new(); sizes.len()]
            } else {
                Vec::new()
            },
            budget: pairs.saturating_mul(64),
            ok,
        }
    }

    #[inline]
    pub(super) fn mark(&mut self, list: u32, first: u32, count: u32) {
        if !self.ok {
            return;
        }
        let Some(&size) = self.sizes.get(list as usize) else {
            self.ok = false;
            return;
        };
        let end = u64::from(first) + u64::from(count);
        if size == 0 || end > u64::from(size) {
            self.ok = false;
            return;
        }
        let b = &mut self.bits[list as usize];
        if b.is_empty() {
            let words = (size as usize).div_ceil(64);
            if words > self.budget {
                self.ok = false;
                return;
            }
            self.budget -= words;
            *b = vec![0; words];
        }
        // A word at a time (vLLM's 16 KiB blocks of 4 KiB granules: one mask a pair).
        let mut i = u64::from(first);
        while i < end {
            let (w, lo) = ((i / 64) as usize, i % 64);
            let n = (64 - lo).min(end - i);
            let m = if n == 64 {
                u64::MAX
            } else {
                ((1u64 << n) - 1) << lo
            };
            if b[w] & m != 0 {
                self.ok = false;
                return;
            }
            b[w] |= m;
            i += n;
        }
    }

    /// True when every range was marked and none overlapped.
    pub(super) fn distinct(&self) -> bool {
        self.ok
    }
}

/// No destination block is named twice: the pairs' destination ranges, sorted by list and first
/// block, may not overlap. The error names the later pair of the first overlap found.
pub(super) fn check_distinct_dests(dests: &mut [DestRange], field: &str, idx: &[u32]) -> EngineResult<()> {
    dests.sort_unstable();
    for w in dests.windows(2) {
        let ((l0, f0, c0, k0), (l1, f1, _, k1)) = (w[0], w[1]);
        if l0 == l1 && u64::from(f0) + u64::from(c0) > u64::from(f1) {
            let (first, later) = (k0.min(k1), k0.max(k1));
            return Err(EngineError::invalid(format!(
                "{field}[{later}]: entry {} names blocks that {field}[{first}] (entry {}) names already (a destination may not name a block twice)",
                idx[later], idx[first]
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::DestBits;

    /// The word-at-a-time marking agrees with a bit-by-bit set on ranges that start and end
    /// anywhere in a word, span several, fill one exactly, or overlap an earlier one by one bit.
    #[test]
    fn marks_ranges_across_words_and_finds_every_overlap() {
        let sizes = [1000u32, 200];
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        for round in 0..2000 {
            let mut bits = DestBits::new(&sizes, 64);
            let mut naive = [vec![false; 1000], vec![false; 200]];
            let mut dup = false;
            for _ in 0..(1 + round % 12) {
                let list = next(2) as u32;
                let size = u64::from(sizes[list as usize]);
                let first = next(size) as u32;
                let count = 1 + next((size - u64::from(first)).min(130)) as u32;
                bits.mark(list, first, count);
                for i in first..first + count {
                    let seen = &mut naive[list as usize][i as usize];
                    dup |= *seen;
                    *seen = true;
                }
                assert_eq!(bits.distinct(), !dup, "round {round}: {list} {first}+{count}");
                if dup {
                    break;
                }
            }
        }
        // A whole word, then the next word's first bit, then the last bit of the first again.
        let mut bits = DestBits::new(&sizes, 8);
        bits.mark(0, 64, 64);
        bits.mark(0, 128, 1);
        assert!(bits.distinct());
        bits.mark(0, 127, 1);
        assert!(!bits.distinct());
    }
}
