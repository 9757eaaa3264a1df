//! The environment, read once at the first `init` (see `docs/EMULATION.md` for every variable).

use crate::hold::{self, HoldGate};
use crate::rng;
use crate::topology::{self, Binding, GpuSpec};
use std::ffi::{CStr, CString};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

pub(crate) const MAX_DEVICES: usize = 16;
pub(crate) const MAX_NSOCKS: u32 = 8;
pub(crate) const MAX_NTHREADS: u32 = 16;
pub(crate) const MAX_SOCKETS: u32 = 64;
/// `src_off` is a u32: the bounce buffer must stay below 4 GiB.
pub(crate) const MAX_BOUNCE_PAGES: u32 = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HostRecv {
    Bounce,
    Direct,
}

/// Where the bounce buffer lives (`TCPXEMU_BOUNCE`, resolved at init).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bounce {
    /// Host memory (no CUDA here, or `TCPXEMU_BOUNCE=host`).
    Host,
    /// Device memory through the CUDA driver API.
    Cuda,
}

/// What the emulation does where the real plugin calls `exit(1)` (`TCPXEMU_FAILSTOP`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FailStop {
    /// Fail the comm with the plugin's words (every later post and test fails); the default.
    Fail,
    /// Log the plugin's words, then `exit(1)` the process, as the shipped plugin does.
    Exit,
}

/// What `closeSend`/`closeRecv` do with requests still under way (`TCPXEMU_CLOSE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CloseMode {
    /// Shut the sockets down and join the helpers at once; the default.
    Prompt,
    /// As Google's plugin: a comm with a posted request whose bytes have not all moved is
    /// closed only once they have, or once the peer closed its end (`tcpxClose` joins helper
    /// threads that look at their stop flag only when idle, src/net_tcpx.cc).
    Plugin,
}

/// How much a `test` call moves (`TCPXEMU_PROGRESS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Progress {
    /// As Google's plugin (`tcpxTest` → `tcpxCommProgress`, src/net_tcpx.cc 1099–1311): each
    /// call on a comm activates at most one posted request and moves only the oldest active one
    /// (a send: at most one chunk per data socket with room, at most [`MAX_TASKS`] chunks queued
    /// on a socket; a receive: its header matched). The default.
    Faithful,
    /// The emulation before session 33: a call dispatches every posted send whole and matches
    /// every arrived header to a posted receive. For A/B measurements only.
    Eager,
}

/// Chunks a data socket's thread may hold queued or in flight (the real plugin's `MAX_TASKS`,
/// src/work_queue.h).
pub(crate) const MAX_TASKS: u32 = 6;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragments {
    Page,
    Odd,
}

/// A device-wide pacing clock shared by every send comm on the device (`RATE_GBPS`).
#[derive(Debug)]
pub(crate) struct Pacer {
    bytes_per_sec: f64,
    next_free: Mutex<Option<Instant>>,
}

impl Pacer {
    /// Reserve `len` bytes of wire time; returns when the reservation ends (the chunk may be
    /// written then), or `None` when unlimited.
    pub(crate) fn reserve(&self, len: u64) -> Option<Instant> {
        if self.bytes_per_sec <= 0.0 {
            return None;
        }
        let dur = Duration::from_secs_f64(len as f64 / self.bytes_per_sec);
        let now = Instant::now();
        let mut next = self.next_free.lock().unwrap_or_else(|e| e.into_inner());
        let start = match *next {
            Some(t) if t > now => t,
            _ => now,
        };
        let end = start + dur;
        *next = Some(end);
        Some(end)
    }
}

#[derive(Debug)]
pub(crate) struct Device {
    pub(crate) index: usize,
    pub(crate) addr: IpAddr,
    pub(crate) ifname: &'static CStr,
    pub(crate) rate_gbps: f64,
    pub(crate) delay: Duration,
    pub(crate) fail_after: Option<u64>,
    pub(crate) fragments: Fragments,
    pub(crate) pacer: Pacer,
    /// `PCI_PATH`: what `getProperties` reports as `pciPath` (NULL for `none`).
    pub(crate) pci_path: Option<&'static CStr>,
    /// `GPUS`: the GPUs this NIC serves, as set (resolved into [`Config::binding`]).
    pub(crate) gpus: GpuSpec,
}

#[derive(Debug)]
pub(crate) struct Config {
    pub(crate) devices: Vec<Device>,
    pub(crate) nsocks: u32,
    pub(crate) nthreads: u32,
    pub(crate) chunk_size: u32,
    pub(crate) host_recv: HostRecv,
    pub(crate) bounce: Bounce,
    /// Why `bounce` is what it is (for the init line and the CUDA-in-host-mode error).
    pub(crate) bounce_why: String,
    /// `TCPXEMU_CUDA_DEVICE`: whose primary context to use when no context is current.
    pub(crate) cuda_device: i32,
    /// Set when `init` must fail (`TCPXEMU_BOUNCE=cuda` without CUDA); every later call fails.
    pub(crate) init_error: Option<String>,
    pub(crate) bounce_pages: u32,
    /// `TCPXEMU_HOST_BLOCK_PAGES`: pages per pool block in host mode (1: every page drawn at
    /// random; >1: the CUDA mode's block allocation, exercised without a GPU).
    pub(crate) host_block_pages: u32,
    /// `TCPXEMU_BOUNCE_POPULATE`: host mode, fault the bounce pages in when the receive comm is
    /// made (by its socket threads, before their first receive), as the real plugin's bounce
    /// buffer is backed from accept on; off, each page faults on its first receive.
    pub(crate) bounce_populate: bool,
    pub(crate) seed: u64,
    pub(crate) flow_wait: Duration,
    pub(crate) conn_retry: u32,
    /// `TCPXEMU_FAILSTOP`: fail the comm (default) or exit the process on the real plugin's
    /// `exit(1)` paths.
    pub(crate) failstop: FailStop,
    /// `TCPXEMU_CLOSE`: close promptly (default) or wait for requests under way as the plugin.
    pub(crate) close: CloseMode,
    /// `TCPXEMU_PROGRESS`: what one `test` call moves (faithful by default).
    pub(crate) progress: Progress,
    /// CUDA mode: the GPUs present and which each NIC serves (`None` in host mode: no GPU, no
    /// binding).
    pub(crate) binding: Option<Binding>,
    /// `TCPXEMU_HOLD_FILE`: the hold gate of every send comm of the process (`hold.rs`).
    pub(crate) hold: Option<HoldGate>,
}

impl Config {
    pub(crate) fn summary(&self) -> String {
        let mut s = format!(
            "tcpxemu: {} device(s), {}x{} data sockets per comm, NCCL_DYNAMIC_CHUNK_SIZE={}, \
             bounce={} ({}), host receive={}, bounce pages={}{}, seed={:#x}, flow-steering wait={}us, \
             connection retry={}, failstop={}, close={}, progress={}, hold={}",
            self.devices.len(),
            self.nsocks,
            self.nthreads,
            self.chunk_size,
            match self.bounce {
                Bounce::Host => "host",
                Bounce::Cuda => "cuda",
            },
            self.bounce_why,
            match (self.bounce, self.host_recv) {
                (Bounce::Cuda, _) => "direct (CUDA mode)",
                (Bounce::Host, HostRecv::Bounce) => "bounce",
                (Bounce::Host, HostRecv::Direct) => "direct",
            },
            self.bounce_pages,
            match (self.bounce, self.bounce_populate) {
                (Bounce::Host, true) => " (populated)",
                (Bounce::Host, false) => " (faulted on first use)",
                (Bounce::Cuda, _) => "",
            },
            self.seed,
            self.flow_wait.as_micros(),
            self.conn_retry,
            match self.failstop {
                FailStop::Fail => "fail",
                FailStop::Exit => "exit",
            },
            match self.close {
                CloseMode::Prompt => "prompt",
                CloseMode::Plugin => "plugin",
            },
            match self.progress {
                Progress::Faithful => "faithful",
                Progress::Eager => "eager",
            },
            match &self.hold {
                Some(h) => format!("{} bytes while {} exists", h.after, h.file.display()),
                None => "off".to_string(),
            }
        );
        for d in &self.devices {
            s.push_str(&format!(
                "; dev{} {} {} pci={} gpus={} rate={}Gbps delay={}us fail_after={} fragments={}",
                d.index,
                d.ifname.to_string_lossy(),
                d.addr,
                d.pci_path
                    .map(|p| p.to_string_lossy().into_owned())
                    .unwrap_or_else(|| "none".into()),
                match &self.binding {
                    Some(b) => b.served_list(d.index),
                    None => "not modelled (host mode)".into(),
                },
                d.rate_gbps,
                d.delay.as_micros(),
                d.fail_after
                    .map(|b| b.to_string())
                    .unwrap_or_else(|| "off".into()),
                match d.fragments {
                    Fragments::Page => "page",
                    Fragments::Odd => "odd",
                }
            ));
        }
        s
    }
}

static CONFIG: OnceLock<Config> = OnceLock::new();

pub(crate) fn get() -> Option<&'static Config> {
    CONFIG.get()
}

/// Read the environment on the first call; later calls return the same configuration and no
/// warnings. The second value lists the warnings to log.
///
/// The first call also applies the PAT guard (`nccl.rs`); its log lines come third.
pub(crate) fn init_from_env() -> (&'static Config, Vec<String>, crate::nccl::Lines) {
    let mut warnings = Vec::new();
    let mut nccl = Vec::new();
    let mut fresh = false;
    let cfg = CONFIG.get_or_init(|| {
        fresh = true;
        nccl = crate::nccl::guard_pat();
        from_env(&mut warnings)
    });
    if !fresh {
        warnings.clear();
        nccl.clear();
    }
    (cfg, warnings, nccl)
}

fn var(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

fn parse<T: std::str::FromStr>(name: &str, raw: Option<String>, default: T, w: &mut Vec<String>) -> T {
    match raw {
        None => default,
        Some(v) => match v.parse::<T>() {
            Ok(x) => x,
            Err(_) => {
                w.push(format!("tcpxemu: cannot parse {name}={v:?}; using the default"));
                default
            }
        },
    }
}

/// `TCPXEMU_DEV<n>_<NAME>`, else `TCPXEMU_<NAME>`: the variable name used and its value.
fn knob(dev: usize, name: &str) -> (String, Option<String>) {
    let per = format!("TCPXEMU_DEV{dev}_{name}");
    if let Some(v) = var(&per) {
        return (per, Some(v));
    }
    let global = format!("TCPXEMU_{name}");
    let v = var(&global);
    (global, v)
}

fn parse_fragments(name: &str, raw: Option<String>, w: &mut Vec<String>) -> Fragments {
    match raw.as_deref() {
        None | Some("page") => Fragments::Page,
        Some("odd") => Fragments::Odd,
        Some(other) => {
            w.push(format!(
                "tcpxemu: {name}={other:?} is neither page nor odd; using page"
            ));
            Fragments::Page
        }
    }
}

fn from_env(w: &mut Vec<String>) -> Config {
    let mut ndev: usize = parse("TCPXEMU_DEVICES", var("TCPXEMU_DEVICES"), 1, w);
    if !(1..=MAX_DEVICES).contains(&ndev) {
        w.push(format!(
            "tcpxemu: TCPXEMU_DEVICES={ndev} is outside 1..={MAX_DEVICES}; clamping"
        ));
        ndev = ndev.clamp(1, MAX_DEVICES);
    }
    let addrs: Vec<String> = var("TCPXEMU_ADDRS")
        .map(|v| v.split(',').map(|s| s.trim().to_string()).collect())
        .unwrap_or_default();
    let names: Vec<String> = var("TCPXEMU_IFNAMES")
        .map(|v| v.split(',').map(|s| s.trim().to_string()).collect())
        .unwrap_or_default();
    if !addrs.is_empty() && addrs.len() != ndev {
        w.push(format!(
            "tcpxemu: TCPXEMU_ADDRS has {} entries for {ndev} devices; the rest use 127.0.0.(1+dev)",
            addrs.len()
        ));
    }
    let mut devices = Vec::with_capacity(ndev);
    for d in 0..ndev {
        let default_addr = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 1 + d as u8));
        let addr = match addrs.get(d).filter(|s| !s.is_empty()) {
            None => default_addr,
            Some(s) => s
                .trim_start_matches('[')
                .trim_end_matches(']')
                .parse()
                .unwrap_or_else(|_| {
                    w.push(format!(
                        "tcpxemu: TCPXEMU_ADDRS entry {s:?} is not an IP address; dev{d} uses {default_addr}"
                    ));
                    default_addr
                }),
        };
        let name = names
            .get(d)
            .filter(|s| !s.is_empty())
            .cloned()
            .unwrap_or_else(|| format!("tcpxemu{d}"));
        let name = CString::new(name).unwrap_or_else(|_| CString::from(c"tcpxemu"));
        let ifname: &'static CStr = Box::leak(name.into_boxed_c_str());

        let (n, raw) = knob(d, "RATE_GBPS");
        let mut rate_gbps: f64 = parse(&n, raw, 0.0, w);
        if !rate_gbps.is_finite() || rate_gbps < 0.0 {
            w.push(format!("tcpxemu: {n}={rate_gbps} is invalid; no rate limit"));
            rate_gbps = 0.0;
        }
        let (n, raw) = knob(d, "DELAY_US");
        let delay = Duration::from_micros(parse(&n, raw, 0u64, w));
        let (n, raw) = knob(d, "FAIL_AFTER_BYTES");
        let fail_after = match raw {
            None => None,
            Some(v) => match v.parse::<u64>() {
                Ok(b) => Some(b),
                Err(_) => {
                    w.push(format!("tcpxemu: cannot parse {n}={v:?}; no injected failure"));
                    None
                }
            },
        };
        let (n, raw) = knob(d, "FRAGMENTS");
        let fragments = parse_fragments(&n, raw, w);
        let (_, raw) = knob(d, "PCI_PATH");
        let pci_path = topology::pci_path(d, raw);
        let (n, raw) = knob(d, "GPUS");
        let gpus = topology::parse_gpus(raw.as_deref()).unwrap_or_else(|why| {
            w.push(format!("tcpxemu: {n}: {why}; using the a3vm default"));
            GpuSpec::Default
        });
        devices.push(Device {
            index: d,
            addr,
            ifname,
            rate_gbps,
            delay,
            fail_after,
            fragments,
            pci_path,
            gpus,
            pacer: Pacer {
                bytes_per_sec: rate_gbps * 1e9 / 8.0,
                next_free: Mutex::new(None),
            },
        });
    }

    let mut nsocks: u32 = parse("NCCL_NSOCKS_PERTHREAD", var("NCCL_NSOCKS_PERTHREAD"), 1, w);
    if !(1..=MAX_NSOCKS).contains(&nsocks) {
        w.push(format!(
            "tcpxemu: NCCL_NSOCKS_PERTHREAD={nsocks} is outside 1..={MAX_NSOCKS}; clamping"
        ));
        nsocks = nsocks.clamp(1, MAX_NSOCKS);
    }
    let mut nthreads: u32 = parse("NCCL_SOCKET_NTHREADS", var("NCCL_SOCKET_NTHREADS"), 1, w);
    if !(1..=MAX_NTHREADS).contains(&nthreads) {
        w.push(format!(
            "tcpxemu: NCCL_SOCKET_NTHREADS={nthreads} is outside 1..={MAX_NTHREADS}; clamping"
        ));
        nthreads = nthreads.clamp(1, MAX_NTHREADS);
    }
    if nsocks * nthreads > MAX_SOCKETS {
        w.push(format!(
            "tcpxemu: {nsocks}x{nthreads} sockets per comm exceeds {MAX_SOCKETS}; using {MAX_SOCKETS}"
        ));
    }
    let chunk_size: u32 = parse("NCCL_DYNAMIC_CHUNK_SIZE", var("NCCL_DYNAMIC_CHUNK_SIZE"), 0, w);
    if chunk_size == 0 {
        w.push("NCCL_DYNAMIC_CHUNK_SIZE is 0: sends will never complete; set it to 524288".to_string());
    }
    let host_recv = match var("TCPXEMU_HOST_RECV").as_deref() {
        None | Some("bounce") => HostRecv::Bounce,
        Some("direct") => HostRecv::Direct,
        Some(other) => {
            w.push(format!(
                "tcpxemu: TCPXEMU_HOST_RECV={other:?} is neither bounce nor direct; using bounce"
            ));
            HostRecv::Bounce
        }
    };
    let mut cuda_device: i32 = parse("TCPXEMU_CUDA_DEVICE", var("TCPXEMU_CUDA_DEVICE"), 0, w);
    if cuda_device < 0 {
        w.push(format!(
            "tcpxemu: TCPXEMU_CUDA_DEVICE={cuda_device} is negative; using 0"
        ));
        cuda_device = 0;
    }
    let want = match var("TCPXEMU_BOUNCE").as_deref() {
        None | Some("auto") => "auto",
        Some("host") => "host",
        Some("cuda") => "cuda",
        Some(other) => {
            w.push(format!(
                "tcpxemu: TCPXEMU_BOUNCE={other:?} is none of auto, host, cuda; using auto"
            ));
            "auto"
        }
    };
    let mut init_error = None;
    let (bounce, bounce_why) = if want == "host" {
        (Bounce::Host, "TCPXEMU_BOUNCE=host".to_string())
    } else {
        match crate::cuda::probe() {
            Ok(n) => {
                if cuda_device >= n {
                    w.push(format!(
                        "tcpxemu: TCPXEMU_CUDA_DEVICE={cuda_device} but there are {n} CUDA device(s); using 0"
                    ));
                    cuda_device = 0;
                }
                (
                    Bounce::Cuda,
                    format!(
                        "TCPXEMU_BOUNCE={want}: {n} CUDA device(s); without a current context, \
                         device {cuda_device}'s primary context"
                    ),
                )
            }
            Err(why) if want == "cuda" => {
                init_error = Some(format!(
                    "tcpxemu: TCPXEMU_BOUNCE=cuda but the CUDA mode cannot run here: {why}"
                ));
                (Bounce::Host, format!("CUDA unavailable: {why}"))
            }
            Err(why) => (Bounce::Host, format!("TCPXEMU_BOUNCE=auto: {why}")),
        }
    };
    if bounce == Bounce::Cuda && host_recv == HostRecv::Bounce && var("TCPXEMU_HOST_RECV").is_some() {
        w.push(
            "tcpxemu: TCPXEMU_HOST_RECV=bounce is ignored in CUDA mode: receives into host memory are \
             direct there, as in the real plugin (TCPXEMU_BOUNCE=host keeps host bounce pages)"
                .to_string(),
        );
    }
    let mut bounce_pages: u32 = parse("TCPXEMU_BOUNCE_PAGES", var("TCPXEMU_BOUNCE_PAGES"), 16384, w);
    if !(1..=MAX_BOUNCE_PAGES).contains(&bounce_pages) {
        w.push(format!(
            "tcpxemu: TCPXEMU_BOUNCE_PAGES={bounce_pages} is outside 1..={MAX_BOUNCE_PAGES}; clamping"
        ));
        bounce_pages = bounce_pages.clamp(1, MAX_BOUNCE_PAGES);
    }
    let mut host_block_pages: u32 = parse("TCPXEMU_HOST_BLOCK_PAGES", var("TCPXEMU_HOST_BLOCK_PAGES"), 1, w);
    if !(1..=64).contains(&host_block_pages) {
        w.push(format!(
            "tcpxemu: TCPXEMU_HOST_BLOCK_PAGES={host_block_pages} is outside 1..=64; clamping"
        ));
        host_block_pages = host_block_pages.clamp(1, 64);
    }
    let bounce_populate = match var("TCPXEMU_BOUNCE_POPULATE").as_deref() {
        None | Some("1") => true,
        Some("0") => false,
        Some(other) => {
            w.push(format!(
                "tcpxemu: TCPXEMU_BOUNCE_POPULATE={other:?} is neither 0 nor 1; using 1"
            ));
            true
        }
    };
    let seed = match var("TCPXEMU_SEED") {
        None => rng::entropy(),
        Some(v) => {
            let parsed = match v.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16).ok(),
                None => v.parse().ok(),
            };
            parsed.unwrap_or_else(|| {
                w.push(format!(
                    "tcpxemu: cannot parse TCPXEMU_SEED={v:?}; using a random seed"
                ));
                rng::entropy()
            })
        }
    };
    let flow_wait = Duration::from_micros(parse(
        "NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS",
        var("NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS"),
        0u64,
        w,
    ));
    let conn_retry = parse(
        "NCCL_GPUDIRECTTCPX_CONNECTION_RETRY",
        var("NCCL_GPUDIRECTTCPX_CONNECTION_RETRY"),
        3u32,
        w,
    );
    let binding = if bounce == Bounce::Cuda {
        let n = crate::cuda::probe().unwrap_or(0);
        let mut gpus = Vec::new();
        for i in 0..n {
            match crate::cuda::pci_bus_id(i) {
                Ok(b) => gpus.push(b),
                Err(e) => {
                    w.push(format!("tcpxemu: {e}; GPU {i} is named by its ordinal only"));
                    gpus.push(format!("GPU {i}"));
                }
            }
        }
        let specs: Vec<GpuSpec> = devices.iter().map(|d| d.gpus.clone()).collect();
        Some(Binding::resolve(gpus, &specs, w))
    } else {
        None
    };
    let failstop = match var("TCPXEMU_FAILSTOP").as_deref() {
        None | Some("fail") => FailStop::Fail,
        Some("exit") => FailStop::Exit,
        Some(other) => {
            w.push(format!(
                "tcpxemu: TCPXEMU_FAILSTOP={other:?} is neither fail nor exit; using fail"
            ));
            FailStop::Fail
        }
    };
    let close = match var("TCPXEMU_CLOSE").as_deref() {
        None | Some("prompt") => CloseMode::Prompt,
        Some("plugin") => CloseMode::Plugin,
        Some(other) => {
            w.push(format!(
                "tcpxemu: TCPXEMU_CLOSE={other:?} is neither prompt nor plugin; using prompt"
            ));
            CloseMode::Prompt
        }
    };
    let progress = match var("TCPXEMU_PROGRESS").as_deref() {
        None | Some("faithful") => Progress::Faithful,
        Some("eager") => Progress::Eager,
        Some(other) => {
            w.push(format!(
                "tcpxemu: TCPXEMU_PROGRESS={other:?} is neither faithful nor eager; using faithful"
            ));
            Progress::Faithful
        }
    };
    let hold = var("TCPXEMU_HOLD_FILE").map(|f| {
        let after = parse(
            "TCPXEMU_HOLD_AFTER_BYTES",
            var("TCPXEMU_HOLD_AFTER_BYTES"),
            hold::DEFAULT_AFTER_BYTES,
            w,
        );
        HoldGate::new(f.into(), after)
    });
    Config {
        hold,
        devices,
        nsocks,
        nthreads,
        chunk_size,
        host_recv,
        bounce,
        bounce_why,
        cuda_device,
        init_error,
        bounce_pages,
        host_block_pages,
        bounce_populate,
        seed,
        flow_wait,
        conn_retry,
        failstop,
        close,
        progress,
        binding,
    }
}
