//! The plugin checks: the file loads, exports `ncclNetPlugin_v7`, initialises and reports devices.

use serde::Serialize;

use super::{Check, Host};
use crate::config::PluginChoice;
use crate::net::{DeviceProperties, NetError, Plugin};

/// A plugin device, as the report shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceSummary {
    pub dev: i32,
    pub name: String,
    pub pci_path: Option<String>,
    pub speed_mbps: i32,
    /// "host", "cuda" or "host+cuda".
    pub pointers: String,
    pub unpack: bool,
}

impl From<&DeviceProperties> for DeviceSummary {
    fn from(d: &DeviceProperties) -> Self {
        let pointers = match (d.supports_host(), d.supports_cuda()) {
            (true, true) => "host+cuda",
            (true, false) => "host",
            (false, true) => "cuda",
            (false, false) => "none",
        };
        DeviceSummary {
            dev: d.dev,
            name: d.name.clone(),
            pci_path: d.pci_path.clone(),
            speed_mbps: d.speed_mbps,
            pointers: pointers.into(),
            unpack: d.uses_unpack(),
        }
    }
}

const INSTALL_FIX: &str = "install Google's nccl-plugin-gpudirecttcpx and point --plugin (TCPXD_PLUGIN, plugin.path) at its libnccl-net.so in an executable directory such as /usr/local/tcpx/lib64";

/// `plugin.load` and `plugin.devices`.
pub fn check_plugin(host: &Host, choice: &PluginChoice) -> (Vec<Check>, Vec<DeviceSummary>) {
    let loaded = match choice {
        PluginChoice::BuiltinEmulation => Plugin::builtin_emulation().map(|p| {
            (
                p,
                Check::warn(
                    "plugin.load",
                    "the built-in emulation plugin (TCP over loopback), not GPUDirect-TCPX",
                    "for real transfers drop --builtin-emulation and name the TCPX plugin with --plugin",
                ),
            )
        }),
        PluginChoice::Path(path) => Plugin::load(path).map(|p| {
            let detail = format!(
                "{} exports ncclNetPlugin_v7 (plugin {:?}) and initialised",
                path.display(),
                p.name()
            );
            (p, Check::ok("plugin.load", detail))
        }),
    };
    match loaded {
        Ok((plugin, load)) => {
            let devices = plugin.devices();
            (
                vec![load, check_devices(host, devices)],
                devices.iter().map(DeviceSummary::from).collect(),
            )
        }
        Err(e) => {
            let fix = match &e {
                NetError::FileMissing { .. } => INSTALL_FIX.to_string(),
                NetError::NotLoadable { reason, .. } if reason.contains("failed to map segment") => {
                    "the file sits on a noexec mount: copy it to an executable directory (see plugin.noexec)"
                        .into()
                }
                NetError::NotLoadable { .. } => {
                    "check the file is a shared library for this architecture and that its dependencies resolve (ldd)".into()
                }
                NetError::SymbolMissing { .. } => {
                    "this is not a v7 NCCL net plugin: use GPUDirect-TCPX's libnccl-net.so".into()
                }
                _ => "check RxDM runs and the NCCL_GPUDIRECTTCPX_* settings (see the checks below); the plugin's own lines are above".into(),
            };
            (
                vec![
                    Check::fail("plugin.load", e.to_string(), fix),
                    Check::fail(
                        "plugin.devices",
                        "no devices: the plugin did not load",
                        "fix plugin.load first",
                    ),
                ],
                Vec::new(),
            )
        }
    }
}

/// `plugin.devices`: at least one device; each one named among the data NICs when those are set.
pub fn check_devices(host: &Host, devices: &[DeviceProperties]) -> Check {
    if devices.is_empty() {
        return Check::fail(
            "plugin.devices",
            "the plugin reports no devices",
            "the plugin found no data NIC: check NCCL_GPUDIRECTTCPX_SOCKET_IFNAME names NICs that are up",
        );
    }
    let listed = devices
        .iter()
        .map(|d| {
            format!(
                "{} ({} Mbps, {})",
                d.name,
                d.speed_mbps,
                DeviceSummary::from(d).pointers
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    let detail = format!("{} device(s): {listed}", devices.len());
    let (nics, from_env) = host.data_nics();
    if from_env {
        let strays: Vec<&str> = devices
            .iter()
            .map(|d| d.name.as_str())
            .filter(|n| !nics.iter().any(|x| x == n))
            .collect();
        if !strays.is_empty() {
            return Check::warn(
                "plugin.devices",
                format!(
                    "{detail}; {} not in NCCL_GPUDIRECTTCPX_SOCKET_IFNAME={}",
                    strays.join(", "),
                    nics.join(",")
                ),
                "make NCCL_GPUDIRECTTCPX_SOCKET_IFNAME list exactly the data NICs the plugin should use",
            );
        }
    }
    Check::ok("plugin.devices", detail)
}

#[cfg(test)]
mod tests {
    use super::super::Level;
    use super::super::testutil::{TempRoot, simple_host};
    use super::*;

    fn dev(name: &str) -> DeviceProperties {
        DeviceProperties {
            dev: 0,
            name: name.into(),
            pci_path: None,
            guid: 0,
            ptr_support: crate::net::abi::NCCL_PTR_HOST,
            speed_mbps: 200_000,
            port: 0,
            latency: 0.0,
            max_comms: 1,
            max_recvs: 1,
            net_device_type: 0,
            net_device_version: 0,
        }
    }

    #[test]
    fn devices_ok_warn_fail() {
        let root = TempRoot::new("plugdev");
        let h = simple_host(&root, &[("NCCL_GPUDIRECTTCPX_SOCKET_IFNAME", "eth1,eth2")]);
        let c = check_devices(&h, &[dev("eth1"), dev("eth2")]);
        assert_eq!(c.level, Level::Ok, "{c:?}");
        assert!(c.detail.contains("2 device(s)"));
        let c = check_devices(&h, &[dev("eth1"), dev("eth9")]);
        assert_eq!(c.level, Level::Warn, "{c:?}");
        assert!(c.detail.contains("eth9 not in"));
        let c = check_devices(&h, &[]);
        assert_eq!(c.level, Level::Fail);
        // Without the variable any names do.
        let h = simple_host(&root, &[]);
        assert_eq!(check_devices(&h, &[dev("tcpxemu0")]).level, Level::Ok);
    }

    #[test]
    fn load_fails_name_the_reason() {
        let root = TempRoot::new("plugload");
        let h = simple_host(&root, &[]);
        let (c, devs) = check_plugin(&h, &PluginChoice::Path(root.0.join("absent.so")));
        assert_eq!(c[0].level, Level::Fail);
        assert!(c[0].detail.contains("does not exist"), "{c:?}");
        assert!(c[0].fix.contains("nccl-plugin-gpudirecttcpx"));
        assert_eq!(c[1].level, Level::Fail);
        assert!(devs.is_empty());

        let junk = root.write("/junk.so", "not an ELF file");
        let (c, _) = check_plugin(&h, &PluginChoice::Path(junk));
        assert_eq!(c[0].level, Level::Fail);
        assert!(c[0].detail.contains("could not be loaded"), "{c:?}");

        // A real shared library without the symbol: this process's libc.
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        let libc = maps
            .lines()
            .filter_map(|l| l.split_whitespace().nth(5))
            .find(|p| p.contains("/libc.so") || p.contains("/libc-"))
            .expect("libc is mapped");
        let (c, _) = check_plugin(&h, &PluginChoice::Path(libc.into()));
        assert_eq!(c[0].level, Level::Fail);
        assert!(c[0].detail.contains("ncclNetPlugin_v7"), "{c:?}");
        assert!(c[0].fix.contains("v7"));
    }

    #[test]
    fn builtin_emulation_warns() {
        let root = TempRoot::new("plugemu");
        let h = simple_host(&root, &[]);
        let (c, devs) = check_plugin(&h, &PluginChoice::BuiltinEmulation);
        assert_eq!(c[0].level, Level::Warn, "{c:?}");
        assert_eq!(c[1].level, Level::Ok, "{c:?}");
        assert!(!devs.is_empty());
    }
}
