//! A pairing closed while its peer hangs: the plugin cannot close a comm with a request under way
//! until its peer takes or sends the bytes or closes its end (Google's `tcpxClose` joins helper
//! threads that look at their stop flag only when idle; the emulation with `TCPXEMU_CLOSE=plugin`
//! closes the same way). Such closes run on a thread of their own, never the poller's: the daemon's
//! API and its other pairings keep answering while the hung peer's comms wait; however many
//! pairings fail so, their closes take a few threads (`poller::closer`), not one each.

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
    hold::gate_on();
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
    // bytes left that b never takes, its receive comms expect bytes b never sends. (The hold
    // gate keeps both from ending before b is stopped, then opens for the other pairing: the
    // WRITE cannot end without b's `Done`, the READ's rest is in b.)
    hold::close_gate();
    let w = write(&mut a.client, write_entry(&src, 0, &dst, 0, 128 * MIB), b"")
        .await
        .unwrap();
    let r = read(&mut a.client, read_entry(&dst, 0, &back, 0, 128 * MIB))
        .await
        .unwrap();
    let frozen = hold::freeze_once_lanes_move(&mut a.client, &b, 2).await;
    hold::open_gate();
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
    // (The transfers fail on the poller before the pairing's state reaches ListPeers: asked
    // again until it does, each answer within the bound.)
    let api = Duration::from_secs(10);
    let asked = std::time::Instant::now();
    loop {
        let state = tokio::time::timeout(api, peer_state(&mut a.client, "hung-b"))
            .await
            .expect("ListPeers answers while the closes wait");
        if state != Some(pb::PeerState::Up) {
            break;
        }
        assert!(asked.elapsed() < api, "the pairing is still up after {api:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
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

/// The threads of this process closing failed pairings' lanes (`poller::closer`; `comm` keeps
/// 15 bytes of the name `tcpxd-close-peer`).
fn closer_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("this process's threads")
        .filter_map(Result::ok)
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.starts_with("tcpxd-close-pe"))
        })
        .count()
}

/// Many pairings failing at once, each on a peer that hangs with a READ under way (the hub's
/// receive comms expect bytes the peer never sends, so their closes wait until it comes back):
/// the closes take at most `MAX_CLOSERS` (4) threads however many pairings failed (once a thread
/// each), the rest wait their turn, and every close ends and its thread with it once the peers
/// go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_pairings_failing_on_hung_peers_take_a_bounded_number_of_closer_threads() {
    const PEERS: usize = 8;
    hold::gate_on();
    // SAFETY: as in the test above.
    unsafe { std::env::set_var("TCPXEMU_CLOSE", "plugin") };
    tcpxd::logging::init("error");
    let close = [("TCPXEMU_CLOSE", "plugin")];
    let mut a = daemons::start("closers-a", |_| {}).await;
    let mut peers = Vec::new();
    for i in 0..PEERS {
        let (p, mut pc) = hold::peer_process(&mut a, &format!("closers-{i}"), &close).await;
        let src = host_buffer(&mut pc, 32 * MIB, "").await;
        let dst = host_buffer(&mut a.client, 32 * MIB, "").await;
        peers.push((p, src, dst));
    }
    // Each peer's sends wait at the hold gate after 16 MiB: every READ moves bytes, none ends.
    hold::close_gate();
    let mut reads = Vec::new();
    for (_, src, dst) in &peers {
        let id = read(&mut a.client, read_entry(src, 0, dst, 0, 32 * MIB))
            .await
            .unwrap();
        reads.push(id);
    }
    for &id in &reads {
        hold::once_moving(&mut a.client, id).await;
    }
    assert_eq!(closer_threads(), 0, "no pairing failed yet");
    let frozen: Vec<hold::Frozen> = peers.iter().map(|(p, _, _)| hold::Frozen::now(p)).collect();
    // The heartbeat timeout fails every pairing, and so every READ.
    for &id in &reads {
        let e = tokio::time::timeout(BOUND * 5, wait(&mut a.client, id))
            .await
            .expect("the READ ends once its pairing failed");
        assert_eq!(
            e.status_code,
            tonic::Code::Unavailable as i32,
            "{}",
            e.status_message
        );
    }
    // Every failed pairing's close is queued once its transfer failed; the closes hang (their
    // peers are stopped): 4 threads in them, 4 closes waiting.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while closer_threads() < 4 {
        assert!(
            std::time::Instant::now() < deadline,
            "4 closer threads within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let hung = closer_threads();
    assert_eq!(
        hung, 4,
        "closer threads with {PEERS} pairings failed on hung peers"
    );
    // The API answers meanwhile.
    let stats = a
        .client
        .get_stats(pb::GetStatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.active_transfers, 0, "{stats:?}");
    // The peers go on (the gate opens): every close ends, and the threads after them.
    drop(frozen);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while closer_threads() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "{} closer threads left 60 s after the peers went on",
            closer_threads()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
