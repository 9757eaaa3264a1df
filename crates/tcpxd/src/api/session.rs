//! The `Session` stream: many transfers on one bidirectional call, each request under a tag the
//! client chose, one event per request back as each transfer finishes (completion order).
//!
//! One task per session reads the requests in order and starts each on the poller; a task per
//! accepted transfer waits for its final status. Half-closing the request side lets the in-flight
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

use std::collections::HashMap;
use std::future::{Future, pending};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::broadcast::error::RecvError;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use super::delivery::{Delivered, Subscription, deliver_finished, deliver_notifications, notification_event};
use super::finished_tags::{FinishedTags, already_finished};
use super::host_memory::{self, Attached};
use super::local::inline::Inline;
use super::local::outbox::{BACKLOG, Outbox};
use super::prepared;
use super::proto::v1 as pb;
use super::proto::v1::session_event::Event;
use super::proto::v1::session_request::Op;
use super::register_batch::{MAX_BATCH, Registered, Registration};
use super::state::DaemonState;
use super::transfers::{self, Started, cancel_unheard};
use crate::engine::{TransferId, TransferKind};
use crate::poller::NotificationEvent;

pub type EventStream = Pin<Box<dyn Stream<Item = Result<pb::SessionEvent, Status>> + Send>>;

/// Events queued towards a client that reads slowly; past this the session stops reading
/// requests until the client catches up.
const EVENT_QUEUE: usize = 256;

/// Block lists one registration may ask for (`RegisterHostFdRequest.block_lists`).
pub const MAX_REGISTRATION_LISTS: usize = 8;

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

/// What a session's request side yields next.
pub enum Incoming {
    /// Boxed: a request is far larger than the other variants.
    Request(Box<pb::SessionRequest>),
    /// The client half-closed: no more requests; the open ones finish, then the session ends.
    HalfClosed,
    /// The client went away: the open transfers are cancelled.
    Gone,
    /// The client broke the transport's rules (a frame over the limit, one that does not
    /// decode): answered with one refusal under tag 0, then the session ends as for `Gone`.
    Broken(Status),
}

/// A session's request side.
pub trait Requests: Send {
    /// The next request, or why there is none.
    fn next(&mut self) -> impl Future<Output = Incoming> + Send;

    /// The file descriptor that came with the request `next` returned last (`register_host_fd`);
    /// a transport that cannot carry descriptors says so.
    fn attached(&mut self) -> Result<Attached, Status> {
        Err(host_memory::no_descriptors())
    }

    /// The `n` file descriptors that came with the request `next` returned last
    /// (`register_batch`), in order; a transport that cannot carry descriptors says so.
    fn attached_n(&mut self, _n: usize) -> Result<Vec<Attached>, Status> {
        Err(host_memory::no_descriptors())
    }

    /// The client's process, from the connection's peer credentials (`register_client_memory`);
    /// a transport without them says so.
    fn peer_pid(&self) -> Result<i32, Status> {
        Err(host_memory::no_peer_process())
    }
}

/// A session's event side.
pub trait Events: Send {
    /// Hands one event to the client; `Err` when the client is gone.
    fn send(&mut self, event: pb::SessionEvent) -> impl Future<Output = Result<(), Gone>> + Send;

    /// Resolves when the client is known to be gone though nothing is being sent. `reading`:
    /// whether the request side is still open (a transport that learns of the client's going
    /// from its request side only needs to watch once that side has ended).
    fn gone(&mut self, reading: bool) -> impl Future<Output = ()> + Send;

    /// Where other threads may push this session's events straight to the client (the framed
    /// session: src/api/local/outbox.rs): the session's transfers then end and its
    /// notifications arrive without its task (src/api/local/inline.rs). `None`: every event
    /// goes through `send`.
    fn outbox(&self) -> Option<Arc<Outbox>> {
        None
    }

    /// What the session's task waits on besides its own work: `Ok` once it has written events
    /// that others pushed and the socket did not take at once (the session looks again at its
    /// backlog), `Err` when the client is gone. Without an outbox: `gone`.
    fn attend(&mut self, reading: bool) -> impl Future<Output = Result<(), Gone>> + Send {
        async move {
            self.gone(reading).await;
            Err(Gone)
        }
    }
}

/// The session ended early: the client went away.
#[derive(Debug)]
pub struct Gone;

impl Requests for Streaming<pb::SessionRequest> {
    async fn next(&mut self) -> Incoming {
        match self.message().await {
            Ok(Some(req)) => Incoming::Request(Box::new(req)),
            Ok(None) => Incoming::HalfClosed,
            Err(status) => {
                tracing::debug!("session: the client went away: {status}");
                Incoming::Gone
            }
        }
    }
}

impl Events for mpsc::Sender<Result<pb::SessionEvent, Status>> {
    async fn send(&mut self, event: pb::SessionEvent) -> Result<(), Gone> {
        mpsc::Sender::send(self, Ok(event)).await.map_err(|_| Gone)
    }

    async fn gone(&mut self, _reading: bool) {
        self.closed().await
    }
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
        finished: FinishedTags::default(),
        waiting: JoinSet::new(),
        inline: HashMap::new(),
        delivered: Arc::new(Delivered::default()),
        owned: Vec::new(),
        prepared: Vec::new(),
        notifications: None,
    };
    session.run(requests).await
}

struct Session<'e, E> {
    state: Arc<DaemonState>,
    deadline: Option<Instant>,
    events: &'e mut E,
    /// Unfinished transfers by tag.
    open: HashMap<u64, TransferId>,
    /// The last finished ones, for `cancel_tag`'s answer.
    finished: FinishedTags,
    /// One task per open transfer, ending with its tag and final event (without an outbox).
    waiting: JoinSet<(u64, pb::TransferEvent)>,
    /// With an outbox: where the open transfers' final events go, from the thread that
    /// finishes each (`inline`), and the tags whose event went (`delivered`).
    outbox: Option<Arc<Outbox>>,
    inline: HashMap<u64, Arc<Inline>>,
    delivered: Arc<Delivered>,
    /// Buffers this session registered (`register_host_fd`): released when it ends.
    owned: Vec<u64>,
    /// Prepared lists this session prepared (`prepare_blocks`): released when it ends.
    prepared: Vec<u64>,
    /// The node's notifications, once the session subscribed (`subscribe`), and its tag.
    notifications: Option<(u64, Subscription)>,
}

/// What the session does next.
enum Next {
    Gone,
    /// Nothing but a look at what changed (transfers delivered inline, events written).
    Look,
    Finished(u64, pb::TransferEvent),
    Notified(u64, Result<NotificationEvent, RecvError>),
    Incoming(Incoming),
}

/// The subscribed session's next notification (never, unsubscribed), with its tag.
async fn next_notification(
    sub: &mut Option<(u64, Subscription)>,
) -> (u64, Result<NotificationEvent, RecvError>) {
    match sub {
        Some((tag, Subscription::Task(rx))) => (*tag, rx.recv().await),
        _ => pending().await,
    }
}

impl<E: Events> Session<'_, E> {
    async fn run<R: Requests>(mut self, requests: &mut R) -> Result<(), Gone> {
        let mut reading = true;
        let mut stopping = self.state.stopping.clone();
        // A request read while gathering registrations, not one itself: handled next.
        let mut held: Option<Incoming> = None;
        let ended = loop {
            self.reap();
            if !reading && self.waiting.is_empty() && self.open.is_empty() && held.is_none() {
                break Ok(());
            }
            // A client that does not read its events is not read from either (backpressure).
            let room = self.outbox.as_ref().is_none_or(|o| o.backlog() < BACKLOG);
            let draining = !reading && !self.open.is_empty();
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
                Some(done) = self.waiting.join_next(), if !self.waiting.is_empty() => match done {
                    Ok((tag, event)) => Next::Finished(tag, event),
                    // The waiting tasks never panic; a runtime shutting down aborts them.
                    Err(_) => Next::Gone,
                },
                (tag, n) = next_notification(&mut self.notifications) => Next::Notified(tag, n),
                next = requests.next(), if reading && room => Next::Incoming(next),
                // The daemon drains: no new requests; the open ones end as the drain decides.
                _ = stopping.wait_for(|s| *s), if reading => Next::Incoming(Incoming::HalfClosed),
                }
            };
            // What was delivered meanwhile is not open (its tag may come again in this request).
            self.reap();
            let step = match next {
                Next::Gone | Next::Incoming(Incoming::Gone) => Err(Gone),
                Next::Look => Ok(()),
                Next::Finished(tag, event) => self.finished(tag, event).await,
                Next::Notified(tag, n) => self.notified(tag, n).await,
                Next::Incoming(Incoming::Request(req)) if matches!(req.op, Some(Op::ReleaseBatch(_))) => {
                    self.release_batch(*req).await
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
        self.waiting.abort_all();
    }

    /// Stops the inline deliveries still waiting (the session ends: nothing more is written).
    fn stop_inline(&mut self) {
        for (_, task) in self.inline.drain() {
            task.stop();
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
        let tags = std::mem::take(&mut *self.delivered.tags.lock().unwrap_or_else(|e| e.into_inner()));
        for tag in tags {
            if let Some(id) = self.open.remove(&tag) {
                self.finished.record(tag, id);
            }
            self.inline.remove(&tag);
        }
    }

    async fn send(&mut self, tag: u64, event: Event) -> Result<(), Gone> {
        let ev = pb::SessionEvent {
            tag,
            event: Some(event),
        };
        self.events.send(ev).await
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
        if tag == 0 {
            return self
                .refuse(0, Status::invalid_argument("tag: must be nonzero"))
                .await;
        }
        if self.open.contains_key(&tag) || self.notifications.as_ref().is_some_and(|s| s.0 == tag) {
            return self
                .refuse(
                    tag,
                    Status::invalid_argument(format!(
                        "tag: {tag} already names an unfinished request of this session"
                    )),
                )
                .await;
        }
        let started = match req.op {
            None => Err(Status::invalid_argument(
                "op: set one of write, read, write_batch, read_batch, write_blocks, read_blocks, cancel_tag, register_host_fd, prepare_blocks, release_prepared, write_prepared, read_prepared, register_client_memory, subscribe, register_batch, release_batch",
            )),
            Some(Op::CancelTag(target)) => return self.cancel(tag, target).await,
            Some(Op::Subscribe(_)) => return self.subscribe(tag).await,
            Some(Op::RegisterHostFd(_))
            | Some(Op::RegisterClientMemory(_))
            | Some(Op::RegisterBatch(_))
            | Some(Op::ReleaseBatch(_)) => Err(Status::internal(
                "a registration reached the transfer path (registrations go in batches)",
            )),
            Some(Op::Write(r)) => match transfers::write_batch(r) {
                Ok(b) => self.start_write(b).await,
                Err(e) => Err(e),
            },
            Some(Op::WriteBatch(b)) => self.start_write(b).await,
            Some(Op::Read(r)) => match transfers::read_batch(r) {
                Ok(b) => self.start_read(b).await,
                Err(e) => Err(e),
            },
            Some(Op::ReadBatch(b)) => self.start_read(b).await,
            Some(Op::PrepareBlocks(r)) => return self.prepare(tag, r).await,
            Some(Op::ReleasePrepared(id)) => return self.release_prepared(tag, id).await,
            Some(Op::WritePrepared(r)) => {
                let deadline = self.state.request_deadline(r.timeout_ms, self.deadline);
                let t = prepared::write_transfer(r, &self.state.buffers);
                self.state.start_prepared(TransferKind::Write, t, deadline).await
            }
            Some(Op::ReadPrepared(r)) => {
                let deadline = self.state.request_deadline(r.timeout_ms, self.deadline);
                let t = prepared::read_transfer(r, &self.state.buffers);
                self.state.start_prepared(TransferKind::Read, t, deadline).await
            }
            Some(Op::WriteBlocks(r)) => {
                let deadline = self.state.request_deadline(r.timeout_ms, self.deadline);
                self.state.start_write_blocks(r, deadline).await
            }
            Some(Op::ReadBlocks(r)) => {
                let deadline = self.state.request_deadline(r.timeout_ms, self.deadline);
                self.state.start_read_blocks(r, deadline).await
            }
        };
        match started {
            Ok(s) if self.outbox.is_some() => {
                self.open.insert(tag, s.id);
                let outbox = self.outbox.clone().expect("checked");
                let task = Inline::start(deliver_finished(tag, s, outbox, self.delivered.clone()));
                if !task.finished() {
                    self.inline.insert(tag, task);
                }
                Ok(())
            }
            Ok(s) => {
                self.open.insert(tag, s.id);
                self.waiting
                    .spawn(async move { (tag, super::delivery::final_event(s).await) });
                Ok(())
            }
            Err(status) => self.refuse(tag, status).await,
        }
    }

    async fn start_write(&self, r: pb::WriteBatchRequest) -> Result<Started, Status> {
        let deadline = self.state.request_deadline(r.timeout_ms, self.deadline);
        self.state.start_write(r, deadline).await
    }

    async fn start_read(&self, r: pb::ReadBatchRequest) -> Result<Started, Status> {
        let deadline = self.state.request_deadline(r.timeout_ms, self.deadline);
        self.state.start_read(r, deadline).await
    }

    /// A registration as read (its descriptor or peer process taken now, with its frame), or
    /// the refusal of its tag or lists.
    fn registration<R: Requests>(&self, req: pb::SessionRequest, requests: &mut R) -> Gathered {
        let tag = req.tag;
        let (reg, lists) = match req.op {
            Some(Op::RegisterHostFd(mut r)) => {
                let lists = std::mem::take(&mut r.block_lists);
                (Registration::HostFd(r, requests.attached()), lists)
            }
            Some(Op::RegisterClientMemory(mut r)) => {
                let lists = std::mem::take(&mut r.block_lists);
                (Registration::ClientMemory(r, requests.peer_pid()), lists)
            }
            _ => return (tag, Err(Status::internal("not a registration"))),
        };
        let refused = if tag == 0 {
            Some(Status::invalid_argument("tag: must be nonzero"))
        } else if self.open.contains_key(&tag) || self.notifications.as_ref().is_some_and(|s| s.0 == tag) {
            Some(Status::invalid_argument(format!(
                "tag: {tag} already names an unfinished request of this session"
            )))
        } else {
            check_lists(&lists).err()
        };
        match refused {
            Some(status) => (tag, Err(status)),
            None => (tag, Ok((reg, lists))),
        }
    }

    /// Carries out registrations read together (src/api/register_batch.rs) and answers each, in
    /// the order they came, with the block lists it asked for registered on its new buffer (each
    /// refused one named in `block_list_status`); the buffers go with this session.
    async fn register(&mut self, batch: Vec<Gathered>) -> Result<(), Gone> {
        let mut tags = Vec::with_capacity(batch.len());
        let mut todo = Vec::new();
        for (tag, r) in batch {
            match r {
                Ok(reg) => {
                    tags.push((tag, None));
                    todo.push(reg);
                }
                Err(status) => tags.push((tag, Some(status))),
            }
        }
        let mut done = self.state.register_batch(todo).await.into_iter();
        for (tag, refused) in tags {
            let answer = match refused {
                Some(status) => Err(status),
                None => done
                    .next()
                    .unwrap_or_else(|| Err(Status::internal("a registration of the batch went unanswered"))),
            };
            match answer {
                Ok(r) => {
                    self.owned.push(r.entry.id);
                    self.send(tag, Event::Registered(self.state.buffer_answer(r)))
                        .await?;
                }
                Err(status) => self.refuse(tag, status).await?,
            }
        }
        Ok(())
    }

    /// Carries out a `register_batch` frame: its entries as one batch, answered by one
    /// `registered_batch` event (an entry refused alone has an empty buffer and its status); the
    /// whole frame refused, with nothing registered, when it has too many entries or the
    /// descriptors that came with it are not one per `host_fd` entry.
    async fn register_frame<R: Requests>(
        &mut self,
        req: pb::SessionRequest,
        requests: &mut R,
    ) -> Result<(), Gone> {
        let tag = req.tag;
        let Some(Op::RegisterBatch(batch)) = req.op else {
            return self.refuse(tag, Status::internal("not a register_batch")).await;
        };
        let host_fds = batch
            .entries
            .iter()
            .filter(|e| matches!(e.memory, Some(pb::register_batch_entry::Memory::HostFd(_))))
            .count();
        // The descriptors are taken first: refused, they are closed.
        let attached = requests.attached_n(host_fds);
        let refused = if tag == 0 {
            Some(Status::invalid_argument("tag: must be nonzero"))
        } else if self.open.contains_key(&tag) || self.notifications.as_ref().is_some_and(|s| s.0 == tag) {
            Some(Status::invalid_argument(format!(
                "tag: {tag} already names an unfinished request of this session"
            )))
        } else if batch.entries.len() > MAX_BATCH {
            Some(Status::invalid_argument(format!(
                "register_batch.entries: {} entries is over the limit of {MAX_BATCH} a batch",
                batch.entries.len()
            )))
        } else {
            None
        };
        let mut attached = match (refused, attached) {
            (Some(status), _) | (None, Err(status)) => return self.refuse(tag, status).await,
            (None, Ok(a)) => a.into_iter(),
        };
        let packed = batch.packed_answer;
        let mut answers: Vec<Option<Result<Registered, Status>>> = Vec::with_capacity(batch.entries.len());
        let mut todo = Vec::new();
        for (i, entry) in batch.entries.into_iter().enumerate() {
            use pb::register_batch_entry::Memory;
            let (reg, lists) = match entry.memory {
                Some(Memory::HostFd(mut r)) => {
                    let lists = std::mem::take(&mut r.block_lists);
                    let fd = attached
                        .next()
                        .ok_or_else(|| Status::internal("a host_fd entry without its descriptor"));
                    (Registration::HostFd(r, fd), lists)
                }
                Some(Memory::ClientMemory(mut r)) => {
                    let lists = std::mem::take(&mut r.block_lists);
                    (Registration::ClientMemory(r, requests.peer_pid()), lists)
                }
                None => {
                    let e = format!("register_batch.entries[{i}]: set one of host_fd, client_memory");
                    answers.push(Some(Err(Status::invalid_argument(e))));
                    continue;
                }
            };
            match check_lists(&lists) {
                Ok(()) => {
                    answers.push(None);
                    todo.push((reg, lists));
                }
                Err(e) => answers.push(Some(Err(Status::invalid_argument(format!(
                    "register_batch.entries[{i}].{}",
                    e.message()
                ))))),
            }
        }
        let mut done = self.state.register_batch(todo).await.into_iter();
        let answers: Vec<Result<Registered, Status>> = answers
            .into_iter()
            .map(|a| {
                a.unwrap_or_else(|| {
                    done.next().unwrap_or_else(|| {
                        Err(Status::internal("a registration of the batch went unanswered"))
                    })
                })
            })
            .collect();
        self.owned
            .extend(answers.iter().filter_map(|a| a.as_ref().ok().map(|r| r.entry.id)));
        if packed {
            // (reg-async) Arrays, no message an entry (api/register_batch.rs).
            let out = pb::RegisteredBatch {
                packed: Some(self.state.packed_answer(answers)),
                ..Default::default()
            };
            return self.send(tag, Event::RegisteredBatch(out)).await;
        }
        let mut out = pb::RegisteredBatch::default();
        for answer in answers {
            match answer {
                Ok(r) => {
                    out.buffers.push(self.state.buffer_answer(r));
                    out.statuses.push(pb::EntryStatus::default());
                }
                Err(status) => {
                    out.buffers.push(pb::Buffer::default());
                    out.statuses.push(pb::EntryStatus {
                        code: status.code() as i32,
                        message: status.message().to_string(),
                    });
                }
            }
        }
        self.send(tag, Event::RegisteredBatch(out)).await
    }

    /// Releases buffers this session registered (`release_batch`), none waiting for transfers:
    /// one still in use is answered FAILED_PRECONDITION and stays (ReleaseBuffer waits).
    async fn release_batch(&mut self, req: pb::SessionRequest) -> Result<(), Gone> {
        let tag = req.tag;
        let Some(Op::ReleaseBatch(batch)) = req.op else {
            return self.refuse(tag, Status::internal("not a release_batch")).await;
        };
        if batch.buffer_ids.len() > MAX_BATCH {
            let status = Status::invalid_argument(format!(
                "release_batch.buffer_ids: {} ids is over the limit of {MAX_BATCH} a batch",
                batch.buffer_ids.len()
            ));
            return self.refuse(tag, status).await;
        }
        // The buffers of this session, released together (api/register_batch.rs).
        // (an id twice: the second is not this session's any more, as one by one)
        let mut mine = std::collections::HashSet::new();
        let asked: Vec<u64> = batch
            .buffer_ids
            .iter()
            .copied()
            .filter(|id| self.owned.contains(id) && mine.insert(*id))
            .collect();
        let (released, unmapped_after) = self.state.release_batch(&asked).await;
        let mut released = released.into_iter();
        let mut out = pb::ReleasedBatch::default();
        let mut gone = std::collections::HashSet::new();
        for (i, id) in batch.buffer_ids.into_iter().enumerate() {
            let r = if mine.remove(&id) {
                released
                    .next()
                    .unwrap_or_else(|| Err(Status::internal("a release of the batch went unanswered")))
            } else {
                Err(Status::not_found(format!(
                    "release_batch.buffer_ids[{i}]: buffer {id} was not registered on this session (or is released)"
                )))
            };
            let st = match r {
                Ok(()) => {
                    gone.insert(id);
                    pb::EntryStatus::default()
                }
                Err(e) => pb::EntryStatus {
                    code: e.code() as i32,
                    message: e.message().to_string(),
                },
            };
            out.statuses.push(st);
        }
        self.owned.retain(|b| !gone.contains(b));
        let sent = self.send(tag, Event::ReleasedBatch(out)).await;
        // The memory goes now, answered first: the client need not wait for the unmapping of
        // (for memfds) every page of the batch; the session reads its next request after.
        drop(unmapped_after);
        sent
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

    /// Subscribes the session to the node's notifications (one subscription a session).
    async fn subscribe(&mut self, tag: u64) -> Result<(), Gone> {
        if let Some((under, _)) = &self.notifications {
            let status = Status::invalid_argument(format!(
                "subscribe: this session is subscribed already (tag {under}); one subscription a session"
            ));
            return self.refuse(tag, status).await;
        }
        let rx = self.state.notifications.subscribe();
        // Answered first: the notifications follow it on the connection.
        self.send(tag, Event::Subscribed(pb::SessionSubscribed {}))
            .await?;
        let sub = match &self.outbox {
            Some(outbox) => {
                Subscription::Inline(Inline::start(deliver_notifications(tag, rx, outbox.clone())))
            }
            None => Subscription::Task(rx),
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
            return self
                .send(tag, Event::Cancelled(pb::CancelResponse { cancelled: true }))
                .await;
        }
        // A transfer that finished (its event delivered or about to be) is refused alike
        // whether or not the session has seen its end yet: FAILED_PRECONDITION, nothing changed.
        let Some(&id) = self.open.get(&target) else {
            let status = match self.finished.get(target) {
                Some(id) => already_finished(&self.state, target, id),
                None => Status::not_found(format!(
                    "cancel_tag: no unfinished request of this session has tag {target}"
                )),
            };
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

/// A registration read from the session: its tag, and the registration with its lists or why
/// it is refused.
type Gathered = (u64, Result<(Registration, Vec<pb::StridedBlocks>), Status>);

/// Whether a request registers memory (those are gathered into batches).
fn registration(req: &pb::SessionRequest) -> Option<()> {
    matches!(
        req.op,
        Some(Op::RegisterHostFd(_)) | Some(Op::RegisterClientMemory(_))
    )
    .then_some(())
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

/// Refuses a registration asking for more block lists than one may (it changes nothing).
fn check_lists(lists: &[pb::StridedBlocks]) -> Result<(), Status> {
    if lists.len() > MAX_REGISTRATION_LISTS {
        return Err(Status::invalid_argument(format!(
            "block_lists: {} lists is over the limit of {MAX_REGISTRATION_LISTS} a registration",
            lists.len()
        )));
    }
    Ok(())
}
