//! Hostile input on a direct control connection (`peers/direct.rs`): a wrong token is refused
//! and changes nothing; an oversized frame, bytes that are no message, a `Hello` on it and its
//! end each fail the pairing with the reason named; the daemon serves on.

use super::*;
use tcpxd::peers::direct::{ACK, PREFACE};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A fake peer's pairing with its control stream open (Hello and ReceiveMode sent) and the
/// direct token the daemon issued.
struct Paired {
    tx: mpsc::Sender<ppb::PeerMessage>,
    _rx: tonic::Streaming<ppb::PeerMessage>,
    token: Vec<u8>,
}

async fn pair_fake(addr: &str, node: &str) -> Paired {
    let mut raw = TcpxdPeerClient::connect(format!("http://{addr}")).await.unwrap();
    let req = ppb::HandshakeRequest {
        protocol_version: tcpxd::peers::PROTOCOL_VERSION,
        node_id: node.into(),
        lanes: vec![ppb::LaneHandle {
            lane: 0,
            device: 0,
            handle: Vec::new(),
        }],
        ..Default::default()
    };
    let resp = raw.handshake(req).await.expect("handshake").into_inner();
    assert_eq!(
        resp.direct_token.len(),
        16,
        "the daemon offers a direct connection"
    );
    let (tx, rx) = mpsc::channel(64);
    tx.send(msg(ppb::peer_message::Body::Hello(ppb::Hello {
        session_id: resp.session_id,
        node_id: node.into(),
        proof: Vec::new(),
    })))
    .await
    .unwrap();
    tx.send(msg(ppb::peer_message::Body::ReceiveMode(
        ppb::ReceiveMode::default(),
    )))
    .await
    .unwrap();
    let rx = raw
        .control(ReceiverStream::new(rx))
        .await
        .expect("control")
        .into_inner();
    Paired {
        tx,
        _rx: rx,
        token: resp.direct_token,
    }
}

/// Opens a direct connection presenting `token`; the daemon's first answer byte, `None` when it
/// closed the connection instead.
async fn open(addr: &str, token: &[u8]) -> (TcpStream, Option<u8>) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(PREFACE).await.unwrap();
    s.write_all(token).await.unwrap();
    let mut b = [0u8; 1];
    let got = tokio::time::timeout(Duration::from_secs(20), s.read(&mut b))
        .await
        .expect("an answer or a close within 20 s");
    match got {
        Ok(1) => (s, Some(b[0])),
        _ => (s, None),
    }
}

async fn peer_stats(c: &mut Client, node: &str) -> Option<pb::PeerStats> {
    c.get_stats(pb::GetStatsRequest {})
        .await
        .unwrap()
        .into_inner()
        .peers
        .into_iter()
        .find(|p| p.node_id == node)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_direct_connection_with_a_wrong_token_is_refused_and_changes_nothing() {
    tcpxd::logging::init("error");
    let cfg = patient_config("direct-token");
    let mut b = daemons::start("host-b", |a| a.config = Some(cfg.clone())).await;
    let addr = b.peer_addr();
    let fake = pair_fake(&addr, "evil-token").await;
    for wrong in [vec![0u8; 16], fake.token.iter().map(|x| x ^ 1).collect()] {
        let (_, answer) = open(&addr, &wrong).await;
        assert_eq!(answer, None, "a wrong token is refused by closing the connection");
    }
    // Too short, then closed: refused alike.
    let mut s = TcpStream::connect(&addr).await.unwrap();
    s.write_all(PREFACE).await.unwrap();
    s.write_all(&[1, 2, 3]).await.unwrap();
    drop(s);
    let p = peer_stats(&mut b.client, "evil-token")
        .await
        .expect("pairing kept");
    assert_eq!(p.state, pb::PeerState::Up as i32, "{p:?}");
    // The right token still opens it, once.
    let (_keep, answer) = open(&addr, &fake.token).await;
    assert_eq!(answer, Some(ACK));
    let (_, again) = open(&addr, &fake.token).await;
    assert_eq!(again, None, "a token is good once");
    drop(fake.tx);
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_on_a_direct_connection_fails_its_pairing_naming_why() {
    tcpxd::logging::init("error");
    let cfg = patient_config("direct-bad");
    let mut b = daemons::start("host-b", |a| a.config = Some(cfg.clone())).await;
    let addr = b.peer_addr();
    let hello = {
        let m = msg(ppb::peer_message::Body::Hello(ppb::Hello::default()));
        let body = prost::Message::encode_to_vec(&m);
        let mut f = (body.len() as u32).to_le_bytes().to_vec();
        f.extend_from_slice(&body);
        f
    };
    let cases: [(&str, Vec<u8>, &str); 4] = [
        (
            "evil-big",
            u32::MAX.to_le_bytes().to_vec(),
            "a frame of 4294967295 bytes",
        ),
        (
            "evil-junk",
            vec![3, 0, 0, 0, 0xff, 0xff, 0xff],
            "not a tcpxd.peer.v1 PeerMessage",
        ),
        ("evil-hello", hello, "a second Hello"),
        ("evil-gone", Vec::new(), "closed by the peer"),
    ];
    let mut keep = Vec::new();
    for (node, bytes, words) in cases {
        let fake = pair_fake(&addr, node).await;
        let (mut s, answer) = open(&addr, &fake.token).await;
        assert_eq!(answer, Some(ACK), "{node}");
        fake.tx
            .send(msg(ppb::peer_message::Body::DirectSwitch(ppb::DirectSwitch {})))
            .await
            .unwrap();
        if bytes.is_empty() {
            drop(s);
        } else {
            s.write_all(&bytes).await.unwrap();
            keep.push(s);
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let p = peer_stats(&mut b.client, node).await.expect("pairing listed");
            if p.state == pb::PeerState::Failed as i32 {
                assert!(
                    p.error.contains("direct control connection"),
                    "{node}: {}",
                    p.error
                );
                assert!(
                    p.error.contains(words),
                    "{node}: {:?} should say {words:?}",
                    p.error
                );
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{node}: pairing never failed: {p:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        drop(fake.tx);
    }
    // A DirectSwitch with no direct connection: the pairing fails, naming it.
    let fake = pair_fake(&addr, "evil-switch").await;
    fake.tx
        .send(msg(ppb::peer_message::Body::DirectSwitch(ppb::DirectSwitch {})))
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let p = peer_stats(&mut b.client, "evil-switch").await.expect("listed");
        if p.state == pb::PeerState::Failed as i32 {
            assert!(p.error.contains("does not have"), "{}", p.error);
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never failed: {p:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The daemon serves on.
    let buf = host_buffer(&mut b.client, MIB, "after").await;
    fill_seed(&mut b.client, buf.id, 0, 0, 5).await;
    b.stop().await;
}
