//! Benchmarks that can be compared row by row: the same sizes, iterations and output for the
//! raw plugin path ([`raw`]: the engine's chunking, windows and unpack driven directly, no daemon)
//! and the service path ([`daemon`]: two daemons driven through the client API).
//!
//! Each measured size gives one [`BenchRow`]: printed as a table with nixlbench-like columns
//! ([`rows_table`]) and written as one JSON object per line ([`BenchRow::to_json`]).

pub mod blocks;
pub mod daemon;
pub mod local_session;
pub mod raw;
pub mod steal;

use std::time::Duration;

use serde_json::{Value, json};

use crate::cli::output::Table;
use crate::client::format_bytes;

/// The smallest block size by default (4 KiB).
pub const DEFAULT_MIN_SIZE: u64 = 4 << 10;
/// The largest block size by default (256 MiB).
pub const DEFAULT_MAX_SIZE: u64 = 256 << 20;
/// The default factor between block sizes.
pub const DEFAULT_STEP: u64 = 4;
/// The seed the sources are filled with.
pub const SEED: u64 = 0x7c9d_5eed;
/// Most bytes one buffer of a run may hold (block size × batch size).
pub const MAX_BUFFER_BYTES: u64 = 16 << 30;

/// WRITE (local → remote) or READ (remote → local).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Op {
    Write,
    Read,
}

impl Op {
    pub fn name(self) -> &'static str {
        match self {
            Op::Write => "WRITE",
            Op::Read => "READ",
        }
    }
}

/// Where the benchmark's buffers live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Memory {
    Host,
    /// CUDA device memory on this ordinal (both sides).
    Cuda(u32),
}

impl Memory {
    pub fn name(self) -> String {
        match self {
            Memory::Host => "host".to_string(),
            Memory::Cuda(d) => format!("cuda:{d}"),
        }
    }
}

/// Which harness measured a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Harness {
    /// The plugin driven directly, in one process (`tcpxctl bench raw`).
    Raw,
    /// Two daemons through the client API (`tcpxctl bench transfer`), the transfers on a gRPC
    /// `Session` stream.
    Daemon,
    /// The same, the transfers on a framed local session (`--via local`: the API unix socket
    /// without HTTP/2, as the Python package's client sends them).
    DaemonLocal,
}

impl Harness {
    pub fn name(self) -> &'static str {
        match self {
            Harness::Raw => "raw",
            Harness::Daemon => "daemon",
            Harness::DaemonLocal => "daemon-local",
        }
    }
}

/// What both harnesses measure: the block sizes, the batch and the iterations.
#[derive(Debug, Clone)]
pub struct Workload {
    pub op: Op,
    pub memory: Memory,
    /// The peer side's memory when it differs from `memory` (the daemon harness only: one
    /// daemon per GPU).
    pub peer_memory: Option<Memory>,
    /// Block sizes (bytes per entry), in the order they run.
    pub sizes: Vec<u64>,
    /// Entries per transfer: one transfer moves `batch` blocks, block `i` at offset `i * size`.
    pub batch: u32,
    /// Measured transfers per size.
    pub iterations: u32,
    /// Unmeasured transfers per size before the measured ones.
    pub warmup: u32,
    /// Transfers in flight at once (a queue depth): transfer `k` uses slot `k % concurrency`,
    /// its own range of `batch × size` bytes at `slot × batch × size` on both sides.
    pub concurrency: u32,
}

/// Most transfers a run keeps in flight.
pub const MAX_CONCURRENCY: u32 = 64;

/// Whether a harness may start transfer `next` of a size (0-based, warm-up first) while
/// `in_flight` earlier ones are unfinished: at most `depth` in flight, and the first measured
/// transfer only once every one of the `warmup` transfers has finished. Without the second rule
/// a queue deeper than the warm-up (8 in flight, 5 warm-up) starts measured transfers together
/// with the first warm-up ones, so they carry every one-time cost of the run's start (a GPU
/// unpack stage built on first use, its kernels compiled by NVRTC: 75–80 ms on the H100).
pub fn may_start(next: u32, in_flight: u32, depth: u32, warmup: u32) -> bool {
    in_flight < depth.max(1) && (next != warmup || in_flight == 0)
}

impl Workload {
    /// Bytes each side's buffer needs.
    pub fn buffer_bytes(&self) -> u64 {
        self.sizes.iter().copied().max().unwrap_or(0) * u64::from(self.batch) * u64::from(self.slots())
    }

    /// Slots the transfers of one size use: each its own range (fewer than `concurrency` when
    /// a size runs fewer transfers).
    pub fn slots(&self) -> u32 {
        self.concurrency.clamp(1, (self.warmup + self.iterations).max(1))
    }

    /// Checks the limits; the message names the option at fault.
    pub fn validate(&self) -> Result<(), String> {
        if self.sizes.is_empty() {
            return Err("--sizes: no block size to run".into());
        }
        if let Some(z) = self.sizes.iter().find(|&&s| s == 0) {
            return Err(format!("--sizes: block size {z} must be at least 1 byte"));
        }
        if !(1..=65_536).contains(&self.batch) {
            return Err(format!(
                "--batch: {} is outside 1..=65536 (the API's entries per request)",
                self.batch
            ));
        }
        if self.iterations == 0 {
            return Err("--iters: at least one measured iteration is needed".into());
        }
        if !(1..=MAX_CONCURRENCY).contains(&self.concurrency) {
            return Err(format!(
                "--concurrency: {} is outside 1..={MAX_CONCURRENCY}",
                self.concurrency
            ));
        }
        let need = self
            .sizes
            .iter()
            .map(|&s| s.checked_mul(u64::from(self.batch) * u64::from(self.slots())))
            .try_fold(0u64, |m, s| s.map(|s| m.max(s)));
        match need {
            Some(n) if n <= MAX_BUFFER_BYTES => Ok(()),
            _ => Err(format!(
                "--max × --batch × --concurrency: each side's buffer would exceed {} (largest block size × batch size × transfers in flight)",
                format_bytes(MAX_BUFFER_BYTES)
            )),
        }
    }
}

/// Block sizes from `min` to `max`, multiplying by `step` (`max` itself is always included).
pub fn size_steps(min: u64, max: u64, step: u64) -> Result<Vec<u64>, String> {
    if min == 0 {
        return Err("--min: the smallest block size must be at least 1 byte".into());
    }
    if max < min {
        return Err(format!("--max ({max}) is below --min ({min})"));
    }
    if step < 2 {
        return Err(format!(
            "--step: the factor between sizes must be at least 2, got {step}"
        ));
    }
    let mut sizes = Vec::new();
    let mut s = min;
    while s < max {
        sizes.push(s);
        match s.checked_mul(step) {
            Some(n) => s = n,
            None => break,
        }
    }
    sizes.push(max);
    Ok(sizes)
}

/// Latency statistics of the measured iterations of one size.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyStats {
    pub avg: Duration,
    pub p50: Duration,
    pub p99: Duration,
    pub min: Duration,
    pub max: Duration,
    /// Sum of the latencies: the time the measured transfers took back to back.
    pub total: Duration,
}

impl LatencyStats {
    /// Nearest-rank percentiles over `samples` (which must not be empty).
    pub fn from_samples(samples: &[Duration]) -> LatencyStats {
        assert!(!samples.is_empty(), "no samples");
        let mut sorted = samples.to_vec();
        sorted.sort_unstable();
        let total: Duration = sorted.iter().sum();
        let rank = |p: f64| {
            let r = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
            sorted[r.clamp(1, sorted.len()) - 1]
        };
        LatencyStats {
            avg: total / sorted.len() as u32,
            p50: rank(50.0),
            p99: rank(99.0),
            min: sorted[0],
            max: sorted[sorted.len() - 1],
            total,
        }
    }
}

/// One measured block size.
#[derive(Debug, Clone)]
pub struct BenchRow {
    pub harness: Harness,
    pub op: Op,
    pub memory: Memory,
    pub block_size: u64,
    pub batch_size: u32,
    pub iterations: u32,
    pub warmup: u32,
    pub latency: LatencyStats,
    /// Transfers in flight at once.
    pub concurrency: u32,
    /// Wall time of the measured transfers, from the first one's start to the last one's end
    /// (with one in flight: about the sum of the latencies).
    pub wall: Duration,
    /// Whether the destination held the source's bytes after the size's iterations.
    pub verified: bool,
    /// Chunk size and lanes when the harness knows them.
    pub chunk_bytes: Option<u32>,
    pub lanes: Option<u32>,
    /// CPU time the hypervisor took from this machine while the size ran (warm-up included);
    /// `None` where the machine does not say (not Linux).
    pub steal: Option<steal::Steal>,
}

impl BenchRow {
    /// Bytes one transfer moves.
    pub fn bytes_per_transfer(&self) -> u64 {
        self.block_size * u64::from(self.batch_size)
    }

    /// Decimal GB/s over the measured transfers: back to back with one in flight (the sum of
    /// their latencies), over the wall time with several.
    pub fn gbps(&self) -> f64 {
        let secs = if self.concurrency > 1 {
            self.wall.as_secs_f64()
        } else {
            self.latency.total.as_secs_f64()
        };
        if secs <= 0.0 {
            return 0.0;
        }
        (self.bytes_per_transfer() as f64 * f64::from(self.iterations)) / secs / 1e9
    }

    pub fn to_json(&self) -> Value {
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        json!({
            "harness": self.harness.name(),
            "op": self.op.name(),
            "memory": self.memory.name(),
            "block_size": self.block_size,
            "batch_size": self.batch_size,
            "concurrency": self.concurrency,
            "iterations": self.iterations,
            "warmup": self.warmup,
            "bytes_per_transfer": self.bytes_per_transfer(),
            "gb_per_s": self.gbps(),
            "avg_lat_us": us(self.latency.avg),
            "p50_lat_us": us(self.latency.p50),
            "p99_lat_us": us(self.latency.p99),
            "min_lat_us": us(self.latency.min),
            "max_lat_us": us(self.latency.max),
            "verified": self.verified,
            "chunk_bytes": self.chunk_bytes,
            "lanes": self.lanes,
            "steal_ms": self.steal.map(|s| s.stolen.as_secs_f64() * 1e3),
            "steal_share": self.steal.map(|s| s.share),
        })
    }
}

/// The rows as a table: harness, op, memory, block size, batch size, GB/s, avg/p50/p99 latency,
/// and the host's steal when any row saw some.
pub fn rows_table(rows: &[BenchRow]) -> Table {
    let stolen = rows.iter().any(|r| r.steal.is_some_and(|s| s.share > 0.0));
    let mut head = vec![
        "harness",
        "op",
        "memory",
        "block size",
        "batch",
        "in flight",
        "GB/s",
        "avg lat (us)",
        "p50 (us)",
        "p99 (us)",
        "verified",
    ];
    if stolen {
        head.push("host steal");
    }
    let mut t = Table::new(head);
    let us = |d: Duration| format!("{:.1}", d.as_secs_f64() * 1e6);
    for r in rows {
        let mut cells = vec![
            r.harness.name().to_string(),
            r.op.name().to_string(),
            r.memory.name(),
            format_bytes(r.block_size),
            r.batch_size.to_string(),
            r.concurrency.to_string(),
            format!("{:.3}", r.gbps()),
            us(r.latency.avg),
            us(r.latency.p50),
            us(r.latency.p99),
            if r.verified { "yes" } else { "NO" }.to_string(),
        ];
        if stolen {
            cells.push(r.steal.map_or("-".into(), |s| format!("{:.1}%", s.share * 100.0)));
        }
        t.row(cells);
    }
    t
}

/// The rows as JSON lines (one object per line, newline-terminated).
pub fn rows_json_lines(rows: &[BenchRow]) -> String {
    rows.iter().map(|r| format!("{}\n", r.to_json())).collect()
}

/// Appends the rows as JSON lines to `path` (created if missing), so the raw and daemon runs
/// can share one file.
pub fn append_json_lines(path: &std::path::Path, rows: &[BenchRow]) -> std::io::Result<()> {
    use std::io::Write as _;
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
    f.write_all(rows_json_lines(rows).as_bytes())
}

/// An indicatif bar counting every iteration of a run (warm-up included); hidden when not
/// wanted.
pub fn progress_bar(workload: &Workload, label: &str, enabled: bool) -> indicatif::ProgressBar {
    use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
    if !enabled {
        return ProgressBar::hidden();
    }
    let total = workload.sizes.len() as u64 * u64::from(workload.iterations + workload.warmup);
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template(
        "{prefix:>6} {msg:>10} [{elapsed_precise}] {wide_bar:.cyan/blue} {pos}/{len} transfers",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ");
    bar.set_style(style);
    bar.set_prefix(label.to_string());
    bar.enable_steady_tick(Duration::from_millis(200));
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_cover_min_to_max() {
        assert_eq!(
            size_steps(4 << 10, 256 << 20, 4).unwrap(),
            (0..9).map(|i| (4u64 << 10) << (2 * i)).collect::<Vec<_>>()
        );
        assert_eq!(size_steps(1000, 5000, 4).unwrap(), vec![1000, 4000, 5000]);
        assert_eq!(size_steps(7, 7, 2).unwrap(), vec![7]);
        assert!(size_steps(0, 1, 2).is_err());
        assert!(size_steps(8, 4, 2).is_err());
        assert!(size_steps(4, 8, 1).is_err());
    }

    /// A queue of `concurrency` transfers finishing in order, admitted by [`may_start`]: no
    /// measured transfer starts while a warm-up one is unfinished, the depth is kept, and every
    /// transfer starts (issue #13, the 64 KiB "stall" with 8 in flight and 5 warm-up).
    #[test]
    fn measured_transfers_start_after_the_warm_up() {
        for (concurrency, warmup) in [(8, 5), (8, 0), (8, 8), (8, 10), (1, 5), (3, 1), (64, 63)] {
            let total = warmup + 20;
            let (mut next, mut done, mut deepest) = (0u32, 0u32, 0u32);
            while done < total {
                while next < total && may_start(next, next - done, concurrency, warmup) {
                    if next == warmup {
                        assert_eq!(
                            done, warmup,
                            "{concurrency}/{warmup}: measured start with warm-ups in flight"
                        );
                    }
                    next += 1;
                    deepest = deepest.max(next - done);
                }
                assert!(
                    next > done,
                    "{concurrency}/{warmup}: nothing in flight, nothing started"
                );
                done += 1;
            }
            assert_eq!(next, total);
            // The warm-up and the measured transfers each fill the queue as far as they go.
            let depth = concurrency.min(warmup).max(concurrency.min(20));
            assert_eq!(deepest, depth, "{concurrency}/{warmup}: depth not reached");
        }
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let samples: Vec<Duration> = (1..=100).rev().map(Duration::from_micros).collect();
        let s = LatencyStats::from_samples(&samples);
        assert_eq!(s.p50, Duration::from_micros(50));
        assert_eq!(s.p99, Duration::from_micros(99));
        assert_eq!(s.min, Duration::from_micros(1));
        assert_eq!(s.max, Duration::from_micros(100));
        assert_eq!(s.total, Duration::from_micros(5050));
        let one = LatencyStats::from_samples(&[Duration::from_micros(7)]);
        assert_eq!((one.p50, one.p99, one.avg), (one.min, one.max, one.max));
    }

    #[test]
    fn rows_print_and_serialise() {
        let row = BenchRow {
            harness: Harness::Raw,
            op: Op::Write,
            memory: Memory::Host,
            block_size: 1 << 20,
            batch_size: 2,
            iterations: 4,
            warmup: 1,
            latency: LatencyStats::from_samples(&[Duration::from_millis(1); 4]),
            concurrency: 1,
            wall: Duration::from_millis(5),
            verified: true,
            chunk_bytes: Some(512 << 10),
            lanes: Some(2),
            steal: None,
        };
        // 2 MiB per transfer in 1 ms: 2.097152 GB/s.
        assert!((row.gbps() - 2.097152).abs() < 1e-9);
        // Several in flight: over the wall time (4 × 2 MiB in 5 ms).
        let deep = BenchRow {
            concurrency: 4,
            ..row.clone()
        };
        assert!((deep.gbps() - 4.0 * 2.097152 / 5.0).abs() < 1e-9);
        let v: Value = serde_json::from_str(rows_json_lines(std::slice::from_ref(&row)).trim()).unwrap();
        assert_eq!(v["harness"], "raw");
        assert_eq!(v["block_size"], 1 << 20);
        assert_eq!(v["p50_lat_us"], 1000.0);
        assert!(v["steal_share"].is_null());
        let text = rows_table(std::slice::from_ref(&row)).to_string();
        assert!(text.contains("1.00 MiB") && text.contains("2.097"), "{text}");
        assert!(!text.contains("steal"), "{text}");
        // A row that saw steal: the column appears, with each row's share.
        let busy = BenchRow {
            steal: Some(steal::Steal {
                stolen: Duration::from_millis(30),
                share: 0.0125,
            }),
            ..row.clone()
        };
        let v: Value = serde_json::from_str(rows_json_lines(std::slice::from_ref(&busy)).trim()).unwrap();
        assert_eq!(v["steal_ms"], 30.0);
        assert_eq!(v["steal_share"], 0.0125);
        let text = rows_table(&[row, busy]).to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].ends_with("host steal"), "{text}");
        assert!(
            lines[1].trim_end().ends_with('-') && lines[2].trim_end().ends_with("1.2%"),
            "{text}"
        );
    }

    #[test]
    fn workloads_are_checked() {
        let w = Workload {
            op: Op::Write,
            memory: Memory::Host,
            peer_memory: None,
            sizes: vec![4096, 1 << 20],
            batch: 4,
            iterations: 2,
            warmup: 0,
            concurrency: 1,
        };
        assert_eq!(w.buffer_bytes(), 4 << 20);
        assert!(w.validate().is_ok());
        // Each transfer in flight has its own range (as many as the size runs transfers).
        let deep = Workload {
            concurrency: 8,
            ..w.clone()
        };
        assert_eq!((deep.slots(), deep.buffer_bytes()), (2, 8 << 20));
        let deep = Workload {
            concurrency: 8,
            iterations: 20,
            ..w.clone()
        };
        assert_eq!(deep.buffer_bytes(), 32 << 20);
        assert!(
            Workload {
                concurrency: 0,
                ..w.clone()
            }
            .validate()
            .unwrap_err()
            .contains("--concurrency")
        );
        assert!(
            Workload {
                batch: 0,
                ..w.clone()
            }
            .validate()
            .unwrap_err()
            .contains("--batch")
        );
        assert!(
            Workload {
                iterations: 0,
                ..w.clone()
            }
            .validate()
            .is_err()
        );
        assert!(
            Workload {
                sizes: vec![],
                ..w.clone()
            }
            .validate()
            .is_err()
        );
        assert!(
            Workload {
                sizes: vec![1 << 40],
                ..w
            }
            .validate()
            .is_err()
        );
    }
}
