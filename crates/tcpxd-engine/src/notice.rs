//! A notification alone: a WRITE of exactly one zero-byte entry carrying a notification (peer
//! protocol 10). It travels as control messages only: the sender's header (one range of length 0,
//! no chunks), the receiver's `Done` or `Reject`. No lane, credit or landing slot is touched.
//!
//! - **Sender** ([`Engine::send_notice`]): the header goes on the control stream as soon as the
//!   peer's receive mode is known (as any offer's); the offer counts as accepted and sent, with no
//!   chunk unfinished, so `Done` ends it and a `Reject` fails it. A cancel or deadline before the
//!   answer sends `CancelOffer` as a WRITE's does; the receiver always answers the header first
//!   (`Done` or `Reject`: the control stream is ordered), which ends the held offer.
//! - **Receiver** ([`Engine::on_notice`]): the gate a WRITE's key check keeps — the range's buffer
//!   exists, the access key is its own, the offset is inside it (offset = size allowed: zero
//!   bytes) — then `Done` and the notification delivered (`Action::Notify`, naming that buffer),
//!   in that order, as a WRITE's last consume does. Refused: `Reject` naming `ranges[0]`, nothing
//!   delivered.
//! - **Order**: headers of one pairing arrive in stream order and a notice is delivered when its
//!   header is read, so notices from one sender reach subscribers in the order sent. A notice is
//!   not held behind an earlier WRITE still landing (that WRITE's notification comes when its
//!   last chunk is consumed); clients that need that order wait for the WRITE (tcpxd.nixl does).

use super::*;

impl Engine {
    /// Whether an offer or header is a notification alone: one range of zero bytes, a
    /// notification, not a block transfer, not serving a READ.
    pub(super) fn is_lone_notice(offer: &Offer) -> bool {
        offer.blocks.is_none()
            && offer.read_id == 0
            && !offer.notification.is_empty()
            && offer.ranges.len() == 1
            && offer.ranges.first().is_some_and(|r| r.length == 0)
    }

    /// Sends a recorded notice's header (`msg`, taken from its offer) on control: no chunks, so
    /// nothing is queued on a lane; the offer waits only for the peer's `Done` or `Reject`.
    pub(super) fn send_lone_notice(&mut self, offer_id: u64, mut msg: Offer) {
        let chunk_bytes = self.cfg.chunk_bytes;
        let o = self.out_offers.get_mut(&offer_id).expect("present");
        let (peer, transfer) = (o.peer, o.transfer);
        o.chunk_bytes = chunk_bytes;
        o.first_lane = 0;
        o.lanes = 0..0;
        // Answered as an eager header is (a `Reject` fails it at any time), accepted at once,
        // nothing to send.
        o.eager = true;
        o.accepted = true;
        o.unfinished = 0;
        msg.chunk_bytes = chunk_bytes;
        msg.first_lane = 0;
        self.peers[&peer].sent_notices += 1;
        self.actions.push_back(Action::Control {
            peer,
            msg: PeerMsg::Header(msg),
        });
        if let Some(t) = transfer {
            self.set_running(t);
        }
    }

    /// A peer's notice (`is_lone_notice`): checked as a WRITE's range is, then answered `Done` and
    /// delivered, or refused with `Reject`.
    pub(super) fn on_lone_notice(&mut self, peer: PeerIdx, offer: Offer) {
        let verdict = self.check_lone_notice(&offer);
        let p = self.peers.get_mut(&peer).expect("live");
        p.received_notices += 1;
        match verdict {
            Ok(buffer) => {
                let returned = self.take_owed_credits(peer).unwrap_or_default();
                self.actions.push_back(Action::Control {
                    peer,
                    msg: PeerMsg::Done {
                        offer_id: offer.offer_id,
                        returned,
                    },
                });
                self.actions.push_back(Action::Notify {
                    peer,
                    transfer_id: offer.notify_id(),
                    payload: offer.notification,
                    buffers: vec![buffer],
                });
            }
            Err((code, message)) => self.actions.push_back(Action::Control {
                peer,
                msg: PeerMsg::Reject {
                    offer_id: offer.offer_id,
                    code,
                    message,
                    range_index: 0,
                },
            }),
        }
    }

    /// The notice's gate: its notification within this node's limit, its buffer ours, the key
    /// that buffer's, the offset inside it. Returns the buffer.
    fn check_lone_notice(&self, offer: &Offer) -> Result<u64, (Code, String)> {
        if offer.notification.len() > self.cfg.max_notification {
            return Err((
                Code::InvalidArgument,
                format!(
                    "notification of {} bytes exceeds {}",
                    offer.notification.len(),
                    self.cfg.max_notification
                ),
            ));
        }
        let r = offer.ranges.first().expect("one range");
        let b = self.buffers.get(&r.buffer_id).ok_or_else(|| {
            (
                Code::NotFound,
                format!("ranges[0]: buffer {} does not exist", r.buffer_id),
            )
        })?;
        if !keys_equal(&b.key, &r.access_key) {
            return Err((
                Code::PermissionDenied,
                format!("ranges[0]: wrong access key for buffer {}", r.buffer_id),
            ));
        }
        // Zero bytes at an offset inside the buffer (its size allowed); the message is formatted
        // only for a fault (every notice delivered passes here).
        if r.offset > b.size
            && let Some(why) = range_fault(
                "ranges[0].offset",
                "ranges[0].length",
                &format!("buffer {}", r.buffer_id),
                b.size,
                r.offset,
                0,
            )
        {
            return Err((Code::InvalidArgument, why));
        }
        Ok(r.buffer_id)
    }
}
