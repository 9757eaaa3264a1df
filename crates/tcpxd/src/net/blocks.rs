//! Block chunks on host memory: the sender's gather of a chunk's pieces into its staging slot, and
//! the receiver's scatter of a received chunk's fragments into its blocks. The same work as
//! kernels/blocks.cu, with `memcpy`; also the reference the GPU tests compare with. The checks
//! and the copy plans ([`gather_ops`], [`scatter_ops`]) serve the slice versions here and the
//! versions over registered regions, by raw copies (the plugin may be writing other parts of
//! either region from its own threads, so no Rust reference spans them): [`gather_region`], and
//! the receiver's [`super::RecvComm::scatter_landed`].
//!
//! A chunk's table is its pieces in wire order ([`Segment`]: `len` bytes at `offset` of this
//! side's buffer, at byte `wire` of the chunk), as `engine::blocks::SidePlan` produces them.

use std::sync::Arc;

use crate::engine::blocks::Segment;

use super::abi::loadMeta;
use super::cross_memory::{AttachError, ClientCopies, ClientPages};
use super::error::{NetError, NetResult};
use super::host_copies::{CopyJob, CopyTicket, HostCopies, HostCopy, Place};
use super::memory::{MemType, Region};

// kernels/blocks.cu reads the tables as 16-byte `BlockSeg`s.
const _: () = assert!(size_of::<Segment>() == 16);

/// A table or fragment that does not fit where it points.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockCopyError {
    #[error("piece {index} ({len} bytes at {offset}) lies outside the {limit}-byte buffer")]
    PieceOutside {
        index: usize,
        offset: u64,
        len: u32,
        limit: u64,
    },
    #[error(
        "the pieces do not cover the {bytes}-byte chunk in order (piece {index} starts at {wire}, expected {expected})"
    )]
    NotContiguous {
        index: usize,
        wire: u32,
        expected: u64,
        bytes: u32,
    },
    #[error(
        "fragment {index} ({len} bytes at {src_off} of the bounce buffer, chunk offset {dst_off}) lies outside the {bytes}-byte chunk or the {bounce}-byte bounce buffer"
    )]
    FragmentOutside {
        index: usize,
        src_off: u32,
        len: u32,
        dst_off: u64,
        bytes: u32,
        bounce: u64,
    },
}

/// Checks a chunk's table: pieces in wire order covering `0..bytes` exactly, each inside a buffer
/// of `buffer_len` bytes. (The planner's tables always pass; the copies below rely on it.)
pub fn check_table(segs: &[Segment], bytes: u32, buffer_len: u64) -> Result<(), BlockCopyError> {
    let mut wire = 0u64;
    for (index, s) in segs.iter().enumerate() {
        if u64::from(s.wire) != wire || s.len == 0 {
            return Err(BlockCopyError::NotContiguous {
                index,
                wire: s.wire,
                expected: wire,
                bytes,
            });
        }
        if s.offset
            .checked_add(u64::from(s.len))
            .is_none_or(|e| e > buffer_len)
        {
            return Err(BlockCopyError::PieceOutside {
                index,
                offset: s.offset,
                len: s.len,
                limit: buffer_len,
            });
        }
        wire += u64::from(s.len);
    }
    if wire != u64::from(bytes) {
        return Err(BlockCopyError::NotContiguous {
            index: segs.len(),
            wire: wire.min(u64::from(u32::MAX)) as u32,
            expected: u64::from(bytes),
            bytes,
        });
    }
    Ok(())
}

/// Gathers a chunk: copies each piece of `segs` from `src` to its wire offset in `staging` (at
/// least the chunk's length). The table is checked first; on error nothing is copied.
pub fn gather_host(src: &[u8], segs: &[Segment], staging: &mut [u8]) -> Result<u32, BlockCopyError> {
    gather_ops(segs, src.len() as u64, staging.len() as u64, |from, to, n| {
        staging[to..to + n].copy_from_slice(&src[from..from + n])
    })
}

/// The gather's copies without the memory: checks `segs` against a `src_len`-byte source and a
/// `staging_len`-byte slot, then calls `copy(from, to, n)` once per piece (`n` bytes from byte
/// `from` of the source to byte `to` of the slot; all in bounds). On error `copy` is never
/// called. Returns the chunk's length. (`net::blocks` drives it over registered memory.)
pub fn gather_ops(
    segs: &[Segment],
    src_len: u64,
    staging_len: u64,
    mut copy: impl FnMut(usize, usize, usize),
) -> Result<u32, BlockCopyError> {
    let bytes = segs.last().map_or(0, |s| s.wire + s.len);
    check_table(segs, bytes, src_len)?;
    if u64::from(bytes) > staging_len {
        return Err(BlockCopyError::PieceOutside {
            index: segs.len() - 1,
            offset: u64::from(segs[segs.len() - 1].wire),
            len: segs[segs.len() - 1].len,
            limit: staging_len,
        });
    }
    for s in segs {
        copy(s.offset as usize, s.wire as usize, s.len as usize);
    }
    Ok(bytes)
}

/// Scatters a received chunk of `bytes` bytes: each fragment (`len` bytes at `src_off` of
/// `bounce`, chunk offset `dst_off`) is copied into the pieces of `segs` that hold those chunk
/// bytes, in `dst`. Everything is checked before the first byte is written (the table against
/// `dst`, every fragment against the chunk and the bounce buffer); returns the bytes copied.
pub fn scatter_host(
    frags: &[loadMeta],
    bounce: &[u8],
    segs: &[Segment],
    bytes: u32,
    dst: &mut [u8],
) -> Result<u64, BlockCopyError> {
    scatter_ops(
        frags,
        bounce.len() as u64,
        segs,
        bytes,
        dst.len() as u64,
        |from, to, n| dst[to..to + n].copy_from_slice(&bounce[from..from + n]),
    )
}

/// The scatter's copies without the memory: checks `segs` against a `dst_len`-byte destination
/// and every fragment against the chunk and a `bounce_len`-byte bounce buffer, then calls
/// `copy(from, to, n)` per piece of each fragment (`n` bytes from byte `from` of the bounce
/// buffer to byte `to` of the destination; all in bounds). On error `copy` is never called.
/// Returns the bytes copied. (`net::blocks` drives it over the plugin's and the buffer's memory.)
pub fn scatter_ops(
    frags: &[loadMeta],
    bounce_len: u64,
    segs: &[Segment],
    bytes: u32,
    dst_len: u64,
    mut copy: impl FnMut(usize, usize, usize),
) -> Result<u64, BlockCopyError> {
    check_table(segs, bytes, dst_len)?;
    for (index, f) in frags.iter().enumerate() {
        let in_chunk = f.dst_off <= u64::from(bytes) && u64::from(f.len) <= u64::from(bytes) - f.dst_off;
        let in_bounce = u64::from(f.src_off) + u64::from(f.len) <= bounce_len;
        if !in_chunk || !in_bounce {
            return Err(BlockCopyError::FragmentOutside {
                index,
                src_off: f.src_off,
                len: f.len,
                dst_off: f.dst_off,
                bytes,
                bounce: bounce_len,
            });
        }
    }
    let mut copied = 0u64;
    for f in frags.iter().filter(|f| f.len > 0) {
        let mut w = f.dst_off as u32;
        let end = w + f.len;
        let mut i = segs.partition_point(|s| s.wire <= w) - 1;
        while w < end {
            let s = segs[i];
            let stop = (s.wire + s.len).min(end);
            let n = (stop - w) as usize;
            let from = f.src_off as usize + (w - f.dst_off as u32) as usize;
            let to = (s.offset + u64::from(w - s.wire)) as usize;
            copy(from, to, n);
            copied += n as u64;
            w = stop;
            i += 1;
        }
    }
    Ok(copied)
}

/// Gathers a chunk: each piece of `segs` (offsets in `src`) to its wire offset in the
/// `slot_len`-byte slot at byte `slot` of `staging`. Both regions must be host memory. The table
/// is checked first (pieces in wire order, inside `src`, the chunk inside the slot); on error
/// nothing is copied. Returns the chunk's length once it is copied.
pub fn gather_region(
    src: &dyn Region,
    segs: &[Segment],
    staging: &dyn Region,
    slot: usize,
    slot_len: usize,
    copies: &HostCopies,
) -> NetResult<u32> {
    let (bytes, planned) = plan_gather(src, segs, staging, slot, slot_len)?;
    // SAFETY: every copy lies inside `src` and the slot (`plan_gather`); both are live host
    // regions; the pieces' wire ranges are distinct, so no two targets overlap, and the slot is
    // this send's alone (the ring's rule), so nothing else writes it; the source bytes are the
    // transfer's (the engine counts the buffer's users). `copy_all` returns once all are copied.
    unsafe { copies.copy_all(&planned) };
    Ok(bytes)
}

/// [`gather_region`] queued on a copy helper at `place` ([`HostCopies::queue_at`]): returns the
/// chunk's length and, unless it was copied at once, the ticket the send must wait for. The
/// regions are held by the job; the slot must not be reused, nor the send posted, before the
/// ticket is done.
pub fn gather_region_queued(
    src: &Arc<dyn Region>,
    segs: &[Segment],
    staging: &Arc<dyn Region>,
    slot: usize,
    slot_len: usize,
    copies: &HostCopies,
    place: Place,
) -> NetResult<(u32, Option<CopyTicket>)> {
    let (bytes, planned) = plan_gather(&**src, segs, &**staging, slot, slot_len)?;
    let job = CopyJob {
        copies: planned,
        zero: None,
        // The staging slot: read by the plugin's send next.
        cold_targets: false,
        keep: vec![src.clone(), staging.clone()],
    };
    // SAFETY: as in `gather_region`; both regions are held by the job until it is done, and the
    // slot stays this send's until the send (posted only after the ticket is done) completes.
    Ok((bytes, unsafe { copies.queue_at(job, place) }))
}

/// A gather's checks and copies: the chunk's length and one copy per piece.
fn plan_gather(
    src: &dyn Region,
    segs: &[Segment],
    staging: &dyn Region,
    slot: usize,
    slot_len: usize,
) -> NetResult<(u32, Vec<HostCopy>)> {
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
    let mut planned: Vec<HostCopy> = Vec::with_capacity(segs.len());
    let bytes = gather_ops(segs, src.len() as u64, slot_len as u64, |f, t, n| {
        // SAFETY: `gather_ops` checked `f..f + n` inside `src` and `t..t + n` inside the slot,
        // which lies inside `staging` (checked above).
        let (from, to) = unsafe { (from.add(f).cast_const(), to.add(slot + t)) };
        planned.push(HostCopy { from, to, n });
    })
    .map_err(|e| NetError::InvalidArgument(format!("gather: {e}")))?;
    Ok((bytes, planned))
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
    use crate::engine::blocks::{BlockList, IndexArray, Layout, SidePlan};
    use crate::net::HostRegion;

    use tcpxd_testkit::Rng;

    fn lm(src_off: u32, len: u32, dst_off: u64) -> loadMeta {
        loadMeta {
            src_off,
            len,
            dst_off,
        }
    }

    /// Fragments of a chunk as TCPX leaves them: the chunk cut at random points (at most 4 KiB
    /// each), scattered over a bounce buffer in random order.
    fn fragments(rng: &mut Rng, chunk: &[u8], bounce: &mut Vec<u8>) -> Vec<loadMeta> {
        let mut cuts = Vec::new();
        let mut at = 0u32;
        while (at as usize) < chunk.len() {
            let len = (1 + rng.below(4096) as u32).min(chunk.len() as u32 - at);
            cuts.push((at, len));
            at += len;
        }
        for i in (1..cuts.len()).rev() {
            cuts.swap(i, rng.below(i as u64 + 1) as usize);
        }
        bounce.clear();
        let mut frags = Vec::new();
        for (wire, len) in cuts {
            bounce.extend((0..rng.below(50)).map(|_| 0xCC));
            frags.push(lm(bounce.len() as u32, len, u64::from(wire)));
            bounce.extend_from_slice(&chunk[wire as usize..(wire + len) as usize]);
        }
        frags
    }

    #[test]
    fn gather_then_scatter_of_fragments_matches_a_per_block_copy() {
        let mut rng = Rng::new(0x1234_5678);
        for round in 0..60 {
            // Odd block sizes at odd offsets, scattered both sides.
            let n = 1 + rng.below(200) as u32;
            let len = 1 + rng.below(9000) as u32;
            let stride = u64::from(len) + rng.below(3) * 17;
            let list = |first: u64| Layout::Strided {
                first,
                stride,
                len,
                count: n,
            };
            let src_len = 3 + stride * u64::from(n) + 5;
            let src = BlockList::new(1, 1, src_len, list(3)).unwrap();
            let dst = BlockList::new(2, 2, src_len + 11, list(11)).unwrap();
            let mut si: Vec<u32> = (0..n).collect();
            let mut di: Vec<u32> = (0..n).collect();
            for v in [&mut si, &mut di] {
                if rng.below(2) == 0 {
                    for i in (1..v.len()).rev() {
                        v.swap(i, rng.below(i as u64 + 1) as usize);
                    }
                }
            }
            let send = SidePlan::build(&src, &IndexArray::compact(&si), "s").unwrap();
            let recv = SidePlan::build(&dst, &IndexArray::compact(&di), "d").unwrap();
            let sbuf: Vec<u8> = (0..src_len).map(|_| rng.next() as u8).collect();
            let mut got: Vec<u8> = vec![0x5A; dst.buffer_len() as usize];
            let mut want = got.clone();
            for (&s, &d) in si.iter().zip(&di) {
                let (so, l) = src.block(s).unwrap();
                let (doff, _) = dst.block(d).unwrap();
                want[doff as usize..doff as usize + l as usize]
                    .copy_from_slice(&sbuf[so as usize..so as usize + l as usize]);
            }
            let chunk_bytes = [4096u32, 65536, 524288, 7777][round % 4];
            let (mut gt, mut st) = (Vec::new(), Vec::new());
            let mut staging = vec![0u8; chunk_bytes as usize];
            let mut bounce = Vec::new();
            for k in 0..send.chunk_count(chunk_bytes) {
                send.chunk_into(chunk_bytes, k, &mut gt);
                recv.chunk_into(chunk_bytes, k, &mut st);
                let bytes = gather_host(&sbuf, &gt, &mut staging).unwrap();
                let frags = fragments(&mut rng, &staging[..bytes as usize], &mut bounce);
                let copied = scatter_host(&frags, &bounce, &st, bytes, &mut got).unwrap();
                assert_eq!(copied, u64::from(bytes));
            }
            assert!(got == want, "round {round}");
        }
    }

    #[test]
    fn bad_tables_and_fragments_are_refused_before_any_byte() {
        let segs = [
            Segment {
                offset: 10,
                wire: 0,
                len: 100,
            },
            Segment {
                offset: 500,
                wire: 100,
                len: 50,
            },
        ];
        let bounce = vec![7u8; 1000];
        let mut dst = vec![0u8; 1000];
        // A fragment past the chunk, past the bounce buffer.
        for f in [lm(0, 151, 0), lm(0, 1, 150), lm(999, 2, 0)] {
            let e = scatter_host(&[lm(0, 10, 0), f], &bounce, &segs, 150, &mut dst).unwrap_err();
            assert!(
                matches!(e, BlockCopyError::FragmentOutside { index: 1, .. }),
                "{e}"
            );
            assert!(dst.iter().all(|&b| b == 0), "nothing written");
        }
        // A piece past the destination; pieces out of order; a gap; a short table.
        let e = scatter_host(&[], &bounce, &segs, 150, &mut dst[..540]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "piece 1 (50 bytes at 500) lies outside the 540-byte buffer"
        );
        let swapped = [segs[1], segs[0]];
        assert!(matches!(
            check_table(&swapped, 150, 1000),
            Err(BlockCopyError::NotContiguous { index: 0, .. })
        ));
        assert!(check_table(&segs, 151, 1000).is_err());
        assert!(check_table(&segs, 150, 1000).is_ok());
        let e = gather_host(&bounce[..549], &segs, &mut [0u8; 4096]).unwrap_err();
        assert!(matches!(e, BlockCopyError::PieceOutside { index: 1, .. }), "{e}");
        assert!(gather_host(&bounce, &segs, &mut [0u8; 149]).is_err());
        // Empty fragments are fine and copy nothing.
        assert_eq!(
            scatter_host(&[lm(0, 0, 150)], &bounce, &segs, 150, &mut dst),
            Ok(0)
        );
    }

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
