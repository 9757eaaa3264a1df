//! A transfer's status cell: the subset of `tokio::sync::watch` that the transfer status uses,
//! with a publish that costs a lock and two atomics when nobody waits.
//!
//! `tokio::sync::watch::Sender::send_modify` wakes through eight internal notifiers, locking
//! each one, on every publish, waiter or not (0.6–0.9 µs a send on the poller, docs/BENCHMARKS.md
//! "Session 33, pollcpu"). Nearly every transfer's status is published two to four times and read
//! by nobody but the final event, so here a publish wakes only when a receiver is parked in
//! [`Receiver::changed`] (a count of parked receivers, checked after the version is bumped; a
//! receiver counts itself before it reads the version, both sequentially consistent, so one of
//! the two always sees the other).
//!
//! Semantics kept from `watch`: a receiver sees every value's latest state (not every value),
//! `changed` returns once the version moved past the one it last saw, and returns an error once
//! the sender is gone with nothing newer; `wait_for` checks the current value first.

use std::ops::Deref;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, RwLock, RwLockReadGuard};

use tokio::sync::Notify;

/// The sender dropped (the daemon stopping) before a newer value came.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the status's sender is gone")]
pub struct RecvError;

/// Bit 0: the sender is gone; the rest: the version, bumped by 2 a publish.
const CLOSED: u64 = 1;

struct Shared<T> {
    value: RwLock<T>,
    version: AtomicU64,
    /// Receivers parked in `changed` (counted before they read the version).
    parked: AtomicUsize,
    notify: Notify,
}

impl<T> Shared<T> {
    fn read(&self) -> RwLockReadGuard<'_, T> {
        // A panic while publishing leaves a value that is still whole (each publish is a
        // closure on plain fields); keep serving it.
        self.value.read().unwrap_or_else(|p| p.into_inner())
    }

    fn wake(&self) {
        if self.parked.load(SeqCst) > 0 {
            self.notify.notify_waiters();
        }
    }
}

/// The one writer (the poller's table entry, or a same-node copy's).
pub struct Sender<T> {
    shared: Arc<Shared<T>>,
}

/// A reader; clones share nothing but the cell (each has its own last-seen version).
pub struct Receiver<T> {
    shared: Arc<Shared<T>>,
    seen: u64,
}

/// A read lock on the current value.
pub struct Ref<'a, T>(RwLockReadGuard<'a, T>);

impl<T> Deref for Ref<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// A cell holding `init` (version 0) with its sender and a first receiver.
pub fn channel<T>(init: T) -> (Sender<T>, Receiver<T>) {
    let shared = Arc::new(Shared {
        value: RwLock::new(init),
        version: AtomicU64::new(0),
        parked: AtomicUsize::new(0),
        notify: Notify::new(),
    });
    (
        Sender {
            shared: shared.clone(),
        },
        Receiver { shared, seen: 0 },
    )
}

impl<T> Sender<T> {
    /// Changes the value in place and tells the receivers.
    pub fn send_modify(&self, modify: impl FnOnce(&mut T)) {
        self.send_if_modified(|v| {
            modify(v);
            true
        });
    }

    /// Changes the value in place; the receivers are told only when `modify` returns true.
    pub fn send_if_modified(&self, modify: impl FnOnce(&mut T) -> bool) -> bool {
        {
            let mut v = self.shared.value.write().unwrap_or_else(|p| p.into_inner());
            if !modify(&mut v) {
                return false;
            }
            self.shared.version.fetch_add(2, SeqCst);
        }
        self.shared.wake();
        true
    }

    /// The current value.
    pub fn borrow(&self) -> Ref<'_, T> {
        Ref(self.shared.read())
    }

    /// A new receiver that has seen the current value.
    pub fn subscribe(&self) -> Receiver<T> {
        let seen = self.shared.version.load(SeqCst) & !CLOSED;
        Receiver {
            shared: self.shared.clone(),
            seen,
        }
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        self.shared.version.fetch_or(CLOSED, SeqCst);
        self.shared.wake();
    }
}

impl<T> Clone for Receiver<T> {
    fn clone(&self) -> Self {
        Receiver {
            shared: self.shared.clone(),
            seen: self.seen,
        }
    }
}

impl<T> Receiver<T> {
    /// The current value (not marked seen).
    pub fn borrow(&self) -> Ref<'_, T> {
        Ref(self.shared.read())
    }

    /// The current value, marked seen.
    pub fn borrow_and_update(&mut self) -> Ref<'_, T> {
        // The version first: a publish between the two reads is then seen again, not lost.
        self.seen = self.shared.version.load(SeqCst) & !CLOSED;
        Ref(self.shared.read())
    }

    /// Whether a value newer than the last seen one was published.
    pub fn has_changed(&self) -> Result<bool, RecvError> {
        let v = self.shared.version.load(SeqCst);
        if v & !CLOSED != self.seen {
            return Ok(true);
        }
        if v & CLOSED != 0 {
            return Err(RecvError);
        }
        Ok(false)
    }

    /// Waits for a value newer than the last seen one (marking it seen); an error once the
    /// sender is gone with nothing newer.
    pub async fn changed(&mut self) -> Result<(), RecvError> {
        if let Some(r) = self.settled() {
            return r;
        }
        let shared = self.shared.clone();
        shared.parked.fetch_add(1, SeqCst);
        let _unpark = Unpark(&shared.parked);
        loop {
            // Made before the version is read: `notify_waiters` wakes every `Notified` made
            // before it, polled or not.
            let notified = shared.notify.notified();
            if let Some(r) = self.settled() {
                return r;
            }
            notified.await;
        }
    }

    /// Waits until the value satisfies `f` (the current one checked first) and returns it
    /// (read again after the check: meant for a final state, such as `Phase::Finished`).
    pub async fn wait_for(&mut self, mut f: impl FnMut(&T) -> bool) -> Result<Ref<'_, T>, RecvError> {
        loop {
            let ok = f(&self.borrow_and_update());
            if ok {
                return Ok(self.borrow());
            }
            self.changed().await?;
            // `changed` marked the version seen; the loop's borrow_and_update reads it.
        }
    }

    fn settled(&mut self) -> Option<Result<(), RecvError>> {
        let v = self.shared.version.load(SeqCst);
        if v & !CLOSED != self.seen {
            self.seen = v & !CLOSED;
            return Some(Ok(()));
        }
        (v & CLOSED != 0).then_some(Err(RecvError))
    }
}

struct Unpark<'a>(&'a AtomicUsize);

impl Drop for Unpark<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn changed_sees_each_publish_and_then_the_close() {
        let (tx, mut rx) = channel(0u32);
        assert_eq!(rx.has_changed(), Ok(false));
        tx.send_modify(|v| *v = 1);
        assert_eq!(rx.has_changed(), Ok(true));
        rx.changed().await.unwrap();
        assert_eq!(*rx.borrow(), 1);
        assert_eq!(rx.has_changed(), Ok(false));
        assert!(!tx.send_if_modified(|v| {
            *v = 5;
            false
        }));
        assert_eq!(rx.has_changed(), Ok(false));
        drop(tx);
        assert_eq!(rx.changed().await, Err(RecvError));
        // The value stays readable after the sender is gone (late watchers).
        assert_eq!(*rx.borrow(), 5);
    }

    #[tokio::test]
    async fn a_publish_after_the_close_is_not_lost_before_it() {
        let (tx, mut rx) = channel(0u32);
        tx.send_modify(|v| *v = 2);
        drop(tx);
        // Something newer than seen: Ok first, then the close.
        rx.changed().await.unwrap();
        assert_eq!(*rx.borrow_and_update(), 2);
        assert_eq!(rx.changed().await, Err(RecvError));
    }

    #[tokio::test]
    async fn wait_for_checks_the_current_value_first_even_when_closed() {
        let (tx, mut rx) = channel(7u32);
        drop(tx);
        assert_eq!(*rx.wait_for(|v| *v == 7).await.unwrap(), 7);
        assert_eq!(rx.wait_for(|v| *v == 8).await.err(), Some(RecvError));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn parked_receivers_are_woken_and_unparked() {
        for _ in 0..200 {
            let (tx, rx) = channel(0u32);
            let waiters: Vec<_> = (0..4)
                .map(|_| {
                    let mut rx = rx.clone();
                    tokio::spawn(async move { *rx.wait_for(|v| *v == 3).await.unwrap() })
                })
                .collect();
            let tx = std::thread::spawn(move || {
                for i in 1..=3 {
                    tx.send_modify(|v| *v = i);
                }
                tx
            })
            .join()
            .unwrap();
            for w in waiters {
                assert_eq!(
                    tokio::time::timeout(Duration::from_secs(10), w)
                        .await
                        .unwrap()
                        .unwrap(),
                    3
                );
            }
            assert_eq!(tx.shared.parked.load(SeqCst), 0);
        }
    }

    #[tokio::test]
    async fn a_dropped_wait_unparks() {
        let (tx, mut rx) = channel(0u32);
        let r = tokio::time::timeout(Duration::from_millis(5), rx.changed()).await;
        assert!(r.is_err());
        assert_eq!(tx.shared.parked.load(SeqCst), 0);
        tx.send_modify(|v| *v = 1);
        rx.changed().await.unwrap();
        let late = tx.subscribe();
        assert_eq!(late.has_changed(), Ok(false));
    }
}
