//! The node's topology (issue #37) on an A3-shaped emulated node: eight stand-in GPUs with A3's
//! PCI bus ids (`tools/realplugin/cudastub` as the daemon's `libcuda.so.1`) and four emulated
//! NICs with A3's `pciPath`s. Each daemon works out each GPU's NIC (`pci`: the even spread, since
//! the stand-in's GPUs have no sysfs place; `a3vm`: RxDM's preset) and shows it in DescribeNode;
//! every lane's comms are opened with a GPU its NIC serves current (GetStats' `send_gpu` /
//! `recv_gpu`); host memory moves byte-exact over all four NICs; a GPU pair's bytes move only on
//! its NICs' routed lanes (GetStats' per-direction NIC, GPU and bytes), also towards a node
//! without GPUs; a map naming what the node lacks stops the daemon at start-up with the part
//! named.

use std::process::Command;

use crate::common::daemons::*;
use crate::common::procs;
use tcpxd::api::proto::v1 as pb;

const MIB: u64 = 1 << 20;

/// The stand-in's eight GPUs and four emulated NICs, for a daemon process.
pub(crate) fn a3_env() -> Vec<(String, String)> {
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
    // These tests follow GPU bytes on their lanes: GPU memory inline (on by default, one
    // transfer in flight per pairing) is daemon_inline's.
    env.push(("TCPXD_INLINE_GPU".into(), "off".into()));
    env
}

pub(crate) fn refs(env: &[(String, String)]) -> Vec<(&str, &str)> {
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
        let p = &s.peers[0];
        let lanes = &p.lanes;
        // The routed lanes of each memory pair (8 GPUs over 4 NICs, 2 rendezvous + 2 eager lanes
        // per route: 264 + 264), not the layout's 4 NICs x (2 + 1 eager), which a routed
        // pairing never uses; GetStats lists those in use only: host memory's, no GPU pair's.
        assert!(p.routed, "{name}");
        assert_eq!((p.send_lanes, p.recv_lanes), (528, 528), "{name}");
        assert!(!lanes.is_empty() && lanes.len() <= 4 * 4, "{name}: {lanes:?}");
        assert_eq!(p.bytes_sent, lanes.iter().map(|l| l.bytes_sent).sum::<u64>());
        for l in lanes {
            for m in [&l.send_memory, &l.recv_memory] {
                assert!(m.is_empty() || m == "host>host", "{name}: {l:?}");
            }
        }
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
pub(crate) fn assert_every_comm_served(d: &procs::ProcDaemon, at_least: usize) {
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
    // Host memory's lanes, one route per NIC (NIC i to NIC i), each comm under the GPU its NIC
    // serves first (NICs 1 and 3: none, so GPU 0 and GPU 1): a's sends, b's receives.
    let ends = |lanes: Vec<pb::LaneStats>, send: bool| {
        let mut v: Vec<(i32, i32)> = lanes
            .iter()
            .map(|l| {
                if send {
                    (l.send_device, l.send_gpu)
                } else {
                    (l.recv_device, l.recv_gpu)
                }
            })
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    let want = [(0, 0), (1, 0), (2, 1), (3, 1)];
    assert_eq!(ends(lane_bytes(&mut ac).await, true), want);
    assert_eq!(ends(lane_bytes(&mut bc).await, false), want);
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

/// Each lane's bytes sent and received so far, by lane.
pub(crate) async fn lane_bytes(c: &mut Client) -> Vec<pb::LaneStats> {
    let s = c.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    assert!(s.peers.len() <= 1);
    // Before the first transfer paired the nodes: nothing yet.
    s.peers.first().map(|p| p.lanes.clone()).unwrap_or_default()
}

/// The lanes whose bytes sent (`sent`) or received grew since `before`.
pub(crate) fn grew<'a>(
    before: &[pb::LaneStats],
    after: &'a [pb::LaneStats],
    sent: bool,
) -> Vec<&'a pb::LaneStats> {
    // GetStats lists the lanes in use only: a lane new since `before` had counted nothing.
    let zero = pb::LaneStats::default();
    after
        .iter()
        .map(|a| (a, before.iter().find(|b| b.lane == a.lane).unwrap_or(&zero)))
        .filter(|(a, b)| {
            if sent {
                a.bytes_sent > b.bytes_sent
            } else {
                a.bytes_received > b.bytes_received
            }
        })
        .map(|(a, _)| a)
        .collect()
}

/// Issue #37 point 2: a transfer from GPU s to GPU d moves only on lanes from nic(s), opened
/// under GPU s, to nic(d), listened under GPU d (GetStats' per-direction NIC and GPU, and each
/// lane's byte counters), byte-exact by WRITE and READ; host memory to and from GPUs too; and
/// the emulation (which takes a comm's GPU from the CUDA context current at listen / connect
/// and fails a CUDA receive on a NIC that does not serve it, "rx no cmsg") found every comm
/// served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_pairs_bytes_move_only_on_its_nics_lanes() {
    use crate::common::gpus::{assert_same, cuda_buffer};
    tcpxd::logging::init("error");
    if test_plugin_file().is_some() {
        return;
    }
    let mut env = a3_env();
    env.extend(
        [
            ("TCPXEMU_BOUNCE", "cuda"),
            ("TCPXEMU_BOUNCE_PAGES", "2048"),
            ("UCCL_TCPX_UNPACK_IMPL", "d2d"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    let a = procs::spawn("routes-a", 0, "", &refs(&env)).await;
    let b = procs::spawn("routes-b", 0, "[topology]\nmap = \"a3vm\"\n", &refs(&env)).await;
    let mut ac = a.client().await;
    let mut bc = b.client().await;
    // Larger than auto's eager limit: rendezvous, on the routed lanes.
    let len = 2 * MIB + 5;
    for (s, d, back_gpu) in [(3u32, 5u32, 6u32), (0, 7, 1), (6, 6, 2)] {
        let src = cuda_buffer(&mut ac, s, 4 * MIB).await;
        let dst = cuda_buffer(&mut bc, d, 4 * MIB).await;
        let back = cuda_buffer(&mut ac, back_gpu, 4 * MIB).await;
        fill_seed(&mut ac, src.id, 0, 0, 11 + u64::from(s)).await;
        let (a0, b0) = (lane_bytes(&mut ac).await, lane_bytes(&mut bc).await);
        let id = write(&mut ac, write_entry(&src, 3, &dst, 4096, len), b"")
            .await
            .unwrap();
        wait_ok(&mut ac, id).await;
        let what = format!("WRITE GPU {s} -> GPU {d}");
        assert_same(&mut ac, (src.id, 3), &mut bc, (dst.id, 4096), len, &what).await;
        let (a1, b1) = (lane_bytes(&mut ac).await, lane_bytes(&mut bc).await);
        let sent = grew(&a0, &a1, true);
        assert!(!sent.is_empty(), "{what}");
        for l in &sent {
            assert_eq!(
                (l.send_device, l.send_gpu),
                (s as i32 / 2, s as i32),
                "{what}: {l:?}"
            );
            assert_eq!(
                (l.recv_device, l.recv_gpu),
                (d as i32 / 2, d as i32),
                "{what}: {l:?}"
            );
        }
        let received = grew(&b0, &b1, false);
        assert_eq!(
            received.iter().map(|l| l.lane).collect::<Vec<_>>(),
            sent.iter().map(|l| l.lane).collect::<Vec<_>>(),
            "{what}: the same lanes at both ends"
        );
        for l in &received {
            assert_eq!(
                (l.recv_device, l.recv_gpu),
                (d as i32 / 2, d as i32),
                "{what}: {l:?}"
            );
        }
        // READ it back into another GPU of a: b's GPU d sends, a's GPU back_gpu receives.
        let id = read(&mut ac, read_entry(&dst, 4096, &back, 0, len))
            .await
            .unwrap();
        wait_ok(&mut ac, id).await;
        let what = format!("READ GPU {d} -> GPU {back_gpu}");
        assert_same(&mut bc, (dst.id, 4096), &mut ac, (back.id, 0), len, &what).await;
        let (a2, b2) = (lane_bytes(&mut ac).await, lane_bytes(&mut bc).await);
        for l in grew(&b1, &b2, true) {
            assert_eq!(
                (l.send_device, l.send_gpu),
                (d as i32 / 2, d as i32),
                "{what}: {l:?}"
            );
        }
        let received = grew(&a1, &a2, false);
        assert!(!received.is_empty(), "{what}");
        for l in received {
            assert_eq!(
                (l.recv_device, l.recv_gpu),
                (back_gpu as i32 / 2, back_gpu as i32),
                "{what}: {l:?}"
            );
        }
    }
    // Host memory to a GPU and back: byte-exact, the GPU's end on its own NIC.
    let host = host_buffer(&mut ac, 4 * MIB, "host").await;
    let gpu = cuda_buffer(&mut bc, 4, 4 * MIB).await;
    fill_seed(&mut ac, host.id, 0, 0, 5).await;
    let b0 = lane_bytes(&mut bc).await;
    let id = write(&mut ac, write_entry(&host, 0, &gpu, 0, len), b"")
        .await
        .unwrap();
    wait_ok(&mut ac, id).await;
    assert_same(&mut ac, (host.id, 0), &mut bc, (gpu.id, 0), len, "host -> GPU 4").await;
    for l in grew(&b0, &lane_bytes(&mut bc).await, false) {
        assert_eq!((l.recv_device, l.recv_gpu), (2, 4), "host -> GPU 4: {l:?}");
    }
    let host_back = host_buffer(&mut ac, 4 * MIB, "host-back").await;
    let id = read(&mut ac, read_entry(&gpu, 0, &host_back, 0, len))
        .await
        .unwrap();
    wait_ok(&mut ac, id).await;
    assert_same(
        &mut bc,
        (gpu.id, 0),
        &mut ac,
        (host_back.id, 0),
        len,
        "GPU 4 -> host",
    )
    .await;
    // Small transfers go eager: GPU 3 -> GPU 5 by b's GPU credits and GPU 3 -> host by size,
    // each on its pair's eager lanes (into host memory: host slots), byte-exact.
    let src = cuda_buffer(&mut ac, 3, 64 * 1024).await;
    fill_seed(&mut ac, src.id, 0, 0, 31).await;
    let gpu5 = cuda_buffer(&mut bc, 5, 64 * 1024).await;
    let host_b = host_buffer(&mut bc, 64 * 1024, "host-b").await;
    for (dst, what) in [(&gpu5, "small GPU 3 -> GPU 5"), (&host_b, "small GPU 3 -> host")] {
        let a0 = lane_bytes(&mut ac).await;
        let id = write(&mut ac, write_entry(&src, 0, dst, 8, 8192 + 3), b"")
            .await
            .unwrap();
        wait_ok(&mut ac, id).await;
        assert_same(&mut ac, (src.id, 0), &mut bc, (dst.id, 8), 8192 + 3, what).await;
        let a1 = lane_bytes(&mut ac).await;
        let sent = grew(&a0, &a1, true);
        assert!(!sent.is_empty(), "{what}");
        for l in sent {
            assert_eq!((l.send_device, l.send_gpu), (1, 3), "{what}: {l:?}");
            if dst.id == gpu5.id {
                assert_eq!((l.recv_device, l.recv_gpu), (2, 5), "{what}: {l:?}");
            }
        }
    }
    for d in [&a, &b] {
        let log = d.log();
        assert!(!log.contains("NOT served"), "{}: {log}", d.node);
        assert!(!log.contains("rx no cmsg"), "{}: {log}", d.node);
    }
    assert_every_comm_served(&a, 4);
    assert_every_comm_served(&b, 4);
}

/// A node without GPUs pairs with an eight-GPU node: the pairing is routed (one side has GPUs),
/// host memory on a reaches GPU 5 of b only through b's NIC 2 under GPU 5, and back, byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_gpus_reaches_a_gpu_on_its_own_nic() {
    use crate::common::gpus::{assert_same, cuda_buffer};
    tcpxd::logging::init("error");
    if test_plugin_file().is_some() {
        return;
    }
    let plain = [("TCPXEMU_DEVICES", "2")];
    let mut env = a3_env();
    env.extend(
        [
            ("TCPXEMU_BOUNCE", "cuda"),
            ("TCPXEMU_BOUNCE_PAGES", "2048"),
            ("UCCL_TCPX_UNPACK_IMPL", "d2d"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    let a = procs::spawn("routes-plain", 0, "", &plain).await;
    let b = procs::spawn("routes-gpus", 0, "", &refs(&env)).await;
    let mut ac = a.client().await;
    let mut bc = b.client().await;
    let len = 2 * MIB + 5;
    let host = host_buffer(&mut ac, 4 * MIB, "host").await;
    let back = host_buffer(&mut ac, 4 * MIB, "back").await;
    let gpu = cuda_buffer(&mut bc, 5, 4 * MIB).await;
    fill_seed(&mut ac, host.id, 0, 0, 23).await;
    let id = write(&mut ac, write_entry(&host, 1, &gpu, 0, len), b"")
        .await
        .unwrap();
    wait_ok(&mut ac, id).await;
    assert_same(&mut ac, (host.id, 1), &mut bc, (gpu.id, 0), len, "host -> GPU 5").await;
    let id = read(&mut ac, read_entry(&gpu, 0, &back, 0, len)).await.unwrap();
    wait_ok(&mut ac, id).await;
    assert_same(&mut bc, (gpu.id, 0), &mut ac, (back.id, 0), len, "GPU 5 -> host").await;
    let (mut into, mut out) = (0, 0);
    for l in lane_bytes(&mut bc).await {
        if l.bytes_received > 0 {
            assert_eq!((l.recv_device, l.recv_gpu), (2, 5), "{l:?}");
            into += 1;
        }
        if l.bytes_sent > 0 {
            assert_eq!((l.send_device, l.send_gpu), (2, 5), "{l:?}");
            out += 1;
        }
    }
    // Host side has two NICs: two routes each way. Into GPU 5 by b's GPU credits (at any
    // size): the pair's eager lanes, two a route (ROUTED_EAGER_PER_ROUTE); back by rendezvous
    // (a keeps no GPU credits and the READ is above its eager limit): two lanes a route.
    assert_eq!((into, out), (4, 4));
    for l in lane_bytes(&mut ac).await {
        // Nothing is made current on a node without GPUs.
        assert_eq!((l.send_gpu, l.recv_gpu), (-1, -1), "{l:?}");
    }
    let log = b.log();
    assert!(
        !log.contains("NOT served") && !log.contains("rx no cmsg"),
        "{log}"
    );
}
