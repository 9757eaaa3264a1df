//! A registered list of blocks inside one buffer.

use super::{BlockError, MAX_LIST_BLOCKS};

/// How a list's blocks are stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Layout {
    /// `count` blocks of `len` bytes, block i at `first + i * stride`.
    Strided {
        first: u64,
        stride: u64,
        len: u32,
        count: u32,
    },
    /// Blocks of `len` bytes at the given offsets.
    Uniform { offsets: Vec<u64>, len: u32 },
    /// Block i at `offsets[i]`, `lens[i]` bytes long.
    Explicit { offsets: Vec<u64>, lens: Vec<u32> },
}

impl Layout {
    /// The most compact layout for these blocks: strided when the offsets step evenly and the
    /// lengths agree, uniform when only the lengths agree, explicit otherwise. `lens` has one
    /// length per offset, or a single length for every block. Lengths must fit 32 bits.
    pub fn compact(offsets: Vec<u64>, lens: &[u64]) -> Result<Layout, BlockError> {
        let field = || "lengths".to_string();
        if lens.len() != 1 && lens.len() != offsets.len() {
            return Err(BlockError::Malformed {
                field: field(),
                why: format!(
                    "{} lengths for {} offsets (give one per offset, or one for all)",
                    lens.len(),
                    offsets.len()
                ),
            });
        }
        if offsets.len() > MAX_LIST_BLOCKS as usize {
            return Err(BlockError::TooMany {
                field: "offsets".into(),
                count: offsets.len() as u64,
                limit: MAX_LIST_BLOCKS.into(),
            });
        }
        let mut narrow = Vec::new();
        for (i, &l) in lens.iter().enumerate() {
            if l > u64::from(u32::MAX) {
                return Err(BlockError::BadBlock {
                    field: field(),
                    at: i as u64,
                    why: format!("{l} bytes exceed the limit of {} bytes per block", u32::MAX),
                });
            }
            narrow.push(l as u32);
        }
        let uniform = narrow.iter().all(|&l| l == narrow[0]);
        if !uniform {
            return Ok(Layout::Explicit {
                offsets,
                lens: narrow,
            });
        }
        let len = narrow.first().copied().unwrap_or(0);
        if offsets.len() >= 2 && offsets[1] > offsets[0] {
            let stride = offsets[1] - offsets[0];
            let strided = offsets.windows(2).all(|w| w[1].checked_sub(w[0]) == Some(stride));
            if strided {
                return Ok(Layout::Strided {
                    first: offsets[0],
                    stride,
                    len,
                    count: offsets.len() as u32,
                });
            }
        }
        if offsets.len() == 1 {
            return Ok(Layout::Strided {
                first: offsets[0],
                stride: u64::from(len),
                len,
                count: 1,
            });
        }
        Ok(Layout::Uniform { offsets, len })
    }

    fn count(&self) -> usize {
        match self {
            Layout::Strided { count, .. } => *count as usize,
            Layout::Uniform { offsets, .. } => offsets.len(),
            Layout::Explicit { offsets, .. } => offsets.len(),
        }
    }
}

/// A list of blocks inside a buffer, checked once at registration: every block lies inside the
/// buffer, none is empty, none overlaps another. It belongs to its buffer (released or rekeyed
/// with it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockList {
    id: u64,
    buffer: u64,
    buffer_len: u64,
    layout: Layout,
}

impl BlockList {
    /// Registers `layout` inside buffer `buffer` of `buffer_len` bytes as list `id`. The error
    /// names the first bad block and the limit it broke.
    pub fn new(id: u64, buffer: u64, buffer_len: u64, layout: Layout) -> Result<BlockList, BlockError> {
        let count = layout.count();
        if count == 0 {
            return Err(BlockError::Empty {
                field: "offsets".into(),
            });
        }
        if count > MAX_LIST_BLOCKS as usize {
            return Err(BlockError::TooMany {
                field: "offsets".into(),
                count: count as u64,
                limit: MAX_LIST_BLOCKS.into(),
            });
        }
        let bad = |at: usize, why: String| BlockError::BadBlock {
            field: "offsets".into(),
            at: at as u64,
            why,
        };
        let in_buffer = |at: usize, off: u64, len: u32| -> Result<(), BlockError> {
            if len == 0 {
                return Err(bad(at, "a block must be at least 1 byte long".into()));
            }
            match off.checked_add(u64::from(len)) {
                Some(end) if end <= buffer_len => Ok(()),
                _ => Err(bad(
                    at,
                    format!("offset {off} + length {len} exceeds the buffer's {buffer_len} bytes"),
                )),
            }
        };
        match &layout {
            Layout::Strided {
                first,
                stride,
                len,
                count,
            } => {
                in_buffer(0, *first, *len)?;
                if *count > 1 {
                    if *stride < u64::from(*len) {
                        return Err(bad(
                            1,
                            format!("blocks of {len} bytes every {stride} bytes overlap"),
                        ));
                    }
                    let last = u64::from(*count - 1);
                    let off = stride
                        .checked_mul(last)
                        .and_then(|s| s.checked_add(*first))
                        .ok_or_else(|| bad(last as usize, "offset overflows 64 bits".into()))?;
                    in_buffer(last as usize, off, *len)?;
                }
            }
            Layout::Uniform { offsets, len } => {
                for (i, &o) in offsets.iter().enumerate() {
                    in_buffer(i, o, *len)?;
                }
                check_overlap(offsets, |_| *len)?;
            }
            Layout::Explicit { offsets, lens } => {
                if lens.len() != offsets.len() {
                    return Err(BlockError::Malformed {
                        field: "lengths".into(),
                        why: format!("{} lengths for {} offsets", lens.len(), offsets.len()),
                    });
                }
                for (i, (&o, &l)) in offsets.iter().zip(lens).enumerate() {
                    in_buffer(i, o, l)?;
                }
                check_overlap(offsets, |i| lens[i])?;
            }
        }
        Ok(BlockList {
            id,
            buffer,
            buffer_len,
            layout,
        })
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// The buffer the list lies in.
    pub fn buffer(&self) -> u64 {
        self.buffer
    }

    pub fn buffer_len(&self) -> u64 {
        self.buffer_len
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// Number of blocks (at least 1).
    pub fn len(&self) -> u32 {
        self.layout.count() as u32
    }

    /// Never true: a list has at least one block.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The length of every block, when they are all equal.
    pub fn uniform_len(&self) -> Option<u32> {
        match &self.layout {
            Layout::Strided { len, .. } | Layout::Uniform { len, .. } => Some(*len),
            Layout::Explicit { .. } => None,
        }
    }

    /// Block `i`'s (offset, length), or `None` past the list.
    #[inline]
    pub fn block(&self, i: u32) -> Option<(u64, u32)> {
        match &self.layout {
            Layout::Strided {
                first,
                stride,
                len,
                count,
            } => (i < *count).then(|| (first + stride * u64::from(i), *len)),
            Layout::Uniform { offsets, len } => offsets.get(i as usize).map(|&o| (o, *len)),
            Layout::Explicit { offsets, lens } => {
                let i = i as usize;
                Some((*offsets.get(i)?, *lens.get(i)?))
            }
        }
    }

    /// Bytes of memory the list's storage takes (for the registry's accounting).
    pub fn storage_bytes(&self) -> usize {
        match &self.layout {
            Layout::Strided { .. } => 0,
            Layout::Uniform { offsets, .. } => offsets.len() * 8,
            Layout::Explicit { offsets, .. } => offsets.len() * 12,
        }
    }
}

/// Refuses blocks that overlap: sorts the block numbers by offset once (registration only) and
/// compares neighbours. The error names the later block of the first overlapping pair found.
fn check_overlap(offsets: &[u64], len: impl Fn(usize) -> u32) -> Result<(), BlockError> {
    if offsets.windows(2).all(|w| w[0] < w[1]) {
        // Already in order (the usual case): one pass, no allocation.
        for i in 1..offsets.len() {
            if offsets[i - 1] + u64::from(len(i - 1)) > offsets[i] {
                return Err(overlap(i - 1, i));
            }
        }
        return Ok(());
    }
    let mut order: Vec<u32> = (0..offsets.len() as u32).collect();
    order.sort_unstable_by_key(|&i| (offsets[i as usize], i));
    for w in order.windows(2) {
        let (a, b) = (w[0] as usize, w[1] as usize);
        if offsets[a] + u64::from(len(a)) > offsets[b] {
            return Err(overlap(a.min(b), a.max(b)));
        }
    }
    Ok(())
}

fn overlap(a: usize, b: usize) -> BlockError {
    BlockError::BadBlock {
        field: "offsets".into(),
        at: b as u64,
        why: format!("block {b} overlaps block {a}"),
    }
}
