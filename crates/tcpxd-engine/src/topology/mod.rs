//! The node's topology: its GPUs, the plugin's devices (NICs) and which NIC(s) serve each GPU.
//!
//! On A3, RxDM binds each NIC's receive queues to two GPUs, and Google's plugin takes a comm's
//! GPU from the CUDA device current at `listen` / `connect` (docs/ARCHITECTURE.md, "The node's
//! topology"). So every comm the daemon opens is opened under a GPU its NIC serves, and a GPU's
//! data goes through that GPU's NIC. This module decides the map — from PCI distance, RxDM's
//! `a3vm` preset or an explicit list ([`MapSpec`]) — and answers the data path's questions
//! (which NICs a GPU has, which GPU to make current for a NIC, which lanes a pair of memories
//! takes: [`routes`]). Pure: the daemon reads sysfs and CUDA and hands the facts in.

mod catalogue;
mod route;
mod spec;

pub use catalogue::{
    CatalogueError, LaneCatalogue, LaneGroup, MAX_SUMMARY_GPUS, MAX_SUMMARY_NICS, SummaryGpu, TopologySummary,
};
pub use route::{Endpoint, Memory, Route, routes};
pub use spec::{A3VM, A3vmNic, GpuRef, MAX_MAP_ENTRIES, MapSpec, NicRef, a3vm_nic_of, is_bus_id};

use spec::{gpu_text, nic_text};

/// A CUDA device of the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// Its CUDA ordinal.
    pub ordinal: u32,
    /// Its PCI bus id, lower case (`0000:04:00.0`).
    pub pci_bus_id: String,
    /// Where it sits in the PCI tree: the components of its sysfs path below `/sys/devices`
    /// ([`place_of`]); `None` when it has none there (the CUDA stand-in, a container without
    /// sysfs).
    pub place: Option<Vec<String>>,
}

/// A device of the net plugin (a NIC).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NicInfo {
    /// The plugin's device index.
    pub device: i32,
    /// Its name (`getProperties`: the interface, `eth1`).
    pub name: String,
    /// Its `pciPath` as the plugin reports it.
    pub pci_path: Option<String>,
    /// Where it sits in the PCI tree ([`place_of`] of its resolved `pciPath`).
    pub place: Option<Vec<String>>,
}

/// A GPU's NICs and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    /// Positions in [`Topology::nics`], in order of preference (never empty).
    pub nics: Vec<usize>,
    /// How they were chosen: "same PCIe switch", "same root complex", "different root
    /// complex", "even spread (no PCI place)", "a3vm", "config".
    pub relation: String,
}

/// Why a topology could not be built; every message names `topology.map` or the part at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopologyError {
    #[error("topology.map {text:?}: {why}")]
    Spec { text: String, why: String },
    #[error("topology.map: {0}")]
    Map(String),
    #[error("topology: the plugin has no devices to serve GPUs")]
    NoNics,
}

/// The node's GPUs, NICs and each GPU's NICs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    pub gpus: Vec<GpuInfo>,
    pub nics: Vec<NicInfo>,
    /// One per GPU, in [`Topology::gpus`]' order.
    pub bindings: Vec<Binding>,
    /// Where the map came from: "pci", "a3vm", "config" (or "none": no GPUs).
    pub source: &'static str,
}

/// The components of a sysfs path below `/sys/devices` (`/sys/devices/pci0000:00/0000:00:01.0/…`
/// → `["pci0000:00", "0000:00:01.0", …]`); `None` for a path not under it.
pub fn place_of(path: &str) -> Option<Vec<String>> {
    let below = path.split_once("/sys/devices/")?.1;
    let parts: Vec<String> = below
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .map(String::from)
        .collect();
    (!parts.is_empty()).then_some(parts)
}

/// PCI tree levels two places share (1: the root complex only).
fn shared_levels(a: &[String], b: &[String]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

fn relation(levels: usize) -> &'static str {
    match levels {
        0 => "different root complex",
        1 => "same root complex",
        _ => "same PCIe switch",
    }
}

impl Topology {
    /// Builds the map `spec` asks for over these GPUs and NICs. With no GPUs the map is empty
    /// (host memory only, every NIC, nothing made current).
    pub fn build(gpus: Vec<GpuInfo>, nics: Vec<NicInfo>, spec: &MapSpec) -> Result<Topology, TopologyError> {
        if nics.is_empty() {
            return Err(TopologyError::NoNics);
        }
        let bindings = if gpus.is_empty() {
            Vec::new()
        } else {
            match spec {
                MapSpec::Pci => by_distance(&gpus, &nics),
                MapSpec::A3vm => a3vm(&gpus, &nics)?,
                MapSpec::Explicit(entries) => explicit(&gpus, &nics, entries)?,
            }
        };
        Ok(Topology {
            source: if gpus.is_empty() {
                "none"
            } else {
                spec.source_name()
            },
            gpus,
            nics,
            bindings,
        })
    }

    /// A made-up node for tests and benches: `gpus` GPUs (PCI ids `0000:04:00.0` on) spread
    /// evenly over `nics` NICs (`eth1` on) by [`MapSpec::Pci`] — GPU g on NIC g × nics / gpus,
    /// A3's two GPUs a NIC for 8 and 4 — with no PCI places. Fails as [`Topology::build`] does
    /// (no NICs).
    pub fn synthetic(gpus: u32, nics: i32) -> Result<Topology, TopologyError> {
        Topology::build(
            (0..gpus)
                .map(|o| GpuInfo {
                    ordinal: o,
                    pci_bus_id: format!("0000:{:02x}:00.0", o + 4),
                    place: None,
                })
                .collect(),
            (0..nics)
                .map(|d| NicInfo {
                    device: d,
                    name: format!("eth{}", d + 1),
                    pci_path: None,
                    place: None,
                })
                .collect(),
            &MapSpec::Pci,
        )
    }

    /// The position in [`Topology::gpus`] of the GPU with this ordinal.
    pub fn gpu_position(&self, ordinal: u32) -> Option<usize> {
        self.gpus.iter().position(|g| g.ordinal == ordinal)
    }

    /// The position in [`Topology::nics`] of the plugin device `device`.
    pub fn nic_position(&self, device: i32) -> Option<usize> {
        self.nics.iter().position(|n| n.device == device)
    }

    /// The NICs (positions) serving the GPU with this ordinal; empty for an unknown GPU.
    pub fn nics_of(&self, ordinal: u32) -> &[usize] {
        self.gpu_position(ordinal)
            .map(|i| self.bindings[i].nics.as_slice())
            .unwrap_or(&[])
    }

    /// The GPUs (ordinals) a NIC (position) serves, in ordinal order.
    pub fn gpus_served(&self, nic: usize) -> Vec<u32> {
        self.gpus
            .iter()
            .zip(&self.bindings)
            .filter(|(_, b)| b.nics.contains(&nic))
            .map(|(g, _)| g.ordinal)
            .collect()
    }

    /// The GPU to make current when opening a comm on a NIC (position) for host memory: the
    /// first GPU it serves. A NIC the map gives no GPU (more NICs than GPUs) still gets one, so
    /// that what is current is never left to chance: of n GPUs over D NICs, NIC j gets the GPU
    /// at position ⌈(j + 1) × n / D⌉ − 1 (the emulation's default map gives NIC j that GPU).
    /// `None` only without GPUs.
    pub fn listen_gpu(&self, nic: usize) -> Option<u32> {
        if let Some(&g) = self.gpus_served(nic).first() {
            return Some(g);
        }
        let (n, d) = (self.gpus.len(), self.nics.len());
        if n == 0 || nic >= d {
            return None;
        }
        Some(self.gpus[((nic + 1) * n).div_ceil(d) - 1].ordinal)
    }

    /// Where this map contradicts what RxDM serves (`served`: GPU PCI bus id → the NIC name
    /// RxDM files its rules under): each GPU of the node that RxDM serves on a NIC this map does
    /// not give it, or that this map gives a NIC RxDM does not serve it on.
    pub fn contradictions(&self, served: &[(&str, &str)]) -> Vec<Contradiction> {
        let mut out = Vec::new();
        for (g, b) in self.gpus.iter().zip(&self.bindings) {
            let Some((_, rxdm)) = served
                .iter()
                .find(|(bus, _)| bus.eq_ignore_ascii_case(&g.pci_bus_id))
            else {
                continue;
            };
            let ours: Vec<String> = b.nics.iter().map(|&n| self.nics[n].name.clone()).collect();
            if ours.len() != 1 || ours[0] != *rxdm {
                out.push(Contradiction {
                    gpu: g.ordinal,
                    pci_bus_id: g.pci_bus_id.clone(),
                    ours,
                    rxdm: rxdm.to_string(),
                });
            }
        }
        out
    }
}

/// A GPU this node's map puts on other NICs than RxDM serves it on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Contradiction {
    pub gpu: u32,
    pub pci_bus_id: String,
    /// The NIC names this map gives it.
    pub ours: Vec<String>,
    /// The NIC RxDM files its rules under.
    pub rxdm: String,
}

/// Each GPU's nearest NIC; a tie goes to the NIC with the fewest GPUs so far, then the first. A
/// GPU without a PCI place, or with no NIC having one, gets the even spread: the GPU at position
/// i of n gets NIC ⌊i × nics / n⌋ (eight GPUs over four NICs: two each, in order, as `a3vm`).
fn by_distance(gpus: &[GpuInfo], nics: &[NicInfo]) -> Vec<Binding> {
    let mut load = vec![0usize; nics.len()];
    let mut out = Vec::with_capacity(gpus.len());
    for (i, g) in gpus.iter().enumerate() {
        let best = g.place.as_ref().and_then(|place| {
            nics.iter()
                .enumerate()
                .filter_map(|(n, nic)| nic.place.as_ref().map(|p| (shared_levels(place, p), n)))
                .max_by(|a, b| a.0.cmp(&b.0).then(load[b.1].cmp(&load[a.1])).then(b.1.cmp(&a.1)))
        });
        let (nic, why) = match best {
            Some((levels, n)) => (n, relation(levels)),
            None => (i * nics.len() / gpus.len(), "even spread (no PCI place)"),
        };
        load[nic] += 1;
        out.push(Binding {
            nics: vec![nic],
            relation: why.to_string(),
        });
    }
    out
}

fn a3vm(gpus: &[GpuInfo], nics: &[NicInfo]) -> Result<Vec<Binding>, TopologyError> {
    gpus.iter()
        .map(|g| {
            let preset = a3vm_nic_of(&g.pci_bus_id).ok_or_else(|| {
                TopologyError::Map(format!(
                    "a3vm: GPU {} ({}) is not one of the preset's eight (04, 05, 0a, 0b, 84, 85, 8a, 8b:00.0); \
                     name each GPU's NIC instead (GPU=NIC;…)",
                    g.ordinal, g.pci_bus_id
                ))
            })?;
            let by_name = nics.iter().position(|n| n.name == preset.name);
            let by_pci = || {
                nics.iter().position(|n| {
                    n.pci_path
                        .as_deref()
                        .is_some_and(|p| p.trim_end_matches('/').ends_with(preset.pci))
                })
            };
            let nic = by_name.or_else(by_pci).ok_or_else(|| {
                TopologyError::Map(format!(
                    "a3vm: GPU {} ({}) is served by {} (PCI {}), and no plugin device is named so or sits there \
                     (devices: {})",
                    g.ordinal,
                    g.pci_bus_id,
                    preset.name,
                    preset.pci,
                    device_list(nics)
                ))
            })?;
            Ok(Binding {
                nics: vec![nic],
                relation: "a3vm".into(),
            })
        })
        .collect()
}

fn explicit(
    gpus: &[GpuInfo],
    nics: &[NicInfo],
    entries: &[(GpuRef, Vec<NicRef>)],
) -> Result<Vec<Binding>, TopologyError> {
    let position = |r: &GpuRef| {
        gpus.iter().position(|g| match r {
            GpuRef::Ordinal(o) => g.ordinal == *o,
            GpuRef::Bus(b) => g.pci_bus_id.eq_ignore_ascii_case(b),
        })
    };
    let mut found: Vec<Option<Vec<usize>>> = vec![None; gpus.len()];
    for (gpu, list) in entries {
        let i = position(gpu).ok_or_else(|| {
            TopologyError::Map(format!(
                "GPU {} is not on this node (GPUs: {})",
                gpu_text(gpu),
                gpus.iter()
                    .map(|g| format!("{} {}", g.ordinal, g.pci_bus_id))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?;
        if found[i].is_some() {
            return Err(TopologyError::Map(format!(
                "GPU {} ({}) is named twice",
                gpus[i].ordinal, gpus[i].pci_bus_id
            )));
        }
        let mut positions = Vec::new();
        for nic in list {
            let p = nics
                .iter()
                .position(|n| match nic {
                    NicRef::Index(d) => n.device == *d,
                    NicRef::Name(s) => n.name == *s,
                })
                .ok_or_else(|| {
                    TopologyError::Map(format!(
                        "GPU {}: NIC {} is not one of the plugin devices in use ({})",
                        gpu_text(gpu),
                        nic_text(nic),
                        device_list(nics)
                    ))
                })?;
            if !positions.contains(&p) {
                positions.push(p);
            }
        }
        found[i] = Some(positions);
    }
    found
        .into_iter()
        .zip(gpus)
        .map(|(f, g)| {
            f.map(|nics| Binding {
                nics,
                relation: "config".into(),
            })
            .ok_or_else(|| {
                TopologyError::Map(format!(
                    "GPU {} ({}) has no NIC: an explicit map names every GPU of the node",
                    g.ordinal, g.pci_bus_id
                ))
            })
        })
        .collect()
}

fn device_list(nics: &[NicInfo]) -> String {
    nics.iter()
        .map(|n| format!("{} {}", n.device, n.name))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests;
