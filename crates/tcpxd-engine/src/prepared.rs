//! Prepared lists (docs/BLOCKS.md, "Prepared lists"): what NIXL calls a prepared descriptor
//! list, held here so that a transfer names entries by index and nothing else.
//!
//! - A prepared list is a sequence of entries, each a range of blocks `(first, count)` of one
//!   block list: all lists of this node, or all lists of one other node (from their tokens). Every
//!   entry is checked once when the list is prepared, never again per transfer.
//! - A transfer names a local prepared list and a remote one and two arrays of entry indices of
//!   equal length; pair k copies the blocks of local entry `local[k]` to (WRITE) or from (READ)
//!   those of remote entry `remote[k]`, and must cover as many blocks.
//! - **Grouping.** The pairs are grouped by (local list, remote list), groups in order of first
//!   appearance; each group's blocks, consecutive entries merged, become the `(start, count)`
//!   index arrays of one block part, a block offer (WRITE) or block read request (READ) exactly as
//!   [`Engine::start_write_blocks`] / [`Engine::start_read_blocks`] make them, all parts of ONE
//!   transfer. A group of more than [`MAX_TRANSFER_BLOCKS`] blocks is split. Every part is planned
//!   and checked before any is made: on error nothing changed.
//! - **Notification.** A WRITE of one part carries it on its offer, as any block WRITE. Otherwise
//!   (a WRITE of several parts, any READ) it is kept here and, once every part finished OK, sent
//!   to the peer as [`PeerMsg::Notify`] (with the target's lists the transfer touched), just
//!   before the transfer finishes; on failure or cancel it is dropped. Ordering: a WRITE part
//!   finishes only on the receiver's `Done`, which it sends after the part's data landed, and the
//!   control stream is one ordered stream, so the target reads `Notify` after every byte landed;
//!   for a READ the data landed here before `Notify` is sent.

use std::collections::{HashMap, HashSet};

use super::block_transfers::IndexChecks;
use super::blocks::{IndexArray, MAX_LIST_BLOCKS, MAX_TRANSFER_BLOCKS};
use super::prepared_entries::PreparedEntries;
use super::*;

/// The most entries one prepared list holds, and the most pairs one prepared transfer names.
pub const MAX_PREPARED_ENTRIES: usize = 1 << 22;
/// The most prepared lists a node keeps at once.
pub const MAX_PREPARED: usize = 65_536;
/// The most block lists one prepared list names.
pub const MAX_PREPARED_LISTS: usize = 65_536;

/// One entry of a prepared list: `count` blocks from block `first` of the list at position
/// `list` of the prepared list's lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreparedEntry {
    pub list: u32,
    pub first: u32,
    pub count: u32,
}

/// A block list of another node, from its token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteList {
    pub list_id: u64,
    pub access_key: [u8; 16],
    /// Blocks in the list (the token's count; 0: unknown, checked by the peer only).
    pub blocks: u32,
    /// Its block length when all are equal (the token's), else 0.
    pub block_len: u32,
}

/// What preparing a list answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreparedInfo {
    pub id: u64,
    pub entries: u32,
    /// Blocks all entries cover, summed.
    pub blocks: u64,
}

#[derive(Debug)]
enum Lists {
    Local(Vec<u64>),
    Remote { node: String, lists: Vec<RemoteList> },
}

#[derive(Debug)]
struct Prepared {
    lists: Lists,
    entries: PreparedEntries,
}

/// A notification kept until every part of its transfer finished.
#[derive(Debug)]
struct Notice {
    peer: PeerIdx,
    payload: Vec<u8>,
    lists: Vec<u64>,
}

/// The prepared lists of a node, and the notifications of its prepared transfers in flight.
#[derive(Debug, Default)]
pub(super) struct PreparedRegistry {
    lists: HashMap<u64, Prepared>,
    next_id: u64,
    notices: HashMap<TransferId, Notice>,
}

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

impl Engine {
    /// Prepares a list over block lists of this node (`lists`, by id); returns its id (never
    /// reused). Each entry is checked here once, the error naming the first bad one.
    pub fn prepare_local(
        &mut self,
        lists: Vec<u64>,
        entries: Vec<PreparedEntry>,
    ) -> EngineResult<PreparedInfo> {
        self.check_prepared_room()?;
        check_list_count(lists.len(), "local_list_ids")?;
        let mut lens = Vec::with_capacity(lists.len());
        let mut seen: HashMap<u64, usize> = HashMap::with_capacity(lists.len());
        for (i, &id) in lists.iter().enumerate() {
            let list = self.lists.get(id).ok_or_else(|| {
                EngineError::not_found(format!("local_list_ids[{i}]: list {id} does not exist"))
            })?;
            if let Some(j) = seen.insert(id, i) {
                return Err(EngineError::invalid(format!(
                    "local_list_ids[{i}]: list {id} is named already at local_list_ids[{j}]"
                )));
            }
            lens.push(list.len());
        }
        let blocks = check_prepared_entries(&entries, &lens, |p| lists[p])?;
        Ok(self.insert_prepared(Lists::Local(lists), entries, blocks))
    }

    /// Prepares a list over block lists of the node of pairing `peer` (from their tokens).
    pub fn prepare_remote(
        &mut self,
        peer: PeerIdx,
        lists: Vec<RemoteList>,
        entries: Vec<PreparedEntry>,
    ) -> EngineResult<PreparedInfo> {
        self.check_prepared_room()?;
        let node = self.live_peer("remote_tokens", peer)?.node_id.clone();
        check_list_count(lists.len(), "remote_tokens")?;
        let mut seen: HashMap<u64, usize> = HashMap::with_capacity(lists.len());
        for (i, l) in lists.iter().enumerate() {
            if let Some(j) = seen.insert(l.list_id, i) {
                return Err(EngineError::invalid(format!(
                    "remote_tokens[{i}]: list {} is named already at remote_tokens[{j}]",
                    l.list_id
                )));
            }
        }
        let lens: Vec<u32> = lists.iter().map(|l| l.blocks).collect();
        let blocks = check_prepared_entries(&entries, &lens, |p| lists[p].list_id)?;
        Ok(self.insert_prepared(Lists::Remote { node, lists }, entries, blocks))
    }

    /// Releases a prepared list. Transfers already started keep their plans.
    pub fn release_prepared(&mut self, id: u64) -> EngineResult<()> {
        match self.prepared.lists.remove(&id) {
            Some(_) => Ok(()),
            None => Err(EngineError::not_found(format!(
                "prepared_id: prepared list {id} does not exist"
            ))),
        }
    }

    /// The bytes a transfer not yet finished moves.
    pub fn transfer_total(&self, id: TransferId) -> Option<u64> {
        self.transfers.get(&id).map(|t| t.total)
    }

    /// Prepared lists kept.
    pub fn prepared_lists(&self) -> usize {
        self.prepared.lists.len()
    }

    /// A prepared list's entries and blocks (`None` when unknown).
    pub fn prepared_info(&self, id: u64) -> Option<PreparedInfo> {
        let p = self.prepared.lists.get(&id)?;
        Some(PreparedInfo {
            id,
            entries: p.entries.len() as u32,
            blocks: p.entries.blocks(),
        })
    }

    fn check_prepared_room(&self) -> EngineResult<()> {
        if self.prepared.lists.len() >= MAX_PREPARED {
            return Err(EngineError::new(
                Code::ResourceExhausted,
                format!(
                    "prepared: {MAX_PREPARED} prepared lists exist already (the limit); release one first"
                ),
            ));
        }
        Ok(())
    }

    fn insert_prepared(&mut self, lists: Lists, entries: Vec<PreparedEntry>, blocks: u64) -> PreparedInfo {
        self.prepared.next_id += 1;
        let id = self.prepared.next_id;
        let info = PreparedInfo {
            id,
            entries: entries.len() as u32,
            blocks,
        };
        let entries = PreparedEntries::new(entries);
        self.prepared.lists.insert(id, Prepared { lists, entries });
        info
    }

    /// Starts a WRITE by prepared entries: local entry `local_idx[k]` into remote entry
    /// `remote_idx[k]`, as one transfer. Everything is checked and every part planned before
    /// any offer is made: on error nothing changed.
    #[allow(clippy::too_many_arguments)]
    pub fn start_write_prepared(
        &mut self,
        local_id: u64,
        local_idx: &[u32],
        remote_id: u64,
        remote_idx: &[u32],
        notification: Vec<u8>,
        deadline: Instant,
        now: Instant,
    ) -> EngineResult<TransferId> {
        self.start_prepared(
            TransferKind::Write,
            (local_id, local_idx),
            (remote_id, remote_idx),
            notification,
            deadline,
            now,
        )
    }

    /// Starts a READ by prepared entries: remote entry `remote_idx[k]` into local entry
    /// `local_idx[k]`. Its notification, if any, goes to the peer once every byte landed here.
    #[allow(clippy::too_many_arguments)]
    pub fn start_read_prepared(
        &mut self,
        local_id: u64,
        local_idx: &[u32],
        remote_id: u64,
        remote_idx: &[u32],
        notification: Vec<u8>,
        deadline: Instant,
        now: Instant,
    ) -> EngineResult<TransferId> {
        self.start_prepared(
            TransferKind::Read,
            (local_id, local_idx),
            (remote_id, remote_idx),
            notification,
            deadline,
            now,
        )
    }

    fn start_prepared(
        &mut self,
        kind: TransferKind,
        local: (u64, &[u32]),
        remote: (u64, &[u32]),
        mut notification: Vec<u8>,
        deadline: Instant,
        now: Instant,
    ) -> EngineResult<TransferId> {
        self.refuse_while_draining()?;
        self.check_common(1, notification.len())?;
        let (peer, parts, touched) = self.plan_prepared(kind, local, remote)?;
        let total: u64 = parts.iter().map(|(_, l)| l.total).sum();
        let id = self.new_transfer(kind, total, 1, deadline);
        let deadline_ms = deadline.saturating_duration_since(now).as_millis() as u64;
        let on_offer = kind == TransferKind::Write && parts.len() == 1;
        if !on_offer && !notification.is_empty() {
            self.prepared.notices.insert(
                id,
                Notice {
                    peer,
                    payload: std::mem::take(&mut notification),
                    lists: touched,
                },
            );
        }
        for (spec, planned) in parts {
            match kind {
                TransferKind::Write => {
                    let n = std::mem::take(&mut notification);
                    self.offer_block_part(id, spec, planned, n, deadline_ms)
                }
                TransferKind::Read => self.request_block_part(id, spec, planned, deadline_ms),
            }
        }
        self.announce(id, total);
        Ok(id)
    }

    /// Checks a prepared transfer and plans its parts: the pairing, each part's spec and local
    /// plan, and the remote lists touched (in order of first appearance).
    #[allow(clippy::type_complexity)]
    fn plan_prepared(
        &self,
        kind: TransferKind,
        (local_id, local_idx): (u64, &[u32]),
        (remote_id, remote_idx): (u64, &[u32]),
    ) -> EngineResult<(PeerIdx, Vec<(BlockSpec, block_transfers::LocalBlocks)>, Vec<u64>)> {
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
            let local_list = local_lists[g.local as usize];
            if self.lists.get(local_list).is_none() {
                return Err(EngineError::not_found(format!(
                    "local_prepared_id: list {local_list} of prepared list {local_id} does not exist (released since it was prepared)"
                )));
            }
            let r = &remote_lists[g.remote as usize];
            touched.push(r.list_id);
            for p in g.parts {
                let spec = BlockSpec {
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
                };
                let plan = self
                    .plan_local_blocks(&spec, kind == TransferKind::Read, IndexChecks::DoneByCaller)
                    .map_err(|e| {
                        EngineError::new(
                            e.code,
                            format!(
                                "the pairs of local list {local_list} and remote list {}: {}",
                                r.list_id, e.message
                            ),
                        )
                    })?;
                planned.push((spec, plan));
            }
        }
        Ok((peer, planned, touched))
    }

    /// The newest pairing of `node`, live (UNAVAILABLE naming `field` when it failed or none).
    fn live_peer_of_node(&self, field: &str, node: &str) -> EngineResult<PeerIdx> {
        // In id order: the last one is the newest.
        let newest = self
            .peers
            .iter()
            .filter(|(_, p)| p.node_id == node)
            .map(|(&i, _)| i)
            .next_back()
            .ok_or_else(|| {
                EngineError::new(Code::Unavailable, format!("{field}: node {node} is not paired"))
            })?;
        self.live_peer(field, newest)?;
        Ok(newest)
    }

    /// Every part of prepared transfer `id` finished OK: its kept notification goes to the peer
    /// now, after every part's data landed (the module's doc says why it arrives after them).
    pub(super) fn send_notice(&mut self, id: TransferId) {
        if let Some(n) = self.prepared.notices.remove(&id) {
            self.actions.push_back(Action::Control {
                peer: n.peer,
                msg: PeerMsg::Notify {
                    transfer_id: id.0,
                    payload: n.payload,
                    lists: n.lists,
                },
            });
        }
    }

    /// Transfer `id` failed or was cancelled: its kept notification is never sent.
    pub(super) fn drop_notice(&mut self, id: TransferId) {
        self.prepared.notices.remove(&id);
    }

    /// A peer's prepared transfer touching our `lists` finished: its notification is delivered
    /// (with the buffers of those lists that still exist). One larger than this node accepts is
    /// dropped, as an offer carrying it would be refused.
    pub(super) fn on_notify(&mut self, peer: PeerIdx, transfer_id: u64, payload: Vec<u8>, lists: Vec<u64>) {
        if payload.is_empty() || payload.len() > self.cfg.max_notification {
            return;
        }
        let mut seen = HashSet::new();
        let buffers = lists
            .iter()
            .filter_map(|&l| self.lists.get(l).map(|l| l.buffer()))
            .filter(|b| seen.insert(*b))
            .collect();
        self.actions.push_back(Action::Notify {
            peer,
            transfer_id,
            payload,
            buffers,
        });
    }
}

fn check_list_count(n: usize, field: &str) -> EngineResult<()> {
    if n == 0 {
        return Err(EngineError::invalid(format!(
            "{field}: at least one list is required"
        )));
    }
    if n > MAX_PREPARED_LISTS {
        return Err(EngineError::invalid(format!(
            "{field}: {n} lists exceed the limit of {MAX_PREPARED_LISTS}"
        )));
    }
    Ok(())
}

/// Checks a prepared list's entries against its lists' lengths (`lens[p]`, 0: unknown; `id(p)`:
/// the list's id, for the message); returns the blocks they cover.
fn check_prepared_entries(
    entries: &[PreparedEntry],
    lens: &[u32],
    id: impl Fn(usize) -> u64,
) -> EngineResult<u64> {
    if entries.is_empty() {
        return Err(EngineError::invalid("entries: at least one entry is required"));
    }
    if entries.len() > MAX_PREPARED_ENTRIES {
        return Err(EngineError::invalid(format!(
            "entries: {} entries exceed the limit of {MAX_PREPARED_ENTRIES}",
            entries.len()
        )));
    }
    let mut blocks = 0u64;
    for (i, e) in entries.iter().enumerate() {
        let p = e.list as usize;
        let Some(&len) = lens.get(p) else {
            return Err(EngineError::invalid(format!(
                "entries[{i}]: list position {p} is past the {} lists named",
                lens.len()
            )));
        };
        if e.count == 0 {
            return Err(EngineError::invalid(format!(
                "entries[{i}]: count must be at least 1 block"
            )));
        }
        let end = u64::from(e.first) + u64::from(e.count);
        let limit = if len > 0 { len } else { MAX_LIST_BLOCKS };
        if end > u64::from(limit) {
            return Err(EngineError::invalid(format!(
                "entries[{i}]: blocks {}..{end} past the {limit} blocks of list {}",
                e.first,
                id(p)
            )));
        }
        blocks += u64::from(e.count);
    }
    Ok(blocks)
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
            let m = if n == 64 { u64::MAX } else { ((1u64 << n) - 1) << lo };
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
