//! The raw bench's receiving thread: posts the receives of each transfer the sender started and
//! runs the daemon's lane pass over them (`tcpxd::lanes`: test the head of each comm, unpack
//! completed receives — host gather or GPU stage — and consume them in ring order); a transfer
//! ends when its last chunk is consumed.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{Job, Mem, Shared, plan_into, window};
use tcpxd::idle::Backoff;
use tcpxd::lanes::{Dest, GpuStage, RecvQueue, Target, start_unpack};
use tcpxd::net::{MemHandle, RecvComm};

/// A receive lane: chunks to post as (offset, length, transfer), then the lane pass's queues,
/// each receive carrying its (offset, transfer) and, once landed, its transfer.
#[derive(Default)]
pub(super) struct RecvLane {
    queue: VecDeque<(u64, u32, u64)>,
    pass: RecvQueue<(u64, u64), u64>,
}

pub(super) struct RecvSide {
    pub comms: Vec<RecvComm>,
    pub handles: Vec<Vec<MemHandle>>,
    pub lanes: Vec<RecvLane>,
    pub window: usize,
    pub next_lane: u32,
    pub dst: Mem,
    pub stage: Option<GpuStage>,
    /// Whether the last pass posted a receive.
    pub posted_any: bool,
    /// The transfers of the chunks the last pass consumed, one entry per chunk.
    pub consumed: Vec<u64>,
}

impl RecvSide {
    /// Runs one job; `n` counts the transfers planned over the whole run. Returns the measured
    /// latencies and the wall time from the first measured start to the last measured end.
    pub fn run(
        &mut self,
        shared: &Shared,
        job: &Job,
        n: &mut u64,
        bar: &indicatif::ProgressBar,
    ) -> Result<(Vec<Duration>, Duration), String> {
        let mut latencies = Vec::with_capacity(job.iterations() as usize);
        let first = *n + 1;
        // Chunks left per planned, unfinished transfer; the front is transfer `oldest`.
        let mut left: VecDeque<u64> = VecDeque::new();
        let mut oldest = first;
        let (mut planned, mut finished) = (0u32, 0u32);
        let mut last_end = None;
        // The first measured transfer's start, read when it is planned: the ring of start times
        // (`T0_RING`) has reused its slot by the end of a long run.
        let mut measured_from = None;
        let mut idle = Backoff::new();
        let mut last_progress = Instant::now();
        while finished < job.transfers {
            let mut progressed = false;
            while planned < job.transfers && shared.started.load(Ordering::Acquire) > *n {
                *n += 1;
                let (lanes, t) = (&mut self.lanes, *n);
                let chunks = plan_into(job, planned, shared, &mut self.next_lane, |lane, at, len| {
                    lanes[lane].queue.push_back((at, len, t))
                });
                left.push_back(chunks);
                if t == first + u64::from(job.warmup) {
                    measured_from = Some(shared.t0(t));
                }
                planned += 1;
                progressed = true;
            }
            let consumed = self.pass()?;
            progressed |= consumed > 0 || self.posted_any;
            if consumed > 0 {
                let end = Instant::now();
                for t in self.consumed.drain(..) {
                    let chunks = &mut left[(t - oldest) as usize];
                    *chunks -= 1;
                    if *chunks > 0 {
                        continue;
                    }
                    tracing::trace!(target: "tcpxd::hop", hop = "raw.end", id = t);
                    if t - first >= u64::from(job.warmup) {
                        latencies.push(end.saturating_duration_since(shared.t0(t)));
                        last_end = Some(end);
                    }
                    finished += 1;
                    shared.done.fetch_add(1, Ordering::AcqRel);
                    bar.inc(1);
                }
                while left.front() == Some(&0) {
                    left.pop_front();
                    oldest += 1;
                }
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
                    "no receive completed for {:.0} s",
                    shared.stall.as_secs_f64()
                ));
            }
            idle.step_or_sleep();
        }
        let wall = match (last_end, measured_from) {
            (Some(end), Some(from)) => end.saturating_duration_since(from),
            _ => Duration::ZERO,
        };
        Ok((latencies, wall))
    }

    /// One pass, the poller's: post what the window allows, test heads, unpack, consume in
    /// ring order. Returns the receives consumed (their transfers in `consumed`).
    fn pass(&mut self) -> Result<u64, String> {
        self.posted_any = false;
        let mut consumed = 0u64;
        let (dst, stage) = (&self.dst, &mut self.stage);
        for (li, (comm, l)) in self.comms.iter_mut().zip(self.lanes.iter_mut()).enumerate() {
            while comm.outstanding() < self.window
                && let Some(&(at, len, transfer)) = l.queue.front()
            {
                let (mh, off) = window(&self.handles[li], at);
                if !l
                    .pass
                    .post(comm, mh, off, len, (at, transfer))
                    .map_err(|e| format!("lane {li} irecv: {e}"))?
                {
                    break;
                }
                l.queue.pop_front();
                self.posted_any = true;
            }
            let mut failed = None;
            l.pass
                .test_heads(comm, |comm, posted| {
                    let (offset, transfer) = posted.meta;
                    let target = match dst {
                        Mem::Host(r) => Target::Host(&**r),
                        Mem::Cuda(r) => Target::Gpu(r),
                    };
                    let dest = Dest {
                        target,
                        offset,
                        len: posted.len,
                        staged: false,
                    };
                    let wait = start_unpack(comm, posted.id, dest, |_| {
                        stage.as_mut().ok_or_else(|| "no GPU unpack stage".to_string())
                    });
                    if let tcpxd::lanes::Wait::Ready(Err(e)) = &wait {
                        failed.get_or_insert_with(|| e.clone());
                    }
                    (wait, transfer)
                })
                .map_err(|e| format!("lane {li} receive: {e}"))?;
            if let Some(e) = failed {
                return Err(format!("lane {li} unpack: {e}"));
            }
        }
        if let Some(stage) = self.stage.as_mut() {
            stage.advance();
        }
        for (li, (comm, l)) in self.comms.iter_mut().zip(self.lanes.iter_mut()).enumerate() {
            let mut failed = None;
            let stage = self.stage.as_ref();
            consumed += l
                .pass
                .consume_ready(
                    comm,
                    |_, batch| stage.and_then(|s| s.outcome(batch)),
                    |landed, result| {
                        if let Err(e) = result {
                            failed.get_or_insert(e);
                        }
                        self.consumed.push(landed.meta);
                    },
                )
                .map_err(|e| format!("lane {li} irecvConsumed: {e}"))? as u64;
            if let Some(e) = failed {
                return Err(format!("lane {li} unpack: {e}"));
            }
        }
        Ok(consumed)
    }
}
