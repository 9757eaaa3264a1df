//! Planning one side of a block transfer: runs of adjacent blocks, and the pieces each wire chunk
//! covers.

use super::list::Layout;
use super::{BlockError, BlockList, IndexArray, MAX_TRANSFER_BLOCKS};

/// One piece of a wire chunk on one side: `len` bytes at `offset` in this side's buffer, at byte
/// `wire` of the chunk. The sender's gather table and the receiver's segment table are lists of
/// these, in wire order. The layout (16 bytes) is what kernels/blocks.cu reads (`BlockSeg`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Segment {
    pub offset: u64,
    pub wire: u32,
    pub len: u32,
}

/// Blocks adjacent in this side's buffer, merged: bytes from `offset` on, starting at byte `wire`
/// of the transfer's wire stream (the run's length is where the next run starts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub offset: u64,
    pub wire: u64,
}

/// One side of a block transfer, planned: the selected blocks in index order, neighbours in the
/// buffer merged into runs. Built in one pass over the indices (the pass that checks them), in a
/// vector that can be reused for the next transfer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SidePlan {
    runs: Vec<Run>,
    total: u64,
    blocks: u64,
}

impl SidePlan {
    /// Plans `indices` of `list`, checking each against the list (the error names the first one
    /// past it). `field` names the indices in errors.
    pub fn build(list: &BlockList, indices: &IndexArray, field: &str) -> Result<SidePlan, BlockError> {
        let mut p = SidePlan::default();
        p.rebuild(list, indices, field, |_, _, _| Ok(()))?;
        Ok(p)
    }

    /// Plans into this plan's storage (kept from an earlier transfer). `check(position, index,
    /// length)` runs on every block as it is visited (the receiver compares lengths with the
    /// sender's there); its error stops the plan, which is then empty.
    pub fn rebuild(
        &mut self,
        list: &BlockList,
        indices: &IndexArray,
        field: &str,
        mut check: impl FnMut(u64, u32, u32) -> Result<(), BlockError>,
    ) -> Result<(), BlockError> {
        self.runs.clear();
        self.total = 0;
        self.blocks = 0;
        if indices.count() > MAX_TRANSFER_BLOCKS {
            return Err(BlockError::TooMany {
                field: field.to_string(),
                count: indices.count(),
                limit: MAX_TRANSFER_BLOCKS,
            });
        }
        let past = |at: u64, index: u32| BlockError::PastList {
            field: field.to_string(),
            at,
            index: index.into(),
            len: list.len(),
        };
        let mut runs = std::mem::take(&mut self.runs);
        let mut total = 0u64;
        // The end of the last run in the buffer (u64::MAX: none yet, nothing is adjacent to it).
        let mut end = u64::MAX;
        let mut push = |off: u64, len: u32| {
            if off != end {
                runs.push(Run {
                    offset: off,
                    wire: total,
                });
            }
            end = off + u64::from(len);
            total += u64::from(len);
        };
        // The layout is matched once, outside the per-block loop.
        let result = match list.layout() {
            Layout::Strided {
                first,
                stride,
                len,
                count,
            } => indices.iter().enumerate().try_for_each(|(at, i)| {
                if i >= *count {
                    return Err(past(at as u64, i));
                }
                check(at as u64, i, *len)?;
                push(first + stride * u64::from(i), *len);
                Ok(())
            }),
            Layout::Uniform { offsets, len } => indices.iter().enumerate().try_for_each(|(at, i)| {
                let &off = offsets.get(i as usize).ok_or_else(|| past(at as u64, i))?;
                check(at as u64, i, *len)?;
                push(off, *len);
                Ok(())
            }),
            Layout::Explicit { offsets, lens } => indices.iter().enumerate().try_for_each(|(at, i)| {
                let (&off, &len) = offsets
                    .get(i as usize)
                    .zip(lens.get(i as usize))
                    .ok_or_else(|| past(at as u64, i))?;
                check(at as u64, i, len)?;
                push(off, len);
                Ok(())
            }),
        };
        if let Err(e) = result {
            runs.clear();
            self.runs = runs;
            return Err(e);
        }
        self.runs = runs;
        self.total = total;
        self.blocks = indices.count();
        Ok(())
    }

    /// Plans `indices` of `list` whose lengths need no comparing (the partner's are all the
    /// list's one length), each index checked against the list as [`SidePlan::rebuild`] does
    /// (the error naming the first one past it): no per-block callback, and each range of a strided list whose blocks touch (stride = length) is one step,
    /// not one per block. The same plan as [`SidePlan::rebuild`]'s. (The receiver of a part of
    /// vLLM's pull through `tcpxd.nixl`, 1,024 ranges of 4 granules, checks and plans it in ~19
    /// µs instead of ~40 on the build machine: `timing_of_a_vllm_sized_header`.)
    pub fn rebuild_checked(
        &mut self,
        list: &BlockList,
        indices: &IndexArray,
        field: &str,
    ) -> Result<(), BlockError> {
        let (
            Layout::Strided {
                first,
                stride,
                len,
                count,
            },
            Some(ranges),
        ) = (list.layout(), indices.ranges())
        else {
            return self.rebuild(list, indices, field, |_, _, _| Ok(()));
        };
        if *stride != u64::from(*len) || indices.count() > MAX_TRANSFER_BLOCKS {
            return self.rebuild(list, indices, field, |_, _, _| Ok(()));
        }
        self.runs.clear();
        let (mut total, mut end, mut at) = (0u64, u64::MAX, 0u64);
        for (start, n) in ranges {
            if u64::from(start) + u64::from(n) > u64::from(*count) {
                let bad = start.max(*count);
                self.runs.clear();
                (self.total, self.blocks) = (0, 0);
                return Err(BlockError::PastList {
                    field: field.to_string(),
                    at: at + u64::from(bad - start),
                    index: bad.into(),
                    len: *count,
                });
            }
            let off = first + stride * u64::from(start);
            if off != end {
                self.runs.push(Run {
                    offset: off,
                    wire: total,
                });
            }
            let bytes = u64::from(n) * u64::from(*len);
            end = off + bytes;
            total += bytes;
            at += u64::from(n);
        }
        self.total = total;
        self.blocks = indices.count();
        Ok(())
    }

    /// Plans plain ranges of one buffer (a batch's entries, already checked against the buffer),
    /// in order: `(offset, length)`, neighbours merged as for blocks. Empty ranges add nothing.
    pub fn rebuild_ranges(&mut self, ranges: impl IntoIterator<Item = (u64, u64)>) {
        self.runs.clear();
        let (mut total, mut end, mut blocks) = (0u64, u64::MAX, 0u64);
        for (off, len) in ranges {
            blocks += 1;
            if len == 0 {
                continue;
            }
            if off != end {
                self.runs.push(Run {
                    offset: off,
                    wire: total,
                });
            }
            end = off + len;
            total += len;
        }
        self.total = total;
        self.blocks = blocks;
    }

    /// Bytes the transfer moves (the wire stream's length).
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Blocks planned.
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// The merged runs, in wire order.
    pub fn runs(&self) -> &[Run] {
        &self.runs
    }

    /// Chunks of `chunk_bytes` the wire stream is cut into (the last one may be short).
    pub fn chunk_count(&self, chunk_bytes: u32) -> u64 {
        self.total.div_ceil(u64::from(chunk_bytes))
    }

    /// The pieces of this side that chunk `k` (of `chunk_bytes`) covers, in wire order; empty
    /// past the last chunk.
    pub fn chunk(&self, chunk_bytes: u32, k: u64) -> Pieces<'_> {
        let start = k.saturating_mul(u64::from(chunk_bytes)).min(self.total);
        let len = (self.total - start).min(u64::from(chunk_bytes));
        self.pieces(start, len as u32)
    }

    /// The pieces covering wire bytes `start..start + len` (clipped to the total), their `wire`
    /// counted from `start`. One binary search, then one step per piece.
    pub fn pieces(&self, start: u64, len: u32) -> Pieces<'_> {
        let end = start.saturating_add(u64::from(len)).min(self.total);
        let start = start.min(end);
        let run = self.runs.partition_point(|r| r.wire <= start).saturating_sub(1);
        Pieces {
            runs: &self.runs,
            total: self.total,
            run,
            pos: start,
            end,
            base: start,
        }
    }

    /// Writes chunk `k`'s table into `out` (pinned memory a kernel reads, say) and returns how
    /// many pieces it holds, or `None` (nothing written past `out`) when they do not fit.
    pub fn chunk_to_slice(&self, chunk_bytes: u32, k: u64, out: &mut [Segment]) -> Option<usize> {
        let mut n = 0;
        for s in self.chunk(chunk_bytes, k) {
            *out.get_mut(n)? = s;
            n += 1;
        }
        Some(n)
    }

    /// The most pieces any one chunk of `chunk_bytes` has (what a table slot must hold), in one
    /// pass over the runs.
    pub fn max_chunk_pieces(&self, chunk_bytes: u32) -> usize {
        let c = u64::from(chunk_bytes);
        let (mut best, mut chunk, mut count) = (0usize, 0u64, 0usize);
        for (i, r) in self.runs.iter().enumerate() {
            let end = self.runs.get(i + 1).map_or(self.total, |n| n.wire);
            let (first, last) = (r.wire / c, (end - 1) / c);
            if first != chunk {
                best = best.max(count);
                count = 0;
            }
            // The run is a piece of every chunk from `first` to `last`.
            count += 1;
            if last != first {
                best = best.max(count);
                count = 1;
            }
            chunk = last;
        }
        best.max(count)
    }

    /// Writes chunk `k`'s table into `out` (cleared first; its capacity is kept across chunks).
    pub fn chunk_into(&self, chunk_bytes: u32, k: u64, out: &mut Vec<Segment>) {
        out.clear();
        out.extend(self.chunk(chunk_bytes, k));
    }
}

/// The pieces of a wire range on one side ([`SidePlan::pieces`]).
#[derive(Debug, Clone)]
pub struct Pieces<'a> {
    runs: &'a [Run],
    total: u64,
    run: usize,
    pos: u64,
    end: u64,
    base: u64,
}

impl Iterator for Pieces<'_> {
    type Item = Segment;

    #[inline]
    fn next(&mut self) -> Option<Segment> {
        if self.pos >= self.end {
            return None;
        }
        let r = self.runs[self.run];
        let run_end = self.runs.get(self.run + 1).map_or(self.total, |n| n.wire);
        let stop = run_end.min(self.end);
        let seg = Segment {
            offset: r.offset + (self.pos - r.wire),
            wire: (self.pos - self.base) as u32,
            len: (stop - self.pos) as u32,
        };
        self.pos = stop;
        if stop == run_end {
            self.run += 1;
        }
        Some(seg)
    }
}

/// Checks a transfer's two sides against each other, both lists known (the sender of a WRITE
/// when the token told it the remote lengths are uniform, a READ's holder, tests): the same
/// number of blocks, each pair equal in length, every index inside its list. Returns the total
/// bytes. The error names the first bad index.
pub fn check_pairs(
    src: (&BlockList, &IndexArray, &str),
    dst: (&BlockList, &IndexArray, &str),
) -> Result<u64, BlockError> {
    let (sl, si, sf) = src;
    let (dl, di, df) = dst;
    for (idx, f) in [(si, sf), (di, df)] {
        if idx.count() > MAX_TRANSFER_BLOCKS {
            return Err(BlockError::TooMany {
                field: f.to_string(),
                count: idx.count(),
                limit: MAX_TRANSFER_BLOCKS,
            });
        }
    }
    if si.count() != di.count() {
        return Err(BlockError::CountMismatch {
            field: df.to_string(),
            got: di.count(),
            other: sf.to_string(),
            want: si.count(),
        });
    }
    let past = |f: &str, at: usize, index: u32, len: u32| BlockError::PastList {
        field: f.to_string(),
        at: at as u64,
        index: index.into(),
        len,
    };
    let mut total = 0u64;
    for (at, (s, d)) in si.iter().zip(di.iter()).enumerate() {
        let (_, slen) = sl.block(s).ok_or_else(|| past(sf, at, s, sl.len()))?;
        let (_, dlen) = dl.block(d).ok_or_else(|| past(df, at, d, dl.len()))?;
        if slen != dlen {
            return Err(BlockError::LengthMismatch {
                field: df.to_string(),
                at: at as u64,
                index: d,
                len: dlen,
                partner: slen,
            });
        }
        total += u64::from(slen);
    }
    Ok(total)
}
