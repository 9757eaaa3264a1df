//! A prepared list's entries as the engine keeps them: in runs where they follow a stride.
//!
//! A transfer looks up two entries per pair, at random positions of lists that can hold millions
//! (vLLM prepares one entry per block per region: 262,144 a side for 32 layers of 4,096 blocks).
//! Kept flat, 12 bytes each, those lookups missed the CPU's caches: 92 % of the time of starting
//! vLLM's 32,768-pair pull, ~8.7 ms on the 2-core build machine (session 10, `perf annotate`).
//! Such lists are regular: a region's entries are one list, one count, each `first` a stride
//! after the previous. Stored as runs of that shape, a list of 262,144 entries is 64 runs (1.5
//! KiB), and a lookup is a binary search among them. A list that does not compress to at most
//! one run per [`MIN_ENTRIES_PER_RUN`] entries stays flat.

/// One entry of a prepared list: `count` blocks from block `first` of the list at position
/// `list` of the prepared list's lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreparedEntry {
    pub list: u32,
    pub first: u32,
    pub count: u32,
}

/// Runs are kept only when they average at least this many entries.
pub const MIN_ENTRIES_PER_RUN: usize = 8;

/// Entries `start..` of the list, up to the next run's `start`: entry `start + j` is `count`
/// blocks from block `first + j * step` of list position `list`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct EntryRun {
    start: u32,
    list: u32,
    first: u32,
    step: u32,
    count: u32,
}

/// A prepared list's entries (checked before they come here).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedEntries(Repr);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Repr {
    Flat(Vec<PreparedEntry>),
    Runs {
        runs: Vec<EntryRun>,
        len: u32,
        blocks: u64,
    },
}

impl PreparedEntries {
    /// Keeps `entries` in runs when they compress well, else as they are.
    pub fn new(entries: Vec<PreparedEntry>) -> PreparedEntries {
        let runs = runs_of(&entries, entries.len() / MIN_ENTRIES_PER_RUN);
        PreparedEntries(match runs {
            Some(runs) => Repr::Runs {
                runs,
                len: entries.len() as u32,
                blocks: entries.iter().map(|e| u64::from(e.count)).sum(),
            },
            None => Repr::Flat(entries),
        })
    }

    pub fn len(&self) -> usize {
        match &self.0 {
            Repr::Flat(v) => v.len(),
            Repr::Runs { len, .. } => *len as usize,
        }
    }

    /// Blocks all entries cover, summed.
    pub fn blocks(&self) -> u64 {
        match &self.0 {
            Repr::Flat(v) => v.iter().map(|e| u64::from(e.count)).sum(),
            Repr::Runs { blocks, .. } => *blocks,
        }
    }

    /// Entry `i` (`None` past the end).
    #[cfg(test)]
    pub fn get(&self, i: u32) -> Option<PreparedEntry> {
        self.get_near(i, &mut 0)
    }

    /// Entry `i`, looked up from run `*hint` first (a transfer's pairs mostly stay in one run
    /// for a while: no search then); `*hint` is left at `i`'s run.
    #[inline]
    pub fn get_near(&self, i: u32, hint: &mut usize) -> Option<PreparedEntry> {
        match &self.0 {
            Repr::Flat(v) => v.get(i as usize).copied(),
            Repr::Runs { runs, len, .. } => {
                if i >= *len {
                    return None;
                }
                let inside = |k: usize| runs[k].start <= i && runs.get(k + 1).is_none_or(|n| i < n.start);
                if *hint >= runs.len() || !inside(*hint) {
                    *hint = runs.partition_point(|r| r.start <= i) - 1;
                }
                let r = runs[*hint];
                Some(PreparedEntry {
                    list: r.list,
                    first: r.first + (i - r.start) * r.step,
                    count: r.count,
                })
            }
        }
    }

    /// Whether the entries are kept in runs.
    #[cfg(test)]
    pub fn in_runs(&self) -> bool {
        matches!(self.0, Repr::Runs { .. })
    }
}

/// The runs of `entries`, or `None` once there would be more than `most` of them.
fn runs_of(entries: &[PreparedEntry], most: usize) -> Option<Vec<EntryRun>> {
    let mut runs: Vec<EntryRun> = Vec::new();
    // The current run's last entry, and whether its step is fixed yet (a run of one has none).
    let mut last: Option<(PreparedEntry, bool)> = None;
    for (i, &e) in entries.iter().enumerate() {
        let extends = match (last, runs.last_mut()) {
            (Some((prev, fixed)), Some(run))
                if prev.list == e.list && prev.count == e.count && e.first >= prev.first =>
            {
                let step = e.first - prev.first;
                if !fixed {
                    run.step = step;
                    true
                } else {
                    step == run.step
                }
            }
            _ => false,
        };
        if extends {
            last = Some((e, true));
            continue;
        }
        if runs.len() == most {
            return None;
        }
        runs.push(EntryRun {
            start: i as u32,
            list: e.list,
            first: e.first,
            step: 0,
            count: e.count,
        });
        last = Some((e, false));
    }
    Some(runs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tcpxd_testkit::Rng;

    fn e(list: u32, first: u32, count: u32) -> PreparedEntry {
        PreparedEntry { list, first, count }
    }

    #[test]
    fn every_entry_reads_back_whatever_the_shape() {
        let mut rng = Rng::new(0xE17);
        for round in 0..200 {
            let mut v = Vec::new();
            let n = 1 + rng.below(3000) as usize;
            while v.len() < n {
                // Stretches of strided entries, repeats, decreasing and random ones mixed.
                let (list, count) = (rng.below(4) as u32, 1 + rng.below(5) as u32);
                let (mut first, step) = (rng.below(1000) as u32, rng.below(9) as u32);
                for _ in 0..1 + rng.below(if round % 3 == 0 { 3 } else { 400 }) {
                    v.push(e(list, first, count));
                    first = if rng.below(50) == 0 {
                        rng.below(5000) as u32
                    } else {
                        first + step
                    };
                }
            }
            v.truncate(n);
            let p = PreparedEntries::new(v.clone());
            assert_eq!(p.len(), v.len());
            assert_eq!(p.blocks(), v.iter().map(|x| u64::from(x.count)).sum::<u64>());
            let mut hint = 0;
            for (i, want) in v.iter().enumerate() {
                assert_eq!(p.get(i as u32), Some(*want), "round {round}, entry {i}");
                // Near the last one looked up, and anywhere.
                let j = rng.below(v.len() as u64) as u32;
                assert_eq!(
                    p.get_near(j, &mut hint),
                    Some(v[j as usize]),
                    "round {round}, entry {j}"
                );
                assert_eq!(p.get_near(i as u32, &mut hint), Some(*want));
            }
            assert_eq!(p.get(v.len() as u32), None);
        }
    }

    #[test]
    fn vllm_shaped_lists_are_runs_and_irregular_ones_stay_flat() {
        // 32 layers x 2 regions x 4,096 blocks of 4 granules: one run per region.
        let v: Vec<PreparedEntry> = (0..32u32)
            .flat_map(|l| (0..8192u32).map(move |d| e(l, d * 4, 4)))
            .collect();
        let p = PreparedEntries::new(v.clone());
        match &p.0 {
            Repr::Runs { runs, .. } => assert_eq!(runs.len(), 32),
            other => panic!("expected runs, got {other:?}"),
        }
        assert_eq!(p.get(8192 * 5 + 17), Some(e(5, 68, 4)));
        // No two neighbours alike: kept flat.
        let mut rng = Rng::new(3);
        let w: Vec<PreparedEntry> = (0..1000)
            .map(|_| e(0, rng.below(1 << 20) as u32, 1 + rng.below(3) as u32))
            .collect();
        let q = PreparedEntries::new(w.clone());
        assert!(!q.in_runs());
        assert_eq!(q.get(999), Some(w[999]));
    }
}
