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
    Task(broadcast::Receiver<NotificationEvent>),
    Inline(Arc<Inline>),
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
    outbox: Arc<Outbox>,
) {
    loop {
        if outbox.backlog() >= BACKLOG {
            outbox.room().await;
        }
        let Some(event) = notification_event(rx.recv().await) else {
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
