//! The raw bench's receiving thread: posts the receives of each transfer the sender started,
//! tests the head of each comm, unpacks completed receives (host gather or GPU stage) and
//! consumes them in ring order; a transfer ends when its last chunk is consumed.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{Job, Mem, Shared, plan_into, window};
use tcpxd::gpu::Gpu;
use tcpxd::idle::Backoff;
use tcpxd::net::{MemHandle, RecvComm, RequestId};
use tcpxd::unpack::{Ticket, UnpackImpl, UnpackJob, Unpacker};

/// A posted receive: where its bytes go, and the transfer it belongs to.
#[derive(Debug, Clone, Copy)]
struct Posted {
    id: RequestId,
    len: u32,
    offset: u64,
    transfer: u64,
}

#[derive(Debug, Clone, Copy)]
enum Wait {
    Ready,
    /// In this batch of the GPU stage.
    Gpu(u64),
}

#[derive(Default)]
pub(super) struct RecvLane {
    /// Chunks to post: (offset, length, transfer).
    queue: VecDeque<(u64, u32, u64)>,
    posted: VecDeque<Posted>,
    landing: VecDeque<(RequestId, Wait, u64)>,
    tag: i32,
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
        let wall = last_end.map_or(Duration::ZERO, |end| {
            end.saturating_duration_since(shared.t0(first + u64::from(job.warmup)))
        });
        Ok((latencies, wall))
    }

    /// One poller-like pass: post what the window allows, test heads, unpack, consume in ring
    /// order. Returns the receives consumed (their transfers in `consumed`).
    fn pass(&mut self) -> Result<u64, String> {
        self.posted_any = false;
        let mut consumed = 0u64;
        for (li, (comm, l)) in self.comms.iter_mut().zip(self.lanes.iter_mut()).enumerate() {
            while comm.outstanding() < self.window
                && let Some(&(at, len, transfer)) = l.queue.front()
            {
                let (mh, off) = window(&self.handles[li], at);
                l.tag = l.tag.wrapping_add(1) & 0x7fff_ffff;
                match comm
                    .irecv(mh, off, len as usize, l.tag)
                    .map_err(|e| format!("lane {li} irecv: {e}"))?
                {
                    Some(id) => {
                        l.queue.pop_front();
                        l.posted.push_back(Posted {
                            id,
                            len,
                            offset: at,
                            transfer,
                        });
                        self.posted_any = true;
                    }
                    None => break,
                }
            }
            while let Some(&posted) = l.posted.front() {
                match comm
                    .test(posted.id)
                    .map_err(|e| format!("lane {li} receive: {e}"))?
                {
                    Some(_) => {
                        let wait = start_unpack(comm, &posted, &self.dst, self.stage.as_mut())
                            .map_err(|e| format!("lane {li} unpack: {e}"))?;
                        l.posted.pop_front();
                        l.landing.push_back((posted.id, wait, posted.transfer));
                    }
                    None => break,
                }
            }
        }
        if let Some(stage) = self.stage.as_mut() {
            stage.advance()?;
        }
        for (li, (comm, l)) in self.comms.iter_mut().zip(self.lanes.iter_mut()).enumerate() {
            while let Some(&(id, wait, transfer)) = l.landing.front() {
                if let Wait::Gpu(batch) = wait
                    && !self.stage.as_ref().is_some_and(|s| s.done(batch))
                {
                    break;
                }
                comm.consume(id)
                    .map_err(|e| format!("lane {li} irecvConsumed: {e}"))?;
                l.landing.pop_front();
                self.consumed.push(transfer);
                consumed += 1;
            }
        }
        Ok(consumed)
    }
}

/// As the poller's `start_unpack`: nothing when the plugin received in place, the host gather
/// for host memory, a push into the GPU stage for CUDA memory.
fn start_unpack(
    comm: &RecvComm,
    posted: &Posted,
    dst: &Mem,
    stage: Option<&mut GpuStage>,
) -> Result<Wait, String> {
    let (ring, q) = comm.completed(posted.id).map_err(|e| e.to_string())?;
    let frags = ring.fragments(q).map_err(|e| e.to_string())?;
    if frags.is_empty() {
        return Ok(Wait::Ready);
    }
    match (dst, stage) {
        (Mem::Host(_), _) => {
            let landed: u64 = frags.iter().map(|f| u64::from(f.len)).sum();
            if landed != u64::from(posted.len) {
                return Err(format!("chunk landed {landed} of {} bytes", posted.len));
            }
            comm.unpack_host(posted.id)
                .map(|_| Wait::Ready)
                .map_err(|e| e.to_string())
        }
        // The unpacker checks the list against the posted size (`exact`): on the host at
        // `push`, or, for the ring read in place, the kernel adds the lengths up.
        (Mem::Cuda(region), Some(stage)) => {
            let job = UnpackJob {
                frags: ring.fragment_list(q).map_err(|e| e.to_string())?,
                bounce: ring.bounce_span(frags),
                dst: region
                    .subspan(posted.offset, u64::from(posted.len))
                    .map_err(|e| e.to_string())?,
                exact: true,
            };
            stage.unpacker.push(&job).map_err(|e| e.to_string())?;
            stage.pushed = true;
            Ok(Wait::Gpu(stage.next_batch))
        }
        (Mem::Cuda(_), None) => Err("no GPU unpack stage".into()),
    }
}

/// The poller's GPU unpack stage, for one GPU: one batch per pass.
pub(super) struct GpuStage {
    gpu: Arc<Gpu>,
    unpacker: Box<dyn Unpacker>,
    next_batch: u64,
    pushed: bool,
    in_flight: VecDeque<(u64, Option<Ticket>)>,
    done_upto: u64,
}

impl GpuStage {
    pub(super) fn new(gpu: Arc<Gpu>, imp: UnpackImpl) -> Result<GpuStage, String> {
        gpu.bind_to_thread().map_err(|e| e.to_string())?;
        let unpacker = imp.build(&gpu).map_err(|e| e.to_string())?;
        Ok(GpuStage {
            gpu,
            unpacker,
            next_batch: 1,
            pushed: false,
            in_flight: VecDeque::new(),
            done_upto: 0,
        })
    }

    fn advance(&mut self) -> Result<(), String> {
        self.gpu.bind_to_thread().map_err(|e| e.to_string())?;
        if self.pushed {
            self.pushed = false;
            let batch = self.next_batch;
            self.next_batch += 1;
            let ticket = self.unpacker.submit().map_err(|e| e.to_string())?;
            self.in_flight.push_back((batch, ticket));
        }
        while let Some((batch, ticket)) = self.in_flight.front() {
            let done = match ticket {
                None => true,
                Some(t) => self.unpacker.is_done(t).map_err(|e| e.to_string())?,
            };
            if !done {
                break;
            }
            self.done_upto = *batch;
            self.in_flight.pop_front();
        }
        Ok(())
    }

    fn done(&self, batch: u64) -> bool {
        batch <= self.done_upto
    }
}
