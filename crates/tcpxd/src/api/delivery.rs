//! How a session's events reach a client of the framed local session without its task: a
//! transfer's final event pushed into the connection's outbox by the thread that finished the
//! transfer, the node's notifications by the thread that published each (src/api/local/inline.rs,
//! outbox.rs). The session (src/api/session/) starts these and forgets the transfers they
//! delivered (`Delivered`).

use std::sync::Arc;

use tokio::sync::broadcast::{self, error::RecvError};
use tonic::Status;

use super::local::inline::Inline;
use super::local::outbox::{BACKLOG, Outbox};
use super::proto::v1 as pb;
use super::proto::v1::session_event::Event;
use super::transfers::{self, Started};
use crate::poller::NotificationEvent;

/// A session's subscription to the node's notifications: read by its task, or (with an outbox)
/// delivered by the thread that publishes each.
pub(crate) enum Subscription {
    Task(broadcast::Receiver<NotificationEvent>, Addressed),
    Inline(Arc<Inline>),
}

/// Which of the node's notifications a subscriber gets: all (`None`), or those addressed to one
/// name (`SubscribeRequest.addressed_to`: an agent's feed on a daemon several agents share).
pub(crate) type Addressed = Option<Arc<[u8]>>;

/// The subscriber's filter from its request: `None` (all) when `addressed_to` is empty.
pub(crate) fn addressed(req: &pb::SubscribeRequest) -> Addressed {
    (!req.addressed_to.is_empty()).then(|| Arc::from(req.addressed_to.as_bytes()))
}

/// tcpxd.nixl's framing of a notification (python/src/tcpxd/nixl/_notify.py, `frame`).
const NIXL_MAGIC: &[u8] = b"\0NIXL1";

/// Whether `payload` goes to a subscriber with filter `to`: every payload without one; with
/// one, only a frame `"\0NIXL1", u16 len(from), u16 len(to) (big-endian), from, to, message`
/// whose `to` is that name (anything else, another agent's or another user's, is not its).
pub(crate) fn is_for(to: &Addressed, payload: &[u8]) -> bool {
    let Some(to) = to else {
        return true;
    };
    let Some(rest) = payload.strip_prefix(NIXL_MAGIC) else {
        return false;
    };
    let (Some(lf), Some(lt)) = (rest.get(0..2), rest.get(2..4)) else {
        return false;
    };
    let lf = u16::from_be_bytes([lf[0], lf[1]]) as usize;
    let lt = u16::from_be_bytes([lt[0], lt[1]]) as usize;
    rest.get(4 + lf..4 + lf + lt) == Some(&to[..])
}

/// The next notification for the filter `to` (those addressed elsewhere skipped, in the daemon:
/// the subscriber's client never reads them).
pub(crate) async fn next_for(
    rx: &mut broadcast::Receiver<NotificationEvent>,
    to: &Addressed,
) -> Result<NotificationEvent, RecvError> {
    loop {
        match rx.recv().await {
            Ok(n) if !is_for(to, &n.payload) => continue,
            other => return other,
        }
    }
}

/// The tags of transfers whose final event an inline delivery pushed: no longer open once the
/// session's task takes them (`reap`).
#[derive(Default)]
pub(crate) struct Delivered {
    pub(crate) tags: std::sync::Mutex<Vec<u64>>,
    /// Rung after each: a session draining its last transfers looks.
    pub(crate) rung: tokio::sync::Notify,
}

/// The event a notification (or a subscriber's falling behind) makes; `None` once the node's
/// notifications ended (the daemon stops).
pub(crate) fn notification_event(n: Result<NotificationEvent, RecvError>) -> Option<Event> {
    match n {
        Ok(n) => {
            tracing::trace!(target: "tcpxd::hop", hop = "api.notify", id = n.transfer_id);
            Some(Event::Notification(pb::Notification {
                from_node: n.from_node,
                transfer_id: n.transfer_id,
                payload: n.payload,
                buffer_ids: n.buffers,
            }))
        }
        Err(RecvError::Lagged(k)) => {
            let status = Status::data_loss(format!(
                "subscribe: this session fell behind and missed {k} notifications; it stays subscribed"
            ));
            Some(Event::Refused(pb::EntryStatus {
                code: status.code() as i32,
                message: status.message().to_string(),
            }))
        }
        Err(RecvError::Closed) => None,
    }
}

/// A started transfer's final event, once it ended: its own, or one carrying the status it
/// failed with (for a session's `Finished` event, delivered inline or by the session's task).
pub(crate) async fn final_event(s: Started) -> pb::TransferEvent {
    match transfers::finished(s.id, s.rx).await {
        Ok(ev) => ev,
        Err(status) => lost_event(s.id.0, s.total, &status),
    }
}

/// Waits for a transfer's end and pushes its final event into the outbox: run inline
/// (src/api/local/inline.rs), so on the thread that finished the transfer. The tag is marked
/// delivered first: once the client has the event it may use the tag again.
pub(crate) async fn deliver_finished(tag: u64, s: Started, outbox: Arc<Outbox>, delivered: Arc<Delivered>) {
    let event = final_event(s).await;
    let wake = push_finished(tag, event, &outbox, &delivered);
    woken(wake, &outbox, &delivered);
}

/// The event of a transfer that failed with `status` before it finished (the daemon stopped).
pub(crate) fn lost_event(id: u64, total: u64, status: &Status) -> pb::TransferEvent {
    pb::TransferEvent {
        transfer_id: id,
        state: pb::TransferState::Finished as i32,
        total_bytes: total,
        status_code: status.code() as i32,
        status_message: status.message().to_string(),
        ..Default::default()
    }
}

/// After [`push_finished`] (its locks released): the session's writer woken if the socket did
/// not take everything, the session rung.
pub(crate) fn woken(wake: bool, outbox: &Outbox, delivered: &Delivered) {
    if wake {
        outbox.wake_writer();
    }
    delivered.rung.notify_one();
}

/// Marks `tag` delivered and pushes its final event (and the board's copy); `true` when the
/// session's writer must be woken ([`woken`], once the caller released its own locks).
pub(crate) fn push_finished(
    tag: u64,
    event: pb::TransferEvent,
    outbox: &Arc<Outbox>,
    delivered: &Delivered,
) -> bool {
    tracing::trace!(target: "tcpxd::hop", hop = "api.out", id = event.transfer_id);
    // The tag is marked and the event pushed under one lock of the tags: the client cannot
    // see the event (and use the tag again) before the mark, and the session cannot see the
    // mark (and end, the transfer no longer open) before the event is in the outbox. The
    // board's copy (local/board.rs) goes under the same lock, after the mark, before the
    // event: a client that reads it first knows what the event will say.
    // The session's task is woken (to write what the socket did not take) only after the
    // lock: woken here it may be polled right here, inline, and take the lock itself (a
    // deadlock of the thread with itself, seen on the poller's thread: session 27).
    let mut tags = delivered.tags.lock().unwrap_or_else(|e| e.into_inner());
    tags.push(tag);
    outbox.publish(tag, &event);
    let ev = pb::SessionEvent {
        tag,
        event: Some(Event::Finished(event)),
    };
    // A broken connection: the session's task finds it so and cancels what is open.
    outbox.push_unwoken(&ev).1
}

/// Pushes the node's notifications into the outbox as they are published (inline: on the
/// publishing thread), waiting while the client leaves too much unread (it then falls behind
/// and is told how many it missed, as a slow subscriber is).
pub(crate) async fn deliver_notifications(
    tag: u64,
    mut rx: broadcast::Receiver<NotificationEvent>,
    to: Addressed,
    outbox: Arc<Outbox>,
) {
    loop {
        if outbox.backlog() >= BACKLOG {
            outbox.room().await;
        }
        let Some(event) = notification_event(next_for(&mut rx, &to).await) else {
            return;
        };
        // Its payload on the session's board too, numbered in the events' order (local/board.rs).
        if let Event::Notification(n) = &event {
            outbox.note(&n.payload);
        }
        if outbox
            .push(&pb::SessionEvent {
                tag,
                event: Some(event),
            })
            .is_err()
        {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(from: &str, to: &str, msg: &[u8]) -> Vec<u8> {
        let mut f = NIXL_MAGIC.to_vec();
        f.extend_from_slice(&(from.len() as u16).to_be_bytes());
        f.extend_from_slice(&(to.len() as u16).to_be_bytes());
        f.extend_from_slice(from.as_bytes());
        f.extend_from_slice(to.as_bytes());
        f.extend_from_slice(msg);
        f
    }

    #[test]
    fn a_filter_keeps_only_frames_addressed_to_its_name() {
        let b: Addressed = Some(Arc::from(&b"b"[..]));
        assert!(is_for(&b, &frame("a", "b", b"hi")));
        assert!(!is_for(&b, &frame("b", "a", b"hi")), "from b, to a");
        assert!(!is_for(&b, &frame("a", "bb", b"")), "a longer name");
        assert!(!is_for(&b, &frame("a", "", b"b")), "the message is not the name");
        assert!(!is_for(&b, b"plain payload"), "not a frame");
        let mut cut = frame("a", "b", b"");
        cut.pop();
        assert!(!is_for(&b, &cut), "cut short");
        assert!(!is_for(&b, NIXL_MAGIC), "no lengths");
    }

    #[test]
    fn no_filter_keeps_everything() {
        assert!(is_for(&None, b"plain payload"));
        assert!(is_for(&None, &frame("a", "b", b"x")));
        assert!(addressed(&pb::SubscribeRequest::default()).is_none());
    }
}
