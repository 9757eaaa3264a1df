//! Direct control connections (`peer.direct_control`, docs/ARCHITECTURE.md, "The direct control
//! connection"): pairings carry their engine messages on them both ways, with and without a
//! cluster secret, and small WRITEs and READs move the right bytes; either side off keeps the
//! pairing on its HTTP/2 stream. Hostile input on the connection: `daemon_hostile::direct`.

use std::path::PathBuf;

use crate::common::daemons::{self, *};
use tcpxd::api::proto::v1 as pb;

const KIB: u64 = 1024;

async fn stats_of(c: &mut Client) -> Vec<pb::PeerStats> {
    c.get_stats(pb::GetStatsRequest {})
        .await
        .expect("stats")
        .into_inner()
        .peers
}

/// 4 KiB and 64 KiB WRITEs and READs a → b, bytes compared each time.
async fn small_transfers(a: &mut TestDaemon, b: &mut TestDaemon) {
    let x = host_buffer(&mut a.client, 256 * KIB, "x").await;
    let y = host_buffer(&mut b.client, 256 * KIB, "y").await;
    for (i, len) in [4 * KIB, 64 * KIB, 4 * KIB, 64 * KIB].into_iter().enumerate() {
        fill_seed(&mut a.client, x.id, 0, 0, 10 + i as u64).await;
        let id = write(&mut a.client, write_entry(&x, 0, &y, 0, len), b"")
            .await
            .unwrap();
        wait_ok(&mut a.client, id).await;
        assert_eq!(
            bytes(&mut b.client, y.id, 0, len).await,
            bytes(&mut a.client, x.id, 0, len).await
        );
        fill_seed(&mut b.client, y.id, 0, 0, 20 + i as u64).await;
        let id = read(&mut a.client, read_entry(&y, 0, &x, 0, len)).await.unwrap();
        wait_ok(&mut a.client, id).await;
        assert_eq!(
            bytes(&mut a.client, x.id, 0, len).await,
            bytes(&mut b.client, y.id, 0, len).await
        );
    }
}

async fn assert_direct(c: &mut Client, want: bool) {
    let peers = stats_of(c).await;
    assert_eq!(peers.len(), 1, "{peers:?}");
    let p = &peers[0];
    assert_eq!(p.state, pb::PeerState::Up as i32, "{p:?}");
    assert_eq!(p.direct_control, want, "{p:?}");
    if want {
        assert!(
            p.direct_messages_sent > 0,
            "messages went on the direct connection: {p:?}"
        );
    } else {
        assert_eq!(p.direct_messages_sent, 0, "{p:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_transfers_go_over_the_direct_control_connection_both_ways() {
    tcpxd::logging::init("error");
    let (mut a, mut b) = daemons::pair("direct").await;
    small_transfers(&mut a, &mut b).await;
    assert_direct(&mut a.client, true).await;
    assert_direct(&mut b.client, true).await;
    for d in [a, b] {
        d.stop().await;
    }
}

fn secret_file(tag: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("tcpxd-direct-secret-{tag}-{}", std::process::id()));
    std::fs::write(&p, b"cluster-secret-0123456789abcdef").unwrap();
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_cluster_secret_the_direct_connection_proves_it_and_carries_the_pairing() {
    tcpxd::logging::init("error");
    let s = secret_file("both");
    let mut a = daemons::start("direct-sa", |x| x.peer_secret_file = Some(s.clone())).await;
    let mut b = daemons::start("direct-sb", |x| x.peer_secret_file = Some(s.clone())).await;
    connect(&mut a, &b).await;
    small_transfers(&mut a, &mut b).await;
    assert_direct(&mut a.client, true).await;
    assert_direct(&mut b.client, true).await;
    for d in [a, b] {
        d.stop().await;
    }
    std::fs::remove_file(s).ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_control_off_on_either_side_keeps_the_pairing_on_its_stream() {
    tcpxd::logging::init("error");
    let off = |x: &mut tcpxd::config::DaemonArgs| x.direct_control = Some("off".into());
    // The caller off: it ignores the callee's token. The callee off: it offers none.
    for (a_off, b_off) in [(true, false), (false, true)] {
        let mut a = daemons::start("direct-oa", |x| {
            if a_off {
                off(x)
            }
        })
        .await;
        let mut b = daemons::start("direct-ob", |x| {
            if b_off {
                off(x)
            }
        })
        .await;
        connect(&mut a, &b).await;
        small_transfers(&mut a, &mut b).await;
        assert_direct(&mut a.client, false).await;
        assert_direct(&mut b.client, false).await;
        for d in [a, b] {
            d.stop().await;
        }
    }
}
