//! The node's topology (issue #37) on an A3-shaped emulated node: eight stand-in GPUs with A3's
//! PCI bus ids (`tools/realplugin/cudastub` as the daemon's `libcuda.so.1`) and four emulated
//! NICs with A3's `pciPath`s. Each daemon works out each GPU's NIC (`pci`: the even spread, since
//! the stand-in's GPUs have no sysfs place; `a3vm`: RxDM's preset) and shows it in DescribeNode;
//! every lane's comms are opened with a GPU its NIC serves current (GetStats' `send_gpu` /
//! `recv_gpu`); host memory moves byte-exact over all four NICs; a map naming what the node lacks
//! stops the daemon at start-up with the part named.

use std::process::Command;

use crate::common::daemons::*;
use crate::common::procs;
use tcpxd::api::proto::v1 as pb;

const MIB: u64 = 1 << 20;

/// The stand-in's eight GPUs and four emulated NICs, for a daemon process.
fn a3_env() -> Vec<(String, String)> {
    gpus_over_four_nics(8)
}

/// `gpus` stand-in GPUs and four emulated NICs.
fn gpus_over_four_nics(gpus: usize) -> Vec<(String, String)> {
    let mut env = tcpxd_testkit::cudastub::child_env(gpus);
    env.push(("TCPXEMU_DEVICES".into(), "4".into()));
    // The emulation's verdict on each comm ("… under GPU g: served by this NIC" or "NOT served")
    // is an INFO line of the plugin's, which the daemon logs at debug (each call site's first 10
    // lines per 10 s, then a summary naming the last: crate::net::log_limit).
    env.push(("RUST_LOG".into(), "error,tcpxd::plugin=debug".into()));
    env
}

fn refs(env: &[(String, String)]) -> Vec<(&str, &str)> {
    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

async fn describe(c: &mut Client) -> pb::NodeDescription {
    c.describe_node(pb::DescribeNodeRequest {})
        .await
        .unwrap()
        .into_inner()
}

/// GPU i on NIC ⌊i / 2⌋, as RxDM's a3vm serves them.
fn assert_a3_map(n: &pb::NodeDescription, source: &str, relation: &str) {
    assert_eq!(n.gpus.len(), 8, "{n:?}");
    assert_eq!(n.topology_source, source);
    let got: Vec<(u32, &str, Vec<i32>)> = n
        .gpu_nics
        .iter()
        .map(|m| (m.gpu_ordinal, m.gpu_pci_bus_id.as_str(), m.nic_devices.clone()))
        .collect();
    let buses = [
        "0000:04:00.0",
        "0000:05:00.0",
        "0000:0a:00.0",
        "0000:0b:00.0",
        "0000:84:00.0",
        "0000:85:00.0",
        "0000:8a:00.0",
        "0000:8b:00.0",
    ];
    let want: Vec<(u32, &str, Vec<i32>)> = (0..8u32)
        .map(|g| (g, buses[g as usize], vec![g as i32 / 2]))
        .collect();
    assert_eq!(got, want);
    assert!(
        n.gpu_nics.iter().all(|m| m.relation == relation),
        "{:?}",
        n.gpu_nics
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_lane_is_opened_under_a_gpu_its_nic_serves() {
    tcpxd::logging::init("error");
    if test_plugin_file().is_some() {
        eprintln!(
            "skipped: TCPXD_TEST_PLUGIN names another plugin; this test drives the emulation on the stand-in"
        );
        return;
    }
    let env = a3_env();
    let a = procs::spawn("topo-a", 0, "", &refs(&env)).await;
    let b = procs::spawn("topo-b", 0, "[topology]\nmap = \"a3vm\"\n", &refs(&env)).await;
    let mut ac = a.client().await;
    let mut bc = b.client().await;
    assert_a3_map(&describe(&mut ac).await, "pci", "even spread (no PCI place)");
    assert_a3_map(&describe(&mut bc).await, "a3vm", "a3vm");

    // Host memory, both ways, byte-checked: it may use every NIC.
    let src = host_buffer(&mut ac, 16 * MIB, "src").await;
    let dst = host_buffer(&mut bc, 16 * MIB, "dst").await;
    let back = host_buffer(&mut ac, 16 * MIB, "back").await;
    fill_seed(&mut ac, src.id, 0, 0, 37).await;
    let id = write(&mut ac, write_entry(&src, 0, &dst, 0, 16 * MIB), b"")
        .await
        .unwrap();
    wait_ok(&mut ac, id).await;
    let id = read(&mut ac, read_entry(&dst, 0, &back, 0, 16 * MIB))
        .await
        .unwrap();
    wait_ok(&mut ac, id).await;
    let want = crc(&mut ac, src.id, 0, 16 * MIB).await;
    assert_eq!(crc(&mut bc, dst.id, 0, 16 * MIB).await, want);
    assert_eq!(crc(&mut ac, back.id, 0, 16 * MIB).await, want);

    // Each lane's comms were opened under a GPU its NIC serves (GPU g on NIC g / 2), on both
    // sides; host memory went over every NIC, each comm under the first GPU it serves.
    for (c, name) in [(&mut ac, "a"), (&mut bc, "b")] {
        let s = c.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
        assert_eq!(s.peers.len(), 1, "{name}");
        let lanes = &s.peers[0].lanes;
        // The layout's 4 NICs x (2 + 1 eager) lanes, then the routed lanes of each memory pair
        // (8 GPUs over 4 NICs, 2 per route: 264).
        assert_eq!(lanes.len(), 12 + 264, "{name}");
        let mut per_nic = [0u64; 4];
        for l in lanes {
            assert_eq!(l.send_gpu / 2, l.send_device, "{name}: {l:?}");
            assert_eq!(l.recv_gpu / 2, l.recv_device, "{name}: {l:?}");
            per_nic[l.send_device as usize] += l.bytes_sent;
            per_nic[l.recv_device as usize] += l.bytes_received;
            if l.bytes_sent + l.bytes_received > 0 {
                // Host memory both ways: host routes, each comm under the first GPU its NIC serves.
                assert_eq!(
                    (l.send_gpu, l.recv_gpu),
                    (2 * l.send_device, 2 * l.recv_device),
                    "{name}: {l:?}"
                );
            }
        }
        assert!(
            per_nic.iter().all(|&b| b > 0),
            "{name}: bytes per NIC {per_nic:?}"
        );
    }
    // The emulation, which takes a comm's GPU from the CUDA context current at listen / connect
    // as Google's plugin does, found every comm of both daemons under a GPU its NIC serves (under
    // whatever GPU happened to be current, three NICs of four would not be).
    for d in [&a, &b] {
        assert_every_comm_served(d, 10);
    }
}

/// The emulation's verdicts on the daemon's comms were logged (at least `at_least` lines: the
/// log's limit per call site) and none said "NOT served" (its own call site, whose first line
/// is always logged).
fn assert_every_comm_served(d: &procs::ProcDaemon, at_least: usize) {
    let log = d.log();
    let served = log.matches("served by this NIC").count();
    assert!(served >= at_least, "{}: {served} comms judged\n{log}", d.node);
    assert!(!log.contains("NOT served"), "{}: {log}", d.node);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_more_nics_than_gpus_every_nic_is_opened_under_a_gpu_it_serves() {
    tcpxd::logging::init("error");
    if test_plugin_file().is_some() {
        return;
    }
    // Two GPUs over four NICs: the map gives GPU 0 NIC 0 and GPU 1 NIC 2; NICs 1 and 3 carry
    // host memory only, opened under GPU 0 and GPU 1, as the emulation's default map serves them.
    let env = gpus_over_four_nics(2);
    let a = procs::spawn("topo-few-a", 0, "", &refs(&env)).await;
    let b = procs::spawn("topo-few-b", 0, "", &refs(&env)).await;
    let mut ac = a.client().await;
    let mut bc = b.client().await;
    let n = describe(&mut ac).await;
    let map: Vec<Vec<i32>> = n.gpu_nics.iter().map(|m| m.nic_devices.clone()).collect();
    assert_eq!(map, [vec![0], vec![2]]);
    let src = host_buffer(&mut ac, 4 * MIB, "src").await;
    let dst = host_buffer(&mut bc, 4 * MIB, "dst").await;
    fill_seed(&mut ac, src.id, 0, 0, 3).await;
    let id = write(&mut ac, write_entry(&src, 0, &dst, 0, 4 * MIB), b"")
        .await
        .unwrap();
    wait_ok(&mut ac, id).await;
    assert_eq!(
        crc(&mut bc, dst.id, 0, 4 * MIB).await,
        crc(&mut ac, src.id, 0, 4 * MIB).await
    );
    let s = ac.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    let gpus: Vec<(i32, i32)> = s.peers[0]
        .lanes
        .iter()
        .take(4)
        .map(|l| (l.device, l.recv_gpu))
        .collect();
    assert_eq!(gpus, [(0, 0), (1, 0), (2, 1), (3, 1)]);
    // Lanes open on first use: the write's 8 chunks opened the 8 rendezvous lanes a -> b.
    for d in [&a, &b] {
        assert_every_comm_served(d, 8);
    }
}

#[test]
fn a_map_naming_what_the_node_lacks_stops_the_daemon() {
    if test_plugin_file().is_some() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("tcpxd-topo-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (map, says) in [
        (
            "0=eth9",
            "NIC eth9 is not one of the plugin devices in use (0 tcpxemu0",
        ),
        ("0=0;1=1", "GPU 2 (0000:0a:00.0) has no NIC"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_tcpxd"))
            .args([
                "--node-id",
                "topo-bad",
                "--builtin-emulation",
                "--peer-listen",
                "127.0.0.1:0",
            ])
            .arg("--api-socket")
            .arg(dir.join("api.sock"))
            .args(["--topology", map])
            .envs(a3_env())
            .env("RUST_LOG", "error")
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{map}: started\n{err}");
        assert!(err.contains(says) && err.contains("topology.map"), "{map}: {err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
