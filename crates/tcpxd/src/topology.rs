//! The node's topology as the daemon finds it: the CUDA devices with their PCI bus ids, the
//! plugin's devices with their `pciPath`s, and where sysfs places each; the map itself is decided
//! by the engine (`crate::engine::topology`, pure and unit-tested). Also the one place the data
//! path makes a GPU current before a comm is opened (`make_current`), since the plugin takes a
//! comm's GPU from the CUDA device current at `listen` / `connect` (docs/ARCHITECTURE.md, "The
//! node's topology").

use std::path::Path;

use crate::engine::topology::{GpuInfo, MapSpec, NicInfo, Topology, TopologyError, place_of};
use crate::net::Plugin;

/// Where a PCI device sits: the real path of `link` (under `root`), as components below
/// `/sys/devices`; `None` when it does not exist.
fn resolved_place(root: &Path, link: &Path) -> Option<Vec<String>> {
    let real = std::fs::canonicalize(link).ok()?;
    let root = std::fs::canonicalize(root).unwrap_or_else(|_| root.to_path_buf());
    let inside = Path::new("/").join(real.strip_prefix(&root).ok()?);
    place_of(&inside.to_string_lossy())
}

/// A GPU's place: `/sys/bus/pci/devices/<bus id>` resolved. A device there whose PCI class is
/// not a display controller (`0x03…`) is not this GPU (the CUDA stand-in's bus ids may name
/// another device of the machine): no place.
pub fn gpu_place(root: &Path, bus_id: &str) -> Option<Vec<String>> {
    let link = root.join(format!("sys/bus/pci/devices/{}", bus_id.to_ascii_lowercase()));
    if let Ok(class) = std::fs::read_to_string(link.join("class")) {
        if !class.trim().starts_with("0x03") {
            return None;
        }
    }
    resolved_place(root, &link)
}

/// A NIC's place: its `pciPath` resolved, when it exists under `root`. A path this machine does
/// not have (the emulation reports A3-like ones anywhere) gives no place: compared with the real
/// places of this machine's GPUs it would pair them by accident, so such NICs get the even
/// spread, as the emulation's own default map does.
pub fn nic_place(root: &Path, pci_path: &str) -> Option<Vec<String>> {
    let inside = root.join(pci_path.trim_start_matches('/'));
    resolved_place(root, &inside)
}

/// The plugin's devices in use (in `devices`' order), with their places.
pub fn nics(plugin: &Plugin, devices: &[i32], root: &Path) -> Vec<NicInfo> {
    devices
        .iter()
        .filter_map(|&d| plugin.devices().iter().find(|p| p.dev == d))
        .map(|p| NicInfo {
            device: p.dev,
            name: p.name.clone(),
            place: p.pci_path.as_deref().and_then(|path| nic_place(root, path)),
            pci_path: p.pci_path.clone(),
        })
        .collect()
}

/// GPUs by (ordinal, PCI bus id), with their places.
pub fn gpus(list: impl IntoIterator<Item = (u32, String)>, root: &Path) -> Vec<GpuInfo> {
    list.into_iter()
        .map(|(ordinal, bus)| {
            let bus = bus.to_ascii_lowercase();
            GpuInfo {
                ordinal,
                place: gpu_place(root, &bus),
                pci_bus_id: bus,
            }
        })
        .collect()
}

/// The node's topology at start-up: the CUDA devices (none without a driver: a warning when
/// listing them fails), the plugin devices in use, the map `spec` asks for.
pub fn discover(plugin: &Plugin, devices: &[i32], spec: &MapSpec) -> Result<Topology, TopologyError> {
    let root = Path::new("/");
    let list = match crate::gpu::list_devices() {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!("listing CUDA devices for the topology: {e}; treating the node as having none");
            Vec::new()
        }
    };
    let topo = Topology::build(
        gpus(list.into_iter().map(|g| (g.ordinal as u32, g.pci_bus_id)), root),
        nics(plugin, devices, root),
        spec,
    )?;
    for (g, b) in topo.gpus.iter().zip(&topo.bindings) {
        tracing::info!(
            gpu = g.ordinal,
            pci = %g.pci_bus_id,
            nics = %b.nics.iter().map(|&n| topo.nics[n].name.as_str()).collect::<Vec<_>>().join("+"),
            why = %b.relation,
            "topology"
        );
    }
    Ok(topo)
}

/// Makes GPU `gpu` current on this thread before the plugin opens a comm (listen, each connect
/// and accept call); `None` (a node without GPUs) leaves the thread as it is.
pub fn make_current(gpu: Option<u32>) -> Result<(), String> {
    let Some(g) = gpu else { return Ok(()) };
    crate::gpu::shared(g as usize)
        .and_then(|d| d.bind_to_thread())
        .map_err(|e| format!("making GPU {g} current: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_resolve_under_a_root_or_read_as_written() {
        let root = std::env::temp_dir().join(format!("tcpxd-topology-{}", std::process::id()));
        let dev = root.join("sys/devices/pci0000:00/0000:00:01.0/0000:04:00.0");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::create_dir_all(root.join("sys/bus/pci/devices")).unwrap();
        let link = root.join("sys/bus/pci/devices/0000:04:00.0");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&dev, &link).unwrap();
        assert_eq!(
            gpu_place(&root, "0000:04:00.0").unwrap(),
            ["pci0000:00", "0000:00:01.0", "0000:04:00.0"]
        );
        assert_eq!(gpu_place(&root, "0000:05:00.0"), None);
        // A display controller is taken; another device at that address is not the GPU.
        std::fs::write(dev.join("class"), "0x030200\n").unwrap();
        assert!(gpu_place(&root, "0000:04:00.0").is_some());
        std::fs::write(dev.join("class"), "0x020000\n").unwrap();
        assert_eq!(gpu_place(&root, "0000:04:00.0"), None);
        std::fs::remove_file(dev.join("class")).unwrap();
        let g = gpus([(0, "0000:04:00.0".to_string())], &root);
        assert_eq!(g[0].pci_bus_id, "0000:04:00.0");
        assert!(g[0].place.is_some());
        // A pciPath this machine has is resolved; one it lacks gives no place.
        assert_eq!(
            nic_place(&root, "/sys/devices/pci0000:00/0000:00:01.0/0000:04:00.0").unwrap()[2],
            "0000:04:00.0"
        );
        assert_eq!(
            nic_place(&root, "/sys/devices/pci0000:80/0000:80:01.0/0000:86:00.0"),
            None
        );
        assert_eq!(nic_place(&root, "eth1"), None);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn no_gpu_makes_nothing_current() {
        assert_eq!(make_current(None), Ok(()));
    }
}
