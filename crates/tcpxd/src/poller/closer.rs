//! The threads that close failed pairings' lanes, off the poller ([`super::peers::close_apart`]).
//!
//! A plugin's close can block for as long as the peer hangs (Google's `tcpxClose` joins helper
//! threads that look at their stop flag only when idle), so a failed pairing's comms never close
//! on the poller. They once closed on a thread each, which a flapping or hostile peer could turn
//! into a thread per failure. Here the closes queue for a few threads, started on demand and
//! gone after [`LINGER`] without work (a daemon with no failures keeps none):
//!
//! - a close that returns at once (the common case) reuses the thread that ran the last one;
//! - a close that hangs holds one thread; the next failure's close starts another, up to
//!   [`MAX_CLOSERS`], so one hung peer does not hold up every later pairing's close;
//! - past that, closes wait in the queue (their comms and memory kept meanwhile, as a hung
//!   close keeps its own), and a warning says so once per episode.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

/// At most this many closer threads at once, process-wide.
pub(crate) const MAX_CLOSERS: usize = 4;
/// A closer thread with nothing to do for this long ends.
pub(crate) const LINGER: Duration = Duration::from_secs(2);
/// The closer threads' name (what `/proc/<pid>/task/*/comm` shows).
pub(crate) const THREAD_NAME: &str = "tcpxd-close-peer";

type Job = Box<dyn FnOnce() + Send + 'static>;

/// A queue of jobs run by up to `max` threads started on demand.
pub(crate) struct Closers {
    name: &'static str,
    max: usize,
    linger: Duration,
    state: Mutex<State>,
    work: Condvar,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Job>,
    /// Threads alive, and those of them waiting for a job.
    threads: usize,
    idle: usize,
    /// A "closes wait" warning was logged since the queue last ran dry.
    warned: bool,
}

impl Closers {
    pub(crate) fn new(name: &'static str, max: usize, linger: Duration) -> Arc<Closers> {
        Arc::new(Closers {
            name,
            max: max.max(1),
            linger,
            state: Mutex::new(State::default()),
            work: Condvar::new(),
        })
    }

    /// The daemon's closers (one set per process, shared by its pollers).
    pub(crate) fn global() -> &'static Arc<Closers> {
        static CLOSERS: OnceLock<Arc<Closers>> = OnceLock::new();
        CLOSERS.get_or_init(|| Closers::new(THREAD_NAME, MAX_CLOSERS, LINGER))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Threads alive now.
    #[cfg(test)]
    pub(crate) fn threads(&self) -> usize {
        self.lock().threads
    }

    /// Queues `job`; starts a thread for it when none is free and fewer than `max` run. Never
    /// blocks on a job. Where no thread can be started and none runs, runs `job` here.
    pub(crate) fn run(self: &Arc<Self>, job: Job) {
        let mut st = self.lock();
        st.queue.push_back(job);
        if st.idle >= st.queue.len() {
            drop(st);
            self.work.notify_one();
            return;
        }
        if st.threads >= self.max {
            if !st.warned {
                st.warned = true;
                tracing::warn!(
                    queued = st.queue.len(),
                    threads = st.threads,
                    "failed pairings' closes wait: every closer thread is in a close that has not \
                     returned (a peer that hangs with a request under way)"
                );
            }
            return;
        }
        st.threads += 1;
        drop(st);
        let me = Arc::clone(self);
        if let Err(e) = std::thread::Builder::new()
            .name(self.name.into())
            .spawn(move || me.work_loop())
        {
            let mut st = self.lock();
            st.threads -= 1;
            if st.threads == 0 {
                let jobs: Vec<Job> = st.queue.drain(..).collect();
                drop(st);
                tracing::warn!(
                    "could not start a thread to close a failed pairing's comms ({e}): closed here"
                );
                jobs.into_iter().for_each(|j| j());
            } else {
                tracing::warn!("could not start another closer thread ({e}): the close waits for one");
            }
        }
    }

    fn work_loop(&self) {
        let mut st = self.lock();
        loop {
            if let Some(job) = st.queue.pop_front() {
                if st.queue.is_empty() {
                    st.warned = false;
                }
                drop(st);
                // A close that panics costs its own comms, not this thread (the pool counts it).
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                    tracing::error!(
                        "closing a failed pairing's comms panicked: the rest of its close was skipped"
                    );
                }
                st = self.lock();
                continue;
            }
            st.idle += 1;
            let (g, waited) = self
                .work
                .wait_timeout(st, self.linger)
                .unwrap_or_else(|e| e.into_inner());
            st = g;
            st.idle -= 1;
            if waited.timed_out() && st.queue.is_empty() {
                st.threads -= 1;
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;
    use std::time::Instant;

    fn until(what: &str, mut f: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !f() {
            assert!(Instant::now() < deadline, "{what} within 30 s");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn closes_that_hang_take_at_most_max_threads_and_the_rest_wait_their_turn() {
        let pool = Closers::new("test-closer", 3, Duration::from_millis(50));
        let (release, gate) = mpsc::channel::<()>();
        let gate = Arc::new(Mutex::new(gate));
        let (started, ran) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        // 40 closes that each hang until released: 3 threads run 3 of them, 37 wait.
        for _ in 0..40 {
            let (gate, started, ran) = (gate.clone(), started.clone(), ran.clone());
            pool.run(Box::new(move || {
                started.fetch_add(1, Ordering::SeqCst);
                gate.lock().unwrap().recv().unwrap();
                ran.fetch_add(1, Ordering::SeqCst);
            }));
        }
        until("3 closes started", || started.load(Ordering::SeqCst) == 3);
        assert_eq!(pool.threads(), 3);
        assert_eq!(pool.lock().queue.len(), 37);
        // Released one by one, every queued close runs, on those threads.
        for _ in 0..40 {
            release.send(()).unwrap();
        }
        until("every close ran", || ran.load(Ordering::SeqCst) == 40);
        assert!(pool.threads() <= 3);
        // Without work, the threads end.
        until("the threads ended", || pool.threads() == 0);
    }

    #[test]
    fn a_close_that_panics_keeps_its_thread_for_the_next() {
        let pool = Closers::new("test-closer", 1, Duration::from_secs(30));
        pool.run(Box::new(|| panic!("a close that panics")));
        let ran = Arc::new(AtomicUsize::new(0));
        let r = ran.clone();
        pool.run(Box::new(move || {
            r.fetch_add(1, Ordering::SeqCst);
        }));
        until("the next close ran", || ran.load(Ordering::SeqCst) == 1);
        assert_eq!(pool.threads(), 1);
    }

    #[test]
    fn closes_that_return_reuse_one_thread() {
        let pool = Closers::new("test-closer", 4, Duration::from_secs(30));
        let ran = Arc::new(AtomicUsize::new(0));
        for i in 0..100 {
            let r = ran.clone();
            pool.run(Box::new(move || {
                r.fetch_add(1, Ordering::SeqCst);
            }));
            until("the close ran", || ran.load(Ordering::SeqCst) == i + 1);
            // (The thread counts itself idle once back in its wait.)
            until("the closer idle", || pool.lock().idle == 1);
        }
        assert_eq!(pool.threads(), 1);
    }
}
