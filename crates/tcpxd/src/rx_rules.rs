//! The flow-steering rules Google's plugin had RxDM install for this daemon's receive comms,
//! kept in the state directory (`rx_rules`) so that a daemon that died without closing its
//! comms (SIGKILL, an OOM kill, the plugin's `exit(1)`) has them removed by its next instance.
//!
//! RxDM keeps no record of who installed a rule: it removes one when anybody sends the same
//! flow to its `rx_rule_uninstall` socket, the plugin's own way at `tcpxClose`
//! (google/nccl-plugin-gpudirecttcpx `src/net_tcpx.cc` → `DeleteFlowSteerRule`,
//! `src/connect.cc`; the message: `src/rx_buf_mgr_client/rx_rule_client.cc`; RxDM's side:
//! google/tcpgpudmarxd `src/rx_rule_manager.cc`, `DeleteFlowSteering`, keyed by the flow's
//! hash under the NIC of the GPU named). The plugin installs one rule per data socket it
//! accepts, for (its peer's address → its own), under the GPU current at the accept. Those
//! sockets live in this process: once a receive comm is accepted, the daemon finds them among
//! its own TCP sockets (`/proc/self/fd` → `/proc/self/net/tcp{,6}`) by the local address the
//! plugin's listen handle announced (`struct tcpxHandle` starts with it, `src/common.h`), and
//! records them with the lane's GPU until the comm is closed (the plugin removed them then). At
//! start-up, before any comm of its own exists, the daemon sends RxDM the uninstall of every
//! flow its previous instance left recorded, exactly as the plugin would have.

use std::collections::{BTreeMap, HashSet};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prost::Message;
use serde::{Deserialize, Serialize};

/// The file in the state directory.
pub const FILE: &str = "rx_rules";
/// Where RxDM listens, as the plugin finds it (`NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX`, else
/// `/tmp`).
pub const PREFIX_ENV: &str = "NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX";
/// RxDM's uninstall socket under the prefix.
pub const UNINSTALL_SOCKET: &str = "rx_rule_uninstall";

/// One flow-steering rule: the flow (the peer's address → this node's) and the GPU it was
/// installed under (lower-case `dddd:bb:dd.f`, as the plugin sends it).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Flow {
    pub src: SocketAddr,
    pub dst: SocketAddr,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
}

/// The recorded rules of the running daemon, by receive comm.
#[derive(Debug)]
pub struct RuleBook {
    file: PathBuf,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    next: u64,
    comms: BTreeMap<u64, Vec<Flow>>,
}

/// A receive comm's recorded rules: forgotten when dropped (after the comm's close, which
/// removed them; a close that never returns keeps them for the next instance).
#[derive(Debug)]
pub struct Recorded {
    book: Arc<RuleBook>,
    key: u64,
}

impl Drop for Recorded {
    fn drop(&mut self) {
        let mut inner = self.book.lock();
        inner.comms.remove(&self.key);
        self.book.save(&inner);
    }
}

impl RuleBook {
    /// Opens the book in `dir`: what the previous instance left recorded (its rules that no
    /// close removed), and an empty book for this one (the left ones stay in the file until
    /// [`RuleBook::keep`] or [`remove_stale`] says what became of them).
    pub fn open(dir: &Path) -> (Arc<RuleBook>, Vec<Flow>) {
        let file = dir.join(FILE);
        let left: Vec<Flow> = std::fs::read(&file)
            .ok()
            .and_then(|b| serde_json::from_slice::<BTreeMap<u64, Vec<Flow>>>(&b).ok())
            .map(|m| m.into_values().flatten().collect())
            .unwrap_or_default();
        let book = Arc::new(RuleBook {
            file,
            inner: Mutex::new(Inner::default()),
        });
        (book, left)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn save(&self, inner: &Inner) {
        let tmp = self.file.with_extension("tmp");
        let ok = serde_json::to_vec(&inner.comms)
            .ok()
            .is_some_and(|b| std::fs::write(&tmp, b).is_ok() && std::fs::rename(&tmp, &self.file).is_ok());
        if !ok {
            tracing::warn!(file = %self.file.display(), "could not record the flow-steering rules of the receive comms");
        }
    }

    /// Records a receive comm's rules until the returned guard is dropped.
    pub fn record(self: &Arc<Self>, flows: Vec<Flow>) -> Recorded {
        let mut inner = self.lock();
        inner.next += 1;
        let key = inner.next;
        if !flows.is_empty() {
            inner.comms.insert(key, flows);
            self.save(&inner);
        }
        Recorded {
            book: self.clone(),
            key,
        }
    }

    /// Keeps `flows` (the previous instance's, RxDM could not be told) for the next instance.
    pub fn keep(self: &Arc<Self>, flows: Vec<Flow>) {
        std::mem::forget(self.record(flows));
    }

    /// The flows recorded now (tests, and the state directory's reader).
    pub fn recorded(&self) -> Vec<Flow> {
        self.lock().comms.values().flatten().cloned().collect()
    }
}

/// At start-up: asks RxDM (under `prefix`) to remove each of the previous instance's rules;
/// returns how many it removed; those it could not be told of are kept in `book` for the
/// next start.
pub fn remove_stale(book: &Arc<RuleBook>, prefix: &Path, flows: Vec<Flow>) -> usize {
    if flows.is_empty() {
        book.save(&book.lock());
        return 0;
    }
    let mut removed = 0;
    let mut kept = Vec::new();
    let mut first_error = None;
    for f in flows {
        match uninstall(prefix, &f) {
            Ok(()) => removed += 1,
            Err(e) => {
                first_error.get_or_insert(e);
                kept.push(f);
            }
        }
    }
    let left = kept.len();
    book.keep(kept);
    if left == 0 {
        book.save(&book.lock());
    }
    match first_error {
        None => tracing::info!(
            removed,
            rxdm = %prefix.display(),
            "removed the flow-steering rules the previous instance left in RxDM"
        ),
        Some(e) => tracing::warn!(
            removed,
            left,
            rxdm = %prefix.display(),
            "could not remove every flow-steering rule the previous instance left in RxDM ({e}); kept for the next start"
        ),
    }
    removed
}

/// Where RxDM listens for this process (the plugin's own rule).
pub fn rxdm_prefix() -> PathBuf {
    std::env::var_os(PREFIX_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/tmp"))
}

/// The data listen address a plugin handle announces, when it is Google's plugin's (a
/// `union socketAddress` first: AF_INET or AF_INET6, a port); `None` otherwise (the
/// emulation's handle starts with its magic).
pub fn data_listen_addr(handle: &[u8]) -> Option<SocketAddr> {
    const AF_INET: u16 = 2;
    const AF_INET6: u16 = 10;
    let family = u16::from_ne_bytes(handle.get(0..2)?.try_into().ok()?);
    let port = u16::from_be_bytes(handle.get(2..4)?.try_into().ok()?);
    if port == 0 {
        return None;
    }
    let ip = match family {
        AF_INET => IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(handle.get(4..8)?).ok()?)),
        AF_INET6 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(handle.get(8..24)?).ok()?)),
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// This process's established TCP connections accepted on `listen` (its address and port; an
/// unspecified address matches any): (the peer's address, the local one).
pub fn accepted_on(listen: SocketAddr) -> Vec<(SocketAddr, SocketAddr)> {
    let mine = own_socket_inodes();
    let mut out = Vec::new();
    for (table, v6) in [("/proc/self/net/tcp", false), ("/proc/self/net/tcp6", true)] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let Some(e) = parse_tcp_line(line, v6) else {
                continue;
            };
            let local_matches = e.local.port() == listen.port()
                && (listen.ip().is_unspecified() || same_ip(e.local.ip(), listen.ip()));
            if e.established && local_matches && mine.contains(&e.inode) {
                out.push((e.remote, e.local));
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// An IPv4 address and its IPv4-mapped IPv6 form are the same.
fn same_ip(a: IpAddr, b: IpAddr) -> bool {
    let canon = |ip: IpAddr| match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    };
    canon(a) == canon(b)
}

/// The inodes of this process's sockets.
fn own_socket_inodes() -> HashSet<u64> {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return HashSet::new();
    };
    dir.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|target| {
            let t = target.to_str()?;
            t.strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok()
        })
        .collect()
}

struct TcpEntry {
    local: SocketAddr,
    remote: SocketAddr,
    established: bool,
    inode: u64,
}

/// One line of `/proc/net/tcp{,6}`: `sl local rem st tx:rx tr:when retrnsmt uid timeout inode …`.
fn parse_tcp_line(line: &str, v6: bool) -> Option<TcpEntry> {
    let f: Vec<&str> = line.split_whitespace().collect();
    Some(TcpEntry {
        local: parse_addr(f.get(1)?, v6)?,
        remote: parse_addr(f.get(2)?, v6)?,
        established: *f.get(3)? == "01",
        inode: f.get(9)?.parse().ok()?,
    })
}

/// `0100000A:C350`: the address as the kernel's 32-bit words in host order, the port in hex.
fn parse_addr(s: &str, v6: bool) -> Option<SocketAddr> {
    let (ip, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |i: usize| u32::from_str_radix(ip.get(i * 8..i * 8 + 8)?, 16).ok();
    let ip = if v6 {
        let mut b = [0u8; 16];
        for i in 0..4 {
            b[i * 4..i * 4 + 4].copy_from_slice(&word(i)?.to_ne_bytes());
        }
        IpAddr::V6(Ipv6Addr::from(b))
    } else {
        IpAddr::V4(Ipv4Addr::from(word(0)?.to_ne_bytes()))
    };
    Some(SocketAddr::new(ip, port))
}

/// A GPU's PCI bus id as the plugin sends it (`cuDeviceGetPCIBusId` into 16 bytes, lower-cased:
/// a 4-digit domain).
pub fn plugin_pci(bus_id: &str) -> String {
    let lower = bus_id.to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => format!("{}:{rest}", &domain[domain.len() - 4..]),
        _ => lower,
    }
}

// The plugin's messages to RxDM (its `unix_socket_proto.proto`, the fields it sends): framed as
// a big-endian u16 length, then the message; RxDM answers `raw_bytes: "Ok."`.

#[derive(Clone, PartialEq, Message)]
struct UnixSocketProto {
    #[prost(bytes = "vec", optional, tag = "1")]
    raw_bytes: Option<Vec<u8>>,
    #[prost(message, optional, tag = "2")]
    flow_steer_rule_request: Option<FlowSteerRuleRequest>,
}

#[derive(Clone, PartialEq, Message)]
struct FlowSteerRuleRequest {
    #[prost(message, optional, tag = "1")]
    flow_steer_ntuple: Option<FlowSteerNtuple>,
    #[prost(string, optional, tag = "3")]
    gpu_pci_addr: Option<String>,
}

#[derive(Clone, PartialEq, Message)]
struct FlowSteerNtuple {
    #[prost(int32, optional, tag = "1")]
    flow_type: Option<i32>,
    #[prost(message, optional, tag = "2")]
    src: Option<SocketAddress>,
    #[prost(message, optional, tag = "3")]
    dst: Option<SocketAddress>,
}

#[derive(Clone, PartialEq, Message)]
struct SocketAddress {
    #[prost(string, optional, tag = "1")]
    ip_address: Option<String>,
    #[prost(int32, optional, tag = "2")]
    port: Option<i32>,
}

/// ethtool's flow types (`linux/ethtool.h`).
const TCP_V4_FLOW: i32 = 0x01;
const TCP_V6_FLOW: i32 = 0x05;

/// Sends RxDM the uninstall of `flow`, as the plugin's close does.
pub fn uninstall(prefix: &Path, flow: &Flow) -> Result<(), String> {
    let path = prefix.join(UNINSTALL_SOCKET);
    let addr = |a: &SocketAddr| SocketAddress {
        ip_address: Some(a.ip().to_string()),
        port: Some(i32::from(a.port())),
    };
    let msg = UnixSocketProto {
        raw_bytes: None,
        flow_steer_rule_request: Some(FlowSteerRuleRequest {
            flow_steer_ntuple: Some(FlowSteerNtuple {
                flow_type: Some(if flow.src.is_ipv4() {
                    TCP_V4_FLOW
                } else {
                    TCP_V6_FLOW
                }),
                src: Some(addr(&flow.src)),
                dst: Some(addr(&flow.dst)),
            }),
            gpu_pci_addr: flow.gpu.clone(),
        }),
    };
    let body = msg.encode_to_vec();
    let len = u16::try_from(body.len()).map_err(|_| "message too long".to_string())?;
    let fail = |e: std::io::Error| format!("{}: {e}", path.display());
    let mut s = UnixStream::connect(&path).map_err(fail)?;
    s.set_read_timeout(Some(Duration::from_secs(5))).map_err(fail)?;
    s.set_write_timeout(Some(Duration::from_secs(5))).map_err(fail)?;
    s.write_all(&len.to_be_bytes()).map_err(fail)?;
    s.write_all(&body).map_err(fail)?;
    let mut n = [0u8; 2];
    s.read_exact(&mut n).map_err(fail)?;
    let mut answer = vec![0u8; usize::from(u16::from_be_bytes(n))];
    s.read_exact(&mut answer).map_err(fail)?;
    let answer = UnixSocketProto::decode(answer.as_slice()).map_err(|e| format!("RxDM's answer: {e}"))?;
    match answer.raw_bytes.as_deref() {
        Some(b"Ok.") => Ok(()),
        other => Err(format!(
            "RxDM answered {:?} to the uninstall of {} -> {}",
            other.map(String::from_utf8_lossy),
            flow.src,
            flow.dst
        )),
    }
}

#[cfg(test)]
#[path = "rx_rules_tests.rs"]
mod tests;
