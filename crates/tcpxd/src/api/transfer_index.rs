//! The transfers `Watch`, `WaitTransfer` and `Cancel` can name by id: each accepted transfer's
//! status channel, kept until `transfer.finished_retention_s` after it finished, and at most
//! `transfer.finished_kept_max` transfers in all (only finished ones are forgotten to stay
//! within it).
//!
//! # Cost
//! The poller's thread inserts every transfer a framed session starts the fast way
//! (`api::session::fast`), so an insert is a map insert and a queue push under a lock no one holds
//! for long. Before, forgetting walked the whole map under that lock every 10 s: at tens of
//! thousands of transfers a second and 300 s of retention, millions of entries (hundreds of MB,
//! each holding its channel) and a walk of tens of milliseconds during which the poller waited.
//!
//! # How it forgets
//! Besides the map, a queue of `(not before, id)` in insertion order: an entry cannot be due
//! before `not before + retention`. [`TransferIndex::prune`] looks at the queue's front only, in
//! slices of [`PRUNE_SLICE`] entries per lock: a due one is forgotten when its transfer finished
//! long enough ago; one still running goes to the back with `not before = now`, one finished
//! recently with `not before = its finish`; it stops at the first front entry that cannot be
//! due yet. Each entry is looked at about once per retention, so a prune costs what it forgets.
//! The keys are near-monotonic (a re-queued key is never earlier than what it passes, by at most
//! an insert racing the prune's clock): an entry may outlive its retention by a tick, never fall
//! short of it. Past `finished_kept_max` entries the oldest finished ones are forgotten first,
//! whatever their age; running transfers are never forgotten (the engine bounds how many run).

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::poller::TransferStatus;
use crate::status_watch;

/// Entries a prune looks at per lock taken: the longest an insert waits for it (~tens of µs).
pub const PRUNE_SLICE: usize = 1024;

/// The accepted transfers by id (the module's doc).
pub struct TransferIndex {
    retention: Duration,
    max_kept: usize,
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    by_id: HashMap<u64, status_watch::Receiver<TransferStatus>>,
    /// `(not before, id)`, near-monotonic in `not before`.
    queue: VecDeque<(Instant, u64)>,
}

/// What one prune did (for tests and logs).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pruned {
    /// Forgotten: finished at least the retention ago.
    pub expired: usize,
    /// Forgotten early: finished, beyond `finished_kept_max`.
    pub over_cap: usize,
}

impl TransferIndex {
    pub fn new(retention: Duration, max_kept: usize) -> TransferIndex {
        TransferIndex {
            retention,
            max_kept,
            inner: Mutex::default(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes a transfer known by its id.
    pub fn insert(&self, id: u64, rx: status_watch::Receiver<TransferStatus>) {
        let now = Instant::now();
        let mut inner = self.lock();
        if inner.by_id.insert(id, rx).is_none() {
            inner.queue.push_back((now, id));
        }
    }

    /// The transfer's status channel, while it is known.
    pub fn get(&self, id: u64) -> Option<status_watch::Receiver<TransferStatus>> {
        self.lock().by_id.get(&id).cloned()
    }

    /// How many transfers are known (running and finished).
    pub fn len(&self) -> usize {
        self.lock().by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets what is due at `now` (the module's "How it forgets"), one slice per lock.
    pub fn prune(&self, now: Instant) -> Pruned {
        let mut done = Pruned::default();
        loop {
            let mut inner = self.lock();
            let (mut steps, mut kept_in_a_row, mut stopped) = (0, 0, false);
            while steps < PRUNE_SLICE {
                let Some(&(not_before, id)) = inner.queue.front() else {
                    stopped = true;
                    break;
                };
                // Over the cap, the front is looked at whatever its age (it is the oldest).
                let over = inner.by_id.len() > self.max_kept;
                if (!over && now.saturating_duration_since(not_before) < self.retention)
                    || (over && kept_in_a_row >= inner.queue.len())
                {
                    // Nothing due yet; or a full turn over the cap found only running ones.
                    stopped = true;
                    break;
                }
                steps += 1;
                inner.queue.pop_front();
                let Some(rx) = inner.by_id.get(&id) else { continue };
                let finished_at = rx.borrow().finished_at;
                let requeue = match finished_at {
                    Some(f) if now.saturating_duration_since(f) >= self.retention => {
                        done.expired += 1;
                        None
                    }
                    Some(_) if over => {
                        done.over_cap += 1;
                        None
                    }
                    Some(f) => Some(f),
                    None => Some(now),
                };
                match requeue {
                    None => {
                        inner.by_id.remove(&id);
                        kept_in_a_row = 0;
                    }
                    Some(t) => {
                        let t = inner.queue.back().map_or(t, |&(b, _)| t.max(b));
                        inner.queue.push_back((t, id));
                        kept_in_a_row += 1;
                    }
                }
            }
            drop(inner);
            if stopped || steps < PRUNE_SLICE {
                return done;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::poller::Phase;

    fn status(finished_at: Option<Instant>) -> TransferStatus {
        TransferStatus {
            phase: if finished_at.is_some() {
                Phase::Finished
            } else {
                Phase::Running
            },
            bytes_done: 0,
            total: 1,
            outcome: None,
            started: Instant::now(),
            finished_at,
        }
    }

    fn channel(
        finished_at: Option<Instant>,
    ) -> (
        status_watch::Sender<TransferStatus>,
        status_watch::Receiver<TransferStatus>,
    ) {
        status_watch::channel(status(finished_at))
    }

    #[test]
    fn a_finished_transfer_is_kept_its_retention_then_forgotten_and_a_running_one_never() {
        let keep = Duration::from_secs(300);
        let index = TransferIndex::new(keep, usize::MAX);
        let t0 = Instant::now();
        let (_done_tx, done) = channel(Some(t0));
        let (running_tx, running) = channel(None);
        index.insert(1, done);
        index.insert(2, running);
        assert_eq!(index.prune(t0 + Duration::from_secs(299)), Pruned::default());
        assert_eq!(index.len(), 2);
        let p = index.prune(t0 + keep + Duration::from_secs(1));
        assert_eq!(
            p,
            Pruned {
                expired: 1,
                over_cap: 0
            }
        );
        assert!(index.get(1).is_none(), "finished 301 s ago: forgotten");
        assert!(index.get(2).is_some(), "still running: kept");
        // It finishes much later: kept its whole retention from then, then forgotten.
        let end = t0 + Duration::from_secs(1000);
        running_tx.send_modify(|s| s.finished_at = Some(end));
        assert_eq!(index.prune(end + Duration::from_secs(10)), Pruned::default());
        assert!(index.get(2).is_some());
        assert_eq!(index.prune(end + keep).expired, 1);
        assert!(index.is_empty());
    }

    #[test]
    fn a_prune_forgets_many_in_slices_and_stops_at_the_first_that_cannot_be_due() {
        let keep = Duration::from_secs(1);
        let index = TransferIndex::new(keep, usize::MAX);
        let t0 = Instant::now();
        let n = PRUNE_SLICE * 3 + 7;
        let mut senders = Vec::new();
        for id in 0..n as u64 {
            let (tx, rx) = channel(Some(t0));
            senders.push(tx);
            index.insert(id, rx);
        }
        let late = Instant::now();
        let (_tx, rx) = channel(None);
        index.insert(u64::MAX, rx);
        let p = index.prune(late + keep + Duration::from_millis(1));
        assert_eq!(p.expired, n);
        assert_eq!(index.len(), 1, "the running one stays");
        // Looked at once, re-queued with `not before = now`: the next prune at once does nothing.
        assert_eq!(
            index.prune(late + keep + Duration::from_millis(2)),
            Pruned::default()
        );
    }

    #[test]
    fn past_the_cap_the_oldest_finished_go_first_and_running_ones_stay() {
        let index = TransferIndex::new(Duration::from_secs(300), 4);
        let t0 = Instant::now();
        let mut keep_alive = Vec::new();
        let (tx, rx) = channel(None);
        keep_alive.push(tx);
        index.insert(100, rx); // running, oldest
        for id in 0..10u64 {
            let (tx, rx) = channel(Some(t0));
            keep_alive.push(tx);
            index.insert(id, rx);
        }
        let p = index.prune(t0 + Duration::from_secs(1));
        assert_eq!(
            p,
            Pruned {
                expired: 0,
                over_cap: 7
            }
        );
        assert_eq!(index.len(), 4, "the cap counts the running one too");
        assert!(index.get(100).is_some(), "running: never forgotten");
        for id in 0..7 {
            assert!(index.get(id).is_none(), "{id}: among the oldest finished");
        }
        for id in 7..10 {
            assert!(index.get(id).is_some(), "{id}: within the cap");
        }
    }

    #[test]
    fn only_running_transfers_past_the_cap_end_the_prune() {
        let index = TransferIndex::new(Duration::from_secs(300), 2);
        let mut keep_alive = Vec::new();
        for id in 0..5u64 {
            let (tx, rx) = channel(None);
            keep_alive.push(tx);
            index.insert(id, rx);
        }
        assert_eq!(index.prune(Instant::now()), Pruned::default());
        assert_eq!(index.len(), 5);
    }
}
