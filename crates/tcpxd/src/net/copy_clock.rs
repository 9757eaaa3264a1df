//! A queued host copy's clock (`net::host_copies`), kept only while the hop trace is on: when
//! a chunk's gather or scatter waited for a helper, how long it copied, and how long its end
//! went unseen by the poller.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// When a queued job waited and ran, kept only while the hop trace is on
/// (`RUST_LOG=tcpxd::hop=trace`): the poller logs it with the chunk's `poller.gathered` or
/// `poller.consumed` hop (`benches/chunks.py` splits a chunk's copy into waiting for a helper,
/// copying, and waiting for the poller to see it done).
#[derive(Debug)]
pub struct JobClock {
    queued: Instant,
    /// ns from `queued` to the first part's start (`u64::MAX`: not started).
    started_ns: AtomicU64,
    /// ns from `queued` to the last part's end.
    done_ns: AtomicU64,
}

/// What a job's clock says, in µs: queued → a helper started it, its copying (first part's
/// start → last part's end), and its end → now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JobTimes {
    pub wait_us: u64,
    pub copy_us: u64,
    pub since_us: u64,
}

impl JobClock {
    pub(super) fn new() -> JobClock {
        JobClock {
            queued: Instant::now(),
            started_ns: AtomicU64::new(u64::MAX),
            done_ns: AtomicU64::new(0),
        }
    }

    pub(super) fn start(&self) {
        let ns = self.queued.elapsed().as_nanos() as u64;
        self.started_ns.fetch_min(ns, Ordering::Relaxed);
    }

    pub(super) fn finish(&self) {
        let ns = self.queued.elapsed().as_nanos() as u64;
        self.done_ns.fetch_max(ns, Ordering::Relaxed);
    }

    /// The job's times so far (`None` before it started).
    pub fn times(&self) -> Option<JobTimes> {
        let started = self.started_ns.load(Ordering::Relaxed);
        if started == u64::MAX {
            return None;
        }
        let done = self.done_ns.load(Ordering::Relaxed).max(started);
        let now = self.queued.elapsed().as_nanos() as u64;
        Some(JobTimes {
            wait_us: started / 1000,
            copy_us: (done - started) / 1000,
            since_us: now.saturating_sub(done) / 1000,
        })
    }
}

/// A traced job's clock (see [`JobClock`]), or none.
pub(super) type Clock = Option<Arc<JobClock>>;

pub(super) fn clock_start(clock: &Clock) {
    if let Some(c) = clock {
        c.start();
    }
}

pub(super) fn clock_finish(clock: &Clock) {
    if let Some(c) = clock {
        c.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clock_reads_nothing_before_its_job_starts_then_its_wait_copy_and_since() {
        let c = JobClock::new();
        assert_eq!(c.times(), None, "queued, not started");
        std::thread::sleep(std::time::Duration::from_millis(2));
        c.start();
        std::thread::sleep(std::time::Duration::from_millis(2));
        c.start(); // a later part's start: the first one counts
        c.finish();
        let t = c.times().expect("started");
        assert!(t.wait_us >= 2000, "{t:?}");
        assert!(t.copy_us >= 2000, "{t:?}");
        std::thread::sleep(std::time::Duration::from_millis(1));
        assert!(c.times().expect("done").since_us >= 1000);
    }

    #[test]
    fn a_job_of_parts_copies_from_the_first_start_to_the_last_end() {
        let c = Arc::new(JobClock::new());
        clock_start(&Some(c.clone()));
        clock_finish(&Some(c.clone()));
        let first_end = c.done_ns.load(Ordering::Relaxed);
        std::thread::sleep(std::time::Duration::from_millis(1));
        clock_finish(&Some(c.clone()));
        assert!(c.done_ns.load(Ordering::Relaxed) >= first_end + 1_000_000);
        clock_start(&None);
        clock_finish(&None);
    }
}
