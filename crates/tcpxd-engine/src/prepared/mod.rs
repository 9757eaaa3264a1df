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
//!   and checked before any is made: on error nothing changed. A READ of at least
//!   [`EARLY_PART_MIN_PAIRS`] pairs of lists that make it cheap to check whole is checked first
//!   and planned part by part after (the `plan` module: its first part leaves at once).
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
pub use super::prepared_entries::PreparedEntry;
use super::*;

mod dest_bits;
mod plan;
mod same_node;

use plan::Planning;
pub use plan::{EARLY_PART_MIN_PAIRS, SEAL_MIN_BLOCKS};

/// The most entries one prepared list holds, and the most pairs one prepared transfer names.
pub const MAX_PREPARED_ENTRIES: usize = 1 << 22;
/// The most prepared lists a node keeps at once.
pub const MAX_PREPARED: usize = 65_536;
/// The most block lists one prepared list names.
pub const MAX_PREPARED_LISTS: usize = 65_536;

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
    Remote {
        node: String,
        lists: Vec<RemoteList>,
    },
    /// Another client's lists of this node, by their tokens (`same_node`).
    SameNode(Vec<RemoteList>),
}

#[derive(Debug)]
struct Prepared {
    lists: Lists,
    /// Shared with the READs being planned from it (`plan`), so a release leaves them be.
    entries: std::sync::Arc<PreparedEntries>,
    /// The blocks every entry covers, when they all cover as many (vLLM's lists: 1).
    uniform_count: Option<u32>,
}

/// A notification kept until every part of its transfer finished.
#[derive(Debug)]
struct Notice {
    peer: PeerIdx,
    payload: Vec<u8>,
    lists: Vec<u64>,
    /// The peer's buffers the transfer wrote, besides those of `lists` (a plain WRITE split per
    /// memory pair, `route_parts.rs`).
    buffers: Vec<u64>,
}

/// The prepared lists of a node, and the notifications of its prepared transfers in flight.
#[derive(Debug, Default)]
pub(super) struct PreparedRegistry {
    lists: HashMap<u64, Prepared>,
    pub(crate) next_id: u64,
    /// Per transfer, one per peer it notifies.
    notices: HashMap<TransferId, Vec<Notice>>,
    /// Prepared READs whose early part went out, the rest still to plan (`plan` module).
    planning: Vec<Planning>,
}

impl Engine {
    /// Prepares a list over block lists of this node (`lists`, by id); returns its id (never
    /// reused). Each entry is checked here once, the error naming the first bad one.
    pub fn prepare_local(
        &mut self,
        lists: Vec<u64>,
        entries: Vec<PreparedEntry>,
    ) -> EngineResult<PreparedInfo> {
        self.prepare_local_as(None, lists, entries)
    }

    /// As [`Engine::prepare_local`], under id `id` when given (re-attached after a restart).
    pub fn prepare_local_as(
        &mut self,
        id: Option<u64>,
        lists: Vec<u64>,
        entries: Vec<PreparedEntry>,
    ) -> EngineResult<PreparedInfo> {
        self.check_prepared_room()?;
        self.check_prepared_id(id)?;
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
        Ok(self.insert_prepared(id, Lists::Local(lists), entries, blocks))
    }

    /// Prepares a list over block lists of the node of pairing `peer` (from their tokens).
    pub fn prepare_remote(
        &mut self,
        peer: PeerIdx,
        lists: Vec<RemoteList>,
        entries: Vec<PreparedEntry>,
    ) -> EngineResult<PreparedInfo> {
        self.prepare_remote_as(None, peer, lists, entries)
    }

    /// As [`Engine::prepare_remote`], under id `id` when given (re-attached after a restart).
    pub fn prepare_remote_as(
        &mut self,
        id: Option<u64>,
        peer: PeerIdx,
        lists: Vec<RemoteList>,
        entries: Vec<PreparedEntry>,
    ) -> EngineResult<PreparedInfo> {
        self.check_prepared_room()?;
        self.check_prepared_id(id)?;
        // Only the node matters here: a pairing closed when idle will do (the transfers pair
        // again).
        let node = self.named_peer("remote_tokens", peer)?.node_id.clone();
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
        Ok(self.insert_prepared(id, Lists::Remote { node, lists }, entries, blocks))
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

    fn check_prepared_id(&self, id: Option<u64>) -> EngineResult<()> {
        match id {
            Some(id) if id == 0 || self.prepared.lists.contains_key(&id) => Err(EngineError::new(
                Code::AlreadyExists,
                format!("reattach_id: prepared list {id} exists already"),
            )),
            _ => Ok(()),
        }
    }

    fn insert_prepared(
        &mut self,
        id: Option<u64>,
        lists: Lists,
        entries: Vec<PreparedEntry>,
        blocks: u64,
    ) -> PreparedInfo {
        let id = id.unwrap_or(self.prepared.next_id + 1);
        self.prepared.next_id = self.prepared.next_id.max(id);
        let info = PreparedInfo {
            id,
            entries: entries.len() as u32,
            blocks,
        };
        let uniform_count = entries
            .first()
            .map(|e| e.count)
            .filter(|&c| entries.iter().all(|e| e.count == c));
        let entries = std::sync::Arc::new(PreparedEntries::new(entries));
        self.prepared.lists.insert(
            id,
            Prepared {
                lists,
                entries,
                uniform_count,
            },
        );
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
        if kind == TransferKind::Read
            && let Some(early) = self.plan_early_part(local, remote)?
        {
            return Ok(self.start_early(early, local, remote, notification, deadline, now));
        }
        let (peer, parts, touched) = self.plan_prepared(kind, local, remote)?;
        let total: u64 = parts.iter().map(|(_, l)| l.total).sum();
        let id = self.new_transfer(kind, total, 1, deadline);
        let deadline_ms = deadline.saturating_duration_since(now).as_millis() as u64;
        let on_offer = kind == TransferKind::Write && parts.len() == 1;
        if !on_offer && !notification.is_empty() {
            self.keep_notice(id, peer, std::mem::take(&mut notification), touched, Vec::new());
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
        for n in self.prepared.notices.remove(&id).unwrap_or_default() {
            self.actions.push_back(Action::Control {
                peer: n.peer,
                msg: PeerMsg::Notify {
                    transfer_id: id.0,
                    payload: n.payload,
                    lists: n.lists,
                    buffers: n.buffers,
                },
            });
        }
    }

    /// Keeps transfer `id`'s notification to `peer` until every part finished OK.
    pub(super) fn keep_notice(
        &mut self,
        id: TransferId,
        peer: PeerIdx,
        payload: Vec<u8>,
        lists: Vec<u64>,
        buffers: Vec<u64>,
    ) {
        self.prepared.notices.entry(id).or_default().push(Notice {
            peer,
            payload,
            lists,
            buffers,
        });
    }

    /// Transfer `id` failed or was cancelled: its kept notification is never sent.
    pub(super) fn drop_notice(&mut self, id: TransferId) {
        self.prepared.notices.remove(&id);
    }

    /// A peer's prepared transfer touching our `lists` (or a plain WRITE split per memory pair
    /// into our `buffers`, `route_parts.rs`) finished: its notification is delivered (with the
    /// buffers of those lists, and those named, that still exist, each once). One larger than
    /// this node accepts is dropped, as an offer carrying it would be refused.
    pub(super) fn on_notify(
        &mut self,
        peer: PeerIdx,
        transfer_id: u64,
        payload: Vec<u8>,
        lists: Vec<u64>,
        named: Vec<u64>,
    ) {
        if payload.is_empty() || payload.len() > self.cfg.max_notification {
            return;
        }
        let mut seen = HashSet::new();
        let buffers = lists
            .iter()
            .filter_map(|&l| self.lists.get(l).map(|l| l.buffer()))
            .chain(named.into_iter().filter(|b| self.buffers.contains_key(b)))
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
