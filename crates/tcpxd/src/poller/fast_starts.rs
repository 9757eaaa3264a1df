//! Transfers a framed session served on the poller's thread starts without the command channel
//! (session 29, leanstart): the session checks a plain WRITE or READ batch whose peers are paired
//! and up (`crate::api::session`, `fast.rs`) and queues its engine entries here, on the poller's
//! own thread ([`queue`]); the poller takes the queue right after the pass's session wakes (and
//! after its commands and its answers: a session may be polled there too) and starts each on the
//! engine at once ([`Poller::take_fast_starts`]). No boxed start future, no `Command` on the
//! channel, no oneshot for the answer: the session's [`StartSink`] is told the id (or the
//! engine's refusal) in the same pass, and the transfer's final status when the poller finishes
//! it (`actions.rs`, `finish`), which pushes the final event into the session's outbox from the
//! poller's completion path: no future waits on the transfer's `watch` (the channel stays: it
//! is what `WaitTransfer`, `Watch` and `cancel_tag`'s answer for a finished tag read, and with
//! no waiter its send wakes nothing).
//!
//! With `runtime.session_thread` (session 30) the session runs on the sessions thread: its start
//! goes into the hub the poller takes at its next pass (`session_thread.rs`), and the answer is
//! held in the sink for that thread ([`StartSink::hold`]) while the transfer's end still comes
//! from the poller's `finish` (which applies a held answer first).
//!
//! A start queued when the poller no longer takes the queue (it stopped) is answered as the
//! command channel's would be: UNAVAILABLE, "the daemon is shutting down" ([`FastStart`]'s drop).

use std::cell::RefCell;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use super::{Batch, Poller, TransferStatus};
use crate::engine::{Code, EngineError, TransferId};
use crate::metrics::Op;
use crate::status_watch;

/// A fast start as the engine accepted it.
pub struct FastStarted {
    pub id: TransferId,
    pub rx: status_watch::Receiver<TransferStatus>,
    pub total: u64,
}

/// Where a fast start's answer and its transfer's end go (the session's side).
pub trait StartSink: Send + Sync {
    /// The engine's answer, in the pass that took the start (on the poller's thread).
    fn answered(self: Arc<Self>, r: Result<FastStarted, EngineError>);
    /// Keeps the engine's answer for [`StartSink::answer_held`] on the sessions thread
    /// (`session_thread.rs`); the sink applies it then, or before it pushes the transfer's end
    /// if that comes first (so the end never overtakes the answer).
    fn hold(&self, r: Result<FastStarted, EngineError>);
    /// Applies the answer [`StartSink::hold`] kept, unless the transfer's end applied it.
    fn answer_held(self: Arc<Self>);
    /// The transfer ended (`None`: the poller stopped without finishing it).
    fn finished(&self, id: TransferId, status: Option<&TransferStatus>);
}

/// A checked WRITE or READ batch for the engine.
pub struct FastStart {
    pub write: bool,
    pub batch: Batch,
    pub notification: Vec<u8>,
    pub deadline: Instant,
    /// `None` once handed to the engine.
    pub sink: Option<Arc<dyn StartSink>>,
}

impl Drop for FastStart {
    fn drop(&mut self) {
        if let Some(sink) = self.sink.take() {
            sink.answered(Err(EngineError::new(
                Code::Unavailable,
                "the daemon is shutting down",
            )));
        }
    }
}

thread_local! {
    static QUEUED: RefCell<VecDeque<FastStart>> = const { RefCell::new(VecDeque::new()) };
}

/// Queues `start` for the poller's pass in progress (on the poller's thread), or for its next
/// pass (on the sessions thread, `session_thread.rs`: the poller woken if it waits); handed
/// back on any other thread (the caller starts it the usual way).
pub fn queue(start: FastStart) -> Option<FastStart> {
    if !super::on_poller_thread() {
        return super::session_thread::queue_here(start);
    }
    QUEUED.with(|q| q.borrow_mut().push_back(start));
    None
}

/// The sinks of the transfers started fast, by id: told the end when the poller finishes each.
#[derive(Default)]
pub(super) struct Sinks(crate::engine::idhash::IdMap<TransferId, Arc<dyn StartSink>>);

impl Sinks {
    pub(super) fn take(&mut self, id: TransferId) -> Option<Arc<dyn StartSink>> {
        if self.0.is_empty() {
            return None;
        }
        self.0.remove(&id)
    }
}

impl Drop for Sinks {
    fn drop(&mut self) {
        for (id, sink) in self.0.drain() {
            sink.finished(id, None);
        }
    }
}

impl Poller {
    /// Starts the transfers framed sessions queued on this thread; `true` when there were any.
    /// `from_hub`: the sessions thread's too (`session_thread.rs`): taken once a pass, at its
    /// start, so that a pass's starts are started together and their first control messages
    /// leave in one `send` (taken at each of the pass's three looks, they were spread over more
    /// passes' sends: two H200s, 16 in flight, `send_direct` +1–1.5 µs a transfer, and 2.2 µs of
    /// starts in the pass's last phase; session 30).
    pub(super) fn take_fast_starts(&mut self, from_hub: bool) -> bool {
        let mut any = false;
        if let Some(hub) = self.park.hub()
            && from_hub
            && hub.has_starts()
        {
            // From the sessions thread: its answers go back there.
            let mut taken = std::mem::take(&mut self.hub_starts);
            hub.take_starts(&mut taken);
            for start in taken.drain(..) {
                any = true;
                self.fast_start(start);
            }
            self.hub_starts = taken;
            // (rung by the pass's end: `Poller::ring_sessions`)
            if let Some(hub) = self.park.hub() {
                self.hub_unrung |= hub.hand_answers(&mut self.hub_answers);
            }
        }
        // (popped one at a time: a sink told its answer may poll its session, which may queue more)
        while let Some(start) = QUEUED.with(|q| q.borrow_mut().pop_front()) {
            any = true;
            self.fast_start(start);
        }
        any
    }

    fn fast_start(&mut self, mut start: FastStart) {
        let Some(sink) = start.sink.take() else {
            return;
        };
        let batch = std::mem::replace(&mut start.batch, Batch::Entries(Vec::new()));
        let notification = std::mem::take(&mut start.notification);
        let op = if start.write { Op::Write } else { Op::Read };
        let r = self.start_batch(op, batch, notification, start.deadline, "fast");
        let r = r.map(|(id, rx, total)| {
            self.sinks.0.insert(id, sink.clone());
            FastStarted { id, rx, total }
        });
        match self.park.hub() {
            // The ticket's answer (the transfers table, the session's slot) on the sessions thread.
            Some(_) => {
                sink.hold(r);
                self.hub_answers.push(sink);
            }
            None => sink.answered(r),
        }
    }
}
