//! A framed session's transfer request handed to the engine in the poller's pass (session 29,
//! leanstart; the poller's side is `crate::poller::fast_starts`).
//!
//! When the session is polled on the thread that serves the sessions (the poller's, or with
//! `runtime.session_thread` the sessions thread, `crate::poller`'s `session_thread.rs`: there
//! the start goes to the poller through its hub, and the engine's answer is held in the ticket
//! until that thread applies it, or the transfer's end does) and the request is the common case — a
//! WRITE or READ batch (entries, or packed ranges), no ready event, to other nodes all paired and
//! up — the session checks it here as the usual start would (`DaemonState::fast_specs`: the
//! same checks, the same refusals naming the same fields, in the same order), builds its engine
//! entries and queues them for the poller, which starts them on the engine once the session's
//! poll returned, in the same pass. Its [`Ticket`] is the transfer's sink: told the id (the
//! session's [`Starting`] slot, as a usual start's), or the engine's refusal (pushed into the
//! outbox as a usual start's refusal), and then the transfer's end, which it pushes into the
//! outbox from the poller's completion path. What the usual start builds per transfer and this
//! does not: the boxed start future (>1 KiB) and its `Inline` task, the `Command` on the poller's
//! channel and its oneshot, and the task waiting on the transfer's `watch`.
//!
//! Every other request (same node, a node to dial or wait for, a ready event, prepared lists and
//! block lists, a request polled off the poller's thread) goes the usual way (`starting.rs`), unchanged. So does
//! a fast start the engine refused only because its pairing closed when idle meanwhile: its
//! request, kept in the ticket until the engine answers, is started again the usual way once
//! the pairing settled (`DaemonState::after_idle_close`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tonic::Status;

use super::super::delivery::{Delivered, lost_event, push_finished, woken};
use super::super::local::inline::Inline;
use super::super::local::outbox::Outbox;
use super::super::proto::v1::session_request::Op;
use super::super::state::{DaemonState, status};
use super::super::transfers::{self, cancel_unheard, notification_alone};
use super::starting::{self, Start, Starting, deliver_refused};
use super::{Events, Session};
use crate::engine::{EngineError, TransferId};
use crate::poller::{Batch, FastStart, FastStarted, StartSink, TransferStatus};

/// What a session shares with its fast starts' tickets (one a session, made at its first).
pub(super) struct FastLink {
    state: Arc<DaemonState>,
    outbox: Arc<Outbox>,
    delivered: Arc<Delivered>,
    /// For the rare start that goes the usual way after all (its pairing closed when idle).
    runtime: tokio::runtime::Handle,
}

/// What [`Session::try_fast`] did with a request.
pub(super) enum Fast {
    /// Queued for the engine: its answer and its end come to its ticket.
    Queued,
    /// Refused by the checks (nothing changed): the request's event.
    Refused(Status),
    /// Not for the fast path: handed back for the usual start (boxed: that path allocates
    /// its start future anyway).
    Not(Box<Op>),
}

/// Whether `op` may go the fast way (the rest is for [`Session::try_fast`] to find).
pub(super) fn eligible(op: &Op) -> bool {
    match op {
        Op::Write(r) => r.ready_event_ipc_handle.is_empty() && r.entry.is_some(),
        Op::WriteBatch(b) => b.ready_event_ipc_handle.is_empty(),
        Op::Read(r) => r.entry.is_some(),
        Op::ReadBatch(_) => true,
        _ => false,
    }
}

/// A fast start's checked entries: the engine's entries (or a refusal, or `None`: not fast),
/// its `timeout_ms`, whether it writes, and the notification it carries.
type Planned = (Result<Option<Batch>, Status>, u64, bool, Vec<u8>);

fn plan(state: &DaemonState, op: &Op) -> Option<Planned> {
    Some(match op {
        Op::Write(r) => {
            let e = r.entry.as_ref()?;
            let alone = notification_alone(1, &r.notification);
            let specs = state.fast_specs(std::slice::from_ref(e), None, alone);
            (specs, r.timeout_ms, true, r.notification.clone())
        }
        Op::WriteBatch(b) => {
            let alone = notification_alone(b.entries.len(), &b.notification);
            let specs = state.fast_specs(&b.entries, b.ranges.as_ref(), alone);
            (specs, b.timeout_ms, true, b.notification.clone())
        }
        Op::Read(r) => {
            let e = r.entry.as_ref()?;
            (
                state.fast_specs(std::slice::from_ref(e), None, false),
                r.timeout_ms,
                false,
                Vec::new(),
            )
        }
        Op::ReadBatch(b) => (
            state.fast_specs(&b.entries, b.ranges.as_ref(), false),
            b.timeout_ms,
            false,
            Vec::new(),
        ),
        _ => return None,
    })
}

impl<E: Events> Session<'_, E> {
    /// Checks an [`eligible`] transfer request and queues it for the poller's pass in progress,
    /// when the session is polled on the poller's thread and the request is the common case.
    pub(super) fn try_fast(&mut self, tag: u64, op: Op) -> Fast {
        let Some(outbox) = &self.outbox else {
            return Fast::Not(Box::new(op));
        };
        if !crate::poller::serving_sessions_here() {
            return Fast::Not(Box::new(op));
        }
        let Some((specs, timeout_ms, write, notification)) = plan(&self.state, &op) else {
            return Fast::Not(Box::new(op));
        };
        let batch = match specs {
            Ok(Some(batch)) => batch,
            Ok(None) => return Fast::Not(Box::new(op)),
            Err(status) => return Fast::Refused(status),
        };
        tracing::trace!(target: "tcpxd::hop", hop = "api.in");
        let link = match &self.fast {
            Some(link) => link.clone(),
            None => {
                let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                    return Fast::Not(Box::new(op));
                };
                let link = Arc::new(FastLink {
                    state: self.state.clone(),
                    outbox: outbox.clone(),
                    delivered: self.delivered.clone(),
                    runtime,
                });
                self.fast = Some(link.clone());
                link
            }
        };
        let deadline = self.state.request_deadline(timeout_ms, self.deadline);
        let slot = Arc::new(Starting::default());
        let ticket = Arc::new(Ticket {
            tag,
            slot: slot.clone(),
            link,
            total: AtomicU64::new(0),
            again: Mutex::new(Some((op, deadline))),
            held: Mutex::new(None),
        });
        let start = FastStart {
            write,
            batch,
            notification,
            deadline,
            sink: Some(ticket.clone() as Arc<dyn StartSink>),
        };
        match crate::poller::queue_fast_start(start) {
            None => {
                self.starting.insert(tag, slot);
                Fast::Queued
            }
            Some(mut start) => {
                // (not the poller's thread after all: the usual way)
                start.sink = None;
                match ticket.take_request() {
                    Some((op, _)) => Fast::Not(Box::new(op)),
                    None => Fast::Refused(Status::internal("a fast start lost its request")),
                }
            }
        }
    }
}

/// One fast start: its tag and slot in the session, and its request until the engine answers.
struct Ticket {
    tag: u64,
    slot: Arc<Starting>,
    link: Arc<FastLink>,
    /// The transfer's bytes, once started (for the event of one the daemon stopped under).
    total: AtomicU64,
    again: Mutex<Option<(Op, Instant)>>,
    /// The engine's answer, held for the sessions thread (`StartSink::hold`).
    held: Mutex<Option<Result<FastStarted, EngineError>>>,
}

impl Ticket {
    fn take_request(&self) -> Option<(Op, Instant)> {
        self.again.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// The engine refused the start only because its pairing closed when idle meanwhile: the
    /// request goes the usual way once the close settled (it pairs anew), as a usual start's.
    fn start_again(&self, e: EngineError) {
        let Some((op, deadline)) = self.take_request() else {
            return;
        };
        let link = &self.link;
        let state = link.state.clone();
        let start: Start = Box::pin(async move {
            let mut retries = 0;
            state.after_idle_close(e, &mut retries, deadline).await?;
            match op {
                Op::Write(r) => state.start_write(transfers::write_batch(r)?, deadline).await,
                Op::WriteBatch(b) => state.start_write(b, deadline).await,
                Op::Read(r) => state.start_read(transfers::read_batch(r)?, deadline).await,
                Op::ReadBatch(b) => state.start_read(b, deadline).await,
                _ => Err(Status::internal("not a transfer request")),
            }
        });
        let run = starting::run(
            self.tag,
            start,
            self.slot.clone(),
            link.state.clone(),
            link.outbox.clone(),
            link.delivered.clone(),
        );
        // (its wakers hold it until it ends)
        let _task = Inline::start_in(link.runtime.clone(), run);
    }
}

impl StartSink for Ticket {
    fn answered(self: Arc<Self>, r: Result<FastStarted, EngineError>) {
        self.apply(r);
    }

    fn hold(&self, r: Result<FastStarted, EngineError>) {
        *self.held.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
    }

    fn answer_held(self: Arc<Self>) {
        self.apply_held();
    }

    fn finished(&self, id: TransferId, s: Option<&TransferStatus>) {
        // The answer first, if the sessions thread has not applied it yet: the client that
        // reads the end finds the transfer known (WaitTransfer, cancel_tag's answer).
        self.apply_held();
        self.push_end(id, s);
    }
}

impl Ticket {
    /// Applies the held answer, if still held. Under the lock: a transfer's end that comes
    /// while the sessions thread applies the answer waits for it (the end's event never
    /// reaches the client, nor its tag a reap, before the id is in the slot).
    fn apply_held(&self) {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = held.take() {
            self.apply(r);
        }
    }

    /// The engine's answer: the transfer known (its id in the session's slot, in the transfers
    /// table), or its refusal pushed as the request's event.
    fn apply(&self, r: Result<FastStarted, EngineError>) {
        let link = &self.link;
        match r {
            Ok(s) => {
                drop(self.take_request());
                self.total.store(s.total, Ordering::Relaxed);
                let id = s.id;
                if let Some(w) = link.state.poller.sessions() {
                    w.count_fast();
                }
                // Known to WaitTransfer, Watch and cancel_tag's answer, as a usual start's.
                drop(link.state.started(id, s.rx, s.total));
                if self.slot.started(id) {
                    tracing::debug!(
                        transfer = id.0,
                        "the session ended while its transfer started: cancelling"
                    );
                    cancel_unheard(&link.state.poller, id);
                }
            }
            Err(e) if e.closed_pairing.is_some() => self.start_again(e),
            Err(e) => {
                drop(self.take_request());
                self.slot.refused();
                deliver_refused(self.tag, status(e), &link.outbox, &link.delivered);
            }
        }
    }

    /// The transfer's final event pushed into the outbox (unless the session stopped).
    fn push_end(&self, id: TransferId, s: Option<&TransferStatus>) {
        tracing::trace!(target: "tcpxd::hop", hop = "api.woken", id = id.0);
        let event = match s {
            Some(s) => transfers::event(id.0, s),
            None => {
                let status = Status::unavailable("the daemon stopped before the transfer finished");
                lost_event(id.0, self.total.load(Ordering::Relaxed), &status)
            }
        };
        let link = &self.link;
        // (nothing once the session ended: as a stopped inline delivery)
        if let Some(wake) = self
            .slot
            .unless_stopped(|| push_finished(self.tag, event, &link.outbox, &link.delivered))
        {
            woken(wake, &link.outbox, &link.delivered);
        }
    }
}
