//! Heartbeats on the control stream: an idle pairing stays up well past the silence bound, and a
//! peer whose control stream goes silent is failed, with a message that says so.
//!
//! A pairing switched to its direct control connection whose control stream ends while that
//! connection stays open is failed after the stream-end grace (5 s), by an otherwise idle
//! poller: the park's timeout counts that grace (poller/park.rs, "Why no timer is missed").
//!
//! No sleep decides anything here: a stand-in peer (a plain gRPC client of b's peer service)
//! answers each of b's heartbeats with one of its own, and the test waits until b has sent
//! enough of them that two silence bounds have passed on b's own clock (b sends one only after
//! `heartbeat_interval_ms` of quiet). The bound is 20 intervals, so only a stall of the whole
//! process close to a second could fail a live pairing.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::common::daemons::{self, *};
use tcpxd::api::proto::peer as peer_pb;
use tcpxd::api::proto::peer::peer_message::Body;
use tcpxd::api::proto::peer::tcpxd_peer_client::TcpxdPeerClient;
use tcpxd::api::proto::v1 as pb;

const INTERVAL_MS: u64 = 50;
const TIMEOUT_MS: u64 = 1000;

fn fast_heartbeats(dir_tag: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("tcpxd-hb-{dir_tag}-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        format!("[peer]\nheartbeat_interval_ms = {INTERVAL_MS}\nheartbeat_timeout_ms = {TIMEOUT_MS}\n"),
    )
    .unwrap();
    path
}

fn heartbeat(seq: u64) -> peer_pb::PeerMessage {
    peer_pb::PeerMessage {
        body: Some(Body::Heartbeat(peer_pb::Heartbeat { seq })),
    }
}

async fn peer_state(c: &mut Client, node: &str) -> pb::Peer {
    c.list_peers(pb::ListPeersRequest {})
        .await
        .unwrap()
        .into_inner()
        .peers
        .into_iter()
        .find(|p| p.node_id == node)
        .unwrap_or_else(|| panic!("{node} is not a peer"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_pairings_stay_up_and_silent_peers_fail() {
    tcpxd::logging::init("error");
    let cfg_a = fast_heartbeats("a");
    let cfg_b = fast_heartbeats("b");
    let mut a = daemons::start("hb-a", |args| args.config = Some(cfg_a.clone())).await;
    let mut b = daemons::start("hb-b", |args| args.config = Some(cfg_b.clone())).await;
    connect(&mut a, &b).await;

    // A stand-in peer that says Hello, then answers each of b's heartbeats until muted.
    let mut fake = TcpxdPeerClient::connect(format!("http://{}", b.peer_addr()))
        .await
        .unwrap();
    let resp = fake
        .handshake(peer_pb::HandshakeRequest {
            protocol_version: tcpxd::peers::PROTOCOL_VERSION,
            node_id: "hb-silent".into(),
            lanes: vec![peer_pb::LaneHandle {
                lane: 0,
                device: 0,
                handle: Vec::new(),
            }],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let hello = peer_pb::PeerMessage {
        body: Some(Body::Hello(peer_pb::Hello {
            session_id: resp.session_id,
            node_id: "hb-silent".into(),
            proof: Vec::new(),
        })),
    };
    let (to_b, rx) = tokio::sync::mpsc::channel::<peer_pb::PeerMessage>(16);
    to_b.send(hello).await.unwrap();
    let mut from_b = fake
        .control(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let (seen_tx, mut seen) = tokio::sync::watch::channel(0u64);
    let muted = Arc::new(AtomicBool::new(false));
    let mute = muted.clone();
    let echo = tokio::spawn(async move {
        while let Ok(Some(m)) = from_b.message().await {
            if let Some(Body::Heartbeat(h)) = m.body {
                seen_tx.send_replace(h.seq);
                if !mute.load(Ordering::Relaxed) && to_b.send(heartbeat(h.seq)).await.is_err() {
                    break;
                }
            }
        }
        // The stream stays open (silent) until b ends it.
        drop(to_b);
    });

    // Two silence bounds with no traffic but heartbeats, on b's clock.
    let enough = 2 * TIMEOUT_MS / INTERVAL_MS + 1;
    tokio::time::timeout(Duration::from_secs(60), seen.wait_for(|s| *s >= enough))
        .await
        .expect("b's heartbeats within 60 s")
        .unwrap();
    assert_eq!(
        peer_state(&mut a.client, "hb-b").await.state,
        pb::PeerState::Up as i32
    );
    assert_eq!(
        peer_state(&mut b.client, "hb-a").await.state,
        pb::PeerState::Up as i32
    );
    let fake_state = peer_state(&mut b.client, "hb-silent").await;
    assert_ne!(fake_state.state, pb::PeerState::Failed as i32, "{fake_state:?}");
    let x = host_buffer(&mut a.client, 1 << 20, "").await;
    let y = host_buffer(&mut b.client, 1 << 20, "").await;
    let id = write(&mut a.client, write_entry(&x, 0, &y, 0, 1 << 20), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;

    // The stand-in goes silent (its stream open): b fails it after the bound.
    muted.store(true, Ordering::Relaxed);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let silent = peer_state(&mut b.client, "hb-silent").await;
        if silent.state == pb::PeerState::Failed as i32 {
            assert!(
                silent.error.contains("no control message or heartbeat"),
                "{}",
                silent.error
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a silent peer was never failed: {silent:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The real pairing is unaffected.
    let id = write(&mut a.client, write_entry(&x, 0, &y, 0, 1 << 20), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    echo.abort();
    a.stop().await;
    b.stop().await;
    std::fs::remove_file(cfg_a).ok();
    std::fs::remove_file(cfg_b).ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_ended_beside_an_open_direct_connection_fails_after_the_grace_on_an_idle_poller() {
    use tcpxd::peers::direct::{ACK, PREFACE};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tcpxd::logging::init("error");
    let mut b = daemons::start("se-b", |_| {}).await;
    // A stand-in caller: handshake, control stream, direct connection, switch.
    let mut fake = TcpxdPeerClient::connect(format!("http://{}", b.peer_addr()))
        .await
        .unwrap();
    let resp = fake
        .handshake(peer_pb::HandshakeRequest {
            protocol_version: tcpxd::peers::PROTOCOL_VERSION,
            node_id: "se-caller".into(),
            lanes: vec![peer_pb::LaneHandle {
                lane: 0,
                device: 0,
                handle: Vec::new(),
            }],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!resp.direct_token.is_empty(), "b offers a direct connection");
    let (to_b, rx) = tokio::sync::mpsc::channel::<peer_pb::PeerMessage>(16);
    to_b.send(peer_pb::PeerMessage {
        body: Some(Body::Hello(peer_pb::Hello {
            session_id: resp.session_id,
            node_id: "se-caller".into(),
            proof: Vec::new(),
        })),
    })
    .await
    .unwrap();
    let _from_b = fake
        .control(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let mut direct = tokio::net::TcpStream::connect(b.peer_addr()).await.unwrap();
    direct.write_all(PREFACE).await.unwrap();
    direct.write_all(&resp.direct_token).await.unwrap();
    let mut ack = [0u8; 1];
    direct.read_exact(&mut ack).await.unwrap();
    assert_eq!(ack[0], ACK);
    // How it receives (rendezvous): the pairing is up, and quiet (no lane, no transfer), so b's
    // engine has nothing due for 300 s (`peer.pairing_idle_close_ms`); then the switch.
    for body in [
        Body::ReceiveMode(peer_pb::ReceiveMode {
            credits: 0,
            chunk_bytes: 512 << 10,
            eager_first_lane: 0,
            eager_max_bytes: 0,
        }),
        Body::DirectSwitch(peer_pb::DirectSwitch {}),
    ] {
        to_b.send(peer_pb::PeerMessage { body: Some(body) })
            .await
            .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while peer_state(&mut b.client, "se-caller").await.state != pb::PeerState::Up as i32 {
        assert!(Instant::now() < deadline, "the stand-in never came up");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Its control stream ends; the direct connection stays open. Nothing else asks b's poller
    // anything (ListPeers does not): only the park's timeout can fail the pairing, which closes
    // the direct connection.
    let ended = Instant::now();
    drop(to_b);
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), direct.read_to_end(&mut rest))
        .await
        .expect("b closes the direct connection within 30 s")
        .ok();
    let took = ended.elapsed();
    assert!(
        took >= Duration::from_secs(5),
        "closed after {took:?}, before the grace"
    );
    // (The registry hears of the failure just after the connection closed.)
    let deadline = Instant::now() + Duration::from_secs(10);
    let failed = loop {
        let p = peer_state(&mut b.client, "se-caller").await;
        if p.state == pb::PeerState::Failed as i32 {
            break p;
        }
        assert!(Instant::now() < deadline, "closed but not failed: {p:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(
        failed.error.contains("its direct control connection stayed open"),
        "{}",
        failed.error
    );
    b.stop().await;
}
