//! Authentication: peers prove the cluster secret (wrong secret, no secret, replayed or forged
//! handshakes are refused and open nothing; the right secret pairs), the API's TCP listener
//! requires its bearer token, and forged or revoked access keys never change a byte.

use std::path::PathBuf;

use crate::common::daemons::{self, *};
use tcpxd::api::proto::peer as peer_pb;
use tcpxd::api::proto::peer::tcpxd_peer_client::TcpxdPeerClient;
use tcpxd::api::proto::v1 as pb;
use tcpxd::api::proto::v1::tcpxd_client::TcpxdClient;
use tcpxd::auth::{self, ClusterSecret, ProofOf};
use tonic::Code;

const SECRET: &[u8] = b"cluster-secret-0123456789abcdef";
const MIB: u64 = 1 << 20;

fn secret_file(tag: &str, content: &[u8]) -> PathBuf {
    let p = std::env::temp_dir().join(format!("tcpxd-auth-{tag}-{}", std::process::id()));
    std::fs::write(&p, content).unwrap();
    p
}

async fn with_secret(node: &str, file: Option<PathBuf>) -> TestDaemon {
    daemons::start(node, |a| a.peer_secret_file = file).await
}

async fn peer_count(c: &mut Client) -> usize {
    c.list_peers(pb::ListPeersRequest {})
        .await
        .unwrap()
        .into_inner()
        .peers
        .len()
}

async fn try_connect(a: &mut TestDaemon, b: &TestDaemon) -> Result<pb::Peer, tonic::Status> {
    a.client
        .connect_peer(pb::ConnectPeerRequest {
            address: b.peer_addr(),
        })
        .await
        .map(|r| r.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_peers_proving_the_cluster_secret_pair() {
    tcpxd::logging::init("error");
    let right = secret_file("right", SECRET);
    let wrong = secret_file("wrong", b"another-secret-0123456789abcdef");
    // Removed however the test ends.
    let _files = [right.clone(), wrong.clone()].map(daemons::ScratchDir::new);
    let mut a = with_secret("auth-a", Some(right.clone())).await;
    let mut b = with_secret("auth-b", Some(right.clone())).await;
    let mut w = with_secret("auth-w", Some(wrong.clone())).await;
    let mut n = with_secret("auth-n", None).await;

    // Wrong secret, either direction: refused, nothing paired on either side.
    let e = try_connect(&mut a, &w).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{}", e.message());
    let e = try_connect(&mut w, &a).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{}", e.message());
    assert!(e.message().contains("cluster secret"), "{}", e.message());
    // No secret against a secret, either direction: refused.
    let e = try_connect(&mut n, &a).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{}", e.message());
    assert!(e.message().contains("peer.secret_file"), "{}", e.message());
    let e = try_connect(&mut a, &n).await.unwrap_err();
    assert!(
        e.message().contains("without a cluster secret"),
        "{}",
        e.message()
    );
    for c in [&mut a.client, &mut w.client, &mut n.client] {
        assert_eq!(peer_count(c).await, 0, "an unauthenticated peer got nothing");
    }

    // The right secret pairs and moves bytes.
    try_connect(&mut a, &b).await.expect("the right secret pairs");
    let x = host_buffer(&mut a.client, MIB, "x").await;
    let y = host_buffer(&mut b.client, MIB, "y").await;
    fill_seed(&mut a.client, x.id, 0, 0, 5).await;
    let id = write(&mut a.client, write_entry(&x, 0, &y, 0, MIB), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    assert_eq!(
        crc(&mut b.client, y.id, 0, 0).await,
        crc(&mut a.client, x.id, 0, 0).await
    );

    // A raw client that knows the secret: one handshake works once; replayed, it is refused.
    let secret = ClusterSecret::from_bytes(SECRET);
    let mut raw = TcpxdPeerClient::connect(format!("http://{}", b.peer_addr()))
        .await
        .unwrap();
    let challenge = raw
        .challenge(peer_pb::ChallengeRequest::default())
        .await
        .unwrap()
        .into_inner()
        .server_nonce;
    let client_nonce = auth::nonce();
    let mut req = peer_pb::HandshakeRequest {
        protocol_version: tcpxd::peers::PROTOCOL_VERSION,
        node_id: "auth-raw".into(),
        lanes: vec![peer_pb::LaneHandle {
            lane: 0,
            device: 0,
            // Peer protocol 6: handles come on the control stream at a lane's first use.
            handle: Vec::new(),
        }],
        server_nonce: challenge.clone(),
        client_nonce: client_nonce.to_vec(),
        ..Default::default()
    };
    req.proof = secret.prove(
        ProofOf::Handshake,
        &auth::handshake_fields(&challenge, &client_nonce, &req),
    );
    let resp = raw
        .handshake(req.clone())
        .await
        .expect("a proven handshake")
        .into_inner();
    assert!(
        secret.check(
            ProofOf::Accept,
            &auth::accept_fields(&challenge, &client_nonce, &resp),
            &resp.proof
        ),
        "the callee proves the secret back"
    );
    let e = raw.handshake(req.clone()).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    assert!(e.message().contains("replayed"), "{}", e.message());

    // A Hello with a bad proof does not bind the control stream.
    let hello = peer_pb::PeerMessage {
        body: Some(peer_pb::peer_message::Body::Hello(peer_pb::Hello {
            session_id: resp.session_id,
            node_id: "auth-raw".into(),
            proof: vec![0; 32],
        })),
    };
    let e = raw
        .control(tokio_stream::iter(vec![hello]))
        .await
        .expect_err("a Hello without the proof is refused");
    assert_eq!(e.code(), Code::Unauthenticated, "{}", e.message());

    // A fresh challenge with a proof under the wrong secret; a made-up challenge; none at all.
    let forged = ClusterSecret::from_bytes(b"another-secret-0123456789abcdef");
    let challenge = raw
        .challenge(peer_pb::ChallengeRequest::default())
        .await
        .unwrap()
        .into_inner()
        .server_nonce;
    let mut bad = req.clone();
    bad.server_nonce = challenge.clone();
    bad.proof = forged.prove(
        ProofOf::Handshake,
        &auth::handshake_fields(&challenge, &client_nonce, &bad),
    );
    let e = raw.handshake(bad.clone()).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    assert!(e.message().contains("does not prove"), "{}", e.message());
    let made_up = auth::nonce();
    bad.server_nonce = made_up.to_vec();
    bad.proof = secret.prove(
        ProofOf::Handshake,
        &auth::handshake_fields(&made_up, &client_nonce, &bad),
    );
    let e = raw.handshake(bad.clone()).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    bad.server_nonce.clear();
    bad.proof.clear();
    bad.client_nonce.clear();
    let e = raw.handshake(bad).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    // b knows a and, for the proven raw handshake only, auth-raw (failed, its Hello refused).
    let peers = b
        .client
        .list_peers(pb::ListPeersRequest {})
        .await
        .unwrap()
        .into_inner()
        .peers;
    assert!(peers.len() <= 2, "{peers:?}");
    assert!(
        peers
            .iter()
            .all(|p| p.node_id == "auth-a" || p.node_id == "auth-raw"),
        "{peers:?}"
    );

    for d in [a, b, w, n] {
        d.stop().await;
    }
    std::fs::remove_file(right).ok();
    std::fs::remove_file(wrong).ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tcp_api_requires_its_bearer_token() {
    tcpxd::logging::init("error");
    let d = daemons::start("auth-tok", |_| {}).await;
    let url = format!("http://{}", d.daemon.api_tcp.unwrap());
    let channel = tonic::transport::Channel::from_shared(url)
        .unwrap()
        .connect()
        .await
        .unwrap();

    let mut bare = TcpxdClient::new(channel.clone());
    let e = bare.list_buffers(pb::ListBuffersRequest {}).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{}", e.message());
    assert!(e.message().contains("bearer token"), "{}", e.message());

    for wrong in [
        "Bearer test-token-0123456789abcdeX",
        "Bearer ",
        "test-token-0123456789abcdef",
        "Bearer test-token-0123456789abcdef0",
    ] {
        let v: tonic::metadata::MetadataValue<_> = wrong.parse().unwrap();
        let mut c = TcpxdClient::with_interceptor(channel.clone(), move |mut r: tonic::Request<()>| {
            r.metadata_mut().insert("authorization", v.clone());
            Ok(r)
        });
        let e = c
            .register_buffer(pb::RegisterBufferRequest {
                reattach_id: Default::default(),
                reattach_key: Default::default(),
                source: Some(pb::register_buffer_request::Source::Host(pb::HostAllocation {
                    size: 4096,
                })),
                label: String::new(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::Unauthenticated, "{wrong:?}: {}", e.message());
    }
    // Health and reflection sit behind the same gate.
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let e = health
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);

    let right: tonic::metadata::MetadataValue<_> = format!("Bearer {TEST_TOKEN}").parse().unwrap();
    let mut good = TcpxdClient::with_interceptor(channel, move |mut r: tonic::Request<()>| {
        r.metadata_mut().insert("authorization", right.clone());
        Ok(r)
    });
    let list = good
        .list_buffers(pb::ListBuffersRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(list.buffers.is_empty(), "the refused register created nothing");

    // tcpxctl's connect reads the token from TCPXD_API_TOKEN_FILE; checked through the config
    // rule instead of the process environment: a TCP listener without a token is refused.
    let args = tcpxd::config::DaemonArgs {
        node_id: Some("auth-cfg".into()),
        api_tcp: Some("127.0.0.1:0".parse().unwrap()),
        ..Default::default()
    };
    let e = tcpxd::config::Config::resolve(&args, &|_| None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("api.token_file"), "{e}");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_and_revoked_access_keys_never_change_a_byte() {
    tcpxd::logging::init("error");
    let mut a = daemons::start("key-a", |_| {}).await;
    let mut b = daemons::start("key-b", |_| {}).await;
    connect(&mut a, &b).await;
    let src = host_buffer(&mut a.client, MIB, "src").await;
    let dst = host_buffer(&mut b.client, MIB, "dst").await;
    fill_seed(&mut a.client, src.id, 0, 0, 1).await;
    fill_seed(&mut b.client, dst.id, 0, 0, 2).await;
    let before = crc(&mut b.client, dst.id, 0, 0).await;

    // Every single-bit flip of the key's first and last hex digit, and an all-zero key.
    let (head, key) = dst
        .descriptor
        .split('@')
        .next()
        .unwrap()
        .rsplit_once(':')
        .unwrap();
    let mut forged_keys = vec!["0".repeat(32)];
    for pos in [0, 31] {
        for bit in [1u8, 2, 4, 8] {
            let mut k: Vec<u8> = key.bytes().collect();
            let v = u8::from_str_radix(std::str::from_utf8(&k[pos..=pos]).unwrap(), 16).unwrap() ^ bit;
            k[pos] = format!("{v:x}").as_bytes()[0];
            forged_keys.push(String::from_utf8(k).unwrap());
        }
    }
    for k in &forged_keys {
        let mut e = write_entry(&src, 0, &dst, 0, MIB);
        e.remote_descriptor = format!("{head}:{k}");
        let id = write(&mut a.client, e, b"").await.expect("started locally");
        let end = wait(&mut a.client, id).await;
        assert_eq!(
            end.status_code,
            Code::PermissionDenied as i32,
            "{}",
            end.status_message
        );
        assert!(
            !end.status_message.contains(k.as_str()),
            "the key is never echoed"
        );
    }
    assert_eq!(crc(&mut b.client, dst.id, 0, 0).await, before);

    // Re-keyed: the old descriptor (which was right until now) is refused; the new one works.
    let rekeyed = b
        .client
        .rekey_buffer(pb::RekeyBufferRequest { buffer_id: dst.id })
        .await
        .unwrap()
        .into_inner();
    assert_ne!(rekeyed.descriptor, dst.descriptor);
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, MIB), b"")
        .await
        .expect("started locally");
    let end = wait(&mut a.client, id).await;
    assert_eq!(
        end.status_code,
        Code::PermissionDenied as i32,
        "{}",
        end.status_message
    );
    assert_eq!(
        crc(&mut b.client, dst.id, 0, 0).await,
        before,
        "a revoked key changed bytes"
    );
    let id = write(&mut a.client, write_entry(&src, 0, &rekeyed, 0, MIB), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    assert_eq!(
        crc(&mut b.client, dst.id, 0, 0).await,
        crc(&mut a.client, src.id, 0, 0).await
    );
    let e = b
        .client
        .rekey_buffer(pb::RekeyBufferRequest { buffer_id: 999 })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);

    // Released: the old descriptor (right key) is refused; a new buffer never sees its bytes.
    b.client
        .release_buffer(pb::ReleaseBufferRequest { buffer_id: dst.id })
        .await
        .unwrap();
    let fresh = host_buffer(&mut b.client, MIB, "fresh").await;
    fill_seed(&mut b.client, fresh.id, 0, 0, 3).await;
    let fresh_crc = crc(&mut b.client, fresh.id, 0, 0).await;
    let id = write(&mut a.client, write_entry(&src, 0, &dst, 0, MIB), b"")
        .await
        .expect("started locally");
    let end = wait(&mut a.client, id).await;
    assert_ne!(end.status_code, 0, "a released buffer's descriptor is dead");
    assert_eq!(crc(&mut b.client, fresh.id, 0, 0).await, fresh_crc);
    assert_lanes_drain(&mut a.client).await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcpxctl_sends_the_token_from_its_file() {
    tcpxd::logging::init("error");
    let d = daemons::start("auth-ctl", |_| {}).await;
    let endpoint = d.daemon.api_tcp.unwrap().to_string();
    let token = d.dir.join("token");
    let wrong = secret_file("ctl-wrong", b"not-the-token-0123456789");
    let _remove_wrong = daemons::ScratchDir::new(wrong.clone());
    let run = move |file: Option<&std::path::Path>| {
        let mut cmd = std::process::Command::new(tcpxd_testkit::workspace_bin("tcpxctl"));
        cmd.args(["--endpoint", &endpoint, "--json", "stats"])
            .env_remove("TCPXD_API_TOKEN_FILE");
        if let Some(f) = file {
            cmd.env("TCPXD_API_TOKEN_FILE", f);
        }
        cmd.output().expect("tcpxctl runs")
    };
    let out = tokio::task::spawn_blocking({
        let token = token.clone();
        move || (run(Some(&token)), run(None), run(Some(&wrong)))
    })
    .await
    .unwrap();
    let (ok, none, bad) = out;
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    for (what, o) in [("no token", none), ("wrong token", bad)] {
        assert!(!o.status.success(), "{what}: tcpxctl succeeded");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("bearer token"), "{what}: {err}");
        assert!(
            !err.contains("not-the-token"),
            "{what}: the token is never printed: {err}"
        );
    }
    // `tcpxctl buffer rekey` hands out a new descriptor (over the unix socket: no token).
    let mut c = d.client.clone();
    let b = host_buffer(&mut c, 4096, "k").await;
    let sock = d.daemon.api_socket.clone();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(tcpxd_testkit::workspace_bin("tcpxctl"))
            .arg("--endpoint")
            .arg(format!("unix:{}", sock.display()))
            .args(["--json", "buffer", "rekey", &b.id.to_string()])
            .output()
            .expect("tcpxctl runs")
    })
    .await
    .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let fresh = c
        .describe_buffer(pb::DescribeBufferRequest { buffer_id: b.id })
        .await
        .unwrap()
        .into_inner()
        .descriptor;
    assert_ne!(fresh, b.descriptor);
    assert_eq!(v["descriptor"], fresh.as_str(), "{v}");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_reaches_the_logs() {
    tcpxd::logging::init("error");
    let dir = std::env::temp_dir().join(format!("tcpxd-nolog-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let secret = "log-secret-0123456789abcdef";
    let wrong = "log-wrong-secret-0123456789";
    let token = "log-token-0123456789abcdef";
    let (sf, wf, tf) = (dir.join("secret"), dir.join("wrong"), dir.join("token"));
    std::fs::write(&sf, secret).unwrap();
    std::fs::write(&wf, wrong).unwrap();
    std::fs::write(&tf, token).unwrap();
    let cfg = |secret: &std::path::Path| {
        format!(
            "[api]\ntcp = \"127.0.0.1:0\"\ntoken_file = {:?}\n[peer]\nsecret_file = {:?}\n",
            tf.display().to_string(),
            secret.display().to_string()
        )
    };
    let verbose = [("RUST_LOG", "trace"), ("UCCL_TCPX_DEBUG", "1")];
    let p1 = crate::common::procs::spawn("nolog-1", 0, &cfg(&sf), &verbose).await;
    let p2 = crate::common::procs::spawn("nolog-2", 0, &cfg(&sf), &verbose).await;
    let p3 = crate::common::procs::spawn("nolog-3", 0, &cfg(&wf), &verbose).await;
    let (mut c1, mut c2, mut c3) = (p1.client().await, p2.client().await, p3.client().await);
    c1.connect_peer(pb::ConnectPeerRequest {
        address: p2.peer_addr.clone(),
    })
    .await
    .expect("the right secret pairs");
    c3.connect_peer(pb::ConnectPeerRequest {
        address: p1.peer_addr.clone(),
    })
    .await
    .expect_err("a wrong secret is refused");
    let x = host_buffer(&mut c1, MIB, "x").await;
    let y = host_buffer(&mut c2, MIB, "y").await;
    let id = write(&mut c1, write_entry(&x, 0, &y, 0, MIB), b"").await.unwrap();
    wait_ok(&mut c1, id).await;
    let mut forged = write_entry(&x, 0, &y, 0, MIB);
    let bare = y.descriptor.split('@').next().unwrap();
    let last = if bare.ends_with('0') { '1' } else { '0' };
    forged.remote_descriptor = format!("{}{last}", &bare[..bare.len() - 1]);
    let id = write(&mut c1, forged, b"").await.unwrap();
    assert_ne!(wait(&mut c1, id).await.status_code, 0);
    // The TCP API, with a wrong and a right token.
    let info: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(p1.dir().join("ready.json")).unwrap()).unwrap();
    let channel =
        tonic::transport::Channel::from_shared(format!("http://{}", info["api_tcp"].as_str().unwrap()))
            .unwrap()
            .connect()
            .await
            .unwrap();
    for t in ["log-token-wrong-0123456789", token] {
        let v: tonic::metadata::MetadataValue<_> = format!("Bearer {t}").parse().unwrap();
        let mut c = TcpxdClient::with_interceptor(channel.clone(), move |mut r: tonic::Request<()>| {
            r.metadata_mut().insert("authorization", v.clone());
            Ok(r)
        });
        let _ = c.list_buffers(pb::ListBuffersRequest {}).await;
    }
    let key = y
        .descriptor
        .split('@')
        .next()
        .unwrap()
        .rsplit(':')
        .next()
        .unwrap()
        .to_string();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let logs: Vec<(String, String)> = [&p1, &p2, &p3]
        .iter()
        .map(|p| (p.node.clone(), p.log()))
        .collect();
    assert!(
        logs.iter().any(|(_, l)| l.contains("refused a handshake")),
        "the logs are verbose enough to matter: {:?}",
        logs.iter().map(|(n, l)| (n, l.len())).collect::<Vec<_>>()
    );
    for (node, log) in &logs {
        for (what, s) in [
            ("the secret", secret),
            ("the wrong secret", wrong),
            ("the token", token),
            ("the wrong token", "log-token-wrong"),
            ("an access key", key.as_str()),
        ] {
            assert!(!log.contains(s), "{node} logged {what}");
        }
    }
    drop((p1, p2, p3));
    std::fs::remove_dir_all(dir).ok();
}
