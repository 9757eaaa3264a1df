//! Chunk plans: how a transfer's ranges are cut into plugin requests and spread over lanes.
//!
//! Sender and receiver compute the same plan from the same inputs (range lengths, chunk size,
//! first lane, and the lane range the transfer's protocol uses), so an offer needs to carry only
//! those.

use std::ops::Range;

/// Default chunk size: GCP's `NCCL_DYNAMIC_CHUNK_SIZE`, 512 KiB.
pub const DEFAULT_CHUNK_BYTES: u32 = 512 * 1024;
/// Largest chunk: one plugin request must stay ≤ 4 MiB (2048 fragments of at most 4 KiB, 2 per page).
pub const MAX_CHUNK_BYTES: u32 = 4 * 1024 * 1024;
/// Smallest chunk accepted in configuration or offers.
pub const MIN_CHUNK_BYTES: u32 = 4096;

/// Checks a chunk size against the limits.
pub fn check_chunk_bytes(bytes: u64) -> Result<u32, String> {
    if (u64::from(MIN_CHUNK_BYTES)..=u64::from(MAX_CHUNK_BYTES)).contains(&bytes) {
        Ok(bytes as u32)
    } else {
        Err(format!(
            "chunk size {bytes} is outside {MIN_CHUNK_BYTES}..={MAX_CHUNK_BYTES} bytes"
        ))
    }
}

/// Chunks per lane a spread transfer aims at by default ([`spread_chunk_bytes`]'s `per_lane`;
/// `transfer.spread_chunks_per_lane`).
pub const SPREAD_CHUNKS_PER_LANE: u32 = 2;
/// The most chunks per lane a spread plan may aim at (`transfer.spread_chunks_per_lane`).
pub const MAX_SPREAD_CHUNKS_PER_LANE: u32 = 16;

/// The chunk size a transfer of `range_lengths` over `lanes` lanes takes when spread: `chunk_bytes`
/// halved (kept a multiple of 4 KiB) while the plan would have fewer than `per_lane` chunks per
/// lane ([`SPREAD_CHUNKS_PER_LANE`] by default, at least 1) and the half stays at least `min_chunk`. A 1 MiB
/// transfer over two lanes at 512 KiB is one request per lane, each on one of the plugin's data
/// sockets (its `NCCL_DYNAMIC_CHUNK_SIZE` is 512 KiB): spread at 256 KiB it is two per lane, on
/// four sockets, and each chunk's unpack starts while the next lands. `min_chunk` 0: off (the
/// chunk size as given); a transfer already cut into enough chunks, or too small to halve, keeps
/// `chunk_bytes`.
pub fn spread_chunk_bytes(
    range_lengths: &[u64],
    chunk_bytes: u32,
    lanes: u32,
    min_chunk: u32,
    per_lane: u32,
) -> u32 {
    let mut c = chunk_bytes;
    if min_chunk == 0 || range_lengths.iter().all(|&l| l == 0) {
        return c;
    }
    let want = u64::from(per_lane.max(1)) * u64::from(lanes.max(1));
    while ChunkPlan::count(range_lengths, c) < want {
        let half = (c / 2) & !(MIN_CHUNK_BYTES - 1);
        if half < min_chunk.max(MIN_CHUNK_BYTES) {
            break;
        }
        c = half;
    }
    // Halving that cut nothing more (a transfer smaller than the floor) keeps the size as given.
    if ChunkPlan::count(range_lengths, c) == ChunkPlan::count(range_lengths, chunk_bytes) {
        return chunk_bytes;
    }
    c
}

/// One plugin request's worth of a transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// Index of the range (entry) this chunk belongs to.
    pub range: u32,
    /// Offset of the chunk inside its range.
    pub offset: u64,
    pub len: u32,
    /// Lane index.
    pub lane: u32,
}

/// Where a [`ChunkPlan`] stands between two chunks (plain data, kept by a streamed transfer).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChunkCursor {
    range: usize,
    offset: u64,
    lane: u32,
}

/// Iterates the chunks of `range_lengths` cut at `chunk_bytes` over the lanes `lanes` (a range
/// of lane indices: all of a peer's lanes, or only its eager or its rendezvous ones), the k-th
/// chunk on lane `lanes.start + (first_lane - lanes.start + k) % lanes.len()`. `first_lane` is a
/// lane index (not an offset into the range). Allocation-free; both sides run the same iterator.
#[derive(Debug, Clone)]
pub struct ChunkPlan<'a> {
    ranges: &'a [u64],
    chunk_bytes: u64,
    base: u32,
    lanes: u32,
    range: usize,
    offset: u64,
    /// Offset of the next chunk's lane inside the range.
    lane: u32,
}

impl<'a> ChunkPlan<'a> {
    /// `lanes` must not be empty, `chunk_bytes` positive, and `first_lane` inside `lanes`
    /// (checked by the caller's validation; one outside is taken modulo the range's length).
    pub fn new(
        range_lengths: &'a [u64],
        chunk_bytes: u32,
        first_lane: u32,
        lanes: Range<u32>,
    ) -> ChunkPlan<'a> {
        let count = lanes.end.saturating_sub(lanes.start);
        assert!(
            count > 0 && chunk_bytes > 0,
            "a plan needs lanes and a chunk size"
        );
        ChunkPlan {
            ranges: range_lengths,
            chunk_bytes: u64::from(chunk_bytes),
            base: lanes.start,
            lanes: count,
            range: 0,
            offset: 0,
            lane: first_lane.saturating_sub(lanes.start) % count,
        }
    }

    /// Where the plan stands: what [`ChunkPlan::resume`] needs to go on from the next chunk (a
    /// streamed header's next chunks, announced later).
    pub fn cursor(&self) -> ChunkCursor {
        ChunkCursor {
            range: self.range,
            offset: self.offset,
            lane: self.lane,
        }
    }

    /// The plan of [`ChunkPlan::new`] with the same lengths, chunk size and lanes, from `at` on
    /// (a cursor one of its own plans gave; the first lane is in it).
    pub fn resume(
        range_lengths: &'a [u64],
        chunk_bytes: u32,
        lanes: Range<u32>,
        at: ChunkCursor,
    ) -> ChunkPlan<'a> {
        let mut plan = ChunkPlan::new(range_lengths, chunk_bytes, lanes.start, lanes);
        plan.range = at.range;
        plan.offset = at.offset;
        plan.lane = at.lane % plan.lanes;
        plan
    }

    /// Number of chunks the plan yields.
    pub fn count(range_lengths: &[u64], chunk_bytes: u32) -> u64 {
        range_lengths
            .iter()
            .map(|&l| l.div_ceil(u64::from(chunk_bytes)))
            .sum()
    }
}

impl Iterator for ChunkPlan<'_> {
    type Item = Chunk;

    fn next(&mut self) -> Option<Chunk> {
        while self.range < self.ranges.len() && self.offset >= self.ranges[self.range] {
            self.range += 1;
            self.offset = 0;
        }
        let total = *self.ranges.get(self.range)?;
        let len = (total - self.offset).min(self.chunk_bytes);
        let chunk = Chunk {
            range: self.range as u32,
            offset: self.offset,
            len: len as u32,
            lane: self.base + self.lane,
        };
        self.offset += len;
        self.lane = (self.lane + 1) % self.lanes;
        Some(chunk)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_ranges_and_rotates_lanes_across_them() {
        let chunks: Vec<Chunk> = ChunkPlan::new(&[10, 4, 0, 7], 4, 1, 0..3).collect();
        let got: Vec<(u32, u64, u32, u32)> = chunks
            .iter()
            .map(|c| (c.range, c.offset, c.len, c.lane))
            .collect();
        assert_eq!(
            got,
            vec![
                (0, 0, 4, 1),
                (0, 4, 4, 2),
                (0, 8, 2, 0),
                (1, 0, 4, 1),
                (3, 0, 4, 2),
                (3, 4, 3, 0)
            ]
        );
        assert_eq!(ChunkPlan::count(&[10, 4, 0, 7], 4), 6);
    }

    #[test]
    fn covers_every_byte_exactly_once() {
        let ranges = [1u64, 4095, 4096, 4097, 3 * 524288 + 5];
        for chunk in [4096u32, 524288, MAX_CHUNK_BYTES] {
            let mut covered = vec![0u64; ranges.len()];
            for c in ChunkPlan::new(&ranges, chunk, 0, 0..4) {
                assert!(c.len > 0 && c.len <= chunk);
                assert_eq!(
                    c.offset, covered[c.range as usize],
                    "chunks of a range are contiguous and ordered"
                );
                covered[c.range as usize] += u64::from(c.len);
            }
            assert_eq!(covered, ranges);
            assert_eq!(
                ChunkPlan::new(&ranges, chunk, 0, 0..4).count() as u64,
                ChunkPlan::count(&ranges, chunk)
            );
        }
    }

    #[test]
    fn a_plan_resumed_from_its_cursor_goes_on_where_it_stood() {
        let ranges = [10u64, 4, 0, 7];
        let whole: Vec<Chunk> = ChunkPlan::new(&ranges, 4, 5, 4..7).collect();
        for cut in 0..=whole.len() {
            let mut plan = ChunkPlan::new(&ranges, 4, 5, 4..7);
            let mut got: Vec<Chunk> = plan.by_ref().take(cut).collect();
            got.extend(ChunkPlan::resume(&ranges, 4, 4..7, plan.cursor()));
            assert_eq!(got, whole, "cut after {cut} chunks");
        }
    }

    #[test]
    fn first_lane_wraps_and_single_lane_works() {
        let lanes: Vec<u32> = ChunkPlan::new(&[12], 4, 7, 0..4).map(|c| c.lane).collect();
        assert_eq!(lanes, vec![3, 0, 1]);
        assert!(ChunkPlan::new(&[9], 4, 5, 0..1).all(|c| c.lane == 0));
        assert_eq!(ChunkPlan::new(&[], 4, 0, 0..1).count(), 0);
    }

    #[test]
    fn a_lane_range_keeps_every_chunk_inside_it() {
        // Lanes 4..7 of a peer (say its eager ones): the rotation starts at first_lane and wraps
        // inside the range, never onto lanes 0..4.
        let lanes: Vec<u32> = ChunkPlan::new(&[20], 4, 5, 4..7).map(|c| c.lane).collect();
        assert_eq!(lanes, vec![5, 6, 4, 5, 6]);
        assert!(ChunkPlan::new(&[9], 4, 6, 6..7).all(|c| c.lane == 6));
        // Both sides of a pairing run the same plan from the same inputs.
        let a: Vec<Chunk> = ChunkPlan::new(&[7, 13], 4, 2, 0..3).collect();
        let b: Vec<Chunk> = ChunkPlan::new(&[7, 13], 4, 2, 0..3).collect();
        assert_eq!(a, b);
        assert!(a.iter().all(|c| c.lane < 3));
    }
}
