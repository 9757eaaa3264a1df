//! Block transfers: the lists a node registers, transfers that name a local list, a remote
//! list (from its token) and two index arrays, and the pieces a driver gathers from or scatters
//! to for each wire chunk of a block or coalesced offer.
//!
//! See [`crate::blocks`] for the lists, indices, plans and header, and docs/BLOCKS.md for the
//! protocol.

use super::blocks::{BlockList, IndexArray, Layout, Pieces};
use super::*;

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
        let b = self
            .buffers
            .get(&buffer)
            .ok_or_else(|| EngineError::not_found(format!("buffer_id: buffer {buffer} does not exist")))?;
        Ok(self.lists.register(buffer, b.size, layout)?)
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

    /// Starts a block WRITE: the local list's blocks to the peer's list.
    pub fn start_write_blocks(
        &mut self,
        spec: BlockSpec,
        notification: Vec<u8>,
        deadline: Instant,
        now: Instant,
    ) -> EngineResult<TransferId> {
        let _ = (spec, notification, deadline, now);
        Err(EngineError::new(
            Code::FailedPrecondition,
            "block transfers are not wired into the engine yet",
        ))
    }

    /// Starts a block READ: the peer's list's blocks into the local list.
    pub fn start_read_blocks(
        &mut self,
        spec: BlockSpec,
        deadline: Instant,
        now: Instant,
    ) -> EngineResult<TransferId> {
        let _ = (spec, deadline, now);
        Err(EngineError::new(
            Code::FailedPrecondition,
            "block transfers are not wired into the engine yet",
        ))
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
