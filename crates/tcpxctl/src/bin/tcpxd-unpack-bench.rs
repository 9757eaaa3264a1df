//! `tcpxd-unpack-bench`: times the unpack implementations against one contiguous device-to-device
//! copy of the same bytes (the ceiling), for batches of 1, 4 and 16 chunks of 512 KiB made of
//! shuffled 4 KiB fragments. GPU times come from CUDA events (warm-up, then the median of the
//! timed iterations). Sources rotate through a 256 MiB bounce buffer and destinations through
//! 8 sets, so the L2 (50 MiB on an H200) does not hold them. The block scatter (a block
//! transfer's receive side) runs on the same chunks and lists, its blocks permuted over the
//! destination (`blocks-scatter-*` rows: the poller's batches; `scatter-kernel-*`: the kernel
//! alone, with or without its completion signal, lists host-mapped or resident). Prints a table
//! and one JSON line per row (also appended to `--out`). Reports only: nothing here asserts a
//! speed.

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use tcpxd::engine::blocks::Segment;
use tcpxd::gpu::blocks::ScatterTask;
use tcpxd::gpu::{DeviceRegion, Event, FragmentList, Gpu, PersistConfig, PinnedRegion, Stream};
use tcpxd::net::abi::loadMeta;
use tcpxd::unpack::block_batch::{BlockBatcher, BlockOp};
use tcpxd::unpack::{FragSource, KernelUnpacker, UnpackImpl, UnpackJob, Unpacker};

#[derive(Parser, Debug)]
#[command(name = "tcpxd-unpack-bench", about = "Time the GPU unpack implementations")]
struct Args {
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Timed iterations per row (the median is reported).
    #[arg(long, default_value_t = 100)]
    iters: usize,
    /// Untimed iterations first.
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    /// Bounce buffer size in MiB.
    #[arg(long, default_value_t = 256)]
    bounce_mib: usize,
    /// Chunk size in KiB.
    #[arg(long, default_value_t = 512)]
    chunk_kib: usize,
    /// Batch sizes (chunks per batch), comma-separated.
    #[arg(long, default_value = "1,4,16", value_delimiter = ',')]
    chunks: Vec<usize>,
    /// Fewer iterations for the slow implementations (d2d, host).
    #[arg(long, default_value_t = 30)]
    slow_iters: usize,
    /// Append the JSON lines to this file.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
    /// Batches per steady-state (pipelined) measurement (0: skip).
    #[arg(long, default_value_t = 64)]
    pipeline: usize,
    /// Only the rows whose name contains this (the contiguous copy always runs), single and
    /// back to back.
    #[arg(long)]
    only: Option<String>,
    /// Also time the block scatter (the receive side of a block transfer: each chunk's fragments
    /// into blocks of this many KiB, permuted over the destination; 0: skip), as the
    /// `blocks-scatter` row.
    #[arg(long, default_value_t = 64)]
    scatter_block_kib: usize,
    /// Also time the checksum kernel over this many MiB (0: skip).
    #[arg(long, default_value_t = 1024)]
    checksum_mib: usize,
}

const PAGE: usize = 4096;

/// How the unpacker is handed each fragment list.
#[derive(Debug, Clone, Copy)]
enum Lists {
    /// The host-mapped ring (as the plugin's netUnpackMeta).
    Mapped,
    /// A host slice only.
    Host,
    /// Already in device memory (no real mode: the floor of the kernel alone).
    Resident,
}
const DST_SETS: usize = 8;

struct Setup {
    gpu: Arc<Gpu>,
    bounce: DeviceRegion,
    /// Per bounce window (one chunk of pages), its shuffled fragment list.
    lists: PinnedRegion,
    /// A device copy of `lists`.
    lists_dev: DeviceRegion,
    frags_per_chunk: usize,
    windows: usize,
    chunk: usize,
    dsts: DeviceRegion,
    max_chunks: usize,
}

struct Row {
    name: String,
    chunks: usize,
    bytes: u64,
    median_us: f64,
    min_us: f64,
    p90_us: f64,
    /// Median host (CPU) time of the batch's `push`es and `submit`.
    host_us: Option<f64>,
    /// Median host-clock time from the first `push` (or the copy's call) until the host has
    /// seen the batch finish, polling as the poller does (`is_done`; an event query for the
    /// copy): the latency the daemon actually gets.
    wall_us: Option<f64>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn rng(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// Shuffles `v` in place (Fisher-Yates) from the generator state `seed`.
fn shuffle<T>(v: &mut [T], seed: &mut u64) {
    for i in (1..v.len()).rev() {
        v.swap(i, (rng(seed) % (i as u64 + 1)) as usize);
    }
}

/// `0..n` in an order shuffled from `seed`.
fn permutation(n: usize, mut seed: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    shuffle(&mut v, &mut seed);
    v
}

impl Setup {
    fn new(a: &Args) -> Result<Setup, Box<dyn std::error::Error>> {
        let gpu = Gpu::open(a.device)?;
        let chunk = a.chunk_kib * 1024;
        let bounce_len = a.bounce_mib << 20;
        let windows = bounce_len / chunk;
        let frags_per_chunk = chunk / PAGE;
        let stream = Stream::new(&gpu)?;
        let bounce = gpu.alloc(bounce_len)?;
        let mut seed = 0x1234_5678_9abc_def1u64;
        bounce.fill_with(&stream, 0, bounce_len as u64, |_, c| {
            for w in c.chunks_mut(8) {
                let v = rng(&mut seed).to_le_bytes();
                w.copy_from_slice(&v[..w.len()]);
            }
        })?;
        let mut lists = gpu.alloc_pinned(windows * frags_per_chunk * 16)?;
        {
            let all = lists.typed_mut::<loadMeta>(0, windows * frags_per_chunk)?;
            for w in 0..windows {
                let l = &mut all[w * frags_per_chunk..(w + 1) * frags_per_chunk];
                // Page i of the chunk comes from a shuffled page of window w, and the list is in
                // shuffled (arrival) order.
                let mut perm: Vec<usize> = (0..frags_per_chunk).collect();
                shuffle(&mut perm, &mut seed);
                for (i, f) in l.iter_mut().enumerate() {
                    *f = loadMeta {
                        src_off: (w * chunk + perm[i] * PAGE) as u32,
                        len: PAGE as u32,
                        dst_off: (i * PAGE) as u64,
                    };
                }
                shuffle(l, &mut seed);
            }
        }
        let lists_dev = gpu.alloc(lists.len())?;
        stream.copy_h2d(&lists_dev, 0, &lists, 0, lists.len() as u64)?;
        stream.synchronize()?;
        let max_chunks = a.chunks.iter().copied().max().unwrap_or(16);
        let dsts = gpu.alloc(DST_SETS * max_chunks * chunk)?;
        Ok(Setup {
            gpu,
            bounce,
            lists,
            lists_dev,
            frags_per_chunk,
            windows,
            chunk,
            dsts,
            max_chunks,
        })
    }

    fn window(&self, iter: usize, chunks: usize, c: usize) -> usize {
        (iter * chunks + c) % self.windows
    }

    fn dst_off(&self, iter: usize, c: usize) -> u64 {
        (((iter % DST_SETS) * self.max_chunks + c) * self.chunk) as u64
    }

    /// Checks chunk `c` of iteration `iter` landed (page i of the chunk = its source page).
    fn verify(
        &self,
        stream: &Stream,
        iter: usize,
        chunks: usize,
        c: usize,
    ) -> Result<bool, Box<dyn std::error::Error>> {
        let w = self.window(iter, chunks, c);
        let list = self
            .lists
            .typed::<loadMeta>(w * self.frags_per_chunk * 16, self.frags_per_chunk)?;
        let mut got = vec![0u8; self.chunk];
        self.dsts.read_into(stream, self.dst_off(iter, c), &mut got)?;
        let mut src = vec![0u8; self.chunk];
        self.bounce.read_into(stream, (w * self.chunk) as u64, &mut src)?;
        let bad: Vec<usize> = list
            .iter()
            .enumerate()
            .filter(|(_, f)| {
                let s = f.src_off as usize - w * self.chunk;
                let d = f.dst_off as usize;
                got[d..d + PAGE] != src[s..s + PAGE]
            })
            .map(|(i, _)| i)
            .collect();
        if !bad.is_empty() {
            let zero = bad
                .iter()
                .filter(|&&i| got[list[i].dst_off as usize..][..PAGE].iter().all(|&b| b == 0))
                .count();
            eprintln!(
                "iteration {iter} chunk {c}: {} of {} pages wrong ({zero} all zero), list positions {:?}",
                bad.len(),
                list.len(),
                &bad[..bad.len().min(16)]
            );
        }
        Ok(bad.is_empty())
    }
}

fn stats(name: &str, chunks: usize, bytes: u64, mut us: Vec<f64>) -> Row {
    us.sort_by(|a, b| a.total_cmp(b));
    let pick = |q: f64| us[((us.len() - 1) as f64 * q).round() as usize];
    Row {
        name: name.to_string(),
        chunks,
        bytes,
        median_us: pick(0.5),
        min_us: us[0],
        p90_us: pick(0.9),
        host_us: None,
        wall_us: None,
    }
}

fn time_unpacker(
    s: &Setup,
    u: &mut dyn Unpacker,
    label: &str,
    chunks: usize,
    warmup: usize,
    iters: usize,
    lists: Lists,
) -> Result<Row, Box<dyn std::error::Error>> {
    let start = Event::timing(&s.gpu)?;
    let end = Event::timing(&s.gpu)?;
    let mut times = Vec::with_capacity(iters);
    let mut host = Vec::with_capacity(iters);
    let mut last = 0;
    // A persistent grid occupies its stream, so events on it would wait for the grid to leave:
    // its times are host-clock times (first push to `is_done`), which include everything.
    let persistent = u.name() == "kernel-persistent";
    // GPU time: events around the pushes and the submit (nothing else between them, so the
    // host's share delays the GPU exactly as in the poller).
    for it in (0..warmup + iters).filter(|_| !persistent) {
        u.stream().record(&start)?;
        let t0 = Instant::now();
        push_batch(s, u, it, chunks, lists)?;
        let t = u.submit()?.ok_or("no ticket")?;
        let t1 = Instant::now();
        u.stream().record(&end)?;
        end.synchronize()?;
        if !u.is_done(&t)? {
            u.wait(&t)?;
        }
        if it >= warmup {
            times.push(f64::from(start.elapsed_ms(&end)?) * 1000.0);
            host.push((t1 - t0).as_secs_f64() * 1e6);
        }
        last = it;
    }
    let stream = Stream::new(&s.gpu)?;
    for c in [0, chunks - 1].into_iter().filter(|_| !persistent) {
        if !s.verify(&stream, last, chunks, c)? {
            return Err(format!("{label}: wrong bytes in chunk {c}").into());
        }
    }
    // Wall time: the host clock from the first push until `is_done` says so.
    let mut wall = Vec::with_capacity(iters);
    for it in 0..warmup + iters {
        let t0 = Instant::now();
        push_batch(s, u, it, chunks, lists)?;
        let t = u.submit()?.ok_or("no ticket")?;
        let t1 = Instant::now();
        while !u.is_done(&t)? {
            std::hint::spin_loop();
        }
        if it >= warmup {
            wall.push(t0.elapsed().as_secs_f64() * 1e6);
            if persistent {
                host.push((t1 - t0).as_secs_f64() * 1e6);
            }
        }
        last = it;
    }
    if persistent {
        for c in [0, chunks - 1] {
            if !s.verify(&stream, last, chunks, c)? {
                return Err(format!("{label}: wrong bytes in chunk {c}").into());
            }
        }
        times = wall.clone();
    }
    let mut row = stats(label, chunks, (chunks * s.chunk) as u64, times);
    row.host_us = Some(median(host));
    row.wall_us = Some(median(wall));
    Ok(row)
}

/// The block scatter's batches (`BlockBatcher`, as the poller drives it for a block transfer's
/// receives): the same chunks and fragment lists as the unpack rows, each chunk's wire bytes
/// landing in `block`-byte blocks at permuted places of the batch's destination set. GPU time
/// from events around the pushes and the submit; wall time from the first push until `is_done`.
fn time_scatter(
    s: &Setup,
    chunks: usize,
    block: usize,
    inline: bool,
    warmup: usize,
    iters: usize,
) -> Result<Row, Box<dyn std::error::Error>> {
    let mut b = BlockBatcher::new(&s.gpu, BlockOp::Scatter)?;
    b.set_inline(inline);
    let per_chunk = s.chunk / block;
    let perm = permutation(s.max_chunks * per_chunk, 0x9e37_79b9_7f4a_7c15u64);
    let mut table = Vec::with_capacity(per_chunk);
    let push = |b: &mut BlockBatcher, it: usize| -> Result<(), Box<dyn std::error::Error>> {
        let set = s.dst_off(it, 0);
        for c in 0..chunks {
            let w = s.window(it, chunks, c);
            let frags = s.lists.span().sub(
                (w * s.frags_per_chunk * 16) as u64,
                (s.frags_per_chunk * 16) as u64,
            )?;
            table.clear();
            table.extend((0..per_chunk).map(|k| Segment {
                offset: set + (perm[c * per_chunk + k] * block) as u64,
                wire: (k * block) as u32,
                len: block as u32,
            }));
            let task = ScatterTask::unplaced(
                frags,
                s.frags_per_chunk as u32,
                s.bounce.span(),
                per_chunk as u32,
                s.chunk as u32,
                s.dsts.span(),
            )?;
            b.push_scatter(task, s.frags_per_chunk as u32, &table)?;
        }
        Ok(())
    };
    let label = format!(
        "blocks-scatter-{}K{}",
        block / 1024,
        if inline { "" } else { "-arena" }
    );
    time_batches(s, &mut b, &label, chunks, warmup, iters, push)
}

/// The scatter kernel launched directly (tables uploaded once into device memory), by events
/// only: `signal` with or without its completion signal, `resident` with the fragment lists in
/// device memory instead of host-mapped. Where the batch path's time goes.
fn time_scatter_kernel(
    s: &Setup,
    chunks: usize,
    block: usize,
    signal: bool,
    resident: bool,
    iters: usize,
) -> Result<Row, Box<dyn std::error::Error>> {
    use tcpxd::gpu::blocks::BlockSignal;
    let kernels = s.gpu.kernels()?;
    let stream = Stream::new(&s.gpu)?;
    let per_chunk = s.chunk / block;
    let segs: Vec<Segment> = (0..chunks * per_chunk)
        .map(|i| Segment {
            offset: (((i * 7919) % (chunks * per_chunk)) * block) as u64,
            wire: ((i % per_chunk) * block) as u32,
            len: block as u32,
        })
        .collect();
    let mut pinned = s.gpu.alloc_pinned(segs.len() * 16)?;
    pinned.typed_mut::<Segment>(0, segs.len())?.copy_from_slice(&segs);
    let table = s.gpu.alloc(segs.len() * 16)?;
    stream.copy_h2d(&table, 0, &pinned, 0, (segs.len() * 16) as u64)?;
    stream.synchronize()?;
    let err = s.gpu.alloc_pinned(8)?;
    let (counter, word) = (s.gpu.alloc(4)?, s.gpu.alloc_pinned(8)?);
    let tasks = |it: usize| -> Result<Vec<ScatterTask>, Box<dyn std::error::Error>> {
        (0..chunks)
            .map(|c| {
                let w = s.window(it, chunks, c);
                let (off, len) = (
                    (w * s.frags_per_chunk * 16) as u64,
                    (s.frags_per_chunk * 16) as u64,
                );
                let frags = if resident {
                    s.lists_dev.subspan(off, len)?
                } else {
                    s.lists.span().sub(off, len)?
                };
                let t = ScatterTask::new(
                    frags,
                    s.frags_per_chunk as u32,
                    s.bounce.span(),
                    table.subspan((c * per_chunk * 16) as u64, (per_chunk * 16) as u64)?,
                    per_chunk as u32,
                    s.chunk as u32,
                    s.dsts.span(),
                )?;
                Ok(t)
            })
            .collect()
    };
    let start = Event::timing(&s.gpu)?;
    let end = Event::timing(&s.gpu)?;
    let mut times = Vec::new();
    for it in 0..10 + iters {
        let ts = tasks(it)?;
        let sig = if signal {
            BlockSignal::new(&counter, &word, 0, it as u64 + 1)?
        } else {
            BlockSignal::NONE
        };
        stream.record(&start)?;
        s.gpu.launch_scatter_blocks(
            &kernels,
            &stream,
            &ts,
            (s.frags_per_chunk as u32).div_ceil(8),
            &err,
            0,
            sig,
        )?;
        stream.record(&end)?;
        end.synchronize()?;
        if it >= 10 {
            times.push(f64::from(start.elapsed_ms(&end)?) * 1000.0);
        }
    }
    let label = format!(
        "scatter-kernel-{}K{}{}",
        block / 1024,
        if signal { "-signal" } else { "" },
        if resident { "-resident" } else { "" }
    );
    Ok(stats(&label, chunks, (chunks * s.chunk) as u64, times))
}

/// The gather's batches (`BlockBatcher`, a block transfer's send side): each chunk gathered from
/// `block`-byte blocks at permuted places of a destination set (as the source) into its own
/// staging slot (a bounce window). GPU time from events around the pushes and the submit; wall
/// time from the first push until `is_done`.
fn time_gather(
    s: &Setup,
    chunks: usize,
    block: usize,
    warmup: usize,
    iters: usize,
) -> Result<Row, Box<dyn std::error::Error>> {
    use tcpxd::gpu::blocks::GatherTask;
    let mut b = BlockBatcher::new(&s.gpu, BlockOp::Gather)?;
    let per_chunk = s.chunk / block;
    let perm = permutation(s.max_chunks * per_chunk, 0x2545_f491_4f6c_dd1du64);
    let mut table = Vec::with_capacity(per_chunk);
    let push = |b: &mut BlockBatcher, it: usize| -> Result<(), Box<dyn std::error::Error>> {
        let set = s.dst_off(it, 0);
        for c in 0..chunks {
            let w = s.window(it, chunks, c);
            table.clear();
            table.extend((0..per_chunk).map(|k| Segment {
                offset: set + (perm[c * per_chunk + k] * block) as u64,
                wire: (k * block) as u32,
                len: block as u32,
            }));
            let slot = s.bounce.subspan((w * s.chunk) as u64, s.chunk as u64)?;
            let task = GatherTask::unplaced(per_chunk as u32, s.dsts.span(), slot, s.chunk as u32)?;
            b.push_gather(task, s.chunk as u32, &table)?;
        }
        Ok(())
    };
    let label = format!("blocks-gather-{}K", block / 1024);
    time_batches(s, &mut b, &label, chunks, warmup, iters, push)
}

/// Times a block batcher's batches of `chunks` chunks, each queued by `push(batcher,
/// iteration)`: GPU time from events around the pushes and the submit (host time of those
/// apart), then wall time from the first push until `is_done`, as the poller sees it.
fn time_batches(
    s: &Setup,
    b: &mut BlockBatcher,
    label: &str,
    chunks: usize,
    warmup: usize,
    iters: usize,
    mut push: impl FnMut(&mut BlockBatcher, usize) -> Result<(), Box<dyn std::error::Error>>,
) -> Result<Row, Box<dyn std::error::Error>> {
    let start = Event::timing(&s.gpu)?;
    let end = Event::timing(&s.gpu)?;
    let (mut times, mut host, mut wall) = (Vec::new(), Vec::new(), Vec::new());
    for it in 0..warmup + iters {
        b.stream().record(&start)?;
        let t0 = Instant::now();
        push(b, it)?;
        let t = b.submit()?.ok_or("no ticket")?;
        let t1 = Instant::now();
        b.stream().record(&end)?;
        end.synchronize()?;
        b.wait(&t)?;
        if it >= warmup {
            times.push(f64::from(start.elapsed_ms(&end)?) * 1000.0);
            host.push((t1 - t0).as_secs_f64() * 1e6);
        }
    }
    for it in 0..warmup + iters {
        let t0 = Instant::now();
        push(b, it)?;
        let t = b.submit()?.ok_or("no ticket")?;
        while !b.is_done(&t)? {
            std::hint::spin_loop();
        }
        if it >= warmup {
            wall.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    let mut row = stats(label, chunks, (chunks * s.chunk) as u64, times);
    row.host_us = Some(median(host));
    row.wall_us = Some(median(wall));
    Ok(row)
}

fn time_contiguous(
    s: &Setup,
    chunks: usize,
    warmup: usize,
    iters: usize,
) -> Result<Row, Box<dyn std::error::Error>> {
    let stream = Stream::new(&s.gpu)?;
    let start = Event::timing(&s.gpu)?;
    let end = Event::timing(&s.gpu)?;
    let done = Event::new(&s.gpu)?;
    let bytes = (chunks * s.chunk) as u64;
    let window = |it: usize| ((it * chunks) % (s.windows - chunks + 1)) * s.chunk;
    let mut times = Vec::with_capacity(iters);
    for it in 0..warmup + iters {
        stream.record(&start)?;
        stream.copy_d2d(&s.dsts, s.dst_off(it, 0), &s.bounce, window(it) as u64, bytes)?;
        stream.record(&end)?;
        end.synchronize()?;
        if it >= warmup {
            times.push(f64::from(start.elapsed_ms(&end)?) * 1000.0);
        }
    }
    let mut wall = Vec::with_capacity(iters);
    for it in 0..warmup + iters {
        let t0 = Instant::now();
        stream.copy_d2d(&s.dsts, s.dst_off(it, 0), &s.bounce, window(it) as u64, bytes)?;
        stream.record(&done)?;
        while !done.is_done()? {
            std::hint::spin_loop();
        }
        if it >= warmup {
            wall.push(t0.elapsed().as_secs_f64() * 1e6);
        }
    }
    let mut row = stats("contiguous-d2d", chunks, bytes, times);
    row.wall_us = Some(median(wall));
    Ok(row)
}

fn push_batch(
    s: &Setup,
    u: &mut dyn Unpacker,
    it: usize,
    chunks: usize,
    lists: Lists,
) -> Result<(), Box<dyn std::error::Error>> {
    for c in 0..chunks {
        let w = s.window(it, chunks, c);
        let off = w * s.frags_per_chunk * 16;
        let host = s.lists.typed::<loadMeta>(off, s.frags_per_chunk)?;
        let frags = match lists {
            Lists::Mapped => FragmentList::from_pinned(&s.lists, off, s.frags_per_chunk)?,
            Lists::Host => FragmentList::host(host),
            Lists::Resident => FragmentList::from_device(host, &s.lists_dev, off as u64)?,
        };
        u.push(&UnpackJob {
            frags,
            bounce: s.bounce.span(),
            dst: s.dsts.subspan(s.dst_off(it, c), s.chunk as u64)?,
            exact: true,
        })?;
    }
    Ok(())
}

const PIPE_REPS: usize = 7;

fn pipelined(
    s: &Setup,
    u: &mut dyn Unpacker,
    label: &str,
    chunks: usize,
    batches: usize,
    lists: Lists,
) -> Result<Row, Box<dyn std::error::Error>> {
    let start = Event::timing(&s.gpu)?;
    let end = Event::timing(&s.gpu)?;
    let mut per_batch = Vec::new();
    if u.name() == "kernel-persistent" {
        // Host clock (see time_unpacker): first push to the last batch seen done.
        for rep in 0..=PIPE_REPS {
            let t0 = Instant::now();
            let mut last = None;
            for b in 0..batches {
                push_batch(s, u, rep * batches + b, chunks, lists)?;
                last = u.submit()?;
            }
            let last = last.ok_or("no ticket")?;
            while !u.is_done(&last)? {
                std::hint::spin_loop();
            }
            if rep > 0 {
                per_batch.push(t0.elapsed().as_secs_f64() * 1e6 / batches as f64);
            }
        }
        return Ok(stats(label, chunks, (chunks * s.chunk) as u64, per_batch));
    }
    for rep in 0..=PIPE_REPS {
        u.stream().record(&start)?;
        for b in 0..batches {
            push_batch(s, u, rep * batches + b, chunks, lists)?;
            u.submit()?;
        }
        u.stream().record(&end)?;
        end.synchronize()?;
        if rep > 0 {
            per_batch.push(f64::from(start.elapsed_ms(&end)?) * 1000.0 / batches as f64);
        }
    }
    Ok(stats(label, chunks, (chunks * s.chunk) as u64, per_batch))
}

fn pipelined_contiguous(s: &Setup, chunks: usize, batches: usize) -> Result<Row, Box<dyn std::error::Error>> {
    let stream = Stream::new(&s.gpu)?;
    let start = Event::timing(&s.gpu)?;
    let end = Event::timing(&s.gpu)?;
    let bytes = (chunks * s.chunk) as u64;
    let mut per_batch = Vec::new();
    for rep in 0..=PIPE_REPS {
        stream.record(&start)?;
        for b in 0..batches {
            let it = rep * batches + b;
            let w = (it * chunks) % (s.windows - chunks + 1);
            stream.copy_d2d(&s.dsts, s.dst_off(it, 0), &s.bounce, (w * s.chunk) as u64, bytes)?;
        }
        stream.record(&end)?;
        end.synchronize()?;
        if rep > 0 {
            per_batch.push(f64::from(start.elapsed_ms(&end)?) * 1000.0 / batches as f64);
        }
    }
    Ok(stats("contiguous-d2d/pipe", chunks, bytes, per_batch))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let a = Args::parse();
    let s = Setup::new(&a)?;
    let kernels = s.gpu.kernels()?;
    println!(
        "device {}: {} (cc {}.{}, {} SMs); kernels: {:?}",
        a.device,
        s.gpu.name(),
        s.gpu.compute_capability().0,
        s.gpu.compute_capability().1,
        s.gpu.sm_count(),
        kernels.source()
    );
    println!(
        "bounce {} MiB, chunks of {} KiB = {} fragments of 4 KiB, {} warm-up + {} timed iterations (d2d/host: {})",
        a.bounce_mib, a.chunk_kib, s.frags_per_chunk, a.warmup, a.iters, a.slow_iters
    );

    let mut rows: Vec<Row> = Vec::new();
    for &chunks in &a.chunks {
        rows.push(time_contiguous(&s, chunks, a.warmup, a.iters)?);
        let variants: [(&str, UnpackImpl, Lists, u32); 12] = [
            (
                "kernel-mapped-serial",
                UnpackImpl::Kernel(FragSource::Mapped),
                Lists::Mapped,
                1,
            ),
            (
                "kernel-persistent",
                UnpackImpl::Persistent(PersistConfig::default()),
                Lists::Mapped,
                1,
            ),
            (
                "kernel-persistent-2x",
                UnpackImpl::Persistent(PersistConfig {
                    blocks: 2 * s.gpu.sm_count(),
                    ..PersistConfig::default()
                }),
                Lists::Mapped,
                1,
            ),
            (
                "kernel-packed-mapped",
                UnpackImpl::Kernel(FragSource::PackedMapped),
                Lists::Mapped,
                1,
            ),
            (
                "kernel-packed-device",
                UnpackImpl::Kernel(FragSource::PackedDevice),
                Lists::Mapped,
                1,
            ),
            (
                "kernel-params",
                UnpackImpl::Kernel(FragSource::Params),
                Lists::Mapped,
                1,
            ),
            (
                "kernel-device",
                UnpackImpl::Kernel(FragSource::DeviceCopy),
                Lists::Mapped,
                1,
            ),
            (
                "kernel-mapped",
                UnpackImpl::Kernel(FragSource::Mapped),
                Lists::Mapped,
                1,
            ),
            (
                "kernel-hostlist",
                UnpackImpl::Kernel(FragSource::Mapped),
                Lists::Host,
                1,
            ),
            (
                "kernel-resident",
                UnpackImpl::Kernel(FragSource::Mapped),
                Lists::Resident,
                1,
            ),
            ("d2d", UnpackImpl::D2d, Lists::Mapped, 1),
            ("host", UnpackImpl::Host, Lists::Mapped, 1),
        ];
        let block = a.scatter_block_kib * 1024;
        if block > 0 && s.chunk % block == 0 && a.only.as_deref().is_none_or(|o| "blocks-scatter".contains(o))
        {
            for inline in [true, false] {
                rows.push(time_scatter(&s, chunks, block, inline, a.warmup, a.iters)?);
            }
            rows.push(time_gather(&s, chunks, block, a.warmup, a.iters)?);
            for (signal, resident) in [(false, false), (true, false), (false, true), (true, true)] {
                rows.push(time_scatter_kernel(&s, chunks, block, signal, resident, a.iters)?);
            }
        }
        for (label, imp, mapped, fpw) in variants {
            if a.only.as_deref().is_some_and(|o| !label.contains(o)) {
                continue;
            }
            let iters = if matches!(imp, UnpackImpl::D2d | UnpackImpl::Host) {
                a.slow_iters
            } else {
                a.iters
            };
            let row = match imp {
                UnpackImpl::Persistent(config) => {
                    let mut k = KernelUnpacker::persistent(&s.gpu, config)?;
                    let mut row =
                        time_unpacker(&s, &mut k, "kernel-persistent", chunks, a.warmup, iters, mapped)?;
                    row.name = label.to_string();
                    eprintln!("{label}: {:?} grid launches", k.grid_launches());
                    row
                }
                UnpackImpl::Kernel(src) => {
                    let mut k = KernelUnpacker::new(&s.gpu, src)?;
                    k.set_frags_per_warp(fpw);
                    // `-serial`: without the programmatic dependent launch.
                    k.set_overlap(!label.ends_with("-serial"));
                    time_unpacker(&s, &mut k, label, chunks, a.warmup, iters, mapped)?
                }
                other => {
                    let mut u = other.build(&s.gpu)?;
                    time_unpacker(&s, u.as_mut(), label, chunks, a.warmup.min(3), iters, mapped)?
                }
            };
            rows.push(row);
        }
    }

    // Steady state: `--pipeline` batches submitted back to back (as the poller does while
    // receives keep completing), time per batch.
    if a.pipeline > 0 {
        for &chunks in &a.chunks {
            rows.push(pipelined_contiguous(&s, chunks, a.pipeline)?);
            for (label, src, lists) in [
                ("kernel-mapped-serial/pipe", FragSource::Mapped, Lists::Mapped),
                ("kernel-params/pipe", FragSource::Params, Lists::Mapped),
                (
                    "kernel-packed-mapped/pipe",
                    FragSource::PackedMapped,
                    Lists::Mapped,
                ),
                (
                    "kernel-packed-device/pipe",
                    FragSource::PackedDevice,
                    Lists::Mapped,
                ),
                ("kernel-device/pipe", FragSource::DeviceCopy, Lists::Mapped),
                ("kernel-mapped/pipe", FragSource::Mapped, Lists::Mapped),
                ("kernel-resident/pipe", FragSource::Mapped, Lists::Resident),
            ] {
                if a.only.as_deref().is_some_and(|o| !label.contains(o)) {
                    continue;
                }
                let mut k = KernelUnpacker::new(&s.gpu, src)?;
                k.set_overlap(!label.contains("-serial"));
                rows.push(pipelined(&s, &mut k, label, chunks, a.pipeline, lists)?);
            }
            for (label, blocks) in [
                ("kernel-persistent/pipe", 0),
                ("kernel-persistent-2x/pipe", 2 * s.gpu.sm_count()),
            ] {
                if a.only.as_deref().is_some_and(|o| !label.contains(o)) {
                    continue;
                }
                let mut k = KernelUnpacker::persistent(
                    &s.gpu,
                    PersistConfig {
                        blocks,
                        ..PersistConfig::default()
                    },
                )?;
                rows.push(pipelined(&s, &mut k, label, chunks, a.pipeline, Lists::Mapped)?);
            }
        }
    }

    let mut out = match &a.out {
        Some(p) => Some(std::fs::OpenOptions::new().create(true).append(true).open(p)?),
        None => None,
    };
    println!();
    println!(
        "{:<24} {:>6} {:>10} {:>10} {:>10} {:>9} {:>12} {:>8} {:>8}",
        "impl", "chunks", "median_us", "p90_us", "GB/s", "x contig", "vs kernel", "host_us", "wall_us"
    );
    for r in &rows {
        let contig_name = if r.name.ends_with("/pipe") {
            "contiguous-d2d/pipe"
        } else {
            "contiguous-d2d"
        };
        let kernel_name = if r.name.ends_with("/pipe") {
            "kernel-mapped/pipe"
        } else {
            "kernel-mapped"
        };
        let contig = rows
            .iter()
            .find(|c| c.name == contig_name && c.chunks == r.chunks)
            .map_or(f64::NAN, |c| c.median_us);
        let kernel = rows
            .iter()
            .find(|c| c.name == kernel_name && c.chunks == r.chunks)
            .map_or(f64::NAN, |c| c.median_us);
        let gbps = r.bytes as f64 / (r.median_us * 1e3);
        let opt = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}"));
        println!(
            "{:<24} {:>6} {:>10.1} {:>10.1} {:>10.1} {:>9.2} {:>11.1}x {:>8} {:>8}",
            r.name,
            r.chunks,
            r.median_us,
            r.p90_us,
            gbps,
            r.median_us / contig,
            r.median_us / kernel,
            opt(r.host_us),
            opt(r.wall_us)
        );
        let json = serde_json::json!({
            "bench": "unpack",
            "device": s.gpu.name(),
            "impl": r.name,
            "chunks": r.chunks,
            "chunk_bytes": s.chunk,
            "bytes": r.bytes,
            "median_us": r.median_us,
            "min_us": r.min_us,
            "p90_us": r.p90_us,
            "gbps": gbps,
            "ratio_to_contiguous": r.median_us / contig,
            "ratio_to_kernel": r.median_us / kernel,
            "host_us": r.host_us,
            "wall_us": r.wall_us,
        });
        if let Some(f) = out.as_mut() {
            writeln!(f, "{json}")?;
        }
        eprintln!("{json}");
    }

    if a.checksum_mib > 0 {
        let stream = Stream::new(&s.gpu)?;
        let len = (a.checksum_mib as u64) << 20;
        let r = s.gpu.alloc(len as usize)?;
        r.fill_with(&stream, 0, len, |pos, c| tcpxd::buffers::seeded_bytes(1, pos, c))?;
        let mut kernel_ms = Vec::new();
        let mut crc = 0;
        for _ in 0..5 {
            let t = Instant::now();
            crc = r.crc32c(&stream, 0, len)?;
            kernel_ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        kernel_ms.sort_by(|a, b| a.total_cmp(b));
        let host_len = len.min(256 << 20);
        let t = Instant::now();
        let host_crc = r.crc32c_via_host(&stream, 0, host_len)?;
        let host_ms = t.elapsed().as_secs_f64() * 1e3;
        let check = r.crc32c(&stream, 0, host_len)? == host_crc;
        let gib = len as f64 / (1u64 << 30) as f64;
        let host_gib = host_len as f64 / (1u64 << 30) as f64;
        println!();
        println!(
            "checksum: kernel {:.2} ms per GiB (median of 5 over {} MiB, crc {crc:#010x}); D2H + host crc32c {:.1} ms per GiB; agree: {check}",
            kernel_ms[2] / gib,
            a.checksum_mib,
            host_ms / host_gib
        );
        let json = serde_json::json!({
            "bench": "checksum", "device": s.gpu.name(), "bytes": len,
            "kernel_ms_per_gib": kernel_ms[2] / gib, "via_host_ms_per_gib": host_ms / host_gib, "agree": check,
        });
        if let Some(f) = out.as_mut() {
            writeln!(f, "{json}")?;
        }
        eprintln!("{json}");
    }
    Ok(())
}
