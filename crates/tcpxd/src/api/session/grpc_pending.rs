//! A gRPC session's transfers between their request and their final event, polled by the
//! session's own task: no task spawned per transfer, and no wait for the poller's answer before
//! the next request is read.
//!
//! The gRPC stream has no outbox (its events go through the session's task to tonic), so its
//! transfers cannot end inline as the framed session's do (`starting.rs`). Before, the session's
//! task awaited each start (the poller's answer, one pass away) before reading the next request,
//! then spawned a task per transfer for its final event: the starts of a deep queue went to the
//! poller one per pass, and each end woke a spawned task, which woke the session. Here a start
//! is a future in `starts` (its checks already done, its command sent to the poller at its first
//! poll, before the session reads on), and a started transfer's wait for its end a future in
//! `ends`; both sets are polled by the session's task, so the wake-ups of many transfers that
//! end together are one wake-up of that task.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tonic::Status;

use super::super::delivery::final_event;
use super::super::proto::v1 as pb;
use super::super::state::DaemonState;
use super::super::transfers::{Started, cancel_unheard};
use super::starting::Start;

type Starting = Pin<Box<dyn Future<Output = (u64, Result<Started, Status>)> + Send>>;
type Ending = Pin<Box<dyn Future<Output = (u64, pb::TransferEvent)> + Send>>;

/// What one of the session's transfers did next.
pub(super) enum Progress {
    /// The poller accepted it (the session records its id, then hands it back to [`GrpcPending::wait_end`]).
    Started(u64, Started),
    /// Its start was refused: the refusal is its event.
    Refused(u64, Status),
    /// It ended: its final event.
    Finished(u64, pb::TransferEvent),
}

/// The session's transfers whose start or end is on its way.
#[derive(Default)]
pub(super) struct GrpcPending {
    starts: FuturesUnordered<Starting>,
    /// The tags in `starts`.
    starting: HashSet<u64>,
    ends: FuturesUnordered<Ending>,
}

impl GrpcPending {
    /// Whether no transfer is starting or waiting for its end.
    pub(super) fn is_empty(&self) -> bool {
        self.starts.is_empty() && self.ends.is_empty()
    }

    /// Whether `tag`'s start is on its way (its id not known yet).
    pub(super) fn is_starting(&self, tag: u64) -> bool {
        self.starting.contains(&tag)
    }

    /// Adds a transfer's start; its first poll (the session's next look at [`Self::next`],
    /// before it reads another request) hands its command to the poller.
    pub(super) fn start(&mut self, tag: u64, start: Start) {
        self.starting.insert(tag);
        self.starts.push(Box::pin(async move { (tag, start.await) }));
    }

    /// Waits for a started transfer's end (its final event comes from [`Self::next`]).
    pub(super) fn wait_end(&mut self, tag: u64, s: Started) {
        self.ends
            .push(Box::pin(async move { (tag, final_event(s).await) }));
    }

    /// The next thing a transfer did; never resolves while none is pending. Starts are looked
    /// at first: an id known early is one `cancel_tag` can use.
    pub(super) async fn next(&mut self) -> Progress {
        std::future::poll_fn(|cx| {
            if !self.starts.is_empty()
                && let Poll::Ready(Some((tag, started))) = self.starts.poll_next_unpin(cx)
            {
                self.starting.remove(&tag);
                return Poll::Ready(match started {
                    Ok(s) => Progress::Started(tag, s),
                    Err(status) => Progress::Refused(tag, status),
                });
            }
            if !self.ends.is_empty()
                && let Poll::Ready(Some((tag, event))) = self.ends.poll_next_unpin(cx)
            {
                return Poll::Ready(Progress::Finished(tag, event));
            }
            Poll::Pending
        })
        .await
    }

    /// The session ends with its client gone: the waits for ends are dropped (the session
    /// cancels those transfers by id), and the starts still on their way are left to finish on
    /// a task of their own, which cancels each transfer as its id comes (dropping a start would
    /// drop the poller's answer, and with it the id to cancel).
    pub(super) fn abandon(&mut self, state: &Arc<DaemonState>) {
        self.ends = FuturesUnordered::new();
        self.starting.clear();
        let mut starts = std::mem::take(&mut self.starts);
        if starts.is_empty() {
            return;
        }
        let state = state.clone();
        tokio::spawn(async move {
            while let Some((_, started)) = starts.next().await {
                if let Ok(s) = started {
                    tracing::debug!(
                        transfer = s.id.0,
                        "the session ended while its transfer started: cancelling"
                    );
                    if state.same_node.cancel(s.id.0).is_none() {
                        cancel_unheard(&state.poller, s.id);
                    }
                }
            }
        });
    }
}
