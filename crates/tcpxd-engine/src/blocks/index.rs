//! Index arrays: which blocks of a list a transfer moves, as packed bytes.

use super::{BlockError, MAX_TRANSFER_BLOCKS};

/// How an index array's bytes are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexEncoding {
    /// One little-endian `u32` per block.
    U32Le,
    /// Little-endian `(start, count)` pairs of `u32`s: blocks `start..start + count`.
    Ranges,
}

/// A transfer's block indices on one side, as they travel: packed bytes, well formed (whole
/// entries, no empty range, at most [`MAX_TRANSFER_BLOCKS`] blocks, no range past `u32`).
/// Whether they lie inside a list is checked against it ([`IndexArray::check`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexArray {
    encoding: IndexEncoding,
    bytes: Vec<u8>,
    count: u64,
}

impl IndexArray {
    /// Takes packed bytes as received; `field` names them in the error.
    pub fn parse(encoding: IndexEncoding, bytes: Vec<u8>, field: &str) -> Result<IndexArray, BlockError> {
        let malformed = |why: String| BlockError::Malformed {
            field: field.to_string(),
            why,
        };
        let count = match encoding {
            IndexEncoding::U32Le => {
                if bytes.len() % 4 != 0 {
                    return Err(malformed(format!(
                        "{} bytes are not a whole number of 4-byte indices",
                        bytes.len()
                    )));
                }
                (bytes.len() / 4) as u64
            }
            IndexEncoding::Ranges => {
                if bytes.len() % 8 != 0 {
                    return Err(malformed(format!(
                        "{} bytes are not a whole number of 8-byte (start, count) ranges",
                        bytes.len()
                    )));
                }
                let mut total = 0u64;
                for (r, pair) in bytes.chunks_exact(8).enumerate() {
                    let (start, n) = split(pair);
                    if n == 0 {
                        return Err(malformed(format!("range {r} ({start}, 0) is empty")));
                    }
                    if u64::from(start) + u64::from(n) > 1 << 32 {
                        return Err(malformed(format!(
                            "range {r} ({start}, {n}) runs past block {}",
                            u32::MAX
                        )));
                    }
                    total += u64::from(n);
                    if total > MAX_TRANSFER_BLOCKS {
                        break;
                    }
                }
                total
            }
        };
        if count > MAX_TRANSFER_BLOCKS {
            return Err(BlockError::TooMany {
                field: field.to_string(),
                count,
                limit: MAX_TRANSFER_BLOCKS,
            });
        }
        if count == 0 {
            return Err(BlockError::Empty {
                field: field.to_string(),
            });
        }
        Ok(IndexArray {
            encoding,
            bytes,
            count,
        })
    }

    /// Packs explicit indices (little-endian `u32`s).
    pub fn from_indices(indices: &[u32]) -> IndexArray {
        let mut bytes = Vec::with_capacity(indices.len() * 4);
        for i in indices {
            bytes.extend_from_slice(&i.to_le_bytes());
        }
        IndexArray {
            encoding: IndexEncoding::U32Le,
            bytes,
            count: indices.len() as u64,
        }
    }

    /// Packs `(start, count)` ranges. Ranges with a count of 0 are dropped.
    pub fn from_ranges(ranges: &[(u32, u32)]) -> IndexArray {
        let mut bytes = Vec::with_capacity(ranges.len() * 8);
        let mut count = 0;
        for &(s, n) in ranges.iter().filter(|r| r.1 > 0) {
            bytes.extend_from_slice(&s.to_le_bytes());
            bytes.extend_from_slice(&n.to_le_bytes());
            count += u64::from(n);
        }
        IndexArray {
            encoding: IndexEncoding::Ranges,
            bytes,
            count,
        }
    }

    /// An empty ranges-encoded array to append to ([`IndexArray::push_range`]).
    pub fn ranges_with_capacity(ranges: usize) -> IndexArray {
        IndexArray {
            encoding: IndexEncoding::Ranges,
            bytes: Vec::with_capacity(ranges * 8),
            count: 0,
        }
    }

    /// Appends `count` indices from `first` to a ranges-encoded array, merged into its last range
    /// when they continue it (as [`IndexArray::from_ranges`] of the ranges so far would be, with
    /// consecutive ones merged); a count of 0 adds nothing.
    pub fn push_range(&mut self, first: u32, count: u32) {
        debug_assert_eq!(self.encoding, IndexEncoding::Ranges);
        if count == 0 {
            return;
        }
        self.count += u64::from(count);
        let len = self.bytes.len();
        if len >= 8 {
            let (s, n) = split(&self.bytes[len - 8..]);
            if u64::from(s) + u64::from(n) == u64::from(first)
                && let Some(merged) = n.checked_add(count)
            {
                self.bytes[len - 4..].copy_from_slice(&merged.to_le_bytes());
                return;
            }
        }
        self.bytes.extend_from_slice(&first.to_le_bytes());
        self.bytes.extend_from_slice(&count.to_le_bytes());
    }

    /// Packs indices in whichever encoding is smaller (ranges when runs of consecutive indices
    /// make up for their 8 bytes).
    pub fn compact(indices: &[u32]) -> IndexArray {
        let mut ranges: Vec<(u32, u32)> = Vec::new();
        for &i in indices {
            match ranges.last_mut() {
                Some((s, n)) if u64::from(*s) + u64::from(*n) == u64::from(i) && *n < u32::MAX => *n += 1,
                _ => {
                    if (ranges.len() + 1) * 8 >= indices.len() * 4 {
                        return IndexArray::from_indices(indices);
                    }
                    ranges.push((i, 1));
                }
            }
        }
        IndexArray::from_ranges(&ranges)
    }

    pub fn encoding(&self) -> IndexEncoding {
        self.encoding
    }

    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Number of blocks named.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// The indices, in order. Allocation-free.
    pub fn iter(&self) -> IndexIter<'_> {
        IndexIter {
            encoding: self.encoding,
            bytes: &self.bytes,
            pos: 0,
            next: 0,
            left: 0,
        }
    }

    /// Checks every index against a list of `list_len` blocks; the error names the first one past
    /// it (its position in the flattened array).
    pub fn check(&self, list_len: u32, field: &str) -> Result<(), BlockError> {
        let past = |at: u64, index: u64| BlockError::PastList {
            field: field.to_string(),
            at,
            index,
            len: list_len,
        };
        match self.encoding {
            IndexEncoding::U32Le => {
                // One compare per index, branch-free in the loop; the position only on failure.
                let max = self
                    .bytes
                    .chunks_exact(4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .max()
                    .unwrap_or(0);
                if max >= list_len {
                    let at = self
                        .iter()
                        .position(|i| i >= list_len)
                        .expect("some index is past");
                    let index = self.iter().nth(at).expect("in range");
                    return Err(past(at as u64, index.into()));
                }
            }
            IndexEncoding::Ranges => {
                let mut at = 0u64;
                for pair in self.bytes.chunks_exact(8) {
                    let (start, n) = split(pair);
                    let end = u64::from(start) + u64::from(n);
                    if end > u64::from(list_len) {
                        let first_bad = u64::from(start.max(list_len));
                        return Err(past(at + (first_bad - u64::from(start)), first_bad));
                    }
                    at += u64::from(n);
                }
            }
        }
        Ok(())
    }

    /// Checks that no block is named twice (for a destination: two pairs would write the same
    /// bytes). One bit per block of the list, `list_len` already checked.
    /// Costs O(n log n) in the entries given (ranges or indices) when they are few against the
    /// list, else one bit per block of the list; the exact error is found only on failure.
    pub fn check_distinct(&self, list_len: u32, field: &str) -> Result<(), BlockError> {
        if self.distinct_by_sorting(list_len) == Some(true) {
            return Ok(());
        }
        self.check_distinct_bitmap(list_len, field)
    }

    /// `Some(true)` when no block repeats, found by sorting the entries (ranges by start, or
    /// sparse indices); `None` when a bitmap is the cheaper test or a repeat was seen (the
    /// bitmap pass then names it).
    fn distinct_by_sorting(&self, list_len: u32) -> Option<bool> {
        match self.encoding {
            IndexEncoding::Ranges => {
                if self.ranges_ascending() {
                    return Some(true);
                }
                let mut ranges: Vec<(u32, u32)> = self.bytes.chunks_exact(8).map(split).collect();
                ranges.sort_unstable();
                let mut end = 0u64;
                for (start, n) in ranges {
                    if u64::from(start) < end {
                        return None;
                    }
                    end = u64::from(start) + u64::from(n);
                }
                Some(true)
            }
            IndexEncoding::U32Le => {
                // A bitmap costs list_len / 8 bytes to clear; sorting, n log n for n indices.
                let n = self.bytes.len() / 4;
                if (n as u64).saturating_mul(64) >= u64::from(list_len) {
                    return None;
                }
                let mut v: Vec<u32> = self.iter().collect();
                v.sort_unstable();
                v.windows(2).all(|w| w[0] != w[1]).then_some(true)
            }
        }
    }

    pub(crate) fn check_distinct_bitmap(&self, list_len: u32, field: &str) -> Result<(), BlockError> {
        let mut seen = vec![0u64; (list_len as usize).div_ceil(64)];
        for (at, i) in self.iter().enumerate() {
            let (w, b) = ((i / 64) as usize, i % 64);
            if seen[w] & (1 << b) != 0 {
                let first = self.iter().position(|j| j == i).expect("seen before") as u64;
                return Err(BlockError::Duplicate {
                    field: field.to_string(),
                    at: at as u64,
                    index: i,
                    first,
                });
            }
            seen[w] |= 1 << b;
        }
        Ok(())
    }

    /// Ranges that each start past the previous one's end cannot repeat a block.
    /// The `(start, count)` ranges, when the array is RANGES-encoded.
    pub fn ranges(&self) -> Option<impl Iterator<Item = (u32, u32)> + '_> {
        (self.encoding == IndexEncoding::Ranges).then(|| self.bytes.chunks_exact(8).map(split))
    }

    fn ranges_ascending(&self) -> bool {
        let mut end = 0u64;
        for pair in self.bytes.chunks_exact(8) {
            let (start, n) = split(pair);
            if u64::from(start) < end {
                return false;
            }
            end = u64::from(start) + u64::from(n);
        }
        true
    }
}

fn split(pair: &[u8]) -> (u32, u32) {
    (
        u32::from_le_bytes([pair[0], pair[1], pair[2], pair[3]]),
        u32::from_le_bytes([pair[4], pair[5], pair[6], pair[7]]),
    )
}

/// The indices of an [`IndexArray`], in order.
#[derive(Debug, Clone)]
pub struct IndexIter<'a> {
    encoding: IndexEncoding,
    bytes: &'a [u8],
    /// Byte position of the next entry.
    pos: usize,
    /// Ranges: the next index of the current range, and how many are left in it.
    next: u32,
    left: u32,
}

impl Iterator for IndexIter<'_> {
    type Item = u32;

    #[inline]
    fn next(&mut self) -> Option<u32> {
        match self.encoding {
            IndexEncoding::U32Le => {
                let b = self.bytes.get(self.pos..self.pos + 4)?;
                self.pos += 4;
                Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            }
            IndexEncoding::Ranges => {
                while self.left == 0 {
                    let pair = self.bytes.get(self.pos..self.pos + 8)?;
                    self.pos += 8;
                    (self.next, self.left) = split(pair);
                }
                let i = self.next;
                self.left -= 1;
                self.next = self.next.wrapping_add(1);
                Some(i)
            }
        }
    }
}
