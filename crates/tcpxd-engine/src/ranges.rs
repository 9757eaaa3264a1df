//! An offer's ranges and a READ request's pairs as the engine keeps them: one [`RemoteRange`]
//! (or [`ReadPair`]) each, or packed ([`PackedRanges`]: one buffer, one key, offsets and lengths
//! as packed little-endian arrays).
//!
//! A plain batch of one buffer pair (the API's `BatchRanges`, issue 38) stays packed from the
//! client's request to the peer's plan: the offsets the client sent are the bytes the offer
//! carries on the wire, and the receiver walks them in place, where the per-range form built and
//! dropped a 48-byte `RemoteRange` per entry on each side (three vectors of 3 MiB for 65,536
//! entries on a READ's way). Both forms read alike through [`Ranges::iter`].

use crate::packed_ranges::PackedRanges;
use crate::wire::{ReadPair, RemoteRange};

/// An offer's (or header's) ranges on the receiving node, in entry order.
#[derive(Debug, Clone)]
pub enum Ranges {
    Each(Vec<RemoteRange>),
    Packed(PackedRanges),
}

impl Default for Ranges {
    fn default() -> Self {
        Ranges::Each(Vec::new())
    }
}

impl From<Vec<RemoteRange>> for Ranges {
    fn from(v: Vec<RemoteRange>) -> Self {
        Ranges::Each(v)
    }
}

impl FromIterator<RemoteRange> for Ranges {
    fn from_iter<I: IntoIterator<Item = RemoteRange>>(it: I) -> Self {
        Ranges::Each(it.into_iter().collect())
    }
}

impl Ranges {
    /// The per-range form, to change ranges one by one (packed ranges are unpacked first).
    pub fn to_each(&mut self) -> &mut Vec<RemoteRange> {
        if let Ranges::Packed(p) = self {
            *self = Ranges::Each(p.unpack());
        }
        match self {
            Ranges::Each(v) => v,
            Ranges::Packed(_) => unreachable!("unpacked above"),
        }
    }

    /// How many ranges.
    pub fn len(&self) -> usize {
        match self {
            Ranges::Each(v) => v.len(),
            Ranges::Packed(p) => p.len(),
        }
    }

    /// No ranges (a block offer's).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Range `i`, when there is one.
    pub fn get(&self, i: usize) -> Option<RemoteRange> {
        match self {
            Ranges::Each(v) => v.get(i).cloned(),
            Ranges::Packed(p) => (i < p.len()).then(|| p.range(i)),
        }
    }

    /// The first range.
    pub fn first(&self) -> Option<RemoteRange> {
        self.get(0)
    }

    /// The ranges in order, by value (a packed range is read from its arrays as it is visited).
    pub fn iter(&self) -> Iter<'_> {
        match self {
            Ranges::Each(v) => Iter::Each(v.iter()),
            Ranges::Packed(p) => Iter::Packed { p, at: 0 },
        }
    }

    /// The buffers the ranges name, in order: one a range, or once for packed ranges (all in
    /// one buffer). For questions about which buffers (all GPU memory? any unknown?), without a
    /// pass over 65,536 packed ranges.
    pub fn buffers(&self) -> impl Iterator<Item = u64> + '_ {
        let (each, packed) = match self {
            Ranges::Each(v) => (Some(v.iter().map(|r| r.buffer_id)), None),
            Ranges::Packed(p) => (None, Some(p.buffer_id)),
        };
        each.into_iter().flatten().chain(packed)
    }

    /// The sum of the lengths, `None` when it overflows.
    pub fn total(&self) -> Option<u64> {
        match self {
            Ranges::Packed(p) => p.total(),
            Ranges::Each(v) => v.iter().try_fold(0u64, |t, r| t.checked_add(r.length)),
        }
    }

    /// The buffer and key every range names, when they all name one (always, packed).
    pub fn one_buffer(&self) -> Option<(u64, [u8; 16])> {
        match self {
            Ranges::Packed(p) => Some((p.buffer_id, p.access_key)),
            Ranges::Each(v) => {
                let first = v.first()?;
                v.iter()
                    .all(|r| r.buffer_id == first.buffer_id && r.access_key == first.access_key)
                    .then_some((first.buffer_id, first.access_key))
            }
        }
    }

    /// The packed form, when these are ranges of one buffer under one key (moved when already
    /// packed); `None` otherwise.
    pub fn into_packed(self) -> Result<PackedRanges, Vec<RemoteRange>> {
        match self {
            Ranges::Packed(p) => Ok(p),
            Ranges::Each(v) => PackedRanges::pack(&v).ok_or(v),
        }
    }
}

/// Equal when they are the same ranges in the same order, whatever the form (two packed arrays
/// are compared as bytes when both give their lengths alike).
impl PartialEq for Ranges {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Ranges::Each(a), Ranges::Each(b)) => a == b,
            (Ranges::Packed(a), Ranges::Packed(b)) if a.lengths == b.lengths => a == b,
            _ => self.len() == other.len() && self.iter().eq(other.iter()),
        }
    }
}

impl Eq for Ranges {}

/// [`Ranges::iter`].
#[derive(Debug, Clone)]
pub enum Iter<'a> {
    Each(std::slice::Iter<'a, RemoteRange>),
    Packed { p: &'a PackedRanges, at: usize },
}

impl Iterator for Iter<'_> {
    type Item = RemoteRange;

    fn next(&mut self) -> Option<RemoteRange> {
        match self {
            Iter::Each(it) => it.next().cloned(),
            Iter::Packed { p, at } => {
                if *at >= p.len() {
                    return None;
                }
                *at += 1;
                Some(p.range(*at - 1))
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = match self {
            Iter::Each(it) => it.len(),
            Iter::Packed { p, at } => p.len() - *at,
        };
        (n, Some(n))
    }
}

impl ExactSizeIterator for Iter<'_> {}

/// A plain READ request's pairs: one [`ReadPair`] each, or two packed arrays of equal count
/// (sources in one buffer of the holder, destinations in one of the reader's).
#[derive(Debug, Clone)]
pub enum ReadPairs {
    Each(Vec<ReadPair>),
    Packed {
        source: PackedRanges,
        dest: PackedRanges,
    },
}

impl Default for ReadPairs {
    fn default() -> Self {
        ReadPairs::Each(Vec::new())
    }
}

impl From<Vec<ReadPair>> for ReadPairs {
    fn from(v: Vec<ReadPair>) -> Self {
        ReadPairs::Each(v)
    }
}

impl ReadPairs {
    /// How many pairs (a packed request's sources; its destinations are as many once parsed).
    pub fn len(&self) -> usize {
        match self {
            ReadPairs::Each(v) => v.len(),
            ReadPairs::Packed { source, .. } => source.len(),
        }
    }

    /// No pairs (a block READ's request).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Pair `i`, when there is one.
    pub fn get(&self, i: usize) -> Option<ReadPair> {
        match self {
            ReadPairs::Each(v) => v.get(i).cloned(),
            ReadPairs::Packed { source, dest } => (i < source.len() && i < dest.len()).then(|| ReadPair {
                source: source.range(i),
                dest: dest.range(i),
            }),
        }
    }

    /// The sources and the destinations, each in entry order.
    pub fn split(self) -> (Ranges, Ranges) {
        match self {
            ReadPairs::Each(v) => {
                let (s, d): (Vec<RemoteRange>, Vec<RemoteRange>) =
                    v.into_iter().map(|p| (p.source, p.dest)).unzip();
                (Ranges::Each(s), Ranges::Each(d))
            }
            ReadPairs::Packed { source, dest } => (Ranges::Packed(source), Ranges::Packed(dest)),
        }
    }
}

/// Equal when they are the same pairs in the same order, whatever the form.
impl PartialEq for ReadPairs {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (ReadPairs::Each(a), ReadPairs::Each(b)) => a == b,
            (ReadPairs::Packed { source: s1, dest: d1 }, ReadPairs::Packed { source: s2, dest: d2 })
                if s1.lengths == s2.lengths && d1.lengths == d2.lengths =>
            {
                s1 == s2 && d1 == d2
            }
            _ => self.len() == other.len() && (0..self.len()).all(|i| self.get(i) == other.get(i)),
        }
    }
}

impl Eq for ReadPairs {}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(offset: u64, length: u64) -> RemoteRange {
        RemoteRange {
            buffer_id: 4,
            access_key: [9; 16],
            offset,
            length,
        }
    }

    /// Both forms read alike, compare alike, and a per-range list of one buffer packs.
    #[test]
    fn packed_and_per_range_forms_read_and_compare_alike() {
        let v: Vec<RemoteRange> = (0..100).map(|i| range((99 - i) * 4096, 4096)).collect();
        let each = Ranges::from(v.clone());
        let packed = Ranges::Packed(PackedRanges::pack(&v).unwrap());
        assert_eq!(packed.len(), 100);
        assert_eq!(packed.iter().collect::<Vec<_>>(), v);
        assert_eq!(packed.iter().len(), 100);
        assert_eq!(packed.get(3), Some(range(96 * 4096, 4096)));
        assert_eq!(packed.get(100), None);
        assert_eq!(each, packed);
        assert_eq!(packed, each);
        assert_eq!(packed.one_buffer(), Some((4, [9; 16])));
        assert_eq!(
            each.clone().into_packed().unwrap(),
            PackedRanges::pack(&v).unwrap()
        );
        let mut other = v.clone();
        other[50].offset += 1;
        assert_ne!(Ranges::Packed(PackedRanges::pack(&other).unwrap()), packed);
        let mut two = v;
        two[7].buffer_id = 5;
        assert_eq!(Ranges::from(two.clone()).one_buffer(), None);
        assert!(Ranges::from(two).into_packed().is_err());
        assert!(Ranges::default().is_empty());
    }

    /// Packed pairs split into their two sides without a pair each.
    #[test]
    fn packed_pairs_split_into_two_sides() {
        let s: Vec<RemoteRange> = (0..10).map(|i| range(i * 10, 10)).collect();
        let d: Vec<RemoteRange> = (0..10)
            .map(|i| RemoteRange {
                buffer_id: 8,
                access_key: [1; 16],
                offset: (9 - i) * 10,
                length: 10,
            })
            .collect();
        let pairs = ReadPairs::Packed {
            source: PackedRanges::pack(&s).unwrap(),
            dest: PackedRanges::pack(&d).unwrap(),
        };
        assert_eq!(pairs.len(), 10);
        assert_eq!(pairs.get(2).unwrap().dest, d[2]);
        let (src, dst) = pairs.split();
        assert_eq!((src, dst), (Ranges::from(s), Ranges::from(d)));
    }
}
