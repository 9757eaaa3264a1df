//! deploy/ stays deployable: the GKE manifests parse and keep their key fields, the example
//! config loads, the systemd unit keeps its service settings (and passes `systemd-analyze verify`
//! where that tool exists), and the TCPX environment agrees between the unit and the DaemonSet.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;
use tcpxd::config::{Config, DaemonArgs, PluginChoice};

fn repo(rel: &str) -> PathBuf {
    // The workspace root: deploy/ is shared by every crate.
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(rel)
}

/// Every YAML document of every file in deploy/gke.
fn gke_documents() -> Vec<(PathBuf, Value)> {
    let mut docs = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(repo("deploy/gke"))
        .expect("deploy/gke")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no manifests in deploy/gke");
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for doc in serde_yaml_ng::Deserializer::from_str(&text) {
            let v = Value::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
            if !v.is_null() {
                docs.push((f.clone(), v));
            }
        }
    }
    docs
}

fn daemonset() -> Value {
    let mut sets: Vec<Value> = gke_documents()
        .into_iter()
        .map(|(_, v)| v)
        .filter(|v| v["kind"] == "DaemonSet")
        .collect();
    assert_eq!(sets.len(), 1, "one DaemonSet in deploy/gke");
    sets.remove(0)
}

fn container<'a>(pod: &'a Value, name: &str) -> &'a Value {
    pod["containers"]
        .as_array()
        .expect("containers")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("container {name}"))
}

fn mounts(c: &Value) -> BTreeMap<String, String> {
    c["volumeMounts"]
        .as_array()
        .map(|m| {
            m.iter()
                .map(|m| {
                    (
                        m["mountPath"].as_str().unwrap().to_string(),
                        m["name"].as_str().unwrap().to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn env_of(c: &Value) -> BTreeMap<String, String> {
    c["env"]
        .as_array()
        .map(|e| {
            e.iter()
                .filter_map(|e| Some((e["name"].as_str()?.to_string(), e["value"].as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

/// `KEY=VALUE` lines of an environment file, quotes dropped.
fn env_file(rel: &str) -> BTreeMap<String, String> {
    std::fs::read_to_string(repo(rel))
        .unwrap()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.trim_matches('"').to_string()))
        .collect()
}

#[test]
fn gke_daemonset_keeps_its_key_fields() {
    let ds = daemonset();
    assert_eq!(ds["apiVersion"], "apps/v1");
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["hostNetwork"], true, "tcpxd and RxDM use the node's NICs");
    assert_eq!(pod["dnsPolicy"], "ClusterFirstWithHostNet");
    let grace = pod["terminationGracePeriodSeconds"]
        .as_u64()
        .expect("a grace period");
    assert!(
        grace > 30,
        "the pod's grace ({grace}s) must exceed tcpxd's 30 s drain"
    );

    let tcpxd = container(pod, "tcpxd");
    let caps: Vec<&str> = tcpxd["securityContext"]["capabilities"]["add"]
        .as_array()
        .expect("capabilities")
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    assert!(caps.contains(&"IPC_LOCK"), "IPC_LOCK for pinned memory: {caps:?}");

    // RxDM and tcpxd share /run/tcpx through one pod volume.
    let rxdm = container(pod, "tcpgpudmarxd");
    let vol = mounts(tcpxd)
        .get("/run/tcpx")
        .cloned()
        .expect("tcpxd mounts /run/tcpx");
    assert_eq!(
        mounts(rxdm).get("/run/tcpx"),
        Some(&vol),
        "RxDM mounts the same /run/tcpx volume"
    );
    let volumes = pod["volumes"].as_array().expect("volumes");
    assert!(
        volumes.iter().any(|v| v["name"] == vol.as_str()),
        "volume {vol} is defined"
    );
    let rxdm_args = rxdm["args"].as_array().unwrap();
    let uds = rxdm_args
        .iter()
        .position(|a| a == "--uds_path")
        .expect("RxDM's --uds_path");
    assert_eq!(rxdm_args[uds + 1], "/run/tcpx");
    assert_eq!(
        env_of(tcpxd)["NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX"],
        "/run/tcpx"
    );

    // Readiness: gRPC health of the client API, asked through its unix socket.
    let probe: Vec<&str> = tcpxd["readinessProbe"]["exec"]["command"]
        .as_array()
        .expect("an exec readiness probe")
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(
        probe[0].ends_with("tcpxctl") && probe.last() == Some(&"health"),
        "{probe:?}"
    );
    let endpoint = probe[probe.iter().position(|a| *a == "--endpoint").unwrap() + 1];
    let socket = endpoint.strip_prefix("unix:").expect("a unix endpoint");
    assert_eq!(socket, tcpxd::config::DEFAULT_API_SOCKET);
    let run_dir = Path::new(socket).parent().unwrap().to_str().unwrap();
    assert!(
        mounts(tcpxd).contains_key(run_dir),
        "{run_dir} is mounted for the socket"
    );
    // The state directory lies in that mount (a hostPath on the node's /run): registrations
    // outlive the container and the pod (docs/OPERATIONS.md, "Restarts").
    let args: Vec<&str> = tcpxd["args"]
        .as_array()
        .expect("tcpxd's args")
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let state = args[args
        .iter()
        .position(|a| *a == "--state-dir")
        .expect("--state-dir")
        + 1];
    assert!(state.starts_with(&format!("{run_dir}/")), "{state}");
    let host_run = ds["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "tcpxd-run")
        .expect("the tcpxd-run volume");
    assert!(host_run["hostPath"]["path"].as_str().is_some(), "{host_run:?}");
    // The fd keeper (daemon-allocated CUDA memory's fds) serves the socket tcpxd is given, in the
    // same volume.
    let keeper_sock = args[args
        .iter()
        .position(|a| *a == "--fd-keeper")
        .expect("--fd-keeper")
        + 1];
    let keeper = container(pod, "fd-keeper");
    let cmd: Vec<&str> = keeper["command"]
        .as_array()
        .expect("the keeper's command")
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(cmd[1..], ["fd-keeper", "--socket", keeper_sock]);
    assert_eq!(mounts(keeper).get(run_dir), mounts(tcpxd).get(run_dir));

    // The plugin is staged into an executable volume and named to tcpxd.
    let plugin = env_of(tcpxd)["TCPXD_PLUGIN"].clone();
    let plugin_dir = Path::new(&plugin).parent().unwrap().to_str().unwrap().to_string();
    let stage = pod["initContainers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "stage-plugin")
        .expect("the stage-plugin init container");
    assert_eq!(mounts(stage).get(&plugin_dir), mounts(tcpxd).get(&plugin_dir));

    // Metrics: the flag, the declared port and the scrape annotations agree.
    let args: Vec<&str> = tcpxd["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let listen = args[args
        .iter()
        .position(|a| *a == "--metrics-listen")
        .expect("--metrics-listen")
        + 1];
    let port = listen.rsplit(':').next().unwrap();
    let ports = tcpxd["ports"].as_array().unwrap();
    assert!(ports.iter().any(|p| p["name"] == "metrics"
        && p["containerPort"].as_u64().map(|n| n.to_string()).as_deref() == Some(port)));
    let ann = &ds["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(ann["prometheus.io/port"], port);
    assert_eq!(ann["prometheus.io/path"], "/metrics");
}

#[test]
fn the_tcpx_environment_agrees_between_systemd_and_gke() {
    let unit_env = env_file("deploy/systemd/tcpx.env");
    let ds = daemonset();
    let gke_env = env_of(container(&ds["spec"]["template"]["spec"], "tcpxd"));
    let mut compared = 0;
    for (k, v) in unit_env
        .iter()
        .filter(|(k, _)| k.starts_with("NCCL_GPUDIRECTTCPX_") || *k == "NCCL_DYNAMIC_CHUNK_SIZE")
    {
        // FORCE_ACK=0 is the plugin's default; the DaemonSet may leave it out.
        match gke_env.get(k) {
            Some(g) => {
                assert_eq!(g, v, "{k} differs between tcpx.env and the DaemonSet");
                compared += 1;
            }
            None => assert_eq!(
                k, "NCCL_GPUDIRECTTCPX_FORCE_ACK",
                "{k} missing from the DaemonSet"
            ),
        }
    }
    assert!(compared >= 6, "compared {compared} settings");
}

#[test]
fn the_example_config_loads() {
    let args = DaemonArgs {
        config: Some(repo("deploy/tcpxd.toml")),
        node_id: Some("deploy-test".into()),
        ..Default::default()
    };
    let c = Config::resolve(&args, &|_| None).expect("deploy/tcpxd.toml loads");
    assert_eq!(
        c.plugin,
        PluginChoice::Path("/usr/local/tcpx/lib64/libnccl-net.so".into())
    );
    assert_eq!(c.api_socket, Path::new(tcpxd::config::DEFAULT_API_SOCKET));
    assert_eq!(c.metrics_listen, Some("127.0.0.1:9464".parse().unwrap()));
    assert_eq!(c.host_memory_reserve, 1 << 30);
    assert_eq!(c.state_dir.as_deref(), Some(Path::new("/run/tcpxd/state")));
    assert_eq!(c.reattach_grace, std::time::Duration::from_secs(60));
}

/// `[Section]` -> key -> values (a key may repeat).
fn parse_unit(text: &str) -> BTreeMap<String, BTreeMap<String, Vec<String>>> {
    let mut out: BTreeMap<String, BTreeMap<String, Vec<String>>> = BTreeMap::new();
    let mut section = String::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(s) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = s.to_string();
            continue;
        }
        let (k, v) = line.split_once('=').expect("key=value");
        out.entry(section.clone())
            .or_default()
            .entry(k.trim().to_string())
            .or_default()
            .push(v.trim().to_string());
    }
    out
}

#[test]
fn the_systemd_unit_keeps_its_service_settings() {
    let path = repo("deploy/systemd/tcpxd.service");
    let text = std::fs::read_to_string(&path).unwrap();
    let unit = parse_unit(&text);
    let svc = &unit["Service"];
    let one = |k: &str| -> &str {
        let v = svc.get(k).unwrap_or_else(|| panic!("[Service] {k}"));
        assert_eq!(v.len(), 1, "{k} set once");
        &v[0]
    };
    assert_eq!(one("Type"), "notify");
    assert_eq!(one("NotifyAccess"), "main");
    assert!(one("WatchdogSec").trim_end_matches('s').parse::<u64>().unwrap() > 0);
    assert_eq!(one("LimitMEMLOCK"), "infinity");
    // Restarted on any exit (the plugin's exit(1) included), at once, its state directory kept.
    assert_eq!(one("Restart"), "always");
    assert!(one("RestartSec").ends_with("ms"), "restarted within the second");
    assert_eq!(one("RuntimeDirectoryPreserve"), "restart");
    // Daemon-allocated CUDA memory's fds are kept in systemd's store, which tcpxd uses when
    // $FDSTORE says it is there (src/fd_store.rs): the two agree.
    let store_max: u64 = one("FileDescriptorStoreMax").parse().unwrap();
    assert!(store_max > 0);
    assert_eq!(one("Environment"), format!("FDSTORE={store_max}"));
    assert_eq!(one("EnvironmentFile"), "/etc/tcpxd/tcpx.env");
    assert!(one("ExecStart").contains("--config /etc/tcpxd/tcpxd.toml"));
    // The stop timeout leaves room for the 30 s drain.
    assert!(
        one("TimeoutStopSec")
            .trim_end_matches('s')
            .parse::<u64>()
            .unwrap()
            > 30
    );
    assert_eq!(unit["Install"]["WantedBy"], vec!["multi-user.target"]);

    // systemd's own verifier, where installed: the unit pointed at the binary this build made.
    let verify = std::process::Command::new("systemd-analyze")
        .arg("--version")
        .output();
    if verify.is_err() {
        eprintln!("systemd-analyze is not installed: checked the parsed unit only");
        return;
    }
    let dir = std::env::temp_dir().join(format!("tcpxd-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let local = text.replace("/usr/local/bin/tcpxd", env!("CARGO_BIN_EXE_tcpxd"));
    let unit_path = dir.join("tcpxd.service");
    std::fs::write(&unit_path, local).unwrap();
    let out = std::process::Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&unit_path)
        .output()
        .expect("systemd-analyze runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    std::fs::remove_dir_all(&dir).ok();
    // Complaints about the unit itself name its file; those about the machine (no systemd
    // running in a container, other units) do not.
    let ours: Vec<&str> = stderr.lines().filter(|l| l.contains("tcpxd.service")).collect();
    assert!(ours.is_empty(), "systemd-analyze verify:\n{stderr}");
}

/// The readiness probe's command against a serving daemon: SERVING, exit 0; nothing there: non-zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readiness_probe_command_reports_serving() {
    let d = crate::common::daemons::start("probe", |_| {}).await;
    let endpoint = format!("unix:{}", d.daemon.api_socket.display());
    let tcpxctl = tcpxd_testkit::workspace_bin("tcpxctl");
    let run = |endpoint: String| {
        let tcpxctl = tcpxctl.clone();
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(tcpxctl)
                .args(["--endpoint", &endpoint, "health"])
                .output()
                .unwrap()
        })
    };
    let out = run(endpoint).await.unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "tcpxd.v1.Tcpxd: SERVING"
    );
    let socket = d.daemon.api_socket.clone();
    d.stop().await;
    let out = run(format!("unix:{}", socket.display())).await.unwrap();
    assert!(!out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("is tcpxd running?"),
        "{out:?}"
    );
}
