//! The framed sessions' request rings the poller looks at (`crate::api::local::ring`): every
//! pass it wakes the reader of each ring that holds an entry its session waits for, and before
//! it waits (a nap or a park) it says so in every ring (`spinning = 0`) and looks once more, so
//! no entry sits unseen (ring.rs, "No request sits unseen"). Whether or not the sessions are
//! served on the poller's thread (`runtime.poller_sessions`): a session the runtime serves is
//! woken onto a runtime worker, as its socket's reactor would have.
//!
//! # State
//! The rings and whether the poller waits, under one lock: a ring added says what the poller
//! does at that moment (`spinning` from `parked`), and the poller's writes of `spinning` happen
//! under the same lock, so a ring never says "spinning" to a client while the poller waits.
//! The per-pass look takes the lock only while some ring is attached.

use std::sync::atomic::{AtomicUsize, Ordering, fence};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;

use crate::api::local::ring::Ring;

#[derive(Default)]
struct Inner {
    rings: Vec<Arc<Ring>>,
    /// The poller waits (napping or parked in epoll).
    parked: bool,
}

/// The rings of the framed sessions, for the poller.
#[derive(Default)]
pub struct RingWatch {
    inner: Mutex<Inner>,
    count: AtomicUsize,
}

/// A ring's place in the poller's list, removed when dropped.
pub struct RingWatching {
    watch: Arc<RingWatch>,
    ring: Arc<Ring>,
}

impl Drop for RingWatching {
    fn drop(&mut self) {
        let mut inner = self.watch.lock();
        inner.rings.retain(|r| !Arc::ptr_eq(r, &self.ring));
        self.watch.count.store(inner.rings.len(), Ordering::Release);
    }
}

impl RingWatch {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds a session's ring: the poller looks at it from its next pass.
    pub fn watch(self: &Arc<Self>, ring: Arc<Ring>) -> RingWatching {
        let mut inner = self.lock();
        ring.set_spinning(!inner.parked);
        inner.rings.push(ring.clone());
        self.count.store(inner.rings.len(), Ordering::Release);
        RingWatching {
            watch: self.clone(),
            ring,
        }
    }

    /// Rings attached now.
    pub fn len(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Each pass: wakes the readers whose ring holds the entry they wait for (`wakers`: the
    /// caller's scratch, empty on return). True when it woke one: a request taken off a ring is
    /// work, as a socket's is — the thread that serves the sessions lingers after it (a request
    /// on a ring rings no doorbell while its reader spins, so one that does not count it parks
    /// 1 ms into a tight loop and the next request pays the doorbell's wake-up: session 31,
    /// tail).
    pub(super) fn wake(&self, wakers: &mut Vec<Waker>) -> bool {
        if self.is_empty() {
            return false;
        }
        {
            let inner = self.lock();
            wakers.extend(inner.rings.iter().filter_map(|r| r.wake_if_wanted()));
        }
        let woke = !wakers.is_empty();
        for w in wakers.drain(..) {
            w.wake();
        }
        woke
    }

    /// The poller is about to wait: every ring says it does not spin, then (a `SeqCst` fence
    /// between) it looks at them once more; `true` when one holds an entry its reader waits
    /// for (then it does not wait: the next pass wakes that reader).
    pub(super) fn parking(&self) -> bool {
        let inner = &mut *self.lock();
        inner.parked = true;
        if inner.rings.is_empty() {
            return false;
        }
        for r in &inner.rings {
            r.set_spinning(false);
        }
        fence(Ordering::SeqCst);
        inner.rings.iter().any(|r| r.wanted())
    }

    /// The poller runs passes again: every ring says so.
    pub(super) fn unparked(&self) {
        let inner = &mut *self.lock();
        inner.parked = false;
        for r in &inner.rings {
            r.set_spinning(true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::fs::{MemfdFlags, SealFlags};
    use std::os::fd::{AsFd, OwnedFd};
    use std::sync::atomic::AtomicUsize;
    use std::task::Wake;

    use crate::net::shared_words::SharedWords;

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn ring() -> (OwnedFd, Arc<Ring>, SharedWords) {
        let fd = rustix::fs::memfd_create(
            "tcpxd-rings-test",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .unwrap();
        rustix::fs::ftruncate(&fd, 64 + 16 * 128).unwrap();
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK).unwrap();
        let r = Arc::new(Ring::attach(&fd, 16, 128).unwrap());
        let view = SharedWords::map(fd.as_fd(), 8 + 16 * 16).unwrap();
        (fd, r, view)
    }

    /// An entry written whole (`k` last), as a client does.
    fn put(view: &SharedWords, k: u64) {
        let at = 8 + ((k - 1) % 16) as usize * 16;
        view.store(at + 1, 0, Ordering::Relaxed);
        view.store(at + 2, 0, Ordering::Relaxed);
        view.store(at, k, Ordering::Release);
    }

    #[test]
    fn spinning_follows_the_poller_and_a_waiting_entry_keeps_it_from_parking() {
        let watch = Arc::new(RingWatch::default());
        assert!(!watch.parking(), "no rings: it parks");
        // Added while the poller is parked: the ring says so from the start.
        let (_fd, r, view) = ring();
        let watching = watch.watch(r.clone());
        assert_eq!(view.load(1, Ordering::Relaxed), 0);
        watch.unparked();
        assert_eq!(view.load(1, Ordering::Relaxed), 1);
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        r.wait(&waker);
        assert!(!watch.parking(), "waiting, but nothing there: it parks");
        assert_eq!(view.load(1, Ordering::Relaxed), 0);
        put(&view, 1);
        assert!(watch.parking(), "an entry the reader waits for: no park");
        watch.unparked();
        let mut wakers = Vec::new();
        assert!(watch.wake(&mut wakers), "a reader woken: work done");
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "woken by the pass");
        assert!(!watch.wake(&mut wakers), "nothing woken: no work");
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "once per wait");
        assert!(!watch.parking(), "not waiting any more: it parks");
        drop(watching);
        assert!(watch.is_empty());
        watch.unparked();
        assert_eq!(view.load(1, Ordering::Relaxed), 0, "a dropped ring is left alone");
    }
}
