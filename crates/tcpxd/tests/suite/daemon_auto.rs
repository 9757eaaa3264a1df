//! `transfer.protocol = "auto"` between real daemons (issue #13): small transfers go eager over
//! the eager lanes, large ones by rendezvous over the others, chosen per transfer by the
//! receiver's `eager_max_bytes`, with both kinds in flight at once in both directions; the choice
//! shows in GetStats (`sent_eager`, `sent_rendezvous`, per-lane bytes and credit limits); an auto
//! node pairs with eager and rendezvous nodes both ways; cancel gives every credit and slot back.

use crate::common::daemons::{self, *};
use tcpxd::api::proto::v1 as pb;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// The per-transfer choice of eager or rendezvous is under test here: small transfers are not
/// carried inline (daemon_inline.rs tests that path).
fn mode(protocol: &'static str) -> impl FnOnce(&mut tcpxd::config::DaemonArgs) {
    move |a| {
        a.transfer_protocol = Some(protocol.into());
        a.inline.inline_max_bytes = Some(0);
    }
}

async fn peer_stats(c: &mut Client, node: &str) -> pb::PeerStats {
    c.get_stats(pb::GetStatsRequest {})
        .await
        .unwrap()
        .into_inner()
        .peers
        .into_iter()
        .find(|p| p.node_id == node)
        .unwrap_or_else(|| panic!("no peer {node}"))
}

/// One transfer of the mix: who started it, its id, and where its bytes went (node, buffer).
struct Moved {
    at: usize,
    id: u64,
    src: (usize, u64, u64),
    dst: (usize, u64, u64),
    len: u64,
}

/// Writes and reads of `sizes` both ways between daemons 0 and 1, all started before any is
/// waited for; each in its own slot of the 64 MiB buffers. Returns them once all succeeded.
async fn mix(d: &mut [&mut TestDaemon; 2], bufs: &[[pb::Buffer; 2]; 2], sizes: &[u64]) -> Vec<Moved> {
    let mut moved = Vec::new();
    let mut next = 0u64;
    for &len in sizes {
        for dir in 0..4 {
            let slot = next;
            next += len.div_ceil(4096) * 4096;
            assert!(next <= 64 * MIB);
            // dir 0: write 0→1; 1: write 1→0; 2: 0 reads from 1; 3: 1 reads from 0.
            let (at, from) = match dir {
                0 => (0, 0),
                1 => (1, 1),
                2 => (0, 1),
                _ => (1, 0),
            };
            let to = 1 - from;
            let (src, dst) = (&bufs[from][0], &bufs[to][1]);
            let id = if at == from {
                write(&mut d[at].client, write_entry(src, slot, dst, slot, len), b"")
                    .await
                    .unwrap()
            } else {
                read(&mut d[at].client, read_entry(src, slot, dst, slot, len))
                    .await
                    .unwrap()
            };
            moved.push(Moved {
                at,
                id,
                src: (from, src.id, slot),
                dst: (to, dst.id, slot),
                len,
            });
        }
    }
    for m in &moved {
        wait_ok(&mut d[m.at].client, m.id).await;
    }
    for m in &moved {
        let a = crc(&mut d[m.src.0].client, m.src.1, m.src.2, m.len).await;
        let b = crc(&mut d[m.dst.0].client, m.dst.1, m.dst.2, m.len).await;
        assert_eq!(a, b, "{} bytes from node {} differ", m.len, m.src.0);
    }
    moved
}

async fn buffers(d: &mut TestDaemon, seed: u64) -> [pb::Buffer; 2] {
    let src = host_buffer(&mut d.client, 64 * MIB, "src").await;
    let dst = host_buffer(&mut d.client, 64 * MIB, "dst").await;
    fill_seed(&mut d.client, src.id, 0, 0, seed).await;
    [src, dst]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_and_large_transfers_at_once_in_both_directions_each_take_their_protocol() {
    tcpxd::logging::init("error");
    let mut a = daemons::start("auto-a", mode("auto")).await;
    // b wants up to 1 MiB eager, a the default 64 KiB: the receiver's setting decides.
    let mut b = daemons::start("auto-b", |args| {
        args.transfer_protocol = Some("auto".into());
        args.eager_max_bytes = Some(MIB);
        args.inline.inline_max_bytes = Some(0);
    })
    .await;
    connect(&mut a, &b).await;

    // The lanes: each node listens on lanes_per_device (2) + eager_lanes (1) lanes per device,
    // its eager lanes last; a routed pairing (a node with GPUs: the CUDA stand-in) has those and
    // its catalogue's (each memory pair's rendezvous lanes, then its eager lanes). GetStats
    // lists only the lanes in use: none yet.
    let sa = peer_stats(&mut a.client, "auto-b").await;
    assert_routed_as_expected(&sa);
    let n = sa.send_lanes;
    assert_eq!(sa.recv_lanes, n, "{sa:?}");
    if !sa.routed {
        assert_eq!(n % 3, 0, "{sa:?}");
    }
    assert!(sa.lanes.is_empty(), "nothing used yet: {:?}", sa.lanes);
    let eager_from = n / 3 * 2;
    let node = a
        .client
        .describe_node(pb::DescribeNodeRequest {})
        .await
        .unwrap()
        .into_inner();
    // The rendezvous lanes of host memory to host memory: lanes_per_device on each NIC (the
    // layout's, or the (host, host) group's routes, NIC i to NIC i).
    let host_rendezvous = node.devices.len() * node.lanes_per_device as usize;

    let bufs = [buffers(&mut a, 1).await, buffers(&mut b, 2).await];
    let sizes = [1, 4 * KIB, 64 * KIB, 64 * KIB + 1, MIB, MIB + 1, 8 * MIB];
    let before_a = peer_stats(&mut a.client, "auto-b").await;
    let before_b = peer_stats(&mut b.client, "auto-a").await;
    let moved = mix(&mut [&mut a, &mut b], &bufs, &sizes).await;
    assert_eq!(moved.len(), 28);
    let sa = peer_stats(&mut a.client, "auto-b").await;
    let sb = peer_stats(&mut b.client, "auto-a").await;

    // a sends 7 sizes to b (writes, and data for b's reads) twice: eager up to b's 1 MiB.
    assert_eq!(
        (sa.sent_eager, sa.sent_rendezvous),
        (2 * 5, 2 * 2),
        "a → b (limit 1 MiB)"
    );
    // b sends to a: eager up to a's 64 KiB.
    assert_eq!(
        (sb.sent_eager, sb.sent_rendezvous),
        (2 * 3, 2 * 4),
        "b → a (limit 64 KiB)"
    );
    assert_eq!(
        (sa.received_eager, sa.received_rendezvous),
        (sb.sent_eager, sb.sent_rendezvous)
    );
    assert_eq!(
        (sb.received_eager, sb.received_rendezvous),
        (sa.sent_eager, sa.sent_rendezvous)
    );

    // Each lane says what it carries; credits on the eager lanes only, 16 each way (on the
    // layout, its last lane per device), every lane used of host memory to host memory (routed:
    // the (host, host) group's).
    for l in &sa.lanes {
        for (kind, limit, memory) in [
            (&l.send_kind, l.send_credit_limit, &l.send_memory),
            (&l.recv_kind, l.recv_credit_limit, &l.recv_memory),
        ] {
            match kind.as_str() {
                "eager" => assert_eq!(limit, 16, "{l:?}"),
                "rendezvous" => assert_eq!(limit, 0, "{l:?}"),
                "" => continue,
                other => panic!("kind {other:?}: {l:?}"),
            }
            if sa.routed {
                assert_eq!(memory, "host>host", "{l:?}");
            } else {
                assert_eq!(memory, "", "{l:?}");
                assert_eq!(kind == "eager", l.lane >= eager_from, "{l:?}");
            }
        }
    }
    // Each protocol's bytes went over its own lanes only (lanes listed before are listed after:
    // a lane that moved bytes stays listed).
    let sent = |stats: &pb::PeerStats, eager: bool| -> u64 {
        stats
            .lanes
            .iter()
            .filter(|l| (l.send_kind == "eager") == eager)
            .map(|l| l.bytes_sent)
            .sum()
    };
    let (small_a, large_a): (Vec<u64>, Vec<u64>) = sizes.iter().partition(|&&s| s <= MIB);
    let (small_b, large_b): (Vec<u64>, Vec<u64>) = sizes.iter().partition(|&&s| s <= 64 * KIB);
    let twice = |v: &[u64]| 2 * v.iter().sum::<u64>();
    assert_eq!(sent(&sa, true) - sent(&before_a, true), twice(&small_a));
    assert_eq!(sent(&sa, false) - sent(&before_a, false), twice(&large_a));
    assert_eq!(sent(&sb, true) - sent(&before_b, true), twice(&small_b));
    assert_eq!(sent(&sb, false) - sent(&before_b, false), twice(&large_b));
    // The per-peer totals are the lanes' (no bytes on lanes left out).
    assert_eq!(sa.bytes_sent, sent(&sa, true) + sent(&sa, false));
    // The large ones kept the rendezvous lanes' parallelism: every rendezvous lane of host
    // memory to host memory carried some.
    let busy = sa
        .lanes
        .iter()
        .filter(|l| l.send_kind == "rendezvous" && l.bytes_sent > 0)
        .count();
    assert_eq!(busy, host_rendezvous, "{:?}", sa.lanes);

    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_auto_node_pairs_with_eager_and_rendezvous_nodes_both_ways() {
    tcpxd::logging::init("error");
    for other in ["eager", "rendezvous"] {
        let (na, nb) = (format!("mixauto-a-{other}"), format!("mixauto-b-{other}"));
        let mut a = daemons::start(&na, mode("auto")).await;
        let mut b = daemons::start(&nb, mode(other)).await;
        connect(&mut a, &b).await;
        let bufs = [buffers(&mut a, 3).await, buffers(&mut b, 4).await];
        let sizes = [4 * KIB, 64 * KIB, MIB];
        mix(&mut [&mut a, &mut b], &bufs, &sizes).await;
        let sa = peer_stats(&mut a.client, &nb).await;
        let sb = peer_stats(&mut b.client, &na).await;
        assert_routed_as_expected(&sa);
        assert_routed_as_expected(&sb);
        // Towards b everything goes b's way; towards a the size decides (64 KiB: eager).
        match other {
            "eager" => assert_eq!((sa.sent_eager, sa.sent_rendezvous), (6, 0), "{other}"),
            _ => assert_eq!((sa.sent_eager, sa.sent_rendezvous), (0, 6), "{other}"),
        }
        assert_eq!((sb.sent_eager, sb.sent_rendezvous), (4, 2), "{other}");
        // a listens on 3 lanes per device, b on 2: a's send lanes (b's receive lanes) hold
        // credits on every lane or none, b's towards a on a's eager lanes only. Each lane used
        // says what it carries; on the layout a's eager lanes are its last per device.
        let want = if other == "eager" { 16 } else { 0 };
        let towards_b: Vec<&pb::LaneStats> = sa.lanes.iter().filter(|l| !l.send_kind.is_empty()).collect();
        assert!(!towards_b.is_empty(), "{other}: {:?}", sa.lanes);
        for l in towards_b {
            assert_eq!(l.send_kind == "eager", other == "eager", "{other}: {l:?}");
            assert_eq!(l.send_credit_limit, want, "{other}: {l:?}");
        }
        let a_eager_from = sb.send_lanes / 3 * 2;
        let towards_a: Vec<&pb::LaneStats> = sb.lanes.iter().filter(|l| !l.send_kind.is_empty()).collect();
        for kind in ["eager", "rendezvous"] {
            assert!(
                towards_a.iter().any(|l| l.send_kind == kind && l.bytes_sent > 0),
                "{other}: no {kind} lane towards a: {towards_a:?}"
            );
        }
        for l in towards_a {
            let eager = l.send_kind == "eager";
            assert_eq!(l.send_credit_limit, if eager { 16 } else { 0 }, "{other}: {l:?}");
            if !sb.routed {
                assert_eq!(eager, l.lane >= a_eager_from, "{other}: {l:?}");
            }
        }
        assert_lanes_drain(&mut a.client).await;
        assert_lanes_drain(&mut b.client).await;
        a.stop().await;
        b.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_mixed_transfers_gives_every_credit_and_slot_back() {
    // SAFETY: each test runs in its own process (nextest) and sets the variable before the
    // emulation is initialised and before any other thread reads the environment.
    unsafe { std::env::set_var("TCPXEMU_RATE_GBPS", "1") };
    tcpxd::logging::init("error");
    let mut a = daemons::start("autocancel-a", mode("auto")).await;
    let mut b = daemons::start("autocancel-b", mode("auto")).await;
    connect(&mut a, &b).await;
    let [src, _] = buffers(&mut a, 5).await;
    let [_, dst] = buffers(&mut b, 6).await;
    // A large rendezvous write (64 MiB at 1 Gb/s: ~0.5 s) and small eager ones behind it.
    let large = write(&mut a.client, write_entry(&src, 0, &dst, 0, 64 * MIB), b"")
        .await
        .unwrap();
    let mut small = Vec::new();
    for k in 0..8 {
        let off = k * 64 * KIB;
        small.push(
            write(&mut a.client, write_entry(&src, off, &dst, off, 16 * KIB), b"")
                .await
                .unwrap(),
        );
    }
    a.client
        .cancel(pb::CancelRequest { transfer_id: large })
        .await
        .unwrap();
    a.client
        .cancel(pb::CancelRequest {
            transfer_id: small[7],
        })
        .await
        .unwrap();
    let e = wait(&mut a.client, large).await;
    assert!(
        e.status_code == tonic::Code::Cancelled as i32 || e.status_code == 0,
        "{e:?}"
    );
    for id in &small[..7] {
        // Each small one ends (it may have finished before the cancel of its neighbour).
        wait_ok(&mut a.client, *id).await;
    }
    wait(&mut a.client, small[7]).await;
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_lanes_than_a_pairing_carries_are_refused_at_start_naming_the_settings() {
    tcpxd::logging::init("error");
    let dir = std::env::temp_dir().join(format!("tcpxd-auto-lanes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tcpxd.toml");
    // 4 devices (device 0 four times) x (16 + 4 eager) = 80 lanes > 64.
    std::fs::write(
        &file,
        "[plugin]\ndevices = [0, 0, 0, 0]\nlanes_per_device = 16\n[transfer]\nprotocol = \"auto\"\neager_lanes = 4\n",
    )
    .unwrap();
    let args = tcpxd::config::DaemonArgs {
        node_id: Some("too-many".into()),
        config: Some(file.clone()),
        api_socket: Some(dir.join("api.sock")),
        peer_listen: Some("127.0.0.1:0".parse().unwrap()),
        builtin_emulation: true,
        ..Default::default()
    };
    let cfg = tcpxd::config::Config::resolve(&args, &|_| None).expect("config");
    let e = match tcpxd::daemon::start(&cfg, daemons::plugin()).await {
        Ok(_) => panic!("80 lanes accepted"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("80 lanes")
            && e.contains("plugin.lanes_per_device + transfer.eager_lanes")
            && e.contains("at most 64"),
        "{e}"
    );
    // The same lanes without auto's eager lanes: 64, accepted.
    std::fs::write(
        &file,
        "[plugin]\ndevices = [0, 0, 0, 0]\nlanes_per_device = 16\n[transfer]\nprotocol = \"auto\"\neager_lanes = 4\n"
            .replace("\"auto\"", "\"rendezvous\""),
    )
    .unwrap();
    let cfg = tcpxd::config::Config::resolve(&args, &|_| None).expect("config");
    let d = tcpxd::daemon::start(&cfg, daemons::plugin())
        .await
        .expect("64 lanes start");
    d.shutdown().await;
    std::fs::remove_dir_all(&dir).ok();
}
