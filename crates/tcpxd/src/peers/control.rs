//! The conversions between the engine's control messages and `tcpxd.peer.v1`, both ways
//! (`msg_to_pb`, `msg_from_pb`, and the ranges, keys, index arrays and block headers inside
//! them), for whichever connection carries them: the ordered HTTP/2 control stream
//! (`control_stream.rs`) or the direct control connection (`direct.rs`).

use super::packed_pb;
use crate::api::proto::peer as pb;
use crate::engine::blocks::{BlockHeader, IndexArray, IndexEncoding, PairLengths};
use crate::engine::{self, Code, Offer, PeerMsg, ReadBlocks, RemoteRange, ReturnedCredits};

pub(super) fn range_to_pb(r: &RemoteRange) -> pb::RemoteRange {
    pb::RemoteRange {
        buffer_id: r.buffer_id,
        access_key: r.access_key.to_vec(),
        offset: r.offset,
        length: r.length,
    }
}

pub(super) fn range_from_pb(field: &str, r: Option<&pb::RemoteRange>) -> Result<RemoteRange, String> {
    let r = r.ok_or_else(|| format!("{field}: missing"))?;
    let access_key: [u8; 16] = r
        .access_key
        .as_slice()
        .try_into()
        .map_err(|_| format!("{field}.access_key: {} bytes, expected 16", r.access_key.len()))?;
    Ok(RemoteRange {
        buffer_id: r.buffer_id,
        access_key,
        offset: r.offset,
        length: r.length,
    })
}

fn key_from_pb(field: &str, key: &[u8]) -> Result<[u8; 16], String> {
    key.try_into()
        .map_err(|_| format!("{field}: {} bytes, expected 16", key.len()))
}

fn encoding_to_pb(e: IndexEncoding) -> i32 {
    match e {
        IndexEncoding::U32Le => pb::IndexEncoding::U32Le as i32,
        IndexEncoding::Ranges => pb::IndexEncoding::Ranges as i32,
    }
}

fn indices_from_pb(field: &str, encoding: i32, bytes: Vec<u8>) -> Result<IndexArray, String> {
    let encoding = match pb::IndexEncoding::try_from(encoding) {
        Ok(pb::IndexEncoding::U32Le) => IndexEncoding::U32Le,
        Ok(pb::IndexEncoding::Ranges) => IndexEncoding::Ranges,
        Err(_) => return Err(format!("{field}: unknown index encoding {encoding}")),
    };
    IndexArray::parse(encoding, bytes, field).map_err(|e| e.to_string())
}

fn header_to_pb(h: &BlockHeader) -> pb::BlockHeader {
    let (uniform_length, lengths) = match &h.lengths {
        PairLengths::Uniform(l) => (*l, Vec::new()),
        PairLengths::Each(b) => (0, b.clone()),
    };
    pb::BlockHeader {
        list_id: h.list_id,
        access_key: h.access_key.to_vec(),
        encoding: encoding_to_pb(h.indices.encoding()),
        indices: h.indices.bytes().to_vec(),
        uniform_length,
        lengths,
        total: h.total,
    }
}

/// A block header as received (`field`: where it sits, `blocks` or `blocks.dest`); whether it
/// agrees with a list is the engine's check.
fn header_from_pb(field: &str, h: pb::BlockHeader) -> Result<BlockHeader, String> {
    let access_key = key_from_pb(&format!("{field}.access_key"), &h.access_key)?;
    let encoding = h.encoding;
    let indices = indices_from_pb(&format!("{field}.indices"), encoding, h.indices)?;
    let lengths = match (h.uniform_length, h.lengths.is_empty()) {
        (0, true) => {
            return Err(format!(
                "{field}.uniform_length: 0 and no lengths (give one of the two)"
            ));
        }
        (u, true) => PairLengths::Uniform(u),
        (0, false) if h.lengths.len() % 4 != 0 => {
            return Err(format!(
                "{field}.lengths: {} bytes are not a whole number of u32 lengths",
                h.lengths.len()
            ));
        }
        (0, false) => PairLengths::Each(h.lengths),
        (u, false) => {
            return Err(format!(
                "{field}.lengths: given with uniform_length {u} (give one of the two)"
            ));
        }
    };
    Ok(BlockHeader {
        list_id: h.list_id,
        access_key,
        indices,
        lengths,
        total: h.total,
    })
}

fn read_blocks_to_pb(b: &ReadBlocks) -> pb::ReadBlocks {
    pb::ReadBlocks {
        source_list: b.source_list,
        source_key: b.source_key.to_vec(),
        source_encoding: encoding_to_pb(b.source_indices.encoding()),
        source_indices: b.source_indices.bytes().to_vec(),
        dest: Some(header_to_pb(&b.dest)),
    }
}

fn read_blocks_from_pb(b: pb::ReadBlocks) -> Result<ReadBlocks, String> {
    let source_key = key_from_pb("blocks.source_key", &b.source_key)?;
    let source_indices = indices_from_pb("blocks.source_indices", b.source_encoding, b.source_indices)?;
    let dest = b.dest.ok_or_else(|| "blocks.dest: missing".to_string())?;
    Ok(ReadBlocks {
        source_list: b.source_list,
        source_key,
        source_indices,
        dest: header_from_pb("blocks.dest", dest)?,
    })
}

/// Engine message → wire.
pub fn msg_to_pb(m: &PeerMsg) -> pb::PeerMessage {
    use pb::peer_message::Body;
    // Ranges of one buffer and key go packed (peer protocol 6): one key, not one per range.
    let offer = |o: &Offer| {
        let (ranges, packed) = packed_pb::offer_ranges_to_pb(&o.ranges);
        pb::Offer {
            offer_id: o.offer_id,
            read_id: o.read_id,
            chunk_bytes: o.chunk_bytes,
            first_lane: o.first_lane,
            ranges,
            notification: o.notification.clone(),
            deadline_ms: o.deadline_ms,
            coalesced: o.coalesced,
            blocks: o.blocks.as_deref().map(header_to_pb),
            transfer_id: o.transfer_id,
            announced_chunks: o.announced.unwrap_or(0),
            streamed: o.announced.is_some(),
            packed,
        }
    };
    let body = match m {
        PeerMsg::ReceiveMode {
            credits,
            chunk_bytes,
            eager_first_lane,
            eager_max_bytes,
        } => Body::ReceiveMode(pb::ReceiveMode {
            credits: *credits,
            chunk_bytes: *chunk_bytes,
            eager_first_lane: *eager_first_lane,
            eager_max_bytes: *eager_max_bytes,
        }),
        PeerMsg::Credits { returned } => Body::Credits(pb::Credits {
            returned: returned.wire().to_vec(),
        }),
        PeerMsg::GpuCredits {
            budget_bytes,
            buffer_ids,
            buffer_gpus,
        } => Body::GpuCredits(pb::GpuCredits {
            budget_bytes: *budget_bytes,
            buffer_ids: buffer_ids.clone(),
            buffer_gpus: buffer_gpus.clone(),
        }),
        PeerMsg::MoreChunks { offer_id, count } => Body::MoreChunks(pb::MoreChunks {
            offer_id: *offer_id,
            count: *count,
        }),
        PeerMsg::Header(o) => Body::Header(offer(o)),
        PeerMsg::Offer(o) => Body::Offer(offer(o)),
        PeerMsg::Accept { offer_id, first_lane } => Body::Accept(pb::Accept {
            offer_id: *offer_id,
            first_lane: *first_lane,
        }),
        PeerMsg::Reject {
            offer_id,
            code,
            message,
            range_index,
        } => Body::Reject(pb::Reject {
            offer_id: *offer_id,
            code: *code as i32,
            message: message.clone(),
            range_index: *range_index,
        }),
        PeerMsg::Done { offer_id, returned } => Body::Done(pb::Done {
            offer_id: *offer_id,
            returned: returned.wire().to_vec(),
        }),
        PeerMsg::Failed {
            offer_id,
            code,
            message,
        } => Body::Failed(pb::Failed {
            offer_id: *offer_id,
            code: *code as i32,
            message: message.clone(),
        }),
        PeerMsg::CancelOffer {
            offer_id,
            code,
            message,
        } => Body::CancelOffer(pb::CancelOffer {
            offer_id: *offer_id,
            code: *code as i32,
            message: message.clone(),
        }),
        PeerMsg::CancelSeen { offer_id } => Body::CancelSeen(pb::CancelSeen { offer_id: *offer_id }),
        PeerMsg::ReadRequest {
            read_id,
            pairs,
            deadline_ms,
            blocks,
            host_dests,
        } => {
            let (pairs_pb, packed_source, packed_dest) = packed_pb::read_pairs_to_pb(pairs);
            Body::ReadRequest(pb::ReadRequest {
                read_id: *read_id,
                pairs: pairs_pb,
                deadline_ms: *deadline_ms,
                blocks: blocks.as_deref().map(read_blocks_to_pb),
                packed_source,
                packed_dest,
                host_dests: *host_dests,
            })
        }
        PeerMsg::ReadReject {
            read_id,
            code,
            message,
            range_index,
        } => Body::ReadReject(pb::ReadReject {
            read_id: *read_id,
            code: *code as i32,
            message: message.clone(),
            range_index: *range_index,
        }),
        PeerMsg::CancelRead { read_id } => Body::CancelRead(pb::CancelRead { read_id: *read_id }),
        PeerMsg::Notify {
            transfer_id,
            payload,
            lists,
            buffers,
        } => Body::Notify(pb::Notify {
            transfer_id: *transfer_id,
            payload: payload.clone(),
            lists: lists.clone(),
            buffer_ids: buffers.clone(),
        }),
        PeerMsg::Goodbye { reason } => Body::Goodbye(pb::Goodbye {
            reason: reason.clone(),
        }),
        PeerMsg::LaneOpen { lane } => Body::LaneOpen(pb::LaneOpen { lane: *lane }),
        PeerMsg::LaneListening { lane, handle } => Body::LaneListening(pb::LaneListening {
            lane: *lane,
            handle: handle.clone(),
        }),
        PeerMsg::LaneClose { lane } => Body::LaneClose(pb::LaneClose { lane: *lane }),
        PeerMsg::LaneCloseAnswer { lane, closed } => Body::LaneCloseAnswer(pb::LaneCloseAnswer {
            lane: *lane,
            closed: *closed,
        }),
        PeerMsg::PairingClose => Body::PairingClose(pb::PairingClose {}),
        PeerMsg::InlineLimit { max_bytes } => Body::InlineLimit(pb::InlineLimit {
            max_bytes: *max_bytes,
        }),
        PeerMsg::Inline { offer: o, payload } => Body::InlineTransfer(pb::InlineTransfer {
            header: Some(offer(o)),
            payload: payload.clone(),
        }),
        PeerMsg::PairingCloseAnswer { closed } => {
            Body::PairingCloseAnswer(pb::PairingCloseAnswer { closed: *closed })
        }
    };
    pb::PeerMessage { body: Some(body) }
}

/// Why an inbound message could not be handed to the engine.
#[derive(Debug)]
pub enum Malformed {
    /// An offer or read request with a bad field: the engine refuses it.
    Refuse(engine::Malformed),
    /// The peer broke the protocol.
    Fatal(String),
}

/// An offer, header or inline transfer's offer read from the wire; `prefix` starts the field
/// names an error gives: "" for an offer, "header." for the others.
fn offer_from_pb(prefix: &str, o: pb::Offer, announced: Option<u64>) -> Result<Offer, String> {
    let ranges = packed_pb::offer_ranges_from_pb(prefix, o.ranges, o.packed)?;
    let blocks_field = if prefix.is_empty() {
        "blocks"
    } else {
        "header.blocks"
    };
    let blocks = o
        .blocks
        .map(|h| header_from_pb(blocks_field, h).map(Box::new))
        .transpose()?;
    Ok(Offer {
        offer_id: o.offer_id,
        read_id: o.read_id,
        chunk_bytes: o.chunk_bytes,
        first_lane: o.first_lane,
        ranges,
        notification: o.notification,
        deadline_ms: o.deadline_ms,
        blocks,
        coalesced: o.coalesced,
        transfer_id: o.transfer_id,
        announced,
    })
}

/// An offer the engine refuses (its sender hears why) rather than a broken pairing.
fn refuse_offer(offer_id: u64, why: String) -> Malformed {
    Malformed::Refuse(engine::Malformed::Offer { offer_id, why })
}

/// Wire → engine message. `Ok(None)`: nothing for the engine (a heartbeat).
pub fn msg_from_pb(m: pb::PeerMessage) -> Result<Option<PeerMsg>, Malformed> {
    use pb::peer_message::Body;
    let body = m
        .body
        .ok_or_else(|| Malformed::Fatal("message without a body".into()))?;
    Ok(Some(match body {
        Body::Hello(_) => return Err(Malformed::Fatal("a second Hello".into())),
        Body::DirectSwitch(_) => {
            return Err(Malformed::Fatal(
                "a DirectSwitch on the direct control connection itself".into(),
            ));
        }
        Body::Heartbeat(_) => return Ok(None),
        Body::ReceiveMode(m) => PeerMsg::ReceiveMode {
            credits: m.credits,
            chunk_bytes: m.chunk_bytes,
            eager_first_lane: m.eager_first_lane,
            eager_max_bytes: m.eager_max_bytes,
        },
        Body::Credits(c) => PeerMsg::Credits {
            // Checked against the pairing by the engine (`ReturnedCredits::check`).
            returned: ReturnedCredits::from_wire(c.returned),
        },
        Body::GpuCredits(g) => PeerMsg::GpuCredits {
            budget_bytes: g.budget_bytes,
            buffer_ids: g.buffer_ids,
            buffer_gpus: g.buffer_gpus,
        },
        Body::MoreChunks(m) => PeerMsg::MoreChunks {
            offer_id: m.offer_id,
            count: m.count,
        },
        Body::Header(o) => {
            // Its data may be on its way already: a header the engine cannot read breaks the
            // order of every lane, so it fails the pairing instead of a refusal.
            let announced = o.streamed.then_some(o.announced_chunks);
            PeerMsg::Header(offer_from_pb("header.", o, announced).map_err(Malformed::Fatal)?)
        }
        Body::Offer(o) => {
            let offer_id = o.offer_id;
            PeerMsg::Offer(offer_from_pb("", o, None).map_err(|why| refuse_offer(offer_id, why))?)
        }
        Body::Accept(a) => PeerMsg::Accept {
            offer_id: a.offer_id,
            first_lane: a.first_lane,
        },
        Body::Reject(r) => PeerMsg::Reject {
            offer_id: r.offer_id,
            code: Code::from_i32(r.code),
            message: r.message,
            range_index: r.range_index,
        },
        Body::Done(d) => PeerMsg::Done {
            offer_id: d.offer_id,
            returned: ReturnedCredits::from_wire(d.returned),
        },
        Body::Failed(f) => PeerMsg::Failed {
            offer_id: f.offer_id,
            code: Code::from_i32(f.code),
            message: f.message,
        },
        Body::CancelOffer(c) => PeerMsg::CancelOffer {
            offer_id: c.offer_id,
            code: Code::from_i32(c.code),
            message: c.message,
        },
        Body::CancelSeen(c) => PeerMsg::CancelSeen { offer_id: c.offer_id },
        Body::ReadRequest(mut r) => {
            let pairs = packed_pb::read_pairs_from_pb(&mut r);
            let blocks = r.blocks.map(|b| read_blocks_from_pb(b).map(Box::new)).transpose();
            match pairs.and_then(|p| Ok((p, blocks?))) {
                Ok((pairs, blocks)) => PeerMsg::ReadRequest {
                    read_id: r.read_id,
                    pairs,
                    deadline_ms: r.deadline_ms,
                    blocks,
                    host_dests: r.host_dests,
                },
                Err(why) => {
                    return Err(Malformed::Refuse(engine::Malformed::ReadRequest {
                        read_id: r.read_id,
                        why,
                    }));
                }
            }
        }
        Body::ReadReject(r) => PeerMsg::ReadReject {
            read_id: r.read_id,
            code: Code::from_i32(r.code),
            message: r.message,
            range_index: r.range_index,
        },
        Body::CancelRead(c) => PeerMsg::CancelRead { read_id: c.read_id },
        Body::Notify(n) => PeerMsg::Notify {
            transfer_id: n.transfer_id,
            payload: n.payload,
            lists: n.lists,
            buffers: n.buffer_ids,
        },
        Body::Goodbye(g) => PeerMsg::Goodbye {
            reason: g.reason.chars().take(4096).collect(),
        },
        Body::LaneOpen(m) => PeerMsg::LaneOpen { lane: m.lane },
        Body::LaneListening(m) => PeerMsg::LaneListening {
            lane: m.lane,
            handle: m.handle,
        },
        Body::LaneClose(m) => PeerMsg::LaneClose { lane: m.lane },
        Body::LaneCloseAnswer(m) => PeerMsg::LaneCloseAnswer {
            lane: m.lane,
            closed: m.closed,
        },
        Body::PairingClose(_) => PeerMsg::PairingClose,
        Body::PairingCloseAnswer(m) => PeerMsg::PairingCloseAnswer { closed: m.closed },
        Body::InlineLimit(m) => PeerMsg::InlineLimit {
            max_bytes: m.max_bytes,
        },
        Body::InlineTransfer(m) => {
            // Nothing on a lane rests on it: a header that cannot be read refuses that one
            // transfer (as an offer's), it does not fail the pairing.
            let o = m.header.unwrap_or_default();
            let offer_id = o.offer_id;
            PeerMsg::Inline {
                offer: offer_from_pb("header.", o, None).map_err(|why| refuse_offer(offer_id, why))?,
                payload: m.payload,
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer(blocks: Option<BlockHeader>, coalesced: bool) -> Offer {
        Offer {
            offer_id: 7,
            read_id: 3,
            chunk_bytes: 4096,
            first_lane: 1,
            ranges: Vec::new().into(),
            notification: b"n".to_vec(),
            deadline_ms: 9,
            blocks: blocks.map(Box::new),
            coalesced,
            transfer_id: 11,
            announced: None,
        }
    }

    fn header(lengths: PairLengths, indices: IndexArray) -> BlockHeader {
        BlockHeader {
            list_id: 12,
            access_key: [5; 16],
            indices,
            lengths,
            total: 12_345,
        }
    }

    fn round_trip(m: PeerMsg) {
        let back = msg_from_pb(msg_to_pb(&m))
            .expect("well formed")
            .expect("a message");
        assert_eq!(back, m);
    }

    #[test]
    fn returned_credits_go_as_lane_count_pairs_and_survive_the_wire() {
        use pb::peer_message::Body;
        let returned = ReturnedCredits::from_counts(&[0, 2, 0, 0, 1]);
        let done = PeerMsg::Done {
            offer_id: 9,
            returned: returned.clone(),
        };
        match msg_to_pb(&done).body {
            Some(Body::Done(d)) => assert_eq!(d.returned, vec![1, 2, 4, 1], "only lanes 1 and 4"),
            other => panic!("{other:?}"),
        }
        round_trip(done);
        round_trip(PeerMsg::Credits { returned });
        round_trip(PeerMsg::Done {
            offer_id: 10,
            returned: ReturnedCredits::default(),
        });
    }

    #[test]
    fn the_pairing_life_messages_survive_the_wire() {
        round_trip(PeerMsg::PairingClose);
        for closed in [true, false] {
            round_trip(PeerMsg::PairingCloseAnswer { closed });
        }
    }

    #[test]
    fn inline_messages_survive_the_wire_and_an_unreadable_one_is_refused() {
        round_trip(PeerMsg::InlineLimit { max_bytes: 16384 });
        round_trip(PeerMsg::Inline {
            offer: offer(None, true),
            payload: (0..=255).collect(),
        });
        // Ranges that cannot be read refuse the one transfer (no lane depends on it).
        let mut m = msg_to_pb(&PeerMsg::Inline {
            offer: offer(None, false),
            payload: vec![1; 8],
        });
        if let Some(pb::peer_message::Body::InlineTransfer(t)) = m.body.as_mut() {
            let h = t.header.as_mut().unwrap();
            h.ranges.clear();
            h.packed = Some(pb::PackedRanges {
                buffer_id: 1,
                access_key: vec![0; 16],
                offsets: vec![1, 2, 3],
                ..Default::default()
            });
        }
        match msg_from_pb(m) {
            Err(Malformed::Refuse(engine::Malformed::Offer { offer_id, why })) => {
                assert_eq!(offer_id, 7);
                assert!(why.starts_with("header.packed"), "{why}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_notify_survives_the_wire() {
        round_trip(PeerMsg::Notify {
            transfer_id: 17,
            payload: b"done".to_vec(),
            lists: vec![3, 9],
            buffers: vec![],
        });
        round_trip(PeerMsg::Notify {
            transfer_id: 18,
            payload: b"mixed".to_vec(),
            lists: vec![],
            buffers: vec![4, 1 << 40],
        });
    }

    #[test]
    fn gpu_credits_and_streamed_headers_survive_the_wire() {
        round_trip(PeerMsg::GpuCredits {
            budget_bytes: 32 << 20,
            buffer_ids: vec![1, 7, 9],
            buffer_gpus: vec![0, 5, crate::engine::GPU_NOT_KNOWN],
        });
        round_trip(PeerMsg::MoreChunks {
            offer_id: 5,
            count: 12,
        });
        for announced in [Some(0), Some(9), None] {
            round_trip(PeerMsg::Header(Offer {
                announced,
                ..offer(None, false)
            }));
        }
    }

    #[test]
    fn block_parts_and_the_coalesced_flag_survive_the_wire() {
        let each = PairLengths::Each([1u32, 2, 3].iter().flat_map(|x| x.to_le_bytes()).collect());
        for (lengths, indices) in [
            (
                PairLengths::Uniform(4096),
                IndexArray::from_ranges(&[(4, 100), (900, 2)]),
            ),
            (each, IndexArray::from_indices(&[9, 1, 5])),
        ] {
            let h = header(lengths, indices);
            round_trip(PeerMsg::Offer(offer(Some(h.clone()), false)));
            round_trip(PeerMsg::Header(offer(Some(h.clone()), false)));
            round_trip(PeerMsg::ReadRequest {
                read_id: 4,
                pairs: Vec::new().into(),
                deadline_ms: 100,
                blocks: Some(Box::new(ReadBlocks {
                    source_list: 8,
                    source_key: [6; 16],
                    source_indices: IndexArray::from_indices(&[0, 0, 2]),
                    dest: h,
                })),
                host_dests: true,
            });
        }
        round_trip(PeerMsg::Offer(offer(None, true)));
    }

    #[test]
    fn bad_block_bytes_refuse_an_offer_or_read_but_fail_a_header() {
        let mut m = msg_to_pb(&PeerMsg::Offer(offer(
            Some(header(PairLengths::Uniform(1), IndexArray::from_indices(&[1]))),
            false,
        )));
        let Some(pb::peer_message::Body::Offer(o)) = &mut m.body else {
            unreachable!()
        };
        o.blocks.as_mut().unwrap().indices.push(0);
        match msg_from_pb(m.clone()) {
            Err(Malformed::Refuse(engine::Malformed::Offer { offer_id: 7, why })) => {
                assert_eq!(
                    why,
                    "blocks.indices: 5 bytes are not a whole number of 4-byte indices"
                )
            }
            other => panic!("{other:?}"),
        }
        let Some(pb::peer_message::Body::Offer(o)) = m.body else {
            unreachable!()
        };
        let header = pb::PeerMessage {
            body: Some(pb::peer_message::Body::Header(o)),
        };
        match msg_from_pb(header) {
            Err(Malformed::Fatal(why)) => assert!(why.starts_with("header.blocks.indices: 5 bytes"), "{why}"),
            other => panic!("{other:?}"),
        }
    }
}
