//! Offers, headers and read requests with a block part, as this node receives them: the list
//! looked up, the key compared with its buffer's current key, the header validated against the
//! list and the plan built, before anything is posted or lands. A refusal names the field
//! (`blocks.list_id`, `blocks.access_key`, `blocks.indices[i]`, …).

use super::blocks::{BlockHeader, SidePlan};
use super::coalesce::Places;
use super::*;

type Refusal = (Code, String, u32);

impl Engine {
    /// Where an offer's or header's chunks go here, everything it rests on alone checked first
    /// (notification, the READ it serves, each range's key and bounds, a coalesced offer's one
    /// buffer, a block part's list, key and header).
    pub(super) fn incoming_places(&self, peer: PeerIdx, offer: &Offer) -> Result<Places, Refusal> {
        match &offer.blocks {
            Some(_) if !offer.ranges.is_empty() || offer.coalesced => {
                return Err((
                    Code::InvalidArgument,
                    "ranges: a block offer carries its destinations in `blocks`, not ranges".into(),
                    0,
                ));
            }
            Some(_) => {}
            None if offer.ranges.is_empty() || offer.ranges.len() > self.cfg.max_entries => {
                return Err((
                    Code::InvalidArgument,
                    format!(
                        "ranges: {} ranges (1 to {} allowed)",
                        offer.ranges.len(),
                        self.cfg.max_entries
                    ),
                    0,
                ));
            }
            None => {}
        }
        self.check_incoming(peer, offer)?;
        Self::check_coalesced(offer)?;
        match &offer.blocks {
            Some(h) => {
                let (buffer, plan) = self.check_block_header(h, "blocks")?;
                Ok(Places::planned(buffer, plan))
            }
            None => Ok(Self::incoming_layout(offer)),
        }
    }

    /// A block header naming one of our lists (`field`: where it sits in the message): the list
    /// exists, the key is its buffer's current key (a rekey makes tokens stale), and the header
    /// agrees with the list (`BlockHeader::validate`). Returns the list's buffer and the plan.
    pub(super) fn check_block_header(
        &self,
        h: &BlockHeader,
        field: &str,
    ) -> Result<(u64, SidePlan), Refusal> {
        let list = self.lists.get(h.list_id).ok_or_else(|| {
            (
                Code::NotFound,
                format!("{field}.list_id: list {} does not exist on this node", h.list_id),
                0,
            )
        })?;
        let buffer = list.buffer();
        let key = self.buffers.get(&buffer).map(|b| b.key);
        if !key.is_some_and(|k| keys_equal(&k, &h.access_key)) {
            return Err((
                Code::PermissionDenied,
                format!(
                    "{field}.access_key: wrong access key for list {} (the key of buffer {buffer} now)",
                    h.list_id
                ),
                0,
            ));
        }
        let mut plan = SidePlan::default();
        h.validate(list, &mut plan)
            .map_err(|e| (Code::InvalidArgument, format!("{field}.{e}"), 0))?;
        Ok((buffer, plan))
    }

    /// A block READ's source at its holder (this node): the list, its key, the indices inside it,
    /// each of its blocks as long as the reader's destination block and the totals equal.
    /// Returns the list's buffer and the plan the offer's sends gather by.
    pub(super) fn check_read_blocks(&self, rb: &ReadBlocks) -> Result<(u64, SidePlan), Refusal> {
        let list = self.lists.get(rb.source_list).ok_or_else(|| {
            (
                Code::NotFound,
                format!(
                    "blocks.source_list: list {} does not exist on this node",
                    rb.source_list
                ),
                0,
            )
        })?;
        let buffer = list.buffer();
        let key = self.buffers.get(&buffer).map(|b| b.key);
        if !key.is_some_and(|k| keys_equal(&k, &rb.source_key)) {
            return Err((
                Code::PermissionDenied,
                format!(
                    "blocks.source_key: wrong access key for list {} (the key of buffer {buffer} now)",
                    rb.source_list
                ),
                0,
            ));
        }
        let bad = |e: blocks::BlockError| (Code::InvalidArgument, format!("blocks.{e}"), 0);
        let (n, m) = (rb.source_indices.count(), rb.dest.indices.count());
        if n != m {
            return Err(bad(blocks::BlockError::CountMismatch {
                field: "dest.indices".into(),
                got: m,
                other: "source_indices".into(),
                want: n,
            }));
        }
        if let blocks::PairLengths::Each(b) = &rb.dest.lengths
            && b.len() as u64 != n.saturating_mul(4)
        {
            return Err(bad(blocks::BlockError::Malformed {
                field: "dest.lengths".into(),
                why: format!("{} bytes for {n} blocks (a u32 each)", b.len()),
            }));
        }
        let lengths = &rb.dest.lengths;
        let mut plan = SidePlan::default();
        let same_len = match (lengths, list.uniform_len()) {
            (blocks::PairLengths::Uniform(partner), Some(len)) => *partner == len,
            _ => false,
        };
        if same_len {
            // Every block as long as the reader's: nothing to compare per block.
            plan.rebuild_checked(list, &rb.source_indices, "source_indices")
                .map_err(bad)?;
        } else {
            plan.rebuild(list, &rb.source_indices, "source_indices", |at, index, len| {
                let partner = lengths.get(at).unwrap_or(0);
                if partner == len {
                    Ok(())
                } else {
                    Err(blocks::BlockError::LengthMismatch {
                        field: "source_indices".into(),
                        at,
                        index,
                        len,
                        partner,
                    })
                }
            })
            .map_err(bad)?;
        }
        if plan.total() != rb.dest.total {
            return Err(bad(blocks::BlockError::Malformed {
                field: "dest.total".into(),
                why: format!(
                    "the header says {} bytes, but the {n} blocks hold {}",
                    rb.dest.total,
                    plan.total()
                ),
            }));
        }
        Ok((buffer, plan))
    }

    /// A peer's block READ of one of our lists: checked (`check_read_blocks`), then answered with
    /// an offer over the list's buffer carrying the reader's header back, or refused naming the
    /// field.
    pub(super) fn on_read_blocks(
        &mut self,
        peer: PeerIdx,
        read_id: u64,
        pairs: usize,
        rb: ReadBlocks,
        deadline_ms: u64,
        host_dests: bool,
    ) {
        let verdict = if pairs > 0 {
            Err((
                Code::InvalidArgument,
                "pairs: a block read request carries its ranges in `blocks`, not pairs".to_string(),
                0,
            ))
        } else {
            self.check_read_blocks(&rb)
        };
        let (buffer, plan) = match verdict {
            Ok(v) => v,
            Err((code, message, range_index)) => {
                self.actions.push_back(Action::Control {
                    peer,
                    msg: PeerMsg::ReadReject {
                        read_id,
                        code,
                        message,
                        range_index,
                    },
                });
                return;
            }
        };
        let offer_id = self.next_offer;
        self.next_offer += 1;
        self.make_offer(
            peer,
            offer_id,
            read_id,
            None,
            vec![0],
            Places::planned(buffer, plan),
            Ranges::default(),
            Some(Box::new(rb.dest)),
            Vec::new(),
            deadline_ms,
            host_dests,
        );
    }
}
