//! The plugin conformance suite: checks that a `ncclNetPlugin_v7` behaves as the GPUDirect-TCPX
//! plugin does (reference/TCPX_PLUGIN_ABI.md), through tcpxd's own plugin layer.
//!
//! It runs against any plugin: the emulation in CI, the real `libnccl-net.so` on an A3 node (as
//! `tcpxctl conformance --plugin PATH`). Each case runs on its own comms, on every device, under a
//! watchdog, so a hanging plugin shows up as a failed case rather than a hung suite.
//!
//! - `harness`: test buffers (host or GPU), connected comm pairs, batches driven to completion and
//!   the byte-exact check of each receive.
//! - `comms`: the plugin's properties, connect/accept, registration and closing cases.
//! - `data`: the cases that move data: sizes, FIFO matching, the ring wrap-around.
//! - `rules`: the plugin enforcing its own rules: the request limit, test and consume order.
//! - `progress`: `send_progress` and `recv_progress`, where a request moves (only in `test`, one
//!   more per call).
//! - `nccl`: the cases about the plugin under NCCL.
//! - `binding`: `misbound_gpu`, a receive comm under a GPU its NIC does not serve (RxDM's binding).
//! - `credits`: `credit_landing`, a CUDA receive naming a one-page registration and a 4 MiB posted
//!   size (what the daemon's credits on GPU lanes rest on); CUDA test memory only.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use tcpxd::gpu::Gpu;
use tcpxd::net::Plugin;

mod binding;
mod comms;
mod credits;
mod data;
mod harness;
mod nccl;
mod progress;
mod rules;

pub use harness::pattern;
use harness::{Ctx, MemCtx};
use tcpxd::engine::topology::MapSpec;

/// Where the suite's test buffers live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestMemory {
    /// Host memory (`NCCL_PTR_HOST` registrations).
    Host,
    /// GPU memory on this CUDA device (`NCCL_PTR_CUDA`): received bytes are gathered from the
    /// plugin's GPU bounce buffer by the unpack kernel.
    Cuda(usize),
}

/// What to run and how long to wait.
#[derive(Debug, Clone)]
pub struct Options {
    /// Devices to run the per-device cases on; all of the plugin's when `None`.
    pub devices: Option<Vec<i32>>,
    /// Time allowed for one connect/accept (the real plugin sleeps up to 5 s after accept).
    pub connect_timeout: Duration,
    /// Time after which a case counts as hung.
    pub case_timeout: Duration,
    /// Requests streamed through one comm pair in the wrap-around case.
    pub wraparound_requests: usize,
    /// Only cases whose name contains this string.
    pub filter: Option<String>,
    /// Where the test buffers live.
    pub memory: TestMemory,
    /// Which NICs serve each GPU (as the daemon's `topology.map`): with CUDA test memory, the
    /// per-device cases run only on devices that serve the test GPU, with it current.
    pub topology: MapSpec,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            devices: None,
            connect_timeout: Duration::from_secs(30),
            case_timeout: Duration::from_secs(120),
            wraparound_requests: 3000,
            filter: None,
            memory: TestMemory::Host,
            topology: MapSpec::Pci,
        }
    }
}

/// One case's outcome on one device.
#[derive(Debug, Clone)]
pub struct CaseResult {
    pub name: &'static str,
    pub dev: Option<i32>,
    pub passed: bool,
    /// What was observed (on success) or what went wrong (on failure).
    pub detail: String,
    pub elapsed: Duration,
}

/// The whole run.
#[derive(Debug, Clone)]
pub struct Report {
    pub plugin: String,
    pub source: String,
    pub cases: Vec<CaseResult>,
    /// What was left out and why (devices that do not serve the test GPU).
    pub notes: Vec<String>,
}

impl Report {
    pub fn passed(&self) -> bool {
        !self.cases.is_empty() && self.cases.iter().all(|c| c.passed)
    }

    pub fn failures(&self) -> impl Iterator<Item = &CaseResult> {
        self.cases.iter().filter(|c| !c.passed)
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "conformance of {} ({})", self.plugin, self.source)?;
        writeln!(f, "{:<22} {:>4} {:<5} {:>9}  detail", "case", "dev", "", "time")?;
        for c in &self.cases {
            let dev = c.dev.map(|d| d.to_string()).unwrap_or_else(|| "-".into());
            writeln!(
                f,
                "{:<22} {:>4} {:<5} {:>7.1}ms  {}",
                c.name,
                dev,
                if c.passed { "ok" } else { "FAIL" },
                c.elapsed.as_secs_f64() * 1e3,
                c.detail
            )?;
        }
        for n in &self.notes {
            writeln!(f, "note: {n}")?;
        }
        let failed = self.failures().count();
        write!(
            f,
            "{} cases: {} passed, {} failed",
            self.cases.len(),
            self.cases.len() - failed,
            failed
        )
    }
}

type CaseFn = fn(&Ctx) -> Result<String, String>;

/// Cases run on every device, in this order.
const DEVICE_CASES: &[(&str, CaseFn)] = &[
    ("connect_accept", comms::case_connect_accept),
    ("host_registration", comms::case_host_registration),
    ("sizes", data::case_sizes),
    ("fifo_tags_ignored", data::case_fifo_tags_ignored),
    ("request_limit", rules::case_request_limit),
    ("test_order", rules::case_test_order),
    ("send_progress", progress::case_send_progress),
    ("recv_progress", progress::case_recv_progress),
    ("consume_order", rules::case_consume_order),
    ("ring_wraparound", data::case_ring_wraparound),
    ("nccl_ring", nccl::case_ring_traffic),
    ("close_outstanding", comms::case_close_outstanding),
    ("peer_close", comms::case_peer_close),
    ("dead_listener", comms::case_dead_listener),
];

/// Runs the suite.
pub fn run(plugin: &Arc<Plugin>, opts: &Options) -> Report {
    let mut cases = Vec::new();
    let wanted = |name: &str| opts.filter.as_deref().is_none_or(|f| name.contains(f));
    if wanted("properties") {
        let start = Instant::now();
        let (passed, detail) = match comms::check_properties(plugin) {
            Ok(d) => (true, d),
            Err(e) => (false, e),
        };
        cases.push(CaseResult {
            name: "properties",
            dev: None,
            passed,
            detail,
            elapsed: start.elapsed(),
        });
    }
    if wanted("nccl_pat") {
        let start = Instant::now();
        let (passed, detail) = match nccl::check_pat(plugin) {
            Ok(d) => (true, d),
            Err(e) => (false, e),
        };
        cases.push(CaseResult {
            name: "nccl_pat",
            dev: None,
            passed,
            detail,
            elapsed: start.elapsed(),
        });
    }
    let devices = opts
        .devices
        .clone()
        .unwrap_or_else(|| plugin.devices().iter().map(|d| d.dev).collect());
    let mem = match opts.memory {
        TestMemory::Host => MemCtx::Host,
        TestMemory::Cuda(device) => match Gpu::open(device) {
            Ok(gpu) => MemCtx::Cuda(gpu),
            Err(e) => {
                cases.push(CaseResult {
                    name: "cuda_memory",
                    dev: None,
                    passed: false,
                    detail: format!("GPU {device}: {e}"),
                    elapsed: Duration::ZERO,
                });
                return Report {
                    plugin: plugin.name().to_string(),
                    source: plugin.source().to_string(),
                    cases,
                    notes: Vec::new(),
                };
            }
        },
    };
    let misbound = misbound_runs(plugin, opts);
    let cuda = matches!(opts.memory, TestMemory::Cuda(_));
    let mut notes = Vec::new();
    let served = match served_devices(plugin, opts, &devices) {
        Ok(s) => s,
        Err(detail) => {
            cases.push(CaseResult {
                name: "gpu_binding",
                dev: None,
                passed: false,
                detail,
                elapsed: Duration::ZERO,
            });
            vec![false; devices.len()]
        }
    };
    for (dev, serves) in devices.into_iter().zip(served) {
        if !serves {
            let why = unserved_why(plugin, opts, dev);
            if opts.devices.is_some() {
                // Asked for by name: on A3 this device's comms would end the process.
                cases.push(CaseResult {
                    name: "gpu_binding",
                    dev: Some(dev),
                    passed: false,
                    detail: why,
                    elapsed: Duration::ZERO,
                });
            } else {
                notes.push(format!("device {dev}: only misbound_gpu ran: {why}"));
            }
        }
        let cases_here = DEVICE_CASES
            .iter()
            .chain(cuda.then_some(&("credit_landing", credits::case_credit_landing as CaseFn)))
            .filter(|_| serves)
            .chain(misbound.then_some(&("misbound_gpu", binding::case_misbound_gpu as CaseFn)));
        for &(name, case) in cases_here {
            if !wanted(name) {
                continue;
            }
            let ctx = Ctx {
                plugin: plugin.clone(),
                dev,
                opts: opts.clone(),
                mem: mem.clone(),
            };
            let start = Instant::now();
            let (passed, detail) = run_with_watchdog(ctx, case, opts.case_timeout);
            tracing::info!(case = name, dev, passed, "{detail}");
            cases.push(CaseResult {
                name,
                dev: Some(dev),
                passed,
                detail,
                elapsed: start.elapsed(),
            });
        }
    }
    Report {
        plugin: plugin.name().to_string(),
        source: plugin.source().to_string(),
        cases,
        notes,
    }
}

/// With CUDA test memory, whether each of `devices` serves the test GPU under the topology map
/// (as the daemon resolves it): a comm of a device that does not, opened with that GPU current,
/// gets its flow-steering rules filed under another NIC on A3 and the plugin ends the process at
/// its first CUDA receive ("rx no cmsg", ABI §8). Host memory, or a node whose GPUs the topology
/// does not know: every device.
fn served_devices(plugin: &Plugin, opts: &Options, devices: &[i32]) -> Result<Vec<bool>, String> {
    let TestMemory::Cuda(gpu) = opts.memory else {
        return Ok(vec![true; devices.len()]);
    };
    let all: Vec<i32> = plugin.devices().iter().map(|d| d.dev).collect();
    let topo = tcpxd::topology::discover(plugin, &all, &opts.topology).map_err(|e| e.to_string())?;
    if topo.gpus.is_empty() {
        return Ok(vec![true; devices.len()]);
    }
    let nics = topo.nics_of(gpu as u32);
    if nics.is_empty() {
        return Err(format!(
            "GPU {gpu}: the topology ({}) knows no such GPU",
            topo.source
        ));
    }
    Ok(devices
        .iter()
        .map(|&d| topo.nic_position(d).is_some_and(|p| nics.contains(&p)))
        .collect())
}

/// Why device `dev` does not serve the test GPU, and what to run instead.
fn unserved_why(plugin: &Plugin, opts: &Options, dev: i32) -> String {
    let TestMemory::Cuda(gpu) = opts.memory else {
        return String::new();
    };
    let all: Vec<i32> = plugin.devices().iter().map(|d| d.dev).collect();
    let Ok(topo) = tcpxd::topology::discover(plugin, &all, &opts.topology) else {
        return format!("device {dev} does not serve GPU {gpu}");
    };
    let name = topo
        .nic_position(dev)
        .map(|p| topo.nics[p].name.clone())
        .unwrap_or_else(|| format!("device {dev}"));
    let theirs = topo
        .nic_position(dev)
        .map(|p| topo.gpus_served(p))
        .unwrap_or_default();
    let other = theirs
        .first()
        .map(|g| format!("; test it with --cuda {g}"))
        .unwrap_or_default();
    format!(
        "{name} does not serve GPU {gpu} under topology {} (it serves GPUs {theirs:?}): on A3 RxDM would file \
         its comms' flow-steering rules under another NIC and the plugin would exit at the first CUDA \
         receive (\"rx no cmsg\"){other}",
        topo.source
    )
}

/// `misbound_gpu` needs CUDA test memory and two GPUs or more (with one, every NIC serves it).
/// Google's plugin ends the process there (`exit(1)`, ABI §5), so against a plugin other than the
/// emulation it runs only when the filter names it (`--filter misbound_gpu`, in a process that
/// may die: its exit status 1 after "rx no cmsg" is the pass).
fn misbound_runs(plugin: &Plugin, opts: &Options) -> bool {
    let TestMemory::Cuda(_) = opts.memory else {
        return false;
    };
    if Gpu::device_count().unwrap_or(0) < 2 {
        return false;
    }
    plugin.name().starts_with("tcpxemu")
        || opts
            .filter
            .as_deref()
            .is_some_and(|f| "misbound_gpu".contains(f) && f.len() >= "misbound".len())
}

fn run_with_watchdog(ctx: Ctx, case: CaseFn, timeout: Duration) -> (bool, String) {
    let (tx, rx) = mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("conformance-case".into())
        .spawn(move || {
            // Listen, connect and accept run on this thread: under the test GPU, as the daemon
            // opens every comm under a GPU its NIC serves.
            if let MemCtx::Cuda(gpu) = &ctx.mem
                && let Err(e) = gpu.bind_to_thread()
            {
                let _ = tx.send(Ok(Err(format!("making the test GPU current: {e}"))));
                return;
            }
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| case(&ctx)));
            let _ = tx.send(r);
        });
    if let Err(e) = spawned {
        return (false, format!("could not start the case thread: {e}"));
    }
    match rx.recv_timeout(timeout) {
        Ok(Ok(Ok(detail))) => (true, detail),
        Ok(Ok(Err(why))) => (false, why),
        Ok(Err(_)) => (false, "the case panicked".into()),
        Err(_) => (
            false,
            format!("hung: no result after {timeout:?} (thread left behind)"),
        ),
    }
}

/// Renders the report as JSON lines (one object per case) for machines.
pub fn report_json_lines(report: &Report) -> String {
    report
        .cases
        .iter()
        .map(|c| {
            serde_json::json!({
                "plugin": report.plugin,
                "source": report.source,
                "case": c.name,
                "dev": c.dev,
                "passed": c.passed,
                "elapsed_ms": c.elapsed.as_secs_f64() * 1e3,
                "detail": c.detail,
            })
            .to_string()
                + "\n"
        })
        .chain(report.notes.iter().map(|n| {
            serde_json::json!({"plugin": report.plugin, "source": report.source, "note": n}).to_string()
                + "\n"
        }))
        .collect()
}
