//! Control-stream messages as the engine sees them (the peer layer converts them to and from
//! `tcpxd.v1.PeerMessage`). See proto/tcpxd/v1/peer.proto for the protocol.

use super::blocks::{BlockHeader, IndexArray};
use super::error::Code;
use super::ranges::{Ranges, ReadPairs};

/// A buffer range on the node that receives the message, as the sender claims it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteRange {
    pub buffer_id: u64,
    pub access_key: [u8; 16],
    pub offset: u64,
    pub length: u64,
}

/// Credits returned to a sender, sparse (peer protocol 12): `(lane, count)` pairs, kept as the
/// wire carries them (`lane, count, lane, count, …`) so that neither side converts. A valid
/// one names lanes in strictly increasing order, each below the pairing's lane count, each
/// with a nonzero count ([`ReturnedCredits::check`]); a lane not named returns none. Until
/// protocol 11 the wire carried one count per lane of the pairing — hundreds on a routed
/// pairing, nearly all zero, each decoded and walked for every `Done` (issue #38).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReturnedCredits(Vec<u32>);

impl ReturnedCredits {
    /// As the wire carries it, unchecked (the engine checks it against the pairing).
    pub fn from_wire(flat: Vec<u32>) -> Self {
        Self(flat)
    }

    /// The wire form: `lane, count` pairs.
    pub fn wire(&self) -> &[u32] {
        &self.0
    }

    /// The wire form, taken.
    pub fn into_wire(self) -> Vec<u32> {
        self.0
    }

    /// From one count per lane (lanes with 0 left out).
    pub fn from_counts(counts: &[u32]) -> Self {
        let mut r = Self::default();
        for (lane, &n) in counts.iter().enumerate() {
            if n > 0 {
                r.0.extend([lane as u32, n]);
            }
        }
        r
    }

    /// Whether it returns nothing.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The `(lane, count)` pairs, in order (an odd last number is left out: `check` refuses it).
    pub fn pairs(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.0.chunks_exact(2).map(|p| (p[0], p[1]))
    }

    /// The credits returned on `lane` (0: none).
    pub fn on_lane(&self, lane: u32) -> u32 {
        self.pairs().find(|&(l, _)| l == lane).map_or(0, |(_, n)| n)
    }

    /// The credits returned on all lanes.
    pub fn total(&self) -> u64 {
        self.pairs().map(|(_, n)| u64::from(n)).sum()
    }

    /// Adds `count` (nonzero) credits on `lane`, not named yet, keeping the lanes in order. The
    /// pairs are few (the lanes owing credits), so finding the place by a scan costs less than
    /// a sort.
    pub(crate) fn insert(&mut self, lane: u32, count: u32) {
        debug_assert!(count > 0 && self.on_lane(lane) == 0);
        let at = self.pairs().take_while(|&(l, _)| l < lane).count() * 2;
        self.0.splice(at..at, [lane, count]);
    }

    /// Whether it is well formed for a pairing of `lanes` lanes: whole pairs, lanes strictly
    /// increasing (so none twice) and below `lanes`, counts nonzero. Whether each count fits
    /// what the lane's sender has out is the lane's own check.
    pub fn check(&self, lanes: usize) -> Result<(), String> {
        if self.0.len() % 2 != 0 {
            return Err(format!(
                "credits as {} numbers, not (lane, count) pairs",
                self.0.len()
            ));
        }
        let mut last: Option<u32> = None;
        for (lane, n) in self.pairs() {
            if lane as usize >= lanes {
                return Err(format!("credits for lane {lane}, the pairing has {lanes}"));
            }
            if let Some(prev) = last.filter(|&prev| lane <= prev) {
                return Err(format!(
                    "credits for lane {lane} after lane {prev}: lanes must increase"
                ));
            }
            if n == 0 {
                return Err(format!("0 credits for lane {lane}"));
            }
            last = Some(lane);
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    pub offer_id: u64,
    pub read_id: u64,
    pub chunk_bytes: u32,
    pub first_lane: u32,
    /// The receiver's ranges, in entry order: per range, or packed (a batch of one buffer pair).
    pub ranges: Ranges,
    pub notification: Vec<u8>,
    pub deadline_ms: u64,
    /// A block transfer (`ranges` is empty): the receiver's list, its indices, the sender's
    /// lengths and the total. Chunks are those of one range of `total` bytes.
    pub blocks: Option<Box<BlockHeader>>,
    /// A plain transfer whose ranges all lie in one buffer on each side, cut into chunks as one
    /// range of their total length (many small ranges share a chunk): each side gathers or
    /// scatters a chunk's pieces by its own `SidePlan` of the ranges.
    pub coalesced: bool,
    /// The sender's transfer this offer is part of (what the receiver's notification names);
    /// 0 for an offer serving a READ and from daemons before it (the offer id is named then).
    pub transfer_id: u64,
    /// A streamed header (credits at any size, `crate::streams`): only its first `n` chunks
    /// are announced; `MoreChunks` announces the rest. `None`: every chunk (offers, and every
    /// header before peer protocol 6).
    pub announced: Option<u64>,
}

impl Offer {
    /// What the receiver's notification names: the sender's transfer id, or the offer id from a
    /// sender that did not say.
    pub fn notify_id(&self) -> u64 {
        if self.transfer_id != 0 {
            self.transfer_id
        } else {
            self.offer_id
        }
    }
}

/// The block part of a READ request: the holder's list (from its token) and indices, and the
/// header the holder's offer must carry back to the reader (its own list, indices, lengths).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadBlocks {
    pub source_list: u64,
    pub source_key: [u8; 16],
    pub source_indices: IndexArray,
    pub dest: BlockHeader,
}

/// A READ's source range (the holder's buffer) and destination (the reader's buffer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadPair {
    pub source: RemoteRange,
    pub dest: RemoteRange,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerMsg {
    /// How the sender of this message receives (its first message on the stream): `credits`
    /// receives of `chunk_bytes` kept posted on each of its eager lanes, or 0 credits
    /// (rendezvous on every lane). Its eager lanes are those from `eager_first_lane` on (0: every
    /// lane); with lanes left for rendezvous (`eager_first_lane` > 0) it wants transfers of at
    /// most `eager_max_bytes` (0: any size) eager and larger ones by rendezvous on lanes
    /// `0..eager_first_lane`. Both new fields are 0 in the form of an eager or rendezvous node.
    ReceiveMode {
        credits: u32,
        chunk_bytes: u32,
        eager_first_lane: u32,
        eager_max_bytes: u64,
    },
    /// The sender of this message lands its credit receives in GPU memory: a transfer whose
    /// destinations are all in `buffer_ids` (its GPU buffers, sent before its `ReceiveMode` and
    /// again for each GPU buffer registered later) may take its credit lanes at any size, chunks
    /// spending `budget_bytes` per lane (un-consumed bytes at most) besides one credit each.
    /// `buffer_gpus`: each buffer's GPU ordinal, in order (empty: not said; `GPU_NOT_KNOWN`: not
    /// known), from which a routed pairing's sender picks its eager lanes (`crate::routes`).
    GpuCredits {
        budget_bytes: u64,
        buffer_ids: Vec<u64>,
        buffer_gpus: Vec<u32>,
    },
    /// The next `count` chunks of a streamed header (its plan goes on where the last
    /// announcement stopped), their sends already posted within credits.
    MoreChunks {
        offer_id: u64,
        count: u64,
    },
    /// Credits returned: receives re-posted since the last message, on the lanes it names
    /// ([`ReturnedCredits`], sparse since peer protocol 12).
    Credits {
        returned: ReturnedCredits,
    },
    /// An eager transfer's header: the same fields as an offer, but the sends are already
    /// posted (within credits); the receiver answers only `Done`, `Reject` or `Failed`.
    Header(Offer),
    Offer(Offer),
    Accept {
        offer_id: u64,
        /// A routed pairing's offer: the first lane the receiver chose in the offer's memory
        /// pair's lanes (`routes.rs`); `None` otherwise (the offer's own first lane stands).
        first_lane: Option<u32>,
    },
    Reject {
        offer_id: u64,
        code: Code,
        message: String,
        range_index: u32,
    },
    /// The receiver holds every byte of `offer_id` (its chunks consumed). `returned`: the
    /// credits returned with it, as [`PeerMsg::Credits`] would carry them (empty: none) — the
    /// consume that finished the offer re-posted its receive, so a small eager transfer's end is
    /// one message, not `Done` and `Credits` (peer protocol 9).
    Done {
        offer_id: u64,
        returned: ReturnedCredits,
    },
    Failed {
        offer_id: u64,
        code: Code,
        message: String,
    },
    CancelOffer {
        offer_id: u64,
        code: Code,
        message: String,
    },
    /// Peer protocol 7 (numpy-zeros): the answer to `CancelOffer` for an offer the receiver
    /// still has, sent once it discards the offer's chunks. Until it comes (or `Done`,
    /// `Failed`, `Reject`, `CancelRead`) the sender holds the offer's chunks that go out empty:
    /// an emptied chunk reaching a receiver that still lands the offer would be landed as zeros
    /// wherever the receive cannot tell "empty" from "received in place".
    CancelSeen {
        offer_id: u64,
    },
    ReadRequest {
        read_id: u64,
        /// Per pair, or packed (a batch of one buffer pair).
        pairs: ReadPairs,
        deadline_ms: u64,
        /// A block READ (`pairs` is empty).
        blocks: Option<Box<ReadBlocks>>,
        /// Peer protocol 11: every destination is host memory on the reader (the holder may
        /// answer inline without knowing the reader's memory itself: `inline.rs`).
        host_dests: bool,
    },
    ReadReject {
        read_id: u64,
        code: Code,
        message: String,
        range_index: u32,
    },
    CancelRead {
        read_id: u64,
    },
    /// A prepared transfer's notification (peer protocol 5), or (protocol 8) a plain WRITE's
    /// sent in several parts to this peer (`route_parts.rs`): sent by the node that ran the
    /// transfer once every part of it finished OK (a WRITE's after every `Done`, a READ's after
    /// every byte landed there), never on failure. `lists`: the receiver's lists it touched;
    /// `buffers`: the receiver's buffers a split plain WRITE wrote.
    Notify {
        transfer_id: u64,
        payload: Vec<u8>,
        lists: Vec<u64>,
        buffers: Vec<u64>,
    },
    /// The sender failed the pairing, for this reason (its last message on the stream): the
    /// receiver fails it too and reports the sender's reason, e.g. its plugin's words.
    Goodbye {
        reason: String,
    },
    /// Peer protocol 6, lanes opened on first use (`lane_life.rs`): the sender of this message
    /// will send on `lane` (one of the receiver's receive lanes) and asks it to listen for it.
    LaneOpen {
        lane: u32,
    },
    /// The answer: `lane` is listened for (and accepted), this is its connect handle.
    LaneListening {
        lane: u32,
        handle: Vec<u8>,
    },
    /// The sender of this message has nothing on `lane` and would close it.
    LaneClose {
        lane: u32,
    },
    /// The answer: closed on this side too (`closed`), or kept because this side still has
    /// receives on it (the lane stays open; the closing side sends on it again).
    LaneCloseAnswer {
        lane: u32,
        closed: bool,
    },
    /// Peer protocol 7, pairings closed when idle (`pair_life.rs`): the sender of this message
    /// has had nothing on the pairing for its `pairing_idle_close` and would close it.
    PairingClose,
    /// The answer: closed on this side too (`closed`: both end the control stream and every
    /// comm of the pairing; the next use pairs anew), or kept because this side has something
    /// on it.
    PairingCloseAnswer {
        closed: bool,
    },
    /// Peer protocol 11 (`inline.rs`): the sender of this message takes transfers of at most
    /// `max_bytes` in total inline (sent before its `ReceiveMode`; never sent: none).
    InlineLimit {
        max_bytes: u64,
    },
    /// Peer protocol 11: a small transfer whole, its header (`offer`: ranges, keys,
    /// notification, the READ it serves) and its bytes (`payload`: the ranges' bytes in order).
    /// No chunk follows on any lane; the receiver answers `Done`, `Reject` or `Failed`.
    Inline {
        offer: Offer,
        payload: Vec<u8>,
    },
}

/// A peer's request that could not be read: a field missing or out of range. The engine
/// refuses it naming the field (`Engine::on_malformed`); nothing was posted for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Malformed {
    Offer { offer_id: u64, why: String },
    ReadRequest { read_id: u64, why: String },
}

impl PeerMsg {
    /// The message's kind and the transfer it is about (an offer or read id; 0 for none), for the
    /// hop trace (`RUST_LOG=tcpxd::hop=trace`).
    pub fn label(&self) -> (&'static str, u64) {
        match self {
            PeerMsg::ReceiveMode { .. } => ("receive_mode", 0),
            PeerMsg::Credits { .. } => ("credits", 0),
            PeerMsg::GpuCredits { .. } => ("gpu_credits", 0),
            PeerMsg::MoreChunks { offer_id, .. } => ("more_chunks", *offer_id),
            PeerMsg::Header(o) => ("header", o.offer_id),
            PeerMsg::Offer(o) => ("offer", o.offer_id),
            PeerMsg::Accept { offer_id, .. } => ("accept", *offer_id),
            PeerMsg::Reject { offer_id, .. } => ("reject", *offer_id),
            PeerMsg::Done { offer_id, .. } => ("done", *offer_id),
            PeerMsg::Failed { offer_id, .. } => ("failed", *offer_id),
            PeerMsg::CancelOffer { offer_id, .. } => ("cancel_offer", *offer_id),
            PeerMsg::CancelSeen { offer_id } => ("cancel_seen", *offer_id),
            PeerMsg::ReadRequest { read_id, .. } => ("read_request", *read_id),
            PeerMsg::ReadReject { read_id, .. } => ("read_reject", *read_id),
            PeerMsg::CancelRead { read_id } => ("cancel_read", *read_id),
            PeerMsg::Notify { transfer_id, .. } => ("notify", *transfer_id),
            PeerMsg::Goodbye { .. } => ("goodbye", 0),
            PeerMsg::LaneOpen { lane } => ("lane_open", u64::from(*lane)),
            PeerMsg::LaneListening { lane, .. } => ("lane_listening", u64::from(*lane)),
            PeerMsg::LaneClose { lane } => ("lane_close", u64::from(*lane)),
            PeerMsg::LaneCloseAnswer { lane, .. } => ("lane_close_answer", u64::from(*lane)),
            PeerMsg::PairingClose => ("pairing_close", 0),
            PeerMsg::PairingCloseAnswer { .. } => ("pairing_close_answer", 0),
            PeerMsg::InlineLimit { .. } => ("inline_limit", 0),
            PeerMsg::Inline { offer, .. } => ("inline", offer.offer_id),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A notification names the sender's transfer; an offer from a daemon that does not send it
    /// (0) names the offer, as before.
    #[test]
    fn a_notification_names_the_senders_transfer_else_the_offer() {
        let mut o = Offer {
            offer_id: 7,
            read_id: 0,
            chunk_bytes: 4096,
            first_lane: 0,
            ranges: Ranges::default(),
            notification: b"n".to_vec(),
            deadline_ms: 0,
            blocks: None,
            coalesced: false,
            transfer_id: 9,
            announced: None,
        };
        assert_eq!(o.notify_id(), 9);
        o.transfer_id = 0;
        assert_eq!(o.notify_id(), 7);
    }
}
