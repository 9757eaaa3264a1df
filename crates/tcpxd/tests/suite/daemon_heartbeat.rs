//! Heartbeats on the control stream: an idle pairing stays up well past the silence bound, and a
//! peer whose control stream goes silent is failed, with a message that says so.

use std::time::{Duration, Instant};

use crate::common::daemons::{self, *};
use tcpxd::api::proto::peer as peer_pb;
use tcpxd::api::proto::peer::tcpxd_peer_client::TcpxdPeerClient;
use tcpxd::api::proto::v1 as pb;

fn fast_heartbeats(dir_tag: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("tcpxd-hb-{dir_tag}-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        "[peer]\nheartbeat_interval_ms = 100\nheartbeat_timeout_ms = 600\n",
    )
    .unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_pairings_stay_up_and_silent_peers_fail() {
    tcpxd::logging::init("error");
    let cfg_a = fast_heartbeats("a");
    let cfg_b = fast_heartbeats("b");
    let mut a = daemons::start("hb-a", |args| args.config = Some(cfg_a.clone())).await;
    let mut b = daemons::start("hb-b", |args| args.config = Some(cfg_b.clone())).await;
    connect(&mut a, &b).await;
    // Six silence bounds with no traffic but heartbeats.
    tokio::time::sleep(Duration::from_millis(3600)).await;
    for c in [&mut a.client, &mut b.client] {
        let peers = c
            .list_peers(pb::ListPeersRequest {})
            .await
            .unwrap()
            .into_inner()
            .peers;
        assert_eq!(peers[0].state, pb::PeerState::Up as i32, "{peers:?}");
    }
    let x = host_buffer(&mut a.client, 1 << 20, "").await;
    let y = host_buffer(&mut b.client, 1 << 20, "").await;
    let id = write(&mut a.client, write_entry(&x, 0, &y, 0, 1 << 20), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;

    // A peer that says Hello and then nothing: b fails it after the bound.
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
        body: Some(peer_pb::peer_message::Body::Hello(peer_pb::Hello {
            session_id: resp.session_id,
            node_id: "hb-silent".into(),
            proof: Vec::new(),
        })),
    };
    let (keep_open, rx) = tokio::sync::mpsc::channel::<peer_pb::PeerMessage>(1);
    keep_open.send(hello).await.unwrap();
    let _stream = fake
        .control(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let peers = b
            .client
            .list_peers(pb::ListPeersRequest {})
            .await
            .unwrap()
            .into_inner()
            .peers;
        let silent = peers
            .iter()
            .find(|p| p.node_id == "hb-silent")
            .expect("registered");
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
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The real pairing is unaffected.
    let id = write(&mut a.client, write_entry(&x, 0, &y, 0, 1 << 20), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    drop(keep_open);
    a.stop().await;
    b.stop().await;
    std::fs::remove_file(cfg_a).ok();
    std::fs::remove_file(cfg_b).ok();
}
