//! Work a polling thread holds until the end of its pass: the writes that wake local clients
//! (a framed session's final events and notifications, src/api/local/outbox.rs). Written in the
//! middle of the poller's actions, such a write woke the client's thread, which on a machine with
//! few CPUs took the poller's CPU at once: the actions after it (the `Done` and `Credits` to the
//! peer) went out ~90 µs later on the 2-core VM (session 21, `benches/api_legs.py`). Held until
//! the pass has sent what it had for its peers, the wake costs the peers nothing.
//!
//! A thread defers only once it has called [`run`] (the poller, at the end of every pass); any
//! other thread does the work at once. What is still held when the thread ends is done then.
//! Imports nothing of the crate: the poller (below the API) calls it, the API hands it work.

use std::cell::{Cell, RefCell};
use std::sync::Arc;

/// Something to do at the end of the pass.
pub trait Deferred: Send + Sync {
    fn run(&self);
}

struct Held(Vec<Arc<dyn Deferred>>);

impl Drop for Held {
    fn drop(&mut self) {
        for d in self.0.drain(..) {
            d.run();
        }
    }
}

thread_local! {
    static DEFERRING: Cell<bool> = const { Cell::new(false) };
    static HELD: RefCell<Held> = const { RefCell::new(Held(Vec::new())) };
}

/// Whether this thread holds work until the end of its pass.
pub fn deferring() -> bool {
    DEFERRING.with(|d| d.get())
}

/// Holds `work` until this thread's [`run`] (the caller checked [`deferring`]).
pub fn defer(work: Arc<dyn Deferred>) {
    HELD.with(|h| h.borrow_mut().0.push(work));
}

/// Does what this thread held, in order, and from now on holds such work until the next call.
pub fn run() {
    DEFERRING.with(|d| d.set(true));
    loop {
        let batch = HELD.with(|h| std::mem::take(&mut h.borrow_mut().0));
        if batch.is_empty() {
            return;
        }
        for d in batch {
            d.run();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    struct Note(Arc<Mutex<Vec<u32>>>, u32);

    impl Deferred for Note {
        fn run(&self) {
            self.0.lock().unwrap().push(self.1);
        }
    }

    #[test]
    fn held_until_run_in_order_and_done_at_thread_end() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let l = log.clone();
        std::thread::spawn(move || {
            assert!(!deferring());
            run();
            assert!(deferring());
            defer(Arc::new(Note(l.clone(), 1)));
            defer(Arc::new(Note(l.clone(), 2)));
            assert!(l.lock().unwrap().is_empty());
            run();
            assert_eq!(*l.lock().unwrap(), [1, 2]);
            defer(Arc::new(Note(l.clone(), 3)));
        })
        .join()
        .unwrap();
        assert_eq!(*log.lock().unwrap(), [1, 2, 3]);
    }
}
