//! Block chunks over registered host memory: a sender's gather of a chunk's pieces from a client
//! buffer into a staging slot, by raw copies (the plugin may be writing other parts of either
//! region from its own threads, so no Rust reference spans them). The receiver's scatter is
//! [`super::RecvComm::scatter_landed`]. The checks and the copy plan are
//! `unpack::blocks::{gather_ops, scatter_ops}`, shared with the slice versions.

use crate::engine::blocks::Segment;
use crate::unpack::blocks::gather_ops;

use super::cross_memory::{AttachError, ClientCopies, ClientPages};
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

/// Why a gather from a client's pages failed: the table (nothing copied) or the client's
/// process (its memory gone or unreadable part way: the slot holds part of the chunk).
#[derive(Debug, thiserror::Error)]
pub enum ClientGatherError {
    #[error(transparent)]
    Table(NetError),
    #[error(transparent)]
    Client(AttachError),
}

/// [`gather_region`] from a client's pages (a buffer registered by address, `src_len` bytes at
/// `pages`): each piece read by `process_vm_readv` straight into the slot. The table is checked
/// first; on a table error nothing is copied.
pub fn gather_client(
    pages: ClientPages,
    src_len: u64,
    segs: &[Segment],
    staging: &dyn Region,
    slot: usize,
    slot_len: usize,
) -> Result<u32, ClientGatherError> {
    if staging.mem_type() != MemType::Host {
        return Err(ClientGatherError::Table(NetError::InvalidArgument(
            "a gather from a client's pages needs a host staging slot".into(),
        )));
    }
    if slot.checked_add(slot_len).is_none_or(|e| e > staging.len()) {
        return Err(ClientGatherError::Table(NetError::InvalidArgument(format!(
            "staging slot {slot}+{slot_len} is outside the {}-byte ring",
            staging.len()
        ))));
    }
    let to = staging.as_ptr();
    let mut copies = ClientCopies::from_client(pages);
    let mut failed = None;
    let bytes = gather_ops(segs, src_len, slot_len as u64, |f, t, n| {
        if failed.is_some() {
            return;
        }
        // SAFETY: `gather_ops` checked the chunk inside the slot, which lies inside `staging`
        // (checked above), a live host region; the slot is this send's alone (the ring's rule)
        // until the flush below. The client's range is checked by the kernel.
        if let Err(e) = unsafe { copies.push(to.add(slot + t), f as u64, n) } {
            failed = Some(e);
        }
    })
    .map_err(|e| ClientGatherError::Table(NetError::InvalidArgument(format!("gather: {e}"))))?;
    match failed.map_or_else(|| copies.flush(), Err) {
        Err(e) => Err(ClientGatherError::Client(e)),
        Ok(()) => Ok(bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::HostRegion;

    #[test]
    fn a_gather_from_client_pages_puts_each_piece_at_its_wire_offset() {
        let mut mine: Vec<u8> = (0..=255u8).cycle().take(8192).collect();
        let pages = ClientPages {
            pid: std::process::id() as i32,
            addr: mine.as_mut_ptr() as u64,
        };
        let staging = HostRegion::new(4096).unwrap();
        let segs = [
            Segment {
                offset: 4000,
                wire: 0,
                len: 10,
            },
            Segment {
                offset: 10,
                wire: 10,
                len: 5,
            },
        ];
        assert_eq!(
            gather_client(pages, 8192, &segs, &staging, 1024, 1024).unwrap(),
            15
        );
        let got = staging.to_vec(1024, 15).unwrap();
        let mut want = mine[4000..4010].to_vec();
        want.extend_from_slice(&mine[10..15]);
        assert_eq!(got, want);
        // A piece past the buffer's end copies nothing and says so.
        let bad = [Segment {
            offset: 8190,
            wire: 0,
            len: 10,
        }];
        assert!(matches!(
            gather_client(pages, 8192, &bad, &staging, 0, 1024),
            Err(ClientGatherError::Table(_))
        ));
        // A process's memory that is not there: the client's error.
        let nowhere = ClientPages {
            pid: pages.pid,
            addr: 8,
        };
        assert!(matches!(
            gather_client(nowhere, 8192, &segs, &staging, 0, 1024),
            Err(ClientGatherError::Client(AttachError::Fault { .. }))
        ));
        drop(mine);
    }
}
