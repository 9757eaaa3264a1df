//! One pairing per node, however it is dialled: through several of its addresses at once or one
//! after another, while transfers run on the pairing, and by two nodes dialling each other at
//! once (with first-use writes racing the dials). Every `ConnectPeer` answers the live pairing,
//! each side keeps exactly one, no transfer fails, and lanes and credits drain back to zero.
//!
//! The dials of a paired node go on while a write each way is held in flight by the emulation's
//! hold gate (`common::hold`, no payload byte written while it is closed), not by pacing: they
//! are in flight during every dial whatever the machine's load, and land byte-exact after.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::common::daemons::{self, *};
use crate::common::hold;
use tcpxd::api::proto::v1 as pb;

const MIB: u64 = 1 << 20;

/// Four spellings of one daemon's peer address (each its own dial lock).
fn aliases(d: &TestDaemon) -> Vec<String> {
    let port = d.daemon.peer_addr.port();
    vec![
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        format!("http://127.0.0.1:{port}"),
        format!("http://localhost:{port}"),
    ]
}

/// `ConnectPeer` to each address, all at once.
async fn connect_all(c: &Client, addresses: &[String]) -> Vec<Result<pb::Peer, tonic::Status>> {
    let calls: Vec<_> = addresses
        .iter()
        .map(|a| {
            let (mut c, address) = (c.clone(), a.clone());
            tokio::spawn(async move {
                c.connect_peer(pb::ConnectPeerRequest { address })
                    .await
                    .map(|r| r.into_inner())
            })
        })
        .collect();
    let mut out = Vec::new();
    for call in calls {
        out.push(call.await.expect("the call's task"));
    }
    out
}

/// Every call answered the one live pairing with `node`, the same for all.
fn all_answer_one_pairing(got: &[Result<pb::Peer, tonic::Status>], node: &str) -> pb::Peer {
    let peers: Vec<&pb::Peer> = got
        .iter()
        .map(|r| {
            r.as_ref()
                .unwrap_or_else(|s| panic!("a ConnectPeer failed: {s:?} (all: {got:?})"))
        })
        .collect();
    for p in &peers {
        assert_eq!(p.node_id, node, "{got:?}");
        assert_eq!(p.state, pb::PeerState::Up as i32, "{got:?}");
        assert_eq!(
            p.address, peers[0].address,
            "one pairing answered every call: {got:?}"
        );
    }
    peers[0].clone()
}

/// The daemon has one pairing with `node`, up: one peer listed, one live pairing in its stats
/// (and no other at all, unless `superseded` allows one that another replaced while setting up).
/// Each side sees its own lanes come up: the far side of a `ConnectPeer` that returned may still
/// be connecting its last ones, so this waits for UP (failing after 10 s).
async fn one_pairing(c: &mut Client, node: &str, superseded: usize) -> pb::Peer {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let listed = loop {
        let listed = c
            .list_peers(pb::ListPeersRequest {})
            .await
            .unwrap()
            .into_inner()
            .peers;
        assert_eq!(listed.len(), 1, "{listed:?}");
        assert_eq!(listed[0].node_id, node);
        assert_ne!(listed[0].state, pb::PeerState::Failed as i32, "{listed:?}");
        if listed[0].state == pb::PeerState::Up as i32 {
            break listed;
        }
        assert!(std::time::Instant::now() < deadline, "never up: {listed:?}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    let stats = c.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    let states: Vec<i32> = stats.peers.iter().map(|p| p.state).collect();
    assert!(stats.peers.iter().all(|p| p.node_id == node), "{states:?}");
    let live = states
        .iter()
        .filter(|&&s| s != pb::PeerState::Failed as i32)
        .count();
    assert_eq!(live, 1, "one live pairing in the poller: {states:?}");
    assert!(
        states.contains(&(pb::PeerState::Up as i32)),
        "the live one is up: {states:?}"
    );
    assert!(
        states.len() <= 1 + superseded,
        "pairings made with {node}: {states:?}"
    );
    listed[0].clone()
}

/// A byte-exact write each way over the pairing, then both sides' lanes drain.
async fn both_ways(a: &mut TestDaemon, b: &mut TestDaemon, seed: u64) {
    let x = host_buffer(&mut a.client, 4 * MIB, "x").await;
    let y = host_buffer(&mut b.client, 4 * MIB, "y").await;
    fill_seed(&mut a.client, x.id, 0, 0, seed).await;
    let id = write(&mut a.client, write_entry(&x, 0, &y, 0, 4 * MIB), b"")
        .await
        .expect("a → b starts");
    wait_ok(&mut a.client, id).await;
    assert_eq!(
        crc(&mut a.client, x.id, 0, 0).await,
        crc(&mut b.client, y.id, 0, 0).await
    );
    fill_seed(&mut b.client, y.id, 0, 0, seed + 1).await;
    let id = write(&mut b.client, write_entry(&y, 0, &x, 0, 4 * MIB), b"")
        .await
        .expect("b → a starts");
    wait_ok(&mut b.client, id).await;
    assert_eq!(
        crc(&mut a.client, x.id, 0, 0).await,
        crc(&mut b.client, y.id, 0, 0).await
    );
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_node_dialled_through_four_addresses_at_once_pairs_once() {
    tcpxd::logging::init("warn");
    // Each round a fresh pair: the four handshakes race differently every time (before the
    // per-node settling most rounds ended with calls failing "the peer connected again" or
    // "reports an existing pairing this daemon does not have", and pairings left behind).
    for round in 0..6 {
        let mut a = daemons::start(&format!("four{round}-a"), |_| {}).await;
        let mut b = daemons::start(&format!("four{round}-b"), |_| {}).await;
        let got = connect_all(&a.client, &aliases(&b)).await;
        all_answer_one_pairing(&got, &b.daemon.node_id);
        // Exactly one pairing was ever made on each side: the callee answered every handshake
        // after the first "already paired", and the caller joined.
        one_pairing(&mut a.client, &b.daemon.node_id, 0).await;
        one_pairing(&mut b.client, &a.daemon.node_id, 0).await;
        both_ways(&mut a, &mut b, round).await;
        a.stop().await;
        b.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dialling_a_paired_node_again_by_any_address_keeps_its_transfers_running() {
    // Closed, the gate lets no payload byte through: a write posted then waits, unfinished.
    hold::gate_on_with_budget(0);
    tcpxd::logging::init("warn");
    let (mut a, mut b) = (
        daemons::start("again-a", |_| {}).await,
        daemons::start("again-b", |_| {}).await,
    );
    let (to_b, to_a) = (aliases(&b), aliases(&a));
    let first = a
        .client
        .connect_peer(pb::ConnectPeerRequest {
            address: to_b[1].clone(),
        })
        .await
        .expect("the first pairing")
        .into_inner();
    let b_side = one_pairing(&mut b.client, "again-a", 0).await;

    // Writes both ways, one after another, for as long as the dials below go on.
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let mut traffic = Vec::new();
    for (from, to) in [(&a, &b), (&b, &a)] {
        let (mut fc, mut tc) = (from.client.clone(), to.client.clone());
        let (stop, rounds) = (stop.clone(), rounds.clone());
        let src = host_buffer(&mut fc, 4 * MIB, "src").await;
        let dst = host_buffer(&mut tc, 4 * MIB, "dst").await;
        traffic.push(tokio::spawn(async move {
            let mut seed = 0;
            while !stop.load(Ordering::Relaxed) {
                seed += 1;
                fill_seed(&mut fc, src.id, 0, 0, seed).await;
                let id = write(&mut fc, write_entry(&src, 0, &dst, 0, 4 * MIB), b"")
                    .await
                    .expect("a write starts");
                wait_ok(&mut fc, id).await;
                assert_eq!(
                    crc(&mut fc, src.id, 0, 0).await,
                    crc(&mut tc, dst.id, 0, 0).await,
                    "round {seed}"
                );
                rounds.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    // Wait for the traffic to be moving before dialling.
    while rounds.load(Ordering::Relaxed) < 2 {
        tokio::task::yield_now().await;
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    // Then a write each way held in flight for the dials (the traffic's next writes wait too).
    let mut held = Vec::new();
    for (from, to) in [(&a, &b), (&b, &a)] {
        let (mut fc, mut tc) = (from.client.clone(), to.client.clone());
        let src = host_buffer(&mut fc, 4 * MIB, "held-src").await;
        let dst = host_buffer(&mut tc, 4 * MIB, "held-dst").await;
        fill_seed(&mut fc, src.id, 0, 0, 99).await;
        held.push((fc, tc, src, dst));
    }
    hold::close_gate();
    let mut held_ids = Vec::new();
    for (fc, _, src, dst) in &mut held {
        let id = write(fc, write_entry(src, 0, dst, 0, 4 * MIB), b"")
            .await
            .expect("a held write starts");
        held_ids.push(id);
    }

    // One after another, then all at once, from each side: every call answers the live pairing.
    for address in &to_b {
        let again = a
            .client
            .connect_peer(pb::ConnectPeerRequest {
                address: address.clone(),
            })
            .await
            .unwrap_or_else(|s| panic!("a → {address}: {s:?}"))
            .into_inner();
        assert_eq!(again, first, "a → {address}");
    }
    for address in &to_a {
        let again = b
            .client
            .connect_peer(pb::ConnectPeerRequest {
                address: address.clone(),
            })
            .await
            .unwrap_or_else(|s| panic!("b → {address}: {s:?}"))
            .into_inner();
        assert_eq!(again, b_side, "b → {address}");
    }
    let (from_a, from_b) = tokio::join!(connect_all(&a.client, &to_b), connect_all(&b.client, &to_a));
    assert_eq!(all_answer_one_pairing(&from_a, "again-b"), first);
    assert_eq!(all_answer_one_pairing(&from_b, "again-a"), b_side);

    // The held writes were in flight all along; let them go: they land byte-exact. (Only the
    // emulation honours the hold gate: on another plugin, `TCPXD_TEST_PLUGIN`, they may have
    // ended already, and only their landing is checked.)
    let gate_holds = daemons::test_plugin_file().is_none();
    for ((fc, _, _, _), &id) in held.iter_mut().zip(&held_ids).filter(|_| gate_holds) {
        let now = fc
            .watch(pb::WatchRequest { transfer_id: id })
            .await
            .expect("watch")
            .into_inner()
            .message()
            .await
            .expect("watch stream")
            .expect("the transfer's state");
        assert_ne!(
            now.state,
            pb::TransferState::Finished as i32,
            "held write {id} finished before the gate opened: {now:?}"
        );
    }
    hold::open_gate();
    for ((fc, tc, src, dst), &id) in held.iter_mut().zip(&held_ids) {
        wait_ok(fc, id).await;
        assert_eq!(
            crc(fc, src.id, 0, 0).await,
            crc(tc, dst.id, 0, 0).await,
            "held write {id}"
        );
    }
    stop.store(true, Ordering::Relaxed);
    for t in traffic {
        t.await.expect("no write failed while the node was dialled again");
    }
    one_pairing(&mut a.client, "again-b", 0).await;
    one_pairing(&mut b.client, "again-a", 0).await;
    assert_lanes_drain(&mut a.client).await;
    assert_lanes_drain(&mut b.client).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_dialling_each_other_at_once_pair_once() {
    tcpxd::logging::init("warn");
    // Before the settling by node id, a round could end with both calls failing after the
    // 30 s connect timeout (each side used the pairing the other dialled and neither opened
    // its control stream), or with one side's pairing replaced under the other; and a write
    // that started on the pairing being replaced failed with it.
    for round in 0..6 {
        // Half the rounds `a` (whose calls go first) has the lower node id, half the higher.
        let (first, second) = (format!("cross{round}-a"), format!("cross{round}-b"));
        let (x, y) = if round % 2 == 0 {
            (first, second)
        } else {
            (second, first)
        };
        let mut a = daemons::start(&x, |_| {}).await;
        let mut b = daemons::start(&y, |_| {}).await;
        let (to_b, to_a) = (aliases(&b)[..2].to_vec(), aliases(&a)[..2].to_vec());
        // Writes started at the same moment, each side to the other: their descriptors carry
        // the peer addresses, so each write pairs on first use or waits for the pairing.
        let writes = |from: &TestDaemon, to: &TestDaemon| {
            let (mut fc, mut tc) = (from.client.clone(), to.client.clone());
            async move {
                let src = host_buffer(&mut fc, MIB, "src").await;
                let dst = host_buffer(&mut tc, MIB, "dst").await;
                fill_seed(&mut fc, src.id, 0, 0, 5).await;
                (fc, tc, src, dst)
            }
        };
        let (wa, wb) = tokio::join!(writes(&a, &b), writes(&b, &a));
        let send = |(mut fc, mut tc, src, dst): (Client, Client, pb::Buffer, pb::Buffer)| async move {
            let id = write(&mut fc, write_entry(&src, 0, &dst, 0, MIB), b"").await?;
            let end = wait(&mut fc, id).await;
            if end.status_code != 0 {
                return Err(tonic::Status::new(end.status_code.into(), end.status_message));
            }
            assert_eq!(crc(&mut fc, src.id, 0, 0).await, crc(&mut tc, dst.id, 0, 0).await);
            Ok(())
        };
        let (from_a, from_b, sent_a, sent_b) = tokio::join!(
            connect_all(&a.client, &to_b),
            connect_all(&b.client, &to_a),
            send(wa),
            send(wb)
        );
        sent_a.expect("a's write while the two dialled each other");
        sent_b.expect("b's write while the two dialled each other");
        all_answer_one_pairing(&from_a, &y);
        all_answer_one_pairing(&from_b, &x);
        // Both may have accepted the other's handshake before either answer came back: then
        // the lower node id's dial stays and the pairing the other dialled is failed unused.
        one_pairing(&mut a.client, &y, 1).await;
        one_pairing(&mut b.client, &x, 1).await;
        both_ways(&mut a, &mut b, round).await;
        a.stop().await;
        b.stop().await;
    }
}

/// A `ConnectPeer` its client cancels (as a Python agent's pairing ahead is, by gRPC, when its
/// remote agent is loaded again) does not cut the dial short: cut between the poller's making
/// the pairing and the control stream's opening, the caller's pairing stayed connecting for
/// good while the callee failed its side, and a WRITE to that node waited until its deadline
/// (python test_nixl_single.py under CPU load). Cancelled at 0 to 8 ms, on fresh pairs: each
/// WRITE afterwards lands, well within its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_peer_cancelled_by_its_client_leaves_no_pairing_half_made() {
    tcpxd::logging::init("warn");
    for round in 0..16u64 {
        let mut a = daemons::start(&format!("cut-{round}-a"), |_| {}).await;
        let mut b = daemons::start(&format!("cut-{round}-b"), |_| {}).await;
        let src = host_buffer(&mut a.client, MIB, "").await;
        let dst = host_buffer(&mut b.client, MIB, "").await;
        fill_seed(&mut a.client, src.id, 0, MIB, round).await;
        let mut c = a.client.clone();
        let addr = b.peer_addr();
        let dial = tokio::spawn(async move {
            let _ = c.connect_peer(pb::ConnectPeerRequest { address: addr }).await;
        });
        tokio::time::sleep(std::time::Duration::from_micros(round * 500)).await;
        dial.abort(); // the call's stream reset: the daemon drops its handler
        let _ = dial.await;
        let id = a
            .client
            .write(pb::WriteRequest {
                entry: Some(write_entry(&src, 0, &dst, 0, MIB)),
                timeout_ms: 20_000,
                ..Default::default()
            })
            .await
            .expect("write")
            .into_inner()
            .transfer_id;
        let e = wait(&mut a.client, id).await;
        assert_eq!(e.status_code, 0, "round {round}: {}", e.status_message);
        assert_eq!(
            crc(&mut a.client, src.id, 0, MIB).await,
            crc(&mut b.client, dst.id, 0, MIB).await,
            "round {round}"
        );
        a.stop().await;
        b.stop().await;
    }
}
