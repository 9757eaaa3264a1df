//! Running `tcpxctl bench transfer` and `tcpxctl bench raw` (their arguments are in
//! `crate::cli::args`, the harnesses in [`crate::bench`]).

use std::path::PathBuf;
use std::time::Duration;

use crate::bench::blocks::{BlocksRow, BlocksWorkload, run_blocks_bench};
use crate::bench::daemon::{DaemonBenchError, DaemonPair, ensure_peer, run_daemon_bench};
use crate::bench::raw::{RawOptions, run_raw};
use crate::bench::{
    BenchRow, Harness, Memory, Workload, append_json_lines, progress_bar, rows_json_lines, rows_table,
    size_steps,
};
use crate::cli::args::{BenchCommand, BenchTransferArgs, GlobalOpts, PathArgs, WorkloadArgs};
use crate::cli::demo::{Daemons, DemoOptions, Signals, connect_peer, remove_dir};
use crate::cli::error::{CliError, emit};
use crate::cli::output::Table;
use crate::client::{connect, format_bytes};
use tcpxd::unpack::UnpackImpl;

/// The node ids of the local daemons `bench transfer` starts.
pub const LOCAL_NODES: [&str; 2] = ["bench-a", "bench-b"];

impl WorkloadArgs {
    pub fn workload(&self) -> Result<Workload, String> {
        let sizes = if self.sizes.is_empty() {
            size_steps(self.min, self.max, self.step)?
        } else {
            self.sizes.clone()
        };
        let w = Workload {
            op: self.op,
            memory: match self.cuda {
                Some(d) => Memory::Cuda(d),
                None => Memory::Host,
            },
            peer_memory: self.peer_cuda.map(Memory::Cuda),
            sizes,
            batch: self.batch,
            iterations: self.iters,
            warmup: self.warmup,
            concurrency: self.concurrency,
        };
        w.validate()?;
        Ok(w)
    }
}

impl PathArgs {
    fn chunk_bytes(&self) -> Result<u32, String> {
        match self.chunk_bytes {
            Some(v) => tcpxd::engine::plan::check_chunk_bytes(v).map_err(|e| format!("--chunk-bytes: {e}")),
            None => tcpxd::config::chunk_bytes_from_env(
                std::env::var("UCCL_TCPX_CHUNK_BYTES").ok().as_deref(),
                std::env::var("NCCL_P2P_NET_CHUNKSIZE").ok().as_deref(),
            ),
        }
    }

    fn spread_min_chunk(&self) -> Result<u32, String> {
        match self.spread_min_chunk_bytes {
            None => Ok(tcpxd::config::DEFAULT_SPREAD_MIN_CHUNK_BYTES as u32),
            Some(0) => Ok(0),
            Some(v) => tcpxd::engine::plan::check_chunk_bytes(v)
                .map_err(|e| format!("--spread-min-chunk-bytes: {e} (or 0: off)")),
        }
    }
}

/// What `bench transfer` runs between the two daemons: the size sweep, or the block bench.
#[derive(Clone, Copy)]
enum Job<'a> {
    Sizes(&'a Workload),
    Blocks(&'a BlocksWorkload),
}

/// What a job measured.
enum Ran {
    Sizes(Vec<BenchRow>),
    Blocks(Box<BlocksRow>),
}

impl Job<'_> {
    fn memories(&self) -> (Memory, Option<Memory>) {
        match self {
            Job::Sizes(w) => (w.memory, w.peer_memory),
            Job::Blocks(w) => (w.memory, w.peer_memory),
        }
    }

    async fn run(
        self,
        pair: &mut DaemonPair,
        lanes: Option<u32>,
        bar: &indicatif::ProgressBar,
        stop: impl std::future::Future<Output = ()>,
    ) -> Result<Ran, DaemonBenchError> {
        match self {
            Job::Sizes(w) => run_daemon_bench(pair, w, lanes, bar, stop).await.map(Ran::Sizes),
            Job::Blocks(w) => run_blocks_bench(pair, w, stop)
                .await
                .map(|r| Ran::Blocks(Box::new(r))),
        }
    }
}

impl BenchTransferArgs {
    /// `--blocks N --block-size S` with the workload's op, memory, iterations and warm-up.
    fn blocks_workload(&self) -> Option<Result<BlocksWorkload, String>> {
        let blocks = self.blocks?;
        let wl = &self.workload;
        if wl.batch != 1 || wl.concurrency != 1 || !wl.sizes.is_empty() {
            return Some(Err(
                "--blocks: runs one block transfer at a time; leave out --sizes, --batch and --concurrency"
                    .into(),
            ));
        }
        let w = BlocksWorkload {
            op: wl.op,
            memory: wl.cuda.map_or(Memory::Host, Memory::Cuda),
            peer_memory: wl.peer_cuda.map(Memory::Cuda),
            blocks,
            block_size: self.block_size.unwrap_or(4096),
            iterations: wl.iters,
            warmup: wl.warmup,
            seed: self.seed,
            scattered: self.scattered,
            batch: (!self.no_batch && blocks as usize <= tcpxd::engine::DEFAULT_MAX_ENTRIES)
                .then_some(self.batch_form),
        };
        Some(w.validate().map(|()| w))
    }
}

/// Runs `bench transfer --blocks`: its table (or one JSON line with --json).
async fn run_blocks(
    global: &GlobalOpts,
    args: &BenchTransferArgs,
    w: &BlocksWorkload,
) -> Result<(), CliError> {
    let bar = indicatif::ProgressBar::hidden();
    let Ran::Blocks(row) = transfer_rows(global, args, Job::Blocks(w), &bar).await? else {
        unreachable!("a block job measures a block row");
    };
    let line = row.to_json();
    if let Some(path) = &args.workload.out {
        use std::io::Write as _;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .and_then(|mut f| writeln!(f, "{line}").map(|()| f))
            .map_err(|source| CliError::Io {
                what: format!("appending to {}", path.display()),
                source,
            })?;
        f.flush().map_err(|source| CliError::Io {
            what: format!("appending to {}", path.display()),
            source,
        })?;
    }
    if global.json {
        emit(&format!("{line}\n"))?;
    } else {
        emit(&row.table().to_string())?;
        emit(&format!(
            "\nscattered/contiguous: {:.2} ({} blocks of {}, {}, seed {}; checked: {})\n",
            row.ratio(),
            w.blocks,
            format_bytes(w.block_size),
            w.scattered.describe(),
            w.seed,
            row.checked
        ))?;
        if let (Some(form), Some(r), Some(c)) = (w.batch, row.batch_ratio(), row.batch_contiguous_ratio()) {
            emit(&format!(
                "batch/blocks: {r:.2}, batch/contiguous: {c:.2} (the same pairs as one plain batch, {} form)\n",
                format!("{form:?}").to_lowercase()
            ))?;
        }
    }
    if !row.verified {
        return Err(CliError::Bench(
            "the destination does not hold the source's bytes after the block run".into(),
        ));
    }
    Ok(())
}

/// Runs a bench subcommand and prints its table (or JSON lines with --json).
pub async fn run(global: &GlobalOpts, cmd: BenchCommand) -> Result<(), CliError> {
    if let BenchCommand::Transfer(args) = &cmd
        && let Some(w) = args.blocks_workload()
    {
        let w = w.map_err(CliError::Usage)?;
        if args.raw {
            return Err(CliError::Usage("--blocks: --raw has no block counterpart".into()));
        }
        return run_blocks(global, args, &w).await;
    }
    let (rows, out) = match cmd {
        BenchCommand::Raw(args) => {
            let w = args.workload.workload().map_err(CliError::Usage)?;
            let opts = raw_options(
                &w,
                &args.path,
                args.plugin,
                args.devices,
                args.send_window,
                args.recv_window,
            )?;
            (raw_rows(opts, !global.json).await?, args.workload.out)
        }
        BenchCommand::Transfer(args) => {
            let w = args.workload.workload().map_err(CliError::Usage)?;
            let mut rows = Vec::new();
            if args.raw {
                let opts = raw_options(&w, &args.path, args.plugin.clone(), Vec::new(), 12, 16)?;
                rows.extend(raw_rows(opts, !global.json).await?);
            }
            let bar = progress_bar(&w, "daemon", !global.json);
            let Ran::Sizes(more) = transfer_rows(global, &args, Job::Sizes(&w), &bar).await? else {
                unreachable!("a size job measures size rows");
            };
            bar.finish_and_clear();
            rows.extend(more);
            (rows, args.workload.out.clone())
        }
    };
    if let Some(path) = &out {
        append_json_lines(path, &rows).map_err(|source| CliError::Io {
            what: format!("appending to {}", path.display()),
            source,
        })?;
    }
    if global.json {
        emit(&rows_json_lines(&rows))?;
    } else {
        emit(&rows_table(&rows).to_string())?;
        if let Some(t) = side_by_side(&rows) {
            emit(&format!("\ndaemon against raw:\n{t}"))?;
        }
    }
    if let Some(bad) = rows.iter().find(|r| !r.verified) {
        return Err(CliError::Bench(format!(
            "the destination does not hold the source's bytes after the {} {} run at block size {}",
            bad.harness.name(),
            bad.op.name(),
            format_bytes(bad.block_size)
        )));
    }
    Ok(())
}

fn raw_options(
    w: &Workload,
    path: &PathArgs,
    plugin: Option<PathBuf>,
    devices: Vec<i32>,
    send_window: usize,
    recv_window: usize,
) -> Result<RawOptions, CliError> {
    Ok(RawOptions {
        workload: w.clone(),
        plugin,
        chunk_bytes: path.chunk_bytes().map_err(CliError::Usage)?,
        lanes_per_device: path.lanes_per_device.unwrap_or(2),
        spread_min_chunk: path.spread_min_chunk().map_err(CliError::Usage)?,
        spread_chunks_per_lane: path
            .spread_chunks_per_lane
            .unwrap_or(tcpxd::config::DEFAULT_SPREAD_CHUNKS_PER_LANE),
        devices: (!devices.is_empty()).then_some(devices),
        send_window,
        recv_window,
        unpack_impl: UnpackImpl::from_env()
            .map_err(|e| CliError::Usage(format!("UCCL_TCPX_UNPACK_IMPL: {e}")))?,
        connect_timeout: Duration::from_secs(30),
        stall_timeout: Duration::from_secs(60),
    })
}

async fn raw_rows(opts: RawOptions, progress: bool) -> Result<Vec<BenchRow>, CliError> {
    // `RUST_LOG=tcpxd::hop=trace`: the raw bench's transfers (`raw.start`, `raw.end`) and its
    // lanes' events (`lane.isend`, `lane.sent`, `lane.irecv`, `lane.recvd`, `stage.*`) on
    // stderr, in the daemon's format, for `benches/lanes.py` to set beside a daemon pair's.
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .try_init();
    }
    let bar = progress_bar(&opts.workload, "raw", progress);
    let b = bar.clone();
    let rows = tokio::task::spawn_blocking(move || run_raw(&opts, &b))
        .await
        .map_err(|e| CliError::Bench(format!("the raw bench panicked: {e}")))?;
    bar.finish_and_clear();
    rows.map_err(|e| CliError::Bench(e.to_string()))
}

async fn transfer_rows(
    global: &crate::cli::args::GlobalOpts,
    args: &BenchTransferArgs,
    job: Job<'_>,
    bar: &indicatif::ProgressBar,
) -> Result<Ran, CliError> {
    let rows = match &args.peer_endpoint {
        Some(peer) => {
            if args.path.chunk_bytes.is_some() || args.path.lanes_per_device.is_some() {
                return Err(CliError::Usage(
                    "--chunk-bytes and --lanes-per-device set up local daemons; running daemons keep their own settings"
                        .into(),
                ));
            }
            let a = connect(&global.endpoint)
                .await
                .map_err(|source| CliError::Connect { source })?;
            let b = connect(peer)
                .await
                .map_err(|source| CliError::Connect { source })?;
            let mut pair = DaemonPair {
                a,
                b,
                chunk_bytes: None,
                via: via(args.via, &global.endpoint)?,
            };
            let (_, lanes) = tokio::select! {
                r = ensure_peer(&mut pair, args.peer_address.as_deref()) => r.map_err(|e| CliError::Bench(e.to_string()))?,
                _ = tokio::signal::ctrl_c() => return Err(CliError::Interrupted),
            };
            let interrupted = async {
                let _ = tokio::signal::ctrl_c().await;
            };
            match job.run(&mut pair, Some(lanes), bar, interrupted).await {
                Ok(rows) => rows,
                Err(crate::bench::daemon::DaemonBenchError::Interrupted) => {
                    bar.finish_and_clear();
                    eprintln!("tcpxctl: interrupted; the bench's buffers were released");
                    return Err(CliError::Interrupted);
                }
                Err(e) => return Err(CliError::Bench(e.to_string())),
            }
        }
        None => local_daemons_bench(args, job, bar).await?,
    };
    Ok(rows)
}

/// How the transfers reach the daemon at `endpoint` (`--via`): the framed local session needs
/// its API unix socket.
fn via(via: crate::cli::args::Via, endpoint: &str) -> Result<crate::bench::daemon::Via, CliError> {
    use crate::bench::daemon::Via as On;
    match via {
        crate::cli::args::Via::Grpc => Ok(On::Grpc),
        crate::cli::args::Via::Local => {
            let path = endpoint.strip_prefix("unix:").unwrap_or(endpoint);
            match path.starts_with('/') {
                true => Ok(On::Local(PathBuf::from(path))),
                false => Err(CliError::Usage(format!(
                    "--via local: the framed local session runs on the daemon's API unix socket; --endpoint {endpoint} is not one (unix:/path or /path)"
                ))),
            }
        }
    }
}

/// Starts two local daemons (as `demo` does), runs the bench between them, stops them.
async fn local_daemons_bench(
    args: &BenchTransferArgs,
    job: Job<'_>,
    bar: &indicatif::ProgressBar,
) -> Result<Ran, CliError> {
    let chunk_bytes = args.path.chunk_bytes().map_err(CliError::Usage)?;
    let lanes_per_device = args.path.lanes_per_device.unwrap_or(2);
    let opts = DemoOptions {
        chunk_bytes: Some(u64::from(chunk_bytes)),
        keep_dir: args.keep_dir,
        daemon: args.daemon.clone(),
        dir: Some(std::env::temp_dir().join(format!("tcpxd-bench-{}", std::process::id()))),
        ready_timeout: args.ready_timeout,
        progress: false,
        handle_signals: true,
        extra_daemon_args: [
            "--lanes-per-device".into(),
            lanes_per_device.to_string(),
            "--spread-min-chunk-bytes".into(),
            args.path.spread_min_chunk().map_err(CliError::Usage)?.to_string(),
        ]
        .into_iter()
        // Only when set: the daemon's default is the same, and a daemon older than the setting
        // still starts.
        .chain(
            args.path
                .spread_chunks_per_lane
                .into_iter()
                .flat_map(|n| ["--spread-chunks-per-lane".to_string(), n.to_string()]),
        )
        .collect(),
        // One daemon per GPU: each keeps its emulated bounce buffers on its own GPU.
        emulation_cuda_devices: match job.memories() {
            (Memory::Cuda(a), Some(Memory::Cuda(b))) => vec![a, b],
            _ => Vec::new(),
        },
        plugin: args.plugin.clone(),
        ..DemoOptions::default()
    };
    let fail = |e: crate::cli::demo::DemoError| CliError::Bench(e.to_string());
    let daemon = opts.daemon_path().map_err(fail)?;
    if !daemon.is_file() {
        return Err(fail(crate::cli::demo::DemoError::DaemonMissing { path: daemon }));
    }
    let mut signals = Signals::new().map_err(fail)?;
    let dir = opts.work_dir();
    std::fs::create_dir_all(&dir).map_err(|source| CliError::Io {
        what: format!("creating {}", dir.display()),
        source,
    })?;
    let mut daemons = Daemons::new(false);
    let flow = async {
        for node in LOCAL_NODES {
            daemons.spawn(&daemon, node, &dir, &opts).map_err(fail)?;
        }
        let [a, b] = daemons.wait_ready(opts.ready_timeout).await.map_err(fail)?;
        let mut ca = connect(&format!("unix:{}", a.api_socket))
            .await
            .map_err(|source| CliError::Connect { source })?;
        let cb = connect(&format!("unix:{}", b.api_socket))
            .await
            .map_err(|source| CliError::Connect { source })?;
        connect_peer(&mut ca, &a, &b).await.map_err(fail)?;
        let mut pair = DaemonPair {
            a: ca,
            b: cb,
            chunk_bytes: Some(chunk_bytes),
            via: via(args.via, &a.api_socket)?,
        };
        let (_, lanes) = ensure_peer(&mut pair, None)
            .await
            .map_err(|e| CliError::Bench(e.to_string()))?;
        // Ctrl-C is handled around this flow: the daemons are stopped, their buffers with them.
        match job.run(&mut pair, Some(lanes), bar, std::future::pending()).await {
            Ok(rows) => Ok(rows),
            // A failed RPC is often a daemon that died: say so, with its log.
            Err(e) => Err(match daemons.explain_exit() {
                Some(d) => fail(d),
                None => CliError::Bench(e.to_string()),
            }),
        }
    };
    let outcome = tokio::select! {
        r = flow => r,
        name = signals.recv() => Err(CliError::Bench(format!("interrupted by {name}; daemons stopped"))),
    };
    let exits = daemons.stop(crate::cli::demo::STOP_GRACE).await;
    for e in exits.iter().filter(|e| !e.clean()) {
        eprintln!("tcpxctl: warning: {} {}", e.node, e.describe());
    }
    match (&outcome, args.keep_dir) {
        (Ok(_), false) => remove_dir(&dir, true),
        (Ok(_), true) => eprintln!("tcpxctl: kept {}", dir.display()),
        (Err(_), _) => eprintln!("tcpxctl: the daemons' logs are kept in {}", dir.display()),
    }
    outcome
}

/// Raw and daemon rows of the same op, memory, block size, batch size and concurrency, paired:
/// GB/s, the ratio, p50 and p99 latencies. `None` unless both harnesses ran.
pub fn side_by_side(rows: &[BenchRow]) -> Option<Table> {
    let raw: Vec<&BenchRow> = rows.iter().filter(|r| r.harness == Harness::Raw).collect();
    let mut t = Table::new([
        "op",
        "block size",
        "batch",
        "in flight",
        "raw GB/s",
        "daemon GB/s",
        "daemon/raw",
        "raw p50 (us)",
        "daemon p50 (us)",
        "raw p99 (us)",
        "daemon p99 (us)",
    ]);
    for d in rows.iter().filter(|r| r.harness != Harness::Raw) {
        let Some(r) = raw.iter().find(|r| {
            r.op == d.op
                && r.memory == d.memory
                && r.block_size == d.block_size
                && r.batch_size == d.batch_size
                && r.concurrency == d.concurrency
        }) else {
            continue;
        };
        let us = |x: Duration| format!("{:.1}", x.as_secs_f64() * 1e6);
        let ratio = if r.gbps() > 0.0 {
            format!("{:.2}", d.gbps() / r.gbps())
        } else {
            "n/a".into()
        };
        t.row([
            d.op.name().to_string(),
            format_bytes(d.block_size),
            d.batch_size.to_string(),
            d.concurrency.to_string(),
            format!("{:.3}", r.gbps()),
            format!("{:.3}", d.gbps()),
            ratio,
            us(r.latency.p50),
            us(d.latency.p50),
            us(r.latency.p99),
            us(d.latency.p99),
        ]);
    }
    (!t.is_empty()).then_some(t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::{DEFAULT_MAX_SIZE, DEFAULT_MIN_SIZE, DEFAULT_STEP, Op};

    #[test]
    fn default_sizes_are_4k_to_256m_by_4() {
        let args = WorkloadArgs {
            op: Op::Write,
            cuda: None,
            peer_cuda: None,
            sizes: Vec::new(),
            min: DEFAULT_MIN_SIZE,
            max: DEFAULT_MAX_SIZE,
            step: DEFAULT_STEP,
            batch: 1,
            iters: 100,
            warmup: 10,
            concurrency: 1,
            out: None,
        };
        let w = args.workload().unwrap();
        assert_eq!(w.sizes.first(), Some(&4096));
        assert_eq!(w.sizes.last(), Some(&(256 << 20)));
        assert_eq!(w.sizes.len(), 9);
        let w = WorkloadArgs {
            sizes: vec![4096, 1 << 20],
            cuda: Some(1),
            peer_cuda: Some(0),
            ..args
        }
        .workload()
        .unwrap();
        assert_eq!(w.sizes, vec![4096, 1 << 20]);
        assert_eq!(w.peer_memory, Some(Memory::Cuda(0)));
        assert_eq!(w.memory, Memory::Cuda(1));
    }
}
