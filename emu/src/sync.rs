//! Comm health (closing / failed), closing-aware sleeps and the per-socket task queues.

use crate::abi::ncclResult_t;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Lock, ignoring poison: a panicking helper must not take the caller's thread down with it.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether a comm is closing or has failed, and why it failed.
#[derive(Debug, Default)]
pub(crate) struct Health {
    closing: AtomicBool,
    failed: AtomicBool,
    why: Mutex<Option<(ncclResult_t, String)>>,
    m: Mutex<()>,
    cv: Condvar,
}

impl Health {
    /// Record the comm's first failure (logged as a WARN). Ignored once closing: errors caused by
    /// our own shutdown are not failures.
    pub(crate) fn fail(&self, code: ncclResult_t, msg: String) -> bool {
        if self.closing() {
            return false;
        }
        let mut why = lock(&self.why);
        if why.is_some() {
            return false;
        }
        warn!("{msg}");
        *why = Some((code, msg));
        self.failed.store(true, Ordering::Release);
        drop(why);
        let _g = lock(&self.m);
        self.cv.notify_all();
        true
    }

    /// One of the real plugin's `exit(1)` paths (reference/TCPX_PLUGIN_ABI.md §5) that the
    /// emulation models: with `TCPXEMU_FAILSTOP=exit`, log `msg` and exit the process as the
    /// plugin does; otherwise (the default) fail the comm with `code` and `msg`. Ignored once the
    /// comm is closing, as [`Health::fail`] is.
    pub(crate) fn fatal(&self, code: ncclResult_t, msg: String) -> bool {
        if self.closing() {
            return false;
        }
        if crate::config::get().is_some_and(|c| c.failstop == crate::config::FailStop::Exit) {
            exit_like_the_plugin(&msg);
        }
        self.fail(code, msg)
    }

    pub(crate) fn failure(&self) -> Option<(ncclResult_t, String)> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        lock(&self.why).clone()
    }

    pub(crate) fn closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// Helper threads stop when the comm closes or fails.
    pub(crate) fn stop(&self) -> bool {
        self.closing() || self.failed.load(Ordering::Acquire)
    }

    pub(crate) fn begin_close(&self) {
        self.closing.store(true, Ordering::Release);
        let _g = lock(&self.m);
        self.cv.notify_all();
    }

    /// Sleep until `deadline`; false when the comm stopped first.
    pub(crate) fn sleep_until(&self, deadline: Instant) -> bool {
        let mut g = lock(&self.m);
        loop {
            if self.stop() {
                return false;
            }
            let now = Instant::now();
            if now >= deadline {
                return true;
            }
            let step = (deadline - now).min(Duration::from_millis(50));
            g = self.cv.wait_timeout(g, step).unwrap_or_else(|e| e.into_inner()).0;
        }
    }
}

/// Log the plugin's words and `exit(1)`, as the shipped plugin does on its fail-stop paths.
pub(crate) fn exit_like_the_plugin(msg: &str) -> ! {
    warn!("{msg}");
    warn!("tcpxemu: exit(1), as the real plugin does here (TCPXEMU_FAILSTOP=exit)");
    std::process::exit(1)
}

/// A FIFO of tasks for one socket thread. Preallocated for the 16 requests a comm can hold.
#[derive(Debug)]
pub(crate) struct TaskQueue<T> {
    q: Mutex<Tasks<T>>,
    cv: Condvar,
}

/// The queue and how many of its threads wait on it (at most one: each socket thread has its
/// own), both under the one lock: a push wakes a thread only when one waits. A `notify_one` is
/// a futex syscall whether or not anyone waits, and the poller's `test` (`match_headers`) and
/// `isend` push a task per chunk while the socket threads are mostly busy.
#[derive(Debug)]
struct Tasks<T> {
    q: VecDeque<T>,
    waiting: usize,
}

impl<T> TaskQueue<T> {
    pub(crate) fn new() -> TaskQueue<T> {
        TaskQueue {
            q: Mutex::new(Tasks {
                q: VecDeque::with_capacity(crate::abi::MAX_REQUESTS * 2),
                waiting: 0,
            }),
            cv: Condvar::new(),
        }
    }

    pub(crate) fn push(&self, t: T) {
        let mut g = lock(&self.q);
        g.q.push_back(t);
        // Read under the lock: a thread counted here is waiting (or about to, having found the
        // queue empty under this lock before), and one not counted finds the task when it looks.
        let wake = g.waiting > 0;
        drop(g);
        if wake {
            self.cv.notify_one();
        }
    }

    /// The next task, or `None` once the comm stops.
    pub(crate) fn pop(&self, health: &Health) -> Option<T> {
        let mut g = lock(&self.q);
        loop {
            if health.stop() {
                return None;
            }
            if let Some(t) = g.q.pop_front() {
                return Some(t);
            }
            g.waiting += 1;
            g = self
                .cv
                .wait_timeout(g, Duration::from_millis(100))
                .unwrap_or_else(|e| e.into_inner())
                .0;
            g.waiting -= 1;
        }
    }

    pub(crate) fn wake(&self) {
        let _q = lock(&self.q);
        self.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_task_queue_hands_every_task_over_in_order_whether_or_not_its_thread_waits() {
        let q = Arc::new(TaskQueue::new());
        let health = Arc::new(Health::default());
        // Pushed with nobody waiting (no wake-up): found at once.
        q.push(0u32);
        assert_eq!(q.pop(&health), Some(0));
        let (q2, h2) = (q.clone(), health.clone());
        let popper = std::thread::spawn(move || {
            let mut got = Vec::new();
            while got.len() < 20_000 {
                got.push(q2.pop(&h2).expect("not stopped"));
            }
            got
        });
        for i in 1..=20_000u32 {
            q.push(i);
            if i % 1000 == 0 {
                // Let the popper drain the queue and wait: the next push must wake it.
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        let got = popper.join().unwrap();
        assert_eq!(got, (1..=20_000).collect::<Vec<_>>());
        assert_eq!(
            lock(&q.q).waiting,
            0,
            "nobody counted as waiting once it returned"
        );
    }
}
