//! Packed ranges (peer protocol 6, `tcpxd.peer.v1.PackedRanges`) to and from the wire: an
//! offer's or header's ranges of one buffer and key, a READ request's pairs of one buffer pair.
//! The engine reads and checks the bytes (`engine::PackedRanges::parse`); this layer only moves
//! the fields and picks the form.

use super::control::{range_from_pb, range_to_pb};
use crate::api::proto::peer as pb;
use crate::engine::{self, PackedRanges, RangeLengths, Ranges, ReadPair, ReadPairs};

/// Packed ranges on the wire: offsets on a uniform length's grid as `u32` slots (peer protocol
/// 9, `offset_slots`: half the bytes), else as `u64`s.
pub(super) fn packed_to_pb(p: PackedRanges) -> pb::PackedRanges {
    let offset_slots = p.offset_slots().unwrap_or_default();
    let (lengths, uniform_length) = match p.lengths {
        RangeLengths::Uniform(u) => (Vec::new(), u),
        RangeLengths::Each(b) => (b, 0),
    };
    pb::PackedRanges {
        buffer_id: p.buffer_id,
        access_key: p.access_key.to_vec(),
        offsets: if offset_slots.is_empty() {
            p.offsets
        } else {
            Vec::new()
        },
        lengths,
        uniform_length,
        offset_slots,
    }
}

/// Packed ranges as received (`field`: where they sit), read by the engine's parse, which names
/// the field and limit of anything malformed (at most `DEFAULT_MAX_ENTRIES` ranges); offsets
/// given as slots are multiplied out first (`PackedRanges::offsets_from_slots`, checked as
/// strictly), given both ways they are refused.
fn parse_pb(field: &str, p: pb::PackedRanges) -> Result<PackedRanges, String> {
    let offsets = match (p.offset_slots.is_empty(), p.offsets.is_empty()) {
        (true, _) => p.offsets,
        (false, true) => PackedRanges::offsets_from_slots(
            field,
            &p.offset_slots,
            p.uniform_length,
            engine::DEFAULT_MAX_ENTRIES,
        )?,
        (false, false) => {
            return Err(format!(
                "{field}.offset_slots: given with offsets (give one of the two)"
            ));
        }
    };
    PackedRanges::parse(
        field,
        p.buffer_id,
        &p.access_key,
        offsets,
        p.lengths,
        p.uniform_length,
        engine::DEFAULT_MAX_ENTRIES,
    )
}

/// An offer's or header's ranges, per range or packed (never both); packed ranges stay packed.
pub(super) fn offer_ranges_from_pb(
    field: &str,
    ranges: Vec<pb::RemoteRange>,
    packed: Option<pb::PackedRanges>,
) -> Result<Ranges, String> {
    match packed {
        Some(_) if !ranges.is_empty() => Err(format!(
            "{field}packed: given with {} ranges (give one of the two)",
            ranges.len()
        )),
        Some(p) => parse_pb(&format!("{field}packed"), p).map(Ranges::Packed),
        None => ranges
            .iter()
            .enumerate()
            .map(|(i, r)| range_from_pb(&format!("{field}ranges[{i}]"), Some(r)))
            .collect::<Result<Vec<_>, _>>()
            .map(Ranges::Each),
    }
}

/// An offer's or header's ranges on the wire: packed when they lie in one buffer under one key
/// (as they are when the engine keeps them packed), else a `RemoteRange` each. Returns
/// (ranges, packed).
pub(super) fn offer_ranges_to_pb(ranges: &Ranges) -> (Vec<pb::RemoteRange>, Option<pb::PackedRanges>) {
    let packed = match ranges {
        Ranges::Packed(p) => Some(p.clone()),
        Ranges::Each(v) => PackedRanges::pack(v),
    };
    match packed {
        Some(p) => (Vec::new(), Some(packed_to_pb(p))),
        None => (ranges.iter().map(|r| range_to_pb(&r)).collect(), None),
    }
}

/// A read request's pairs, per pair or as two packed arrays (both, or neither, and no pairs
/// beside them).
pub(super) fn read_pairs_from_pb(r: &mut pb::ReadRequest) -> Result<ReadPairs, String> {
    match (r.packed_source.take(), r.packed_dest.take()) {
        (None, None) => r
            .pairs
            .iter()
            .enumerate()
            .map(|(i, p)| {
                Ok(ReadPair {
                    source: range_from_pb(&format!("pairs[{i}].source"), p.source.as_ref())?,
                    dest: range_from_pb(&format!("pairs[{i}].dest"), p.dest.as_ref())?,
                })
            })
            .collect::<Result<Vec<_>, String>>()
            .map(ReadPairs::Each),
        (Some(s), Some(d)) => {
            if !r.pairs.is_empty() {
                return Err(format!(
                    "packed_source: given with {} pairs (give one of the two)",
                    r.pairs.len()
                ));
            }
            let source = parse_pb("packed_source", s)?;
            let dest = parse_pb("packed_dest", d)?;
            if source.len() != dest.len() {
                return Err(format!(
                    "packed_dest: {} ranges for {} in packed_source (one per pair)",
                    dest.len(),
                    source.len()
                ));
            }
            // Kept packed: no pair per entry (65,536 pairs: 6 MiB).
            Ok(ReadPairs::Packed { source, dest })
        }
        (Some(_), None) => Err("packed_dest: missing (packed_source given)".into()),
        (None, Some(_)) => Err("packed_source: missing (packed_dest given)".into()),
    }
}

/// A read request's pairs on the wire: two packed arrays when the sources lie in one buffer under
/// one key and the destinations too (as they are when the engine keeps them packed), else a
/// `ReadPair` each. Returns (pairs, packed_source, packed_dest).
pub(super) fn read_pairs_to_pb(
    pairs: &ReadPairs,
) -> (
    Vec<pb::ReadPair>,
    Option<pb::PackedRanges>,
    Option<pb::PackedRanges>,
) {
    let pairs = match pairs {
        ReadPairs::Packed { source, dest } => {
            return (
                Vec::new(),
                Some(packed_to_pb(source.clone())),
                Some(packed_to_pb(dest.clone())),
            );
        }
        ReadPairs::Each(v) => v,
    };
    let packed = PackedRanges::pack_iter(pairs.iter().map(|p| &p.source))
        .zip(PackedRanges::pack_iter(pairs.iter().map(|p| &p.dest)));
    match packed {
        Some((s, d)) => (Vec::new(), Some(packed_to_pb(s)), Some(packed_to_pb(d))),
        None => (
            pairs
                .iter()
                .map(|p| pb::ReadPair {
                    source: Some(range_to_pb(&p.source)),
                    dest: Some(range_to_pb(&p.dest)),
                })
                .collect(),
            None,
            None,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::super::control::{Malformed, msg_from_pb, msg_to_pb};
    use super::*;
    use crate::engine::{Offer, PeerMsg, RemoteRange};

    fn range(buffer_id: u64, key: u8, offset: u64, length: u64) -> RemoteRange {
        RemoteRange {
            buffer_id,
            access_key: [key; 16],
            offset,
            length,
        }
    }

    fn offer(ranges: Vec<RemoteRange>) -> Offer {
        Offer {
            offer_id: 7,
            read_id: 0,
            chunk_bytes: 4096,
            first_lane: 0,
            ranges: ranges.into(),
            notification: Vec::new(),
            deadline_ms: 9,
            blocks: None,
            coalesced: true,
            transfer_id: 11,
            announced: None,
        }
    }

    fn read(pairs: Vec<ReadPair>) -> PeerMsg {
        PeerMsg::ReadRequest {
            read_id: 4,
            pairs: pairs.into(),
            deadline_ms: 100,
            blocks: None,
            host_dests: false,
        }
    }

    fn round_trip(m: PeerMsg) -> pb::PeerMessage {
        let wire = msg_to_pb(&m);
        assert_eq!(
            msg_from_pb(wire.clone())
                .expect("well formed")
                .expect("a message"),
            m
        );
        wire
    }

    /// A notification alone's header (one range of zero bytes, peer protocol 10) goes as that
    /// range, never packed (the packed form has no zero length), and comes back the same.
    #[test]
    fn a_zero_byte_range_goes_as_itself() {
        use pb::peer_message::Body;
        let mut o = offer(vec![range(3, 9, 4096, 0)]);
        o.notification = b"alone".to_vec();
        let wire = round_trip(PeerMsg::Header(o));
        let Some(Body::Header(h)) = wire.body else {
            unreachable!()
        };
        assert!(h.packed.is_none() && h.ranges.len() == 1 && h.ranges[0].length == 0);
    }

    /// Offers, headers and read requests of one buffer (pair) go packed at 65,536 ranges and
    /// come back the same; two buffers go a message per range.
    #[test]
    fn ranges_of_one_buffer_go_packed_and_come_back_the_same() {
        use pb::peer_message::Body;
        let n = engine::DEFAULT_MAX_ENTRIES as u64;
        let uniform: Vec<RemoteRange> = (0..n).map(|i| range(3, 9, (n - 1 - i) * 4096, 4096)).collect();
        let each: Vec<RemoteRange> = (0..n).map(|i| range(3, 9, i * 64, 1 + i % 63)).collect();
        for ranges in [uniform.clone(), each] {
            let wire = round_trip(PeerMsg::Offer(offer(ranges.clone())));
            let Some(Body::Offer(o)) = wire.body else {
                unreachable!()
            };
            assert!(o.ranges.is_empty());
            // On a uniform grid the offsets go as u32 slots (protocol 9), else as u64s.
            let p = o.packed.as_ref().expect("packed");
            let grid = ranges.iter().all(|r| r.length == 4096);
            assert_eq!(p.offsets.len(), if grid { 0 } else { ranges.len() * 8 });
            assert_eq!(p.offset_slots.len(), if grid { ranges.len() * 4 } else { 0 });
            // Received, they stay packed (no range object each); sent packed, they go as they are.
            let got = msg_from_pb(pb::PeerMessage {
                body: Some(Body::Offer(o)),
            })
            .expect("well formed")
            .expect("a message");
            let PeerMsg::Offer(got) = got else { unreachable!() };
            assert!(matches!(got.ranges, Ranges::Packed(_)));
            let wire = round_trip(PeerMsg::Header(got));
            assert!(
                matches!(wire.body, Some(Body::Header(ref h)) if h.ranges.is_empty() && h.packed.is_some())
            );
            round_trip(PeerMsg::Header(offer(ranges)));
        }
        let pairs: Vec<ReadPair> = uniform
            .iter()
            .enumerate()
            .map(|(i, r)| ReadPair {
                source: range(5, 1, i as u64 * 4096, 4096),
                dest: r.clone(),
            })
            .collect();
        let wire = round_trip(read(pairs));
        let Some(Body::ReadRequest(r)) = wire.body else {
            unreachable!()
        };
        assert!(r.pairs.is_empty() && r.packed_source.is_some() && r.packed_dest.is_some());
        let got = msg_from_pb(pb::PeerMessage {
            body: Some(Body::ReadRequest(r)),
        })
        .expect("well formed")
        .expect("a message");
        assert!(matches!(
            got,
            PeerMsg::ReadRequest {
                pairs: ReadPairs::Packed { .. },
                ..
            }
        ));
        round_trip(got);

        let two = vec![range(1, 1, 0, 8), range(2, 1, 0, 8)];
        let wire = round_trip(PeerMsg::Offer(offer(two.clone())));
        let Some(Body::Offer(o)) = wire.body else {
            unreachable!()
        };
        assert!(o.packed.is_none() && o.ranges.len() == 2);
        let pairs = two
            .iter()
            .map(|r| ReadPair {
                source: range(1, 1, 0, 8),
                dest: r.clone(),
            })
            .collect();
        let wire = round_trip(read(pairs));
        let Some(Body::ReadRequest(r)) = wire.body else {
            unreachable!()
        };
        assert!(r.pairs.len() == 2 && r.packed_source.is_none());
    }

    fn packed(offsets: &[u64], lengths: &[u64], uniform_length: u64) -> pb::PackedRanges {
        pb::PackedRanges {
            buffer_id: 3,
            access_key: vec![9; 16],
            offsets: offsets.iter().flat_map(|x| x.to_le_bytes()).collect(),
            lengths: lengths.iter().flat_map(|x| x.to_le_bytes()).collect(),
            uniform_length,
            offset_slots: Vec::new(),
        }
    }

    fn slots(slots: &[u32], lengths: &[u64], uniform_length: u64) -> pb::PackedRanges {
        pb::PackedRanges {
            offset_slots: slots.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ..packed(&[], lengths, uniform_length)
        }
    }

    /// Malformed packed bytes refuse an offer or read request naming the field and the limit;
    /// in a header (its data may be on the lanes) they fail the pairing.
    #[test]
    fn malformed_packed_ranges_refuse_an_offer_or_read_but_fail_a_header() {
        use pb::peer_message::Body;
        let too_many = vec![0u64; engine::DEFAULT_MAX_ENTRIES + 1];
        let offer_cases = [
            (
                packed(&too_many, &[], 1),
                Vec::new(),
                "packed.offsets: 65537 ranges (1 to 65536 allowed)",
            ),
            (
                packed(&[0, 8], &[8], 0),
                Vec::new(),
                "packed.lengths: 1 lengths for 2 offsets (one per range)",
            ),
            (
                packed(&[0], &[], 8),
                vec![range_to_pb(&range(3, 9, 0, 8))],
                "packed: given with 1 ranges (give one of the two)",
            ),
            (
                pb::PackedRanges {
                    offsets: vec![0; 8],
                    ..slots(&[0], &[], 8)
                },
                Vec::new(),
                "packed.offset_slots: given with offsets (give one of the two)",
            ),
            (
                slots(&[0, 1], &[8, 8], 0),
                Vec::new(),
                "packed.offset_slots: given without uniform_length (slots are in units of it)",
            ),
        ];
        for (p, ranges, want) in offer_cases {
            let mut o = match msg_to_pb(&PeerMsg::Offer(offer(vec![range(3, 9, 0, 8)]))).body {
                Some(Body::Offer(o)) => o,
                _ => unreachable!(),
            };
            o.packed = Some(p.clone());
            o.ranges = ranges.clone();
            match msg_from_pb(pb::PeerMessage {
                body: Some(Body::Offer(o.clone())),
            }) {
                Err(Malformed::Refuse(engine::Malformed::Offer { offer_id: 7, why })) => {
                    assert_eq!(why, want)
                }
                other => panic!("{other:?}"),
            }
            match msg_from_pb(pb::PeerMessage {
                body: Some(Body::Header(o)),
            }) {
                Err(Malformed::Fatal(why)) => assert_eq!(why, format!("header.{want}")),
                other => panic!("{other:?}"),
            }
        }
        let read_cases = [
            (
                Some(packed(&[0], &[], 8)),
                None,
                "packed_dest: missing (packed_source given)",
            ),
            (
                None,
                Some(packed(&[0], &[], 8)),
                "packed_source: missing (packed_dest given)",
            ),
            (
                Some(packed(&[0, 8], &[], 8)),
                Some(packed(&[0], &[], 8)),
                "packed_dest: 1 ranges for 2 in packed_source (one per pair)",
            ),
            (
                Some(pb::PackedRanges {
                    access_key: vec![1; 3],
                    ..packed(&[0], &[], 8)
                }),
                Some(packed(&[0], &[], 8)),
                "packed_source.access_key: 3 bytes, expected 16",
            ),
            (
                Some(packed(&[0], &[], 8)),
                Some(packed(&[u64::MAX], &[], 8)),
                "packed_dest.offsets[0]: offset 18446744073709551615 + length 8 exceeds 2^64 - 1",
            ),
            (
                Some(packed(&[0], &[], 8)),
                Some(slots(&[u32::MAX], &[], u64::MAX / 2)),
                "packed_dest.offset_slots[0]: slot 4294967295 × uniform_length 9223372036854775807 exceeds 2^64 - 1",
            ),
            (
                Some(slots(&[0, 1, 2], &[], 8)),
                Some(slots(&[0, 1], &[], 8)),
                "packed_dest: 2 ranges for 3 in packed_source (one per pair)",
            ),
        ];
        for (s, d, want) in read_cases {
            let r = pb::ReadRequest {
                read_id: 4,
                packed_source: s,
                packed_dest: d,
                ..Default::default()
            };
            match msg_from_pb(pb::PeerMessage {
                body: Some(Body::ReadRequest(r)),
            }) {
                Err(Malformed::Refuse(engine::Malformed::ReadRequest { read_id: 4, why })) => {
                    assert_eq!(why, want)
                }
                other => panic!("{other:?}"),
            }
        }
    }
}
