//! Checking a prepared transfer's pairs and planning its parts (the module doc above says what
//! they are), and the early first part of a large prepared READ.
//!
//! # The early first part
//! A READ of at least [`EARLY_PART_MIN_PAIRS`] pairs (vLLM's pull: 32,768) would keep its read
//! requests back for the ~1.2 ms the engine takes to check and plan every pair, and the data
//! behind them. Where its lists make every check cheap — both prepared lists' entries of one
//! block count, the local lists of one block length that every remote list (by its token) has
//! too, few enough list pairs and blocks for the parts to stay within the limit —
//! [`Engine::start_read_prepared`] checks all that can fail first: the lists, the pairing, every
//! index in range, and (one pass over the destination side, a bit per block) no destination
//! block named twice. Nothing after can fail but the pairing itself. It then plans only the
//! leading pairs that fall in one group (vLLM's first layer region) and sends that part's read
//! request at once. The other pairs are planned a slice at a time ([`Engine::plan_pending`],
//! called by the driver each pass and by [`Engine::on_tick`]), between which the poller takes
//! the holder's offers for the parts already sent. A group's open part is sent once the pairs
//! move on to another group with [`SEAL_MIN_BLOCKS`] in it (vLLM's: each region's part as soon
//! as its pairs are planned); the ones left open go at the end.
//!
//! # State
//! While planning, the transfer counts one more pending part than it has, so it cannot finish
//! before its last part was sent; its total (pairs × blocks × length) and first progress event
//! are known from the start; its notification is kept once the last part went (with the target's
//! lists it touched). A cancel, a deadline or the pairing failing fails the transfer as any,
//! and drops what was left to plan.

use std::sync::Arc;

use super::dest_bits::{DestBits, DestRange, check_distinct_dests};
use super::*;

/// Pairs a prepared READ must name for its first part to go out before the rest is planned
/// (module doc); smaller transfers are planned whole, in the call that starts them.
pub const EARLY_PART_MIN_PAIRS: usize = 4096;

/// Blocks a group's open part must hold to be sent when the pairs move on to another group.
pub const SEAL_MIN_BLOCKS: u64 = 256;

/// Pairs [`Engine::plan_pending`] plans a call (~0.1 ms on a GPU host's CPU).
const PLAN_SLICE_PAIRS: usize = 4096;

/// The most (local list, remote list) pairs the early path takes (each may leave a part open).
const EARLY_MAX_GROUPS: usize = 4096;

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

/// A prepared READ checked whole whose first part went out, its other pairs still to plan a
/// slice at a time ([`Engine::plan_pending`]).
#[derive(Debug)]
pub(super) struct Planning {
    pub(super) id: TransferId,
    peer: PeerIdx,
    local_idx: Vec<u32>,
    remote_idx: Vec<u32>,
    notification: Vec<u8>,
    deadline_ms: u64,
    /// The next pair to plan, and the entry lookups' hints.
    next: usize,
    near: (usize, usize),
    /// The groups so far (in order of first appearance; each one's last part open unless
    /// `sealed`), by list pair, and the group of the pair before.
    groups: Vec<Group>,
    by_lists: HashMap<(u32, u32), usize>,
    last: Option<((u32, u32), usize)>,
    /// The remote lists the parts sent touched, in order of first appearance.
    touched: Vec<u64>,
    /// What it plans from, its own (a prepared list released meanwhile changes nothing, as
    /// for any transfer started): both sides' entries and lists, the blocks an entry covers.
    local_entries: Arc<PreparedEntries>,
    remote_entries: Arc<PreparedEntries>,
    local_lists: Vec<u64>,
    remote_lists: Vec<RemoteList>,
    count: u32,
}

/// The early part of a READ checked whole (`Engine::plan_early_part`).
pub(super) struct Early {
    spec: BlockSpec,
    plan: block_transfers::LocalBlocks,
    /// The leading pairs it covers, its group, and the transfer's total bytes.
    covered: usize,
    key: (u32, u32),
    total: u64,
    /// The sides it was planned from (`Planning`'s copies) and the blocks an entry covers.
    local_entries: Arc<PreparedEntries>,
    remote_entries: Arc<PreparedEntries>,
    local_lists: Vec<u64>,
    remote_lists: Vec<RemoteList>,
    count: u32,
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
        check_index_pairs(
            (local_id, local_idx, local.entries.len()),
            (remote_id, remote_idx, remote.entries.len()),
        )?;
        Ok(Sides {
            local,
            local_lists,
            remote,
            remote_lists,
            peer,
        })
    }

    /// Checks a large prepared READ whole where its lists make that cheap and plans its early
    /// part (module doc). `None` when the transfer is too small, its lists are not such, or a
    /// pair is bad: the whole plan, made at once, then names it.
    pub(super) fn plan_early_part(
        &self,
        local: (u64, &[u32]),
        remote: (u64, &[u32]),
    ) -> EngineResult<Option<Early>> {
        let n = local.1.len();
        if n < EARLY_PART_MIN_PAIRS {
            return Ok(None);
        }
        let s = self.prepared_sides(local, remote)?;
        // Every pair covers as many blocks on both sides.
        let (Some(count), Some(rc)) = (s.local.uniform_count, s.remote.uniform_count) else {
            return Ok(None);
        };
        // Every local list there, of one block length, which every remote list has (or does
        // not say): no part can meet a missing list or unequal lengths.
        let mut len = None;
        let mut sizes = Vec::with_capacity(s.local_lists.len());
        for &l in s.local_lists {
            let Some(list) = self.lists.get(l) else {
                return Ok(None);
            };
            match (list.uniform_len(), len) {
                (Some(x), None) => len = Some(x),
                (Some(x), Some(y)) if x == y => {}
                _ => return Ok(None),
            }
            sizes.push(list.len());
        }
        let len = len.expect("at least one list");
        let groups = s.local_lists.len() * s.remote_lists.len();
        let blocks = n as u64 * u64::from(count);
        let most_parts = blocks / SEAL_MIN_BLOCKS + blocks / MAX_TRANSFER_BLOCKS + groups as u64 + 1;
        if count != rc
            || s.remote_lists
                .iter()
                .any(|r| r.block_len != 0 && r.block_len != len)
            || groups > EARLY_MAX_GROUPS
            || most_parts > self.cfg.max_entries as u64
        {
            return Ok(None);
        }
        // No destination block named twice: a bit per block of each local list.
        let mut bits = DestBits::new(&sizes, n);
        let mut hint = 0;
        for &li in local.1 {
            let e = s.local.entries.get_near(li, &mut hint).expect("checked in range");
            bits.mark(e.list, e.first, e.count);
        }
        if !bits.distinct() {
            return Ok(None);
        }
        // The leading pairs of one group.
        let mut part = Part::new(64);
        let mut key = None;
        let mut near = (0usize, 0usize);
        let mut covered = 0;
        for (&li, &ri) in local.1.iter().zip(remote.1) {
            let le = s
                .local
                .entries
                .get_near(li, &mut near.0)
                .expect("checked in range");
            let re = s
                .remote
                .entries
                .get_near(ri, &mut near.1)
                .expect("checked in range");
            if *key.get_or_insert((le.list, re.list)) != (le.list, re.list)
                || part.blocks + u64::from(count) > MAX_TRANSFER_BLOCKS
            {
                break;
            }
            part.local.push_range(le.first, count);
            part.remote.push_range(re.first, count);
            part.blocks += u64::from(count);
            covered += 1;
        }
        let Some(key) = key.filter(|_| covered > 0) else {
            return Ok(None);
        };
        let local_list = s.local_lists[key.0 as usize];
        let spec = part_spec(local_list, &s.remote_lists[key.1 as usize], s.peer, part);
        let plan = self.plan_part(&spec, TransferKind::Read)?;
        Ok(Some(Early {
            spec,
            plan,
            covered,
            key,
            total: blocks * u64::from(len),
            local_entries: s.local.entries.clone(),
            remote_entries: s.remote.entries.clone(),
            local_lists: s.local_lists.to_vec(),
            remote_lists: s.remote_lists.to_vec(),
            count,
        }))
    }

    /// Starts a prepared READ checked whole (`plan_early_part`): sends its early part's read
    /// request and leaves the other pairs to [`Engine::plan_pending`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start_early(
        &mut self,
        early: Early,
        local: (u64, &[u32]),
        remote: (u64, &[u32]),
        notification: Vec<u8>,
        deadline: Instant,
        now: Instant,
    ) -> TransferId {
        let id = self.new_transfer(TransferKind::Read, early.total, 1, deadline);
        let deadline_ms = deadline.saturating_duration_since(now).as_millis() as u64;
        let peer = early.spec.peer;
        let touched = vec![early.spec.remote.list_id];
        self.request_block_part(id, early.spec, early.plan, deadline_ms);
        // The pairs still to plan count as a part: the transfer cannot finish before them.
        self.transfers.get_mut(&id).expect("just made").pending_parts += 1;
        self.announce(id, early.total);
        // The early part's group: sealed (its later pairs, if any, start a part of their own).
        let mut by_lists = HashMap::new();
        by_lists.insert(early.key, 0);
        self.prepared.planning.push(Planning {
            id,
            peer,
            local_idx: local.1.to_vec(),
            remote_idx: remote.1.to_vec(),
            notification,
            deadline_ms,
            next: early.covered,
            near: (0, 0),
            groups: vec![Group {
                local: early.key.0,
                remote: early.key.1,
                parts: Vec::new(),
            }],
            by_lists,
            last: Some((early.key, 0)),
            touched,
            local_entries: early.local_entries,
            remote_entries: early.remote_entries,
            local_lists: early.local_lists,
            remote_lists: early.remote_lists,
            count: early.count,
        });
        id
    }

    /// Plans a slice of the pairs prepared READs left after their early part (module doc),
    /// sending each part as it is complete; the last slice sends the parts left open and keeps
    /// the notification. The driver calls it each pass while [`Engine::planning`]; so does
    /// [`Engine::on_tick`]. `true` when there was something to plan.
    pub fn plan_pending(&mut self) -> bool {
        let Some(mut p) = self.prepared.planning.pop() else {
            return false;
        };
        if !self.transfers.contains_key(&p.id) {
            return true; // ended meanwhile
        }
        let count = p.count;
        let end = (p.next + PLAN_SLICE_PAIRS).min(p.local_idx.len());
        // Parts complete in this slice, with their group's (local, remote) list positions.
        let mut sealed: Vec<((u32, u32), Part)> = Vec::new();
        for k in p.next..end {
            let le = p
                .local_entries
                .get_near(p.local_idx[k], &mut p.near.0)
                .expect("checked in range");
            let re = p
                .remote_entries
                .get_near(p.remote_idx[k], &mut p.near.1)
                .expect("checked in range");
            let key = (le.list, re.list);
            let g = match p.last {
                Some((k0, g)) if k0 == key => g,
                prev => {
                    // Moving on: the group left sends its open part once it is large enough.
                    if let Some((k0, g0)) = prev {
                        let grp = &mut p.groups[g0];
                        if grp.parts.last().is_some_and(|q| q.blocks >= SEAL_MIN_BLOCKS) {
                            sealed.push((k0, grp.parts.pop().expect("checked")));
                        }
                    }
                    let g = *p.by_lists.entry(key).or_insert_with(|| {
                        p.groups.push(Group {
                            local: key.0,
                            remote: key.1,
                            parts: Vec::new(),
                        });
                        p.groups.len() - 1
                    });
                    p.last = Some((key, g));
                    g
                }
            };
            let grp = &mut p.groups[g];
            if grp
                .parts
                .last()
                .is_none_or(|q| q.blocks + u64::from(count) > MAX_TRANSFER_BLOCKS)
            {
                if let Some(q) = grp.parts.pop() {
                    sealed.push((key, q));
                }
                grp.parts.push(Part::new(64));
            }
            let q = grp.parts.last_mut().expect("pushed");
            q.local.push_range(le.first, count);
            q.remote.push_range(re.first, count);
            q.blocks += u64::from(count);
        }
        p.next = end;
        let done = end == p.local_idx.len();
        if done {
            for grp in &mut p.groups {
                if let Some(q) = grp.parts.pop() {
                    sealed.push(((grp.local, grp.remote), q));
                }
            }
        }
        for ((l, r), q) in sealed {
            let spec = part_spec(p.local_lists[l as usize], &p.remote_lists[r as usize], p.peer, q);
            if !p.touched.contains(&spec.remote.list_id) {
                p.touched.push(spec.remote.list_id);
            }
            match self.plan_part(&spec, TransferKind::Read) {
                Ok(plan) => self.request_block_part(p.id, spec, plan, p.deadline_ms),
                Err(e) => {
                    // Only the pairing can fail now (checked whole at the start).
                    self.fail_transfer(p.id, e.code, &e.message, None);
                    return true;
                }
            }
        }
        if !done {
            self.prepared.planning.push(p);
            return true;
        }
        if !p.notification.is_empty() {
            self.keep_notice(p.id, p.peer, p.notification, p.touched, Vec::new());
        }
        // The plan's own pending part is done (the parts just sent keep the transfer going).
        self.part_done(p.id);
        true
    }

    /// Transfer `id` failed or was cancelled: what was left to plan of it is dropped.
    pub(crate) fn drop_plan(&mut self, id: TransferId) {
        self.prepared.planning.retain(|p| p.id != id);
    }

    /// Whether a prepared READ has pairs still to plan ([`Engine::plan_pending`]).
    pub fn planning(&self) -> bool {
        !self.prepared.planning.is_empty()
    }

    /// Checks a prepared transfer and plans its parts: the pairing, each part's spec and local
    /// plan, and the remote lists touched (in order of first appearance).
    #[allow(clippy::type_complexity)]
    pub(super) fn plan_prepared(
        &self,
        kind: TransferKind,
        (local_id, local_idx): (u64, &[u32]),
        (remote_id, remote_idx): (u64, &[u32]),
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
        let mut parts = 0usize;
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

/// A transfer's two index arrays over two prepared lists (id, indices, entries of each): as many
/// on each side, 1 to `MAX_PREPARED_ENTRIES`, each naming an entry of its list.
pub(super) fn check_index_pairs(
    (local_id, local_idx, local_entries): (u64, &[u32], usize),
    (remote_id, remote_idx, remote_entries): (u64, &[u32], usize),
) -> EngineResult<()> {
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
    check_indices(local_idx, local_entries, "local_indices", local_id)?;
    check_indices(remote_idx, remote_entries, "remote_indices", remote_id)
}

/// Every index names an entry of the prepared list (`entries` of them); the error names the
/// first that does not.
pub(super) fn check_indices(idx: &[u32], entries: usize, field: &str, id: u64) -> EngineResult<()> {
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
