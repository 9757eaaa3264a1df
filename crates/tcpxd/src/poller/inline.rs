//! The poller's side of inline transfers (engine `inline.rs`): the sender's payload read from
//! its source pieces as the message is framed, the receiver's payload copied into its checked
//! destinations, synchronous on this thread for host memory (a few KiB: `memcpy`, a client's
//! pages by cross-memory copy). GPU memory (only with `transfer.inline_gpu` on the sending side)
//! is copied asynchronously through pinned staging (`inline_copies.rs`), synchronously only
//! when the staging is full.

use super::Poller;
use crate::buffers;
use crate::engine::{Offer, PeerIdx, PeerMsg};

impl Poller {
    /// `Action::SendInline`: the payload gathered, then the message sent as any control message
    /// is. A source that cannot be read sends nothing; the engine ends the offer.
    pub(super) fn send_inline(
        &mut self,
        peer: PeerIdx,
        offer: Offer,
        sources: Vec<(u64, u64, u64)>,
        gather: bool,
    ) {
        let offer = if gather {
            match self.gather_async(peer, offer, &sources) {
                None => return,
                Some(offer) => offer,
            }
        } else {
            offer
        };
        let total: u64 = sources.iter().map(|s| s.2).sum();
        let mut payload = vec![0u8; total as usize];
        let mut at = 0usize;
        let mut fault = None;
        for (buffer, offset, len) in sources {
            let dst = &mut payload[at..at + len as usize];
            at += len as usize;
            let r = match self.buffers.get(&buffer) {
                Some(entry) => buffers::read_into(entry, offset, dst),
                None => Err(format!("buffer {buffer} vanished")),
            };
            if let Err(why) = r {
                fault = Some(why);
                break;
            }
        }
        if let Some(why) = fault {
            let message = format!("reading the inline transfer's source: {why}");
            self.engine.on_inline_unsent(offer.offer_id, &message);
            return;
        }
        if gather && !self.engine.on_inline_gathered(offer.offer_id, Ok(())) {
            return;
        }
        self.send_control(peer, PeerMsg::Inline { offer, payload });
    }

    /// `Action::LandInline`: the payload copied into its destinations (only while the transfer
    /// still lands here), then reported to the engine, whose `Done` and notification come next.
    pub(super) fn land_inline(
        &mut self,
        peer: PeerIdx,
        offer: u64,
        dests: Vec<(u64, u64, u64)>,
        payload: Vec<u8>,
        gpu: bool,
    ) {
        tracing::trace!(target: "tcpxd::hop", hop = "poller.land_inline", offer);
        let mut result = Ok(());
        let lands = self.engine.recv_lands(peer, offer);
        let payload = if lands && gpu {
            match self.land_async(peer, offer, &dests, payload) {
                Ok(()) => return,
                Err(payload) => payload,
            }
        } else {
            payload
        };
        if lands {
            let mut at = 0usize;
            for (buffer, offset, len) in dests {
                let Some(src) = payload.get(at..at + len as usize) else {
                    result = Err(format!("inline payload of {} bytes is too short", payload.len()));
                    break;
                };
                at += len as usize;
                let r = match self.buffers.get(&buffer) {
                    Some(entry) => buffers::write_from(entry, offset, src),
                    None => Err(format!("buffer {buffer} vanished")),
                };
                if let Err(why) = r {
                    result = Err(format!("landing the inline transfer: {why}"));
                    break;
                }
            }
        }
        self.engine
            .on_inline_landed(peer, offer, payload.len() as u64, result);
    }
}
