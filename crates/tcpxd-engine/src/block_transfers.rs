//! Block transfers: the lists a node registers, transfers that name a local list, a remote
//! list (from its token) and two index arrays, and the pieces a driver gathers from or scatters
//! to for each wire chunk of a block or coalesced offer.
//!
//! See [`crate::blocks`] for the lists, indices, plans and header, and docs/BLOCKS.md for the
//! protocol.

use super::blocks::{BlockError, BlockHeader, BlockList, IndexArray, Layout, PairLengths, Pieces, SidePlan};
use super::coalesce::Places;
use super::*;

/// The local half of a block transfer, planned (`Engine::plan_local_blocks`): the list's buffer
/// and key, the plan, and the lengths of the selected blocks (what the other side checks).
pub(super) struct LocalBlocks {
    buffer: u64,
    key: [u8; 16],
    /// The runs, for a source. A READ's destination leaves it empty: its runs are built when the
    /// holder's offer comes, from the list as it is then (`total` is what the request needs).
    pub(super) plan: SidePlan,
    pub(super) total: u64,
    lengths: PairLengths,
}

/// Who has checked a block part's indices (`Engine::plan_local_blocks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum IndexChecks {
    /// Nobody yet: every index inside its list, and none of the destination's twice.
    Needed,
    /// The caller, for the whole transfer: a prepared transfer's entries were checked inside
    /// their lists when prepared, and its destinations distinct across all its parts before
    /// any part is planned (`prepared/plan.rs`), so a part need not sort its ranges again.
    DoneByCaller,
}

/// The remote side of a block transfer, from the list owner's token and the caller's indices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteBlocks {
    pub list_id: u64,
    pub access_key: [u8; 16],
    /// Blocks in the remote list (the token's count): indices are checked against it here.
    pub blocks: u32,
    /// The remote list's block length when all are equal (the token's), else 0: pair lengths
    /// are then checked here too; otherwise by the receiver (WRITE) or holder (READ).
    pub block_len: u32,
    pub indices: IndexArray,
}

/// A block WRITE or READ: `local_indices` of the local list paired, in order, with the remote
/// indices of a peer's list. Pairs must be equal in length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockSpec {
    pub local_list: u64,
    pub local_indices: IndexArray,
    pub peer: PeerIdx,
    pub remote: RemoteBlocks,
}

impl Engine {
    // ---- commands -------------------------------------------------------------------------

    /// Registers a list of blocks inside a registered buffer, checked once here; returns its id
    /// (never reused). The list goes with its buffer.
    pub fn register_blocks(&mut self, buffer: u64, layout: Layout) -> EngineResult<u64> {
        self.register_blocks_as(None, buffer, layout)
    }

    /// As [`Engine::register_blocks`], under id `id` when given (re-attached after a restart).
    pub fn register_blocks_as(&mut self, id: Option<u64>, buffer: u64, layout: Layout) -> EngineResult<u64> {
        let b = self
            .buffers
            .get(&buffer)
            .ok_or_else(|| EngineError::not_found(format!("buffer_id: buffer {buffer} does not exist")))?;
        Ok(self.lists.register_as(id, buffer, b.size, layout)?)
    }

    /// New block-list and prepared-list ids start at these at the lowest (above every id an
    /// earlier instance of the daemon handed out: ids are never reused).
    pub fn start_ids_at(&mut self, lists: u64, prepared: u64) {
        self.lists.start_ids_at(lists);
        self.prepared.next_id = self.prepared.next_id.max(prepared.saturating_sub(1));
    }

    /// Releases a list. Transfers already started keep their plans.
    pub fn release_blocks(&mut self, list: u64) -> EngineResult<()> {
        if self.lists.release(list) {
            Ok(())
        } else {
            Err(EngineError::not_found(format!(
                "list_id: list {list} does not exist"
            )))
        }
    }

    /// Starts a block WRITE: the local list's blocks to the peer's list. Everything local is
    /// checked first (the list, the indices inside it, the peer, the notification) and, as far as
    /// the token tells (`blocks`, `block_len`), the remote side too: on error nothing changed.
    /// The receiver checks the rest before any byte lands.
    pub fn start_write_blocks(
        &mut self,
        spec: BlockSpec,
        notification: Vec<u8>,
        deadline: Instant,
        now: Instant,
    ) -> EngineResult<TransferId> {
        self.refuse_while_draining()?;
        self.check_common(1, notification.len())?;
        let local = self.plan_local_blocks(&spec, false, IndexChecks::Needed)?;
        let total = local.total;
        let id = self.new_transfer(TransferKind::Write, total, 1, deadline);
        let deadline_ms = deadline.saturating_duration_since(now).as_millis() as u64;
        self.offer_block_part(id, spec, local, notification, deadline_ms);
        self.announce(id, total);
        Ok(id)
    }

    /// Makes the offer of one planned block part of WRITE `id` (a part of it: `add_part`).
    pub(super) fn offer_block_part(
        &mut self,
        id: TransferId,
        spec: BlockSpec,
        local: LocalBlocks,
        notification: Vec<u8>,
        deadline_ms: u64,
    ) {
        let total = local.total;
        let offer_id = self.next_offer;
        self.next_offer += 1;
        let header = BlockHeader {
            list_id: spec.remote.list_id,
            access_key: spec.remote.access_key,
            indices: spec.remote.indices,
            lengths: local.lengths,
            total,
        };
        self.make_offer(
            spec.peer,
            offer_id,
            0,
            Some(id),
            vec![0],
            Places::planned(local.buffer, local.plan),
            Ranges::default(),
            Some(Box::new(header)),
            notification,
            deadline_ms,
            false,
        );
        self.add_part(id, offer_id, spec.peer);
    }

    /// Starts a block READ: the peer's list's blocks into the local list. The local (destination)
    /// indices may not name a block twice. The holder checks its side and answers with an offer
    /// carrying back the header asked for.
    pub fn start_read_blocks(
        &mut self,
        spec: BlockSpec,
        deadline: Instant,
        now: Instant,
    ) -> EngineResult<TransferId> {
        self.refuse_while_draining()?;
        self.check_common(1, 0)?;
        let local = self.plan_local_blocks(&spec, true, IndexChecks::Needed)?;
        let total = local.total;
        let id = self.new_transfer(TransferKind::Read, total, 1, deadline);
        let deadline_ms = deadline.saturating_duration_since(now).as_millis() as u64;
        self.request_block_part(id, spec, local, deadline_ms);
        self.announce(id, total);
        Ok(id)
    }

    /// Sends the read request of one planned block part of READ `id` (a part of it: `add_part`).
    pub(super) fn request_block_part(
        &mut self,
        id: TransferId,
        spec: BlockSpec,
        local: LocalBlocks,
        deadline_ms: u64,
    ) {
        let total = local.total;
        let read_id = self.next_read;
        self.next_read += 1;
        // What the holder's offer must carry back: our list, key, indices, lengths, total (the
        // plan itself is rebuilt when the offer comes, from the list as it is then).
        let dest = Box::new(BlockHeader {
            list_id: spec.local_list,
            access_key: local.key,
            indices: spec.local_indices,
            lengths: local.lengths,
            total,
        });
        self.actions.push_back(Action::Control {
            peer: spec.peer,
            msg: PeerMsg::ReadRequest {
                read_id,
                pairs: ReadPairs::default(),
                deadline_ms,
                blocks: Some(Box::new(ReadBlocks {
                    source_list: spec.remote.list_id,
                    source_key: spec.remote.access_key,
                    source_indices: spec.remote.indices,
                    dest: (*dest).clone(),
                })),
                host_dests: self.memory_of(local.buffer) == crate::topology::Memory::Host,
            },
        });
        self.reads.insert(
            read_id,
            ReadPart {
                peer: spec.peer,
                transfer: id,
                entries: vec![0],
                dests: Ranges::default(),
                blocks: Some(dest),
                offer: None,
                cancelled: false,
            },
        );
        self.add_part(id, read_id, spec.peer);
    }

    /// The local half of a block transfer, checked: the list, its indices (`destination`: none
    /// twice), the peer, and the remote indices as far as the token tells (count, inside the
    /// remote list, none twice for a WRITE's destination, pair lengths when the remote list is
    /// uniform). `checks`: whether the indices' range and distinctness are left to check.
    pub(super) fn plan_local_blocks(
        &self,
        spec: &BlockSpec,
        destination: bool,
        checks: IndexChecks,
    ) -> EngineResult<LocalBlocks> {
        let list = self.lists.get(spec.local_list).ok_or_else(|| {
            EngineError::not_found(format!("local_list: list {} does not exist", spec.local_list))
        })?;
        self.live_peer("peer", spec.peer)?;
        let (n, m) = (spec.local_indices.count(), spec.remote.indices.count());
        if n == 0 {
            return Err(BlockError::Empty {
                field: "local_indices".into(),
            }
            .into());
        }
        if n != m {
            return Err(BlockError::CountMismatch {
                field: "remote_indices".into(),
                got: m,
                other: "local_indices".into(),
                want: n,
            }
            .into());
        }
        let remote = &spec.remote;
        if remote.blocks > 0 && checks == IndexChecks::Needed {
            remote.indices.check(remote.blocks, "remote_indices")?;
            if !destination {
                remote.indices.check_distinct(remote.blocks, "remote_indices")?;
            }
        }
        if destination && checks == IndexChecks::Needed {
            spec.local_indices.check(list.len(), "local_indices")?;
            spec.local_indices.check_distinct(list.len(), "local_indices")?;
        }
        let mut plan = SidePlan::default();
        let (total, lengths) = match list.uniform_len() {
            // A READ's destination of equal blocks: its runs are built when the offer comes, so
            // only the lengths and the total are needed now (checked above: every index is in
            // the list), without a pass over the blocks (131,072 of them for vLLM's pull).
            Some(len) if destination => {
                if remote.block_len > 0 && len != remote.block_len {
                    return Err(BlockError::LengthMismatch {
                        field: "remote_indices".into(),
                        at: 0,
                        index: remote.indices.iter().next().unwrap_or(0),
                        len: remote.block_len,
                        partner: len,
                    }
                    .into());
                }
                (n * u64::from(len), PairLengths::Uniform(len))
            }
            _ => {
                let mut remote_at = remote.indices.iter();
                plan.rebuild(list, &spec.local_indices, "local_indices", |at, _, len| {
                    let r = remote_at.next().unwrap_or(0);
                    if remote.block_len > 0 && len != remote.block_len {
                        return Err(BlockError::LengthMismatch {
                            field: "remote_indices".into(),
                            at,
                            index: r,
                            len: remote.block_len,
                            partner: len,
                        });
                    }
                    Ok(())
                })?;
                let lengths = PairLengths::of(list, &spec.local_indices, "local_indices")?;
                (plan.total(), lengths)
            }
        };
        let buffer = list.buffer();
        let key = self.buffers.get(&buffer).map(|b| b.key).ok_or_else(|| {
            EngineError::not_found(format!(
                "local_list: the buffer of list {} is gone",
                spec.local_list
            ))
        })?;
        Ok(LocalBlocks {
            buffer,
            key,
            plan,
            total,
            lengths,
        })
    }

    // ---- queries --------------------------------------------------------------------------

    /// A registered list.
    pub fn block_list(&self, list: u64) -> Option<&BlockList> {
        self.lists.get(list)
    }

    /// A registered buffer's current access key (what a token of its lists carries).
    pub fn buffer_key(&self, buffer: u64) -> Option<[u8; 16]> {
        self.buffers.get(&buffer).map(|b| b.key)
    }

    /// The pieces of an offer this node sends that wire bytes `wire..wire + len` come from
    /// (`Action::PostGatherSend`), in wire order, their `wire` counted from the chunk's start.
    /// `None` once the offer is gone.
    pub fn send_pieces(&self, offer: u64, wire: u64, len: u32) -> Option<Pieces<'_>> {
        let plan = self.out_offers.get(&offer)?.plan.as_ref()?;
        Some(plan.pieces(wire, len))
    }

    /// The pieces of an offer this node receives from `peer` that wire bytes `wire..wire + len`
    /// go to (`Action::PostScatterRecv`, `Action::LandScatter`). `None` once the offer is gone.
    pub fn recv_pieces(&self, peer: PeerIdx, offer: u64, wire: u64, len: u32) -> Option<Pieces<'_>> {
        let plan = self.in_offers.get(&(peer, offer))?.plan.as_ref()?;
        Some(plan.pieces(wire, len))
    }
}
