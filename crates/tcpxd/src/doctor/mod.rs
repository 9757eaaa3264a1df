//! `tcpxd doctor`: checks a node's set-up for GPUDirect-TCPX and tcpxd, each check reporting ok,
//! warn or fail with a one-line fix.
//!
//! Every read of `/proc`, `/sys`, `/dev` and of RxDM's socket directory goes through [`Host::root`],
//! and every environment variable through [`Host::env`], so tests point the checks at fake trees
//! built in temporary directories. External commands (`ethtool`, `dmesg`) go through an injectable
//! [`Runner`]; the memlock limit through an injectable function. The daemon's own paths (the plugin
//! file, the API socket) are used as given: the doctor loads and binds them.

mod advertise;
mod lanes;
mod plugin;
mod system;
mod topology;

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::Args;
use serde::Serialize;

use crate::config::{Config, DaemonArgs, PluginChoice};
use crate::engine::topology::MapSpec;
use crate::net::RECOMMENDED_ENV;

pub use lanes::{LaneChoice, lane_plan};
pub use system::parse_recommended_env;
pub use topology::{GpuNicsLine, rxdm_preset};

/// `tcpxd doctor`'s options: the daemon's own settings (to know the plugin, sockets and ports it
/// would use) plus the doctor's.
#[derive(Debug, Clone, Default, Args)]
pub struct DoctorArgs {
    #[command(flatten)]
    pub daemon: DaemonArgs,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Read /proc, /sys, /dev and the RxDM socket directory under this directory instead of /
    /// (for checking a node's tree from a container that mounts it elsewhere).
    #[arg(long, value_name = "DIR", default_value = "/")]
    pub root: PathBuf,
}

/// A check's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    Ok,
    Warn,
    Fail,
}

impl std::fmt::Display for Level {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Level::Ok => "ok",
            Level::Warn => "warn",
            Level::Fail => "fail",
        })
    }
}

/// One check's result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub level: Level,
    /// What was found.
    pub detail: String,
    /// What to do about it (empty when ok).
    pub fix: String,
}

impl Check {
    pub fn ok(name: &'static str, detail: impl Into<String>) -> Check {
        Check {
            name,
            level: Level::Ok,
            detail: detail.into(),
            fix: String::new(),
        }
    }
    pub fn warn(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
        Check {
            name,
            level: Level::Warn,
            detail: detail.into(),
            fix: fix.into(),
        }
    }
    pub fn fail(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
        Check {
            name,
            level: Level::Fail,
            detail: detail.into(),
            fix: fix.into(),
        }
    }
}

/// What an external command printed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunOutput {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

/// Runs external commands (`ethtool`, `dmesg`); tests substitute canned answers.
pub trait Runner: Send + Sync {
    /// Runs `program args…`; `Err` when it cannot be started (e.g. not installed).
    fn run(&self, program: &str, args: &[&str]) -> std::io::Result<RunOutput>;
}

/// Runs commands for real, with `LC_ALL=C` so their output parses.
#[derive(Debug, Default)]
pub struct SystemRunner;

impl Runner for SystemRunner {
    fn run(&self, program: &str, args: &[&str]) -> std::io::Result<RunOutput> {
        let out = std::process::Command::new(program)
            .args(args)
            .env("LC_ALL", "C")
            .stdin(std::process::Stdio::null())
            .output()?;
        Ok(RunOutput {
            success: out.status.success(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }
}

/// A resource limit: (soft, hard), `None` meaning unlimited.
pub type Rlimit = (Option<u64>, Option<u64>);

/// The machine being checked.
pub struct Host {
    /// Where `/` of the checked machine is.
    pub root: PathBuf,
    /// Its environment.
    pub env: HashMap<String, String>,
    pub runner: Arc<dyn Runner>,
    /// `RLIMIT_MEMLOCK`.
    pub memlock: Box<dyn Fn() -> std::io::Result<Rlimit> + Send + Sync>,
    /// Whether to ask the CUDA driver for devices too (only for the real root).
    pub probe_cuda: bool,
}

impl Host {
    /// This machine, as this process sees it.
    pub fn real(root: &Path) -> Host {
        Host {
            root: root.to_path_buf(),
            env: std::env::vars().collect(),
            runner: Arc::new(SystemRunner),
            memlock: Box::new(|| {
                let l = rustix::process::getrlimit(rustix::process::Resource::Memlock);
                Ok((l.current, l.maximum))
            }),
            probe_cuda: root == Path::new("/"),
        }
    }

    /// `abs` (an absolute path on the checked machine) under the root.
    pub fn path(&self, abs: impl AsRef<Path>) -> PathBuf {
        let abs = abs.as_ref();
        self.root.join(abs.strip_prefix("/").unwrap_or(abs))
    }

    pub fn var(&self, key: &str) -> Option<&str> {
        self.env.get(key).map(String::as_str)
    }

    /// The data NICs the plugin will use (`NCCL_GPUDIRECTTCPX_SOCKET_IFNAME`), or GCP's when unset;
    /// and whether they came from the environment.
    pub fn data_nics(&self) -> (Vec<String>, bool) {
        match self.var("NCCL_GPUDIRECTTCPX_SOCKET_IFNAME") {
            Some(v) if !v.trim().is_empty() => (split_list(v), true),
            _ => {
                let rec = parse_recommended_env(RECOMMENDED_ENV);
                let v = rec
                    .get("NCCL_GPUDIRECTTCPX_SOCKET_IFNAME")
                    .cloned()
                    .unwrap_or_default();
                (split_list(&v), false)
            }
        }
    }

    /// The control NIC (`NCCL_GPUDIRECTTCPX_CTRL_DEV`), or GCP's when unset.
    pub fn ctrl_nic(&self) -> (String, bool) {
        match self.var("NCCL_GPUDIRECTTCPX_CTRL_DEV") {
            Some(v) if !v.trim().is_empty() => (v.trim().to_string(), true),
            _ => (
                parse_recommended_env(RECOMMENDED_ENV)
                    .get("NCCL_GPUDIRECTTCPX_CTRL_DEV")
                    .cloned()
                    .unwrap_or_default(),
                false,
            ),
        }
    }
}

fn split_list(v: &str) -> Vec<String> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
}

/// The daemon settings the doctor checks against.
#[derive(Debug, Clone)]
pub struct Target {
    /// `topology.map` and `plugin.devices` (`None`: all).
    pub topology: MapSpec,
    pub devices: Option<Vec<i32>>,
    pub plugin: PluginChoice,
    pub api_socket: PathBuf,
    /// TCP addresses the daemon would listen on, with what they are for.
    pub tcp: Vec<(&'static str, SocketAddr)>,
    /// The peer service's address and `peer.advertise` (what descriptors will carry).
    pub peer_listen: SocketAddr,
    pub peer_advertise: Vec<String>,
}

impl Default for Target {
    /// The built-in emulation with the default settings (for tests that set a few).
    fn default() -> Target {
        Target {
            topology: MapSpec::Pci,
            devices: None,
            plugin: PluginChoice::BuiltinEmulation,
            api_socket: PathBuf::from(crate::config::DEFAULT_API_SOCKET),
            tcp: Vec::new(),
            peer_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            peer_advertise: Vec::new(),
        }
    }
}

impl Target {
    pub fn from_config(cfg: &Config) -> Target {
        let mut tcp = vec![("peer service", cfg.peer_listen)];
        if let Some(a) = cfg.api_tcp {
            tcp.push(("client API", a));
        }
        if let Some(a) = cfg.metrics_listen {
            tcp.push(("metrics", a));
        }
        Target {
            topology: cfg.topology.clone(),
            devices: cfg.devices.clone(),
            plugin: cfg.plugin.clone(),
            api_socket: cfg.api_socket.clone(),
            tcp,
            peer_listen: cfg.peer_listen,
            peer_advertise: cfg.peer_advertise.clone(),
        }
    }
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub checks: Vec<Check>,
    /// Each GPU's PCIe-nearest data NIC, when it could be worked out.
    pub lane_plan: Vec<LaneChoice>,
    /// The plugin's devices, when it loaded.
    pub plugin_devices: Vec<plugin::DeviceSummary>,
    /// Each GPU's NIC(s) as the daemon would use them (`topology`), when they could be worked out.
    pub topology: Vec<GpuNicsLine>,
}

impl Report {
    pub fn count(&self, level: Level) -> usize {
        self.checks.iter().filter(|c| c.level == level).count()
    }

    pub fn worst(&self) -> Level {
        self.checks.iter().map(|c| c.level).max().unwrap_or(Level::Ok)
    }

    pub fn get(&self, name: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.name == name)
    }

    pub fn to_json(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).expect("plain data");
        v["summary"] = serde_json::json!({
            "ok": self.count(Level::Ok),
            "warn": self.count(Level::Warn),
            "fail": self.count(Level::Fail),
        });
        v
    }

    /// The report as a table: one line per check, its fix on the line below when not ok, then
    /// the plugin's devices and the lane plan.
    pub fn to_table(&self) -> String {
        let w = self.checks.iter().map(|c| c.name.len()).max().unwrap_or(5).max(5);
        let mut s = String::new();
        let _ = writeln!(s, "{:<w$}  {:<7}DETAIL", "CHECK", "STATUS");
        for c in &self.checks {
            let _ = writeln!(s, "{:<w$}  {:<7}{}", c.name, c.level.to_string(), c.detail);
            if !c.fix.is_empty() {
                let _ = writeln!(s, "{:<w$}  {:<7}fix: {}", "", "", c.fix);
            }
        }
        if !self.plugin_devices.is_empty() {
            let _ = writeln!(s, "\nplugin devices:");
            for d in &self.plugin_devices {
                let _ = writeln!(
                    s,
                    "  {:>2}  {:<12} {:>7} Mbps  {}  pci {}",
                    d.dev,
                    d.name,
                    d.speed_mbps,
                    d.pointers,
                    d.pci_path.as_deref().unwrap_or("-")
                );
            }
        }
        if !self.lane_plan.is_empty() {
            let _ = writeln!(s, "\nlane plan (each GPU's PCIe-nearest data NIC):");
            for l in &self.lane_plan {
                let _ = writeln!(
                    s,
                    "  GPU {}  ->  {:<6} ({})",
                    l.gpu,
                    l.nic.as_deref().unwrap_or("-"),
                    l.relation
                );
            }
        }
        if !self.topology.is_empty() {
            let _ = writeln!(s, "\ntopology (the NIC(s) each GPU's comms are opened on):");
            for l in &self.topology {
                let _ = writeln!(
                    s,
                    "  GPU {} {}  ->  {:<6} ({})",
                    l.gpu,
                    l.pci_bus_id,
                    l.nics.join("+"),
                    l.relation
                );
            }
        }
        let _ = writeln!(
            s,
            "\n{} ok, {} warn, {} fail",
            self.count(Level::Ok),
            self.count(Level::Warn),
            self.count(Level::Fail)
        );
        s
    }
}

/// Runs every check.
pub fn run(host: &Host, target: &Target) -> Report {
    let mut checks = Vec::new();
    let (mut plugin_checks, plugin_devices) = plugin::check_plugin(host, &target.plugin);
    checks.append(&mut plugin_checks);
    if let PluginChoice::Path(p) = &target.plugin {
        checks.push(system::check_noexec(host, p));
    }
    checks.push(system::check_chunk_size(host));
    checks.push(system::check_plugin_settings(host));
    checks.push(system::check_tcpx_env(host));
    checks.push(system::check_nics(host));
    checks.push(system::check_data_split(host));
    checks.push(system::check_kernel_log(host));
    checks.push(system::check_rxdm(host));
    checks.push(system::check_gpus(host));
    let (lane_check, plan) = lanes::check_lanes(host);
    checks.push(lane_check);
    let (topology_check, topology) =
        topology::check_topology(host, &target.topology, target.devices.as_deref(), &plugin_devices);
    checks.push(topology_check);
    checks.push(system::check_memlock(host));
    checks.push(system::check_ports(target));
    checks.push(advertise::check_advertise(host, target));
    Report {
        checks,
        lane_plan: plan,
        plugin_devices,
        topology,
    }
}

/// `tcpxd doctor`: resolves the daemon's configuration, runs the checks on this machine and
/// prints the report. Returns whether no check failed.
pub fn main(args: &DoctorArgs) -> bool {
    let host = Host::real(&args.root);
    let mut report = match Config::resolve(&args.daemon, &|k| host.env.get(k).cloned()) {
        Ok(cfg) => {
            let mut r = run(&host, &Target::from_config(&cfg));
            r.checks
                .insert(0, Check::ok("config", config_summary(&args.daemon)));
            r
        }
        Err(e) => Report {
            checks: vec![Check::fail(
                "config",
                e.to_string(),
                "fix the setting named (docs/CONFIG.md lists every setting)",
            )],
            lane_plan: Vec::new(),
            plugin_devices: Vec::new(),
            topology: Vec::new(),
        },
    };
    report.checks.sort_by_key(|c| order(c.name));
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report.to_json()).expect("plain data")
        );
    } else {
        print!("{}", report.to_table());
    }
    report.worst() != Level::Fail
}

fn config_summary(a: &DaemonArgs) -> String {
    match &a.config {
        Some(p) => format!("{} resolves (with the environment and flags)", p.display()),
        None => "defaults, the environment and flags resolve (no --config)".into(),
    }
}

/// Keeps the report in the order the checks ran, with `config` first.
fn order(name: &str) -> usize {
    CHECK_NAMES.iter().position(|n| *n == name).unwrap_or(usize::MAX)
}

/// Every check, in report order.
pub const CHECK_NAMES: &[&str] = &[
    "config",
    "plugin.load",
    "plugin.devices",
    "plugin.noexec",
    "env.chunk_size",
    "env.tcpx",
    "nics",
    "nics.data_split",
    "kernel.devmem",
    "rxdm.sockets",
    "gpus",
    "lanes",
    "topology",
    "memlock",
    "ports",
    "peer.advertise",
];

/// Reads a small text file, trimmed.
pub(crate) fn read_trim(path: &Path) -> std::io::Result<String> {
    std::fs::read_to_string(path).map(|s| s.trim().to_string())
}

/// Parses `KEY=VALUE` lines (comments, blanks and surrounding quotes dropped), in order.
pub(crate) fn parse_env_lines(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().trim_matches('"').to_string()))
        .collect()
}

#[cfg(test)]
pub(crate) mod testutil;
