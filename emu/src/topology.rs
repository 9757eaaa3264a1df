//! The binding between GPUs and emulated NICs that RxDM imposes on A3
//! (reference/TCPX_PLUGIN_ABI.md §8): each NIC's `pciPath` (`TCPXEMU_DEV<n>_PCI_PATH`), the GPUs
//! it serves (`TCPXEMU_DEV<n>_GPUS`, default RxDM's `a3vm` scaled to the GPUs present), and the
//! queries the verdict on a comm asks (`misbound.rs`). It imports nothing of the crate's, so
//! `config.rs` builds on it without a circle.

use std::ffi::{CStr, CString};

/// A3's data NICs' PCI bus ids (eth1..eth4), in device order.
const A3_NICS: [&str; 4] = ["0000:06:00.0", "0000:0c:00.0", "0000:86:00.0", "0000:8c:00.0"];

/// The default `pciPath` of device `d`: A3's NICs in sysfs-shaped paths for devices 0..3 (two
/// per root complex, each under its own switch), a synthetic root complex beyond. The last
/// component is always the NIC's bus id, as the real plugin's `realpath` of
/// `/sys/class/net/<if>/device` is.
pub(crate) fn default_pci_path(d: usize) -> String {
    match A3_NICS.get(d) {
        Some(nic) => {
            let bus = u8::from_str_radix(&nic[5..7], 16).unwrap_or(0);
            let rc = if d < 2 { 0x00u8 } else { 0x80 };
            format!(
                "/sys/devices/pci0000:{rc:02x}/0000:{rc:02x}:{port:02x}.0/0000:{sw:02x}:00.0/{nic}",
                port = d % 2 + 1,
                sw = bus - 3,
            )
        }
        None => format!(
            "/sys/devices/pci0000:c0/0000:c0:{d:02x}.0/0000:{bus:02x}:00.0",
            bus = 0xc0 + d
        ),
    }
}

/// `TCPXEMU_DEV<n>_PCI_PATH` resolved: `none` is NULL, unset the default.
pub(crate) fn pci_path(d: usize, raw: Option<String>) -> Option<&'static CStr> {
    let text = match raw.as_deref() {
        Some("none") => return None,
        Some(p) => p.to_string(),
        None => default_pci_path(d),
    };
    let c = CString::new(text).ok()?;
    Some(Box::leak(c.into_boxed_c_str()))
}

/// One GPU named in `TCPXEMU_DEV<n>_GPUS`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum GpuRef {
    Ordinal(i32),
    /// Lower case, `0000:04:00.0`.
    BusId(String),
}

/// What a device's `GPUS` setting says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum GpuSpec {
    /// Unset: the scaled `a3vm` default.
    Default,
    /// `all`: every GPU (the binding is not modelled on this NIC).
    All,
    List(Vec<GpuRef>),
}

/// Parse a `GPUS` value; `Err` names the entry it could not read.
pub(crate) fn parse_gpus(raw: Option<&str>) -> Result<GpuSpec, String> {
    let Some(v) = raw else {
        return Ok(GpuSpec::Default);
    };
    if v == "all" {
        return Ok(GpuSpec::All);
    }
    let mut list = Vec::new();
    for e in v.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        if let Ok(n) = e.parse::<i32>()
            && n >= 0
        {
            list.push(GpuRef::Ordinal(n));
        } else if is_bus_id(e) {
            list.push(GpuRef::BusId(e.to_ascii_lowercase()));
        } else {
            return Err(format!(
                "{e:?} is neither a CUDA ordinal nor a PCI bus id like 0000:04:00.0"
            ));
        }
    }
    Ok(GpuSpec::List(list))
}

fn is_bus_id(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && b.iter()
            .enumerate()
            .all(|(i, c)| matches!(i, 4 | 7 | 10) || c.is_ascii_hexdigit())
}

/// The binding in force (CUDA mode): which GPUs (by ordinal) each device serves.
#[derive(Debug)]
pub(crate) struct Binding {
    /// The GPUs present, by ordinal: their PCI bus ids (lower case).
    pub(crate) gpus: Vec<String>,
    /// Per device: `None` = serves every GPU; else served[ordinal].
    pub(crate) serves: Vec<Option<Vec<bool>>>,
}

/// The scaled `a3vm` default: with `g` GPUs and `d` devices, does device `dev` serve GPU `gpu`?
/// g ≥ d: GPU i is served by device ⌊i·d/g⌋ (8 GPUs, 4 NICs: pairs, RxDM's a3vm table when
/// ordinals follow A3's bus ids); g < d: device j serves the last GPU i with ⌊i·d/g⌋ ≤ j, i.e.
/// ⌈(j+1)·g/d⌉ − 1 (every NIC serves one GPU, and GPU i is served by device ⌊i·d/g⌋, the
/// daemon's even spread, among others).
pub(crate) fn scaled_a3vm(dev: usize, gpu: usize, g: usize, d: usize) -> bool {
    if g == 0 || d == 0 {
        return false;
    }
    if g >= d {
        gpu * d / g == dev
    } else {
        ((dev + 1) * g).div_ceil(d) - 1 == gpu
    }
}

impl Binding {
    /// Resolve each device's spec against the GPUs present; unknown GPUs are warnings.
    pub(crate) fn resolve(gpus: Vec<String>, specs: &[GpuSpec], w: &mut Vec<String>) -> Binding {
        let g = gpus.len();
        let d = specs.len();
        let serves = specs
            .iter()
            .enumerate()
            .map(|(dev, spec)| match spec {
                GpuSpec::All => None,
                GpuSpec::Default => Some((0..g).map(|i| scaled_a3vm(dev, i, g, d)).collect()),
                GpuSpec::List(list) => {
                    let mut v = vec![false; g];
                    for r in list {
                        let at = match r {
                            GpuRef::Ordinal(n) => usize::try_from(*n).ok().filter(|&n| n < g),
                            GpuRef::BusId(b) => gpus.iter().position(|x| x == b),
                        };
                        match at {
                            Some(i) => v[i] = true,
                            None => w.push(format!(
                                "tcpxemu: TCPXEMU_DEV{dev}_GPUS names {r:?}, which is not one of this \
                                 process's {g} CUDA device(s) ({}); ignored",
                                gpus.join(", ")
                            )),
                        }
                    }
                    Some(v)
                }
            })
            .collect();
        Binding { gpus, serves }
    }

    /// Does device `dev` serve GPU `ordinal`?
    pub(crate) fn serves(&self, dev: usize, ordinal: i32) -> bool {
        match self.serves.get(dev) {
            None => false,
            Some(None) => true,
            Some(Some(v)) => usize::try_from(ordinal).ok().and_then(|i| v.get(i)).copied() == Some(true),
        }
    }

    /// GPU `ordinal` as logs name it: `0000:04:00.0 (GPU 0)`.
    pub(crate) fn describe(&self, ordinal: i32) -> String {
        match usize::try_from(ordinal).ok().and_then(|i| self.gpus.get(i)) {
            Some(b) => format!("{b} (GPU {ordinal})"),
            None => format!("GPU {ordinal}"),
        }
    }

    /// Device `dev`'s GPUs for the init line: `all` or `0000:04:00.0,0000:05:00.0`.
    pub(crate) fn served_list(&self, dev: usize) -> String {
        match self.serves.get(dev) {
            Some(None) => "all".into(),
            Some(Some(v)) => {
                let l: Vec<&str> = v
                    .iter()
                    .zip(&self.gpus)
                    .filter(|(s, _)| **s)
                    .map(|(_, b)| b.as_str())
                    .collect();
                if l.is_empty() { "none".into() } else { l.join(",") }
            }
            None => "none".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_paths_end_in_a3_bus_ids() {
        for (d, nic) in A3_NICS.iter().enumerate() {
            let p = default_pci_path(d);
            assert!(p.starts_with("/sys/devices/pci0000:"), "{p}");
            assert_eq!(p.rsplit('/').next().unwrap(), *nic);
        }
        assert_eq!(
            default_pci_path(0),
            "/sys/devices/pci0000:00/0000:00:01.0/0000:03:00.0/0000:06:00.0"
        );
        assert_eq!(
            default_pci_path(3),
            "/sys/devices/pci0000:80/0000:80:02.0/0000:89:00.0/0000:8c:00.0"
        );
        assert_eq!(
            default_pci_path(5),
            "/sys/devices/pci0000:c0/0000:c0:05.0/0000:c5:00.0"
        );
        assert!(pci_path(0, Some("none".into())).is_none());
        assert_eq!(
            pci_path(1, Some("/x/y".into())).unwrap().to_str().unwrap(),
            "/x/y"
        );
    }

    #[test]
    fn scaled_default_is_a3vm_for_eight_gpus_and_four_nics() {
        let map: Vec<Vec<usize>> = (0..4)
            .map(|n| (0..8).filter(|&g| scaled_a3vm(n, g, 8, 4)).collect())
            .collect();
        assert_eq!(map, vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
        // One GPU, four NICs: every NIC serves it. Two GPUs, four NICs: 0,0,1,1.
        assert!((0..4).all(|n| scaled_a3vm(n, 0, 1, 4)));
        let two: Vec<usize> = (0..4)
            .map(|n| (0..2).find(|&g| scaled_a3vm(n, g, 2, 4)).unwrap())
            .collect();
        assert_eq!(two, vec![0, 0, 1, 1]);
        // Every GPU is served by device floor(i*d/g) (the daemon's even spread), whatever g and d.
        for g in 1..=9 {
            for d in 1..=5 {
                for i in 0..g {
                    assert!(scaled_a3vm(i * d / g, i, g, d), "g={g} d={d} i={i}");
                }
            }
        }
    }

    #[test]
    fn gpu_lists_parse_and_resolve() {
        assert_eq!(parse_gpus(None), Ok(GpuSpec::Default));
        assert_eq!(parse_gpus(Some("all")), Ok(GpuSpec::All));
        assert_eq!(
            parse_gpus(Some("0000:0A:00.0, 3")),
            Ok(GpuSpec::List(vec![
                GpuRef::BusId("0000:0a:00.0".into()),
                GpuRef::Ordinal(3)
            ]))
        );
        assert!(parse_gpus(Some("eth1")).is_err());
        let gpus: Vec<String> = ["0000:04:00.0", "0000:05:00.0", "0000:0a:00.0"]
            .map(String::from)
            .to_vec();
        let mut w = Vec::new();
        let b = Binding::resolve(
            gpus,
            &[
                parse_gpus(Some("0000:0a:00.0,1")).unwrap(),
                GpuSpec::All,
                parse_gpus(Some("7")).unwrap(),
            ],
            &mut w,
        );
        assert!(!b.serves(0, 0) && b.serves(0, 1) && b.serves(0, 2));
        assert!(b.serves(1, 0) && b.serves(1, 2));
        assert!(!b.serves(2, 0) && !b.serves(3, 0));
        assert_eq!(w.len(), 1, "{w:?}");
        assert_eq!(b.served_list(0), "0000:05:00.0,0000:0a:00.0");
        assert_eq!(b.served_list(2), "none");
        assert_eq!(b.describe(2), "0000:0a:00.0 (GPU 2)");
    }
}
