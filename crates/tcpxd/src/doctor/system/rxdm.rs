//! `rxdm.sockets`: RxDM's unix sockets.

use std::os::unix::fs::FileTypeExt;

use crate::doctor::{Check, Host};

/// `rxdm.sockets`: RxDM's unix sockets under NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX.
pub fn check_rxdm(host: &Host) -> Check {
    const NAME: &str = "rxdm.sockets";
    let prefix = host
        .var("NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX")
        .filter(|v| !v.trim().is_empty())
        .unwrap_or("/run/tcpx")
        .trim()
        .to_string();
    let dir = host.path(&prefix);
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) => {
            return Check::fail(
                NAME,
                format!("{prefix}: {e}"),
                "start RxDM (tcpgpudmarxd --uds_path <prefix>) and share that directory with tcpxd",
            );
        }
    };
    let mut sockets: Vec<String> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_type().map(|t| t.is_socket()).unwrap_or(false))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    sockets.sort();
    if sockets.is_empty() {
        return Check::warn(
            NAME,
            format!("{prefix} exists but holds no sockets: RxDM is not serving (yet)"),
            "start RxDM and wait for its sockets before tcpxd (systemd: After=; GKE: the sidecar)",
        );
    }
    let shown = if sockets.len() > 4 {
        format!("{}, …", sockets[..4].join(", "))
    } else {
        sockets.join(", ")
    };
    Check::ok(NAME, format!("{} socket(s) in {prefix}: {shown}", sockets.len()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::Level;
    use crate::doctor::testutil::{TempRoot, simple_host};

    #[test]
    fn rxdm_ok_warn_fail() {
        let root = TempRoot::new("rxdm");
        let h = simple_host(&root, &[]);
        let c = check_rxdm(&h);
        assert_eq!(c.level, Level::Fail, "{c:?}");
        assert!(c.detail.contains("/run/tcpx"));
        let dir = root.mkdir("/run/tcpx");
        std::fs::write(dir.join("not-a-socket"), "").unwrap();
        assert_eq!(check_rxdm(&h).level, Level::Warn);
        let _l = std::os::unix::net::UnixListener::bind(dir.join("get_gpu_fd_0")).unwrap();
        let c = check_rxdm(&h);
        assert_eq!(c.level, Level::Ok, "{c:?}");
        assert!(c.detail.contains("1 socket(s) in /run/tcpx: get_gpu_fd_0"));
        // The prefix comes from the environment.
        let h = simple_host(&root, &[("NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX", "/other")]);
        assert_eq!(check_rxdm(&h).level, Level::Fail);
    }
}
