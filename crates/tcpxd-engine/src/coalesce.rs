//! Coalesced plain batches, and the queue items of planned offers.
//!
//! A peer's share of a WRITE (or the holder's offer for a READ) whose entries all lie in one
//! buffer on each side and are, on average, shorter than a chunk goes out as one coalesced offer
//! (`Offer::coalesced`): the ranges travel as always, but the wire stream is their bytes end to
//! end, cut into chunks as one range of their total, so many small entries share a chunk. Each
//! side plans its own half (`SidePlan::rebuild_ranges`, neighbours merged); a chunk that is one
//! piece on a side is an ordinary post there, one of several pieces is gathered (sender) or
//! scattered (receiver). Block transfers use the same items (`block_transfers.rs`).

use super::blocks::SidePlan;
use super::*;

/// Whether a peer's share of a batch goes out coalesced: more than one entry, every local entry
/// in one buffer (`one_local`), every remote range in one buffer under one key, and the mean
/// entry shorter than `chunk_bytes`.
pub(super) fn should_coalesce<'a>(
    one_local: bool,
    remote: impl IntoIterator<Item = &'a RemoteRange>,
    chunk_bytes: u32,
) -> bool {
    let mut remote = remote.into_iter();
    let Some(first) = remote.next() else {
        return false;
    };
    let (mut n, mut total) = (1u64, first.length);
    for r in remote {
        if r.buffer_id != first.buffer_id || r.access_key != first.access_key {
            return false;
        }
        n += 1;
        total = total.saturating_add(r.length);
    }
    one_local && n > 1 && total < n.saturating_mul(u64::from(chunk_bytes))
}

/// [`should_coalesce`] of ranges in either form (packed ranges lie in one buffer under one key
/// by construction: no pass over them).
pub(super) fn should_coalesce_ranges(one_local: bool, remote: &Ranges, chunk_bytes: u32) -> bool {
    match remote {
        Ranges::Each(v) => should_coalesce(one_local, v, chunk_bytes),
        Ranges::Packed(p) => {
            let n = p.len() as u64;
            one_local
                && n > 1
                && p.total()
                    .is_some_and(|t| t < n.saturating_mul(u64::from(chunk_bytes)))
        }
    }
}

/// All equal (an empty sequence is not "one").
pub(super) fn all_one<T: PartialEq>(mut it: impl Iterator<Item = T>) -> bool {
    match it.next() {
        Some(first) => it.all(|x| x == first),
        None => false,
    }
}

/// Where an offer's chunks come from or go to on one side: per range (`places[i]` = buffer and
/// offset of range i, `lengths` the ranges'), or planned (`places` = the one buffer at 0,
/// `lengths` = [total], `plan` its pieces).
#[derive(Debug)]
pub(super) struct Places {
    pub(super) places: Vec<(u64, u64)>,
    pub(super) lengths: Vec<u64>,
    pub(super) plan: Option<SidePlan>,
}

impl Places {
    /// A plain offer: one place per range.
    pub(super) fn ranges(places: Vec<(u64, u64)>, lengths: Vec<u64>) -> Places {
        Places {
            places,
            lengths,
            plan: None,
        }
    }

    /// A coalesced side: `ranges` (offset, length) of `buffer`, planned as one stream.
    pub(super) fn coalesced(buffer: u64, ranges: impl IntoIterator<Item = (u64, u64)>) -> Places {
        let mut plan = SidePlan::default();
        plan.rebuild_ranges(ranges);
        Places::planned(buffer, plan)
    }

    /// A planned side (coalesced ranges or blocks) of `buffer`.
    pub(super) fn planned(buffer: u64, plan: SidePlan) -> Places {
        Places {
            places: vec![(buffer, 0)],
            lengths: vec![plan.total()],
            plan: Some(plan),
        }
    }
}

/// The queue item of chunk `c` of an offer on one side: the range's bytes (plain); for a planned
/// offer, its single piece as an ordinary post at that buffer offset, or, when it has several, a
/// pieces item at the chunk's wire offset.
pub(super) fn chunk_item(offer: u64, places: &[(u64, u64)], plan: Option<&SidePlan>, c: &Chunk) -> Item {
    let (buffer, base) = places[c.range as usize];
    let Some(plan) = plan else {
        return Item {
            offer,
            buffer,
            offset: base + c.offset,
            len: c.len,
            pieces: false,
        };
    };
    let mut pieces = plan.pieces(c.offset, c.len);
    match (pieces.next(), pieces.next()) {
        (Some(one), None) => Item {
            offer,
            buffer,
            offset: one.offset,
            len: c.len,
            pieces: false,
        },
        _ => Item {
            offer,
            buffer,
            offset: c.offset,
            len: c.len,
            pieces: true,
        },
    }
}

impl Item {
    /// Sent with nothing in it (a cancelled offer's chunk still meets its receive): a plain
    /// zero-length post, nothing to gather.
    pub(super) fn empty(&mut self) {
        if self.pieces {
            self.pieces = false;
            self.offset = 0;
        }
        self.len = 0;
    }
}

/// The chunks an offer's sender plans (`coalesced` or a block offer: one range of the total),
/// counted without overflow: `None` past `limit`.
pub(super) fn offer_chunks(offer: &Offer, limit: u64) -> Option<u64> {
    let c = u64::from(offer.chunk_bytes);
    let n = if let Some(h) = &offer.blocks {
        h.total.div_ceil(c)
    } else if offer.coalesced {
        offer.ranges.total()?.div_ceil(c)
    } else {
        offer
            .ranges
            .iter()
            .try_fold(0u64, |n, r| n.checked_add(r.length.div_ceil(c)))?
    };
    (n <= limit).then_some(n)
}

impl Engine {
    /// A coalesced offer's ranges must all lie in one of our buffers (keys and bounds are checked
    /// per range by `check_incoming`).
    pub(super) fn check_coalesced(offer: &Offer) -> Result<(), (Code, String, u32)> {
        let Ranges::Each(ranges) = &offer.ranges else {
            return Ok(()); // packed: one buffer
        };
        if !offer.coalesced {
            return Ok(());
        }
        let Some(first) = ranges.first() else {
            return Ok(());
        };
        match ranges.iter().position(|r| r.buffer_id != first.buffer_id) {
            None => Ok(()),
            Some(i) => Err((
                Code::InvalidArgument,
                format!(
                    "ranges[{i}].buffer_id: a coalesced offer's ranges must lie in one buffer, but ranges[0] is in buffer {} and ranges[{i}] in buffer {}",
                    first.buffer_id, ranges[i].buffer_id
                ),
                i as u32,
            )),
        }
    }

    /// Where an accepted plain or coalesced offer's chunks go here.
    pub(super) fn incoming_layout(offer: &Offer) -> Places {
        match (&offer.ranges, offer.coalesced) {
            (Ranges::Packed(p), true) => Places::coalesced(p.buffer_id, p.spans()),
            (ranges, true) => {
                let buffer = ranges.first().map_or(0, |r| r.buffer_id);
                Places::coalesced(buffer, ranges.iter().map(|r| (r.offset, r.length)))
            }
            (ranges, false) => Places::ranges(
                ranges.iter().map(|r| (r.buffer_id, r.offset)).collect(),
                ranges.iter().map(|r| r.length).collect(),
            ),
        }
    }

    /// The wire lengths an offer's chunk plan runs over (what both sides cut into chunks), from
    /// the message alone: the ranges', or for a coalesced or block offer their total.
    pub(super) fn wire_lengths(offer: &Offer) -> Vec<u64> {
        if let Some(h) = &offer.blocks {
            vec![h.total]
        } else if offer.coalesced {
            vec![offer.ranges.total().unwrap_or(u64::MAX)]
        } else {
            offer.ranges.iter().map(|r| r.length).collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(buffer_id: u64, key: u8, length: u64) -> RemoteRange {
        RemoteRange {
            buffer_id,
            access_key: [key; 16],
            offset: 0,
            length,
        }
    }

    #[test]
    fn small_entries_of_one_buffer_pair_coalesce() {
        let small = [range(1, 1, 100), range(1, 1, 200)];
        assert!(should_coalesce(true, &small, 4096));
        assert!(!should_coalesce(false, &small, 4096), "two local buffers");
        assert!(!should_coalesce(true, &small[..1], 4096), "one entry");
        assert!(
            !should_coalesce(true, &[range(1, 1, 100), range(2, 1, 100)], 4096),
            "two remote buffers"
        );
        assert!(
            !should_coalesce(true, &[range(1, 1, 100), range(1, 2, 100)], 4096),
            "two keys"
        );
        assert!(
            !should_coalesce(true, &[range(1, 1, 4096), range(1, 1, 4096)], 4096),
            "the mean entry is a whole chunk"
        );
        assert!(should_coalesce(true, &[range(1, 1, 8190), range(1, 1, 1)], 4096));
        assert!(all_one([3, 3, 3].into_iter()) && !all_one([3, 4].into_iter()));
        assert!(!all_one(std::iter::empty::<u8>()));
    }

    #[test]
    fn a_chunk_of_one_piece_is_an_ordinary_item_and_of_several_a_pieces_item() {
        // Ranges 0..100, 100..300 (merged with the first), 1000..1100: chunks of 256.
        let l = Places::coalesced(7, [(0, 100), (100, 200), (1000, 100)]);
        assert_eq!(l.lengths, [400]);
        let items: Vec<Item> = ChunkPlan::new(&l.lengths, 256, 0, 0..1)
            .map(|c| chunk_item(9, &l.places, l.plan.as_ref(), &c))
            .collect();
        let got: Vec<(u64, u64, u32, bool)> = items
            .iter()
            .map(|i| (i.buffer, i.offset, i.len, i.pieces))
            .collect();
        assert_eq!(
            got,
            [(7, 0, 256, false), (7, 256, 144, true)],
            "chunk 0 is one piece at offset 0; chunk 1 is bytes 256..300 and 1000..1100"
        );
    }
}
