//! The public vocabulary of a transfer: the ids of pairings ([`PeerIdx`]) and transfers
//! ([`TransferId`]), which way it moves data ([`TransferKind`]), its entries ([`EntrySpec`]) and
//! how it ended ([`Outcome`]).

use crate::error::Code;
use crate::wire::RemoteRange;

/// A pairing in the engine: never reused, so a late message or event for a pairing the engine
/// released names no other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerIdx(pub u32);

/// A client-visible transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransferId(pub u64);

impl std::fmt::Display for TransferId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Which way a transfer moves data, seen from this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferKind {
    Write,
    Read,
}

/// One entry of a transfer: `remote.length` bytes between a local buffer and a peer's buffer
/// (from local to remote for a WRITE, from remote to local for a READ).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntrySpec {
    pub local_buffer: u64,
    pub local_offset: u64,
    pub peer: PeerIdx,
    pub remote: RemoteRange,
}

/// An entry of a WRITE.
pub type WriteSpec = EntrySpec;
/// An entry of a READ.
pub type ReadSpec = EntrySpec;

/// How a transfer (or one entry of it) ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub code: Code,
    pub message: String,
    /// One per entry, in request order; none for a transfer started with
    /// `Engine::report_one_status` (its status is every entry's).
    pub entries: Vec<(Code, String)>,
    /// Bytes known to have landed at their destination: the total when OK; after a failure, a
    /// WRITE's ranges its receivers confirmed and a READ's chunks unpacked here (progress events
    /// count a WRITE's chunks as they leave, which says nothing of what the receiver kept).
    pub landed: u64,
}
