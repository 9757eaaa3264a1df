//! Block lists: many (offset, length) blocks inside one registered buffer, moved by index.
//!
//! A KV cache moves as hundreds to hundreds of thousands of small blocks scattered on both sides.
//! Instead of one entry (and one wire chunk) per block, a transfer names a list on each side and
//! two index arrays; the blocks are packed into wire chunks of up to the chunk size.
//!
//! - **Lists** ([`BlockList`]) are registered once inside a buffer of known length: every block is
//!   checked against the buffer there (and blocks may not overlap), never again per transfer. A
//!   list of blocks of one size at a fixed stride is stored as four numbers, one of uniform size
//!   as one offset per block, any other as an offset and a length per block.
//! - **Indices** ([`IndexArray`]) travel as packed bytes: little-endian `u32`s, or `(start,
//!   count)` pairs of `u32`s for runs of consecutive blocks. Decoding is an iterator; nothing is
//!   allocated per block. A transfer's indices are checked once, the error naming the first bad
//!   one: past its list, a count that differs between the two sides, a pair whose two blocks
//!   differ in length, more than [`MAX_TRANSFER_BLOCKS`] blocks, a destination block named twice.
//! - **Pairs have equal lengths** (as NIXL requires of each descriptor pair): the k-th block of
//!   the source selection is copied whole into the k-th block of the destination selection.
//! - **The wire stream** of a block transfer is the concatenation of its pairs' bytes, in index
//!   order, cut into chunks of `chunk_bytes` exactly as a single range of that total length
//!   ([`super::ChunkPlan`] over `[total]`, the last chunk short). So each side can plan its own
//!   half alone: [`SidePlan`] merges the blocks that are adjacent *on its side* into runs and
//!   answers, per chunk, the pieces of its buffer that chunk covers — the sender's gather table,
//!   the receiver's segment table ([`Segment`]). Merging per side merges at least every run that
//!   is adjacent on both sides, and more: a run adjacent only at the destination is one segment
//!   for the receiver even if the sender gathers it from two places.
//! - **What the receiver is told** ([`BlockHeader`]): its own list id and key, its indices, and
//!   the sender's block lengths (one number when they are all equal). It rebuilds the segment
//!   tables from its own list, after checking that every index lies in the list, that the
//!   counts agree, that each of its blocks is as long as the sender's and that the total is the
//!   header's ([`BlockHeader::validate`]); a header that fails is refused before any byte lands.

mod index;
mod list;
mod plan;
mod registry;
mod wire;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_ranges;
#[cfg(test)]
mod tests_refusals;

pub use index::{IndexArray, IndexEncoding, IndexIter};
pub use list::{BlockList, Layout};
pub use plan::{Pieces, Run, Segment, SidePlan, check_pairs};
pub use registry::{BlockRegistry, MAX_LISTS};
pub use wire::{BlockHeader, PairLengths};

use super::error::{Code, EngineError};

/// The most blocks one list may hold (16,777,216; an explicit list of that size takes 192 MiB).
pub const MAX_LIST_BLOCKS: u32 = 1 << 24;
/// The most blocks one transfer may move (4,194,304; 16 MiB of explicit indices per side).
pub const MAX_TRANSFER_BLOCKS: u64 = 1 << 22;

/// Why a list, an index array or a header was refused. `field` is the name of the offending
/// input as the API spells it (`offsets`, `local_indices`, `remote_indices`, …).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    #[error("{field}: {count} blocks exceed the limit of {limit}")]
    TooMany { field: String, count: u64, limit: u64 },
    #[error("lists: {limit} lists are registered already (the limit); release one first")]
    TooManyLists { limit: usize },
    #[error("reattach_id: list {id} is registered already")]
    IdTaken { id: u64 },
    #[error("{field}: at least one block is required")]
    Empty { field: String },
    #[error("{field}[{at}]: block {index} is past the list's {len} blocks")]
    PastList {
        field: String,
        at: u64,
        index: u64,
        len: u32,
    },
    #[error("{field}[{at}]: {why}")]
    BadBlock { field: String, at: u64, why: String },
    #[error("{field}: {why}")]
    Malformed { field: String, why: String },
    #[error("{field}: {got} blocks, but {other} names {want}")]
    CountMismatch {
        field: String,
        got: u64,
        other: String,
        want: u64,
    },
    #[error(
        "{field}[{at}]: block {index} is {len} bytes, but its partner is {partner} bytes (pairs must be equal in length)"
    )]
    LengthMismatch {
        field: String,
        at: u64,
        index: u32,
        len: u32,
        partner: u32,
    },
    #[error("{field}[{at}]: block {index} is already named at {first}")]
    Duplicate {
        field: String,
        at: u64,
        index: u32,
        first: u64,
    },
}

impl From<BlockError> for EngineError {
    /// Bad input is INVALID_ARGUMENT; a full registry is RESOURCE_EXHAUSTED.
    fn from(e: BlockError) -> EngineError {
        let code = match e {
            BlockError::TooManyLists { .. } => Code::ResourceExhausted,
            BlockError::IdTaken { .. } => Code::AlreadyExists,
            _ => Code::InvalidArgument,
        };
        EngineError::new(code, e.to_string())
    }
}
