//! RxDM's `--gpu_nic_preset a3vm` (google/tcpgpudmarxd, `src/a3vm_gpu_rxq_configurator.cc`) and
//! what RxDM does with a rule (`src/rx_rule_manager.cc`, `RxRuleManager::DispatchRequest`): the
//! rule is filed under the NIC that serves the GPU the request names (`gpu_to_ifname_map_`), not
//! under the NIC the flow's destination address belongs to. The fake records, per rule, whether
//! the two agree: a rule filed under another NIC never steers its flow into GPU memory on A3, and
//! the plugin's next CUDA receive on it exits the process ("rx no cmsg").

use std::net::IpAddr;

/// The `a3vm` preset: each data NIC and the two GPUs (PCI bus ids) it serves.
pub const A3VM: [(&str, [&str; 2]); 4] = [
    ("eth1", ["0000:04:00.0", "0000:05:00.0"]),
    ("eth2", ["0000:0a:00.0", "0000:0b:00.0"]),
    ("eth3", ["0000:84:00.0", "0000:85:00.0"]),
    ("eth4", ["0000:8a:00.0", "0000:8b:00.0"]),
];

/// The binding a fake in `a3vm` mode applies: GPU -> NIC, and each NIC's addresses.
#[derive(Clone, Debug, Default)]
pub struct Binding {
    /// (GPU bus id, lower case; NIC name).
    pub gpu_to_nic: Vec<(String, String)>,
    /// (NIC name, one of its addresses).
    pub nic_addrs: Vec<(String, IpAddr)>,
}

impl Binding {
    /// The `a3vm` preset with the NICs' addresses given.
    pub fn a3vm(nic_addrs: Vec<(String, IpAddr)>) -> Binding {
        Binding {
            gpu_to_nic: A3VM
                .iter()
                .flat_map(|(nic, gpus)| gpus.iter().map(move |g| (g.to_string(), nic.to_string())))
                .collect(),
            nic_addrs,
        }
    }

    /// The NIC serving `gpu` (case-insensitive bus id).
    pub fn nic_of_gpu(&self, gpu: &str) -> Option<&str> {
        let gpu = gpu.to_ascii_lowercase();
        self.gpu_to_nic
            .iter()
            .find(|(g, _)| *g == gpu)
            .map(|(_, n)| n.as_str())
    }

    /// The NIC `addr` belongs to.
    pub fn nic_of_addr(&self, addr: IpAddr) -> Option<&str> {
        self.nic_addrs
            .iter()
            .find(|(_, a)| *a == addr)
            .map(|(n, _)| n.as_str())
    }

    /// Files a rule for a flow to `dst` naming `gpu`, as RxDM does.
    pub fn file(&self, gpu: Option<&str>, dst: Option<IpAddr>) -> Filing {
        let Some(gpu) = gpu else {
            return Filing::Refused(
                "Failed to process request, error: INVALID_ARGUMENT: no gpu_pci_addr.".into(),
            );
        };
        let Some(nic) = self.nic_of_gpu(gpu) else {
            // RxDM's words (ASSIGN_VALUE_BY_KEY_IN_MAP_OR_ERROR, ConstructErrorResponse).
            return Filing::Refused(format!(
                "Failed to process request, error: NOT_FOUND: {gpu} not found in gpu_to_ifname_map_."
            ));
        };
        Filing::Filed {
            nic: nic.to_string(),
            dst_nic: dst.and_then(|d| self.nic_of_addr(d)).map(str::to_string),
        }
    }
}

/// What RxDM did with one install request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Filing {
    /// Filed under `nic` (answered "Ok."); `dst_nic`: the NIC the flow's destination address
    /// belongs to, if it is one of the known addresses.
    Filed { nic: String, dst_nic: Option<String> },
    /// Not filed; answered with this text (the plugin retries).
    Refused(String),
}

impl Filing {
    /// Filed under the NIC the flow arrives on.
    pub fn matches(&self) -> bool {
        matches!(self, Filing::Filed { nic, dst_nic: Some(d) } if nic == d)
    }

    /// For the request's log line: `nic=eth1 dst_nic=eth1 match` / `... MISMATCH`.
    pub fn describe(&self) -> String {
        match self {
            Filing::Filed { nic, dst_nic } => format!(
                "nic={nic} dst_nic={} {}",
                dst_nic.as_deref().unwrap_or("?"),
                if self.matches() { "match" } else { "MISMATCH" }
            ),
            Filing::Refused(why) => format!("not filed ({why})"),
        }
    }
}

/// The file, under the fake's prefix, where `a3vm` mode keeps the rules it holds for the devmem
/// shim (tools/realplugin/devmem-shim): `nic NAME ADDR` per NIC address, then `rule NIC GPU
/// SRC_IP SRC_PORT DST_IP DST_PORT` per rule (the NIC it was filed under, the GPU it names).
pub const RULES_FILE: &str = "devmem-rules";

/// Rewrites [`RULES_FILE`] under `prefix` (whole, by rename: a reader sees the old or the new).
pub fn write_rules(
    prefix: &std::path::Path,
    binding: &Binding,
    filed: &std::collections::BTreeMap<crate::Flow, (String, String)>,
) -> std::io::Result<()> {
    use std::fmt::Write as _;
    let mut text = String::new();
    for (nic, addr) in &binding.nic_addrs {
        let _ = writeln!(text, "nic {nic} {addr}");
    }
    for ((_, src, dst), (nic, gpu)) in filed {
        let _ = writeln!(
            text,
            "rule {nic} {gpu} {} {} {} {}",
            src.ip(),
            src.port(),
            dst.ip(),
            dst.port()
        );
    }
    let tmp = prefix.join(format!("{RULES_FILE}.tmp"));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, prefix.join(RULES_FILE))
}

/// The addresses of interfaces `names` in this network namespace (`getifaddrs`), in order.
pub fn interface_addrs(names: &[&str]) -> std::io::Result<Vec<(String, IpAddr)>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list it allocates; freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: a NUL-terminated interface name owned by the list.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        if !names.contains(&name.as_str()) {
            continue;
        }
        // SAFETY: ifa_addr points at a sockaddr of the family it names.
        let addr = unsafe {
            match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sin = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    Some(IpAddr::from(u32::from_be(sin.sin_addr.s_addr).to_be_bytes()))
                }
                libc::AF_INET6 => {
                    let sin6 = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    Some(IpAddr::from(sin6.sin6_addr.s6_addr))
                }
                _ => None,
            }
        };
        if let Some(a) = addr {
            out.push((name, a));
        }
    }
    // SAFETY: the list getifaddrs allocated, freed once.
    unsafe { libc::freeifaddrs(head) };
    out.sort_by_key(|(n, _)| names.iter().position(|x| x == n));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b() -> Binding {
        Binding::a3vm(
            (1..=4)
                .map(|i| (format!("eth{i}"), IpAddr::from([10, 0, i as u8, 1])))
                .collect(),
        )
    }

    #[test]
    fn a_rule_is_filed_under_the_named_gpus_nic() {
        let b = b();
        let f = b.file(Some("0000:84:00.0"), Some("10.0.3.1".parse().unwrap()));
        assert_eq!(
            f,
            Filing::Filed {
                nic: "eth3".into(),
                dst_nic: Some("eth3".into())
            }
        );
        assert!(f.matches());
        assert_eq!(f.describe(), "nic=eth3 dst_nic=eth3 match");
        // GPU 0 named for a flow arriving on eth3: filed under eth1, as RxDM does.
        let f = b.file(Some("0000:04:00.0"), Some("10.0.3.1".parse().unwrap()));
        assert!(!f.matches());
        assert_eq!(f.describe(), "nic=eth1 dst_nic=eth3 MISMATCH");
        let f = b.file(Some("0000:0B:00.0"), Some("192.168.9.9".parse().unwrap()));
        assert_eq!(f.describe(), "nic=eth2 dst_nic=? MISMATCH");
        assert!(matches!(b.file(Some("0000:10:00.0"), None), Filing::Refused(t) if t.contains("NOT_FOUND")));
    }

    #[test]
    fn loopback_has_an_address() {
        let addrs = interface_addrs(&["lo"]).unwrap();
        assert!(
            addrs.iter().any(|(n, a)| n == "lo" && a.is_loopback()),
            "{addrs:?}"
        );
    }
}
