//! The `Session` stream: many transfers on one bidirectional call, each request under a tag the
//! client chose, one event per request back as each transfer finishes (completion order).
//!
//! One task per session reads the requests in order and starts each on the poller without
//! waiting for its answer; the gRPC session's task itself then waits for each transfer's final
//! status (`grpc_pending.rs`), the framed session's transfers end inline (`starting.rs`), and
//! on the poller's thread the common ones start on the engine in the same pass, their ends pushed
//! by the poller's `finish` (`fast.rs`). Half-closing the request side lets the in-flight
//! transfers finish before the stream ends OK; a client that goes away (the request stream fails
//! or the event stream is dropped) gets its in-flight transfers cancelled on both sides.
//!
//! A `register_host_fd` request (the framed transport only: its file descriptor comes with the
//! frame) registers client host memory; the buffers a session registered are released when it
//! ends (src/api/host_memory.rs). So do the prepared lists it prepared (`prepare_blocks`), unless
//! released before (src/api/prepared.rs).
//!
//! The same logic serves two transports: the gRPC stream (`start`) and the framed local session
//! on the API unix socket (`super::local`), each supplying its request side ([`Requests`]) and its
//! event side ([`Events`]).
//!
//! This file holds the session's loop and its transfer, cancel, prepared-list and notification
//! requests; `transport.rs` the two sides a transport supplies ([`Requests`], [`Events`]) and the
//! gRPC stream's; `registrations.rs` the registrations (gathered into batches, `register_batch`
//! frames, `release_batch`).

use std::collections::HashMap;
use std::future::{Future, pending};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::broadcast::error::RecvError;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use super::delivery::{
    Delivered, Subscription, addressed, deliver_notifications, next_for, notification_event,
};
use super::finished_tags::{FinishedTags, already_finished};
use super::local::inline::{Inline, off_poller};
use super::local::outbox::{BACKLOG, Outbox};
use super::prepared;
use super::proto::v1 as pb;
use super::proto::v1::session_event::Event;
use super::proto::v1::session_request::Op;
use super::register_batch::MAX_BATCH;
use super::state::DaemonState;
use super::transfers::{self, cancel_unheard};
use crate::engine::{TransferId, TransferKind};
use crate::poller::NotificationEvent;

mod fast;
mod grpc_pending;
mod registrations;
mod starting;
mod transport;

use grpc_pending::{GrpcPending, Progress};
pub use registrations::MAX_REGISTRATION_LISTS;
use registrations::registration;
use starting::{Known, Start, Starting};
pub use transport::{Events, Gone, Incoming, Requests};

pub type EventStream = Pin<Box<dyn Stream<Item = Result<pb::SessionEvent, Status>> + Send>>;

/// Events queued towards a client that reads slowly; past this the session stops reading
/// requests until the client catches up.
const EVENT_QUEUE: usize = 256;

/// Starts serving one gRPC session; `deadline` is the stream's own (its gRPC deadline), if any.
pub fn start(
    state: Arc<DaemonState>,
    deadline: Option<Instant>,
    requests: Streaming<pb::SessionRequest>,
) -> EventStream {
    let (mut tx, rx) = mpsc::channel(EVENT_QUEUE);
    tokio::spawn(async move {
        let mut requests = requests;
        serve(state, deadline, &mut requests, &mut tx).await
    });
    Box::pin(ReceiverStream::new(rx))
}

/// Serves one session to its end: `Ok` once the request side has ended (half-close, or the
/// daemon draining) and every open request has had its event; `Err(Gone)` when the client went
/// away (its open transfers are cancelled on both sides).
pub async fn serve<R: Requests, E: Events>(
    state: Arc<DaemonState>,
    deadline: Option<Instant>,
    requests: &mut R,
    events: &mut E,
) -> Result<(), Gone> {
    let session = Session {
        state,
        deadline,
        outbox: events.outbox(),
        events,
        open: HashMap::new(),
        starting: HashMap::new(),
        finished: FinishedTags::default(),
        pending: GrpcPending::default(),
        inline: HashMap::new(),
        delivered: Arc::new(Delivered::default()),
        reaped: Vec::new(),
        owned: Vec::new(),
        prepared: Vec::new(),
        notifications: None,
        fast: None,
    };
    session.run(requests).await
}

struct Session<'e, E> {
    state: Arc<DaemonState>,
    deadline: Option<Instant>,
    events: &'e mut E,
    /// Unfinished transfers by tag.
    open: HashMap<u64, TransferId>,
    /// With an outbox: unfinished transfers by tag, each started inline (`starting.rs`), its
    /// id once the poller gave it.
    starting: HashMap<u64, Arc<Starting>>,
    /// The last finished ones, for `cancel_tag`'s answer.
    finished: FinishedTags,
    /// Without an outbox: the transfers whose start or end is on its way, polled by this task.
    pending: GrpcPending,
    /// With an outbox: where the open transfers' final events go, from the thread that
    /// finishes each (`inline`), and the tags whose event went (`delivered`).
    outbox: Option<Arc<Outbox>>,
    inline: HashMap<u64, Arc<Inline>>,
    delivered: Arc<Delivered>,
    /// `reap`'s list, swapped with `delivered`'s: the two keep their room (no allocation a
    /// delivery).
    reaped: Vec<u64>,
    /// Buffers this session registered (`register_host_fd`): released when it ends.
    owned: Vec<u64>,
    /// Prepared lists this session prepared (`prepare_blocks`): released when it ends.
    prepared: Vec<u64>,
    /// The node's notifications, once the session subscribed (`subscribe`), and its tag.
    notifications: Option<(u64, Subscription)>,
    /// What its fast starts share (`fast.rs`), from its first.
    fast: Option<Arc<fast::FastLink>>,
}

/// What the session does next.
enum Next {
    Gone,
    /// Nothing but a look at what changed (transfers delivered inline, events written).
    Look,
    Pending(Progress),
    Notified(u64, Result<NotificationEvent, RecvError>),
    Incoming(Incoming),
}

/// The subscribed session's next notification (never, unsubscribed), with its tag.
async fn next_notification(
    sub: &mut Option<(u64, Subscription)>,
) -> (u64, Result<NotificationEvent, RecvError>) {
    match sub {
        Some((tag, Subscription::Task(rx, to))) => (*tag, next_for(rx, to).await),
        _ => pending().await,
    }
}

impl<E: Events> Session<'_, E> {
    async fn run<R: Requests>(mut self, requests: &mut R) -> Result<(), Gone> {
        let mut reading = true;
        let mut stopping = self.state.stopping.clone();
        // A request read while gathering registrations, not one itself: handled next.
        let mut held: Option<Incoming> = None;
        let mut budget = crate::poller::PassBudget::default();
        let ended = loop {
            self.reap();
            if !reading
                && self.pending.is_empty()
                && self.open.is_empty()
                && self.starting.is_empty()
                && held.is_none()
            {
                break Ok(());
            }
            // A client that does not read its events is not read from either (backpressure).
            let room = self.outbox.as_ref().is_none_or(|o| o.backlog() < BACKLOG);
            let draining = !reading && (!self.open.is_empty() || !self.starting.is_empty());
            let next = if let Some(h) = held.take() {
                Next::Incoming(h)
            } else {
                tokio::select! {
                biased;
                attended = self.events.attend(reading) => match attended {
                    Ok(()) => Next::Look,
                    Err(Gone) => Next::Gone,
                },
                _ = self.delivered.rung.notified(), if draining => Next::Look,
                // (before the requests: a start's first poll hands its command to the poller)
                progress = self.pending.next(), if !self.pending.is_empty() => Next::Pending(progress),
                (tag, n) = next_notification(&mut self.notifications) => Next::Notified(tag, n),
                next = requests.next(), if reading && room => Next::Incoming(next),
                // The daemon drains: no new requests; the open ones end as the drain decides.
                _ = stopping.wait_for(|s| *s), if reading => Next::Incoming(Incoming::HalfClosed),
                }
            };
            // What was delivered meanwhile is not open (its tag may come again in this request).
            self.reap();
            // Served on the poller's thread: what could stall it runs on the runtime (as does the
            // rest of a burst over the pass's budget, `crate::poller::PASS_BUDGET`).
            let over = match (requests.watch(), &next) {
                (Some(watch), Next::Incoming(Incoming::Request(_))) => watch.spend(&mut budget),
                _ => false,
            };
            let _off = match &next {
                Next::Incoming(Incoming::Request(req)) if over || stalls_poller(req, requests.last_len()) => {
                    requests.off_poller()
                }
                _ => None,
            };
            if _off.is_some() {
                off_poller().await;
            }
            if let (Some(watch), Next::Incoming(Incoming::Request(_))) = (requests.watch(), &next) {
                watch.counted();
            }
            let step = match next {
                Next::Gone | Next::Incoming(Incoming::Gone) => Err(Gone),
                Next::Look => Ok(()),
                Next::Pending(progress) => self.progress(progress).await,
                Next::Notified(tag, n) => self.notified(tag, n).await,
                Next::Incoming(Incoming::Request(req)) if matches!(req.op, Some(Op::ReleaseBatch(_))) => {
                    self.release_batch(*req).await
                }
                Next::Incoming(Incoming::Request(req)) if matches!(req.op, Some(Op::AttachBoard(_))) => {
                    self.attach_board(*req, requests).await
                }
                Next::Incoming(Incoming::Request(req))
                    if matches!(req.op, Some(Op::AttachRequestRing(_))) =>
                {
                    self.attach_request_ring(*req, requests).await
                }
                Next::Incoming(Incoming::Request(req)) if matches!(req.op, Some(Op::RegisterBatch(_))) => {
                    self.register_frame(*req, requests).await
                }
                Next::Incoming(Incoming::Request(req)) if registration(&req).is_some() => {
                    let mut batch = Vec::new();
                    let first = self.registration(*req, requests);
                    batch.push(first);
                    // The registrations already waiting behind it join its batch.
                    while batch.len() < MAX_BATCH {
                        match ready_now(requests.next()) {
                            None => break,
                            Some(Incoming::Request(r)) if registration(&r).is_some() => {
                                let next = self.registration(*r, requests);
                                batch.push(next);
                            }
                            Some(other) => {
                                held = Some(other);
                                break;
                            }
                        }
                    }
                    self.register(batch).await
                }
                Next::Incoming(Incoming::Request(req)) => self.request(*req).await,
                Next::Incoming(Incoming::HalfClosed) => {
                    reading = false;
                    Ok(())
                }
                Next::Incoming(Incoming::Broken(status)) => {
                    tracing::debug!("session: closing a client that broke the framing: {status}");
                    // Whether or not the refusal reaches the client, the session ends here.
                    let _ = self.refuse(0, status).await;
                    Err(Gone)
                }
            };
            if let Err(gone) = step {
                break Err(gone);
            }
        };
        // The inline deliveries stop first: the cancellations below would end their transfers
        // with events written after the session's last one.
        self.stop_inline();
        if ended.is_err() {
            self.cancel_all();
        }
        let _off = match self.owned.is_empty() && self.prepared.is_empty() {
            true => None,
            false => requests.off_poller(),
        };
        if _off.is_some() {
            off_poller().await;
        }
        self.state.release_owned(std::mem::take(&mut self.owned));
        let state = self.state.clone();
        state
            .release_prepared_owned(std::mem::take(&mut self.prepared))
            .await;
        ended
    }

    fn cancel_all(&mut self) {
        if !self.open.is_empty() {
            tracing::debug!(
                transfers = self.open.len(),
                "session reset: cancelling its transfers"
            );
        }
        for (_, id) in self.open.drain() {
            if self.state.same_node.cancel(id.0).is_none() {
                cancel_unheard(&self.state.poller, id);
            }
        }
        // A start still on its way cancels its transfer itself when the id comes (`abandon`).
        for (_, slot) in self.starting.drain() {
            if let Some(id) = slot.abandon()
                && self.state.same_node.cancel(id.0).is_none()
            {
                cancel_unheard(&self.state.poller, id);
            }
        }
        self.pending.abandon(&self.state);
    }

    /// Stops the inline deliveries still waiting (the session ends: nothing more is written).
    fn stop_inline(&mut self) {
        for (tag, task) in self.inline.drain() {
            // A start still waiting for its id is left to run: dropping it would drop the
            // poller's answer, and with it the id to cancel (`cancel_all` marks it abandoned).
            if self.starting.get(&tag).is_some_and(|s| s.id().is_none()) {
                continue;
            }
            task.stop();
        }
        // The fast starts' ends push nothing more either (`fast.rs`).
        for slot in self.starting.values() {
            slot.stop();
        }
        if let Some((_, Subscription::Inline(task))) = self.notifications.take() {
            task.stop();
        }
    }

    /// Forgets the transfers whose final event was delivered inline.
    fn reap(&mut self) {
        if self.outbox.is_none() {
            return;
        }
        let mut tags = std::mem::take(&mut self.reaped);
        std::mem::swap(
            &mut tags,
            &mut *self.delivered.tags.lock().unwrap_or_else(|e| e.into_inner()),
        );
        for tag in tags.drain(..) {
            if let Some(id) = self.open.remove(&tag) {
                self.finished.record(tag, id);
            }
            // (a refused start has no id: nothing to record)
            if let Some(id) = self.starting.remove(&tag).and_then(|s| s.id()) {
                self.finished.record(tag, id);
            }
            self.inline.remove(&tag);
        }
        self.reaped = tags;
    }

    async fn send(&mut self, tag: u64, event: Event) -> Result<(), Gone> {
        let ev = pb::SessionEvent {
            tag,
            event: Some(event),
        };
        self.events.send(ev).await
    }

    /// A gRPC session's transfer started (its id recorded, its end awaited), was refused, or
    /// ended.
    async fn progress(&mut self, progress: Progress) -> Result<(), Gone> {
        match progress {
            Progress::Started(tag, s) => {
                self.open.insert(tag, s.id);
                self.pending.wait_end(tag, s);
                Ok(())
            }
            Progress::Refused(tag, status) => self.refuse(tag, status).await,
            Progress::Finished(tag, event) => self.finished(tag, event).await,
        }
    }

    async fn finished(&mut self, tag: u64, event: pb::TransferEvent) -> Result<(), Gone> {
        tracing::trace!(target: "tcpxd::hop", hop = "api.out", id = event.transfer_id);
        if let Some(id) = self.open.remove(&tag) {
            self.finished.record(tag, id);
        }
        self.send(tag, Event::Finished(event)).await
    }

    async fn refuse(&mut self, tag: u64, status: Status) -> Result<(), Gone> {
        let refused = pb::EntryStatus {
            code: status.code() as i32,
            message: status.message().to_string(),
        };
        self.send(tag, Event::Refused(refused)).await
    }

    /// Handles one request other than a registration (`register`): starts its transfer,
    /// answers a cancel, or refuses it.
    async fn request(&mut self, req: pb::SessionRequest) -> Result<(), Gone> {
        let tag = req.tag;
        // A doorbell (tag 0) only woke the session: its ring is read by the request side.
        if matches!(req.op, Some(Op::RingDoorbell(_))) {
            return Ok(());
        }
        if tag == 0 {
            return self
                .refuse(0, Status::invalid_argument("tag: must be nonzero"))
                .await;
        }
        if self.tag_open(tag) {
            return self
                .refuse(
                    tag,
                    Status::invalid_argument(format!(
                        "tag: {tag} already names an unfinished request of this session"
                    )),
                )
                .await;
        }
        // The common case, on the poller's thread: to the engine in this pass (`fast.rs`).
        let op = match req.op {
            Some(op) if fast::eligible(&op) => match self.try_fast(tag, op) {
                fast::Fast::Queued => return Ok(()),
                fast::Fast::Refused(status) => return self.refuse(tag, status).await,
                fast::Fast::Not(op) => Some(*op),
            },
            op => op,
        };
        let start = match op {
            None => Err(Status::invalid_argument(
                "op: set one of write, read, write_batch, read_batch, write_blocks, read_blocks, cancel_tag, register_host_fd, prepare_blocks, release_prepared, write_prepared, read_prepared, register_client_memory, subscribe, register_batch, release_batch",
            )),
            Some(Op::CancelTag(target)) => return self.cancel(tag, target).await,
            Some(Op::RingDoorbell(_)) => return Ok(()),
            Some(Op::Subscribe(r)) => return self.subscribe(tag, &r).await,
            Some(Op::RegisterHostFd(_))
            | Some(Op::RegisterClientMemory(_))
            | Some(Op::RegisterBatch(_))
            | Some(Op::ReleaseBatch(_))
            | Some(Op::AttachBoard(_))
            | Some(Op::AttachRequestRing(_)) => Err(Status::internal(
                "a registration reached the transfer path (registrations go in batches)",
            )),
            Some(Op::PrepareBlocks(r)) => return self.prepare(tag, r).await,
            Some(Op::ReleasePrepared(id)) => return self.release_prepared(tag, id).await,
            Some(op) => self.transfer_start(op),
        };
        let start = match start {
            Ok(s) => s,
            Err(status) => return self.refuse(tag, status).await,
        };
        if let Some(outbox) = self.outbox.clone() {
            // Its checks run now, in the first poll; the rest where the poller answers.
            let slot = Arc::new(Starting::default());
            let run = starting::run(
                tag,
                start,
                slot.clone(),
                self.state.clone(),
                outbox,
                self.delivered.clone(),
            );
            let task = Inline::start_in(tokio::runtime::Handle::current(), run);
            if !task.finished() {
                self.inline.insert(tag, task);
            }
            self.starting.insert(tag, slot);
            return Ok(());
        }
        // Its command goes to the poller at its first poll, the session's next look at what
        // is pending, before it reads another request.
        self.pending.start(tag, start);
        Ok(())
    }

    /// A transfer request's start: its synchronous checks now (a refusal), the rest as a future
    /// that owns what it needs.
    fn transfer_start(&self, op: Op) -> Result<Start, Status> {
        let state = self.state.clone();
        let session = self.deadline;
        let start: Start = match op {
            Op::Write(r) => {
                let b = transfers::write_batch(r)?;
                let deadline = state.request_deadline(b.timeout_ms, session);
                Box::pin(async move { state.start_write(b, deadline).await })
            }
            Op::WriteBatch(b) => {
                let deadline = state.request_deadline(b.timeout_ms, session);
                Box::pin(async move { state.start_write(b, deadline).await })
            }
            Op::Read(r) => {
                let b = transfers::read_batch(r)?;
                let deadline = state.request_deadline(b.timeout_ms, session);
                Box::pin(async move { state.start_read(b, deadline).await })
            }
            Op::ReadBatch(b) => {
                let deadline = state.request_deadline(b.timeout_ms, session);
                Box::pin(async move { state.start_read(b, deadline).await })
            }
            Op::WritePrepared(r) => {
                let deadline = state.request_deadline(r.timeout_ms, session);
                let t = prepared::write_transfer(r, &state.buffers);
                Box::pin(async move { state.start_prepared(TransferKind::Write, t, deadline).await })
            }
            Op::ReadPrepared(r) => {
                let deadline = state.request_deadline(r.timeout_ms, session);
                let t = prepared::read_transfer(r, &state.buffers);
                Box::pin(async move { state.start_prepared(TransferKind::Read, t, deadline).await })
            }
            Op::WriteBlocks(r) => {
                let deadline = state.request_deadline(r.timeout_ms, session);
                Box::pin(async move { state.start_write_blocks(r, deadline).await })
            }
            Op::ReadBlocks(r) => {
                let deadline = state.request_deadline(r.timeout_ms, session);
                Box::pin(async move { state.start_read_blocks(r, deadline).await })
            }
            _ => return Err(Status::internal("not a transfer request")),
        };
        Ok(start)
    }

    /// Whether `tag` names an unfinished request of this session.
    fn tag_open(&self, tag: u64) -> bool {
        self.open.contains_key(&tag)
            || self.starting.contains_key(&tag)
            || self.pending.is_starting(tag)
            || self.notifications.as_ref().is_some_and(|s| s.0 == tag)
    }

    /// Prepares a list that goes with this session.
    async fn prepare(&mut self, tag: u64, r: pb::PrepareBlocksRequest) -> Result<(), Gone> {
        let deadline = self.state.request_deadline(0, self.deadline);
        match self.state.prepare_blocks(r, deadline).await {
            Ok(p) => {
                self.prepared.push(p.prepared_id);
                self.send(tag, Event::Prepared(p)).await
            }
            Err(status) => self.refuse(tag, status).await,
        }
    }

    async fn release_prepared(&mut self, tag: u64, id: u64) -> Result<(), Gone> {
        match self.state.release_prepared(id).await {
            Ok(()) => {
                self.prepared.retain(|&p| p != id);
                self.send(tag, Event::Released(pb::ReleasePreparedResponse {}))
                    .await
            }
            Err(status) => self.refuse(tag, status).await,
        }
    }

    /// Attaches the client's completion board (src/api/local/board.rs), whose memfd came with
    /// the frame: answered `board_attached`, or refused (nothing changes; the session goes on
    /// with its events alone).
    async fn attach_board<R: Requests>(
        &mut self,
        req: pb::SessionRequest,
        requests: &mut R,
    ) -> Result<(), Gone> {
        let tag = req.tag;
        let Some(Op::AttachBoard(r)) = req.op else {
            return Ok(());
        };
        if tag == 0 {
            let _ = requests.attached();
            return self
                .refuse(0, Status::invalid_argument("tag: must be nonzero"))
                .await;
        }
        // The descriptor is taken first, whatever the answer: one that stayed would be given to
        // the session's next frame.
        let fd = requests
            .attached()
            .map_err(|s| Status::invalid_argument(s.message().replace("register_host_fd", "attach_board")));
        let attached = match (&self.outbox, fd) {
            (None, _) => Err(Status::failed_precondition(
                "attach_board: only on the framed local session (the gRPC stream cannot carry its memfd)",
            )),
            (Some(_), _) if !self.state.shared_completions => Err(Status::failed_precondition(
                "attach_board: this daemon has runtime.shared_completions off; the session's events carry every end",
            )),
            (Some(_), Err(status)) => Err(status),
            (Some(outbox), Ok(a)) => super::local::board::Board::attach(&a.fd, r.slots, r.notification_slots)
                .and_then(|b| {
                    let slots = (b.slots(), b.notification_slots());
                    outbox.attach_board(b).map(|()| slots).map_err(|_| {
                        Status::invalid_argument("attach_board: this session has a board already")
                    })
                }),
        };
        match attached {
            Ok((slots, notification_slots)) => {
                tracing::debug!(
                    slots,
                    notification_slots,
                    "local session: completion board attached"
                );
                let attached = pb::BoardAttached {
                    slots,
                    notification_slots,
                };
                self.send(tag, Event::BoardAttached(attached)).await
            }
            Err(status) => {
                tracing::debug!("local session: no completion board: {}", status.message());
                self.refuse(tag, status).await
            }
        }
    }

    /// Attaches the client's request ring (src/api/local/ring.rs), whose memfd came with the
    /// frame: answered `request_ring_attached`, or refused (nothing changes; the client's
    /// requests go on the socket).
    async fn attach_request_ring<R: Requests>(
        &mut self,
        req: pb::SessionRequest,
        requests: &mut R,
    ) -> Result<(), Gone> {
        let tag = req.tag;
        let Some(Op::AttachRequestRing(r)) = req.op else {
            return Ok(());
        };
        // The descriptor is taken first, whatever the answer (as attach_board's).
        let fd = requests.attached().map_err(|s| {
            Status::invalid_argument(s.message().replace("register_host_fd", "attach_request_ring"))
        });
        if tag == 0 {
            return self
                .refuse(0, Status::invalid_argument("tag: must be nonzero"))
                .await;
        }
        let attached = match fd {
            _ if !self.state.request_ring => Err(Status::failed_precondition(
                "attach_request_ring: this daemon has runtime.request_ring off; send requests on the socket",
            )),
            Err(status) => Err(status),
            Ok(a) => super::local::ring::Ring::attach(&a.fd, r.slots, r.slot_bytes).and_then(|ring| {
                let sizes = (ring.slots(), ring.slot_bytes());
                requests.attach_ring(ring).map(|()| sizes)
            }),
        };
        match attached {
            Ok((slots, slot_bytes)) => {
                tracing::debug!(slots, slot_bytes, "local session: request ring attached");
                let attached = pb::RequestRingAttached { slots, slot_bytes };
                self.send(tag, Event::RequestRingAttached(attached)).await
            }
            Err(status) => {
                tracing::debug!("local session: no request ring: {}", status.message());
                self.refuse(tag, status).await
            }
        }
    }

    /// Subscribes the session to the node's notifications (one subscription a session).
    /// With `addressed_to`, only the notifications addressed to that name (`delivery::is_for`).
    async fn subscribe(&mut self, tag: u64, req: &pb::SubscribeRequest) -> Result<(), Gone> {
        if let Some((under, _)) = &self.notifications {
            let status = Status::invalid_argument(format!(
                "subscribe: this session is subscribed already (tag {under}); one subscription a session"
            ));
            return self.refuse(tag, status).await;
        }
        let rx = self.state.notifications.subscribe();
        let to = addressed(req);
        // Answered first: the notifications follow it on the connection.
        self.send(tag, Event::Subscribed(pb::SessionSubscribed {}))
            .await?;
        let sub = match &self.outbox {
            Some(outbox) => {
                Subscription::Inline(Inline::start(deliver_notifications(tag, rx, to, outbox.clone())))
            }
            None => Subscription::Task(rx, to),
        };
        self.notifications = Some((tag, sub));
        Ok(())
    }

    /// Hands a notification to the subscribed client; one it fell behind on is reported as lost.
    async fn notified(&mut self, tag: u64, n: Result<NotificationEvent, RecvError>) -> Result<(), Gone> {
        match notification_event(n) {
            Some(event) => self.send(tag, event).await,
            None => {
                self.notifications = None;
                Ok(())
            }
        }
    }

    async fn cancel(&mut self, tag: u64, target: u64) -> Result<(), Gone> {
        if self.notifications.as_ref().is_some_and(|s| s.0 == target) {
            if let Some((_, Subscription::Inline(task))) = self.notifications.take() {
                task.stop();
            }
            self.finished.record_unsubscribed(target, tag);
            return self
                .send(tag, Event::Cancelled(pb::CancelResponse { cancelled: true }))
                .await;
        }
        // A transfer that finished (its event delivered or about to be) is refused alike
        // whether or not the session has seen its end yet, and so is a subscription that ended:
        // FAILED_PRECONDITION, nothing changed.
        let id = match self.starting.get(&target).cloned() {
            // (its start on its way: the id comes at the end of the poller's pass)
            Some(slot) => match slot.wait().await {
                Known::Id(id) => Some(id),
                Known::Refused => None,
            },
            None => {
                // A gRPC start on its way: this task polls it, so it waits by doing its work
                // (the other transfers' progress included) until the start has its answer.
                while self.pending.is_starting(target) {
                    let progress = self.pending.next().await;
                    self.progress(progress).await?;
                }
                self.open.get(&target).copied()
            }
        };
        let Some(id) = id else {
            let status = self.finished.refusal(&self.state, target).unwrap_or_else(|| {
                Status::not_found(format!(
                    "cancel_tag: no unfinished request of this session has tag {target}"
                ))
            });
            return self.refuse(tag, status).await;
        };
        match self.state.cancel_transfer(id).await {
            Ok(true) => {
                self.send(tag, Event::Cancelled(pb::CancelResponse { cancelled: true }))
                    .await
            }
            Ok(false) => {
                let status = already_finished(&self.state, target, id);
                self.refuse(tag, status).await
            }
            Err(status) => self.refuse(tag, status).await,
        }
    }
}

/// Requests larger than this are handled off the poller's thread when the session is served
/// there (`crate::poller::SessionWatch`): decoding and checking one costs roughly a µs per KiB,
/// and the poller's pass gives its commands `crate::poller::COMMAND_SLICE` (50 µs) at a time.
pub const OFF_POLLER_BYTES: u64 = 16 << 10;

/// Whether handling `req` (of `len` bytes) could stall the poller's thread: registrations and
/// releases (system calls, the state directory's journal), prepared lists, large requests.
fn stalls_poller(req: &pb::SessionRequest, len: u64) -> bool {
    len > OFF_POLLER_BYTES
        || matches!(
            req.op,
            Some(
                Op::RegisterHostFd(_)
                    | Op::RegisterClientMemory(_)
                    | Op::RegisterBatch(_)
                    | Op::ReleaseBatch(_)
                    | Op::AttachBoard(_)
                    | Op::AttachRequestRing(_)
                    | Op::PrepareBlocks(_)
                    | Op::ReleasePrepared(_)
            )
        )
}

/// What `fut` gives without waiting, if anything (polled once). For the request side's `next`,
/// which keeps what it read of a frame across polls, so dropping it unfinished loses nothing
/// (as `select!` does with it).
fn ready_now<F: Future>(fut: F) -> Option<F::Output> {
    let mut fut = std::pin::pin!(fut);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match fut.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(v) => Some(v),
        std::task::Poll::Pending => None,
    }
}
