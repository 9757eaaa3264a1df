//! Benchmark (not run in CI: `#[ignore]`): what 64 paired, idle peers cost one daemon once their
//! lanes closed, and once their pairings closed too (issue #37's target: at most 1% of a core and
//! 64 threads for the whole daemon), and that the next transfer to any of them still succeeds.
//!
//! The measured daemon (the hub) is a `tcpxd` process with `peer.lane_idle_close_ms = 500` and
//! `peer.pairing_idle_close_ms` from `IDLE_PEERS_PAIRING_CLOSE_MS` (default 60000: long enough
//! for the first measurement to find every pairing up; 0: never); its 64 peers are daemons inside
//! the test process (same settings). Each peer pairs with the hub and writes and reads 1 MiB; the
//! hub's threads are read from `/proc/<pid>/status` with every lane open, then after every lane
//! closed, with its CPU (utime + stime) over 10 s; then, once every pairing closed, threads and
//! CPU again; then the hub writes to each peer again (pairing anew with each: the hub was dialled,
//! so it dials back), byte-checked. Run it:
//!
//! ```text
//! TCPXD_TEST_DAEMON_BIN=target/release/tcpxd \
//!   cargo nextest run -p tcpxd --test suite daemon_idle_peers:: --run-ignored ignored-only --no-capture
//! ```

use std::time::{Duration, Instant};

use crate::common::daemons::{self, *};
use crate::common::procs;
use tcpxd::api::proto::v1 as pb;

const PEERS: usize = 64;
const MIB: u64 = 1 << 20;

/// The process's thread count and CPU seconds (user + system) so far.
fn threads_and_cpu(pid: u32) -> (u64, f64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let threads = status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("Threads:");
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let rest = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    (threads, ticks as f64 / hz)
}

/// The process's open file descriptors (sockets included).
fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// The hub's CPU share (% of a core) over `secs` seconds, and its threads at the start.
async fn idle_share(pid: u32, secs: u64) -> (u64, f64) {
    let (threads, cpu0) = threads_and_cpu(pid);
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let (_, cpu1) = threads_and_cpu(pid);
    (threads, (cpu1 - cpu0) / t0.elapsed().as_secs_f64() * 100.0)
}

/// The hub's pairings by state: (up, idle, other).
async fn pairing_states(c: &mut Client) -> (usize, usize, usize) {
    let peers = c
        .list_peers(pb::ListPeersRequest {})
        .await
        .unwrap()
        .into_inner()
        .peers;
    let n = |s: pb::PeerState| peers.iter().filter(|p| p.state == s as i32).count();
    let (up, idle) = (n(pb::PeerState::Up), n(pb::PeerState::Idle));
    (up, idle, peers.len() - up - idle)
}

/// Lanes of the hub not closed (either way).
async fn open_lanes(c: &mut Client) -> usize {
    let s = c.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    s.peers
        .iter()
        .flat_map(|p| &p.lanes)
        .filter(|l| l.send_state != "closed" || l.recv_state != "closed")
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: 65 daemons; run by hand (module doc)"]
async fn sixty_four_idle_peers_cost_the_hub_little_and_the_next_transfers_land() {
    tcpxd::logging::init("error");
    // IDLE_PEERS_HEARTBEAT_MS: every daemon's peer.heartbeat_interval_ms (timeout: 6 x that);
    // unset: the defaults (500 ms, 3 s).
    let heartbeat: Option<u64> = std::env::var("IDLE_PEERS_HEARTBEAT_MS")
        .ok()
        .and_then(|v| v.parse().ok());
    let pairing_close: u64 = std::env::var("IDLE_PEERS_PAIRING_CLOSE_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60_000);
    let mut config = format!("[peer]\nlane_idle_close_ms = 500\npairing_idle_close_ms = {pairing_close}\n");
    if let Some(ms) = heartbeat {
        config += &format!(
            "heartbeat_interval_ms = {ms}\nheartbeat_timeout_ms = {}\n",
            6 * ms
        );
    }
    let dir = std::env::temp_dir().join(format!("tcpxd-idlepeers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let _dir = daemons::ScratchDir::new(dir.clone());
    let peer_config = dir.join("peer.toml");
    std::fs::write(&peer_config, &config).unwrap();
    let hub = procs::spawn("idlehub", 0, &config, &[]).await;
    let mut hc = hub.client().await;
    let pid = hub.child.id();
    let (threads_alone, _) = threads_and_cpu(pid);
    let hub_src = host_buffer(&mut hc, MIB, "src").await;
    fill_seed(&mut hc, hub_src.id, 0, 0, 5).await;
    let hub_dst = host_buffer(&mut hc, MIB, "dst").await;
    let mut peers = Vec::new();
    for i in 0..PEERS {
        let mut p = daemons::start(&format!("idlepeer{i}"), |a| a.config = Some(peer_config.clone())).await;
        p.client
            .connect_peer(pb::ConnectPeerRequest {
                address: hub.peer_addr.clone(),
            })
            .await
            .expect("pairs with the hub");
        let buf = host_buffer(&mut p.client, MIB, "peer").await;
        fill_seed(&mut p.client, buf.id, 0, 0, 100 + i as u64).await;
        // Both directions' lanes used once: the peer writes to the hub and reads from it.
        let id = write(&mut p.client, write_entry(&buf, 0, &hub_dst, 0, MIB), b"")
            .await
            .unwrap();
        wait_ok(&mut p.client, id).await;
        let id = read(&mut p.client, read_entry(&hub_src, 0, &buf, 0, MIB))
            .await
            .unwrap();
        wait_ok(&mut p.client, id).await;
        peers.push((p, buf));
    }
    let (threads_used, _) = threads_and_cpu(pid);
    let open_used = open_lanes(&mut hc).await;
    // Every lane idles out.
    let deadline = Instant::now() + Duration::from_secs(60);
    while open_lanes(&mut hc).await > 0 {
        assert!(Instant::now() < deadline, "the hub's lanes never closed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let states = pairing_states(&mut hc).await;
    let fds_idle = fds(pid);
    let (threads_idle, share) = idle_share(pid, 10).await;
    let heartbeat_name = heartbeat.map_or("500 ms (default)".to_string(), |ms| format!("{ms} ms"));
    println!(
        "hub with {PEERS} paired peers (2-core machine, emulation, 1 device, heartbeat {heartbeat_name}): threads {threads_alone} alone, \
         {threads_used} with lanes used ({open_used} lanes open), {threads_idle} once every lane closed; \
         idle CPU {share:.2}% of a core over 10 s with lanes closed, {fds_idle} fds (pairings up / idle / other at the start: {states:?})",
    );
    // Every pairing closes when idle (peer.pairing_idle_close_ms), by agreement: none fails.
    if pairing_close > 0 {
        let deadline = Instant::now() + Duration::from_millis(pairing_close) + Duration::from_secs(120);
        loop {
            let (up, idle, other) = pairing_states(&mut hc).await;
            assert_eq!(other, 0, "a pairing failed or is connecting");
            if idle == PEERS {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "pairings never closed: {up} up, {idle} idle"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let fds_closed = fds(pid);
        let (threads_closed, share_closed) = idle_share(pid, 10).await;
        println!(
            "the same hub once every pairing closed when idle (pairing_idle_close_ms {pairing_close}): threads {threads_closed}, \
             idle CPU {share_closed:.2}% of a core over 10 s, {fds_closed} fds"
        );
        assert!(
            threads_closed <= 64,
            "{threads_closed} threads with every pairing closed"
        );
    }
    // The next transfer to every peer: its lanes open again, bytes checked.
    let want = crc(&mut hc, hub_src.id, 0, 0).await;
    for (p, buf) in &mut peers {
        let id = write(&mut hc, write_entry(&hub_src, 0, buf, 0, MIB), b"")
            .await
            .unwrap();
        wait_ok(&mut hc, id).await;
        assert_eq!(crc(&mut p.client, buf.id, 0, 0).await, want);
    }
    println!("the next transfer to each of the {PEERS} peers landed byte-exact");
    let s = hc.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    let closes: u64 = s.peers.iter().map(|p| p.idle_closes).sum();
    let failed: u64 = s.peers.iter().map(|p| p.transfers_failed).sum();
    println!(
        "hub afterwards: {} pairings up, {closes} idle closes counted, {failed} transfers failed",
        pairing_states(&mut hc).await.0
    );
    assert_eq!(failed, 0);
    assert!(
        threads_idle <= 64,
        "{threads_idle} threads with every lane closed"
    );
    for (p, _) in peers {
        p.stop().await;
    }
}
