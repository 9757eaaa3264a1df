use std::collections::HashMap;

use super::*;

fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| map.get(k).cloned()
}

fn write_toml(text: &str) -> PathBuf {
    let path = std::env::temp_dir().join(format!(
        "tcpxd-config-{}-{}.toml",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn defaults() {
    let args = DaemonArgs {
        node_id: Some("n1".into()),
        ..Default::default()
    };
    let c = Config::resolve(&args, &env_of(&[])).unwrap();
    assert_eq!(c.api_socket, PathBuf::from(DEFAULT_API_SOCKET));
    assert_eq!(c.api_socket_mode, 0o660);
    assert_eq!(c.plugin, PluginChoice::Path(PathBuf::from(DEFAULT_PLUGIN)));
    assert_eq!(c.chunk_bytes, plan::DEFAULT_CHUNK_BYTES);
    assert_eq!((c.send_window, c.recv_window), (12, 16));
    assert_eq!(
        c.gather_ahead, 0,
        "off by default (docs/BENCHMARKS.md, session 9)"
    );
    assert_eq!(c.shutdown_grace, Duration::from_secs(30));
    assert!(
        c.heartbeat_timeout <= Duration::from_secs(3),
        "a dead peer is noticed within 3 s"
    );
    assert!(c.heartbeat_interval * 3 <= c.heartbeat_timeout);
}

#[test]
fn spin_and_async_workers() {
    let cfg = |file: &str, args: DaemonArgs| {
        let path = write_toml(file);
        let args = DaemonArgs {
            node_id: Some("n".into()),
            config: Some(path.clone()),
            ..args
        };
        let r = Config::resolve(&args, &env_of(&[]));
        std::fs::remove_file(path).unwrap();
        r
    };
    // Auto follows the machine; with spinning two workers, without one per CPU.
    let c = cfg("", DaemonArgs::default()).unwrap();
    assert_eq!(c.spin, crate::idle::cpus() >= crate::idle::SPIN_AUTO_CPUS);
    assert_eq!(
        c.async_workers,
        if c.spin {
            crate::config::SPIN_ASYNC_WORKERS
        } else {
            crate::idle::cpus()
        }
    );
    let c = cfg("[runtime]\nspin = \"on\"\n", DaemonArgs::default()).unwrap();
    assert!(c.spin);
    assert_eq!(c.async_workers, 2);
    let c = cfg(
        "[runtime]\nspin = \"on\"\nasync_workers = 3\n",
        DaemonArgs::default(),
    )
    .unwrap();
    assert_eq!(c.async_workers, 3);
    // The flag beats the file.
    let flag = DaemonArgs {
        spin: Some("off".into()),
        ..Default::default()
    };
    let c = cfg("[runtime]\nspin = \"on\"\n", flag).unwrap();
    assert!(!c.spin);
    // runtime.poller_sessions: auto is on whatever spin says (session 28); on and off too.
    let c = cfg("[runtime]\nspin = \"on\"\n", DaemonArgs::default()).unwrap();
    assert!(c.poller_sessions);
    let c = cfg("[runtime]\nspin = \"off\"\n", DaemonArgs::default()).unwrap();
    assert!(c.poller_sessions);
    let c = cfg(
        "[runtime]\nspin = \"off\"\npoller_sessions = \"off\"\n",
        DaemonArgs::default(),
    )
    .unwrap();
    assert!(!c.poller_sessions);
    let c = cfg(
        "[runtime]\nspin = \"on\"\npoller_sessions = \"off\"\n",
        DaemonArgs::default(),
    )
    .unwrap();
    assert!(!c.poller_sessions);
    let on = DaemonArgs {
        spin: Some("off".into()),
        poller_sessions: Some("on".into()),
        ..Default::default()
    };
    assert!(cfg("", on).unwrap().poller_sessions);
    let e = cfg("[runtime]\npoller_sessions = \"maybe\"\n", DaemonArgs::default()).unwrap_err();
    assert!(e.to_string().contains("runtime.poller_sessions"), "{e}");
    // runtime.lane_thread: off by default; the file's bool, the flag's on / off (the flag wins).
    assert!(!cfg("", DaemonArgs::default()).unwrap().lane_thread);
    assert!(
        cfg("[runtime]\nlane_thread = true\n", DaemonArgs::default())
            .unwrap()
            .lane_thread
    );
    let off = DaemonArgs {
        lane_thread: Some("off".into()),
        ..Default::default()
    };
    assert!(!cfg("[runtime]\nlane_thread = true\n", off).unwrap().lane_thread);
    let bad = DaemonArgs {
        lane_thread: Some("maybe".into()),
        ..Default::default()
    };
    assert!(cfg("", bad).unwrap_err().to_string().contains("--lane-thread"));
    // auto (session 31): as runtime.spin, from the file or the flag; a bad word names the key.
    let auto_spin = |spin: &str| format!("[runtime]\nspin = \"{spin}\"\nlane_thread = \"auto\"\n");
    assert!(cfg(&auto_spin("on"), DaemonArgs::default()).unwrap().lane_thread);
    assert!(!cfg(&auto_spin("off"), DaemonArgs::default()).unwrap().lane_thread);
    let auto = || DaemonArgs {
        lane_thread: Some("auto".into()),
        ..Default::default()
    };
    assert!(cfg("[runtime]\nspin = \"on\"\n", auto()).unwrap().lane_thread);
    assert!(!cfg("[runtime]\nspin = \"off\"\n", auto()).unwrap().lane_thread);
    assert!(
        cfg("[runtime]\nlane_thread = \"on\"\n", DaemonArgs::default())
            .unwrap()
            .lane_thread
    );
    assert!(
        !cfg("[runtime]\nlane_thread = false\n", DaemonArgs::default())
            .unwrap()
            .lane_thread
    );
    // Still off by default where the threads spin: the lead turns it on after measuring.
    assert!(
        !cfg("[runtime]\nspin = \"on\"\n", DaemonArgs::default())
            .unwrap()
            .lane_thread
    );
    let e = cfg("[runtime]\nlane_thread = \"maybe\"\n", DaemonArgs::default()).unwrap_err();
    assert!(e.to_string().contains("runtime.lane_thread"), "{e}");
    // runtime.session_thread: auto is as spin (session 30); only with poller_sessions.
    let c = cfg("[runtime]\nspin = \"on\"\n", DaemonArgs::default()).unwrap();
    assert!(c.session_thread);
    let c = cfg("[runtime]\nspin = \"off\"\n", DaemonArgs::default()).unwrap();
    assert!(!c.session_thread);
    let c = cfg(
        "[runtime]\nspin = \"off\"\nsession_thread = \"on\"\n",
        DaemonArgs::default(),
    )
    .unwrap();
    assert!(c.session_thread);
    let c = cfg(
        "[runtime]\nspin = \"on\"\npoller_sessions = \"off\"\nsession_thread = \"on\"\n",
        DaemonArgs::default(),
    )
    .unwrap();
    assert!(!c.session_thread, "no sessions thread without poller_sessions");
    let flag = DaemonArgs {
        spin: Some("on".into()),
        session_thread: Some("off".into()),
        ..Default::default()
    };
    assert!(
        !cfg("[runtime]\nsession_thread = \"on\"\n", flag)
            .unwrap()
            .session_thread
    );
    let e = cfg("[runtime]\nsession_thread = \"maybe\"\n", DaemonArgs::default()).unwrap_err();
    assert!(e.to_string().contains("runtime.session_thread"), "{e}");
    // runtime.warm_worker: only with spin, on there unless off (session 32, rt2); the flag
    // over the file.
    assert!(
        cfg("[runtime]\nspin = \"on\"\n", DaemonArgs::default())
            .unwrap()
            .warm_worker
    );
    assert!(
        !cfg("[runtime]\nspin = \"off\"\n", DaemonArgs::default())
            .unwrap()
            .warm_worker
    );
    let c = cfg(
        "[runtime]\nspin = \"on\"\nwarm_worker = \"off\"\n",
        DaemonArgs::default(),
    )
    .unwrap();
    assert!(c.spin && !c.warm_worker);
    let flag = DaemonArgs {
        warm_worker: Some("on".into()),
        ..Default::default()
    };
    assert!(
        cfg("[runtime]\nspin = \"on\"\nwarm_worker = \"off\"\n", flag.clone())
            .unwrap()
            .warm_worker
    );
    assert!(
        !cfg("[runtime]\nspin = \"off\"\nwarm_worker = \"on\"\n", flag)
            .unwrap()
            .warm_worker,
        "no warm worker without spin"
    );
    let e = cfg("[runtime]\nwarm_worker = \"maybe\"\n", DaemonArgs::default()).unwrap_err();
    assert!(e.to_string().contains("runtime.warm_worker"), "{e}");
    // runtime.shared_completions: on by default; the file's bool, the flag's on / off.
    assert!(cfg("", DaemonArgs::default()).unwrap().shared_completions);
    let c = cfg("[runtime]\nshared_completions = false\n", DaemonArgs::default()).unwrap();
    assert!(!c.shared_completions);
    let on = DaemonArgs {
        shared_completions: Some("on".into()),
        ..Default::default()
    };
    assert!(
        cfg("[runtime]\nshared_completions = false\n", on)
            .unwrap()
            .shared_completions
    );
    let bad = DaemonArgs {
        shared_completions: Some("maybe".into()),
        ..Default::default()
    };
    let e = cfg("", bad).unwrap_err();
    assert!(e.to_string().contains("--shared-completions"), "{e}");
    // runtime.request_ring: the same.
    assert!(cfg("", DaemonArgs::default()).unwrap().request_ring);
    assert!(
        !cfg("[runtime]\nrequest_ring = false\n", DaemonArgs::default())
            .unwrap()
            .request_ring
    );
    let off = DaemonArgs {
        request_ring: Some("off".into()),
        ..Default::default()
    };
    assert!(!cfg("", off).unwrap().request_ring);
    let bad = DaemonArgs {
        request_ring: Some("maybe".into()),
        ..Default::default()
    };
    let e = cfg("", bad).unwrap_err();
    assert!(e.to_string().contains("--request-ring"), "{e}");
    // Bad values name the setting.
    let e = cfg("[runtime]\nspin = \"sometimes\"\n", DaemonArgs::default()).unwrap_err();
    assert!(e.to_string().contains("runtime.spin"), "{e}");
    let e = cfg("[runtime]\nasync_workers = 100000\n", DaemonArgs::default()).unwrap_err();
    assert!(e.to_string().contains("runtime.async_workers"), "{e}");
}

#[test]
fn host_copy_spin_is_auto_a_number_or_refused() {
    use crate::net::host_copies::{AUTO_SPIN, HelperSpin};
    let cfg = |file: &str, args: DaemonArgs| {
        let path = write_toml(file);
        let args = DaemonArgs {
            node_id: Some("n".into()),
            config: Some(path.clone()),
            ..args
        };
        let r = Config::resolve(&args, &env_of(&[]));
        std::fs::remove_file(path).unwrap();
        r
    };
    let us = Duration::from_micros;
    // Auto follows runtime.spin: 200 µs where the daemon spins, none where it does not.
    let c = cfg("", DaemonArgs::default()).unwrap();
    assert_eq!(c.host_copy_spin, HelperSpin::auto(c.spin));
    let c = cfg("[runtime]\nspin = \"on\"\n", DaemonArgs::default()).unwrap();
    assert_eq!(c.host_copy_spin.max, AUTO_SPIN);
    let c = cfg("[runtime]\nspin = \"off\"\n", DaemonArgs::default()).unwrap();
    assert_eq!(c.host_copy_spin.max, Duration::ZERO);
    let c = cfg(
        "[runtime]\nspin = \"off\"\n[transfer]\nhost_copy_spin_us = \"auto\"\n",
        DaemonArgs::default(),
    )
    .unwrap();
    assert_eq!(c.host_copy_spin.max, Duration::ZERO);
    // A number in the file, as a number or a word; the flag beats the file.
    let c = cfg("[transfer]\nhost_copy_spin_us = 50\n", DaemonArgs::default()).unwrap();
    assert_eq!(c.host_copy_spin.max, us(50));
    let c = cfg("[transfer]\nhost_copy_spin_us = \"0\"\n", DaemonArgs::default()).unwrap();
    assert_eq!(c.host_copy_spin.max, Duration::ZERO);
    let flag = DaemonArgs {
        host_copy_spin_us: Some("75".into()),
        ..Default::default()
    };
    let c = cfg("[transfer]\nhost_copy_spin_us = 50\n", flag).unwrap();
    assert_eq!(c.host_copy_spin.max, us(75));
    // Bad values name the setting and the limit.
    let e = cfg("[transfer]\nhost_copy_spin_us = 100001\n", DaemonArgs::default()).unwrap_err();
    assert!(
        e.to_string().contains("transfer.host_copy_spin_us: 100001") && e.to_string().contains("0 to 100000"),
        "{e}"
    );
    let e = cfg(
        "[transfer]\nhost_copy_spin_us = \"often\"\n",
        DaemonArgs::default(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("transfer.host_copy_spin_us"), "{e}");
    let flag = DaemonArgs {
        host_copy_spin_us: Some("-3".into()),
        ..Default::default()
    };
    let e = cfg("", flag).unwrap_err();
    assert!(e.to_string().contains("--host-copy-spin-us"), "{e}");
}

/// `transfer.host_copy_spinners` (auto: `AUTO_SPINNERS`), `host_copy_routine` and
/// `host_copy_split`: defaults, file, flags over the file, bad values naming the setting.
#[test]
fn host_copy_policy_from_file_and_flags() {
    use crate::config::host_copy::HostCopyArgs;
    use crate::net::copy_routines::CopyRoutine;
    use crate::net::host_copies::AUTO_SPINNERS;
    let cfg = |file: &str, host_copy: HostCopyArgs| {
        let path = write_toml(file);
        let args = DaemonArgs {
            node_id: Some("n".into()),
            config: Some(path.clone()),
            host_copy,
            ..Default::default()
        };
        let r = Config::resolve(&args, &env_of(&[]));
        std::fs::remove_file(path).unwrap();
        r
    };
    let none = HostCopyArgs::default;
    let c = cfg("", none()).unwrap();
    assert_eq!(
        (c.host_copy.spinners, c.host_copy.routine, c.host_copy.split),
        (AUTO_SPINNERS, CopyRoutine::Stream, true)
    );
    assert_eq!(c.host_copy.spin, c.host_copy_spin);
    let file =
        "[transfer]\nhost_copy_spinners = 3\nhost_copy_routine = \"stream\"\nhost_copy_split = \"off\"\n";
    let c = cfg(file, none()).unwrap();
    assert_eq!(
        (c.host_copy.spinners, c.host_copy.routine, c.host_copy.split),
        (3, CopyRoutine::Stream, false)
    );
    let c = cfg("[transfer]\nhost_copy_spinners = \"auto\"\n", none()).unwrap();
    assert_eq!(c.host_copy.spinners, AUTO_SPINNERS);
    let flags = HostCopyArgs {
        host_copy_spinners: Some("0".into()),
        host_copy_routine: Some("prefetch".into()),
        host_copy_split: Some("on".into()),
        host_gather_ahead: None,
    };
    let c = cfg(file, flags).unwrap();
    assert_eq!(
        (c.host_copy.spinners, c.host_copy.routine, c.host_copy.split),
        (0, CopyRoutine::Prefetch, true)
    );
    let e = cfg("[transfer]\nhost_copy_spinners = 65\n", none()).unwrap_err();
    assert!(
        e.to_string().contains("transfer.host_copy_spinners: 65") && e.to_string().contains("0 to 64"),
        "{e}"
    );
    let e = cfg("[transfer]\nhost_copy_routine = \"fast\"\n", none()).unwrap_err();
    assert!(
        e.to_string().contains("transfer.host_copy_routine")
            && e.to_string().contains("plain, prefetch, stream or stream-all"),
        "{e}"
    );
    let e = cfg(
        "",
        HostCopyArgs {
            host_copy_split: Some("maybe".into()),
            ..none()
        },
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("--host-copy-split") && e.to_string().contains("on or off"),
        "{e}"
    );
}

/// `transfer.host_gather_ahead`: its default (with copy helpers; 0 without), the file, the flag
/// over the file, and a value past 16 refused naming the setting and the limit.
#[test]
fn host_gather_ahead_from_file_and_flag() {
    use crate::config::host_copy::HostCopyArgs;
    let cfg = |file: &str, host_gather_ahead: Option<usize>| {
        let path = write_toml(file);
        let args = DaemonArgs {
            node_id: Some("n".into()),
            config: Some(path.clone()),
            host_copy: HostCopyArgs {
                host_gather_ahead,
                ..HostCopyArgs::default()
            },
            ..Default::default()
        };
        let r = Config::resolve(&args, &env_of(&[]));
        std::fs::remove_file(path).unwrap();
        r
    };
    let c = cfg("[transfer]\nhost_copy_threads = 2\n", None).unwrap();
    assert_eq!(
        (c.host_gather_ahead, c.gather_ahead),
        (crate::engine::DEFAULT_HOST_GATHER_AHEAD, 0)
    );
    let c = cfg("[transfer]\nhost_copy_threads = 0\n", None).unwrap();
    assert_eq!(
        c.host_gather_ahead, 0,
        "no helpers: nothing gathered ahead unless asked"
    );
    let c = cfg("[transfer]\nhost_copy_threads = 0\nhost_gather_ahead = 4\n", None).unwrap();
    assert_eq!(c.host_gather_ahead, 4);
    let c = cfg("[transfer]\nhost_gather_ahead = 5\ngather_ahead = 2\n", None).unwrap();
    assert_eq!((c.host_gather_ahead, c.gather_ahead), (5, 2));
    let c = cfg("[transfer]\nhost_gather_ahead = 5\n", Some(0)).unwrap();
    assert_eq!(c.host_gather_ahead, 0, "the flag beats the file");
    let e = cfg("[transfer]\nhost_gather_ahead = 17\n", None).unwrap_err();
    assert!(
        e.to_string().contains("transfer.host_gather_ahead: 17") && e.to_string().contains("0 to 16"),
        "{e}"
    );
}

#[test]
fn file_then_environment_then_flags() {
    let path = write_toml(
        r#"
        node_id = "from-file"
        [api]
        socket = "/tmp/file.sock"
        socket_mode = "0600"
        [transfer]
        chunk_bytes = 1048576
        [plugin]
        lanes_per_device = 3
        "#,
    );
    let args = DaemonArgs {
        config: Some(path.clone()),
        ..Default::default()
    };
    let c = Config::resolve(&args, &env_of(&[])).unwrap();
    assert_eq!(c.node_id, "from-file");
    assert_eq!(c.api_socket, PathBuf::from("/tmp/file.sock"));
    assert_eq!(c.api_socket_mode, 0o600);
    assert_eq!(c.chunk_bytes, 1 << 20);
    assert_eq!(c.lanes_per_device, 3);
    // The environment's chunk size beats the file's.
    let c = Config::resolve(&args, &env_of(&[("NCCL_P2P_NET_CHUNKSIZE", "65536")])).unwrap();
    assert_eq!(c.chunk_bytes, 65536);
    // Flags (clap merges TCPXD_* variables into them) beat both.
    let args = DaemonArgs {
        config: Some(path.clone()),
        node_id: Some("from-flag".into()),
        chunk_bytes: Some(262144),
        lanes_per_device: Some(1),
        ..Default::default()
    };
    let c = Config::resolve(&args, &env_of(&[("UCCL_TCPX_CHUNK_BYTES", "65536")])).unwrap();
    assert_eq!(c.node_id, "from-flag");
    assert_eq!(c.chunk_bytes, 262144);
    assert_eq!(c.lanes_per_device, 1);
    std::fs::remove_file(path).ok();
    // peer.advertise: the flag (or TCPXD_PEER_ADVERTISE) beats the file.
    let path = write_toml("[peer]\nadvertise = [\"10.0.0.2:50052\"]\n");
    let args = DaemonArgs {
        config: Some(path.clone()),
        node_id: Some("n".into()),
        ..Default::default()
    };
    let c = Config::resolve(&args, &env_of(&[])).unwrap();
    assert_eq!(c.peer_advertise, ["10.0.0.2:50052"]);
    let args = DaemonArgs {
        peer_advertise: vec!["a.example:1".into(), "[fd00::1]:2".into()],
        ..args
    };
    let c = Config::resolve(&args, &env_of(&[])).unwrap();
    assert_eq!(c.peer_advertise, ["a.example:1", "[fd00::1]:2"]);
    std::fs::remove_file(path).ok();
}

#[test]
fn persistent_unpack_settings_from_the_file_and_the_environment() {
    let path = write_toml(
        r#"
        node_id = "n"
        [transfer]
        unpack_impl = "kernel-persistent"
        unpack_linger_us = 1000
        unpack_blocks = 8
        "#,
    );
    let args = DaemonArgs {
        config: Some(path.clone()),
        ..Default::default()
    };
    let grid = |c: Config| match c.unpack_impl {
        crate::unpack::UnpackImpl::Persistent(g) => (g.blocks, g.linger),
        other => panic!("{other:?}"),
    };
    let c = Config::resolve(&args, &env_of(&[])).unwrap();
    assert_eq!(grid(c), (8, std::time::Duration::from_millis(1)));
    let c = Config::resolve(&args, &env_of(&[("TCPXD_UNPACK_BLOCKS", "0")])).unwrap();
    assert_eq!(grid(c), (0, std::time::Duration::from_millis(1)));
    let e = Config::resolve(&args, &env_of(&[("TCPXD_UNPACK_LINGER_US", "soon")]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("TCPXD_UNPACK_LINGER_US") && e.contains("unpack_linger_us"),
        "{e}"
    );
    // The launch modes take no grid settings.
    let c = Config::resolve(&args, &env_of(&[("UCCL_TCPX_UNPACK_IMPL", "kernel")])).unwrap();
    assert_eq!(c.unpack_impl, crate::unpack::UnpackImpl::default());
    std::fs::remove_file(path).ok();
}

#[test]
fn bad_values_name_the_setting() {
    let bad = |args: DaemonArgs, env: &[(&str, &str)], words: &str| {
        let e = Config::resolve(&args, &env_of(env)).unwrap_err().to_string();
        assert!(e.contains(words), "{e} should mention {words}");
    };
    let base = || DaemonArgs {
        node_id: Some("n".into()),
        ..Default::default()
    };
    bad(
        DaemonArgs {
            node_id: Some("a:b".into()),
            ..Default::default()
        },
        &[],
        "node_id",
    );
    bad(
        DaemonArgs {
            chunk_bytes: Some(8 << 20),
            ..base()
        },
        &[],
        "--chunk-bytes",
    );
    bad(
        base(),
        &[("UCCL_TCPX_CHUNK_BYTES", "12")],
        "UCCL_TCPX_CHUNK_BYTES",
    );
    bad(
        DaemonArgs {
            lanes_per_device: Some(0),
            ..base()
        },
        &[],
        "lanes_per_device",
    );
    let path = write_toml("[transfer]\nsend_window = 17\n");
    bad(
        DaemonArgs {
            config: Some(path.clone()),
            ..base()
        },
        &[],
        "send_window",
    );
    let ahead = write_toml("[transfer]\ngather_ahead = 17\n");
    let e = Config::resolve(
        &DaemonArgs {
            config: Some(ahead.clone()),
            ..base()
        },
        &env_of(&[]),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("transfer.gather_ahead: 17") && e.contains("0 to 16"),
        "{e}"
    );
    let _ = std::fs::remove_file(ahead);
    let unknown = write_toml("[transfer]\nchunk = 1\n");
    bad(
        DaemonArgs {
            config: Some(unknown.clone()),
            ..base()
        },
        &[],
        "unknown field",
    );
    bad(
        DaemonArgs {
            config: Some("/nonexistent/tcpxd.toml".into()),
            ..base()
        },
        &[],
        "/nonexistent/tcpxd.toml",
    );
    let half_tls = write_toml("[peer]\ntls_cert_file = \"/x.crt\"\n");
    bad(
        DaemonArgs {
            config: Some(half_tls.clone()),
            ..base()
        },
        &[],
        "peer.tls_key_file",
    );
    bad(
        DaemonArgs {
            api_tcp: Some("127.0.0.1:0".parse().unwrap()),
            ..base()
        },
        &[],
        "api.token_file",
    );
    let wildcard = write_toml("[peer]\nadvertise = [\"10.0.0.2:50052\", \"0.0.0.0:50052\"]\n");
    bad(
        DaemonArgs {
            config: Some(wildcard.clone()),
            ..base()
        },
        &[],
        "peer.advertise[1]",
    );
    bad(
        DaemonArgs {
            peer_advertise: vec!["node-a".into()],
            ..base()
        },
        &[],
        "peer.advertise[0]",
    );
    std::fs::remove_file(path).ok();
    std::fs::remove_file(unknown).ok();
    std::fs::remove_file(half_tls).ok();
    std::fs::remove_file(wildcard).ok();
}

#[test]
fn the_shipped_example_config_is_valid() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy/tcpxd.toml");
    let args = DaemonArgs {
        config: Some(path),
        node_id: Some("example".into()),
        ..Default::default()
    };
    let c = Config::resolve(&args, &env_of(&[])).expect("deploy/tcpxd.toml parses and validates");
    assert_eq!(c.api_socket, PathBuf::from("/run/tcpxd/tcpxd.sock"));
    assert_eq!(
        c.plugin,
        PluginChoice::Path("/usr/local/tcpx/lib64/libnccl-net.so".into())
    );
    assert_eq!(c.shutdown_grace, Duration::from_secs(30));
}

#[test]
fn builtin_emulation_is_only_chosen_when_named() {
    let args = DaemonArgs {
        node_id: Some("n".into()),
        builtin_emulation: true,
        ..Default::default()
    };
    assert_eq!(
        Config::resolve(&args, &env_of(&[])).unwrap().plugin,
        PluginChoice::BuiltinEmulation
    );
    let path = write_toml("[plugin]\nbuiltin_emulation = true\n");
    let args = DaemonArgs {
        node_id: Some("n".into()),
        config: Some(path.clone()),
        plugin: Some("/opt/libnccl-net.so".into()),
        ..Default::default()
    };
    // A plugin path on the command line beats the file's emulation switch.
    assert_eq!(
        Config::resolve(&args, &env_of(&[])).unwrap().plugin,
        PluginChoice::Path("/opt/libnccl-net.so".into())
    );
    std::fs::remove_file(path).ok();
}

#[test]
fn chunk_size_comes_from_the_environment_in_order() {
    assert_eq!(chunk_bytes_from_env(None, None), Ok(plan::DEFAULT_CHUNK_BYTES));
    assert_eq!(chunk_bytes_from_env(Some("1048576"), Some("65536")), Ok(1 << 20));
    assert_eq!(chunk_bytes_from_env(None, Some("65536")), Ok(65536));
    let e = chunk_bytes_from_env(Some("8388608"), None).unwrap_err();
    assert!(
        e.contains("UCCL_TCPX_CHUNK_BYTES") && e.contains("4194304"),
        "{e}"
    );
    assert!(
        chunk_bytes_from_env(None, Some("lots"))
            .unwrap_err()
            .contains("NCCL_P2P_NET_CHUNKSIZE")
    );
    assert!(plan::check_chunk_bytes(4095).is_err());
}

#[test]
fn gather_ahead_comes_from_the_file() {
    for (text, want) in [
        ("send_window = 2\ngather_ahead = 0\n", (2, 0)),
        ("gather_ahead = 16\n", (12, 16)),
    ] {
        let path = write_toml(&format!("[transfer]\n{text}"));
        let args = DaemonArgs {
            config: Some(path.clone()),
            node_id: Some("n".into()),
            ..Default::default()
        };
        let c = Config::resolve(&args, &env_of(&[])).unwrap();
        assert_eq!((c.send_window, c.gather_ahead), want, "{text}");
        let _ = std::fs::remove_file(path);
    }
}

#[test]
fn the_topology_map_comes_from_the_file_then_the_flag() {
    use crate::engine::topology::{GpuRef, NicRef};
    let base = DaemonArgs {
        node_id: Some("n1".into()),
        ..Default::default()
    };
    assert_eq!(
        Config::resolve(&base, &env_of(&[])).unwrap().topology,
        MapSpec::Pci
    );
    let file = write_toml("[topology]\nmap = \"a3vm\"\n");
    let args = DaemonArgs {
        config: Some(file.clone()),
        ..base.clone()
    };
    assert_eq!(
        Config::resolve(&args, &env_of(&[])).unwrap().topology,
        MapSpec::A3vm
    );
    let args = DaemonArgs {
        config: Some(file.clone()),
        topology: Some("0=eth1".into()),
        ..base.clone()
    };
    assert_eq!(
        Config::resolve(&args, &env_of(&[])).unwrap().topology,
        MapSpec::Explicit(vec![(GpuRef::Ordinal(0), vec![NicRef::Name("eth1".into())])])
    );
    let args = DaemonArgs {
        topology: Some("0:eth1".into()),
        ..base.clone()
    };
    let e = Config::resolve(&args, &env_of(&[])).unwrap_err().to_string();
    assert!(
        e.contains("topology.map \"0:eth1\"") && e.contains("is not GPU=NIC"),
        "{e}"
    );
    let bad = write_toml("[topology]\nmapping = \"a3vm\"\n");
    let args = DaemonArgs {
        config: Some(bad.clone()),
        ..base
    };
    assert!(
        Config::resolve(&args, &env_of(&[]))
            .unwrap_err()
            .to_string()
            .contains("mapping")
    );
    let _ = std::fs::remove_file(file);
    let _ = std::fs::remove_file(bad);
}

/// `tcpxd --help` states every option's default, and the numbers it states are those the daemon
/// takes when nothing sets them (issue #40 point 5: six options once said none).
#[test]
fn every_option_says_its_default_in_help() {
    // No option has a clap default (a flag would override the file): the help text says it.
    use clap::Args as _;
    let cmd = DaemonArgs::augment_args(clap::Command::new("tcpxd"));
    let mut said = HashMap::new();
    for arg in cmd.get_arguments() {
        let help = arg
            .get_long_help()
            .or(arg.get_help())
            .map(|h| h.to_string())
            .unwrap_or_default();
        let id = arg.get_id().to_string();
        let default = help
            .split("Default: ")
            .nth(1)
            .unwrap_or_else(|| panic!("--{id}'s help states no default: {help:?}"));
        said.insert(
            id,
            default
                .trim_end_matches('.')
                .split([' ', ','])
                .next()
                .unwrap()
                .to_string(),
        );
    }
    let c = Config::resolve(
        &DaemonArgs {
            node_id: Some("n1".into()),
            ..Default::default()
        },
        &env_of(&[]),
    )
    .unwrap();
    for (id, value) in [
        ("api_socket", DEFAULT_API_SOCKET.to_string()),
        ("peer_listen", DEFAULT_PEER_LISTEN.to_string()),
        ("plugin", DEFAULT_PLUGIN.to_string()),
        ("lanes_per_device", c.lanes_per_device.to_string()),
        ("chunk_bytes", c.chunk_bytes.to_string()),
        ("transfer_protocol", c.protocol.as_str().to_string()),
        ("eager_lanes", c.eager_lanes.to_string()),
        ("eager_max_bytes", c.eager_max_bytes.to_string()),
        ("default_timeout_s", c.default_timeout.as_secs().to_string()),
        ("shutdown_grace_s", c.shutdown_grace.as_secs().to_string()),
        ("async_workers", "0".to_string()),
        ("spin", "auto".to_string()),
        ("topology", "pci".to_string()),
        ("scatter_ahead", c.scatter_ahead.to_string()),
        ("gather_ahead", c.gather_ahead.to_string()),
        // With copy helpers (none on a small machine: then 0, as the help says).
        (
            "host_gather_ahead",
            crate::engine::DEFAULT_HOST_GATHER_AHEAD.to_string(),
        ),
    ] {
        assert_eq!(said[id], value, "--{id}");
    }
}

#[test]
fn direct_control_is_on_by_default_and_the_flag_beats_the_file() {
    let path = write_toml("[peer]\ndirect_control = false\n");
    let with = |config: Option<PathBuf>, flag: Option<&str>| DaemonArgs {
        config,
        node_id: Some("n".into()),
        direct_control: flag.map(str::to_string),
        ..Default::default()
    };
    let resolve = |a: &DaemonArgs| Config::resolve(a, &env_of(&[]));
    assert!(resolve(&with(None, None)).unwrap().direct_control);
    assert!(!resolve(&with(Some(path.clone()), None)).unwrap().direct_control);
    assert!(
        resolve(&with(Some(path.clone()), Some("on")))
            .unwrap()
            .direct_control
    );
    assert!(!resolve(&with(None, Some("off"))).unwrap().direct_control);
    let e = resolve(&with(None, Some("maybe"))).unwrap_err().to_string();
    assert_eq!(e, "--direct-control: \"maybe\" (on or off)");
    let _ = std::fs::remove_file(path);
}

#[test]
fn scatter_and_gather_ahead_come_from_the_file_or_the_flag_and_are_bounded() {
    let base = DaemonArgs {
        node_id: Some("n".into()),
        ..Default::default()
    };
    let c = Config::resolve(&base, &env_of(&[])).unwrap();
    assert_eq!(c.scatter_ahead, super::DEFAULT_SCATTER_AHEAD);
    let path = write_toml("[transfer]\nscatter_ahead = 0\n");
    let from_file = DaemonArgs {
        config: Some(path.clone()),
        ..base.clone()
    };
    assert_eq!(
        Config::resolve(&from_file, &env_of(&[])).unwrap().scatter_ahead,
        0
    );
    let flag = DaemonArgs {
        scatter_ahead: Some(16),
        gather_ahead: Some(4),
        ..from_file
    };
    let c = Config::resolve(&flag, &env_of(&[])).unwrap();
    assert_eq!((c.scatter_ahead, c.gather_ahead), (16, 4));
    let _ = std::fs::remove_file(path);
    let over = DaemonArgs {
        scatter_ahead: Some(17),
        ..base
    };
    let e = Config::resolve(&over, &env_of(&[])).unwrap_err().to_string();
    assert!(
        e.contains("transfer.scatter_ahead: 17") && e.contains("0 to 16"),
        "{e}"
    );
}
