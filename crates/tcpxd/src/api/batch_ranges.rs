//! A plain batch of one buffer pair as packed arrays (`BatchRanges`, issue 38): one descriptor
//! parsed, one local buffer looked up, three arrays checked in one pass, and handed to the engine
//! still packed (`engine::PackedBatch`): no entry object per range here, in the engine or on the
//! peer wire. The same transfer as the same entries given one message each, without the
//! per-entry strings, messages, objects and statuses that made a batch of many small entries
//! cost ~3× its block-list twin.

use tonic::Status;

use super::proto::v1 as pb;
use super::state::{DaemonState, status};
use crate::buffers::Descriptor;
use crate::engine::{self, PackedBatch, PackedRanges, RangeLengths};

/// The arrays of a `BatchRanges`, read and checked for shape (not yet against any buffer).
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Ranges<'a> {
    local: &'a [u8],
    remote: &'a [u8],
    lengths: Lengths<'a>,
}

#[derive(Debug, PartialEq, Eq)]
enum Lengths<'a> {
    Uniform(u64),
    Each(&'a [u8]),
}

fn u64_at(b: &[u8], k: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[k * 8..k * 8 + 8]);
    u64::from_le_bytes(a)
}

impl<'a> Ranges<'a> {
    /// Reads the arrays' shape: whole 8-byte values, 1 to `limit` entries, equal counts, exactly
    /// one of `lengths` and `uniform_length`. The error names the field and the limit.
    pub(crate) fn read(r: &'a pb::BatchRanges, limit: usize) -> Result<Ranges<'a>, String> {
        let count = |field: &str, b: &[u8]| -> Result<usize, String> {
            if b.len() % 8 != 0 {
                return Err(format!(
                    "ranges.{field}: {} bytes is not a whole number of 8-byte little-endian values",
                    b.len()
                ));
            }
            Ok(b.len() / 8)
        };
        let n = count("local_offsets", &r.local_offsets)?;
        if n == 0 {
            return Err("ranges.local_offsets: at least one entry is required".into());
        }
        if n > limit {
            return Err(format!(
                "ranges.local_offsets: {n} entries exceed the limit of {limit}"
            ));
        }
        let m = count("remote_offsets", &r.remote_offsets)?;
        if m != n {
            return Err(format!(
                "ranges.remote_offsets: {m} offsets, but local_offsets has {n}"
            ));
        }
        let lengths = match (r.lengths.is_empty(), r.uniform_length) {
            (true, 0) => {
                return Err(
                    "ranges.uniform_length: give each entry's length in `lengths` or one for all here (at least 1 byte)"
                        .into(),
                );
            }
            (true, l) => Lengths::Uniform(l),
            (false, 0) => {
                let k = count("lengths", &r.lengths)?;
                if k != n {
                    return Err(format!("ranges.lengths: {k} lengths, but local_offsets has {n}"));
                }
                Lengths::Each(&r.lengths)
            }
            (false, _) => {
                return Err("ranges.lengths: give `lengths` or `uniform_length`, not both".into());
            }
        };
        Ok(Ranges {
            local: &r.local_offsets,
            remote: &r.remote_offsets,
            lengths,
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.local.len() / 8
    }

    /// Entry `k`: (local offset, remote offset, length).
    pub(crate) fn get(&self, k: usize) -> (u64, u64, u64) {
        let len = match self.lengths {
            Lengths::Uniform(l) => l,
            Lengths::Each(b) => u64_at(b, k),
        };
        (u64_at(self.local, k), u64_at(self.remote, k), len)
    }

    /// Checks every entry against the two buffers' sizes (lengths at least 1, both ranges
    /// inside), naming the first bad one (`ranges.local_offsets[k]`, `ranges.lengths[k]`, …).
    pub(crate) fn check(&self, local_size: u64, remote_size: u64) -> Result<u64, String> {
        let length_field = |k: usize| match self.lengths {
            Lengths::Uniform(_) => "ranges.uniform_length".to_string(),
            Lengths::Each(_) => format!("ranges.lengths[{k}]"),
        };
        let mut total = 0u64;
        for k in 0..self.len() {
            let (lo, ro, len) = self.get(k);
            if len == 0 {
                return Err(format!("{}: must be at least 1 byte", length_field(k)));
            }
            for (field, what, size, off) in [
                ("local_offsets", "the local buffer", local_size, lo),
                ("remote_offsets", "the remote buffer", remote_size, ro),
            ] {
                if off.checked_add(len).is_none_or(|end| end > size)
                    && let Some(why) = engine::range_fault(
                        &format!("ranges.{field}[{k}]"),
                        &length_field(k),
                        what,
                        size,
                        off,
                        len,
                    )
                {
                    return Err(why);
                }
            }
            total = total.saturating_add(len);
        }
        Ok(total)
    }
}

impl DaemonState {
    /// The engine's packed batch of a `BatchRanges`: its arrays read, its one local buffer and
    /// one descriptor resolved, every entry checked against both buffers in one pass. The arrays
    /// go to the engine as they came (copied once, no entry objects). Returns the total bytes.
    /// `parsed`: its descriptor already parsed, if it was (else parsed here).
    pub(crate) fn packed_batch(
        &self,
        r: &pb::BatchRanges,
        parsed: Option<Descriptor>,
    ) -> Result<(PackedBatch, u64), Status> {
        let ranges = Ranges::read(r, engine::DEFAULT_MAX_ENTRIES).map_err(Status::invalid_argument)?;
        let local = self
            .buffers
            .get_as("ranges.local_buffer_id", r.local_buffer_id)
            .map_err(status)?;
        const FIELD: &str = "ranges.remote_descriptor";
        let (peer, d) = match parsed {
            Some(d) => {
                self.not_this_node(&d, || FIELD.to_string())?;
                (self.peer_of(FIELD, &d.node_id)?, d)
            }
            None => self.remote_buffer(FIELD, &r.remote_descriptor)?,
        };
        let total = ranges
            .check(local.size, d.size)
            .map_err(Status::invalid_argument)?;
        let lengths = match ranges.lengths {
            Lengths::Uniform(l) => RangeLengths::Uniform(l),
            Lengths::Each(b) => RangeLengths::Each(b.to_vec()),
        };
        let batch = PackedBatch {
            local_buffer: r.local_buffer_id,
            local_offsets: ranges.local.to_vec(),
            peer,
            remote: PackedRanges {
                buffer_id: d.buffer_id,
                access_key: d.key,
                offsets: ranges.remote.to_vec(),
                lengths,
            },
        };
        Ok((batch, total))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packed(v: &[u64]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn ranges(local: &[u64], remote: &[u64], lengths: &[u64], uniform: u64) -> pb::BatchRanges {
        pb::BatchRanges {
            local_buffer_id: 1,
            remote_descriptor: String::new(),
            local_offsets: packed(local),
            remote_offsets: packed(remote),
            lengths: packed(lengths),
            uniform_length: uniform,
        }
    }

    #[test]
    fn arrays_read_back_entry_by_entry() {
        let r = ranges(&[0, 4096, 100], &[8192, 0, 5], &[], 4096);
        let x = Ranges::read(&r, 10).unwrap();
        assert_eq!(x.len(), 3);
        assert_eq!(x.get(1), (4096, 0, 4096));
        let r = ranges(&[0, 10], &[20, 30], &[10, 7], 0);
        let x = Ranges::read(&r, 10).unwrap();
        assert_eq!((x.get(0), x.get(1)), ((0, 20, 10), (10, 30, 7)));
        assert_eq!(x.check(100, 100), Ok(17));
    }

    #[test]
    fn bad_shapes_are_refused_naming_the_field() {
        let refused = |r: pb::BatchRanges, limit: usize, want: &str| {
            let e = Ranges::read(&r, limit).unwrap_err();
            assert!(e.starts_with(want), "{e}");
        };
        let mut odd = ranges(&[0], &[0], &[], 1);
        odd.local_offsets.push(0);
        refused(odd, 10, "ranges.local_offsets: 9 bytes");
        refused(ranges(&[], &[], &[], 1), 10, "ranges.local_offsets: at least one");
        refused(
            ranges(&[0; 11], &[0; 11], &[], 1),
            10,
            "ranges.local_offsets: 11 entries exceed the limit of 10",
        );
        refused(
            ranges(&[0, 1], &[0], &[], 1),
            10,
            "ranges.remote_offsets: 1 offsets, but local_offsets has 2",
        );
        refused(ranges(&[0], &[0], &[], 0), 10, "ranges.uniform_length");
        refused(ranges(&[0], &[0], &[1], 1), 10, "ranges.lengths: give");
        refused(
            ranges(&[0, 1], &[0, 1], &[1], 0),
            10,
            "ranges.lengths: 1 lengths, but local_offsets has 2",
        );
    }

    #[test]
    fn entries_past_either_buffer_or_empty_are_refused_naming_the_entry() {
        let check = |r: pb::BatchRanges| Ranges::read(&r, 10).unwrap().check(100, 50).unwrap_err();
        let e = check(ranges(&[0, 95], &[0, 0], &[], 10));
        assert!(
            e.starts_with("ranges.local_offsets[1]: 10 bytes from offset 95"),
            "{e}"
        );
        let e = check(ranges(&[0, 0], &[0, 45], &[], 10));
        assert!(
            e.starts_with("ranges.remote_offsets[1]: 10 bytes from offset 45"),
            "{e}"
        );
        let e = check(ranges(&[0, 0], &[0, 0], &[5, 0], 0));
        assert_eq!(e, "ranges.lengths[1]: must be at least 1 byte");
        let e = check(ranges(&[0], &[0], &[], 60));
        assert!(
            e.starts_with("ranges.uniform_length: 60 bytes is more than the remote buffer holds"),
            "{e}"
        );
        let e = check(ranges(&[u64::MAX], &[0], &[], 2));
        assert!(e.contains("overflows 64 bits"), "{e}");
    }
}
