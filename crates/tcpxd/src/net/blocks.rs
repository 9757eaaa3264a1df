//! Block chunks over registered host memory: a sender's gather of a chunk's pieces from a client
//! buffer into a staging slot, by raw copies (the plugin may be writing other parts of either
//! region from its own threads, so no Rust reference spans them). The receiver's scatter is
//! [`super::RecvComm::scatter_landed`]. The checks and the copy plan are
//! `unpack::blocks::{gather_ops, scatter_ops}`, shared with the slice versions.

use crate::engine::blocks::Segment;
use crate::unpack::blocks::gather_ops;

use super::error::{NetError, NetResult};
use super::memory::{MemType, Region};

/// Gathers a chunk: each piece of `segs` (offsets in `src`) to its wire offset in the
/// `slot_len`-byte slot at byte `slot` of `staging`. Both regions must be host memory. The table
/// is checked first (pieces in wire order, inside `src`, the chunk inside the slot); on error
/// nothing is copied. Returns the chunk's length.
pub fn gather_region(
    src: &dyn Region,
    segs: &[Segment],
    staging: &dyn Region,
    slot: usize,
    slot_len: usize,
) -> NetResult<u32> {
    if src.mem_type() != MemType::Host || staging.mem_type() != MemType::Host {
        return Err(NetError::InvalidArgument(
            "a host gather needs a host buffer and a host staging slot".into(),
        ));
    }
    if slot.checked_add(slot_len).is_none_or(|e| e > staging.len()) {
        return Err(NetError::InvalidArgument(format!(
            "staging slot {slot}+{slot_len} is outside the {}-byte ring",
            staging.len()
        )));
    }
    let (from, to) = (src.as_ptr(), staging.as_ptr());
    gather_ops(segs, src.len() as u64, slot_len as u64, |f, t, n| {
        // SAFETY: `gather_ops` checked every piece inside `src` and the chunk inside the slot,
        // which lies inside `staging` (checked above); both are live host regions; the slot is
        // this send's alone (the ring's rule), so nothing else writes it, and the source bytes
        // are the transfer's (the engine counts the buffer's users).
        unsafe { std::ptr::copy_nonoverlapping(from.add(f), to.add(slot + t), n) }
    })
    .map_err(|e| NetError::InvalidArgument(format!("gather: {e}")))
}
