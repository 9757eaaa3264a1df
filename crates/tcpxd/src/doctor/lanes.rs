//! The lane plan: each GPU's PCIe-nearest data NIC, from where sysfs places them in the PCI tree.

use std::path::{Component, Path};

use serde::Serialize;

use super::system::proc_gpus;
use super::{Check, Host};

/// One GPU's nearest data NIC.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LaneChoice {
    /// The GPU's PCI bus id.
    pub gpu: String,
    pub nic: Option<String>,
    /// "same PCIe switch", "same root complex", "different root complex" or why there is none.
    pub relation: String,
    /// PCI tree levels the two share below /sys/devices (1: the root complex only).
    pub shared_levels: usize,
}

/// Where a PCI device sits: its path under /sys/devices, as components below it.
fn pci_place(host: &Host, link: &Path) -> Option<Vec<String>> {
    let real = std::fs::canonicalize(link).ok()?;
    let root = std::fs::canonicalize(&host.root).unwrap_or_else(|_| host.root.clone());
    let inside = real.strip_prefix(&root).ok()?;
    let inside = Path::new("/").join(inside);
    let below = inside.strip_prefix("/sys/devices").ok()?;
    Some(
        below
            .components()
            .filter_map(|c| match c {
                Component::Normal(s) => Some(s.to_string_lossy().into_owned()),
                _ => None,
            })
            .collect(),
    )
}

fn shared(a: &[String], b: &[String]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn relation(levels: usize) -> &'static str {
    match levels {
        0 => "different root complex",
        1 => "same root complex",
        _ => "same PCIe switch",
    }
}

/// Each GPU's nearest NIC; ties go to the NIC with the fewest GPUs so far.
pub fn lane_plan(gpus: &[(String, Option<Vec<String>>)], nics: &[(String, Vec<String>)]) -> Vec<LaneChoice> {
    let mut load = vec![0usize; nics.len()];
    gpus.iter()
        .map(|(gpu, place)| {
            let Some(place) = place else {
                return LaneChoice {
                    gpu: gpu.clone(),
                    nic: None,
                    relation: "not found under /sys/bus/pci/devices".into(),
                    shared_levels: 0,
                };
            };
            let best = nics
                .iter()
                .enumerate()
                .map(|(i, (_, p))| (shared(place, p), i))
                .max_by(|a, b| a.0.cmp(&b.0).then(load[b.1].cmp(&load[a.1])).then(b.1.cmp(&a.1)));
            match best {
                None => LaneChoice {
                    gpu: gpu.clone(),
                    nic: None,
                    relation: "no data NIC with a PCI device".into(),
                    shared_levels: 0,
                },
                Some((levels, i)) => {
                    load[i] += 1;
                    LaneChoice {
                        gpu: gpu.clone(),
                        nic: Some(nics[i].0.clone()),
                        relation: relation(levels).into(),
                        shared_levels: levels,
                    }
                }
            }
        })
        .collect()
}

/// `lanes`: works out the plan and judges it.
pub fn check_lanes(host: &Host) -> (Check, Vec<LaneChoice>) {
    const NAME: &str = "lanes";
    let gpus = match proc_gpus(host) {
        Ok(g) if !g.is_empty() => g,
        _ => {
            return (
                Check::fail(
                    NAME,
                    "no GPUs under /proc/driver/nvidia/gpus: nothing to pair with NICs",
                    "fix the gpus check first",
                ),
                Vec::new(),
            );
        }
    };
    let (names, _) = host.data_nics();
    let mut nics = Vec::new();
    let mut virtual_nics = Vec::new();
    for n in &names {
        match pci_place(host, &host.path(format!("/sys/class/net/{n}/device"))) {
            Some(p) => nics.push((n.clone(), p)),
            None => virtual_nics.push(n.clone()),
        }
    }
    if nics.is_empty() {
        return (
            Check::fail(
                NAME,
                format!(
                    "no data NIC has a PCI device (checked {})",
                    if names.is_empty() {
                        "none".into()
                    } else {
                        names.join(", ")
                    }
                ),
                "name the gVNIC data NICs in NCCL_GPUDIRECTTCPX_SOCKET_IFNAME",
            ),
            Vec::new(),
        );
    }
    let places: Vec<(String, Option<Vec<String>>)> = gpus
        .iter()
        .map(|g| {
            (
                g.clone(),
                pci_place(host, &host.path(format!("/sys/bus/pci/devices/{g}"))),
            )
        })
        .collect();
    let plan = lane_plan(&places, &nics);
    let summary = plan
        .iter()
        .map(|l| format!("{}->{}", short(&l.gpu), l.nic.as_deref().unwrap_or("-")))
        .collect::<Vec<_>>()
        .join(" ");
    let far: Vec<&LaneChoice> = plan.iter().filter(|l| l.shared_levels < 2).collect();
    if far.is_empty() {
        let mut detail = format!("every GPU has a data NIC under its PCIe switch: {summary}");
        if !virtual_nics.is_empty() {
            detail += &format!(" (no PCI device: {})", virtual_nics.join(", "));
        }
        return (Check::ok(NAME, detail), plan);
    }
    (
        Check::warn(
            NAME,
            format!(
                "{} GPU(s) without a data NIC under their PCIe switch ({}): {summary}",
                far.len(),
                far.iter()
                    .map(|l| format!("{}: {}", short(&l.gpu), l.relation))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            "list every NIC that shares a switch with a GPU in NCCL_GPUDIRECTTCPX_SOCKET_IFNAME; transfers crossing the root complex are slower",
        ),
        plan,
    )
}

/// "0000:04:00.0" -> "04:00.0".
fn short(bus: &str) -> &str {
    bus.strip_prefix("0000:").unwrap_or(bus)
}

#[cfg(test)]
mod tests {
    use super::super::Level;
    use super::super::testutil::{TempRoot, simple_host};
    use super::*;

    /// An A3-like half: root complex pci0000:00 with two switches; GPUs and NICs under them.
    fn tree(root: &TempRoot, nic2_far: bool) {
        let sw = |n: u8| format!("/sys/devices/pci0000:00/0000:00:0{n}.0/0000:0{n}:00.0");
        let dev = |abs: &str| {
            root.mkdir(abs);
        };
        // GPU 04 and eth1 under switch 1; GPU 05 and eth2 under switch 2 (or eth2 elsewhere).
        dev(&format!("{}/0000:04:00.0", sw(1)));
        dev(&format!("{}/0000:06:00.0", sw(1)));
        dev(&format!("{}/0000:05:00.0", sw(2)));
        let eth2 = if nic2_far {
            "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0".to_string()
        } else {
            format!("{}/0000:07:00.0", sw(2))
        };
        dev(&eth2);
        root.symlink(
            "/sys/bus/pci/devices/0000:04:00.0",
            &format!("{}/0000:04:00.0", sw(1)),
        );
        root.symlink(
            "/sys/bus/pci/devices/0000:05:00.0",
            &format!("{}/0000:05:00.0", sw(2)),
        );
        root.mkdir("/sys/class/net/eth1");
        root.mkdir("/sys/class/net/eth2");
        root.symlink("/sys/class/net/eth1/device", &format!("{}/0000:06:00.0", sw(1)));
        root.symlink("/sys/class/net/eth2/device", &eth2);
        for g in ["0000:04:00.0", "0000:05:00.0"] {
            root.write(
                &format!("/proc/driver/nvidia/gpus/{g}/information"),
                "Model: H100\n",
            );
        }
    }

    #[test]
    fn lanes_ok_warn_fail() {
        let env = [("NCCL_GPUDIRECTTCPX_SOCKET_IFNAME", "eth1,eth2")];
        let root = TempRoot::new("lanes-fail");
        let (c, plan) = check_lanes(&simple_host(&root, &env));
        assert_eq!(c.level, Level::Fail, "{c:?}");
        assert!(plan.is_empty());

        let root = TempRoot::new("lanes-ok");
        tree(&root, false);
        let (c, plan) = check_lanes(&simple_host(&root, &env));
        assert_eq!(c.level, Level::Ok, "{c:?}");
        assert_eq!(plan.len(), 2);
        assert_eq!(plan[0].nic.as_deref(), Some("eth1"));
        assert_eq!(plan[1].nic.as_deref(), Some("eth2"));
        assert_eq!(plan[1].relation, "same PCIe switch");
        assert!(c.detail.contains("04:00.0->eth1 05:00.0->eth2"), "{}", c.detail);

        let root = TempRoot::new("lanes-warn");
        tree(&root, true);
        let (c, plan) = check_lanes(&simple_host(&root, &env));
        assert_eq!(c.level, Level::Warn, "{c:?}");
        // GPU 05 shares only the root complex with eth1, nothing with eth2.
        assert_eq!(plan[1].nic.as_deref(), Some("eth1"));
        assert_eq!(plan[1].relation, "same root complex");
        // No data NIC with a device link at all: fail.
        let (c, _) = check_lanes(&simple_host(&root, &[("NCCL_GPUDIRECTTCPX_SOCKET_IFNAME", "lo")]));
        assert_eq!(c.level, Level::Fail);
    }

    #[test]
    fn ties_spread_over_nics() {
        let p = |s: &str| s.split('/').map(String::from).collect::<Vec<_>>();
        let gpus = vec![
            ("a".to_string(), Some(p("pci0/s1/a"))),
            ("b".to_string(), Some(p("pci0/s1/b"))),
        ];
        let nics = vec![
            ("eth1".to_string(), p("pci0/s1/n1")),
            ("eth2".to_string(), p("pci0/s1/n2")),
        ];
        let plan = lane_plan(&gpus, &nics);
        assert_eq!(plan[0].nic.as_deref(), Some("eth1"));
        assert_eq!(plan[1].nic.as_deref(), Some("eth2"));
    }
}
