//! A descriptor is all a client needs (issue #15 point 3): descriptors carry their daemon's peer
//! addresses, the first transfer naming a node this daemon never met connects to it (once, however
//! many ask at the same time; authenticated as configured), bad addresses are refused naming the
//! field, and DescribeNode says what another node needs.

use std::path::PathBuf;

use crate::common::daemons::{self, *};
use tcpxd::api::proto::v1 as pb;
use tonic::Code;

const MIB: u64 = 1 << 20;

async fn peers_of(c: &mut Client) -> Vec<pb::Peer> {
    c.list_peers(pb::ListPeersRequest {})
        .await
        .unwrap()
        .into_inner()
        .peers
}

/// Pairings the poller knows with `node` (a second pairing would show as a second entry).
async fn pairings_with(c: &mut Client, node: &str) -> usize {
    let s = c.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    s.peers.iter().filter(|p| p.node_id == node).count()
}

async fn describe(c: &mut Client) -> pb::NodeDescription {
    c.describe_node(pb::DescribeNodeRequest {})
        .await
        .expect("describe node")
        .into_inner()
}

/// The descriptor without its peer addresses (the form older daemons hand out).
fn bare(descriptor: &str) -> String {
    descriptor.split('@').next().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_descriptor_is_all_a_client_needs() {
    tcpxd::logging::init("error");
    // a takes nothing inline, so b's small write below uses a's receive lanes (stats checked).
    let mut a = daemons::start("fu-a", |a| a.inline.inline_max_bytes = Some(0)).await;
    let mut b = daemons::start("fu-b", |_| {}).await;

    // DescribeNode: the id, the peer address descriptors carry, what the node runs.
    let nb = describe(&mut b.client).await;
    assert_eq!(nb.node_id, "fu-b");
    assert_eq!(nb.peer_addresses, vec![b.peer_addr()]);
    assert_eq!(nb.version, env!("CARGO_PKG_VERSION"));
    assert_eq!(nb.plugin_path, daemons::described_plugin_path());
    assert!(!nb.plugin_name.is_empty());
    assert!(!nb.devices.is_empty() && nb.devices.iter().all(|d| d.host_memory));
    assert!(nb.lanes_per_device >= 1 && nb.chunk_bytes >= 4096);
    assert_eq!(nb.peer_protocol_version, tcpxd::peers::PROTOCOL_VERSION);
    // The topology: each GPU with its NIC(s); without GPUs (CI) none, nothing made current.
    assert_eq!(nb.gpu_nics.len(), nb.gpus.len());
    if nb.gpus.is_empty() {
        assert_eq!(nb.topology_source, "none");
    } else {
        assert_eq!(nb.topology_source, "pci");
        assert!(
            nb.gpu_nics.iter().all(|m| !m.nic_names.is_empty()),
            "{:?}",
            nb.gpu_nics
        );
    }

    let x = host_buffer(&mut a.client, 4 * MIB, "x").await;
    let y = host_buffer(&mut b.client, 4 * MIB, "y").await;
    assert!(
        y.descriptor.ends_with(&format!("@{}", b.peer_addr())),
        "the descriptor carries b's peer address: {}",
        y.descriptor
    );
    fill_seed(&mut a.client, x.id, 0, 0, 71).await;
    assert!(peers_of(&mut a.client).await.is_empty(), "a never met b");

    // A WRITE to b's descriptor, with no ConnectPeer: a pairs with b, the bytes land.
    let r = a
        .client
        .write(pb::WriteRequest {
            entry: Some(write_entry(&x, 0, &y, 0, 4 * MIB)),
            timeout_ms: 60_000,
            wait: true,
            ..Default::default()
        })
        .await
        .expect("write to a never-met node's descriptor")
        .into_inner();
    let fin = r.r#final.expect("waited");
    assert_eq!(fin.status_code, 0, "{}", fin.status_message);
    assert_eq!(
        crc(&mut b.client, y.id, 0, 0).await,
        crc(&mut a.client, x.id, 0, 0).await,
        "the bytes landed"
    );
    let peers = peers_of(&mut a.client).await;
    assert_eq!(peers.len(), 1);
    assert_eq!(
        (peers[0].node_id.as_str(), peers[0].state),
        ("fu-b", pb::PeerState::Up as i32)
    );
    // DescribeNode counts the layout's lanes as the pairing has them: the rendezvous lanes, and
    // under `auto` the eager ones on top (`tcpxctl describe` once said 2 per device where stats
    // showed 3). A routed pairing (a node with GPUs: the CUDA stand-in) has its lane catalogue
    // instead (every memory pair's lanes: more than the layout's).
    let na = describe(&mut a.client).await;
    let auto = na.transfer_protocol == "auto";
    assert!(["auto", "eager", "rendezvous"].contains(&na.transfer_protocol.as_str()));
    assert_eq!(na.eager_lanes_per_device > 0, auto, "{na:?}");
    assert_eq!(na.eager_max_bytes > 0, auto, "{na:?}");
    // A small write from b to a: a's receive lanes in use too (under `auto` an eager one).
    let small = host_buffer(&mut a.client, 4096, "small").await;
    let id = write(&mut b.client, write_entry(&y, 0, &small, 0, 4096), b"")
        .await
        .unwrap();
    wait_ok(&mut b.client, id).await;
    assert_eq!(
        crc(&mut a.client, small.id, 0, 0).await,
        crc(&mut b.client, y.id, 0, 4096).await
    );
    let stats = a
        .client
        .get_stats(pb::GetStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    let peer = stats
        .peers
        .iter()
        .find(|p| p.node_id == "fu-b")
        .expect("b in stats");
    assert_routed_as_expected(peer);
    let per_device = na.lanes_per_device + na.eager_lanes_per_device;
    let layout = na.devices.len() as u32 * per_device;
    if peer.routed {
        assert!(peer.recv_lanes > layout, "{peer:?}");
    } else {
        assert_eq!(peer.recv_lanes, layout, "{peer:?}");
    }
    // GetStats lists the lanes in use: the write's.
    let lanes = &peer.lanes;
    assert!(!lanes.is_empty() && lanes.len() as u32 <= peer.send_lanes.max(peer.recv_lanes));
    assert_eq!(peer.bytes_sent, lanes.iter().map(|l| l.bytes_sent).sum::<u64>());
    assert!(peer.bytes_sent >= 4 * MIB, "{peer:?}");
    assert!(lanes.iter().any(|l| l.bytes_received > 0), "{lanes:?}");
    for l in lanes {
        // The eager lanes are those a receiving `auto` node announced credits for (a's
        // receive lanes: on the layout its last one per device).
        if !l.recv_kind.is_empty() {
            assert_eq!(l.recv_kind == "eager", l.recv_credit_limit > 0, "{l:?}");
            if auto && !peer.routed {
                assert_eq!(
                    l.recv_kind == "eager",
                    l.lane >= na.devices.len() as u32 * na.lanes_per_device,
                    "{l:?}"
                );
            }
        }
    }
    // And the other way: b reads a's buffer through a's descriptor (already paired from a's side).
    let z = host_buffer(&mut b.client, 4 * MIB, "z").await;
    let id = read(&mut b.client, read_entry(&x, 0, &z, 0, 4 * MIB))
        .await
        .unwrap();
    wait_ok(&mut b.client, id).await;
    assert_eq!(
        crc(&mut b.client, z.id, 0, 0).await,
        crc(&mut a.client, x.id, 0, 0).await
    );
    assert_eq!(pairings_with(&mut a.client, "fu-b").await, 1);
    assert_eq!(pairings_with(&mut b.client, "fu-a").await, 1);

    // Many first uses at once (another never-met node): one pairing, every transfer lands.
    let mut c = daemons::start("fu-c", |_| {}).await;
    let w = host_buffer(&mut c.client, 8 * MIB, "w").await;
    let mut calls = Vec::new();
    for i in 0..8u64 {
        let mut client = a.client.clone();
        let e = write_entry(&x, (i % 4) * MIB, &w, i * MIB, MIB);
        calls.push(tokio::spawn(async move {
            client
                .write(pb::WriteRequest {
                    entry: Some(e),
                    timeout_ms: 60_000,
                    wait: true,
                    ..Default::default()
                })
                .await
                .map(|r| r.into_inner().r#final.expect("waited"))
        }));
    }
    for call in calls {
        let fin = call.await.unwrap().expect("concurrent first use");
        assert_eq!(fin.status_code, 0, "{}", fin.status_message);
    }
    for i in 0..8u64 {
        assert_eq!(
            crc(&mut c.client, w.id, i * MIB, MIB).await,
            crc(&mut a.client, x.id, (i % 4) * MIB, MIB).await
        );
    }
    assert_eq!(pairings_with(&mut a.client, "fu-c").await, 1, "one pairing");
    assert_eq!(pairings_with(&mut c.client, "fu-a").await, 1, "one pairing");
    assert_lanes_drain(&mut a.client).await;

    // An old descriptor (no addresses) of a node never met: NOT_FOUND saying what to do.
    let d = daemons::start("fu-d", |_| {}).await;
    let mut dd = d.client.clone();
    let v = host_buffer(&mut dd, MIB, "v").await;
    let mut e = write_entry(&x, 0, &v, 0, MIB);
    e.remote_descriptor = bare(&v.descriptor);
    let s = write(&mut a.client, e, b"").await.unwrap_err();
    assert_eq!(s.code(), Code::NotFound, "{}", s.message());
    assert!(
        s.message().contains("entries[0].remote_descriptor")
            && s.message()
                .contains("`tcpxctl peer connect HOST:PORT` or the ConnectPeer call"),
        "{}",
        s.message()
    );
    // The same node through its full descriptor: connected on first use, in a batch entry.
    let r = a
        .client
        .write_batch(pb::WriteBatchRequest {
            entries: vec![write_entry(&x, 0, &y, 0, MIB), write_entry(&x, 0, &v, 0, MIB)],
            timeout_ms: 60_000,
            wait: true,
            ..Default::default()
        })
        .await
        .expect("batch naming a never-met node")
        .into_inner();
    assert_eq!(r.r#final.unwrap().status_code, 0);
    assert_eq!(
        crc(&mut dd, v.id, 0, 0).await,
        crc(&mut a.client, x.id, 0, MIB).await
    );

    for t in [a, b, c, d] {
        t.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_and_malformed_addresses_are_named() {
    tcpxd::logging::init("error");
    let mut a = daemons::start("fu-u", |_| {}).await;
    let x = host_buffer(&mut a.client, MIB, "x").await;
    let other = daemons::start("fu-o", |_| {}).await;
    let mut oc = other.client.clone();
    let y = host_buffer(&mut oc, MIB, "y").await;
    let head = bare(&y.descriptor);
    // A port nothing listens on.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let with = |addrs: &str| format!("{head}@{addrs}");
    let ac = a.client.clone();
    let try_write = |d: String| {
        let mut c = ac.clone();
        let mut e = write_entry(&x, 0, &y, 0, 4096);
        e.remote_descriptor = d;
        async move { write(&mut c, e, b"").await }
    };

    let s = try_write(with(&closed)).await.unwrap_err();
    assert_eq!(s.code(), Code::Unavailable, "{}", s.message());
    assert!(
        s.message().contains(&closed) && s.message().contains("entries[0].remote_descriptor"),
        "{}",
        s.message()
    );
    // Several addresses: each is tried, in order, until one answers as the node.
    let s = try_write(with(&format!("{closed},127.0.0.1:1")))
        .await
        .unwrap_err();
    assert_eq!(s.code(), Code::Unavailable);
    assert!(
        s.message().contains(&closed) && s.message().contains("127.0.0.1:1"),
        "{}",
        s.message()
    );
    // A dead address first, a good one second: the transfer goes through.
    let id = try_write(with(&format!("{closed},{}", other.peer_addr())))
        .await
        .expect("the second address answers");
    wait_ok(&mut a.client, id).await;
    assert!(peers_of(&mut a.client).await.iter().any(|p| p.node_id == "fu-o"));

    // An address answering as another node is not taken for this one (it pairs with that node,
    // which is harmless, and the transfer fails).
    let s = try_write(format!(
        "{}@{}",
        head.replacen("fu-o", "fu-elsewhere", 1),
        other.peer_addr()
    ))
    .await
    .unwrap_err();
    assert_eq!(s.code(), Code::Unavailable);
    assert!(s.message().contains("answers as node fu-o"), "{}", s.message());
    for (what, d, words) in [
        ("no port", with("10.0.0.2"), "peer address[0]"),
        ("port 0", with("10.0.0.2:0"), "port 0"),
        ("wildcard", with("0.0.0.0:50052"), "wildcard"),
        ("empty list", with(""), "peer address[0]"),
        ("empty entry", with("h:1,,h:2"), "peer address[1]"),
        ("bad host", with("a b:1"), "not a host name"),
        (
            "nine addresses",
            with(&(1..=9).map(|i| format!("h{i}:1")).collect::<Vec<_>>().join(",")),
            "at most 8",
        ),
        (
            "long host",
            with(&format!("{}:1", "a".repeat(300))),
            "over the limit",
        ),
        ("oversized", with(&vec!["h:1"; 700].join(",")), "limit of 2560"),
    ] {
        let s = try_write(d).await.unwrap_err();
        assert_eq!(s.code(), Code::InvalidArgument, "{what}: {}", s.message());
        assert!(
            s.message().starts_with("entries[0].remote_descriptor: ") && s.message().contains(words),
            "{what}: {}",
            s.message()
        );
    }
    a.stop().await;
    other.stop().await;
}

fn secret_file(tag: &str, content: &[u8]) -> PathBuf {
    let p = std::env::temp_dir().join(format!("tcpxd-fu-{tag}-{}", std::process::id()));
    std::fs::write(&p, content).unwrap();
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_use_is_authenticated_as_configured() {
    tcpxd::logging::init("error");
    let right = secret_file("right", b"cluster-secret-0123456789abcdef");
    let wrong = secret_file("wrong", b"another-secret-0123456789abcdef");
    let mut a = daemons::start("fu-s1", |x| x.peer_secret_file = Some(right.clone())).await;
    let mut b = daemons::start("fu-s2", |x| x.peer_secret_file = Some(right.clone())).await;
    let mut w = daemons::start("fu-sw", |x| x.peer_secret_file = Some(wrong.clone())).await;
    let mut n = daemons::start("fu-sn", |_| {}).await;
    let x = host_buffer(&mut a.client, MIB, "x").await;
    fill_seed(&mut a.client, x.id, 0, 0, 3).await;

    // A node proving another secret, or none: refused, nothing paired, no byte written.
    for (t, words) in [(&mut w, "cluster secret"), (&mut n, "without a cluster secret")] {
        let y = host_buffer(&mut t.client, MIB, "y").await;
        let s = write(&mut a.client, write_entry(&x, 0, &y, 0, MIB), b"")
            .await
            .unwrap_err();
        assert!(
            matches!(s.code(), Code::Unauthenticated | Code::FailedPrecondition),
            "{}",
            s.message()
        );
        assert!(s.message().contains(words), "{}", s.message());
        assert!(peers_of(&mut t.client).await.is_empty());
        assert_eq!(crc(&mut t.client, y.id, 0, 0).await, {
            let z = host_buffer(&mut t.client, MIB, "zeros").await;
            crc(&mut t.client, z.id, 0, 0).await
        });
    }
    assert!(peers_of(&mut a.client).await.is_empty());
    // The same secret: the descriptor alone pairs them.
    let y = host_buffer(&mut b.client, MIB, "y").await;
    let id = write(&mut a.client, write_entry(&x, 0, &y, 0, MIB), b"")
        .await
        .expect("the right secret pairs on first use");
    wait_ok(&mut a.client, id).await;
    assert_eq!(
        crc(&mut b.client, y.id, 0, 0).await,
        crc(&mut a.client, x.id, 0, 0).await
    );
    for t in [a, b, w, n] {
        t.stop().await;
    }
    std::fs::remove_file(right).ok();
    std::fs::remove_file(wrong).ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advertised_addresses_come_from_the_configuration() {
    tcpxd::logging::init("error");
    let mut a = daemons::start("fu-adv", |x| {
        x.peer_advertise = vec!["node-adv.example:50052".into(), "10.1.2.3:50052".into()]
    })
    .await;
    let n = describe(&mut a.client).await;
    assert_eq!(n.peer_addresses, ["node-adv.example:50052", "10.1.2.3:50052"]);
    let b = host_buffer(&mut a.client, 4096, "b").await;
    assert!(
        b.descriptor.ends_with("@node-adv.example:50052,10.1.2.3:50052"),
        "{}",
        b.descriptor
    );
    assert_eq!(
        a.daemon.peer_addresses,
        ["node-adv.example:50052", "10.1.2.3:50052"]
    );
    // tcpxctl describe shows the same (JSON and text).
    let endpoint = format!("unix:{}", a.daemon.api_socket.display());
    let run = |args: Vec<String>| {
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(tcpxd_testkit::workspace_bin("tcpxctl"))
                .args(args)
                .output()
                .expect("tcpxctl runs")
        })
    };
    let out = run(vec![
        "--endpoint".into(),
        endpoint.clone(),
        "--json".into(),
        "describe".into(),
    ])
    .await
    .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["node_id"], "fu-adv");
    assert_eq!(
        v["peer_addresses"],
        serde_json::json!(["node-adv.example:50052", "10.1.2.3:50052"])
    );
    assert_eq!(v["plugin_path"], daemons::described_plugin_path());
    assert_eq!(v["local_session"], "TCPXD/1");
    assert!(v["devices"].as_array().is_some_and(|d| !d.is_empty()), "{v}");
    let out = run(vec!["--endpoint".into(), endpoint, "describe".into()])
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("peer addresses  node-adv.example:50052, 10.1.2.3:50052"),
        "{text}"
    );
    a.stop().await;
}

/// Pairing with one node never waits on another node's handshake: an address that accepts TCP
/// connections and then says nothing (a hung daemon, a wrong port) holds up only the callers that
/// named it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_address_holds_up_no_other_pairing() {
    tcpxd::logging::init("error");
    let mut a = daemons::start("hung-a", |_| {}).await;
    let b = daemons::start("hung-b", |_| {}).await;

    // Accepts and holds every connection, answering nothing.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            held.push(s);
        }
    });
    let mut stuck = a.client.clone();
    let hung = tokio::spawn(async move {
        stuck
            .connect_peer(pb::ConnectPeerRequest { address: silent_addr })
            .await
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(!hung.is_finished(), "the silent address answered");

    let peer = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        a.client.connect_peer(pb::ConnectPeerRequest {
            address: b.peer_addr(),
        }),
    )
    .await
    .expect("pairing with b waited on the hung address")
    .expect("connect b")
    .into_inner();
    assert_eq!(peer.node_id, "hung-b");
    hung.abort();
    holder.abort();
}

/// Mistakes on this node's side are answered before any pairing is tried (issue #40 point 5): a
/// WRITE or READ naming a buffer this node does not have, or a range past its end, to a node that
/// cannot be reached, is refused for the local field at once, and nothing is dialled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_mistakes_are_answered_before_pairing() {
    tcpxd::logging::init("error");
    let mut a = daemons::start("fu-local", |_| {}).await;
    let x = host_buffer(&mut a.client, MIB, "x").await;
    // A node nobody runs, at an address where nothing listens: dialling it could only fail.
    let nowhere = format!("tcpxd1:fu-nowhere:1:{MIB}:{}@127.0.0.1:1", "ab".repeat(16));
    let entry = |local_buffer_id, local_offset| pb::WriteEntry {
        local_buffer_id,
        local_offset,
        remote_descriptor: nowhere.clone(),
        remote_offset: 0,
        length: MIB,
    };
    let client = a.client.clone();
    let write = |e: pb::WriteEntry| {
        let mut c = client.clone();
        async move {
            c.write(pb::WriteRequest {
                entry: Some(e),
                wait: true,
                timeout_ms: 30_000,
                ..Default::default()
            })
            .await
            .expect_err("refused")
        }
    };
    let s = write(entry(9, 0)).await;
    assert_eq!(s.code(), Code::NotFound, "{}", s.message());
    assert!(
        s.message()
            .starts_with("entries[0].local_buffer_id: buffer 9 does not exist"),
        "{}",
        s.message()
    );
    let s = write(entry(x.id, 4096)).await;
    assert_eq!(s.code(), Code::InvalidArgument, "{}", s.message());
    assert!(
        s.message().starts_with("entries[0].local_offset: "),
        "{}",
        s.message()
    );
    let s = a
        .client
        .read(pb::ReadRequest {
            entry: Some(pb::ReadEntry {
                remote_descriptor: nowhere.clone(),
                local_buffer_id: 9,
                length: MIB,
                ..Default::default()
            }),
            wait: true,
            timeout_ms: 30_000,
        })
        .await
        .expect_err("refused");
    assert_eq!(s.code(), Code::NotFound, "{}", s.message());
    assert!(
        s.message().starts_with("entries[0].local_buffer_id: "),
        "{}",
        s.message()
    );
    assert!(peers_of(&mut a.client).await.is_empty(), "nothing was dialled");
    // The same entry with a good local side does dial, and fails for the remote.
    let s = write(entry(x.id, 0)).await;
    assert_eq!(s.code(), Code::Unavailable, "{}", s.message());
    a.stop().await;
}
