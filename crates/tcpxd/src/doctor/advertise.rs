//! The `peer.advertise` check: what this node's descriptors will carry, so other nodes pair with
//! it on first use (a wildcard listen needs a hostname that resolves to a dialable address, or the
//! daemon refuses to start).

use std::path::Path;

use super::{Check, Host, Target, read_trim};

const NAME: &str = "peer.advertise";

/// The hostname of the checked machine (its root's `/proc/sys/kernel/hostname`, else `$HOSTNAME`).
fn hostname(host: &Host) -> String {
    read_trim(&host.path(Path::new("/proc/sys/kernel/hostname")))
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| host.var("HOSTNAME").map(str::to_string))
        .unwrap_or_default()
}

pub fn check_advertise(host: &Host, target: &Target) -> Check {
    match crate::advertise::advertised(&target.peer_advertise, target.peer_listen, &hostname(host)) {
        Err(why) => Check::fail(
            NAME,
            why,
            "set peer.advertise (TCPXD_PEER_ADVERTISE) to the host:port other nodes dial, e.g. 10.0.0.2:50052",
        ),
        Ok(list) => {
            let shown = if target.peer_listen.port() == 0 && target.peer_advertise.is_empty() {
                format!("{} (port 0: the port picked at start)", list.join(", "))
            } else {
                list.join(", ")
            };
            let loopback_only = list.iter().all(|a| {
                a.parse::<std::net::SocketAddr>()
                    .is_ok_and(|s| s.ip().is_loopback())
                    || a.starts_with("localhost:")
            });
            if loopback_only {
                Check::warn(
                    NAME,
                    format!(
                        "descriptors carry {shown}: loopback only, other machines cannot reach this node through them"
                    ),
                    "bind peer.listen to this node's data-center address, or set peer.advertise",
                )
            } else {
                Check::ok(NAME, format!("descriptors carry {shown}"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::Level;
    use crate::doctor::testutil::{TempRoot, simple_host};

    fn target(listen: &str, advertise: &[&str]) -> Target {
        Target {
            plugin: crate::config::PluginChoice::BuiltinEmulation,
            api_socket: "/nonexistent/api.sock".into(),
            tcp: Vec::new(),
            peer_listen: listen.parse().unwrap(),
            peer_advertise: advertise.iter().map(|s| s.to_string()).collect(),
            ..Target::default()
        }
    }

    #[test]
    fn advertised_addresses_ok_warn_fail() {
        let root = TempRoot::new("advertise");
        root.write("/proc/sys/kernel/hostname", "localhost\n");
        let host = simple_host(&root, &[]);
        let c = check_advertise(&host, &target("10.0.0.2:50052", &[]));
        assert_eq!(c.level, Level::Ok, "{c:?}");
        assert!(c.detail.contains("10.0.0.2:50052"), "{c:?}");
        let c = check_advertise(&host, &target("0.0.0.0:50052", &["node-a.example:50052"]));
        assert_eq!(c.level, Level::Ok, "{c:?}");
        let c = check_advertise(&host, &target("127.0.0.1:0", &[]));
        assert_eq!(c.level, Level::Warn, "{c:?}");
        assert!(c.detail.contains("port 0"), "{c:?}");
        // A wildcard listen whose hostname resolves to loopback only: the daemon would not start.
        let c = check_advertise(&host, &target("0.0.0.0:50052", &[]));
        assert_eq!(c.level, Level::Fail, "{c:?}");
        assert!(c.fix.contains("peer.advertise"), "{c:?}");
    }
}
