//! How a node's GPU → NIC map is asked for (`topology.map`): from PCI distance, RxDM's `a3vm`
//! preset, or an explicit list; parsed here so that a bad setting is refused at start-up with
//! the part that is wrong named.

use super::TopologyError;

/// RxDM's `a3vm` preset (google/tcpgpudmarxd, `src/a3vm_gpu_rxq_configurator.cc`): each data NIC
/// with the two GPUs whose receive queues it serves, the NIC by interface name and PCI address.
pub const A3VM: [A3vmNic; 4] = [
    A3vmNic {
        name: "eth1",
        pci: "0000:06:00.0",
        gpus: ["0000:04:00.0", "0000:05:00.0"],
    },
    A3vmNic {
        name: "eth2",
        pci: "0000:0c:00.0",
        gpus: ["0000:0a:00.0", "0000:0b:00.0"],
    },
    A3vmNic {
        name: "eth3",
        pci: "0000:86:00.0",
        gpus: ["0000:84:00.0", "0000:85:00.0"],
    },
    A3vmNic {
        name: "eth4",
        pci: "0000:8c:00.0",
        gpus: ["0000:8a:00.0", "0000:8b:00.0"],
    },
];

/// One NIC of the `a3vm` preset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct A3vmNic {
    /// Its interface name (what the TCPX plugin reports as the device's name).
    pub name: &'static str,
    /// Its PCI address (the last component of the plugin's `pciPath`).
    pub pci: &'static str,
    /// The GPUs it serves, by PCI bus id.
    pub gpus: [&'static str; 2],
}

/// The `a3vm` NIC serving a GPU (by PCI bus id, any case), if the preset names it.
pub fn a3vm_nic_of(gpu_bus_id: &str) -> Option<&'static A3vmNic> {
    let id = gpu_bus_id.to_ascii_lowercase();
    A3VM.iter().find(|n| n.gpus.contains(&id.as_str()))
}

/// A GPU as a map names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuRef {
    /// Its CUDA ordinal.
    Ordinal(u32),
    /// Its PCI bus id, lower case (`0000:04:00.0`).
    Bus(String),
}

/// A NIC as a map names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NicRef {
    /// The plugin's device index.
    Index(i32),
    /// The device's name (`eth1`).
    Name(String),
}

/// What `topology.map` asks for.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum MapSpec {
    /// Each GPU's PCIe-nearest NIC (the default); GPUs or NICs without a PCI place are spread
    /// evenly in order.
    #[default]
    Pci,
    /// RxDM's `a3vm` preset ([`A3VM`]).
    A3vm,
    /// An explicit list: each GPU with its NICs.
    Explicit(Vec<(GpuRef, Vec<NicRef>)>),
}

/// The most entries an explicit map may have (GPUs of a node).
pub const MAX_MAP_ENTRIES: usize = 64;

impl MapSpec {
    /// Parses `pci`, `a3vm`, or `GPU=NIC[+NIC…];GPU=NIC…` (GPU: a CUDA ordinal or a PCI bus id;
    /// NIC: a plugin device index or name). Whitespace around the parts is ignored.
    pub fn parse(text: &str) -> Result<MapSpec, TopologyError> {
        let t = text.trim();
        match t {
            "" | "pci" => return Ok(MapSpec::Pci),
            "a3vm" => return Ok(MapSpec::A3vm),
            _ => {}
        }
        let bad = |why: String| TopologyError::Spec {
            text: text.to_string(),
            why,
        };
        let mut entries: Vec<(GpuRef, Vec<NicRef>)> = Vec::new();
        for part in t.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            let (gpu, nics) = part.split_once('=').ok_or_else(|| {
                bad(format!(
                    "{part:?} is not GPU=NIC (e.g. 0=eth1 or 0000:04:00.0=eth1+eth2)"
                ))
            })?;
            let gpu = parse_gpu(gpu.trim()).map_err(&bad)?;
            if entries.iter().any(|(g, _)| *g == gpu) {
                return Err(bad(format!("GPU {} is named twice", gpu_text(&gpu))));
            }
            let mut list = Vec::new();
            for n in nics.split('+').map(str::trim) {
                if n.is_empty() {
                    return Err(bad(format!("{part:?}: an empty NIC name")));
                }
                let nic = match n.parse::<i32>() {
                    Ok(i) if i >= 0 => NicRef::Index(i),
                    Ok(_) => return Err(bad(format!("{part:?}: NIC index {n} is negative"))),
                    Err(_) => NicRef::Name(n.to_string()),
                };
                if !list.contains(&nic) {
                    list.push(nic);
                }
            }
            entries.push((gpu, list));
            if entries.len() > MAX_MAP_ENTRIES {
                return Err(bad(format!("more than {MAX_MAP_ENTRIES} GPUs")));
            }
        }
        if entries.is_empty() {
            return Err(bad("no GPU=NIC entry".into()));
        }
        Ok(MapSpec::Explicit(entries))
    }

    /// The name `DescribeNode` and the doctor show for where the map came from.
    pub fn source_name(&self) -> &'static str {
        match self {
            MapSpec::Pci => "pci",
            MapSpec::A3vm => "a3vm",
            MapSpec::Explicit(_) => "config",
        }
    }
}

fn parse_gpu(s: &str) -> Result<GpuRef, String> {
    if let Ok(n) = s.parse::<u32>() {
        return Ok(GpuRef::Ordinal(n));
    }
    let lower = s.to_ascii_lowercase();
    if is_bus_id(&lower) {
        return Ok(GpuRef::Bus(lower));
    }
    Err(format!(
        "GPU {s:?} is neither a CUDA ordinal nor a PCI bus id like 0000:04:00.0"
    ))
}

/// `dddd:bb:dd.f` in hex.
pub fn is_bus_id(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && s.char_indices()
            .all(|(i, c)| matches!(i, 4 | 7 | 10) || c.is_ascii_hexdigit())
}

pub(super) fn gpu_text(g: &GpuRef) -> String {
    match g {
        GpuRef::Ordinal(n) => n.to_string(),
        GpuRef::Bus(b) => b.clone(),
    }
}

pub(super) fn nic_text(n: &NicRef) -> String {
    match n {
        NicRef::Index(i) => i.to_string(),
        NicRef::Name(s) => s.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_three_forms() {
        assert_eq!(MapSpec::parse("pci").unwrap(), MapSpec::Pci);
        assert_eq!(MapSpec::parse(" ").unwrap(), MapSpec::Pci);
        assert_eq!(MapSpec::parse("a3vm").unwrap(), MapSpec::A3vm);
        assert_eq!(
            MapSpec::parse("0=eth1; 0000:0A:00.0 = eth2+3 ;").unwrap(),
            MapSpec::Explicit(vec![
                (GpuRef::Ordinal(0), vec![NicRef::Name("eth1".into())]),
                (
                    GpuRef::Bus("0000:0a:00.0".into()),
                    vec![NicRef::Name("eth2".into()), NicRef::Index(3)]
                ),
            ])
        );
    }

    #[test]
    fn refuses_what_it_cannot_read_naming_the_part() {
        for (text, says) in [
            ("eth1", "is not GPU=NIC"),
            ("x=eth1", "neither a CUDA ordinal nor a PCI bus id"),
            ("0=eth1;0=eth2", "GPU 0 is named twice"),
            ("0=eth1+", "an empty NIC name"),
            ("0=-1", "negative"),
            (";;", "no GPU=NIC entry"),
        ] {
            let e = MapSpec::parse(text).unwrap_err().to_string();
            assert!(e.contains(says), "{text}: {e}");
            assert!(e.contains("topology.map"), "{e}");
        }
    }

    #[test]
    fn the_preset_is_rxdms() {
        assert_eq!(a3vm_nic_of("0000:05:00.0").unwrap().name, "eth1");
        assert_eq!(a3vm_nic_of("0000:8B:00.0").unwrap().name, "eth4");
        assert!(a3vm_nic_of("0000:06:00.0").is_none());
        assert!(is_bus_id("0000:04:00.0") && !is_bus_id("0000:04:00") && !is_bus_id("0000:0g:00.0"));
    }
}
