//! `topology`: the GPU → NIC map the daemon would use (`topology.map` over this node's GPUs and
//! the plugin's devices), checked against the map RxDM serves: a GPU whose comms the daemon would
//! open on a NIC RxDM does not steer for it is a failure (on A3 the plugin's first GPU receive on
//! such a comm exits the process: "rx no cmsg").

use serde::Serialize;

use super::plugin::DeviceSummary;
use super::system::proc_gpus;
use super::{Check, Host};
use crate::engine::topology::{A3VM, MapSpec, NicInfo, Topology};

const NAME: &str = "topology";

/// One GPU's NICs, as the report shows them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuNicsLine {
    pub gpu: u32,
    pub pci_bus_id: String,
    pub nics: Vec<String>,
    pub relation: String,
}

/// The preset RxDM runs with (`--gpu_nic_preset NAME` or `=NAME`, or the fake RxDM's
/// `--gpu-nic-preset`, on a process's command line under /proc), if a process carries one.
pub fn rxdm_preset(host: &Host) -> Option<String> {
    let procs = std::fs::read_dir(host.path("/proc")).ok()?;
    for e in procs.filter_map(Result::ok) {
        let name = e.file_name();
        if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(raw) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = raw
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        for (i, a) in args.iter().enumerate() {
            // RxDM's gflags spelling, and the fake RxDM's (`tools/realplugin/fake-rxdm`).
            for flag in ["--gpu_nic_preset", "--gpu-nic-preset"] {
                if let Some(v) = a.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
                    return Some(v.to_string());
                }
                if a == flag {
                    if let Some(v) = args.get(i + 1) {
                        return Some(v.clone());
                    }
                }
            }
        }
    }
    None
}

/// The GPUs by (ordinal, PCI bus id): what CUDA lists on the real root (the daemon's own view),
/// else the driver's /proc entries in PCI order.
fn gpus(host: &Host) -> Vec<(u32, String)> {
    if host.probe_cuda {
        if let Ok(list) = crate::gpu::list_devices() {
            if !list.is_empty() {
                return list
                    .into_iter()
                    .map(|g| (g.ordinal as u32, g.pci_bus_id))
                    .collect();
            }
        }
    }
    proc_gpus(host)
        .unwrap_or_default()
        .into_iter()
        .enumerate()
        .map(|(i, b)| (i as u32, b))
        .collect()
}

/// `topology`: builds the map and judges it; the lines for the report.
pub fn check_topology(
    host: &Host,
    spec: &MapSpec,
    devices: Option<&[i32]>,
    plugin_devices: &[DeviceSummary],
) -> (Check, Vec<GpuNicsLine>) {
    let used: Vec<&DeviceSummary> = plugin_devices
        .iter()
        .filter(|d| devices.is_none_or(|list| list.contains(&d.dev)))
        .collect();
    if used.is_empty() {
        return (
            Check::warn(
                NAME,
                "no plugin devices: the GPU → NIC map cannot be worked out",
                "fix plugin.load and plugin.devices first",
            ),
            Vec::new(),
        );
    }
    let nics = used
        .iter()
        .map(|d| NicInfo {
            device: d.dev,
            name: d.name.clone(),
            place: d
                .pci_path
                .as_deref()
                .and_then(|p| crate::topology::nic_place(&host.root, p)),
            pci_path: d.pci_path.clone(),
        })
        .collect();
    let gpus = crate::topology::gpus(gpus(host), &host.root);
    let topo = match Topology::build(gpus, nics, spec) {
        Ok(t) => t,
        Err(e) => {
            return (
                Check::fail(
                    NAME,
                    e.to_string(),
                    "fix topology.map (TCPXD_TOPOLOGY, --topology): `pci`, `a3vm` or GPU=NIC;… naming every GPU (docs/OPERATIONS.md, \"The topology\")",
                ),
                Vec::new(),
            );
        }
    };
    let lines: Vec<GpuNicsLine> = topo
        .gpus
        .iter()
        .zip(&topo.bindings)
        .map(|(g, b)| GpuNicsLine {
            gpu: g.ordinal,
            pci_bus_id: g.pci_bus_id.clone(),
            nics: b.nics.iter().map(|&n| topo.nics[n].name.clone()).collect(),
            relation: b.relation.clone(),
        })
        .collect();
    if lines.is_empty() {
        return (
            Check::ok(
                NAME,
                format!("no GPUs: host memory on every NIC ({})", used.len()),
            ),
            lines,
        );
    }
    let summary = lines
        .iter()
        .map(|l| format!("{}->{}", l.gpu, l.nics.join("+")))
        .collect::<Vec<_>>()
        .join(" ");
    let unserved: Vec<String> = (0..topo.nics.len())
        .filter(|&n| topo.gpus_served(n).is_empty())
        .map(|n| topo.nics[n].name.clone())
        .collect();
    let (check, served) = judge(host, &topo, &summary);
    if let Some(c) = check {
        return (c, lines);
    }
    let note = if matches!(spec, MapSpec::Pci) && lines.iter().all(|l| l.relation.starts_with("even spread"))
    {
        "no PCI places here: the GPUs spread evenly over the NICs"
    } else {
        spec_note(spec)
    };
    let mut detail = format!("{} ({note}): {summary}; {served}", topo.source);
    if !unserved.is_empty() {
        detail += &format!("; serving no GPU (host memory only): {}", unserved.join(", "));
    }
    (Check::ok(NAME, detail), lines)
}

fn spec_note(spec: &MapSpec) -> &'static str {
    match spec {
        MapSpec::Pci => "each GPU's PCIe-nearest NIC",
        MapSpec::A3vm => "RxDM's a3vm preset",
        MapSpec::Explicit(_) => "topology.map",
    }
}

/// Against RxDM: a failure when the map contradicts its preset, else what was checked.
fn judge(host: &Host, topo: &Topology, summary: &str) -> (Option<Check>, String) {
    let Some(preset) = rxdm_preset(host) else {
        return (
            None,
            "RxDM's map not checked (no process with --gpu_nic_preset)".into(),
        );
    };
    if preset != "a3vm" {
        return (
            None,
            format!("RxDM runs preset {preset:?}, which tcpxd does not know: not checked"),
        );
    }
    let served: Vec<(&str, &str)> = A3VM.iter().flat_map(|n| n.gpus.map(|g| (g, n.name))).collect();
    let wrong = topo.contradictions(&served);
    if wrong.is_empty() {
        return (None, "agrees with RxDM's a3vm".into());
    }
    let what = wrong
        .iter()
        .map(|c| {
            format!(
                "GPU {} ({}) on {}, RxDM serves it on {}",
                c.gpu,
                c.pci_bus_id,
                c.ours.join("+"),
                c.rxdm
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    (
        Some(Check::fail(
            NAME,
            format!(
                "{} GPU(s) would have comms on NICs RxDM does not steer for them ({what}); map: {summary}",
                wrong.len()
            ),
            "set topology.map = \"a3vm\" (TCPXD_TOPOLOGY=a3vm): RxDM files each GPU's rules under the NIC its preset names, and a comm on another NIC exits the plugin (\"rx no cmsg\")",
        )),
        String::new(),
    )
}

#[cfg(test)]
mod tests {
    use super::super::Level;
    use super::super::testutil::{TempRoot, simple_host};
    use super::*;

    fn a3_devices() -> Vec<DeviceSummary> {
        A3VM.iter()
            .enumerate()
            .map(|(i, n)| DeviceSummary {
                dev: i as i32,
                name: n.name.into(),
                pci_path: None,
                speed_mbps: 200_000,
                pointers: "host+cuda".into(),
                unpack: true,
            })
            .collect()
    }

    fn a3_root(tag: &str) -> TempRoot {
        let root = TempRoot::new(tag);
        for n in A3VM {
            for g in n.gpus {
                root.write(
                    &format!("/proc/driver/nvidia/gpus/{g}/information"),
                    "Model: H100\n",
                );
            }
        }
        root
    }

    #[test]
    fn a_map_rxdm_contradicts_fails_with_the_fix() {
        let root = a3_root("topo-rxdm");
        root.write(
            "/proc/4242/cmdline",
            "/tcpgpudmarxd\0--gpu_nic_preset\0a3vm\0--uds_path\0/run/tcpx\0",
        );
        let h = simple_host(&root, &[]);
        assert_eq!(rxdm_preset(&h).as_deref(), Some("a3vm"));
        let fake = TempRoot::new("topo-fake-rxdm");
        fake.write("/proc/7/cmdline", "fake-rxdm\0--gpu-nic-preset=a3vm\0");
        assert_eq!(rxdm_preset(&simple_host(&fake, &[])).as_deref(), Some("a3vm"));
        // No sysfs places: the even spread, which is a3vm's map.
        let (c, lines) = check_topology(&h, &MapSpec::Pci, None, &a3_devices());
        assert_eq!(c.level, Level::Ok, "{c:?}");
        assert!(c.detail.contains("agrees with RxDM's a3vm"), "{}", c.detail);
        assert!(c.detail.starts_with("pci (no PCI places here"), "{}", c.detail);
        assert_eq!(lines.len(), 8);
        assert_eq!(
            (lines[5].gpu, lines[5].nics.clone()),
            (5, vec!["eth3".to_string()])
        );
        let swapped = MapSpec::parse("0=eth2;1=eth1;2=eth2;3=eth2;4=eth3;5=eth3;6=eth4;7=eth4").unwrap();
        let (c, _) = check_topology(&h, &swapped, None, &a3_devices());
        assert_eq!(c.level, Level::Fail, "{c:?}");
        assert!(
            c.detail
                .contains("GPU 0 (0000:04:00.0) on eth2, RxDM serves it on eth1"),
            "{}",
            c.detail
        );
        assert!(c.fix.contains("topology.map = \"a3vm\""), "{}", c.fix);
        // Without RxDM's preset on any command line: shown, not judged.
        let root = a3_root("topo-norxdm");
        let (c, _) = check_topology(&simple_host(&root, &[]), &swapped, None, &a3_devices());
        assert_eq!(c.level, Level::Ok, "{c:?}");
        assert!(c.detail.contains("not checked"), "{}", c.detail);
    }

    #[test]
    fn a_bad_map_or_no_devices_is_said() {
        let root = a3_root("topo-bad");
        let h = simple_host(&root, &[]);
        let (c, _) = check_topology(&h, &MapSpec::parse("0=eth1").unwrap(), None, &a3_devices());
        assert_eq!(c.level, Level::Fail);
        assert!(
            c.detail.contains("GPU 1 (0000:05:00.0) has no NIC"),
            "{}",
            c.detail
        );
        let (c, _) = check_topology(&h, &MapSpec::Pci, Some(&[9]), &a3_devices());
        assert_eq!(c.level, Level::Warn);
        let empty = TempRoot::new("topo-nogpu");
        let (c, lines) = check_topology(&simple_host(&empty, &[]), &MapSpec::A3vm, None, &a3_devices());
        assert_eq!(c.level, Level::Ok);
        assert!(
            lines.is_empty() && c.detail.starts_with("no GPUs"),
            "{}",
            c.detail
        );
    }
}
