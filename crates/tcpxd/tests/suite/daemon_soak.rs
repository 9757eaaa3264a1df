//! Soak: three `tcpxd` processes, every ordered pair moving mixed sizes (4 KiB to 32 MiB) both
//! by writes and by reads, each transfer's bytes checked by checksum; the daemons' resident
//! memory must not grow once warmed up. Runs `TCPXD_SOAK_SECS` seconds (60 by default; set it
//! higher for a longer soak).

use std::time::{Duration, Instant};

use crate::common::daemons::*;
use crate::common::procs::{self, ProcDaemon};
use tcpxd::api::proto::v1 as pb;
use tcpxd_testkit::Rng;

const MIB: u64 = 1 << 20;
const SRC: u64 = 64 * MIB;
const LAND: u64 = 32 * MIB;
const SIZES: [u64; 6] = [4096, 65536, MIB + 13, 3 * MIB + 4096, 8 * MIB, 32 * MIB];

fn soak_secs() -> u64 {
    std::env::var("TCPXD_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60)
}

/// Resident memory of a process, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kb * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_daemons_move_mixed_traffic_exactly_with_stable_memory() {
    tcpxd::logging::init("error");
    let secs = soak_secs();
    let mut ds: Vec<ProcDaemon> = Vec::new();
    for name in ["soak-0", "soak-1", "soak-2"] {
        ds.push(procs::spawn(name, 0, "", &[]).await);
    }
    let mut cs: Vec<Client> = Vec::new();
    for d in &ds {
        cs.push(d.client().await);
    }
    for (i, j) in [(0, 1), (0, 2), (1, 2)] {
        cs[i]
            .connect_peer(pb::ConnectPeerRequest {
                address: ds[j].peer_addr.clone(),
            })
            .await
            .expect("pairing");
    }
    let mut srcs = Vec::new();
    for (i, c) in cs.iter_mut().enumerate() {
        let s = host_buffer(c, SRC, "src").await;
        fill_seed(c, s.id, 0, 0, 1000 + i as u64).await;
        srcs.push(s);
    }

    let until = Instant::now() + Duration::from_secs(secs);
    let warm_at = Instant::now() + Duration::from_secs(secs / 3);
    let mut workers = Vec::new();
    for i in 0..3usize {
        for j in 0..3usize {
            if i == j {
                continue;
            }
            // Data flows i → j into a landing buffer of j's that only this worker uses.
            let (mut ci, mut cj) = (cs[i].clone(), cs[j].clone());
            let src = srcs[i].clone();
            workers.push(tokio::spawn(async move {
                let land = host_buffer(&mut cj, LAND, &format!("land-from-{i}")).await;
                // Touch every page now, so the warm-up sample already counts them.
                fill_seed(&mut cj, land.id, 0, 0, 7).await;
                let mut rng = Rng::new(0x9E37_79B9_7F4A_7C15 ^ ((i as u64) << 8 | j as u64));
                let mut moved = 0u64;
                let mut rounds = 0u64;
                while Instant::now() < until {
                    let len = SIZES[rng.below(SIZES.len() as u64) as usize];
                    let soff = rng.below(SRC - len + 1);
                    let loff = rng.below(LAND - len + 1);
                    let by_read = rng.below(2) == 1;
                    let id = if by_read {
                        read(&mut cj, read_entry(&src, soff, &land, loff, len)).await
                    } else {
                        write(&mut ci, write_entry(&src, soff, &land, loff, len), b"").await
                    }
                    .unwrap_or_else(|s| panic!("{i}→{j} round {rounds}: {s}"));
                    let c = if by_read { &mut cj } else { &mut ci };
                    wait_ok(c, id).await;
                    assert_eq!(
                        crc(&mut cj, land.id, loff, len).await,
                        crc(&mut ci, src.id, soff, len).await,
                        "{i}→{j} round {rounds}: {len} bytes {soff}→{loff} (read: {by_read})"
                    );
                    moved += len;
                    rounds += 1;
                }
                (rounds, moved)
            }));
        }
    }
    // Memory once warmed up, then at the end.
    tokio::time::sleep_until(warm_at.into()).await;
    let warm: Vec<u64> = ds.iter().map(|d| rss(d.child.id())).collect();
    let mut total = (0, 0);
    for w in workers {
        let (r, m) = w.await.expect("worker");
        assert!(r > 0, "every pair moved data");
        total = (total.0 + r, total.1 + m);
    }
    let end: Vec<u64> = ds.iter().map(|d| rss(d.child.id())).collect();
    for (k, (w, e)) in warm.iter().zip(&end).enumerate() {
        // Buffers are registered before the warm-up sample; what remains is allocator noise.
        assert!(
            *e <= w + 64 * MIB,
            "soak-{k}: resident memory grew from {} MiB to {} MiB",
            w / MIB,
            e / MIB
        );
    }
    for c in cs.iter_mut() {
        assert_lanes_drain(c).await;
    }
    eprintln!(
        "soak: {} transfers, {} MiB in {secs} s; RSS warm {:?} MiB, end {:?} MiB",
        total.0,
        total.1 / MIB,
        warm.iter().map(|r| r / MIB).collect::<Vec<_>>(),
        end.iter().map(|r| r / MIB).collect::<Vec<_>>()
    );
}
