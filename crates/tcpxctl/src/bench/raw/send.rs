//! The raw bench's sending thread: starts transfers (up to the job's depth in flight), posts
//! their chunks within the send window, testing the head of the comm after each post and then
//! once more per pass (the daemon's lane pass, `tcpxd::lanes`: a send moves only in a test).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::{Job, Shared, plan_into, window};
use tcpxd::idle::Backoff;
use tcpxd::lanes::{Tag, post_send, test_sends};
use tcpxd::net::{MemHandle, SendComm};

pub(super) struct SendSide {
    pub comms: Vec<SendComm>,
    pub handles: Vec<Vec<MemHandle>>,
    pub queues: Vec<VecDeque<(u64, u32)>>,
    pub tags: Vec<Tag>,
    pub window: usize,
    pub next_lane: u32,
}

impl SendSide {
    /// Runs one job; `n` counts the transfers started over the whole run.
    pub fn run(&mut self, shared: &Shared, job: &Job, n: &mut u64) -> Result<(), String> {
        let mut issued = 0u32;
        let mut idle = Backoff::new();
        let mut last_progress = Instant::now();
        loop {
            let mut progressed = false;
            // Start transfers while fewer than `depth` are unfinished, the first measured one
            // only once the warm-up ones have finished.
            while issued < job.transfers
                && crate::bench::may_start(
                    issued,
                    (*n - shared.done.load(Ordering::Acquire)) as u32,
                    job.depth,
                    job.warmup,
                )
            {
                *n += 1;
                shared.set_t0(*n, Instant::now());
                tracing::trace!(target: "tcpxd::hop", hop = "raw.start", id = *n);
                let queues = &mut self.queues;
                plan_into(job, issued, shared, &mut self.next_lane, |lane, at, len| {
                    queues[lane].push_back((at, len))
                });
                shared.started.store(*n, Ordering::Release);
                issued += 1;
                progressed = true;
            }
            let mut busy = false;
            for (li, comm) in self.comms.iter_mut().enumerate() {
                let q = &mut self.queues[li];
                while comm.outstanding() < self.window
                    && let Some(&(at, len)) = q.front()
                {
                    let (mh, off) = window(&self.handles[li], at);
                    if !post_send(comm, &mut self.tags[li], mh, off, len)
                        .map_err(|e| format!("lane {li} isend: {e}"))?
                    {
                        break;
                    }
                    q.pop_front();
                    progressed = true;
                    // A posted send moves only in a test, one more per call (Google's plugin,
                    // `lanes::post_send`): tested after each post, as the daemon's lanes do.
                    test_sends(comm, || {}).map_err(|e| format!("lane {li} send: {e}"))?;
                }
                if test_sends(comm, || {}).map_err(|e| format!("lane {li} send: {e}"))? > 0 {
                    progressed = true;
                }
                busy |= comm.outstanding() > 0 || !q.is_empty();
            }
            if issued == job.transfers && !busy {
                return Ok(());
            }
            if progressed {
                idle.reset();
                last_progress = Instant::now();
                continue;
            }
            if shared.abort.load(Ordering::Acquire) {
                return Err("the other side stopped".into());
            }
            if last_progress.elapsed() > shared.stall {
                return Err(format!(
                    "no send completed for {:.0} s",
                    shared.stall.as_secs_f64()
                ));
            }
            idle.step_or_sleep();
        }
    }
}
