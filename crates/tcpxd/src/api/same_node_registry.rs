//! The book of same-node transfers ([`SameNode`]): the copies in flight (their ids, stop
//! flags and buffers) and the prepared lists over other clients' lists of this node. The
//! services' shared state holds it; `same_node.rs` runs the copies it books. A drain
//! ([`SameNode::drain`]) refuses new copies, waits for those running until the grace period's
//! end and stops the rest, as the engine's drain does with the poller's transfers.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tonic::Status;

/// Ids of same-node transfers start here: far above the engine's, which count from 1.
pub const FIRST_ID: u64 = 1 << 62;

/// Why a copy must stop, in its [`StopFlag`] (read between chunks).
pub const RUNNING: u8 = 0;
/// Its client cancelled it.
pub const CANCELLED: u8 = 1;
/// The daemon's drain ended its grace period.
pub const SHUT_DOWN: u8 = 2;

/// A copy's stop flag: [`RUNNING`], [`CANCELLED`] or [`SHUT_DOWN`].
pub type StopFlag = Arc<AtomicU8>;

/// What a drain did with the copies running when it began.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopiesDrained {
    /// Ended (however) within the grace period.
    pub finished_in_grace: usize,
    /// Stopped when the grace period ended.
    pub failed_at_deadline: usize,
}

/// How long a drain waits, after stopping the copies left at its deadline, for them to notice
/// (each checks between chunks of `same_node::CHUNK_BYTES`, about a millisecond of copying).
const STOP_WAIT: Duration = Duration::from_secs(2);

/// The same-node transfers in flight (their cancel flags), and the prepared lists over other
/// clients' lists of this node (a prepared transfer naming one as its remote list is copied).
#[derive(Default)]
pub struct SameNode {
    next: AtomicU64,
    /// The copies in flight, and whether a drain began (no copy starts after).
    open: Mutex<Book>,
    /// Told whenever a copy ends (ReleaseBuffer waits for those using its buffer).
    ended: tokio::sync::Notify,
    prepared: Mutex<std::collections::HashSet<u64>>,
    /// How many threads copy one transfer at most (`transfer.host_copy_threads`; 0 as 1).
    threads: usize,
}

#[derive(Default)]
struct Book {
    copies: HashMap<u64, Open>,
    draining: bool,
}

/// A copy in flight: its stop flag and the buffers it uses.
struct Open {
    stop: StopFlag,
    buffers: Vec<u64>,
}

impl SameNode {
    /// A book whose copies each run on up to `threads` threads (`transfer.host_copy_threads`).
    pub fn with_threads(threads: usize) -> Self {
        Self {
            threads,
            ..Self::default()
        }
    }

    /// How many threads copy one transfer at most (at least 1).
    pub(super) fn threads(&self) -> usize {
        self.threads.max(1)
    }

    /// Whether prepared list `id` names other clients' lists of this node.
    pub fn is_prepared(&self, id: u64) -> bool {
        let set = self.prepared.lock().unwrap_or_else(|e| e.into_inner());
        !set.is_empty() && set.contains(&id)
    }

    pub(crate) fn prepared(&self, id: u64) {
        self.prepared.lock().unwrap_or_else(|e| e.into_inner()).insert(id);
    }

    pub(crate) fn released(&self, id: u64) {
        self.prepared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
    }

    /// Books a copy of `buffers`: its id and stop flag; UNAVAILABLE once a drain began.
    pub(super) fn open(&self, buffers: Vec<u64>) -> Result<(u64, StopFlag), Status> {
        let mut book = self.lock();
        if book.draining {
            return Err(Status::unavailable(
                "the daemon is shutting down; no new transfers",
            ));
        }
        let id = FIRST_ID + self.next.fetch_add(1, Ordering::Relaxed);
        let stop = Arc::new(AtomicU8::new(RUNNING));
        book.copies.insert(
            id,
            Open {
                stop: stop.clone(),
                buffers,
            },
        );
        Ok((id, stop))
    }

    pub(super) fn close(&self, id: u64) {
        self.lock().copies.remove(&id);
        self.ended.notify_waiters();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Book> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn in_use(&self, buffer: u64) -> bool {
        self.lock().copies.values().any(|o| o.buffers.contains(&buffer))
    }

    /// Same-node copies in flight (GetStats `active_transfers` counts them with the poller's).
    pub fn active(&self) -> usize {
        self.lock().copies.len()
    }

    /// The daemon's drain: from now on no copy starts; those running get until `deadline`, then
    /// are stopped (UNAVAILABLE, "grace period over"); returns once none is left (or, should a
    /// stopped copy not notice within `STOP_WAIT`, then), with what it did.
    pub async fn drain(&self, deadline: Instant) -> CopiesDrained {
        let running = {
            let mut book = self.lock();
            book.draining = true;
            book.copies.len()
        };
        let mut stopped = 0;
        loop {
            let ended = self.ended.notified();
            if self.active() == 0 {
                break;
            }
            if Instant::now() >= deadline {
                stopped = self
                    .lock()
                    .copies
                    .values()
                    .filter(|o| {
                        o.stop
                            .compare_exchange(RUNNING, SHUT_DOWN, Ordering::Relaxed, Ordering::Relaxed)
                            .is_ok()
                    })
                    .count();
                let until = tokio::time::Instant::now() + STOP_WAIT;
                while self.active() > 0 {
                    let ended = self.ended.notified();
                    if self.active() == 0 || tokio::time::timeout_at(until, ended).await.is_err() {
                        break;
                    }
                }
                if self.active() > 0 {
                    tracing::warn!(
                        copies = self.active(),
                        "same-node copies still running {STOP_WAIT:?} after the grace period's end: not waited for"
                    );
                }
                break;
            }
            let _ = tokio::time::timeout_at(deadline.into(), ended).await;
        }
        CopiesDrained {
            finished_in_grace: running.saturating_sub(stopped),
            failed_at_deadline: stopped,
        }
    }

    /// Waits until no same-node copy uses `buffer`, or `deadline` (None: as long as it takes)
    /// passes: then FAILED_PRECONDITION, as the engine answers for its transfers.
    pub async fn idle(&self, buffer: u64, deadline: Option<Instant>) -> Result<(), Status> {
        loop {
            let ended = self.ended.notified();
            if !self.in_use(buffer) {
                return Ok(());
            }
            match deadline {
                None => ended.await,
                Some(d) => {
                    if tokio::time::timeout_at(d.into(), ended).await.is_err() && self.in_use(buffer) {
                        return Err(Status::failed_precondition(format!(
                            "buffer_id: buffer {buffer} is still in use by a transfer within this node"
                        )));
                    }
                }
            }
        }
    }

    /// Cancels a same-node transfer: `None` when `id` is not one (the poller's), `Some(false)`
    /// when it already ended.
    pub fn cancel(&self, id: u64) -> Option<bool> {
        if id < FIRST_ID {
            return None;
        }
        Some(self.lock().copies.get(&id).is_some_and(|o| {
            let _ = o
                .stop
                .compare_exchange(RUNNING, CANCELLED, Ordering::Relaxed, Ordering::Relaxed);
            true
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A copy as `same_node::run` is one: checks its stop flag every millisecond, ends on its
    /// own after `takes` (or never, for `None`).
    fn copy(book: &Arc<SameNode>, takes: Option<Duration>) -> tokio::task::JoinHandle<u8> {
        let (id, stop) = book.open(vec![1, 2]).expect("not draining yet");
        let book = book.clone();
        tokio::spawn(async move {
            let start = Instant::now();
            let why = loop {
                let s = stop.load(Ordering::Relaxed);
                if s != RUNNING {
                    break s;
                }
                if takes.is_some_and(|t| start.elapsed() >= t) {
                    break RUNNING;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            };
            book.close(id);
            why
        })
    }

    #[tokio::test]
    async fn a_drain_waits_for_running_copies_and_refuses_new_ones() {
        let book = Arc::new(SameNode::default());
        let quick = copy(&book, Some(Duration::from_millis(20)));
        assert_eq!(book.active(), 1);
        let drained = book.drain(Instant::now() + Duration::from_secs(60)).await;
        assert_eq!(
            drained,
            CopiesDrained {
                finished_in_grace: 1,
                failed_at_deadline: 0
            }
        );
        assert_eq!(quick.await.unwrap(), RUNNING, "it ended by itself");
        assert_eq!(book.active(), 0);
        let e = book.open(vec![1]).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable);
        assert!(e.message().contains("shutting down"), "{}", e.message());
    }

    #[tokio::test]
    async fn a_drain_stops_the_copies_left_when_its_grace_period_ends() {
        let book = Arc::new(SameNode::default());
        let endless = copy(&book, None);
        let cancelled = copy(&book, None);
        assert_eq!(book.cancel(FIRST_ID + 1), Some(true));
        assert_eq!(book.active(), 2);
        let drained = book.drain(Instant::now() + Duration::from_millis(50)).await;
        assert_eq!(
            drained,
            CopiesDrained {
                finished_in_grace: 1,
                failed_at_deadline: 1
            }
        );
        assert_eq!(endless.await.unwrap(), SHUT_DOWN);
        assert_eq!(cancelled.await.unwrap(), CANCELLED, "a cancel is not overwritten");
        assert_eq!(book.active(), 0);
    }
}
