//! `ports`: the API socket and the TCP listen addresses are free.

use std::os::unix::fs::FileTypeExt;
use std::path::Path;

use crate::doctor::{Check, Target};

/// `ports`: the API socket and the TCP listen addresses are free (or held by a live tcpxd).
pub fn check_ports(target: &Target) -> Check {
    const NAME: &str = "ports";
    let mut notes = Vec::new();
    let mut fails = Vec::new();
    let sock = &target.api_socket;
    let daemon_live = match std::fs::symlink_metadata(sock) {
        Ok(m) if !m.file_type().is_socket() => {
            fails.push(format!("{} exists and is not a socket", sock.display()));
            false
        }
        Ok(_) => {
            if std::os::unix::net::UnixStream::connect(sock).is_ok() {
                notes.push(format!(
                    "{} answers: a daemon is already serving there",
                    sock.display()
                ));
                true
            } else {
                notes.push(format!("{} is stale (tcpxd replaces it)", sock.display()));
                false
            }
        }
        Err(_) => {
            match sock.parent().filter(|d| !d.as_os_str().is_empty()) {
                Some(dir) if !dir.exists() => {
                    // The daemon creates it; it must be able to.
                    let creatable = dir
                        .ancestors()
                        .find(|a| a.exists())
                        .map(is_writable_dir)
                        .unwrap_or(false);
                    if creatable {
                        notes.push(format!(
                            "{} free ({} will be created)",
                            sock.display(),
                            dir.display()
                        ));
                    } else {
                        fails.push(format!("{} cannot be created (no write access)", dir.display()));
                    }
                }
                Some(dir) if !is_writable_dir(dir) => {
                    fails.push(format!("{} is not writable", dir.display()))
                }
                _ => notes.push(format!("{} free", sock.display())),
            }
            false
        }
    };
    let mut busy = Vec::new();
    for (what, addr) in &target.tcp {
        match std::net::TcpListener::bind(addr) {
            Ok(_) => notes.push(format!("{what} {addr} free")),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => busy.push(format!("{what} {addr} in use")),
            Err(e) => fails.push(format!("{what} {addr}: {e}")),
        }
    }
    if daemon_live {
        notes.append(&mut busy);
        return Check::warn(
            NAME,
            notes.join("; "),
            "tcpxd is already running (fine on a live node); stop it to check its ports",
        );
    }
    fails.append(&mut busy);
    if !fails.is_empty() {
        return Check::fail(
            NAME,
            fails.into_iter().chain(notes).collect::<Vec<_>>().join("; "),
            "stop what holds the address (ss -ltnp) or choose other addresses (docs/CONFIG.md)",
        );
    }
    Check::ok(NAME, notes.join("; "))
}

fn is_writable_dir(dir: &Path) -> bool {
    let probe = dir.join(format!(".tcpxd-doctor-{}", std::process::id()));
    match std::fs::File::create(&probe) {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            true
        }
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::doctor::Level;
    use crate::doctor::testutil::TempRoot;

    #[test]
    fn ports_ok_warn_fail() {
        let root = TempRoot::new("ports");
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let free_addr = free.local_addr().unwrap();
        drop(free);
        let target = |sock: PathBuf, tcp: Vec<(&'static str, std::net::SocketAddr)>| Target {
            plugin: crate::config::PluginChoice::BuiltinEmulation,
            api_socket: sock,
            tcp,
            peer_listen: "127.0.0.1:0".parse().unwrap(),
            peer_advertise: Vec::new(),
            ..Target::default()
        };
        let sock = root.0.join("run/tcpxd/tcpxd.sock");
        let c = check_ports(&target(sock.clone(), vec![("peer service", free_addr)]));
        assert_eq!(c.level, Level::Ok, "{c:?}");
        // Another process holds the TCP port.
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let held_addr = held.local_addr().unwrap();
        let c = check_ports(&target(sock.clone(), vec![("peer service", held_addr)]));
        assert_eq!(c.level, Level::Fail, "{c:?}");
        assert!(c.detail.contains("in use"));
        // A live daemon on the socket: the ports are probably its own.
        std::fs::create_dir_all(sock.parent().unwrap()).unwrap();
        let _live = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let c = check_ports(&target(sock.clone(), vec![("peer service", held_addr)]));
        assert_eq!(c.level, Level::Warn, "{c:?}");
        assert!(c.detail.contains("already serving"));
        // A regular file where the socket goes.
        let file = root.write("/file.sock", "");
        assert_eq!(check_ports(&target(file, vec![])).level, Level::Fail);
    }
}
