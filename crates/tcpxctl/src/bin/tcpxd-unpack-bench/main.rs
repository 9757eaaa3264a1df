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
//!
//! This file holds the options, the setup (bounce buffer, shuffled fragment lists, destinations,
//! the check that a chunk landed), the rows' statistics and `main`; `timing.rs` the timed runs of
//! each implementation.

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use tcpxd::gpu::{DeviceRegion, Gpu, PersistConfig, PinnedRegion, Stream};
use tcpxd::net::abi::loadMeta;
use tcpxd::unpack::{FragSource, KernelUnpacker, UnpackImpl};

mod timing;

use timing::{
    pipelined, pipelined_contiguous, time_contiguous, time_gather, time_scatter, time_scatter_kernel,
    time_unpacker,
};

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
