//! `tcpxd doctor` as an operator runs it: the real binary, JSON out, exit code.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

struct Run {
    code: i32,
    json: Value,
    stderr: String,
}

fn doctor(args: &[&str], env: &[(&str, &str)], dir: &Path) -> Run {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tcpxd"));
    cmd.arg("doctor").arg("--json").args(args);
    // A clean environment: only what the test gives (plus PATH for ethtool/dmesg lookups).
    cmd.env_clear();
    if let Some(p) = std::env::var_os("PATH") {
        cmd.env("PATH", p);
    }
    cmd.env("TCPXD_API_SOCKET", dir.join("api.sock"));
    cmd.env("TCPXD_PEER_LISTEN", "127.0.0.1:0");
    cmd.env("TCPXD_NODE_ID", "doctor-test");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("tcpxd runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    Run {
        code: out.status.code().unwrap_or(-1),
        json: serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("JSON on stdout ({e}):\n{stdout}")),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn check<'a>(r: &'a Run, name: &str) -> &'a Value {
    r.json["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("check {name} in {}", r.json))
}

fn level(r: &Run, name: &str) -> String {
    check(r, name)["level"].as_str().unwrap().to_string()
}

fn tempdir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tcpxd-doctor-it-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn the_emulation_plugin_passes_and_a3_only_checks_say_why_not() {
    let dir = tempdir("emu");
    let plugin = tcpxd_testkit::emulation_plugin_path();
    let r = doctor(&["--plugin", plugin.to_str().unwrap()], &[], &dir);
    // Some checks fail on this machine (no A3 NICs, GPUs, RxDM): exit 1.
    assert_eq!(r.code, 1, "{}\n{}", r.json, r.stderr);
    for name in [
        "config",
        "plugin.load",
        "plugin.devices",
        "plugin.noexec",
        "env.plugin",
        "ports",
    ] {
        assert_eq!(level(&r, name), "ok", "{name}: {}", check(&r, name));
    }
    assert!(
        check(&r, "plugin.load")["detail"]
            .as_str()
            .unwrap()
            .contains("ncclNetPlugin_v7")
    );
    let devices = r.json["plugin_devices"].as_array().unwrap();
    assert!(!devices.is_empty());
    assert!(devices[0]["name"].as_str().unwrap().starts_with("tcpxemu"));
    // A3-only checks: not ok, each with a reason and a fix (where this machine lacks the thing).
    let lacks = |p: &str| !Path::new(p).exists();
    let a3_only = [
        ("env.tcpx", true),
        ("nics", lacks("/sys/class/net/eth1")),
        ("rxdm.sockets", lacks("/run/tcpx")),
        ("gpus", lacks("/proc/driver/nvidia/gpus")),
        ("lanes", lacks("/proc/driver/nvidia/gpus")),
    ];
    for name in a3_only.iter().filter(|(_, here)| *here).map(|(n, _)| *n) {
        let c = check(&r, name);
        assert_ne!(c["level"], "ok", "{name} should not pass here: {c}");
        assert!(!c["detail"].as_str().unwrap().is_empty(), "{c}");
        assert!(!c["fix"].as_str().unwrap().is_empty(), "{c}");
    }
    assert_eq!(level(&r, "env.tcpx"), "fail");
    // Unset: tcpxd would set it; a warning.
    assert_eq!(level(&r, "env.chunk_size"), "warn");
    let summary = &r.json["summary"];
    assert_eq!(
        summary["ok"].as_u64().unwrap()
            + summary["warn"].as_u64().unwrap()
            + summary["fail"].as_u64().unwrap(),
        r.json["checks"].as_array().unwrap().len() as u64
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_missing_plugin_fails_with_the_install_fix() {
    let dir = tempdir("missing");
    let r = doctor(&["--plugin", "/nonexistent/libnccl-net.so"], &[], &dir);
    assert_eq!(r.code, 1);
    let c = check(&r, "plugin.load");
    assert_eq!(c["level"], "fail");
    assert!(
        c["fix"].as_str().unwrap().contains("nccl-plugin-gpudirecttcpx"),
        "{c}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A fake A3-like node under `--root`: the system checks pass on it.
#[test]
fn a_healthy_fake_node_under_root_passes_the_host_checks() {
    let dir = tempdir("root");
    let root = dir.join("root");
    let w = |abs: &str, text: &str| {
        let p = root.join(abs.trim_start_matches('/'));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    };
    let link = |abs: &str, target: &str| {
        let p = root.join(abs.trim_start_matches('/'));
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        let depth = Path::new(abs).parent().unwrap().components().count() - 1;
        std::os::unix::fs::symlink(
            format!("{}{}", "../".repeat(depth), target.trim_start_matches('/')),
            p,
        )
        .unwrap();
    };
    w(
        "/proc/self/mountinfo",
        "22 1 0:21 / / rw,relatime - ext4 /dev/sda1 rw\n",
    );
    w(
        "/proc/driver/nvidia/version",
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n",
    );
    w("/dev/kmsg", "6,1,1,-;gve 0000:06:00.0 eth1: devmem TCP enabled\n");
    for (i, (gpu, nic)) in [("0000:04:00.0", "0000:06:00.0"), ("0000:0a:00.0", "0000:0c:00.0")]
        .iter()
        .enumerate()
    {
        let sw = format!("/sys/devices/pci0000:00/0000:00:0{i}.0/0000:0{i}:00.0");
        std::fs::create_dir_all(root.join(format!("{sw}/{gpu}").trim_start_matches('/'))).unwrap();
        std::fs::create_dir_all(root.join(format!("{sw}/{nic}").trim_start_matches('/'))).unwrap();
        w(
            &format!("/proc/driver/nvidia/gpus/{gpu}/information"),
            "Model: \t NVIDIA H100 80GB HBM3\n",
        );
        link(&format!("/sys/bus/pci/devices/{gpu}"), &format!("{sw}/{gpu}"));
        let eth = format!("eth{}", i + 1);
        w(&format!("/sys/class/net/{eth}/operstate"), "up\n");
        w(&format!("/sys/class/net/{eth}/speed"), "200000\n");
        link(&format!("/sys/class/net/{eth}/device"), &format!("{sw}/{nic}"));
    }
    w("/sys/class/net/eth0/operstate", "up\n");
    w("/sys/class/net/eth0/speed", "100000\n");
    std::fs::create_dir_all(root.join("run/tcpx")).unwrap();
    let _rxdm = std::os::unix::net::UnixListener::bind(root.join("run/tcpx/get_gpu_fd_0")).unwrap();

    let plugin = tcpxd_testkit::emulation_plugin_path();
    let env = [
        ("NCCL_GPUDIRECTTCPX_SOCKET_IFNAME", "eth1,eth2"),
        ("NCCL_GPUDIRECTTCPX_CTRL_DEV", "eth0"),
        ("NCCL_DYNAMIC_CHUNK_SIZE", "524288"),
    ];
    let r = doctor(
        &[
            "--plugin",
            plugin.to_str().unwrap(),
            "--root",
            root.to_str().unwrap(),
        ],
        &env,
        &dir,
    );
    for name in [
        "plugin.noexec",
        "env.chunk_size",
        "nics",
        "kernel.devmem",
        "rxdm.sockets",
        "gpus",
        "lanes",
    ] {
        assert_eq!(level(&r, name), "ok", "{name}: {}", check(&r, name));
    }
    let plan = r.json["lane_plan"].as_array().unwrap();
    assert_eq!(plan.len(), 2);
    assert_eq!(plan[0]["gpu"], "0000:04:00.0");
    assert_eq!(plan[0]["nic"], "eth1");
    assert_eq!(plan[1]["nic"], "eth2");
    // The rest of GCP's settings are unset: a warning, not a failure.
    assert_eq!(level(&r, "env.tcpx"), "warn");

    // The topology: two emulated NICs named as A3's, RxDM running its a3vm preset. GPU 04 on
    // eth1 and 0a on eth2 is what RxDM serves; the swapped map fails, naming the fix.
    w(
        "/proc/4242/cmdline",
        "/tcpgpudmarxd\0--gpu_nic_preset\0a3vm\0--uds_path\0/run/tcpx\0",
    );
    // The emulated NICs report the tree's NIC paths as their pciPath: each GPU's NIC by distance.
    let env = [
        ("TCPXEMU_DEVICES", "2"),
        ("TCPXEMU_IFNAMES", "eth1,eth2"),
        (
            "TCPXEMU_DEV0_PCI_PATH",
            "/sys/devices/pci0000:00/0000:00:00.0/0000:00:00.0/0000:06:00.0",
        ),
        (
            "TCPXEMU_DEV1_PCI_PATH",
            "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:0c:00.0",
        ),
    ];
    let args = |extra: &[&'static str]| {
        let mut a = vec![
            "--plugin",
            plugin.to_str().unwrap(),
            "--root",
            root.to_str().unwrap(),
        ];
        a.extend_from_slice(extra);
        a
    };
    let r = doctor(&args(&[]), &env, &dir);
    assert_eq!(level(&r, "topology"), "ok", "{}", check(&r, "topology"));
    assert!(
        check(&r, "topology")["detail"]
            .as_str()
            .unwrap()
            .contains("agrees with RxDM's a3vm"),
        "{}",
        check(&r, "topology")
    );
    let topo = r.json["topology"].as_array().unwrap();
    assert_eq!(topo.len(), 2);
    assert_eq!(
        (&topo[0]["pci_bus_id"], &topo[0]["nics"][0]),
        (&"0000:04:00.0".into(), &"eth1".into())
    );
    assert_eq!(topo[1]["nics"][0], "eth2");
    assert!(
        topo.iter().all(|l| l["relation"] == "same PCIe switch"),
        "{topo:?}"
    );
    let r = doctor(&args(&["--topology", "0=eth2;1=eth1"]), &env, &dir);
    assert_eq!(level(&r, "topology"), "fail", "{}", check(&r, "topology"));
    let c = check(&r, "topology");
    assert!(
        c["detail"]
            .as_str()
            .unwrap()
            .contains("GPU 0 (0000:04:00.0) on eth2, RxDM serves it on eth1"),
        "{c}"
    );
    assert!(
        c["fix"].as_str().unwrap().contains("topology.map = \"a3vm\""),
        "{c}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_table_names_every_check_and_its_fix() {
    let dir = tempdir("table");
    let out = Command::new(env!("CARGO_BIN_EXE_tcpxd"))
        .args(["doctor", "--plugin", "/nonexistent/libnccl-net.so"])
        .env("TCPXD_API_SOCKET", dir.join("api.sock"))
        .env("TCPXD_PEER_LISTEN", "127.0.0.1:0")
        .env("TCPXD_NODE_ID", "doctor-test")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("CHECK"), "{text}");
    for name in tcpxd::doctor::CHECK_NAMES {
        assert!(text.contains(name), "{name} missing:\n{text}");
    }
    assert!(
        text.contains("fix: install Google's nccl-plugin-gpudirecttcpx"),
        "{text}"
    );
    assert!(text.contains(" fail"), "{text}");
    // docs/OPERATIONS.md explains every check.
    let ops =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/OPERATIONS.md")).unwrap();
    for name in tcpxd::doctor::CHECK_NAMES {
        assert!(
            ops.contains(&format!("| `{name}` |")),
            "docs/OPERATIONS.md does not explain {name}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}
