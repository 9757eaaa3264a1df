//! The timed runs: each unpack implementation, the block scatter (poller batches and the kernel
//! alone), the gather, the contiguous copy (the ceiling), and their pipelined (back-to-back)
//! steady states. Each returns its rows; `main.rs` prints them.

use std::time::Instant;

use tcpxd::engine::blocks::Segment;
use tcpxd::gpu::blocks::ScatterTask;
use tcpxd::gpu::{Event, FragmentList, Stream};
use tcpxd::net::abi::loadMeta;
use tcpxd::unpack::block_batch::{BlockBatcher, BlockOp};
use tcpxd::unpack::{UnpackJob, Unpacker};

use super::{Lists, Row, Setup, median, permutation, stats};

pub(super) fn time_unpacker(
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
pub(super) fn time_scatter(
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
pub(super) fn time_scatter_kernel(
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
pub(super) fn time_gather(
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

pub(super) fn time_contiguous(
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

pub(super) fn pipelined(
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

pub(super) fn pipelined_contiguous(
    s: &Setup,
    chunks: usize,
    batches: usize,
) -> Result<Row, Box<dyn std::error::Error>> {
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
