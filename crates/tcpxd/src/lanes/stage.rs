//! A GPU's unpack stage: the unpacker's batches (one per [`GpuStage::advance`]: the lanes' test
//! in each pass, and the poller's again after a batch of actions that landed eager chunks), the
//! block scatters that ride in the same batches, and the block gathers of the send side, each
//! batch launched by the advance (the gathers at the end of a batch of actions).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use crate::engine::blocks::Segment;
use crate::gpu::Gpu;
use crate::gpu::blocks::{GatherTask, ScatterTask};
use crate::unpack::block_batch::{BlockBatcher, BlockOp};
use crate::unpack::{Ticket, UnpackImpl, UnpackJob, Unpacker};

/// When a batch was launched, for the `tcpxd::blocks` timing lines: `queued_us` from its first
/// push to its submit (the rest of the poller's pass), `submit_us` the submit's host time.
#[derive(Debug, Clone, Copy)]
struct Launch {
    at: Instant,
    queued_us: u64,
    submit_us: u64,
}

impl Launch {
    /// The `tcpxd::blocks` line of a batch seen done (`what`: gather, scatter or unpack).
    fn log(&self, gpu: usize, batch: u64, what: &str) {
        tracing::debug!(
            target: "tcpxd::blocks",
            gpu,
            batch,
            us = self.at.elapsed().as_micros() as u64,
            queued_us = self.queued_us,
            submit_us = self.submit_us,
            "{what} batch done"
        );
    }

    fn after(first_push: Option<Instant>, submitted: Instant) -> Launch {
        let at = Instant::now();
        Launch {
            at,
            queued_us: first_push.map_or(0, |f| (submitted - f).as_micros() as u64),
            submit_us: (at - submitted).as_micros() as u64,
        }
    }
}

/// A GPU's block gathers: batches launched at the end of a pass, each send waiting for its own.
#[derive(Default)]
struct Gathers {
    batcher: Option<BlockBatcher>,
    /// The number the batch being filled will get (batches are numbered from 1).
    next: u64,
    /// Launched batches: number, ticket, launch time (for the `tcpxd::blocks` timing lines).
    in_flight: VecDeque<(u64, Ticket, Launch)>,
    /// When the batch being filled got its first gather.
    first_push: Option<Instant>,
    done_upto: u64,
    failed: Option<(u64, String)>,
}

/// How a batch of GPU unpacks ended, for its receives.
#[derive(Debug)]
pub enum BatchEnd {
    Unpacked,
    /// The unpack stage failed (this batch and every later one).
    Failed(String),
    /// The kernel found a list read in place out of bounds (and skipped the fragment) or not
    /// adding up, in some receive of the batch (logged when found): the receive's own host check
    /// says whether it was this one.
    Rejected,
}

/// The unpack stage of one GPU: its unpacker and the batches in flight, oldest first.
pub struct GpuStage {
    gpu: Arc<Gpu>,
    unpacker: Box<dyn Unpacker>,
    /// The batch number receives pushed since the last advance belong to.
    next_batch: u64,
    pushed: bool,
    /// Batches in flight: the unpacker's ticket, the block scatters' ticket and the launch time.
    in_flight: VecDeque<(u64, Option<Ticket>, Option<Ticket>, Launch)>,
    /// When the batch being filled got its first unpack or block scatter.
    first_push: Option<Instant>,
    /// Block chunks received into this GPU: scattered in the same batches (made on first use).
    scatters: Option<BlockBatcher>,
    /// Block chunks sent from this GPU: their gathers, one batch per pass (made on first use).
    gathers: Gathers,
    /// Every batch up to this one has finished.
    done_upto: u64,
    /// A batch that failed on the GPU, and why: its receives (and later ones) fail.
    failed: Option<(u64, String)>,
    /// Batches with a rejected receive (`BatchEnd::Rejected`), recent ones only.
    rejected: std::collections::BTreeSet<u64>,
    /// Per other GPU holding bounce buffers: whether this GPU can read them (`reach_bounce`).
    peer_reach: HashMap<usize, Result<(), String>>,
    /// Eager receives staged in host memory pass through here on their way to this GPU (grown
    /// to the largest chunk once, then reused).
    staging: Vec<u8>,
}
/// The unpack stage of `gpu`, built on first use: its stream, events and unpacker (whose kernels
/// may be compiled then, tens of ms). The poller builds it when the GPU's first buffer is
/// registered, so no transfer pays for it.
pub fn stage_for<'a>(
    stages: &'a mut HashMap<usize, GpuStage>,
    gpu: &Arc<Gpu>,
    unpack_impl: UnpackImpl,
) -> Result<&'a mut GpuStage, String> {
    let ordinal = gpu.ordinal();
    match stages.entry(ordinal) {
        std::collections::hash_map::Entry::Occupied(e) => Ok(e.into_mut()),
        std::collections::hash_map::Entry::Vacant(v) => GpuStage::new(gpu.clone(), unpack_impl)
            .map(|s| v.insert(s))
            .map_err(|e| format!("GPU {ordinal} unpack stage: {e}")),
    }
}

impl GpuStage {
    /// Checks, once per GPU the plugin keeps bounce buffers on, that this GPU's unpacker can
    /// read them: another GPU's memory needs peer access, and without it the receive fails with
    /// this reason instead of an illegal address that would poison the whole context.
    pub fn reach_bounce(&mut self, bounce_device: Option<usize>) -> Result<(), String> {
        let ordinal = self.gpu.ordinal();
        let Some(dev) = bounce_device else {
            return Err(format!(
                "the receive lands in GPU {ordinal} but CUDA cannot tell which GPU holds the plugin's bounce buffer"
            ));
        };
        if dev == ordinal {
            return Ok(());
        }
        let gpu = self.gpu.clone();
        self.peer_reach
            .entry(dev)
            .or_insert_with(|| {
                crate::gpu::enable_peer_access(&gpu, dev).map_err(|e| {
                    format!(
                        "the receive lands in GPU {ordinal} but the plugin's bounce buffer is on GPU {dev}: {e}; \
                         give each GPU its own lanes (for the emulation: TCPXEMU_CUDA_DEVICE per daemon)"
                    )
                })?;
                tracing::info!(gpu = ordinal, bounce_gpu = dev, "unpack reads the bounce buffer over peer access");
                Ok(())
            })
            .clone()
    }

    /// A stage for `gpu` (builds its unpacker: kernels may be compiled now).
    pub fn new(gpu: Arc<Gpu>, imp: UnpackImpl) -> Result<GpuStage, String> {
        gpu.bind_to_thread().map_err(|e| e.to_string())?;
        let unpacker = imp.build(&gpu).map_err(|e| e.to_string())?;
        Ok(GpuStage {
            gpu,
            unpacker,
            next_batch: 1,
            pushed: false,
            in_flight: VecDeque::new(),
            first_push: None,
            done_upto: 0,
            failed: None,
            rejected: std::collections::BTreeSet::new(),
            peer_reach: HashMap::new(),
            staging: Vec::new(),
            scatters: None,
            gathers: Gathers {
                next: 1,
                ..Gathers::default()
            },
        })
    }

    /// Submits the batch being filled (if anything was pushed) and retires finished batches.
    pub fn advance(&mut self) {
        // Nothing pushed and no batch to retire (a sending daemon's stages, every pass): no
        // driver call. `rejected` was trimmed when `done_upto` last moved.
        if !self.pushed && self.in_flight.is_empty() {
            return;
        }
        if self.gpu.bind_to_thread().is_err() {
            return;
        }
        if self.pushed {
            self.pushed = false;
            let batch = self.next_batch;
            self.next_batch += 1;
            let submitted = Instant::now();
            let first_push = self.first_push.take();
            let unpacked = self.unpacker.submit();
            let scattered = match &mut self.scatters {
                Some(s) => s.submit(),
                None => Ok(None),
            };
            tracing::trace!(
                target: "tcpxd::hop",
                hop = "stage.submit",
                pass = super::pass(),
                gpu = self.gpu.ordinal(),
                batch
            );
            match (unpacked, scattered) {
                (Ok(t), Ok(s)) => {
                    let launch = Launch::after(first_push, submitted);
                    self.in_flight.push_back((batch, t, s, launch))
                }
                (Err(e), _) => self.fail(batch, e.to_string()),
                (_, Err(e)) => self.fail(batch, format!("block scatter: {e}")),
            }
        }
        while let Some(&(batch, ticket, scatter, launched)) = self.in_flight.front() {
            let done = match ticket {
                None => Ok(true),
                Some(t) => self.unpacker.is_done(&t),
            };
            let done = match (done, scatter, &mut self.scatters) {
                (Ok(true), Some(t), Some(s)) => s.is_done(&t),
                (d, _, _) => d,
            };
            match done {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) if e.is_data() => {
                    tracing::warn!(gpu = self.gpu.ordinal(), batch, "unpack rejected a receive: {e}");
                    self.rejected.insert(batch);
                }
                Err(e) => self.fail(batch, e.to_string()),
            }
            // Launch to seen done, polling included: the receives wait this long to be consumed.
            if scatter.is_some() {
                launched.log(self.gpu.ordinal(), batch, "scatter");
            } else if ticket.is_some() {
                launched.log(self.gpu.ordinal(), batch, "unpack");
            }
            tracing::trace!(
                target: "tcpxd::hop",
                hop = "stage.done",
                pass = super::pass(),
                gpu = self.gpu.ordinal(),
                batch
            );
            self.done_upto = batch;
            self.in_flight.pop_front();
        }
        // A finished batch's receives are consumed within a pass or two.
        while let Some(&b) = self.rejected.first() {
            if b + 1024 >= self.done_upto {
                break;
            }
            self.rejected.pop_first();
        }
    }

    /// The GPU this stage unpacks into.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Queues an unpack into the batch being filled (the unpacker checks its list: on the host here,
    /// or, read in place, on the GPU, reported as [`BatchEnd::Rejected`]); returns the batch.
    pub fn push_unpack(&mut self, job: &UnpackJob) -> Result<u64, String> {
        self.gpu.bind_to_thread().map_err(|e| e.to_string())?;
        self.unpacker.push(job).map_err(|e| e.to_string())?;
        self.pushed = true;
        self.first_push.get_or_insert_with(Instant::now);
        Ok(self.next_batch)
    }

    /// Queues a block chunk's scatter into the batch being filled; returns the batch.
    pub fn push_scatter(
        &mut self,
        task: ScatterTask,
        fragments: u32,
        table: &[Segment],
    ) -> Result<u64, String> {
        if self.scatters.is_none() {
            self.scatters = Some(BlockBatcher::new(&self.gpu, BlockOp::Scatter).map_err(|e| e.to_string())?);
        }
        let s = self.scatters.as_mut().expect("just made");
        s.push_scatter(task, fragments, table)
            .map_err(|e| e.to_string())?;
        self.pushed = true;
        self.first_push.get_or_insert_with(Instant::now);
        Ok(self.next_batch)
    }

    /// Queues a block chunk's gather into this pass's gather batch; returns the batch, which
    /// [`GpuStage::gather_outcome`] reports on once [`GpuStage::submit_gathers`] launched it.
    pub fn push_gather(&mut self, task: GatherTask, bytes: u32, table: &[Segment]) -> Result<u64, String> {
        let g = &mut self.gathers;
        if let Some((_, why)) = &g.failed {
            return Err(format!("block gather on GPU {}: {why}", self.gpu.ordinal()));
        }
        if g.batcher.is_none() {
            g.batcher = Some(BlockBatcher::new(&self.gpu, BlockOp::Gather).map_err(|e| e.to_string())?);
        }
        g.batcher
            .as_mut()
            .expect("just made")
            .push_gather(task, bytes, table)
            .map_err(|e| e.to_string())?;
        g.first_push.get_or_insert_with(Instant::now);
        Ok(g.next)
    }

    /// Gathers are queued for the next [`GpuStage::submit_gathers`].
    pub fn gathers_pending(&self) -> bool {
        self.gathers.batcher.as_ref().is_some_and(|b| b.pending())
    }

    /// Launches the gathers queued during this pass (one batch).
    pub fn submit_gathers(&mut self) {
        let g = &mut self.gathers;
        let Some(b) = g.batcher.as_mut().filter(|b| b.pending()) else {
            return;
        };
        let batch = g.next;
        g.next += 1;
        let submitted = Instant::now();
        let first_push = g.first_push.take();
        let r = self
            .gpu
            .bind_to_thread()
            .map_err(|e| e.to_string())
            .and_then(|()| b.submit().map_err(|e| e.to_string()));
        match r {
            Ok(Some(t)) => g
                .in_flight
                .push_back((batch, t, Launch::after(first_push, submitted))),
            Ok(None) => g.done_upto = g.done_upto.max(batch),
            Err(why) => {
                tracing::error!(gpu = self.gpu.ordinal(), batch, "block gather failed: {why}");
                g.failed.get_or_insert((batch, why));
            }
        }
    }

    /// Whether gather batch `batch` is done (`None`: not yet); polls the GPU.
    pub fn gather_outcome(&mut self, batch: u64) -> Option<Result<(), String>> {
        let ordinal = self.gpu.ordinal();
        let g = &mut self.gathers;
        while batch > g.done_upto {
            let Some(&(b, t, launched)) = g.in_flight.front() else {
                break;
            };
            let Some(batcher) = g.batcher.as_mut() else {
                break;
            };
            match batcher.is_done(&t) {
                Ok(false) => return None,
                // Launch to seen done, polling included: the batch's sends wait this long.
                Ok(true) => launched.log(ordinal, b, "gather"),
                Err(e) => {
                    tracing::error!(gpu = ordinal, batch = b, "block gather failed: {e}");
                    g.failed.get_or_insert((b, e.to_string()));
                }
            }
            g.done_upto = b;
            g.in_flight.pop_front();
        }
        if let Some((failed, why)) = &g.failed
            && batch >= *failed
        {
            return Some(Err(format!("block gather on GPU {ordinal}: {why}")));
        }
        (batch <= g.done_upto).then_some(Ok(()))
    }

    /// The host staging buffer, at least `len` bytes (grown once, then reused).
    pub fn host_staging(&mut self, len: usize) -> &mut [u8] {
        if self.staging.len() < len {
            self.staging.resize(len, 0);
        }
        &mut self.staging[..len]
    }

    /// Waits for the block kernels in flight (before tables they read are dropped).
    pub fn quiesce_blocks(&mut self) {
        for b in [self.scatters.as_ref(), self.gathers.batcher.as_ref()]
            .into_iter()
            .flatten()
        {
            if let Err(e) = b.stream().synchronize() {
                tracing::warn!(gpu = self.gpu.ordinal(), "waiting for block kernels: {e}");
            }
        }
    }

    fn fail(&mut self, batch: u64, why: String) {
        tracing::error!(gpu = self.gpu.ordinal(), batch, "unpack failed: {why}");
        if self.failed.is_none() {
            self.failed = Some((batch, why));
        }
    }

    /// The outcome of a batch's receives, once it finished.
    pub fn outcome(&self, batch: u64) -> Option<BatchEnd> {
        if let Some((failed, why)) = &self.failed
            && batch >= *failed
        {
            return Some(BatchEnd::Failed(format!(
                "unpack on GPU {}: {why}",
                self.gpu.ordinal()
            )));
        }
        if batch > self.done_upto {
            return None;
        }
        Some(if self.rejected.contains(&batch) {
            BatchEnd::Rejected
        } else {
            BatchEnd::Unpacked
        })
    }
}
