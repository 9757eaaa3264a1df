//! Mutual TLS on the peer service, with certificates generated at test time (rcgen): nodes with
//! certificates from the cluster CA pair and move bytes; a certificate from another CA, a plain
//! (non-TLS) peer, and a TLS peer against a plain daemon are all refused and pair nothing.

use std::path::{Path, PathBuf};

use crate::common::daemons::{self, *};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use tcpxd::api::proto::v1 as pb;

const MIB: u64 = 1 << 20;

struct Ca(CertifiedIssuer<'static, KeyPair>);

impl Ca {
    fn new() -> Ca {
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        Ca(CertifiedIssuer::self_signed(p, KeyPair::generate().unwrap()).unwrap())
    }

    /// Writes `<dir>/<name>.{crt,key}` for a loopback node and `<dir>/<name>.ca` with this CA;
    /// returns the TOML lines that configure them.
    fn node(&self, dir: &Path, name: &str) -> String {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
            .unwrap()
            .signed_by(&key, &self.0)
            .unwrap();
        let (c, k, a) = (
            dir.join(format!("{name}.crt")),
            dir.join(format!("{name}.key")),
            dir.join(format!("{name}.ca")),
        );
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        std::fs::write(&a, self.0.pem()).unwrap();
        format!(
            "[peer]\ntls_cert_file = {c:?}\ntls_key_file = {k:?}\ntls_ca_file = {a:?}\n",
            c = c.display().to_string(),
            k = k.display().to_string(),
            a = a.display().to_string()
        )
    }
}

fn config(dir: &Path, name: &str, toml: &str) -> PathBuf {
    let p = dir.join(format!("{name}.toml"));
    std::fs::write(&p, toml).unwrap();
    p
}

async fn peers_of(c: &mut Client) -> usize {
    c.list_peers(pb::ListPeersRequest {})
        .await
        .unwrap()
        .into_inner()
        .peers
        .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_peers_with_a_certificate_from_the_cluster_ca_pair() {
    tcpxd::logging::init("error");
    let dir = std::env::temp_dir().join(format!("tcpxd-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (ca, rogue) = (Ca::new(), Ca::new());
    let ca_cfg = config(&dir, "a", &ca.node(&dir, "a"));
    let cb_cfg = config(&dir, "b", &ca.node(&dir, "b"));
    let rogue_cfg = config(&dir, "r", &rogue.node(&dir, "r"));
    let mut a = daemons::start("tls-a", |x| x.config = Some(ca_cfg.clone())).await;
    let mut b = daemons::start("tls-b", |x| x.config = Some(cb_cfg.clone())).await;
    let mut r = daemons::start("tls-r", |x| x.config = Some(rogue_cfg.clone())).await;
    let mut plain = daemons::start("tls-plain", |_| {}).await;

    let refused = [
        ("rogue → a", &mut r, a.peer_addr()),
        ("plain → a", &mut plain, a.peer_addr()),
    ];
    for (what, from, to) in refused {
        let e = from
            .client
            .connect_peer(pb::ConnectPeerRequest { address: to })
            .await
            .expect_err(what);
        assert_eq!(e.code(), tonic::Code::Unavailable, "{what}: {}", e.message());
    }
    for (what, to) in [("a → rogue", r.peer_addr()), ("a → plain", plain.peer_addr())] {
        let e = a
            .client
            .connect_peer(pb::ConnectPeerRequest { address: to })
            .await
            .expect_err(what);
        assert_eq!(e.code(), tonic::Code::Unavailable, "{what}: {}", e.message());
    }
    for c in [&mut a.client, &mut r.client, &mut plain.client] {
        assert_eq!(peers_of(c).await, 0, "a refused peer paired nothing");
    }

    connect(&mut a, &b).await;
    let x = host_buffer(&mut a.client, 8 * MIB, "x").await;
    let y = host_buffer(&mut b.client, 8 * MIB, "y").await;
    fill_seed(&mut a.client, x.id, 0, 0, 9).await;
    let id = write(&mut a.client, write_entry(&x, 0, &y, 0, 8 * MIB), b"")
        .await
        .unwrap();
    wait_ok(&mut a.client, id).await;
    assert_eq!(
        crc(&mut b.client, y.id, 0, 0).await,
        crc(&mut a.client, x.id, 0, 0).await
    );
    // And the other way, over the callee's side of the same TLS pairing.
    let id = read(&mut a.client, read_entry(&y, 0, &x, 0, MIB)).await.unwrap();
    wait_ok(&mut a.client, id).await;
    // Under mutual TLS the pairing stays on its (TLS) control stream: no plain direct
    // control connection carries its messages (docs/OPERATIONS.md).
    for c in [&mut a.client, &mut b.client] {
        let peers = c
            .get_stats(pb::GetStatsRequest {})
            .await
            .unwrap()
            .into_inner()
            .peers;
        assert!(
            peers
                .iter()
                .all(|p| !p.direct_control && p.direct_messages_sent == 0),
            "{peers:?}"
        );
    }

    for d in [a, b, r, plain] {
        d.stop().await;
    }
    std::fs::remove_dir_all(dir).ok();
}

/// A descriptor alone pairs two daemons over mutual TLS (issue #15 point 3), and a daemon with
/// another CA's certificate is refused on first use as on ConnectPeer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_use_of_a_descriptor_pairs_over_tls_and_refuses_other_cas() {
    tcpxd::logging::init("error");
    let dir = std::env::temp_dir().join(format!("tcpxd-tls-fu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (ca, rogue) = (Ca::new(), Ca::new());
    let ca_cfg = config(&dir, "a", &ca.node(&dir, "a"));
    let cb_cfg = config(&dir, "b", &ca.node(&dir, "b"));
    let rogue_cfg = config(&dir, "r", &rogue.node(&dir, "r"));
    let mut a = daemons::start("tlsfu-a", |x| x.config = Some(ca_cfg.clone())).await;
    let mut b = daemons::start("tlsfu-b", |x| x.config = Some(cb_cfg.clone())).await;
    let mut r = daemons::start("tlsfu-r", |x| x.config = Some(rogue_cfg.clone())).await;
    let x = host_buffer(&mut a.client, 4 * MIB, "x").await;
    fill_seed(&mut a.client, x.id, 0, 0, 13).await;

    // Both directions against the rogue: UNAVAILABLE naming the address, nothing paired.
    let z = host_buffer(&mut r.client, 4 * MIB, "z").await;
    let e = write(&mut a.client, write_entry(&x, 0, &z, 0, MIB), b"")
        .await
        .expect_err("a → rogue's descriptor");
    assert_eq!(e.code(), tonic::Code::Unavailable, "{}", e.message());
    assert!(e.message().contains(&r.peer_addr()), "{}", e.message());
    let e = write(&mut r.client, write_entry(&z, 0, &x, 0, MIB), b"")
        .await
        .expect_err("rogue → a's descriptor");
    assert_eq!(e.code(), tonic::Code::Unavailable, "{}", e.message());
    for c in [&mut a.client, &mut r.client] {
        assert_eq!(peers_of(c).await, 0, "a refused peer paired nothing");
    }

    // Same CA: b's descriptor is all a needs.
    let y = host_buffer(&mut b.client, 4 * MIB, "y").await;
    let id = write(&mut a.client, write_entry(&x, 0, &y, 0, 4 * MIB), b"")
        .await
        .expect("a → b's descriptor over TLS");
    wait_ok(&mut a.client, id).await;
    assert_eq!(
        crc(&mut b.client, y.id, 0, 0).await,
        crc(&mut a.client, x.id, 0, 0).await
    );
    assert_eq!(peers_of(&mut a.client).await, 1);

    for d in [a, b, r] {
        d.stop().await;
    }
    std::fs::remove_dir_all(dir).ok();
}
