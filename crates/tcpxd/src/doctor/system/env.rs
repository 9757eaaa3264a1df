//! `env.chunk_size`, `env.plugin`, `env.tcpx`: the TCPX environment against GCP's recommended
//! tcpx.env, and the plugin settings tcpxd runs with.

use std::collections::BTreeMap;

use crate::doctor::{Check, Host, parse_env_lines};
use crate::net::RECOMMENDED_ENV;

/// GCP's recommended settings from a tcpx.env text, keeping only the plugin's own variables
/// (`NCCL_DYNAMIC_CHUNK_SIZE`, `NCCL_GPUDIRECTTCPX_*`, and the socket thread counts it reads).
pub fn parse_recommended_env(text: &str) -> BTreeMap<String, String> {
    parse_env_lines(text)
        .into_iter()
        .filter(|(k, _)| {
            k == "NCCL_DYNAMIC_CHUNK_SIZE"
                || k.starts_with("NCCL_GPUDIRECTTCPX_")
                || k == "NCCL_NSOCKS_PERTHREAD"
                || k == "NCCL_SOCKET_NTHREADS"
        })
        .collect()
}

/// `env.chunk_size`: NCCL_DYNAMIC_CHUNK_SIZE as the plugin will see it.
pub fn check_chunk_size(host: &Host) -> Check {
    const NAME: &str = "env.chunk_size";
    let rec = parse_recommended_env(RECOMMENDED_ENV);
    let want = rec
        .get("NCCL_DYNAMIC_CHUNK_SIZE")
        .map(String::as_str)
        .unwrap_or(crate::net::DEFAULT_DYNAMIC_CHUNK_SIZE);
    match host.var("NCCL_DYNAMIC_CHUNK_SIZE") {
        None => Check::warn(
            NAME,
            format!("NCCL_DYNAMIC_CHUNK_SIZE is unset; tcpxd sets {want} before loading the plugin"),
            format!("set NCCL_DYNAMIC_CHUNK_SIZE={want} in tcpx.env so every process agrees"),
        ),
        Some(v) => match v.trim().parse::<u64>() {
            Ok(n) if n > 0 && v.trim() == want => Check::ok(NAME, format!("NCCL_DYNAMIC_CHUNK_SIZE={n}")),
            Ok(n) if n > 0 => Check::warn(
                NAME,
                format!("NCCL_DYNAMIC_CHUNK_SIZE={n}; GCP recommends {want}"),
                format!("set NCCL_DYNAMIC_CHUNK_SIZE={want} unless you measured better"),
            ),
            _ => Check::fail(
                NAME,
                format!("NCCL_DYNAMIC_CHUNK_SIZE={v:?}: the plugin makes no progress with 0 or garbage"),
                format!("set NCCL_DYNAMIC_CHUNK_SIZE={want}"),
            ),
        },
    }
}

/// `env.plugin`: the plugin settings in force, each from the environment or, where unset, the value
/// tcpxd applies before loading the plugin (`net::PLUGIN_DEFAULTS`, GCP's recommendation).
pub fn check_plugin_settings(host: &Host) -> Check {
    const NAME: &str = "env.plugin";
    let mut shown = Vec::new();
    let mut differ = Vec::new();
    for (k, want) in crate::net::PLUGIN_DEFAULTS {
        match host.var(k) {
            None => shown.push(format!("{k}={want} (tcpxd's default)")),
            Some(v) => {
                shown.push(format!("{k}={v}"));
                if v.trim().trim_matches('"') != want {
                    differ.push(format!("{k} (GCP: {want})"));
                }
            }
        }
    }
    let detail = format!("in force: {}", shown.join(", "));
    if differ.is_empty() {
        Check::ok(NAME, detail)
    } else {
        Check::warn(
            NAME,
            format!("{detail}; differs from GCP: {}", differ.join(", ")),
            "unset them (tcpxd applies GCP's values) unless you measured better; one socket per comm halves throughput",
        )
    }
}

/// `env.tcpx`: every NCCL_GPUDIRECTTCPX_* setting against GCP's values (the socket counts and the
/// chunk size are `env.plugin`'s: tcpxd applies them when unset).
pub fn check_tcpx_env(host: &Host) -> Check {
    const NAME: &str = "env.tcpx";
    let rec = parse_recommended_env(RECOMMENDED_ENV);
    let mut same = 0;
    let mut differ = Vec::new();
    let mut unset = Vec::new();
    let applied = |k: &str| crate::net::PLUGIN_DEFAULTS.iter().any(|(d, _)| *d == k);
    for (k, want) in rec.iter().filter(|(k, _)| !applied(k)) {
        match host.var(k) {
            Some(v) if v.trim().trim_matches('"') == want => same += 1,
            Some(v) => differ.push(format!("{k}={v} (GCP: {want})")),
            None => unset.push(k.clone()),
        }
    }
    if unset.iter().any(|k| k == "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME") {
        return Check::fail(
            NAME,
            format!(
                "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME is unset (also unset: {})",
                unset.len() - 1
            ),
            "load deploy/systemd/tcpx.env (EnvironmentFile=) or the DaemonSet's env, adjusted to this VM's NICs",
        );
    }
    if differ.is_empty() && unset.is_empty() {
        return Check::ok(NAME, format!("{same} settings match GCP's recommendation"));
    }
    let mut detail = format!("{same} match");
    if !differ.is_empty() {
        detail += &format!("; differ: {}", differ.join("; "));
    }
    if !unset.is_empty() {
        detail += &format!("; unset: {}", unset.join(", "));
    }
    Check::warn(
        NAME,
        detail,
        "compare with deploy/systemd/tcpx.env; interface names and CPU bindings may legitimately differ per VM",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::Level;
    use crate::doctor::testutil::{TempRoot, simple_host};

    #[test]
    fn recommended_values_come_from_tcpx_env() {
        let rec = parse_recommended_env(RECOMMENDED_ENV);
        assert_eq!(rec["NCCL_DYNAMIC_CHUNK_SIZE"], "524288");
        assert_eq!(rec["NCCL_GPUDIRECTTCPX_SOCKET_IFNAME"], "eth1,eth2,eth3,eth4");
        assert!(rec["NCCL_GPUDIRECTTCPX_TX_BINDINGS"].starts_with("eth1:8-21"));
        assert!(!rec.contains_key("RUST_LOG"));
        assert!(!rec.contains_key("NCCL_P2P_NET_CHUNKSIZE"));
    }

    #[test]
    fn chunk_size_ok_warn_fail() {
        let root = TempRoot::new("chunk");
        let c = check_chunk_size(&simple_host(&root, &[("NCCL_DYNAMIC_CHUNK_SIZE", "524288")]));
        assert_eq!(c.level, Level::Ok, "{c:?}");
        let c = check_chunk_size(&simple_host(&root, &[]));
        assert_eq!(c.level, Level::Warn, "{c:?}");
        let c = check_chunk_size(&simple_host(&root, &[("NCCL_DYNAMIC_CHUNK_SIZE", "1048576")]));
        assert_eq!(c.level, Level::Warn, "{c:?}");
        let c = check_chunk_size(&simple_host(&root, &[("NCCL_DYNAMIC_CHUNK_SIZE", "0")]));
        assert_eq!(c.level, Level::Fail, "{c:?}");
    }

    #[test]
    fn plugin_settings_show_the_values_in_force() {
        let root = TempRoot::new("pluginenv");
        let c = check_plugin_settings(&simple_host(&root, &[]));
        assert_eq!(c.level, Level::Ok, "{c:?}");
        assert_eq!(
            c.detail,
            "in force: NCCL_DYNAMIC_CHUNK_SIZE=524288 (tcpxd's default), NCCL_NSOCKS_PERTHREAD=4 \
             (tcpxd's default), NCCL_SOCKET_NTHREADS=1 (tcpxd's default)"
        );
        let c = check_plugin_settings(&simple_host(
            &root,
            &[("NCCL_NSOCKS_PERTHREAD", "1"), ("NCCL_SOCKET_NTHREADS", "1")],
        ));
        assert_eq!(c.level, Level::Warn, "{c:?}");
        assert!(
            c.detail.contains("NCCL_NSOCKS_PERTHREAD=1,")
                && c.detail.contains("NCCL_SOCKET_NTHREADS=1")
                && c.detail
                    .ends_with("differs from GCP: NCCL_NSOCKS_PERTHREAD (GCP: 4)"),
            "{}",
            c.detail
        );
    }

    fn recommended_env() -> Vec<(String, String)> {
        parse_recommended_env(RECOMMENDED_ENV).into_iter().collect()
    }

    #[test]
    fn tcpx_env_ok_warn_fail() {
        let root = TempRoot::new("tcpxenv");
        let all = recommended_env();
        let pairs: Vec<(&str, &str)> = all.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let c = check_tcpx_env(&simple_host(&root, &pairs));
        assert_eq!(c.level, Level::Ok, "{c:?}");
        let mut changed = pairs.clone();
        for p in &mut changed {
            if p.0 == "NCCL_GPUDIRECTTCPX_FORCE_ACK" {
                p.1 = "1";
            }
        }
        changed.retain(|p| p.0 != "NCCL_SOCKET_NTHREADS" && p.0 != "NCCL_GPUDIRECTTCPX_CTRL_DEV");
        let c = check_tcpx_env(&simple_host(&root, &changed));
        assert_eq!(c.level, Level::Warn, "{c:?}");
        assert!(
            c.detail.contains("NCCL_GPUDIRECTTCPX_FORCE_ACK=1 (GCP: 0)"),
            "{}",
            c.detail
        );
        assert!(
            c.detail.contains("unset: NCCL_GPUDIRECTTCPX_CTRL_DEV"),
            "{}",
            c.detail
        );
        // The settings tcpxd applies itself are not "unset" here.
        assert!(!c.detail.contains("NCCL_SOCKET_NTHREADS"), "{}", c.detail);
        let c = check_tcpx_env(&simple_host(&root, &[]));
        assert_eq!(c.level, Level::Fail, "{c:?}");
    }
}
