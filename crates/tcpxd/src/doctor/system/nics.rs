//! `nics`, `nics.data_split`: the data and control NICs (present, up, their speed) and header/data
//! split on the data NICs.

use std::collections::BTreeMap;

use crate::doctor::{Check, Host, read_trim};

/// `nics`: the data NICs and the control NIC exist and are up; their speeds.
pub fn check_nics(host: &Host) -> Check {
    const NAME: &str = "nics";
    let (data, from_env) = host.data_nics();
    let (ctrl, _) = host.ctrl_nic();
    let mut names = data.clone();
    if !ctrl.is_empty() && !names.contains(&ctrl) {
        names.push(ctrl.clone());
    }
    let mut parts = Vec::new();
    let mut missing = Vec::new();
    let mut down = Vec::new();
    let mut no_speed = Vec::new();
    for n in &names {
        let dir = host.path(format!("/sys/class/net/{n}"));
        if !dir.exists() {
            missing.push(n.clone());
            continue;
        }
        let state = read_trim(&dir.join("operstate")).unwrap_or_else(|_| "unknown".into());
        let speed = read_trim(&dir.join("speed"))
            .ok()
            .and_then(|s| s.parse::<i64>().ok())
            .filter(|s| *s > 0);
        match speed {
            Some(s) => parts.push(format!("{n} {state} {} Gb/s", s / 1000)),
            None => {
                no_speed.push(n.clone());
                parts.push(format!("{n} {state} speed unknown"));
            }
        }
        if state != "up" {
            down.push(format!("{n} ({state})"));
        }
    }
    let source = if from_env {
        "from NCCL_GPUDIRECTTCPX_SOCKET_IFNAME/CTRL_DEV"
    } else {
        "GCP's defaults: NCCL_GPUDIRECTTCPX_SOCKET_IFNAME unset"
    };
    if !missing.is_empty() || !down.is_empty() {
        let mut d = String::new();
        if !missing.is_empty() {
            d += &format!("missing: {}", missing.join(", "));
        }
        if !down.is_empty() {
            if !d.is_empty() {
                d += "; ";
            }
            d += &format!("not up: {}", down.join(", "));
        }
        if !parts.is_empty() {
            d += &format!("; {}", parts.join(", "));
        }
        return Check::fail(
            NAME,
            format!("{d} ({source})"),
            "name this VM's gVNIC data interfaces in NCCL_GPUDIRECTTCPX_SOCKET_IFNAME (ip -br link) and bring them up",
        );
    }
    if !no_speed.is_empty() {
        return Check::warn(
            NAME,
            format!("{} ({source})", parts.join(", ")),
            "the driver reports no link speed; check the NICs with ethtool",
        );
    }
    Check::ok(NAME, format!("{} ({source})", parts.join(", ")))
}

/// The `tcp-data-split` value in ethtool's output: `ethtool -k` lists it as a feature on
/// Google's TCPX kernels ("tcp-data-split: on"), upstream `ethtool -g` as a ring parameter
/// ("TCP data split: on").
fn parse_data_split(text: &str) -> Option<String> {
    text.lines()
        .find(|l| {
            let l = l.to_ascii_lowercase();
            l.contains("tcp-data-split") || l.contains("tcp data split")
        })
        .and_then(|l| l.split_once(':'))
        .and_then(|(_, v)| v.split_whitespace().next())
        .map(|v| v.to_ascii_lowercase())
}

/// One NIC's tcp-data-split, from `ethtool -k` then `ethtool -g`; `Err` says why it is unknown.
fn data_split_of(host: &Host, nic: &str) -> Result<String, String> {
    let mut why = String::new();
    for flag in ["-k", "-g"] {
        match host.runner.run("ethtool", &[flag, nic]) {
            Ok(o) if o.success => match parse_data_split(&o.stdout) {
                Some(v) => return Ok(v),
                None => why = "ethtool does not report tcp-data-split".into(),
            },
            Ok(o) => why = format!("ethtool {flag}: {}", o.stderr.trim()),
            Err(e) if why.is_empty() => why = format!("ethtool unavailable: {e}"),
            Err(_) => {}
        }
    }
    Err(why)
}

/// `nics.data_split`: header/data split (`tcp-data-split`) on each data NIC, from ethtool.
pub fn check_data_split(host: &Host) -> Check {
    const NAME: &str = "nics.data_split";
    let (data, _) = host.data_nics();
    let mut on = Vec::new();
    let mut off = Vec::new();
    // Why it is unknown -> the NICs it is unknown on.
    let mut unknown: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for n in &data {
        match data_split_of(host, n) {
            Ok(v) if v == "on" || v == "enabled" => on.push(n.clone()),
            Ok(v) if v == "off" || v == "disabled" => off.push(format!("{n} ({v})")),
            Ok(v) => unknown
                .entry(format!("tcp-data-split {v}"))
                .or_default()
                .push(n.clone()),
            Err(why) => unknown.entry(why).or_default().push(n.clone()),
        }
    }
    if !off.is_empty() {
        return Check::fail(
            NAME,
            format!("tcp-data-split off on {}", off.join(", ")),
            "enable header split on those NICs (ethtool -G <nic> tcp-data-split on), as GPUDirect-TCPX images set up",
        );
    }
    if !unknown.is_empty() {
        return Check::warn(
            NAME,
            format!(
                "unknown on {}{}",
                unknown
                    .iter()
                    .map(|(why, nics)| format!("{} ({why})", nics.join(", ")))
                    .collect::<Vec<_>>()
                    .join("; "),
                if on.is_empty() {
                    String::new()
                } else {
                    format!("; on: {}", on.join(", "))
                }
            ),
            "install ethtool (6.x reads tcp-data-split with -g) or check by hand: ethtool -k <nic>; ethtool -g <nic>",
        );
    }
    if on.is_empty() {
        return Check::warn(
            NAME,
            "no data NICs to check",
            "set NCCL_GPUDIRECTTCPX_SOCKET_IFNAME",
        );
    }
    Check::ok(NAME, format!("tcp-data-split on: {}", on.join(", ")))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::doctor::Level;
    use crate::doctor::testutil::{FakeRunner, TempRoot, host, simple_host};

    fn nic(root: &TempRoot, name: &str, state: &str, speed: &str) {
        root.write(&format!("/sys/class/net/{name}/operstate"), &format!("{state}\n"));
        root.write(&format!("/sys/class/net/{name}/speed"), &format!("{speed}\n"));
    }

    #[test]
    fn nics_ok_warn_fail() {
        let root = TempRoot::new("nics");
        let env = [
            ("NCCL_GPUDIRECTTCPX_SOCKET_IFNAME", "eth1,eth2"),
            ("NCCL_GPUDIRECTTCPX_CTRL_DEV", "eth0"),
        ];
        let h = simple_host(&root, &env);
        nic(&root, "eth0", "up", "100000");
        nic(&root, "eth1", "up", "200000");
        let c = check_nics(&h);
        assert_eq!(c.level, Level::Fail, "{c:?}");
        assert!(c.detail.contains("missing: eth2"), "{}", c.detail);
        nic(&root, "eth2", "up", "-1");
        let c = check_nics(&h);
        assert_eq!(c.level, Level::Warn, "{c:?}");
        assert!(c.detail.contains("eth2 up speed unknown"));
        nic(&root, "eth2", "up", "200000");
        let c = check_nics(&h);
        assert_eq!(c.level, Level::Ok, "{c:?}");
        assert!(c.detail.contains("eth1 up 200 Gb/s") && c.detail.contains("eth0 up 100 Gb/s"));
        nic(&root, "eth1", "down", "200000");
        let c = check_nics(&h);
        assert_eq!(c.level, Level::Fail);
        assert!(c.detail.contains("not up: eth1 (down)"), "{}", c.detail);
    }

    #[test]
    fn data_split_ok_warn_fail() {
        let root = TempRoot::new("split");
        let env = [("NCCL_GPUDIRECTTCPX_SOCKET_IFNAME", "eth1,eth2")];
        let runner = Arc::new(FakeRunner::default());
        let h = host(&root, &env, runner.clone(), (None, None));
        // No ethtool: unknown, as a warning.
        let c = check_data_split(&h);
        assert_eq!(c.level, Level::Warn, "{c:?}");
        assert!(c.detail.contains("ethtool unavailable"));
        let ring = |split: &str| {
            format!(
                "Ring parameters for eth1:\nPre-set maximums:\nRX:\t\t4096\nCurrent hardware settings:\nRX:\t\t1024\nTCP data split:\t\t{split}\n"
            )
        };
        runner.answer("ethtool -g eth1", true, &ring("on"));
        runner.answer("ethtool -g eth2", true, &ring("on"));
        assert_eq!(check_data_split(&h).level, Level::Ok);
        runner.answer("ethtool -g eth2", true, &ring("off"));
        let c = check_data_split(&h);
        assert_eq!(c.level, Level::Fail, "{c:?}");
        assert!(c.detail.contains("eth2"));
        // Google's kernels list it among the features (ethtool -k), which is asked first.
        runner.answer(
            "ethtool -k eth2",
            true,
            "Features for eth2:\nrx-checksumming: on\ntcp-data-split: on [fixed]\n",
        );
        assert_eq!(check_data_split(&h).level, Level::Ok);
        runner.answer(
            "ethtool -k eth2",
            true,
            "Features for eth2:\nrx-checksumming: on\n",
        );
        // An older ethtool that does not print the line.
        runner.answer(
            "ethtool -g eth2",
            true,
            "Ring parameters for eth2:\nRX:\t\t1024\n",
        );
        let c = check_data_split(&h);
        assert_eq!(c.level, Level::Warn);
        assert!(c.detail.contains("does not report"), "{}", c.detail);
    }
}
