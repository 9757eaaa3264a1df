//! A pairing closed while its peer hangs: the plugin cannot close a comm with a request under way
//! until its peer takes or sends the bytes or closes its end (Google's `tcpxClose` joins helper
//! threads that look at their stop flag only when idle; the emulation with `TCPXEMU_CLOSE=plugin`
//! closes the same way). Such closes run on a thread of their own, never the poller's: the daemon's
//! API and its other pairings keep answering while the hung peer's comms wait.

use std::time::Duration;

use crate::common::daemons::{self, *};
use crate::common::hold;
use tcpxd::api::proto::v1 as pb;

const MIB: u64 = 1 << 20;
/// The default heartbeat timeout: the bound on noticing a stopped peer.
const BOUND: Duration = Duration::from_millis(tcpxd::config::DEFAULT_HEARTBEAT_TIMEOUT_MS);

/// `c`'s view of the pairing with `node`, as ListPeers has it.
async fn peer_state(c: &mut Client, node: &str) -> Option<pb::PeerState> {
    let peers = c
        .list_peers(pb::ListPeersRequest {})
        .await
        .expect("ListPeers answers")
        .into_inner()
        .peers;
    peers.into_iter().find(|p| p.node_id == node).map(|p| p.state())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pairing_closed_on_a_hung_peer_freezes_neither_the_api_nor_other_pairings() {
    // SAFETY: each test runs in its own process (nextest) and sets the variable before the
    // emulation is initialised and before any other thread reads the environment.
    unsafe { std::env::set_var("TCPXEMU_CLOSE", "plugin") };
    tcpxd::logging::init("warn");
    let close = [("TCPXEMU_CLOSE", "plugin")];
    let mut a = daemons::start("hung-a", |_| {}).await;
    let (b, mut bc) = hold::peer_process(&mut a, "hung-b", &close).await;
    let (_c, mut cc) = hold::peer_process(&mut a, "hung-c", &close).await;
    let src = host_buffer(&mut a.client, 128 * MIB, "").await;
    let back = host_buffer(&mut a.client, 128 * MIB, "").await;
    let dst = host_buffer(&mut bc, 128 * MIB, "").await;
    let other = host_buffer(&mut cc, 8 * MIB, "").await;
    fill_seed(&mut a.client, src.id, 0, 0, 3).await;
    fill_seed(&mut bc, dst.id, 0, 0, 4).await;
    // A WRITE and a READ under way on b's lanes both ways when b stops: a's send comms have
    // bytes left that b never takes, its receive comms expect bytes b never sends.
    let w = write(&mut a.client, write_entry(&src, 0, &dst, 0, 128 * MIB), b"")
        .await
        .unwrap();
    let r = read(&mut a.client, read_entry(&dst, 0, &back, 0, 128 * MIB))
        .await
        .unwrap();
    let frozen = hold::freeze_once_lanes_move(&mut a.client, &b, 2).await;
    // The heartbeat timeout closes the pairing: both transfers fail, naming the peer.
    for id in [w, r] {
        let e = tokio::time::timeout(BOUND * 5, wait(&mut a.client, id))
            .await
            .expect("the transfer ends once the pairing is closed");
        assert_eq!(
            e.status_code,
            tonic::Code::Unavailable as i32,
            "{}",
            e.status_message
        );
        assert!(e.status_message.contains("hung-b"), "{}", e.status_message);
    }
    // b stays stopped: its comms' closes wait. The API answers, the pairing is not up...
    let api = Duration::from_secs(10);
    let state = tokio::time::timeout(api, peer_state(&mut a.client, "hung-b"))
        .await
        .expect("ListPeers answers while the closes wait");
    assert_ne!(state, Some(pb::PeerState::Up), "{state:?}");
    let stats = tokio::time::timeout(api, a.client.get_stats(pb::GetStatsRequest {}))
        .await
        .expect("GetStats answers while the closes wait")
        .unwrap()
        .into_inner();
    assert_eq!(stats.active_transfers, 0, "{stats:?}");
    // ...and the other pairing moves bytes, WRITE and READ, byte-exact.
    for len in [4096, 8 * MIB] {
        let id = write(&mut a.client, write_entry(&src, 7, &other, 0, len), b"")
            .await
            .unwrap();
        let e = tokio::time::timeout(api, wait(&mut a.client, id))
            .await
            .expect("a WRITE to the other peer ends while the closes wait");
        assert_eq!(e.status_code, 0, "{}", e.status_message);
        assert_eq!(
            crc(&mut a.client, src.id, 7, len).await,
            crc(&mut cc, other.id, 0, len).await,
            "WRITE of {len} bytes"
        );
        let id = read(&mut a.client, read_entry(&other, 0, &back, 11, len))
            .await
            .unwrap();
        let e = tokio::time::timeout(api, wait(&mut a.client, id))
            .await
            .expect("a READ from the other peer ends while the closes wait");
        assert_eq!(e.status_code, 0, "{}", e.status_message);
        assert_eq!(
            crc(&mut a.client, back.id, 11, len).await,
            crc(&mut cc, other.id, 0, len).await,
            "READ of {len} bytes"
        );
    }
    frozen.thaw();
    assert_lanes_drain(&mut cc).await;
}
