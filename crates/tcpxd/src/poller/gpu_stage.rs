//! The poller's unpack stage: starting the unpack of a completed receive (nothing, a host gather,
//! or a push into the GPU's unpacker) and the GPU unpacker's batches, one per pass.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use crate::buffers::BufferEntry;
use crate::gpu::Gpu;
use crate::gpu::blocks::{GatherTask, ScatterTask};
use crate::net::{RecvComm, RequestId};
use crate::unpack::block_batch::{BlockBatcher, BlockOp};
use crate::unpack::{Ticket, UnpackImpl, UnpackJob, Unpacker};

/// A GPU's block gathers: batches launched at the end of a pass, each send waiting for its own.
#[derive(Default)]
struct Gathers {
    batcher: Option<BlockBatcher>,
    /// The number the batch being filled will get (batches are numbered from 1).
    next: u64,
    /// Launched batches: number, ticket, launch time (for the `tcpxd::blocks` timing lines).
    in_flight: VecDeque<(u64, Ticket, Instant)>,
    done_upto: u64,
    failed: Option<(u64, String)>,
}

/// Where a completed receive's bytes go.
#[derive(Debug, Clone, Copy)]
pub(super) struct Dest {
    pub buffer: u64,
    pub offset: u64,
    pub len: u32,
    /// Eager: the receive was posted into the lane's landing slots, not into `buffer`, so the
    /// bytes are copied there even when the plugin received them in place (a direct receive).
    pub staged: bool,
}

#[derive(Debug)]
pub(super) enum Wait {
    /// An eager credit receive completed before its header: the destination is not known yet.
    Header,
    /// Unpacked (or nothing to unpack), with the outcome.
    Ready(Result<(), String>),
    /// In batch `batch` of GPU `gpu`'s unpacker; `len` bytes posted.
    Gpu { gpu: usize, batch: u64, len: u32 },
}

/// How a batch of GPU unpacks ended, for its receives.
#[derive(Debug)]
pub(super) enum BatchEnd {
    Unpacked,
    /// The unpack stage failed (this batch and every later one).
    Failed(String),
    /// The kernel found a list read in place out of bounds (and skipped the fragment) or not
    /// adding up, in some receive of the batch (logged when found): the receive's own host check
    /// says whether it was this one.
    Rejected,
}

/// The unpack stage of one GPU: its unpacker and the batches in flight, oldest first.
pub(super) struct GpuStage {
    gpu: Arc<Gpu>,
    unpacker: Box<dyn Unpacker>,
    /// The batch number receives pushed during this pass belong to.
    next_batch: u64,
    pushed: bool,
    /// Batches in flight: the unpacker's ticket, the block scatters' ticket and the launch time.
    in_flight: VecDeque<(u64, Option<Ticket>, Option<Ticket>, Instant)>,
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
/// Starts unpacking a completed receive: nothing to do when the plugin received in place (or
/// the chunk was sent empty), a host gather for host destinations, a push into the GPU's
/// unpacker for CUDA destinations. A staged (eager) receive that the plugin received in place,
/// into the landing slot, is copied to its destination (a staging copy: synchronous for GPU
/// memory).
/// The unpack stage of `gpu`, built on first use: its stream, events and unpacker (whose kernels
/// may be compiled then, tens of ms). The poller builds it when the GPU's first buffer is
/// registered, so no transfer pays for it.
pub(super) fn stage_for<'a>(
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

pub(super) fn start_unpack(
    comm: &RecvComm,
    id: RequestId,
    posted: Dest,
    buffers: &HashMap<u64, Arc<BufferEntry>>,
    stages: &mut HashMap<usize, GpuStage>,
    unpack_impl: UnpackImpl,
) -> Wait {
    let (ring, q) = match comm.completed(id) {
        Ok(v) => v,
        Err(e) => return Wait::Ready(Err(e.to_string())),
    };
    let frags = match ring.fragments(q) {
        Ok(f) => f,
        Err(e) => return Wait::Ready(Err(e.to_string())),
    };
    if frags.is_empty() && !posted.staged {
        return Wait::Ready(Ok(()));
    }
    let Some(entry) = buffers.get(&posted.buffer) else {
        return Wait::Ready(Err(format!("buffer {} vanished", posted.buffer)));
    };
    let (offset, len) = (posted.offset as usize, posted.len as usize);
    let Some(region) = entry.device_region() else {
        let landed: u64 = frags.iter().map(|f| u64::from(f.len)).sum();
        if !frags.is_empty() && landed != u64::from(posted.len) {
            return Wait::Ready(Err(format!("chunk landed {landed} of {} bytes", posted.len)));
        }
        let r = if posted.staged {
            comm.land_host(id, &*entry.region_dyn(), offset, len)
        } else {
            comm.unpack_host(id)
        };
        return Wait::Ready(r.map(|_| ()).map_err(|e| e.to_string()));
    };
    let ordinal = region.gpu().ordinal();
    let stage = match stage_for(stages, region.gpu(), unpack_impl) {
        Ok(s) => s,
        Err(e) => return Wait::Ready(Err(e)),
    };
    if posted.staged && (frags.is_empty() || ring.bounce_is_host_readable()) {
        // Staged in host memory (received in place into the landing slot, or into host bounce
        // pages): a synchronous copy to the GPU through the stage's host staging buffer.
        if stage.staging.len() < len {
            stage.staging.resize(len, 0);
        }
        let staging = &mut stage.staging[..len];
        let r = match comm.land_into(id, staging) {
            Ok(n) if n == len => region.write(posted.offset, staging).map_err(|e| e.to_string()),
            Ok(n) => Err(format!("chunk landed {n} of {len} bytes")),
            Err(e) => Err(e.to_string()),
        };
        return Wait::Ready(r);
    }
    // From here the unpacker checks the list (bounds, and adding up to the posted size:
    // `exact`): on the host at `push`, or, for the ring read in place, on the GPU, reported when
    // the batch is done (`BatchEnd::Rejected`).
    let job = (|| -> Result<(), String> {
        stage.reach_bounce(ring.bounce_device())?;
        let bounce = ring.bounce_span(frags);
        stage.gpu.bind_to_thread().map_err(|e| e.to_string())?;
        let dst = region
            .subspan(posted.offset, u64::from(posted.len))
            .map_err(|e| e.to_string())?;
        let list = ring.fragment_list(q).map_err(|e| e.to_string())?;
        let job = UnpackJob {
            frags: list,
            bounce,
            dst,
            exact: true,
        };
        stage.unpacker.push(&job).map_err(|e| e.to_string())
    })();
    match job {
        Ok(()) => {
            stage.pushed = true;
            Wait::Gpu {
                gpu: ordinal,
                batch: stage.next_batch,
                len: posted.len,
            }
        }
        Err(e) => Wait::Ready(Err(e)),
    }
}

/// The host's check of a completed receive's list (still in the ring: not consumed yet) against
/// the bounce buffer and the posted size, for the receives of a batch the GPU rejected part of:
/// only a receive whose own list is bad fails, named (the kernel skips only out-of-bounds
/// fragments, so the others were unpacked whole).
pub(super) fn check_list(comm: &RecvComm, id: RequestId, len: u32) -> Result<(), String> {
    let (ring, q) = comm.completed(id).map_err(|e| format!("unpack: {e}"))?;
    let frags = ring.fragments(q).map_err(|e| format!("unpack: {e}"))?;
    let bounce_len = ring.bounce_span(frags).len();
    crate::unpack::validate_list(frags, bounce_len, u64::from(len), true)
        .map(|_| ())
        .map_err(|e| format!("unpack: {e}"))
}

impl GpuStage {
    /// Checks, once per GPU the plugin keeps bounce buffers on, that this GPU's unpacker can
    /// read them: another GPU's memory needs peer access, and without it the receive fails with
    /// this reason instead of an illegal address that would poison the whole context.
    pub(super) fn reach_bounce(&mut self, bounce_device: Option<usize>) -> Result<(), String> {
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

    fn new(gpu: Arc<Gpu>, imp: UnpackImpl) -> Result<GpuStage, String> {
        gpu.bind_to_thread().map_err(|e| e.to_string())?;
        let unpacker = imp.build(&gpu).map_err(|e| e.to_string())?;
        Ok(GpuStage {
            gpu,
            unpacker,
            next_batch: 1,
            pushed: false,
            in_flight: VecDeque::new(),
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

    /// Submits this pass's batch (if anything was pushed) and retires finished batches.
    pub(super) fn advance(&mut self) {
        if self.gpu.bind_to_thread().is_err() {
            return;
        }
        if self.pushed {
            self.pushed = false;
            let batch = self.next_batch;
            self.next_batch += 1;
            let unpacked = self.unpacker.submit();
            let scattered = match &mut self.scatters {
                Some(s) => s.submit(),
                None => Ok(None),
            };
            match (unpacked, scattered) {
                (Ok(t), Ok(s)) => self.in_flight.push_back((batch, t, s, Instant::now())),
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
            if scatter.is_some() {
                // Launch to seen done, polling included: the receive waits this long to be consumed.
                tracing::debug!(
                    target: "tcpxd::blocks",
                    gpu = self.gpu.ordinal(),
                    batch,
                    us = launched.elapsed().as_micros() as u64,
                    "scatter batch done"
                );
            }
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

    /// Queues a block chunk's scatter into this pass's batch; returns the batch.
    pub(super) fn push_scatter(&mut self, task: ScatterTask, fragments: u32) -> Result<u64, String> {
        if self.scatters.is_none() {
            self.scatters = Some(BlockBatcher::new(&self.gpu, BlockOp::Scatter).map_err(|e| e.to_string())?);
        }
        let s = self.scatters.as_mut().expect("just made");
        s.push_scatter(task, fragments).map_err(|e| e.to_string())?;
        self.pushed = true;
        Ok(self.next_batch)
    }

    /// Queues a block chunk's gather into this pass's gather batch; returns the batch, which
    /// [`GpuStage::gather_outcome`] reports on once [`GpuStage::submit_gathers`] launched it.
    pub(super) fn push_gather(&mut self, task: GatherTask, bytes: u32) -> Result<u64, String> {
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
            .push_gather(task, bytes)
            .map_err(|e| e.to_string())?;
        Ok(g.next)
    }

    /// Launches the gathers queued during this pass (one batch).
    pub(super) fn submit_gathers(&mut self) {
        let g = &mut self.gathers;
        let Some(b) = g.batcher.as_mut().filter(|b| b.pending()) else {
            return;
        };
        let batch = g.next;
        g.next += 1;
        let r = self
            .gpu
            .bind_to_thread()
            .map_err(|e| e.to_string())
            .and_then(|()| b.submit().map_err(|e| e.to_string()));
        match r {
            Ok(Some(t)) => g.in_flight.push_back((batch, t, Instant::now())),
            Ok(None) => g.done_upto = g.done_upto.max(batch),
            Err(why) => {
                tracing::error!(gpu = self.gpu.ordinal(), batch, "block gather failed: {why}");
                g.failed.get_or_insert((batch, why));
            }
        }
    }

    /// Whether gather batch `batch` is done (`None`: not yet); polls the GPU.
    pub(super) fn gather_outcome(&mut self, batch: u64) -> Option<Result<(), String>> {
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
                Ok(true) => {
                    // Launch to seen done, polling included: the batch's sends wait this long.
                    tracing::debug!(
                        target: "tcpxd::blocks",
                        gpu = ordinal,
                        batch = b,
                        us = launched.elapsed().as_micros() as u64,
                        "gather batch done"
                    );
                }
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
    pub(super) fn host_staging(&mut self, len: usize) -> &mut [u8] {
        if self.staging.len() < len {
            self.staging.resize(len, 0);
        }
        &mut self.staging[..len]
    }

    /// Waits for the block kernels in flight (before tables they read are dropped).
    pub(super) fn quiesce_blocks(&mut self) {
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
    pub(super) fn outcome(&self, batch: u64) -> Option<BatchEnd> {
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
