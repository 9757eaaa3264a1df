//! A transfer mixing memories on both ends (issue #37 point 2, engine `route_parts.rs`) between
//! two A3-shaped emulated nodes (the CUDA stand-in's eight GPUs, four emulated NICs): a
//! WriteBatch from GPU 0, GPU 3 and host memory of `a` into GPU 5, GPU 1 and host memory of `b`,
//! and a ReadBatch of it back into GPU 6, host memory and GPU 0 of `a`, each ONE transfer that
//! moves every memory pair's bytes only on that pair's lanes — counted per lane at both ends
//! (GetStats' `send_memory` / `recv_memory`, NIC and GPU per direction) — byte-exact, with one
//! notification naming each written buffer once after every byte landed; a mixed batch some of
//! whose entries the receiver refuses fails whole, its lanes drained at both ends.

use std::collections::BTreeMap;

use crate::common::daemons::*;
use crate::common::gpus::{assert_same, cuda_buffer};
use crate::common::procs;
use crate::topology::{a3_env, assert_every_comm_served, grew, lane_bytes, refs};
use tcpxd::api::proto::v1 as pb;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// Bytes per memory pair ("gpu0>gpu5") on the lanes whose bytes sent (`sent`) or received grew
/// since `before`; each such lane's GPU ends checked: GPU g's end on NIC g / 2 under GPU g.
pub(crate) fn per_pair(
    before: &[pb::LaneStats],
    after: &[pb::LaneStats],
    sent: bool,
    what: &str,
) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    let zero = pb::LaneStats::default();
    for l in grew(before, after, sent) {
        let b = before.iter().find(|b| b.lane == l.lane).unwrap_or(&zero);
        let (pair, bytes) = if sent {
            (l.send_memory.clone(), l.bytes_sent - b.bytes_sent)
        } else {
            (l.recv_memory.clone(), l.bytes_received - b.bytes_received)
        };
        let (src, dst) = pair.split_once('>').unwrap_or_else(|| panic!("{what}: {l:?}"));
        let gpu = |m: &str| m.strip_prefix("gpu").map(|g| g.parse::<i32>().unwrap());
        // Our end of the lane: the source's GPU on a sender, the destination's on a receiver.
        if sent && let Some(g) = gpu(src) {
            assert_eq!((l.send_device, l.send_gpu), (g / 2, g), "{what}: {l:?}");
        }
        if !sent && let Some(g) = gpu(dst) {
            assert_eq!((l.recv_device, l.recv_gpu), (g / 2, g), "{what}: {l:?}");
        }
        *m.entry(pair).or_default() += bytes;
    }
    m
}

pub(crate) fn expected(
    entries: &[(usize, u64, usize, u64, u64)],
    from: [&str; 3],
    to: [&str; 3],
) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    for &(f, _, t, _, len) in entries {
        *m.entry(format!("{}>{}", from[f], to[t])).or_default() += len;
    }
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_batch_moves_each_memory_pairs_bytes_only_on_its_lanes() {
    tcpxd::logging::init("error");
    if test_plugin_file().is_some() {
        return;
    }
    let mut env = a3_env();
    env.extend(
        [
            ("TCPXEMU_BOUNCE", "cuda"),
            ("TCPXEMU_BOUNCE_PAGES", "2048"),
            ("UCCL_TCPX_UNPACK_IMPL", "d2d"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    let a = procs::spawn("mixed-a", 0, "", &refs(&env)).await;
    let b = procs::spawn("mixed-b", 0, "[topology]\nmap = \"a3vm\"\n", &refs(&env)).await;
    let mut ac = a.client().await;
    let mut bc = b.client().await;
    let size = 4 * MIB;
    let src = [
        cuda_buffer(&mut ac, 0, size).await,
        cuda_buffer(&mut ac, 3, size).await,
        host_buffer(&mut ac, size, "a-host").await,
    ];
    let dst = [
        cuda_buffer(&mut bc, 5, size).await,
        cuda_buffer(&mut bc, 1, size).await,
        host_buffer(&mut bc, size, "b-host").await,
    ];
    let back = [
        cuda_buffer(&mut ac, 6, size).await,
        host_buffer(&mut ac, size, "a-back").await,
        cuda_buffer(&mut ac, 0, size).await,
    ];
    let (src_mem, dst_mem, back_mem) = (
        ["gpu0", "gpu3", "host"],
        ["gpu5", "gpu1", "host"],
        ["gpu6", "host", "gpu0"],
    );
    for (i, s) in src.iter().enumerate() {
        fill_seed(&mut ac, s.id, 0, 0, 41 + i as u64).await;
    }
    // (source, offset, destination, offset, length): eight memory pairs, GPU 0 -> GPU 5 in
    // entries apart, rendezvous sizes and one small entry (eager: host -> GPU 1 by b's GPU
    // credits), odd lengths.
    let entries: [(usize, u64, usize, u64, u64); 8] = [
        (0, 0, 0, 0, MIB + 3),
        (1, 0, 1, 0, MIB + 5),
        (2, 0, 2, 0, 768 * KIB + 1),
        (0, 2 * MIB, 2, MIB, 512 * KIB + 7),
        (2, MIB, 0, 2 * MIB, MIB),
        (1, 2 * MIB, 0, 3 * MIB + 4096, 512 * KIB),
        (0, MIB + 512 * KIB, 1, 2 * MIB, 256 * KIB),
        (2, 3 * MIB, 1, 3 * MIB, 16 * KIB - 1),
    ];
    let mut sub = bc
        .subscribe(pb::SubscribeRequest::default())
        .await
        .unwrap()
        .into_inner();
    let (a0, b0) = (lane_bytes(&mut ac).await, lane_bytes(&mut bc).await);
    let r = ac
        .write_batch(pb::WriteBatchRequest {
            entries: entries
                .iter()
                .map(|&(s, so, d, doff, len)| write_entry(&src[s], so, &dst[d], doff, len))
                .collect(),
            notification: b"mixed".to_vec(),
            timeout_ms: 120_000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let total: u64 = entries.iter().map(|e| e.4).sum();
    assert_eq!(r.total_bytes, total);
    wait_ok(&mut ac, r.transfer_id).await;
    // One notification, after every part landed, naming each written buffer once.
    let n = sub.message().await.unwrap().expect("a notification");
    assert_eq!(
        (n.transfer_id, n.payload.as_slice()),
        (r.transfer_id, &b"mixed"[..])
    );
    assert_eq!(n.buffer_ids, dst.iter().map(|d| d.id).collect::<Vec<_>>());
    for (i, &(s, so, d, doff, len)) in entries.iter().enumerate() {
        let what = format!("WRITE entry {i}: {} -> {}", src_mem[s], dst_mem[d]);
        assert_same(&mut ac, (src[s].id, so), &mut bc, (dst[d].id, doff), len, &what).await;
    }
    let (a1, b1) = (lane_bytes(&mut ac).await, lane_bytes(&mut bc).await);
    let want = expected(&entries, src_mem, dst_mem);
    assert_eq!(want.len(), 8);
    assert_eq!(
        per_pair(&a0, &a1, true, "WRITE, a sent"),
        want,
        "a's lanes, per memory pair"
    );
    assert_eq!(
        per_pair(&b0, &b1, false, "WRITE, b received"),
        want,
        "b's lanes, per memory pair"
    );

    // READ it back into other memories of a: b sends each pair on its lanes.
    let slot = MIB + 64 * KIB;
    let reads: Vec<(usize, u64, usize, u64, u64)> = entries
        .iter()
        .enumerate()
        .map(|(i, &(_, _, d, doff, len))| (d, doff, i % 3, slot * (i as u64 / 3), len))
        .collect();
    let r = ac
        .read_batch(pb::ReadBatchRequest {
            entries: reads
                .iter()
                .map(|&(d, doff, k, koff, len)| read_entry(&dst[d], doff, &back[k], koff, len))
                .collect(),
            timeout_ms: 120_000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    wait_ok(&mut ac, r.transfer_id).await;
    for (i, &(d, doff, k, koff, len)) in reads.iter().enumerate() {
        let what = format!("READ entry {i}: {} -> {}", dst_mem[d], back_mem[k]);
        assert_same(
            &mut bc,
            (dst[d].id, doff),
            &mut ac,
            (back[k].id, koff),
            len,
            &what,
        )
        .await;
    }
    let (a2, b2) = (lane_bytes(&mut ac).await, lane_bytes(&mut bc).await);
    let want = expected(&reads, dst_mem, back_mem);
    assert_eq!(
        per_pair(&b1, &b2, true, "READ, b sent"),
        want,
        "b's lanes, per memory pair"
    );
    assert_eq!(
        per_pair(&a1, &a2, false, "READ, a received"),
        want,
        "a's lanes, per memory pair"
    );

    // A mixed batch whose entries into b's host buffer b refuses (the buffer was given a new
    // key: the old descriptor's no longer opens it) fails whole; every lane drains at both ends
    // and no notification is delivered for it.
    bc.rekey_buffer(pb::RekeyBufferRequest { buffer_id: dst[2].id })
        .await
        .unwrap();
    let r = ac
        .write_batch(pb::WriteBatchRequest {
            entries: entries
                .iter()
                .map(|&(s, so, d, doff, len)| write_entry(&src[s], so, &dst[d], doff, len))
                .collect(),
            notification: b"never".to_vec(),
            timeout_ms: 120_000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let e = wait(&mut ac, r.transfer_id).await;
    assert_ne!(e.status_code, 0, "{e:?}");
    assert!(
        e.status_message.contains("entries[2]") || e.status_message.contains("entries[3]"),
        "{e:?}"
    );
    assert_lanes_drain(&mut ac).await;
    assert_lanes_drain(&mut bc).await;
    // The next notification b's subscribers see is the next WRITE's.
    let id = write(&mut ac, write_entry(&src[2], 0, &dst[1], 0, 4096), b"after")
        .await
        .unwrap();
    wait_ok(&mut ac, id).await;
    let n = sub.message().await.unwrap().expect("a notification");
    assert_eq!((n.transfer_id, n.payload.as_slice()), (id, &b"after"[..]));

    for d in [&a, &b] {
        let log = d.log();
        assert!(!log.contains("NOT served"), "{}: {log}", d.node);
        assert!(!log.contains("rx no cmsg"), "{}: {log}", d.node);
    }
    assert_every_comm_served(&a, 4);
    assert_every_comm_served(&b, 4);
}
