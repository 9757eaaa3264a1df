//! The host checks: mounts, TCPX settings, NICs, the kernel log, RxDM, GPUs, memlock and ports.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::{Check, Host, RECOMMENDED_ENV, Target, parse_env_lines, read_trim};

/// GCP's recommended settings from a tcpx.env text, keeping only the plugin's own variables
/// (`NCCL_DYNAMIC_CHUNK_SIZE`, `NCCL_GPUDIRECTTCPX_*`, and the socket thread counts it reads).
pub fn parse_recommended_env(text: &str) -> BTreeMap<String, String> {
    parse_env_lines(text)
        .into_iter()
        .filter(|(k, _)| {
            k == "NCCL_DYNAMIC_CHUNK_SIZE"
                || k.starts_with("NCCL_GPUDIRECTTCPX_")
                || k == "NCCL_NSOCKS_PERTHREAD"
                || k == "NCCL_SOCKET_NTHREADS"
        })
        .collect()
}

// ---- plugin.noexec -------------------------------------------------------------------------

/// One mount: where, and its per-mount options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub point: PathBuf,
    pub options: Vec<String>,
    pub fstype: String,
}

/// Undoes the octal escapes (`\040` for a space) the kernel writes in mount tables.
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            let v =
                u16::from(b[i + 1] - b'0') * 64 + u16::from(b[i + 2] - b'0') * 8 + u16::from(b[i + 3] - b'0');
            out.push(v as u8);
            i += 4;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses `/proc/self/mountinfo` (mount point in field 5, per-mount options in field 6, the
/// filesystem type after the `-` separator).
pub fn parse_mountinfo(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let sep = f.iter().position(|x| *x == "-")?;
            Some(Mount {
                point: PathBuf::from(unescape(f.get(4)?)),
                options: f.get(5)?.split(',').map(String::from).collect(),
                fstype: f.get(sep + 1).map(|s| s.to_string()).unwrap_or_default(),
            })
        })
        .collect()
}

/// Parses `/proc/mounts` (device, mount point, type, options).
pub fn parse_proc_mounts(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some(Mount {
                point: PathBuf::from(unescape(f.get(1)?)),
                options: f.get(3)?.split(',').map(String::from).collect(),
                fstype: f.get(2)?.to_string(),
            })
        })
        .collect()
}

/// The mount holding `path`: the longest mount point that is a prefix of it (the last one listed
/// wins among equals, as later mounts hide earlier ones).
pub fn mount_of<'a>(mounts: &'a [Mount], path: &Path) -> Option<&'a Mount> {
    mounts
        .iter()
        .enumerate()
        .filter(|(_, m)| path.starts_with(&m.point))
        .max_by_key(|(i, m)| (m.point.components().count(), *i))
        .map(|(_, m)| m)
}

/// `plugin.noexec`: the plugin's directory must not be mounted noexec (dlopen would fail).
pub fn check_noexec(host: &Host, plugin: &Path) -> Check {
    const NAME: &str = "plugin.noexec";
    let mounts = match std::fs::read_to_string(host.path("/proc/self/mountinfo")) {
        Ok(t) => parse_mountinfo(&t),
        Err(_) => match std::fs::read_to_string(host.path("/proc/mounts")) {
            Ok(t) => parse_proc_mounts(&t),
            Err(e) => {
                return Check::warn(
                    NAME,
                    format!("cannot read the mount table (/proc/self/mountinfo, /proc/mounts): {e}"),
                    "run the doctor where /proc is mounted",
                );
            }
        },
    };
    let dir = plugin.parent().unwrap_or(Path::new("/"));
    // On the real root, resolve symlinks so the match is against the mount that really holds it.
    let dir = if host.root == Path::new("/") {
        std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf())
    } else {
        dir.to_path_buf()
    };
    match mount_of(&mounts, &dir) {
        None => Check::warn(
            NAME,
            format!("no mount in the table holds {}", dir.display()),
            "check the plugin path is absolute",
        ),
        Some(m) if m.options.iter().any(|o| o == "noexec") => Check::fail(
            NAME,
            format!(
                "{} is on {} ({}) mounted noexec: the plugin cannot be loaded from there",
                dir.display(),
                m.point.display(),
                m.fstype
            ),
            "copy libnccl-net.so to an executable directory (e.g. /usr/local/tcpx/lib64) and point --plugin there",
        ),
        Some(m) => Check::ok(
            NAME,
            format!(
                "{} is on {} ({}), not noexec",
                dir.display(),
                m.point.display(),
                m.fstype
            ),
        ),
    }
}

// ---- env.chunk_size, env.tcpx --------------------------------------------------------------

/// `env.chunk_size`: NCCL_DYNAMIC_CHUNK_SIZE as the plugin will see it.
pub fn check_chunk_size(host: &Host) -> Check {
    const NAME: &str = "env.chunk_size";
    let rec = parse_recommended_env(RECOMMENDED_ENV);
    let want = rec
        .get("NCCL_DYNAMIC_CHUNK_SIZE")
        .map(String::as_str)
        .unwrap_or(crate::net::DEFAULT_DYNAMIC_CHUNK_SIZE);
    match host.var("NCCL_DYNAMIC_CHUNK_SIZE") {
        None => Check::warn(
            NAME,
            format!("NCCL_DYNAMIC_CHUNK_SIZE is unset; tcpxd sets {want} before loading the plugin"),
            format!("set NCCL_DYNAMIC_CHUNK_SIZE={want} in tcpx.env so every process agrees"),
        ),
        Some(v) => match v.trim().parse::<u64>() {
            Ok(n) if n > 0 && v.trim() == want => Check::ok(NAME, format!("NCCL_DYNAMIC_CHUNK_SIZE={n}")),
            Ok(n) if n > 0 => Check::warn(
                NAME,
                format!("NCCL_DYNAMIC_CHUNK_SIZE={n}; GCP recommends {want}"),
                format!("set NCCL_DYNAMIC_CHUNK_SIZE={want} unless you measured better"),
            ),
            _ => Check::fail(
                NAME,
                format!("NCCL_DYNAMIC_CHUNK_SIZE={v:?}: the plugin makes no progress with 0 or garbage"),
                format!("set NCCL_DYNAMIC_CHUNK_SIZE={want}"),
            ),
        },
    }
}

/// `env.tcpx`: every NCCL_GPUDIRECTTCPX_* (and socket thread) setting against GCP's values.
pub fn check_tcpx_env(host: &Host) -> Check {
    const NAME: &str = "env.tcpx";
    let rec = parse_recommended_env(RECOMMENDED_ENV);
    let mut same = 0;
    let mut differ = Vec::new();
    let mut unset = Vec::new();
    for (k, want) in rec.iter().filter(|(k, _)| *k != "NCCL_DYNAMIC_CHUNK_SIZE") {
        match host.var(k) {
            Some(v) if v.trim().trim_matches('"') == want => same += 1,
            Some(v) => differ.push(format!("{k}={v} (GCP: {want})")),
            None => unset.push(k.clone()),
        }
    }
    if unset.iter().any(|k| k == "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME") {
        return Check::fail(
            NAME,
            format!(
                "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME is unset (also unset: {})",
                unset.len() - 1
            ),
            "load deploy/systemd/tcpx.env (EnvironmentFile=) or the DaemonSet's env, adjusted to this VM's NICs",
        );
    }
    if differ.is_empty() && unset.is_empty() {
        return Check::ok(NAME, format!("{same} settings match GCP's recommendation"));
    }
    let mut detail = format!("{same} match");
    if !differ.is_empty() {
        detail += &format!("; differ: {}", differ.join("; "));
    }
    if !unset.is_empty() {
        detail += &format!("; unset: {}", unset.join(", "));
    }
    Check::warn(
        NAME,
        detail,
        "compare with deploy/systemd/tcpx.env; interface names and CPU bindings may legitimately differ per VM",
    )
}

// ---- nics ----------------------------------------------------------------------------------

/// `nics`: the data NICs and the control NIC exist and are up; their speeds.
pub fn check_nics(host: &Host) -> Check {
    const NAME: &str = "nics";
    let (data, from_env) = host.data_nics();
    let (ctrl, _) = host.ctrl_nic();
    let mut names = data.clone();
    if !ctrl.is_empty() && !names.contains(&ctrl) {
        names.push(ctrl.clone());
    }
    let mut parts = Vec::new();
    let mut missing = Vec::new();
    let mut down = Vec::new();
    let mut no_speed = Vec::new();
    for n in &names {
        let dir = host.path(format!("/sys/class/net/{n}"));
        if !dir.exists() {
            missing.push(n.clone());
            continue;
        }
        let state = read_trim(&dir.join("operstate")).unwrap_or_else(|_| "unknown".into());
        let speed = read_trim(&dir.join("speed"))
            .ok()
            .and_then(|s| s.parse::<i64>().ok())
            .filter(|s| *s > 0);
        match speed {
            Some(s) => parts.push(format!("{n} {state} {} Gb/s", s / 1000)),
            None => {
                no_speed.push(n.clone());
                parts.push(format!("{n} {state} speed unknown"));
            }
        }
        if state != "up" {
            down.push(format!("{n} ({state})"));
        }
    }
    let source = if from_env {
        "from NCCL_GPUDIRECTTCPX_SOCKET_IFNAME/CTRL_DEV"
    } else {
        "GCP's defaults: NCCL_GPUDIRECTTCPX_SOCKET_IFNAME unset"
    };
    if !missing.is_empty() || !down.is_empty() {
        let mut d = String::new();
        if !missing.is_empty() {
            d += &format!("missing: {}", missing.join(", "));
        }
        if !down.is_empty() {
            if !d.is_empty() {
                d += "; ";
            }
            d += &format!("not up: {}", down.join(", "));
        }
        if !parts.is_empty() {
            d += &format!("; {}", parts.join(", "));
        }
        return Check::fail(
            NAME,
            format!("{d} ({source})"),
            "name this VM's gVNIC data interfaces in NCCL_GPUDIRECTTCPX_SOCKET_IFNAME (ip -br link) and bring them up",
        );
    }
    if !no_speed.is_empty() {
        return Check::warn(
            NAME,
            format!("{} ({source})", parts.join(", ")),
            "the driver reports no link speed; check the NICs with ethtool",
        );
    }
    Check::ok(NAME, format!("{} ({source})", parts.join(", ")))
}

/// The `tcp-data-split` value in ethtool's output: `ethtool -k` lists it as a feature on
/// Google's TCPX kernels ("tcp-data-split: on"), upstream `ethtool -g` as a ring parameter
/// ("TCP data split: on").
fn parse_data_split(text: &str) -> Option<String> {
    text.lines()
        .find(|l| {
            let l = l.to_ascii_lowercase();
            l.contains("tcp-data-split") || l.contains("tcp data split")
        })
        .and_then(|l| l.split_once(':'))
        .and_then(|(_, v)| v.split_whitespace().next())
        .map(|v| v.to_ascii_lowercase())
}

/// One NIC's tcp-data-split, from `ethtool -k` then `ethtool -g`; `Err` says why it is unknown.
fn data_split_of(host: &Host, nic: &str) -> Result<String, String> {
    let mut why = String::new();
    for flag in ["-k", "-g"] {
        match host.runner.run("ethtool", &[flag, nic]) {
            Ok(o) if o.success => match parse_data_split(&o.stdout) {
                Some(v) => return Ok(v),
                None => why = "ethtool does not report tcp-data-split".into(),
            },
            Ok(o) => why = format!("ethtool {flag}: {}", o.stderr.trim()),
            Err(e) if why.is_empty() => why = format!("ethtool unavailable: {e}"),
            Err(_) => {}
        }
    }
    Err(why)
}

/// `nics.data_split`: header/data split (`tcp-data-split`) on each data NIC, from ethtool.
pub fn check_data_split(host: &Host) -> Check {
    const NAME: &str = "nics.data_split";
    let (data, _) = host.data_nics();
    let mut on = Vec::new();
    let mut off = Vec::new();
    // Why it is unknown -> the NICs it is unknown on.
    let mut unknown: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for n in &data {
        match data_split_of(host, n) {
            Ok(v) if v == "on" || v == "enabled" => on.push(n.clone()),
            Ok(v) if v == "off" || v == "disabled" => off.push(format!("{n} ({v})")),
            Ok(v) => unknown
                .entry(format!("tcp-data-split {v}"))
                .or_default()
                .push(n.clone()),
            Err(why) => unknown.entry(why).or_default().push(n.clone()),
        }
    }
    if !off.is_empty() {
        return Check::fail(
            NAME,
            format!("tcp-data-split off on {}", off.join(", ")),
            "enable header split on those NICs (ethtool -G <nic> tcp-data-split on), as GPUDirect-TCPX images set up",
        );
    }
    if !unknown.is_empty() {
        return Check::warn(
            NAME,
            format!(
                "unknown on {}{}",
                unknown
                    .iter()
                    .map(|(why, nics)| format!("{} ({why})", nics.join(", ")))
                    .collect::<Vec<_>>()
                    .join("; "),
                if on.is_empty() {
                    String::new()
                } else {
                    format!("; on: {}", on.join(", "))
                }
            ),
            "install ethtool (6.x reads tcp-data-split with -g) or check by hand: ethtool -k <nic>; ethtool -g <nic>",
        );
    }
    if on.is_empty() {
        return Check::warn(
            NAME,
            "no data NICs to check",
            "set NCCL_GPUDIRECTTCPX_SOCKET_IFNAME",
        );
    }
    Check::ok(NAME, format!("tcp-data-split on: {}", on.join(", ")))
}

// ---- kernel.devmem -------------------------------------------------------------------------

/// Reads the kernel log: `<root>/dev/kmsg` without blocking, else `dmesg`.
fn kernel_log(host: &Host) -> Result<String, String> {
    let kmsg = host.path("/dev/kmsg");
    let from_kmsg = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&kmsg)
        .and_then(|mut f| {
            // /dev/kmsg hands out one record per read and EAGAIN at the end; a file just ends.
            let mut text = String::new();
            let mut buf = vec![0u8; 16 * 1024];
            loop {
                match f.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => text.push_str(&String::from_utf8_lossy(&buf[..n])),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    // A record overwritten while reading: skip on.
                    Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
                    Err(e) => return Err(e),
                }
                if text.len() > 64 << 20 {
                    break;
                }
            }
            Ok(text)
        });
    let kmsg_err = match from_kmsg {
        Ok(t) => return Ok(t),
        Err(e) => format!("{}: {e}", kmsg.display()),
    };
    match host.runner.run("dmesg", &[]) {
        Ok(o) if o.success => Ok(o.stdout),
        Ok(o) => Err(format!("{kmsg_err}; dmesg: {}", o.stderr.trim())),
        Err(e) => Err(format!("{kmsg_err}; dmesg: {e}")),
    }
}

/// `kernel.devmem`: the kernel log mentions devmem TCP (and no devmem errors).
pub fn check_kernel_log(host: &Host) -> Check {
    const NAME: &str = "kernel.devmem";
    let log = match kernel_log(host) {
        Ok(l) => l,
        Err(why) => {
            return Check::warn(
                NAME,
                format!("kernel log unreadable: {why}"),
                "run the doctor as root (or with CAP_SYSLOG) to read the kernel log",
            );
        }
    };
    let hits: Vec<&str> = log
        .lines()
        .filter(|l| {
            let l = l.to_ascii_lowercase();
            l.contains("devmem") || l.contains("gpudirect") || l.contains("tcpx")
        })
        .collect();
    let errors: Vec<&str> = hits
        .iter()
        .copied()
        .filter(|l| {
            let l = l.to_ascii_lowercase();
            l.contains("fail") || l.contains("error")
        })
        .collect();
    let clean = |l: &str| -> String {
        // /dev/kmsg records are "prio,seq,time,flags;message".
        l.split_once(';').map(|(_, m)| m).unwrap_or(l).trim().to_string()
    };
    if let Some(e) = errors.first() {
        return Check::fail(
            NAME,
            format!("{} devmem error line(s), first: {}", errors.len(), clean(e)),
            "check the gVNIC driver and kernel support GPUDirect-TCPX (A3 images: COS or the TCPX-enabled Ubuntu)",
        );
    }
    match hits.first() {
        Some(first) => Check::ok(
            NAME,
            format!(
                "{} line(s) mention devmem/TCPX, first: {}",
                hits.len(),
                clean(first)
            ),
        ),
        None => Check::warn(
            NAME,
            "the kernel log does not mention devmem TCP (it may have rotated)",
            "use an A3 image whose kernel supports GPUDirect-TCPX; check RxDM's log for its set-up",
        ),
    }
}

// ---- rxdm.sockets --------------------------------------------------------------------------

/// `rxdm.sockets`: RxDM's unix sockets under NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX.
pub fn check_rxdm(host: &Host) -> Check {
    const NAME: &str = "rxdm.sockets";
    let prefix = host
        .var("NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX")
        .filter(|v| !v.trim().is_empty())
        .unwrap_or("/run/tcpx")
        .trim()
        .to_string();
    let dir = host.path(&prefix);
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) => {
            return Check::fail(
                NAME,
                format!("{prefix}: {e}"),
                "start RxDM (tcpgpudmarxd --uds_path <prefix>) and share that directory with tcpxd",
            );
        }
    };
    let mut sockets: Vec<String> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().map(|t| t.is_socket()).unwrap_or(false))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    sockets.sort();
    if sockets.is_empty() {
        return Check::warn(
            NAME,
            format!("{prefix} exists but holds no sockets: RxDM is not serving (yet)"),
            "start RxDM and wait for its sockets before tcpxd (systemd: After=; GKE: the sidecar)",
        );
    }
    let shown = if sockets.len() > 4 {
        format!("{}, …", sockets[..4].join(", "))
    } else {
        sockets.join(", ")
    };
    Check::ok(NAME, format!("{} socket(s) in {prefix}: {shown}", sockets.len()))
}

// ---- gpus ----------------------------------------------------------------------------------

/// The PCI bus ids of the GPUs the NVIDIA driver lists under /proc/driver/nvidia/gpus.
pub fn proc_gpus(host: &Host) -> std::io::Result<Vec<String>> {
    let mut ids: Vec<String> = std::fs::read_dir(host.path("/proc/driver/nvidia/gpus"))?
        .filter_map(Result::ok)
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    ids.sort();
    Ok(ids)
}

/// `gpus`: the driver's GPUs and version (and, on the real root, what CUDA sees).
pub fn check_gpus(host: &Host) -> Check {
    const NAME: &str = "gpus";
    let version = read_trim(&host.path("/proc/driver/nvidia/version"))
        .ok()
        .and_then(|v| {
            // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 …"
            v.lines()
                .next()
                .and_then(|l| {
                    l.split_whitespace()
                        .find(|w| w.chars().next().is_some_and(|c| c.is_ascii_digit()) && w.contains('.'))
                })
                .map(String::from)
        });
    let gpus = match proc_gpus(host) {
        Ok(g) if !g.is_empty() => g,
        Ok(_) | Err(_) => {
            let cuda = cuda_summary(host);
            return Check::fail(
                NAME,
                format!("no NVIDIA GPUs: /proc/driver/nvidia/gpus is absent or empty{cuda}"),
                "install the NVIDIA driver (535+ for A3) or run on a GPU node",
            );
        }
    };
    let models: Vec<String> = gpus
        .iter()
        .map(|id| {
            let info =
                std::fs::read_to_string(host.path(format!("/proc/driver/nvidia/gpus/{id}/information")))
                    .unwrap_or_default();
            let model = info
                .lines()
                .find_map(|l| l.strip_prefix("Model:"))
                .map(str::trim)
                .unwrap_or("?");
            format!("{id} {model}")
        })
        .collect();
    let cuda = cuda_summary(host);
    let detail = format!(
        "{} GPU(s), driver {}: {}{cuda}",
        gpus.len(),
        version.as_deref().unwrap_or("unknown"),
        models.join(", ")
    );
    let major = version
        .as_deref()
        .and_then(|v| v.split('.').next())
        .and_then(|m| m.parse::<u32>().ok());
    match major {
        None => Check::warn(
            NAME,
            detail,
            "/proc/driver/nvidia/version is unreadable: check the driver installation",
        ),
        Some(m) if m < 535 => Check::warn(
            NAME,
            detail,
            "GPUDirect-TCPX on A3 needs driver 535 or newer: upgrade the driver",
        ),
        Some(_) if cuda.contains("CUDA unavailable") => Check::warn(
            NAME,
            detail,
            "the kernel driver is loaded but libcuda.so.1 does not initialise: check LD_LIBRARY_PATH and the user-space driver",
        ),
        Some(_) => Check::ok(NAME, detail),
    }
}

fn cuda_summary(host: &Host) -> String {
    if !host.probe_cuda {
        return String::new();
    }
    match crate::gpu::Gpu::device_count() {
        Ok(n) => format!("; CUDA sees {n} device(s)"),
        Err(e) => format!("; CUDA unavailable: {e}"),
    }
}

// ---- memlock -------------------------------------------------------------------------------

/// Below this the daemon's pinned staging and registrations fail early.
pub const MEMLOCK_FAIL_BELOW: u64 = 1 << 30;

fn fmt_limit(l: Option<u64>) -> String {
    match l {
        None => "unlimited".into(),
        Some(b) if b >= 1 << 30 => format!("{} GiB", b >> 30),
        Some(b) if b >= 1 << 20 => format!("{} MiB", b >> 20),
        Some(b) => format!("{} KiB", b >> 10),
    }
}

/// `memlock`: RLIMIT_MEMLOCK (unlimited is ok).
pub fn check_memlock(host: &Host) -> Check {
    const NAME: &str = "memlock";
    const FIX: &str =
        "systemd: LimitMEMLOCK=infinity; containers: add IPC_LOCK and raise the runtime's memlock ulimit";
    let (soft, hard) = match (host.memlock)() {
        Ok(l) => l,
        Err(e) => return Check::warn(NAME, format!("cannot read RLIMIT_MEMLOCK: {e}"), FIX),
    };
    let detail = format!(
        "RLIMIT_MEMLOCK soft {}, hard {}",
        fmt_limit(soft),
        fmt_limit(hard)
    );
    match soft {
        None => Check::ok(NAME, detail),
        Some(b) if b < MEMLOCK_FAIL_BELOW => Check::fail(NAME, detail, FIX),
        Some(_) => Check::warn(NAME, detail + "; buffers pinned beyond it will fail", FIX),
    }
}

// ---- ports ---------------------------------------------------------------------------------

/// `ports`: the API socket and the TCP listen addresses are free (or held by a live tcpxd).
pub fn check_ports(target: &Target) -> Check {
    const NAME: &str = "ports";
    let mut notes = Vec::new();
    let mut fails = Vec::new();
    let sock = &target.api_socket;
    let daemon_live = match std::fs::symlink_metadata(sock) {
        Ok(m) if !m.file_type().is_socket() => {
            fails.push(format!("{} exists and is not a socket", sock.display()));
            false
        }
        Ok(_) => {
            if std::os::unix::net::UnixStream::connect(sock).is_ok() {
                notes.push(format!(
                    "{} answers: a daemon is already serving there",
                    sock.display()
                ));
                true
            } else {
                notes.push(format!("{} is stale (tcpxd replaces it)", sock.display()));
                false
            }
        }
        Err(_) => {
            match sock.parent().filter(|d| !d.as_os_str().is_empty()) {
                Some(dir) if !dir.exists() => {
                    // The daemon creates it; it must be able to.
                    let creatable = dir
                        .ancestors()
                        .find(|a| a.exists())
                        .map(is_writable_dir)
                        .unwrap_or(false);
                    if creatable {
                        notes.push(format!(
                            "{} free ({} will be created)",
                            sock.display(),
                            dir.display()
                        ));
                    } else {
                        fails.push(format!("{} cannot be created (no write access)", dir.display()));
                    }
                }
                Some(dir) if !is_writable_dir(dir) => {
                    fails.push(format!("{} is not writable", dir.display()))
                }
                _ => notes.push(format!("{} free", sock.display())),
            }
            false
        }
    };
    let mut busy = Vec::new();
    for (what, addr) in &target.tcp {
        match std::net::TcpListener::bind(addr) {
            Ok(_) => notes.push(format!("{what} {addr} free")),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => busy.push(format!("{what} {addr} in use")),
            Err(e) => fails.push(format!("{what} {addr}: {e}")),
        }
    }
    if daemon_live {
        notes.append(&mut busy);
        return Check::warn(
            NAME,
            notes.join("; "),
            "tcpxd is already running (fine on a live node); stop it to check its ports",
        );
    }
    fails.append(&mut busy);
    if !fails.is_empty() {
        return Check::fail(
            NAME,
            fails.into_iter().chain(notes).collect::<Vec<_>>().join("; "),
            "stop what holds the address (ss -ltnp) or choose other addresses (docs/CONFIG.md)",
        );
    }
    Check::ok(NAME, notes.join("; "))
}

fn is_writable_dir(dir: &Path) -> bool {
    let probe = dir.join(format!(".tcpxd-doctor-{}", std::process::id()));
    match std::fs::File::create(&probe) {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            true
        }
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::super::Level;
    use super::super::testutil::{FakeRunner, TempRoot, host, simple_host};
    use super::*;

    #[test]
    fn recommended_values_come_from_tcpx_env() {
        let rec = parse_recommended_env(RECOMMENDED_ENV);
        assert_eq!(rec["NCCL_DYNAMIC_CHUNK_SIZE"], "524288");
        assert_eq!(rec["NCCL_GPUDIRECTTCPX_SOCKET_IFNAME"], "eth1,eth2,eth3,eth4");
        assert!(rec["NCCL_GPUDIRECTTCPX_TX_BINDINGS"].starts_with("eth1:8-21"));
        assert!(!rec.contains_key("RUST_LOG"));
        assert!(!rec.contains_key("NCCL_P2P_NET_CHUNKSIZE"));
    }

    #[test]
    fn mount_tables_and_longest_prefix() {
        let mi = "22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n\
                  30 22 0:25 / /var/lib/tcpx rw,nosuid,nodev,noexec shared:9 - ext4 /dev/sdb rw\n\
                  31 22 0:26 / /var/lib/tcpx\\040x rw shared:10 - tmpfs tmpfs rw\n";
        let m = parse_mountinfo(mi);
        assert_eq!(m.len(), 3);
        assert_eq!(m[2].point, PathBuf::from("/var/lib/tcpx x"));
        let hit = mount_of(&m, Path::new("/var/lib/tcpx/lib64")).unwrap();
        assert_eq!(hit.point, PathBuf::from("/var/lib/tcpx"));
        // A prefix match is by components: /var/lib/tcpxfoo is not under /var/lib/tcpx.
        assert_eq!(
            mount_of(&m, Path::new("/var/lib/tcpxfoo")).unwrap().point,
            PathBuf::from("/")
        );
        let pm = parse_proc_mounts("/dev/sda1 / ext4 rw 0 0\ntmpfs /run tmpfs rw,noexec 0 0\n");
        assert_eq!(
            mount_of(&pm, Path::new("/run/x")).unwrap().options,
            vec!["rw", "noexec"]
        );
    }

    #[test]
    fn noexec_ok_warn_fail() {
        let root = TempRoot::new("noexec");
        let h = simple_host(&root, &[]);
        // Unreadable mount table: warn.
        let c = check_noexec(&h, Path::new("/usr/local/tcpx/lib64/libnccl-net.so"));
        assert_eq!(c.level, Level::Warn, "{c:?}");
        root.write(
            "/proc/self/mountinfo",
            "22 1 0:21 / / rw,relatime - ext4 /dev/sda1 rw\n\
             30 22 0:25 / /var/lib/tcpx rw,nosuid,noexec - ext4 /dev/sdb rw\n",
        );
        let c = check_noexec(&h, Path::new("/usr/local/tcpx/lib64/libnccl-net.so"));
        assert_eq!(c.level, Level::Ok, "{c:?}");
        let c = check_noexec(&h, Path::new("/var/lib/tcpx/lib64/libnccl-net.so"));
        assert_eq!(c.level, Level::Fail, "{c:?}");
        assert!(c.detail.contains("noexec") && c.fix.contains("/usr/local/tcpx/lib64"));
        // /proc/mounts is the fallback.
        std::fs::remove_file(root.0.join("proc/self/mountinfo")).unwrap();
        root.write(
            "/proc/mounts",
            "/dev/sda1 / ext4 rw 0 0\ntmpfs /opt tmpfs rw,noexec 0 0\n",
        );
        assert_eq!(check_noexec(&h, Path::new("/opt/p.so")).level, Level::Fail);
    }

    #[test]
    fn chunk_size_ok_warn_fail() {
        let root = TempRoot::new("chunk");
        let c = check_chunk_size(&simple_host(&root, &[("NCCL_DYNAMIC_CHUNK_SIZE", "524288")]));
        assert_eq!(c.level, Level::Ok, "{c:?}");
        let c = check_chunk_size(&simple_host(&root, &[]));
        assert_eq!(c.level, Level::Warn, "{c:?}");
        let c = check_chunk_size(&simple_host(&root, &[("NCCL_DYNAMIC_CHUNK_SIZE", "1048576")]));
        assert_eq!(c.level, Level::Warn, "{c:?}");
        let c = check_chunk_size(&simple_host(&root, &[("NCCL_DYNAMIC_CHUNK_SIZE", "0")]));
        assert_eq!(c.level, Level::Fail, "{c:?}");
    }

    fn recommended_env() -> Vec<(String, String)> {
        parse_recommended_env(RECOMMENDED_ENV).into_iter().collect()
    }

    #[test]
    fn tcpx_env_ok_warn_fail() {
        let root = TempRoot::new("tcpxenv");
        let all = recommended_env();
        let pairs: Vec<(&str, &str)> = all.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let c = check_tcpx_env(&simple_host(&root, &pairs));
        assert_eq!(c.level, Level::Ok, "{c:?}");
        let mut changed = pairs.clone();
        for p in &mut changed {
            if p.0 == "NCCL_GPUDIRECTTCPX_FORCE_ACK" {
                p.1 = "1";
            }
        }
        changed.retain(|p| p.0 != "NCCL_SOCKET_NTHREADS");
        let c = check_tcpx_env(&simple_host(&root, &changed));
        assert_eq!(c.level, Level::Warn, "{c:?}");
        assert!(
            c.detail.contains("NCCL_GPUDIRECTTCPX_FORCE_ACK=1 (GCP: 0)"),
            "{}",
            c.detail
        );
        assert!(c.detail.contains("unset: NCCL_SOCKET_NTHREADS"), "{}", c.detail);
        let c = check_tcpx_env(&simple_host(&root, &[]));
        assert_eq!(c.level, Level::Fail, "{c:?}");
    }

    fn nic(root: &TempRoot, name: &str, state: &str, speed: &str) {
        root.write(&format!("/sys/class/net/{name}/operstate"), &format!("{state}\n"));
        root.write(&format!("/sys/class/net/{name}/speed"), &format!("{speed}\n"));
    }

    #[test]
    fn nics_ok_warn_fail() {
        let root = TempRoot::new("nics");
        let env = [
            ("NCCL_GPUDIRECTTCPX_SOCKET_IFNAME", "eth1,eth2"),
            ("NCCL_GPUDIRECTTCPX_CTRL_DEV", "eth0"),
        ];
        let h = simple_host(&root, &env);
        nic(&root, "eth0", "up", "100000");
        nic(&root, "eth1", "up", "200000");
        let c = check_nics(&h);
        assert_eq!(c.level, Level::Fail, "{c:?}");
        assert!(c.detail.contains("missing: eth2"), "{}", c.detail);
        nic(&root, "eth2", "up", "-1");
        let c = check_nics(&h);
        assert_eq!(c.level, Level::Warn, "{c:?}");
        assert!(c.detail.contains("eth2 up speed unknown"));
        nic(&root, "eth2", "up", "200000");
        let c = check_nics(&h);
        assert_eq!(c.level, Level::Ok, "{c:?}");
        assert!(c.detail.contains("eth1 up 200 Gb/s") && c.detail.contains("eth0 up 100 Gb/s"));
        nic(&root, "eth1", "down", "200000");
        let c = check_nics(&h);
        assert_eq!(c.level, Level::Fail);
        assert!(c.detail.contains("not up: eth1 (down)"), "{}", c.detail);
    }

    #[test]
    fn data_split_ok_warn_fail() {
        let root = TempRoot::new("split");
        let env = [("NCCL_GPUDIRECTTCPX_SOCKET_IFNAME", "eth1,eth2")];
        let runner = Arc::new(FakeRunner::default());
        let h = host(&root, &env, runner.clone(), (None, None));
        // No ethtool: unknown, as a warning.
        let c = check_data_split(&h);
        assert_eq!(c.level, Level::Warn, "{c:?}");
        assert!(c.detail.contains("ethtool unavailable"));
        let ring = |split: &str| {
            format!(
                "Ring parameters for eth1:\nPre-set maximums:\nRX:\t\t4096\nCurrent hardware settings:\nRX:\t\t1024\nTCP data split:\t\t{split}\n"
            )
        };
        runner.answer("ethtool -g eth1", true, &ring("on"));
        runner.answer("ethtool -g eth2", true, &ring("on"));
        assert_eq!(check_data_split(&h).level, Level::Ok);
        runner.answer("ethtool -g eth2", true, &ring("off"));
        let c = check_data_split(&h);
        assert_eq!(c.level, Level::Fail, "{c:?}");
        assert!(c.detail.contains("eth2"));
        // Google's kernels list it among the features (ethtool -k), which is asked first.
        runner.answer(
            "ethtool -k eth2",
            true,
            "Features for eth2:\nrx-checksumming: on\ntcp-data-split: on [fixed]\n",
        );
        assert_eq!(check_data_split(&h).level, Level::Ok);
        runner.answer(
            "ethtool -k eth2",
            true,
            "Features for eth2:\nrx-checksumming: on\n",
        );
        // An older ethtool that does not print the line.
        runner.answer(
            "ethtool -g eth2",
            true,
            "Ring parameters for eth2:\nRX:\t\t1024\n",
        );
        let c = check_data_split(&h);
        assert_eq!(c.level, Level::Warn);
        assert!(c.detail.contains("does not report"), "{}", c.detail);
    }

    #[test]
    fn kernel_log_ok_warn_fail() {
        let root = TempRoot::new("kmsg");
        let runner = Arc::new(FakeRunner::default());
        let h = host(&root, &[], runner.clone(), (None, None));
        let c = check_kernel_log(&h);
        assert_eq!(c.level, Level::Warn, "{c:?}");
        assert!(
            c.detail.contains("unreadable") && c.detail.contains("dmesg"),
            "{}",
            c.detail
        );
        // dmesg as the fallback.
        runner.answer("dmesg", true, "[ 1.0] gve 0000:06:00.0: devmem TCP enabled\n");
        assert_eq!(check_kernel_log(&h).level, Level::Ok);
        // /dev/kmsg first, in its record format.
        root.write("/dev/kmsg", "6,100,1000,-;eth1: something else\n");
        let c = check_kernel_log(&h);
        assert_eq!(c.level, Level::Warn, "{c:?}");
        assert!(c.detail.contains("does not mention"));
        root.write(
            "/dev/kmsg",
            "6,100,1000,-;gve: devmem TCP rx queue 3 bound\n3,101,1001,-;gve: devmem bind failed: -22\n",
        );
        let c = check_kernel_log(&h);
        assert_eq!(c.level, Level::Fail, "{c:?}");
        assert!(c.detail.contains("gve: devmem bind failed: -22"), "{}", c.detail);
        root.write("/dev/kmsg", "6,100,1000,-;gve: devmem TCP rx queue 3 bound\n");
        let c = check_kernel_log(&h);
        assert_eq!(c.level, Level::Ok);
        assert!(
            c.detail.contains("first: gve: devmem TCP rx queue 3 bound"),
            "{}",
            c.detail
        );
    }

    #[test]
    fn rxdm_ok_warn_fail() {
        let root = TempRoot::new("rxdm");
        let h = simple_host(&root, &[]);
        let c = check_rxdm(&h);
        assert_eq!(c.level, Level::Fail, "{c:?}");
        assert!(c.detail.contains("/run/tcpx"));
        let dir = root.mkdir("/run/tcpx");
        std::fs::write(dir.join("not-a-socket"), "").unwrap();
        assert_eq!(check_rxdm(&h).level, Level::Warn);
        let _l = std::os::unix::net::UnixListener::bind(dir.join("get_gpu_fd_0")).unwrap();
        let c = check_rxdm(&h);
        assert_eq!(c.level, Level::Ok, "{c:?}");
        assert!(c.detail.contains("1 socket(s) in /run/tcpx: get_gpu_fd_0"));
        // The prefix comes from the environment.
        let h = simple_host(&root, &[("NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX", "/other")]);
        assert_eq!(check_rxdm(&h).level, Level::Fail);
    }

    pub(crate) fn gpu(root: &TempRoot, bus: &str) {
        root.write(
            &format!("/proc/driver/nvidia/gpus/{bus}/information"),
            "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 100\n",
        );
    }

    #[test]
    fn gpus_ok_warn_fail() {
        let root = TempRoot::new("gpus");
        let h = simple_host(&root, &[]);
        let c = check_gpus(&h);
        assert_eq!(c.level, Level::Fail, "{c:?}");
        gpu(&root, "0000:04:00.0");
        let c = check_gpus(&h);
        assert_eq!(c.level, Level::Warn, "{c:?}");
        assert!(c.detail.contains("driver unknown"));
        root.write(
            "/proc/driver/nvidia/version",
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  525.60.13  Wed Nov 30 06:39:21 UTC 2022\n",
        );
        assert_eq!(check_gpus(&h).level, Level::Warn);
        root.write(
            "/proc/driver/nvidia/version",
            "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\nGCC version:  gcc version 12.2.0\n",
        );
        let c = check_gpus(&h);
        assert_eq!(c.level, Level::Ok, "{c:?}");
        assert!(
            c.detail
                .contains("1 GPU(s), driver 535.104.05: 0000:04:00.0 NVIDIA H100 80GB HBM3")
        );
    }

    #[test]
    fn memlock_ok_warn_fail() {
        let root = TempRoot::new("memlock");
        let r = Arc::new(FakeRunner::default());
        let c = check_memlock(&host(&root, &[], r.clone(), (None, None)));
        assert_eq!(c.level, Level::Ok);
        assert!(c.detail.contains("soft unlimited"));
        let c = check_memlock(&host(&root, &[], r.clone(), (Some(64 << 30), None)));
        assert_eq!(c.level, Level::Warn, "{c:?}");
        let c = check_memlock(&host(&root, &[], r.clone(), (Some(8 << 20), Some(8 << 20))));
        assert_eq!(c.level, Level::Fail);
        assert!(c.detail.contains("soft 8 MiB") && c.fix.contains("LimitMEMLOCK=infinity"));
    }

    #[test]
    fn ports_ok_warn_fail() {
        let root = TempRoot::new("ports");
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let free_addr = free.local_addr().unwrap();
        drop(free);
        let target = |sock: PathBuf, tcp: Vec<(&'static str, std::net::SocketAddr)>| Target {
            plugin: crate::config::PluginChoice::BuiltinEmulation,
            api_socket: sock,
            tcp,
            peer_listen: "127.0.0.1:0".parse().unwrap(),
            peer_advertise: Vec::new(),
        };
        let sock = root.0.join("run/tcpxd/tcpxd.sock");
        let c = check_ports(&target(sock.clone(), vec![("peer service", free_addr)]));
        assert_eq!(c.level, Level::Ok, "{c:?}");
        // Another process holds the TCP port.
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let held_addr = held.local_addr().unwrap();
        let c = check_ports(&target(sock.clone(), vec![("peer service", held_addr)]));
        assert_eq!(c.level, Level::Fail, "{c:?}");
        assert!(c.detail.contains("in use"));
        // A live daemon on the socket: the ports are probably its own.
        std::fs::create_dir_all(sock.parent().unwrap()).unwrap();
        let _live = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let c = check_ports(&target(sock.clone(), vec![("peer service", held_addr)]));
        assert_eq!(c.level, Level::Warn, "{c:?}");
        assert!(c.detail.contains("already serving"));
        // A regular file where the socket goes.
        let file = root.write("/file.sock", "");
        assert_eq!(check_ports(&target(file, vec![])).level, Level::Fail);
    }
}
