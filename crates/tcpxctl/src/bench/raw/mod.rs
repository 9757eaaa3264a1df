//! The raw plugin bench: the engine's ceiling. It drives the plugin directly, in one process,
//! with what the daemon's poller does, and nothing else (no daemon, no gRPC, no offers):
//!
//! - lanes: `devices × lanes_per_device` comm pairs, lane `i` on device `devices[i % n]`;
//! - the chunk plan: [`ChunkPlan`] over the batch's ranges (block `i` at `i × size`), the first
//!   lane rotating from transfer to transfer as the engine's does;
//! - windows: at most `send_window` sends and `recv_window` receives (held until consumed) per
//!   lane; buffers registered in the poller's overlapping 1 GiB windows;
//! - completion: the daemon's lane pass (`tcpxd::lanes`, the poller's own): only the head of
//!   each comm is tested; a completed receive is unpacked (the host gather for host memory, the
//!   GPU unpacker for CUDA memory, one batch per pass) and consumed (`irecvConsumed`) in ring
//!   order once its unpack finished;
//! - idling: the poller's (`tcpxd::idle`: spin, then yield, then 50 µs naps once no pass made
//!   progress for 2 ms).
//!
//! The sender and the receiver run on two threads. A transfer's latency runs from the moment the
//! sender starts posting its chunks to the moment the receiver consumed the last one. With a
//! concurrency of N the sender keeps N transfers in flight (transfer `k` on its own range, slot
//! `k % N`), starting the next as soon as the receiver finished one, as the daemon bench's
//! session does; the receiver posts a transfer's receives once the sender started it. Plugin
//! level, a READ is the peer's send: the raw READ rows measure the same path as WRITE and exist
//! so both harnesses can be compared row by row.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use crate::bench::{BenchRow, Harness, LatencyStats, Memory, SEED, Workload};
use tcpxd::buffers::seeded_bytes;
use tcpxd::engine::ChunkPlan;
use tcpxd::gpu::{DeviceRegion, Gpu};
use tcpxd::lanes::Tag;
use tcpxd::net::{HostRegion, MemHandle, Plugin, Region, RegionWindow};
use tcpxd::poller::{WINDOW_LEN, WINDOW_STRIDE};
use tcpxd::unpack::UnpackImpl;

mod recv;
mod send;

use recv::{RecvLane, RecvSide};
use send::SendSide;
use tcpxd::lanes::GpuStage;

/// Bytes verified or filled per step.
const PIECE: usize = 16 << 20;

/// What the raw bench runs.
#[derive(Debug, Clone)]
pub struct RawOptions {
    pub workload: Workload,
    /// The plugin file; `None`: the emulation plugin linked into this binary.
    pub plugin: Option<PathBuf>,
    pub chunk_bytes: u32,
    pub lanes_per_device: u32,
    /// The daemon's `transfer.spread_min_chunk_bytes` (0: off): transfers of fewer than two
    /// chunks per lane take smaller chunks, as the engine plans them.
    pub spread_min_chunk: u32,
    /// The daemon's `transfer.spread_chunks_per_lane`: the chunks per lane a spread plan aims at.
    pub spread_chunks_per_lane: u32,
    /// Plugin devices to use; `None`: all of them.
    pub devices: Option<Vec<i32>>,
    pub send_window: usize,
    pub recv_window: usize,
    pub unpack_impl: UnpackImpl,
    pub connect_timeout: Duration,
    /// A transfer that makes no progress for this long fails the run.
    pub stall_timeout: Duration,
}

/// Why the raw bench failed.
#[derive(Debug, thiserror::Error)]
pub enum RawError {
    #[error("bad option: {0}")]
    BadOption(String),
    #[error("{what}: {why}")]
    Setup { what: String, why: String },
    #[error("{side} failed at block size {size}: {why}")]
    Transfer {
        side: &'static str,
        size: u64,
        why: String,
    },
    #[error("verification failed at block size {size}: {why}")]
    Verify { size: u64, why: String },
}

fn setup(what: impl Into<String>) -> impl FnOnce(String) -> RawError {
    let what = what.into();
    move |why| RawError::Setup { what, why }
}

/// One side's memory.
#[derive(Clone)]
enum Mem {
    Host(Arc<HostRegion>),
    Cuda(Arc<DeviceRegion>),
}

impl Mem {
    fn alloc(memory: Memory, gpu: Option<&Arc<Gpu>>, len: u64) -> Result<Mem, String> {
        match (memory, gpu) {
            (Memory::Host, _) => HostRegion::new(len as usize)
                .map(|r| Mem::Host(Arc::new(r)))
                .map_err(|e| e.to_string()),
            (Memory::Cuda(_), Some(gpu)) => gpu
                .alloc(len as usize)
                .map(|r| Mem::Cuda(Arc::new(r)))
                .map_err(|e| e.to_string()),
            (Memory::Cuda(d), None) => Err(format!("CUDA device {d} is not open")),
        }
    }

    fn region(&self) -> Arc<dyn Region> {
        match self {
            Mem::Host(r) => r.clone(),
            Mem::Cuda(r) => r.clone(),
        }
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), String> {
        match self {
            Mem::Host(r) => r.write(offset as usize, data).map_err(|e| e.to_string()),
            Mem::Cuda(r) => r.write(offset, data).map_err(|e| e.to_string()),
        }
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), String> {
        match self {
            Mem::Host(r) => r.read(offset as usize, out).map_err(|e| e.to_string()),
            Mem::Cuda(r) => r.read(offset, out).map_err(|e| e.to_string()),
        }
    }
}

/// The registrations of one buffer on one comm, by 1 GiB window (as the poller makes them).
fn register_windows(
    mem: &Mem,
    register: impl Fn(Arc<dyn Region>) -> Result<MemHandle, tcpxd::net::NetError>,
) -> Result<Vec<MemHandle>, String> {
    let region = mem.region();
    let size = region.len() as u64;
    let mut handles = Vec::new();
    let mut start = 0u64;
    while start < size {
        let len = WINDOW_LEN.min(size - start);
        let r: Arc<dyn Region> = if start == 0 && len == size {
            region.clone()
        } else {
            Arc::new(
                RegionWindow::new(region.clone(), start as usize, len as usize).map_err(|e| e.to_string())?,
            )
        };
        handles.push(register(r).map_err(|e| e.to_string())?);
        start += WINDOW_STRIDE;
    }
    Ok(handles)
}

/// The window handle and the offset inside it for a chunk at `offset`.
fn window(handles: &[MemHandle], offset: u64) -> (&MemHandle, usize) {
    let w = (offset / WINDOW_STRIDE) as usize;
    (&handles[w], (offset - w as u64 * WINDOW_STRIDE) as usize)
}

/// One block size for the two threads.
#[derive(Debug, Clone)]
struct Job {
    size: u64,
    ranges: Vec<u64>,
    /// Warm-up plus measured transfers.
    transfers: u32,
    warmup: u32,
    /// Transfers in flight at most.
    depth: u32,
    /// Ranges the transfers rotate over: transfer `k` of the job moves slot `k % slots`, at
    /// `slot × batch × size` on both sides.
    slots: u32,
}

impl Job {
    fn iterations(&self) -> u32 {
        self.transfers - self.warmup
    }

    /// Where the `k`-th transfer of the job starts in both buffers.
    fn slot_base(&self, k: u32) -> u64 {
        u64::from(k % self.slots) * self.ranges.len() as u64 * self.size
    }
}

/// Start times kept per transfer, by transfer number modulo this (twice the deepest queue).
const T0_RING: usize = 2 * crate::bench::MAX_CONCURRENCY as usize;

/// State both threads share. Transfers are numbered from 1 across the whole run.
struct Shared {
    base: Instant,
    /// When the sender began posting transfer `n` (ns since `base`), at `n % T0_RING`.
    t0: Vec<AtomicU64>,
    /// Transfers the sender has started (their chunks are planned): the receiver plans up to
    /// this one.
    started: AtomicU64,
    /// Transfers the receiver has finished (every chunk consumed): the sender keeps
    /// `started - done` within the job's depth.
    done: AtomicU64,
    abort: AtomicBool,
    lanes: u32,
    chunk_bytes: u32,
    spread_min_chunk: u32,
    spread_chunks_per_lane: u32,
    stall: Duration,
}

impl Shared {
    fn set_t0(&self, n: u64, at: Instant) {
        self.t0[n as usize % T0_RING]
            .store(at.duration_since(self.base).as_nanos() as u64, Ordering::Release);
    }

    fn t0(&self, n: u64) -> Instant {
        self.base + Duration::from_nanos(self.t0[n as usize % T0_RING].load(Ordering::Acquire))
    }
}

/// Runs the raw bench. `progress` is told of every finished transfer.
pub fn run_raw(opts: &RawOptions, progress: &indicatif::ProgressBar) -> Result<Vec<BenchRow>, RawError> {
    if opts
        .workload
        .peer_memory
        .is_some_and(|m| m != opts.workload.memory)
    {
        return Err(RawError::Setup {
            what: "--peer-cuda".into(),
            why: "the raw bench runs both sides in one process on one device: drop --peer-cuda".into(),
        });
    }
    let w = &opts.workload;
    w.validate().map_err(RawError::BadOption)?;
    tcpxd::engine::plan::check_chunk_bytes(u64::from(opts.chunk_bytes))
        .map_err(|e| RawError::BadOption(format!("--chunk-bytes: {e}")))?;
    if opts.spread_min_chunk != 0 {
        tcpxd::engine::plan::check_chunk_bytes(u64::from(opts.spread_min_chunk))
            .map_err(|e| RawError::BadOption(format!("--spread-min-chunk-bytes: {e} (or 0: off)")))?;
    }
    let max = tcpxd::engine::plan::MAX_SPREAD_CHUNKS_PER_LANE;
    if !(1..=max).contains(&opts.spread_chunks_per_lane) {
        return Err(RawError::BadOption(format!(
            "--spread-chunks-per-lane: {} is outside 1..={max}",
            opts.spread_chunks_per_lane
        )));
    }
    if !(1..=16).contains(&opts.lanes_per_device) {
        return Err(RawError::BadOption(format!(
            "--lanes-per-device: {} is outside 1..=16",
            opts.lanes_per_device
        )));
    }
    if !(1..=16).contains(&opts.send_window) || !(1..=16).contains(&opts.recv_window) {
        return Err(RawError::BadOption(
            "--send-window and --recv-window must lie in 1..=16 (the plugin's 16 slots)".into(),
        ));
    }
    let plugin = match &opts.plugin {
        Some(path) => Plugin::load(path),
        None => Plugin::builtin_emulation(),
    }
    .map_err(|e| RawError::Setup {
        what: "loading the plugin".into(),
        why: e.to_string(),
    })?;
    let ndev = plugin.devices().len();
    let devices = match &opts.devices {
        Some(list) => {
            if let Some(d) = list.iter().find(|&&d| d < 0 || d as usize >= ndev) {
                return Err(RawError::BadOption(format!(
                    "--device {d} is not one of the plugin's devices (it has {ndev})"
                )));
            }
            list.clone()
        }
        None => (0..ndev as i32).collect(),
    };
    if devices.is_empty() {
        return Err(RawError::Setup {
            what: "the plugin".into(),
            why: "it reports no devices".into(),
        });
    }
    let gpu = match w.memory {
        Memory::Host => None,
        Memory::Cuda(d) => Some(Gpu::open(d as usize).map_err(|e| RawError::Setup {
            what: format!("opening CUDA device {d}"),
            why: e.to_string(),
        })?),
    };

    // The lanes: one comm pair per lane, connected from this thread.
    let lanes = devices.len() as u32 * opts.lanes_per_device;
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    if let Some(g) = &gpu {
        g.bind_to_thread()
            .map_err(|e| setup("binding the GPU")(e.to_string()))?;
    }
    for i in 0..lanes {
        let dev = devices[i as usize % devices.len()];
        let (s, r) = tcpxd::net::loopback_pair(&plugin, dev, opts.connect_timeout)
            .map_err(|e| setup(format!("connecting lane {i} on device {dev}"))(e.to_string()))?;
        sends.push(s);
        recvs.push(r);
    }

    let bytes = w.buffer_bytes();
    let src = Mem::alloc(w.memory, gpu.as_ref(), bytes).map_err(setup("allocating the source"))?;
    let dst = Mem::alloc(w.memory, gpu.as_ref(), bytes).map_err(setup("allocating the destination"))?;
    fill_seeded(&src, bytes).map_err(setup("filling the source"))?;
    let send_handles = sends
        .iter()
        .map(|c| register_windows(&src, |r| c.register(r)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(setup("registering the source"))?;
    let recv_handles = recvs
        .iter()
        .map(|c| register_windows(&dst, |r| c.register(r)))
        .collect::<Result<Vec<_>, _>>()
        .map_err(setup("registering the destination"))?;

    let shared = Arc::new(Shared {
        base: Instant::now(),
        t0: (0..T0_RING).map(|_| AtomicU64::new(0)).collect(),
        started: AtomicU64::new(0),
        done: AtomicU64::new(0),
        abort: AtomicBool::new(false),
        lanes,
        chunk_bytes: opts.chunk_bytes,
        spread_min_chunk: opts.spread_min_chunk,
        spread_chunks_per_lane: opts.spread_chunks_per_lane,
        stall: opts.stall_timeout,
    });
    let (send_jobs, send_rx) = mpsc::channel::<Job>();
    let (recv_jobs, recv_rx) = mpsc::channel::<Job>();
    let (send_done_tx, send_done) = mpsc::channel::<Result<(), String>>();
    let (recv_done_tx, recv_done) = mpsc::channel::<Result<(Vec<Duration>, Duration), String>>();
    let sender = {
        let shared = shared.clone();
        let gpu = gpu.clone();
        let window = opts.send_window;
        std::thread::Builder::new()
            .name("raw-bench-send".into())
            .spawn(move || {
                let mut side = SendSide {
                    comms: sends,
                    handles: send_handles,
                    queues: vec![VecDeque::new(); lanes as usize],
                    tags: vec![Tag::default(); lanes as usize],
                    window,
                    next_lane: 0,
                };
                if let Some(g) = &gpu
                    && let Err(e) = g.bind_to_thread()
                {
                    let _ = send_done_tx.send(Err(e.to_string()));
                    return;
                }
                let mut n = 0u64;
                while let Ok(job) = send_rx.recv() {
                    let r = side.run(&shared, &job, &mut n);
                    if r.is_err() {
                        shared.abort.store(true, Ordering::Release);
                    }
                    let _ = send_done_tx.send(r);
                }
            })
            .map_err(|e| setup("starting the sender thread")(e.to_string()))?
    };
    let receiver = {
        let shared = shared.clone();
        let gpu = gpu.clone();
        let window = opts.recv_window;
        let unpack_impl = opts.unpack_impl;
        let bar = progress.clone();
        let dst = dst.clone();
        std::thread::Builder::new()
            .name("raw-bench-recv".into())
            .spawn(move || {
                let stage = match &gpu {
                    None => Ok(None),
                    Some(g) => GpuStage::new(g.clone(), unpack_impl).map(Some),
                };
                let stage = match stage {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = recv_done_tx.send(Err(e));
                        return;
                    }
                };
                let mut side = RecvSide {
                    comms: recvs,
                    handles: recv_handles,
                    lanes: (0..lanes).map(|_| RecvLane::default()).collect(),
                    window,
                    next_lane: 0,
                    dst,
                    stage,
                    posted_any: false,
                    consumed: Vec::new(),
                };
                let mut n = 0u64;
                while let Ok(job) = recv_rx.recv() {
                    let r = side.run(&shared, &job, &mut n, &bar);
                    if r.is_err() {
                        shared.abort.store(true, Ordering::Release);
                    }
                    let _ = recv_done_tx.send(r);
                }
            })
            .map_err(|e| setup("starting the receiver thread")(e.to_string()))?
    };

    let mut rows = Vec::new();
    let outcome = (|| -> Result<(), RawError> {
        for &size in &w.sizes {
            let span = size * u64::from(w.batch) * u64::from(w.slots());
            progress.set_message(crate::client::format_bytes(size));
            zero(&dst, span).map_err(|why| RawError::Verify { size, why })?;
            let job = Job {
                size,
                ranges: vec![size; w.batch as usize],
                transfers: w.warmup + w.iterations,
                warmup: w.warmup,
                depth: w.concurrency,
                slots: w.slots(),
            };
            let lost = |side| RawError::Transfer {
                side,
                size,
                why: "the thread stopped".into(),
            };
            let cpu = crate::bench::steal::now();
            send_jobs.send(job.clone()).map_err(|_| lost("sender"))?;
            recv_jobs.send(job).map_err(|_| lost("receiver"))?;
            let sent = send_done.recv().map_err(|_| lost("sender"))?;
            let received = recv_done.recv().map_err(|_| lost("receiver"))?;
            // The side that failed first says why; the other only saw the abort.
            let (latencies, wall) = match (sent, received) {
                (Ok(()), Ok(l)) => l,
                (Err(why), _) if !why.contains("the other side stopped") => {
                    return Err(RawError::Transfer {
                        side: "sender",
                        size,
                        why,
                    });
                }
                (_, Err(why)) | (Err(why), Ok(_)) => {
                    return Err(RawError::Transfer {
                        side: "receiver",
                        size,
                        why,
                    });
                }
            };
            let steal = crate::bench::steal::since(cpu);
            verify(&src, &dst, span).map_err(|why| RawError::Verify { size, why })?;
            rows.push(BenchRow {
                harness: Harness::Raw,
                op: w.op,
                memory: w.memory,
                block_size: size,
                batch_size: w.batch,
                iterations: w.iterations,
                warmup: w.warmup,
                latency: LatencyStats::from_samples(&latencies),
                concurrency: w.concurrency,
                wall,
                verified: true,
                chunk_bytes: Some(opts.chunk_bytes),
                lanes: Some(lanes),
                steal,
            });
        }
        Ok(())
    })();
    drop(send_jobs);
    drop(recv_jobs);
    let _ = sender.join();
    let _ = receiver.join();
    outcome.map(|()| rows)
}

fn fill_seeded(mem: &Mem, len: u64) -> Result<(), String> {
    let mut buf = vec![0u8; PIECE.min(len as usize)];
    let mut at = 0u64;
    while at < len {
        let n = (len - at).min(buf.len() as u64) as usize;
        seeded_bytes(SEED, at, &mut buf[..n]);
        mem.write(at, &buf[..n])?;
        at += n as u64;
    }
    Ok(())
}

fn zero(mem: &Mem, len: u64) -> Result<(), String> {
    let buf = vec![0u8; PIECE.min(len as usize)];
    let mut at = 0u64;
    while at < len {
        let n = (len - at).min(buf.len() as u64) as usize;
        mem.write(at, &buf[..n])?;
        at += n as u64;
    }
    Ok(())
}

/// Compares `[0, len)` of both sides; the error names the first differing byte.
fn verify(src: &Mem, dst: &Mem, len: u64) -> Result<(), String> {
    let mut a = vec![0u8; PIECE.min(len as usize)];
    let mut b = vec![0u8; a.len()];
    let mut at = 0u64;
    while at < len {
        let n = (len - at).min(a.len() as u64) as usize;
        src.read(at, &mut a[..n])?;
        dst.read(at, &mut b[..n])?;
        if let Some(i) = a[..n].iter().zip(&b[..n]).position(|(x, y)| x != y) {
            let off = at + i as u64;
            return Err(format!(
                "byte {off} is {:#04x} at the destination, {:#04x} at the source",
                b[i], a[i]
            ));
        }
        at += n as u64;
    }
    Ok(())
}

/// The chunks of the job's `k`-th transfer, queued per lane as (buffer offset, length); advances
/// the first lane as the engine does (the next transfer starts where this one ended).
fn plan_into(
    job: &Job,
    k: u32,
    shared: &Shared,
    next_lane: &mut u32,
    mut push: impl FnMut(usize, u64, u32),
) -> u64 {
    let mut count = 0u64;
    let base = job.slot_base(k);
    // The daemon spreads a transfer only while it is alone on the lanes: one at a time here
    // (with several in flight the others are almost always out).
    let spread_min_chunk = if job.depth <= 1 {
        shared.spread_min_chunk
    } else {
        0
    };
    let chunk_bytes = tcpxd::engine::plan::spread_chunk_bytes(
        &job.ranges,
        shared.chunk_bytes,
        shared.lanes,
        spread_min_chunk,
        shared.spread_chunks_per_lane,
    );
    for c in ChunkPlan::new(&job.ranges, chunk_bytes, *next_lane, 0..shared.lanes) {
        push(
            c.lane as usize,
            base + u64::from(c.range) * job.size + c.offset,
            c.len,
        );
        count += 1;
    }
    *next_lane = ((u64::from(*next_lane) + count) % u64::from(shared.lanes)) as u32;
    count
}
