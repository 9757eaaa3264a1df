//! Ranges of one buffer under one key as the peer wire carries them (peer protocol 6,
//! `tcpxd.peer.v1.PackedRanges`): the buffer id and key once, then the offsets and lengths as
//! packed little-endian `u64` arrays (the lengths as one number when they are all equal).
//!
//! An offer or eager header of a plain batch of one buffer pair (`Offer.packed`) and a READ's
//! request (`ReadRequest.packed_source` / `packed_dest`) use it instead of a `RemoteRange`
//! message per entry: 65,536 ranges of 4 KiB are 512 KiB of offsets and one length, where the
//! per-range form is ~2.6 MB of messages that each carry the key again. The engine keeps its
//! ranges as [`RemoteRange`]s; [`PackedRanges::parse`] reads the wire bytes, refusing anything
//! that cannot be a range (naming the field and the limit), and [`PackedRanges::unpack`]
//! expands them. Whether a range lies inside the receiver's buffer is checked afterwards exactly
//! as for the per-range form (`Engine::check_claimed`), before anything is posted or lands.

use crate::wire::RemoteRange;

/// A packed range array's lengths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RangeLengths {
    /// Every range is this long (at least 1 byte).
    Uniform(u64),
    /// A little-endian `u64` per range, as many as offsets, each at least 1.
    Each(Vec<u8>),
}

/// Ranges of one buffer under one key, packed (see the module's documentation).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedRanges {
    pub buffer_id: u64,
    pub access_key: [u8; 16],
    /// A little-endian `u64` per range, in entry order.
    pub offsets: Vec<u8>,
    pub lengths: RangeLengths,
}

fn u64_at(bytes: &[u8], i: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[i * 8..i * 8 + 8]);
    u64::from_le_bytes(b)
}

impl PackedRanges {
    /// The packed form of `ranges`, when there is at least one and they all name one buffer
    /// under one key, none of zero bytes; `None` otherwise (the per-range form carries them).
    pub fn pack(ranges: &[RemoteRange]) -> Option<PackedRanges> {
        Self::pack_iter(ranges.iter())
    }

    /// [`pack`](Self::pack) over any walk of the ranges (a READ's sources or destinations);
    /// `ranges` is walked at most three times.
    pub fn pack_iter<'a, I>(ranges: I) -> Option<PackedRanges>
    where
        I: Iterator<Item = &'a RemoteRange> + Clone,
    {
        let first = ranges.clone().next()?;
        let (mut n, mut uniform) = (0usize, true);
        for r in ranges.clone() {
            // A zero-byte range (a notification alone, `notice.rs`) goes as itself: the packed
            // form's lengths are at least 1 (`uniform_length` 0 means "each given").
            if r.buffer_id != first.buffer_id || r.access_key != first.access_key || r.length == 0 {
                return None;
            }
            uniform &= r.length == first.length;
            n += 1;
        }
        let mut offsets = Vec::with_capacity(n * 8);
        let mut each = Vec::with_capacity(if uniform { 0 } else { n * 8 });
        for r in ranges {
            offsets.extend_from_slice(&r.offset.to_le_bytes());
            if !uniform {
                each.extend_from_slice(&r.length.to_le_bytes());
            }
        }
        Some(PackedRanges {
            buffer_id: first.buffer_id,
            access_key: first.access_key,
            offsets,
            lengths: if uniform {
                RangeLengths::Uniform(first.length)
            } else {
                RangeLengths::Each(each)
            },
        })
    }

    /// Reads packed ranges as they came off the wire (`field`: where they sit, e.g. `packed`),
    /// refusing, with the field and the limit named: a key that is not 16 bytes, offsets or
    /// lengths that are not whole `u64`s, no range or more than `limit`, lengths given both as
    /// `uniform_length` and `lengths` or neither, a count of lengths that differs from the
    /// offsets', a range of 0 bytes, and a range whose end does not fit in a `u64`. Nothing is
    /// allocated before the count is known to be within `limit`.
    pub fn parse(
        field: &str,
        buffer_id: u64,
        access_key: &[u8],
        offsets: Vec<u8>,
        lengths: Vec<u8>,
        uniform_length: u64,
        limit: usize,
    ) -> Result<PackedRanges, String> {
        let access_key: [u8; 16] = access_key
            .try_into()
            .map_err(|_| format!("{field}.access_key: {} bytes, expected 16", access_key.len()))?;
        if offsets.len() % 8 != 0 {
            return Err(format!(
                "{field}.offsets: {} bytes are not a whole number of u64 offsets",
                offsets.len()
            ));
        }
        let n = offsets.len() / 8;
        if n == 0 || n > limit {
            return Err(format!("{field}.offsets: {n} ranges (1 to {limit} allowed)"));
        }
        let lengths = match (uniform_length, lengths.is_empty()) {
            (0, true) => {
                return Err(format!(
                    "{field}.uniform_length: 0 and no lengths (give one of the two)"
                ));
            }
            (u, true) => RangeLengths::Uniform(u),
            (0, false) if lengths.len() % 8 != 0 => {
                return Err(format!(
                    "{field}.lengths: {} bytes are not a whole number of u64 lengths",
                    lengths.len()
                ));
            }
            (0, false) if lengths.len() / 8 != n => {
                return Err(format!(
                    "{field}.lengths: {} lengths for {n} offsets (one per range)",
                    lengths.len() / 8
                ));
            }
            (0, false) => RangeLengths::Each(lengths),
            (u, false) => {
                return Err(format!(
                    "{field}.lengths: given with uniform_length {u} (give one of the two)"
                ));
            }
        };
        let p = PackedRanges {
            buffer_id,
            access_key,
            offsets,
            lengths,
        };
        for i in 0..n {
            let (offset, length) = (u64_at(&p.offsets, i), p.length(i));
            if length == 0 {
                return Err(format!("{field}.lengths[{i}]: 0 (a range is at least 1 byte)"));
            }
            if offset.checked_add(length).is_none() {
                return Err(format!(
                    "{field}.offsets[{i}]: offset {offset} + length {length} exceeds 2^64 - 1"
                ));
            }
        }
        Ok(p)
    }

    /// The offsets as little-endian `u32` slots of the uniform length (offset = slot × length),
    /// when every range has one length and every offset is a multiple of it below 2^32 slots:
    /// half the bytes of the `u64` offsets on the wire (peer protocol 9's
    /// `PackedRanges.offset_slots`; a plain batch of 4 KiB entries is usually that, as a block
    /// list's `u32` indices are). `None` otherwise (the `u64` offsets go).
    pub fn offset_slots(&self) -> Option<Vec<u8>> {
        let RangeLengths::Uniform(u) = self.lengths else {
            return None;
        };
        if u == 0 {
            return None;
        }
        // Filled as it goes, not zeroed first: `vec![0; n]` is a `calloc`, which glibc serves
        // past its per-thread cache (the poller makes one a header; session 29, readside).
        let mut slots = Vec::with_capacity(self.len() * 4);
        // One pass, no division per range where the length is a power of two (4 KiB, 16 KiB
        // blocks): a shift and a mask.
        let (shift, mask) = (u.trailing_zeros(), u.wrapping_sub(1));
        let pow2 = u.is_power_of_two();
        for c in self.offsets.chunks_exact(8) {
            let o = u64::from_le_bytes(c.try_into().expect("8 bytes"));
            let slot = if pow2 {
                if o & mask != 0 {
                    return None;
                }
                o >> shift
            } else {
                let q = o / u;
                if q * u != o {
                    return None;
                }
                q
            };
            slots.extend_from_slice(&u32::try_from(slot).ok()?.to_le_bytes());
        }
        Some(slots)
    }

    /// The `u64` offsets of `offset_slots` as they came off the wire (`field`: where they sit),
    /// for [`parse`](Self::parse): each slot × `uniform_length`. Refused, naming the field and
    /// the limit: slots that are not whole `u32`s, no slot or more than `limit` (nothing is
    /// allocated before), no `uniform_length`, and a product that does not fit in a `u64`.
    pub fn offsets_from_slots(
        field: &str,
        slots: &[u8],
        uniform_length: u64,
        limit: usize,
    ) -> Result<Vec<u8>, String> {
        if slots.len() % 4 != 0 {
            return Err(format!(
                "{field}.offset_slots: {} bytes are not a whole number of u32 slots",
                slots.len()
            ));
        }
        let n = slots.len() / 4;
        if n == 0 || n > limit {
            return Err(format!("{field}.offset_slots: {n} ranges (1 to {limit} allowed)"));
        }
        if uniform_length == 0 {
            return Err(format!(
                "{field}.offset_slots: given without uniform_length (slots are in units of it)"
            ));
        }
        // Filled as it goes (not a zeroing `calloc`: see `offset_slots`).
        let mut offsets = Vec::with_capacity(n * 8);
        for (i, c) in slots.chunks_exact(4).enumerate() {
            let slot = u64::from(u32::from_le_bytes(c.try_into().expect("4 bytes")));
            let o = slot.checked_mul(uniform_length).ok_or_else(|| {
                format!("{field}.offset_slots[{i}]: slot {slot} × uniform_length {uniform_length} exceeds 2^64 - 1")
            })?;
            offsets.extend_from_slice(&o.to_le_bytes());
        }
        Ok(offsets)
    }

    /// How many ranges.
    pub fn len(&self) -> usize {
        self.offsets.len() / 8
    }

    /// No ranges (never, once parsed).
    pub fn is_empty(&self) -> bool {
        self.offsets.is_empty()
    }

    /// The sum of the lengths, `None` when it overflows.
    pub fn total(&self) -> Option<u64> {
        match &self.lengths {
            RangeLengths::Uniform(l) => l.checked_mul(self.len() as u64),
            RangeLengths::Each(b) => b.chunks_exact(8).try_fold(0u64, |t, c| {
                t.checked_add(u64::from_le_bytes(c.try_into().expect("8 bytes")))
            }),
        }
    }

    /// The lengths all equal, when they are (`Uniform`, or `Each` of one value).
    pub fn uniform_length(&self) -> Option<u64> {
        match &self.lengths {
            RangeLengths::Uniform(l) => Some(*l),
            RangeLengths::Each(b) => {
                let first = b.get(..8)?;
                b.chunks_exact(8).all(|c| c == first).then(|| u64_at(b, 0))
            }
        }
    }

    /// Range `i`'s length (`i < len()`).
    pub fn length(&self, i: usize) -> u64 {
        match &self.lengths {
            RangeLengths::Uniform(l) => *l,
            RangeLengths::Each(b) => u64_at(b, i),
        }
    }

    /// Range `i`'s offset (`i < len()`).
    pub fn offset(&self, i: usize) -> u64 {
        u64_at(&self.offsets, i)
    }

    /// (offset, length) of every range, in order.
    pub fn spans(&self) -> impl ExactSizeIterator<Item = (u64, u64)> + Clone + '_ {
        (0..self.len()).map(|i| (self.offset(i), self.length(i)))
    }

    /// Range `i` (`i < len()`).
    pub fn range(&self, i: usize) -> RemoteRange {
        RemoteRange {
            buffer_id: self.buffer_id,
            access_key: self.access_key,
            offset: u64_at(&self.offsets, i),
            length: self.length(i),
        }
    }

    /// The ranges, in entry order.
    pub fn unpack(&self) -> Vec<RemoteRange> {
        (0..self.len()).map(|i| self.range(i)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(buffer_id: u64, key: u8, offset: u64, length: u64) -> RemoteRange {
        RemoteRange {
            buffer_id,
            access_key: [key; 16],
            offset,
            length,
        }
    }

    fn parse(p: &PackedRanges, limit: usize) -> Result<PackedRanges, String> {
        let (lengths, uniform) = match &p.lengths {
            RangeLengths::Uniform(u) => (Vec::new(), *u),
            RangeLengths::Each(b) => (b.clone(), 0),
        };
        PackedRanges::parse(
            "packed",
            p.buffer_id,
            &p.access_key,
            p.offsets.clone(),
            lengths,
            uniform,
            limit,
        )
    }

    /// Ranges of one buffer and key survive packing and parsing, uniform lengths as one number.
    #[test]
    fn ranges_of_one_buffer_round_trip_uniform_or_not() {
        let uniform: Vec<RemoteRange> = (0..1000).map(|i| range(3, 7, (999 - i) * 4096, 4096)).collect();
        let p = PackedRanges::pack(&uniform).unwrap();
        assert_eq!(p.lengths, RangeLengths::Uniform(4096));
        assert_eq!(p.offsets.len(), 8000);
        assert_eq!(parse(&p, 65_536).unwrap().unpack(), uniform);

        let each: Vec<RemoteRange> = (0..1000).map(|i| range(3, 7, i * 10_000, 1 + i * 7)).collect();
        let p = PackedRanges::pack(&each).unwrap();
        assert!(matches!(p.lengths, RangeLengths::Each(ref b) if b.len() == 8000));
        assert_eq!(parse(&p, 65_536).unwrap().unpack(), each);

        let big = vec![range(1, 1, u64::MAX - 5, 5)];
        assert_eq!(
            parse(&PackedRanges::pack(&big).unwrap(), 1).unwrap().unpack(),
            big
        );
    }

    /// Two buffers, or two keys, or none: the per-range form carries them.
    /// Offsets that are multiples of a uniform length travel as u32 slots (half the bytes) and
    /// come back exactly; anything else (a length that differs, an offset off the grid, a slot
    /// past 2^32) keeps u64 offsets; malformed slots are refused naming the field and limit.
    #[test]
    fn offsets_on_a_uniform_grid_travel_as_u32_slots() {
        let mut rng = tcpxd_testkit::Rng::new(9);
        for (len, n) in [
            (4096u64, 65_536usize),
            (16_384, 100),
            (1, 7),
            (3, 1),
            (18_432, 300),
        ] {
            let ranges: Vec<RemoteRange> = (0..n)
                .map(|_| range(4, 1, rng.below(1 << 20) * len, len))
                .collect();
            let p = PackedRanges::pack(&ranges).unwrap();
            let slots = p.offset_slots().expect("a uniform grid");
            assert_eq!(slots.len(), n * 4, "half the bytes of u64 offsets");
            let offsets = PackedRanges::offsets_from_slots("packed", &slots, len, 65_536).unwrap();
            assert!(offsets == p.offsets);
            let back = PackedRanges::parse("packed", 4, &[1; 16], offsets, Vec::new(), len, 65_536).unwrap();
            assert_eq!(back, p);
            assert!(back.unpack() == ranges);
        }
        // Not on a grid: u64 offsets stay.
        let off_grid = [range(4, 1, 0, 4096), range(4, 1, 4097, 4096)];
        assert!(PackedRanges::pack(&off_grid).unwrap().offset_slots().is_none());
        let off_odd_grid = [
            range(4, 1, 18_432 * 5, 18_432),
            range(4, 1, 18_432 * 7 + 512, 18_432),
        ];
        assert!(
            PackedRanges::pack(&off_odd_grid)
                .unwrap()
                .offset_slots()
                .is_none()
        );
        let mixed = [range(4, 1, 0, 4096), range(4, 1, 8192, 8192)];
        assert!(PackedRanges::pack(&mixed).unwrap().offset_slots().is_none());
        let far = [range(4, 1, (1u64 << 32) * 2, 2)];
        assert!(PackedRanges::pack(&far).unwrap().offset_slots().is_none());
        let last = [range(4, 1, ((1u64 << 32) - 1) * 2, 2)];
        assert_eq!(
            PackedRanges::pack(&last).unwrap().offset_slots().unwrap(),
            u32::MAX.to_le_bytes().to_vec()
        );
        // Malformed slots.
        let cases: [(&[u8], u64, usize, &str); 5] = [
            (
                &[1, 0, 0],
                4096,
                8,
                "packed.offset_slots: 3 bytes are not a whole number of u32 slots",
            ),
            (&[], 4096, 8, "packed.offset_slots: 0 ranges (1 to 8 allowed)"),
            (
                &[0; 12],
                4096,
                2,
                "packed.offset_slots: 3 ranges (1 to 2 allowed)",
            ),
            (&[0; 4], 0, 8, "packed.offset_slots: given without uniform_length"),
            (
                &[0, 0, 0, 0, 255, 255, 255, 255],
                u64::MAX / 2,
                8,
                "packed.offset_slots[1]: slot 4294967295 × uniform_length",
            ),
        ];
        for (slots, u, limit, want) in cases {
            let e = PackedRanges::offsets_from_slots("packed", slots, u, limit).unwrap_err();
            assert!(e.starts_with(want), "{e}");
        }
    }

    #[test]
    fn ranges_of_two_buffers_or_keys_are_not_packed() {
        assert!(PackedRanges::pack(&[]).is_none());
        assert!(PackedRanges::pack(&[range(1, 1, 0, 1), range(2, 1, 8, 1)]).is_none());
        assert!(PackedRanges::pack(&[range(1, 1, 0, 1), range(1, 2, 8, 1)]).is_none());
    }

    /// Every malformed field is refused naming the field and the limit.
    #[test]
    fn malformed_packed_ranges_are_refused_naming_the_field() {
        let ok = |offsets: Vec<u8>, lengths: Vec<u8>, uniform: u64| {
            PackedRanges::parse("packed", 1, &[0; 16], offsets, lengths, uniform, 4)
        };
        let le = |v: &[u64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let cases: Vec<(Result<PackedRanges, String>, &str)> = vec![
            (
                PackedRanges::parse("packed", 1, &[0; 15], le(&[0]), Vec::new(), 1, 4),
                "packed.access_key: 15 bytes, expected 16",
            ),
            (
                ok(vec![0; 12], Vec::new(), 1),
                "packed.offsets: 12 bytes are not a whole number of u64 offsets",
            ),
            (
                ok(Vec::new(), Vec::new(), 1),
                "packed.offsets: 0 ranges (1 to 4 allowed)",
            ),
            (
                ok(le(&[0; 5]), Vec::new(), 1),
                "packed.offsets: 5 ranges (1 to 4 allowed)",
            ),
            (
                ok(le(&[0]), Vec::new(), 0),
                "packed.uniform_length: 0 and no lengths (give one of the two)",
            ),
            (
                ok(le(&[0]), vec![1; 7], 0),
                "packed.lengths: 7 bytes are not a whole number of u64 lengths",
            ),
            (
                ok(le(&[0, 8]), le(&[1]), 0),
                "packed.lengths: 1 lengths for 2 offsets (one per range)",
            ),
            (
                ok(le(&[0]), le(&[1]), 1),
                "packed.lengths: given with uniform_length 1 (give one of the two)",
            ),
            (
                ok(le(&[0, 8]), le(&[1, 0]), 0),
                "packed.lengths[1]: 0 (a range is at least 1 byte)",
            ),
            (
                ok(le(&[0, u64::MAX]), Vec::new(), 2),
                "packed.offsets[1]: offset 18446744073709551615 + length 2 exceeds 2^64 - 1",
            ),
        ];
        for (got, want) in cases {
            assert_eq!(got.unwrap_err(), want);
        }
        assert_eq!(ok(le(&[0; 4]), Vec::new(), 1).unwrap().len(), 4);
    }
}
