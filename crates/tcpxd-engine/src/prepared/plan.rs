//! Checking a prepared transfer's pairs and planning its parts (the module doc above says what
//! they are), and the early first part of a large prepared READ.
//!
//! # The early first part
//! A READ of at least [`EARLY_PART_MIN_PAIRS`] pairs (vLLM's pull: 32,768) would keep its read
//! requests back for the ~1.2 ms the engine takes to check and plan every pair, and the data
//! behind them. So [`Engine::start_read_prepared`] checks what is cheap (the lists, the peer,
//! the counts, every index in range), plans only the pairs that lead the arrays in one group
//! (vLLM's first layer region: 512 pairs), and sends that part's read request at once; the
//! driver calls [`Engine::plan_pending`] right after sending it, which checks every pair (the
//! early part's among them) and plans the other parts as a whole transfer's are planned.
//!
//! Why nothing changes on bad input all the same: between the two calls the driver runs only
//! the actions (the read request goes out); it takes no command or peer message, and the engine
//! itself finishes the planning first should any message or tick reach it
//! ([`Engine::on_message`], [`Engine::on_tick`]). So no offer of the holder's is accepted before
//! every pair was checked: a pair found bad fails the transfer naming it, the early part's read
//! is cancelled (`CancelRead`), and no byte has landed. While planning, the transfer counts one
//! more pending part than it has, so it cannot finish early; a cancel or deadline drops the plan.

use super::*;

/// Pairs a prepared READ must name for its first part to go out before the rest is planned
/// (module doc); smaller transfers are planned whole, in the call that starts them.
pub const EARLY_PART_MIN_PAIRS: usize = 4096;

/// One part being built: its ranges on both sides (consecutive entries merged), packed as the
/// part's index arrays as they come.
#[derive(Debug)]
struct Part {
    local: IndexArray,
    remote: IndexArray,
    blocks: u64,
}

impl Part {
    /// An empty part with room for `ranges` ranges a side (more grow it).
    fn new(ranges: usize) -> Part {
        Part {
            local: IndexArray::ranges_with_capacity(ranges),
            remote: IndexArray::ranges_with_capacity(ranges),
            blocks: 0,
        }
    }
}

/// The pairs of one (local list, remote list): one part, or more when it holds more than
/// `MAX_TRANSFER_BLOCKS` blocks.
#[derive(Debug)]
struct Group {
    local: u32,
    remote: u32,
    parts: Vec<Part>,
}

/// A destination block range named by pair `at`: (list position, first, count, at).
type DestRange = (u32, u32, u32, usize);

/// A prepared READ whose first part went out before its other pairs were checked and planned
/// ([`Engine::plan_pending`]).
#[derive(Debug)]
pub(super) struct Planning {
    pub(super) id: TransferId,
    local_id: u64,
    local_idx: Vec<u32>,
    remote_id: u64,
    remote_idx: Vec<u32>,
    notification: Vec<u8>,
    deadline_ms: u64,
    /// Pairs the early part covers (the leading ones), the bytes it moves, its remote list.
    skip: usize,
    early_total: u64,
    early_list: u64,
}

/// What a prepared transfer's checks resolve: both prepared lists and their block lists, and
/// the live pairing of the remote lists' node.
struct Sides<'a> {
    local: &'a Prepared,
    local_lists: &'a [u64],
    remote: &'a Prepared,
    remote_lists: &'a [RemoteList],
    peer: PeerIdx,
}

impl Engine {
    /// The checks every prepared transfer passes before a pair is looked at: both lists exist
    /// and are of the right kind, the remote node is paired, the index arrays are of one length
    /// within the limits and name entries that exist.
    fn prepared_sides(
        &self,
        (local_id, local_idx): (u64, &[u32]),
        (remote_id, remote_idx): (u64, &[u32]),
    ) -> EngineResult<Sides<'_>> {
        let local = self.prepared.lists.get(&local_id).ok_or_else(|| {
            EngineError::not_found(format!(
                "local_prepared_id: prepared list {local_id} does not exist"
            ))
        })?;
        let Lists::Local(local_lists) = &local.lists else {
            return Err(EngineError::invalid(format!(
                "local_prepared_id: prepared list {local_id} names another node's lists (it was prepared from remote_tokens)"
            )));
        };
        let remote = self.prepared.lists.get(&remote_id).ok_or_else(|| {
            EngineError::not_found(format!(
                "remote_prepared_id: prepared list {remote_id} does not exist"
            ))
        })?;
        let Lists::Remote {
            node,
            lists: remote_lists,
        } = &remote.lists
        else {
            return Err(EngineError::invalid(format!(
                "remote_prepared_id: prepared list {remote_id} names lists of this node (it was prepared from local_list_ids)"
            )));
        };
        let peer = self.live_peer_of_node("remote_prepared_id", node)?;
        let n = local_idx.len();
        if n == 0 {
            return Err(EngineError::invalid(
                "local_indices: at least one entry is required",
            ));
        }
        if n > MAX_PREPARED_ENTRIES {
            return Err(EngineError::invalid(format!(
                "local_indices: {n} entries exceed the limit of {MAX_PREPARED_ENTRIES}"
            )));
        }
        if remote_idx.len() != n {
            return Err(EngineError::invalid(format!(
                "remote_indices: {} entries, but local_indices names {n}",
                remote_idx.len()
            )));
        }
        check_indices(local_idx, local.entries.len(), "local_indices", local_id)?;
        check_indices(remote_idx, remote.entries.len(), "remote_indices", remote_id)?;
        Ok(Sides {
            local,
            local_lists,
            remote,
            remote_lists,
            peer,
        })
    }

    /// Plans the leading pairs of a large prepared READ that fall in one group, as its early
    /// part (module doc): its spec, local plan and the pairs it covers. `None` when the arrays
    /// are too short for it, the first entry alone is too large for a part, or a pair among
    /// these is bad (the whole plan, made at once, then names it).
    #[allow(clippy::type_complexity)]
    pub(super) fn plan_early_part(
        &self,
        local: (u64, &[u32]),
        remote: (u64, &[u32]),
    ) -> EngineResult<Option<(BlockSpec, block_transfers::LocalBlocks, usize)>> {
        if local.1.len() < EARLY_PART_MIN_PAIRS {
            return Ok(None);
        }
        let s = self.prepared_sides(local, remote)?;
        // A destination block named twice among these pairs is refused now, by the whole plan.
        let sizes: Vec<u32> = s
            .local_lists
            .iter()
            .map(|&l| self.lists.get(l).map_or(0, |l| l.len()))
            .collect();
        let mut bits = DestBits::new(&sizes, local.1.len());
        let mut part = Part::new(64);
        let mut key = None;
        let mut near = (0usize, 0usize);
        let mut covered = 0;
        for (k, (&li, &ri)) in local.1.iter().zip(remote.1).enumerate() {
            let (Some(le), Some(re)) = (
                s.local.entries.get_near(li, &mut near.0),
                s.remote.entries.get_near(ri, &mut near.1),
            ) else {
                break; // checked in range: the full pass names it
            };
            if *key.get_or_insert((le.list, re.list)) != (le.list, re.list)
                || part.blocks + u64::from(le.count) > MAX_TRANSFER_BLOCKS
            {
                break;
            }
            bits.mark(le.list, le.first, le.count);
            if le.count != re.count || !bits.distinct() {
                return Ok(None); // bad here: the whole plan names it, before anything starts
            }
            part.local.push_range(le.first, le.count);
            part.remote.push_range(re.first, re.count);
            part.blocks += u64::from(le.count);
            covered = k + 1;
        }
        let Some((l, r)) = key.filter(|_| covered > 0) else {
            return Ok(None);
        };
        let local_list = live_local_list(self, s.local_lists, l, local.0)?;
        let spec = part_spec(local_list, &s.remote_lists[r as usize], s.peer, part);
        let plan = self.plan_part(&spec, TransferKind::Read)?;
        Ok(Some((spec, plan, covered)))
    }

    /// Starts a prepared READ whose early part is planned (`plan_early_part`): sends that part's
    /// read request and leaves the rest to [`Engine::plan_pending`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start_early(
        &mut self,
        (spec, planned, skip): (BlockSpec, block_transfers::LocalBlocks, usize),
        local: (u64, &[u32]),
        remote: (u64, &[u32]),
        notification: Vec<u8>,
        deadline: Instant,
        now: Instant,
    ) -> TransferId {
        let id = self.new_transfer(TransferKind::Read, 0, 1, deadline);
        let deadline_ms = deadline.saturating_duration_since(now).as_millis() as u64;
        let (early_total, early_list) = (planned.total, spec.remote.list_id);
        self.request_block_part(id, spec, planned, deadline_ms);
        // The plan still to make counts as a part: the transfer cannot finish before it.
        self.transfers.get_mut(&id).expect("just made").pending_parts += 1;
        self.prepared.planning.push(Planning {
            id,
            local_id: local.0,
            local_idx: local.1.to_vec(),
            remote_id: remote.0,
            remote_idx: remote.1.to_vec(),
            notification,
            deadline_ms,
            skip,
            early_total,
            early_list,
        });
        id
    }

    /// Checks and plans what the early parts of prepared READs left (module doc): every pair,
    /// then the other parts' read requests; a pair found bad fails its transfer, naming it. The
    /// driver calls it right after sending the actions of the command that started one; the
    /// engine calls it before any peer message or tick. `true` when there was something to plan.
    pub fn plan_pending(&mut self) -> bool {
        if self.prepared.planning.is_empty() {
            return false;
        }
        for p in std::mem::take(&mut self.prepared.planning) {
            if !self.transfers.contains_key(&p.id) {
                continue; // ended meanwhile
            }
            let planned = self.plan_prepared(
                TransferKind::Read,
                (p.local_id, &p.local_idx),
                (p.remote_id, &p.remote_idx),
                p.skip,
            );
            let (peer, parts, mut touched) = match planned {
                Ok(x) => x,
                Err(e) => {
                    self.fail_transfer(p.id, e.code, &e.message, None);
                    continue;
                }
            };
            if !touched.contains(&p.early_list) {
                touched.insert(0, p.early_list);
            }
            let total = p.early_total + parts.iter().map(|(_, l)| l.total).sum::<u64>();
            if !p.notification.is_empty() {
                self.prepared.notices.insert(
                    p.id,
                    Notice {
                        peer,
                        payload: p.notification,
                        lists: touched,
                    },
                );
            }
            for (spec, planned) in parts {
                self.request_block_part(p.id, spec, planned, p.deadline_ms);
            }
            let t = self.transfers.get_mut(&p.id).expect("checked above");
            t.total = total;
            t.pending_parts -= 1;
            self.announce(p.id, total);
        }
        true
    }

    /// Transfer `id` ended: the rest of its plan is not made.
    pub(in crate::prepared) fn drop_plan_of(&mut self, id: TransferId) {
        self.prepared.planning.retain(|p| p.id != id);
    }

    /// Whether a prepared READ's plan is still to finish ([`Engine::plan_pending`]).
    pub fn planning(&self) -> bool {
        !self.prepared.planning.is_empty()
    }

    /// Checks a prepared transfer and plans its parts: the pairing, each part's spec and local
    /// plan, and the remote lists touched (in order of first appearance). The first `skip`
    /// pairs (an early part's, sent already) are checked with the others but planned into no
    /// part.
    #[allow(clippy::type_complexity)]
    pub(super) fn plan_prepared(
        &self,
        kind: TransferKind,
        (local_id, local_idx): (u64, &[u32]),
        (remote_id, remote_idx): (u64, &[u32]),
        skip: usize,
    ) -> EngineResult<(PeerIdx, Vec<(BlockSpec, block_transfers::LocalBlocks)>, Vec<u64>)> {
        let Sides {
            local,
            local_lists,
            remote,
            remote_lists,
            peer,
        } = self.prepared_sides((local_id, local_idx), (remote_id, remote_idx))?;
        let n = local_idx.len();
        // The destination lists' sizes, where known (ours; another node's from its token, 0 when
        // it did not say): a bit per block then finds a block named twice as the pairs go by.
        let sizes: Vec<u32> = if kind == TransferKind::Write {
            remote_lists.iter().map(|r| r.blocks).collect()
        } else {
            local_lists
                .iter()
                .map(|&l| self.lists.get(l).map_or(0, |l| l.len()))
                .collect()
        };
        let mut bits = DestBits::new(&sizes, n);
        // Group the pairs by (local list, remote list), in order of first appearance.
        let mut groups: Vec<Group> = Vec::new();
        let mut by_lists: HashMap<(u32, u32), usize> = HashMap::new();
        // The early part, if any, counts toward the limit.
        let mut parts = usize::from(skip > 0);
        let mut last: Option<((u32, u32), usize)> = None;
        let mut near = (0usize, 0usize);
        for (k, (&li, &ri)) in local_idx.iter().zip(remote_idx).enumerate() {
            // In range: checked above.
            let (Some(le), Some(re)) = (
                local.entries.get_near(li, &mut near.0),
                remote.entries.get_near(ri, &mut near.1),
            ) else {
                return Err(EngineError::invalid(format!(
                    "local_indices[{k}] / remote_indices[{k}]: entry past its prepared list"
                )));
            };
            if le.count != re.count {
                return Err(EngineError::invalid(format!(
                    "remote_indices[{k}]: entry {ri} of prepared list {remote_id} covers {} blocks, but its partner, entry {li} of prepared list {local_id}, covers {} (pairs must cover as many blocks)",
                    re.count, le.count
                )));
            }
            let dest = if kind == TransferKind::Write { re } else { le };
            bits.mark(dest.list, dest.first, dest.count);
            if k < skip {
                continue; // the early part's: planned and sent already
            }
            // Consecutive pairs mostly share their lists (vLLM names a layer's blocks together):
            // the last group is tried before the map.
            let g = match last {
                Some((key, g)) if key == (le.list, re.list) => g,
                _ => {
                    let g = *by_lists.entry((le.list, re.list)).or_insert_with(|| {
                        groups.push(Group {
                            local: le.list,
                            remote: re.list,
                            parts: Vec::new(),
                        });
                        groups.len() - 1
                    });
                    last = Some(((le.list, re.list), g));
                    g
                }
            };
            let g = &mut groups[g];
            let (mut lf, mut rf, mut left) = (le.first, re.first, le.count);
            while left > 0 {
                if g.parts.last().is_none_or(|p| p.blocks == MAX_TRANSFER_BLOCKS) {
                    parts += 1;
                    if parts > self.cfg.max_entries {
                        return Err(EngineError::invalid(format!(
                            "local_indices: the pairs make more than {} parts (one per local list, remote list and {MAX_TRANSFER_BLOCKS} blocks), the limit of a transfer",
                            self.cfg.max_entries
                        )));
                    }
                    // Grown as ranges come (vLLM's pull: 512 ranges a part).
                    g.parts.push(Part::new(64));
                }
                let p = g.parts.last_mut().expect("pushed");
                let take = (MAX_TRANSFER_BLOCKS - p.blocks).min(u64::from(left)) as u32;
                p.local.push_range(lf, take);
                p.remote.push_range(rf, take);
                p.blocks += u64::from(take);
                lf += take;
                rf += take;
                left -= take;
            }
        }
        if !bits.distinct() {
            // Unknown sizes, too large bitmaps or a block named twice: sort the destination
            // ranges (the pairs were checked above), which names the pairs on failure.
            let (field, dest_idx, entries) = if kind == TransferKind::Write {
                ("remote_indices", remote_idx, &remote.entries)
            } else {
                ("local_indices", local_idx, &local.entries)
            };
            let mut hint = 0;
            let mut dests: Vec<DestRange> = dest_idx
                .iter()
                .enumerate()
                .map(|(k, &i)| {
                    let e = entries.get_near(i, &mut hint).expect("checked above");
                    (e.list, e.first, e.count, k)
                })
                .collect();
            check_distinct_dests(&mut dests, field, dest_idx)?;
        }
        let mut planned = Vec::with_capacity(parts);
        let mut touched = Vec::with_capacity(groups.len());
        for g in groups {
            let local_list = live_local_list(self, local_lists, g.local, local_id)?;
            let r = &remote_lists[g.remote as usize];
            touched.push(r.list_id);
            for p in g.parts {
                let spec = part_spec(local_list, r, peer, p);
                let plan = self.plan_part(&spec, kind)?;
                planned.push((spec, plan));
            }
        }
        Ok((peer, planned, touched))
    }

    /// One part's local plan, its error naming the pair of lists.
    fn plan_part(&self, spec: &BlockSpec, kind: TransferKind) -> EngineResult<block_transfers::LocalBlocks> {
        self.plan_local_blocks(spec, kind == TransferKind::Read, IndexChecks::DoneByCaller)
            .map_err(|e| {
                EngineError::new(
                    e.code,
                    format!(
                        "the pairs of local list {} and remote list {}: {}",
                        spec.local_list, spec.remote.list_id, e.message
                    ),
                )
            })
    }
}

/// The block list at position `pos` of local prepared list `id`, still registered.
fn live_local_list(e: &Engine, lists: &[u64], pos: u32, id: u64) -> EngineResult<u64> {
    let list = lists[pos as usize];
    if e.lists.get(list).is_none() {
        return Err(EngineError::not_found(format!(
            "local_prepared_id: list {list} of prepared list {id} does not exist (released since it was prepared)"
        )));
    }
    Ok(list)
}

/// A part's spec: its local list, the remote list (from its token), the pairing and the ranges.
fn part_spec(local_list: u64, r: &RemoteList, peer: PeerIdx, p: Part) -> BlockSpec {
    BlockSpec {
        local_list,
        local_indices: p.local,
        peer,
        remote: RemoteBlocks {
            list_id: r.list_id,
            access_key: r.access_key,
            blocks: r.blocks,
            block_len: r.block_len,
            indices: p.remote,
        },
    }
}

/// Every index names an entry of the prepared list (`entries` of them); the error names the
/// first that does not.
fn check_indices(idx: &[u32], entries: usize, field: &str, id: u64) -> EngineResult<()> {
    // One compare per index in the loop; the position only on failure.
    let max = idx.iter().copied().max().unwrap_or(0);
    if (max as usize) < entries {
        return Ok(());
    }
    let at = idx
        .iter()
        .position(|&i| i as usize >= entries)
        .expect("some index is past");
    Err(EngineError::invalid(format!(
        "{field}[{at}]: entry {} past the {entries} entries of prepared list {id}",
        idx[at]
    )))
}

/// Whether any destination block is named twice, found by marking each destination list's
/// blocks in a bitmap (by list position) as the pairs go by. It gives up (and the sorting check,
/// [`check_distinct_dests`], decides and names the pairs) when a list's size is unknown, a range
/// lies past it, two overlap, or the bitmaps would be large against the pairs.
struct DestBits<'a> {
    sizes: &'a [u32],
    bits: Vec<Vec<u64>>,
    /// Words the bitmaps may still take: 64 a pair (vLLM's pull: 32 lists of 32,768 granules,
    /// 16,384 words for 32,768 pairs); past that, sorting is the cheaper test.
    budget: usize,
    ok: bool,
}

impl<'a> DestBits<'a> {
    fn new(sizes: &'a [u32], pairs: usize) -> DestBits<'a> {
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
    fn mark(&mut self, list: u32, first: u32, count: u32) {
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
    fn distinct(&self) -> bool {
        self.ok
    }
}

/// No destination block is named twice: the pairs' destination ranges, sorted by list and first
/// block, may not overlap. The error names the later pair of the first overlap found.
fn check_distinct_dests(dests: &mut [DestRange], field: &str, idx: &[u32]) -> EngineResult<()> {
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
mod dest_bits_tests {
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
