//! A framed session's transfer started without its task waiting for the poller's answer.
//!
//! A transfer request's checks run on the session's task, which hands the command to the poller
//! and goes back to reading requests. The rest of the start — the poller's answer (the transfer's
//! id), the wait for its end and its final event — is one future run inline
//! (`crate::api::local::inline`): polled by the thread that answers, which is the poller's own at
//! the end of its pass. Before, that answer woke the session's task (a runtime worker woken,
//! ~3.4 context switches a 4 KiB READ among the runtime's workers on the 2-core build VM), only
//! for it to register the wait for the end (docs/BENCHMARKS.md, "Session 23, client-leg").
//!
//! [`Starting`] is what the session keeps meanwhile: the id once known (`cancel_tag` waits for
//! it), and, when the session ends with the start still on its way, the order to cancel the
//! transfer as soon as its id comes (the client went away).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use tonic::Status;

use super::super::delivery::{Delivered, deliver_finished};
use super::super::local::outbox::Outbox;
use super::super::proto::v1 as pb;
use super::super::proto::v1::session_event::Event;
use super::super::state::DaemonState;
use super::super::transfers::{Started, cancel_unheard};
use crate::engine::TransferId;

/// A transfer's start as the session hands it on: everything after its checks.
pub(super) type Start = Pin<Box<dyn Future<Output = Result<Started, Status>> + Send>>;

/// A transfer whose start is on its way, as its session sees it.
#[derive(Default)]
pub(crate) struct Starting {
    state: Mutex<State>,
    /// Rung when the start ended (id known, or refused).
    known: tokio::sync::Notify,
}

#[derive(Default)]
struct State {
    id: Option<TransferId>,
    refused: bool,
    /// The session ended (the client went away) before the id came: cancel the transfer then.
    abandoned: bool,
    /// The session ended: a transfer started fast (`fast.rs`) pushes no event any more.
    stopped: bool,
}

/// What [`Starting::wait`] found.
pub(super) enum Known {
    Id(TransferId),
    /// The start was refused: its refusal is the request's event; nothing to cancel.
    Refused,
}

impl Starting {
    /// The transfer's id once the poller gave it, or that its start was refused.
    pub(super) async fn wait(&self) -> Known {
        loop {
            let rung = self.known.notified();
            tokio::pin!(rung);
            rung.as_mut().enable();
            {
                let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(id) = s.id {
                    return Known::Id(id);
                }
                if s.refused {
                    return Known::Refused;
                }
            }
            rung.await;
        }
    }

    /// The id, if the poller gave it already.
    pub(super) fn id(&self) -> Option<TransferId> {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).id
    }

    /// The session ends (its client went away): the id if known (the caller cancels it), else
    /// the start cancels the transfer itself when the id comes.
    pub(super) fn abandon(&self) -> Option<TransferId> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.abandoned = true;
        s.id
    }

    /// The session ends: a fast start's delivery pushes nothing after this (as a stopped
    /// inline delivery, `Inline::stop`).
    pub(super) fn stop(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).stopped = true;
    }

    /// Runs `push` (a final event's push into the outbox) unless the session stopped or
    /// abandoned the transfer, under the slot's lock (`stop` waits for a push in progress).
    pub(super) fn unless_stopped<T>(&self, push: impl FnOnce() -> T) -> Option<T> {
        let s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if s.stopped || s.abandoned {
            return None;
        }
        let pushed = push();
        drop(s);
        Some(pushed)
    }

    /// The poller gave the id; `true` when the session was abandoned meanwhile (cancel it).
    pub(super) fn started(&self, id: TransferId) -> bool {
        let abandoned = {
            let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
            s.id = Some(id);
            s.abandoned
        };
        self.known.notify_waiters();
        abandoned
    }

    pub(super) fn refused(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).refused = true;
        self.known.notify_waiters();
    }
}

/// The rest of a framed session's transfer request, run inline: the start's end (the poller's
/// answer), then the transfer's end, its event pushed into the outbox; or the refusal. The tag is
/// marked delivered with either (`deliver_finished`, `deliver_refused`).
pub(super) async fn run(
    tag: u64,
    start: Start,
    slot: Arc<Starting>,
    state: Arc<DaemonState>,
    outbox: Arc<Outbox>,
    delivered: Arc<Delivered>,
) {
    match start.await {
        Ok(s) => {
            if slot.started(s.id) {
                tracing::debug!(
                    transfer = s.id.0,
                    "the session ended while its transfer started: cancelling"
                );
                if state.same_node.cancel(s.id.0).is_none() {
                    cancel_unheard(&state.poller, s.id);
                }
                return;
            }
            deliver_finished(tag, s, outbox, delivered).await
        }
        Err(status) => {
            slot.refused();
            deliver_refused(tag, status, &outbox, &delivered);
        }
    }
}

/// Pushes a start's refusal into the outbox, the tag marked delivered under the same lock (as
/// `deliver_finished` does: the client may use the tag again once it has the event).
pub(super) fn deliver_refused(tag: u64, status: Status, outbox: &Arc<Outbox>, delivered: &Delivered) {
    let ev = pb::SessionEvent {
        tag,
        event: Some(Event::Refused(pb::EntryStatus {
            code: status.code() as i32,
            message: status.message().to_string(),
        })),
    };
    let wake = {
        let mut tags = delivered.tags.lock().unwrap_or_else(|e| e.into_inner());
        tags.push(tag);
        // A broken connection: the session's task finds it so (woken after the lock, as
        // `deliver_finished` wakes it: polled inline it takes the lock).
        outbox.push_unwoken(&ev).1
    };
    if wake {
        outbox.wake_writer();
    }
    delivered.rung.notify_one();
}
