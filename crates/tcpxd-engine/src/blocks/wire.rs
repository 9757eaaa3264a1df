//! What a block transfer's receiver is told, and its check before anything lands.

use super::{BlockError, BlockList, IndexArray, MAX_TRANSFER_BLOCKS, SidePlan};

/// The sender's block lengths, pair by pair: one number when every block it sends has the same
/// length (the usual KV-cache case), else one little-endian `u32` per block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PairLengths {
    Uniform(u32),
    Each(Vec<u8>),
}

impl PairLengths {
    /// The lengths of `indices` in `list` (checked against it), as compact as they go.
    pub fn of(list: &BlockList, indices: &IndexArray, field: &str) -> Result<PairLengths, BlockError> {
        if let Some(len) = list.uniform_len() {
            indices.check(list.len(), field)?;
            return Ok(PairLengths::Uniform(len));
        }
        let mut bytes = Vec::with_capacity(indices.count() as usize * 4);
        let mut first = None;
        let mut uniform = true;
        for (at, i) in indices.iter().enumerate() {
            let (_, len) = list.block(i).ok_or_else(|| BlockError::PastList {
                field: field.to_string(),
                at: at as u64,
                index: i.into(),
                len: list.len(),
            })?;
            uniform &= *first.get_or_insert(len) == len;
            bytes.extend_from_slice(&len.to_le_bytes());
        }
        Ok(match first {
            Some(len) if uniform => PairLengths::Uniform(len),
            _ => PairLengths::Each(bytes),
        })
    }

    /// The length of pair `at` (`Each`: `None` past its end).
    #[inline]
    pub fn get(&self, at: u64) -> Option<u32> {
        match self {
            PairLengths::Uniform(l) => Some(*l),
            PairLengths::Each(b) => {
                let at = usize::try_from(at).ok()?.checked_mul(4)?;
                let w = b.get(at..at + 4)?;
                Some(u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
            }
        }
    }

    /// How many lengths an `Each` carries (`None` for `Uniform`, which fits any count), or an
    /// error when its bytes are not whole `u32`s.
    fn count(&self) -> Result<Option<u64>, String> {
        match self {
            PairLengths::Uniform(_) => Ok(None),
            PairLengths::Each(b) if b.len() % 4 == 0 => Ok(Some((b.len() / 4) as u64)),
            PairLengths::Each(b) => Err(format!("{} bytes are not a whole number of u32 lengths", b.len())),
        }
    }
}

/// The block part of a header (eager) or offer (rendezvous) towards the node that receives the
/// data: the receiver's list and key (from its token), its indices, the sender's lengths, the
/// total bytes. Chunk size and first lane travel as for any offer; the chunks are those of one
/// range of `total` bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockHeader {
    pub list_id: u64,
    pub access_key: [u8; 16],
    pub indices: IndexArray,
    pub lengths: PairLengths,
    pub total: u64,
}

impl BlockHeader {
    /// The receiver's check, against its own `list` (found by `list_id`; its key compared by the
    /// caller, which owns the keys): the indices lie in the list, there are as many lengths as
    /// indices, each of its blocks is exactly as long as the sender's, no block is named twice,
    /// and the lengths add up to `total`. On success, the plan its segment tables come from; on
    /// failure nothing may land (the error names the first bad index).
    pub fn validate(&self, list: &BlockList, into: &mut SidePlan) -> Result<(), BlockError> {
        const F: &str = "indices";
        let n = self.indices.count();
        if n > MAX_TRANSFER_BLOCKS {
            return Err(BlockError::TooMany {
                field: F.into(),
                count: n,
                limit: MAX_TRANSFER_BLOCKS,
            });
        }
        match self.lengths.count() {
            Err(why) => {
                return Err(BlockError::Malformed {
                    field: "lengths".into(),
                    why,
                });
            }
            Ok(Some(m)) if m != n => {
                return Err(BlockError::CountMismatch {
                    field: F.into(),
                    got: n,
                    other: "lengths".into(),
                    want: m,
                });
            }
            Ok(_) => {}
        }
        self.indices.check_distinct_after(list, F)?;
        let lengths = &self.lengths;
        if let (PairLengths::Uniform(partner), Some(len)) = (lengths, list.uniform_len())
            && *partner == len
        {
            // Every block as long as the sender's: nothing to compare per block.
            into.rebuild_checked(list, &self.indices, F)?;
        } else {
            into.rebuild(list, &self.indices, F, |at, index, len| {
                let partner = lengths.get(at).unwrap_or(0);
                if partner != len {
                    return Err(BlockError::LengthMismatch {
                        field: F.into(),
                        at,
                        index,
                        len,
                        partner,
                    });
                }
                Ok(())
            })?;
        }
        if into.total() != self.total {
            let total = into.total();
            *into = SidePlan::default();
            return Err(BlockError::Malformed {
                field: "total".into(),
                why: format!(
                    "the header says {} bytes, but its {n} blocks hold {total}",
                    self.total
                ),
            });
        }
        Ok(())
    }
}

impl IndexArray {
    /// Indices inside `list` and none repeated (a destination's check).
    fn check_distinct_after(&self, list: &BlockList, field: &str) -> Result<(), BlockError> {
        self.check(list.len(), field)?;
        self.check_distinct(list.len(), field)
    }
}
