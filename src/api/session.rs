//! The `Session` stream: many transfers on one bidirectional call, each request under a tag the
//! client chose, one event per request back as each transfer finishes (completion order).
//!
//! One task per session reads the requests in order and starts each on the poller; a task per
//! accepted transfer waits for its final status. Half-closing the request side lets the in-flight
//! transfers finish before the stream ends OK; a client that goes away (the request stream fails
//! or the event stream is dropped) gets its in-flight transfers cancelled on both sides.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

use super::proto::v1 as pb;
use super::proto::v1::session_event::Event;
use super::proto::v1::session_request::Op;
use super::service::DaemonState;
use super::transfers::{self, Started, cancel_unheard};
use crate::engine::TransferId;
use crate::poller::Command;

pub type EventStream = Pin<Box<dyn Stream<Item = Result<pb::SessionEvent, Status>> + Send>>;

/// Events queued towards a client that reads slowly; past this the session stops reading
/// requests until the client catches up.
const EVENT_QUEUE: usize = 256;

/// Starts serving one session; `deadline` is the stream's own (its gRPC deadline), if any.
pub fn start(
    state: Arc<DaemonState>,
    deadline: Option<Instant>,
    requests: Streaming<pb::SessionRequest>,
) -> EventStream {
    let (tx, rx) = mpsc::channel(EVENT_QUEUE);
    let session = Session {
        state,
        deadline,
        tx,
        open: HashMap::new(),
        waiting: JoinSet::new(),
    };
    tokio::spawn(session.run(requests));
    Box::pin(ReceiverStream::new(rx))
}

struct Session {
    state: Arc<DaemonState>,
    deadline: Option<Instant>,
    tx: mpsc::Sender<Result<pb::SessionEvent, Status>>,
    /// Unfinished transfers by tag.
    open: HashMap<u64, TransferId>,
    /// One task per open transfer, ending with its tag and final event.
    waiting: JoinSet<(u64, pb::TransferEvent)>,
}

/// Why the session stopped early: the client went away.
struct Gone;

/// What the session does next.
enum Next {
    Gone,
    Finished(u64, pb::TransferEvent),
    Request(pb::SessionRequest),
    HalfClosed,
}

impl Session {
    async fn run(mut self, mut requests: Streaming<pb::SessionRequest>) {
        let mut reading = true;
        let mut stopping = self.state.stopping.clone();
        let ended = loop {
            if !reading && self.waiting.is_empty() {
                break Ok(());
            }
            let next = tokio::select! {
                biased;
                _ = self.tx.closed() => Next::Gone,
                Some(done) = self.waiting.join_next(), if !self.waiting.is_empty() => match done {
                    Ok((tag, event)) => Next::Finished(tag, event),
                    // The waiting tasks never panic; a runtime shutting down aborts them.
                    Err(_) => Next::Gone,
                },
                next = requests.message(), if reading => match next {
                    Ok(Some(req)) => Next::Request(req),
                    Ok(None) => Next::HalfClosed,
                    Err(status) => {
                        tracing::debug!("session: the client went away: {status}");
                        Next::Gone
                    }
                },
                // The daemon drains: no new requests; the open ones end as the drain decides.
                _ = stopping.wait_for(|s| *s), if reading => Next::HalfClosed,
            };
            let step = match next {
                Next::Gone => Err(Gone),
                Next::Finished(tag, event) => self.finished(tag, event).await,
                Next::Request(req) => self.request(req).await,
                Next::HalfClosed => {
                    reading = false;
                    Ok(())
                }
            };
            if let Err(gone) = step {
                break Err(gone);
            }
        };
        if ended.is_err() {
            self.cancel_all();
        }
    }

    fn cancel_all(&mut self) {
        if !self.open.is_empty() {
            tracing::debug!(
                transfers = self.open.len(),
                "session reset: cancelling its transfers"
            );
        }
        for (_, id) in self.open.drain() {
            cancel_unheard(&self.state.poller, id);
        }
        self.waiting.abort_all();
    }

    async fn send(&self, tag: u64, event: Event) -> Result<(), Gone> {
        let ev = pb::SessionEvent {
            tag,
            event: Some(event),
        };
        self.tx.send(Ok(ev)).await.map_err(|_| Gone)
    }

    async fn finished(&mut self, tag: u64, event: pb::TransferEvent) -> Result<(), Gone> {
        tracing::trace!(target: "tcpxd::hop", hop = "api.out", id = event.transfer_id);
        self.open.remove(&tag);
        self.send(tag, Event::Finished(event)).await
    }

    async fn refuse(&self, tag: u64, status: Status) -> Result<(), Gone> {
        let refused = pb::EntryStatus {
            code: status.code() as i32,
            message: status.message().to_string(),
        };
        self.send(tag, Event::Refused(refused)).await
    }

    /// Handles one request: starts its transfer, answers a cancel, or refuses it.
    async fn request(&mut self, req: pb::SessionRequest) -> Result<(), Gone> {
        let tag = req.tag;
        if tag == 0 {
            return self
                .refuse(0, Status::invalid_argument("tag: must be nonzero"))
                .await;
        }
        if self.open.contains_key(&tag) {
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
                "op: set one of write, read, write_batch, read_batch, cancel_tag",
            )),
            Some(Op::CancelTag(target)) => return self.cancel(tag, target).await,
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
        };
        match started {
            Ok(s) => {
                self.open.insert(tag, s.id);
                self.waiting.spawn(async move {
                    let event = match transfers::finished(s.id, s.rx).await {
                        Ok(ev) => ev,
                        Err(status) => pb::TransferEvent {
                            transfer_id: s.id.0,
                            state: pb::TransferState::Finished as i32,
                            total_bytes: s.total,
                            status_code: status.code() as i32,
                            status_message: status.message().to_string(),
                            ..Default::default()
                        },
                    };
                    (tag, event)
                });
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

    async fn cancel(&self, tag: u64, target: u64) -> Result<(), Gone> {
        let Some(&id) = self.open.get(&target) else {
            return self
                .refuse(
                    tag,
                    Status::not_found(format!(
                        "cancel_tag: no unfinished request of this session has tag {target}"
                    )),
                )
                .await;
        };
        match self.state.ask(|reply| Command::Cancel { id, reply }).await {
            Ok(cancelled) => {
                self.send(tag, Event::Cancelled(pb::CancelResponse { cancelled }))
                    .await
            }
            Err(status) => self.refuse(tag, status).await,
        }
    }
}
