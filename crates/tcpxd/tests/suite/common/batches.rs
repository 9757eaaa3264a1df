//! Batches of many small scattered entries in one buffer pair (daemon_batches, daemon_gpu_batches):
//! the entries, the expected bytes, whole-buffer reads and the lanes' chunk counts.

use super::daemons::{Client, assert_lanes_drain, read_entry, wait_ok, write_entry};
use tcpxd::api::proto::v1 as pb;
use tcpxd_testkit::Rng;

pub const SIZE: u64 = 4 << 20;

/// How a batch carries its entries: one message each, or packed arrays of one buffer pair
/// (`BatchRanges`: the final event then has no per-entry statuses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    Entries,
    Ranges,
}

fn packed(v: impl Iterator<Item = u64>) -> Vec<u8> {
    v.flat_map(u64::to_le_bytes).collect()
}

/// `list`'s `(local offset, remote offset, length)` as packed ranges (varying lengths).
pub fn ranges(local: &pb::Buffer, remote: &pb::Buffer, list: &[(u64, u64, u64)]) -> pb::BatchRanges {
    pb::BatchRanges {
        local_buffer_id: local.id,
        remote_descriptor: remote.descriptor.clone(),
        local_offsets: packed(list.iter().map(|e| e.0)),
        remote_offsets: packed(list.iter().map(|e| e.1)),
        lengths: packed(list.iter().map(|e| e.2)),
        uniform_length: 0,
    }
}
pub const ENTRIES: usize = 600;

/// A batch's entries: `(source offset, destination offset, length)`.
pub type List = Vec<(u64, u64, u64)>;

/// `(source offset, destination offset, length)` of `ENTRIES` entries: destinations in distinct
/// 6 KiB slots of the buffer in shuffled order at odd offsets, sources anywhere (they may
/// overlap), lengths 1 to 5000 bytes.
pub fn entries(seed: u64) -> Vec<(u64, u64, u64)> {
    let mut rng = Rng::new(seed);
    let slot = 6144u64;
    let mut slots: Vec<u64> = (0..SIZE / slot).collect();
    for i in (1..slots.len()).rev() {
        slots.swap(i, rng.below(i as u64 + 1) as usize);
    }
    slots
        .iter()
        .take(ENTRIES)
        .map(|&s| {
            let len = 1 + rng.below(5000);
            let dst = s * slot + rng.below(slot - len + 1);
            let src = rng.below(SIZE - len + 1);
            (src, dst, len)
        })
        .collect()
}

pub async fn bytes(c: &mut Client, id: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(SIZE as usize);
    let step = 1 << 20;
    for off in (0..SIZE).step_by(step as usize) {
        let r = c
            .read_buffer(pb::ReadBufferRequest {
                buffer_id: id,
                offset: off,
                length: step,
            })
            .await
            .expect("read buffer")
            .into_inner();
        out.extend_from_slice(&r.data);
    }
    out
}

pub fn expect(src: &[u8], dst: &[u8], list: &[(u64, u64, u64)]) -> Vec<u8> {
    let mut want = dst.to_vec();
    for &(s, d, l) in list {
        want[d as usize..(d + l) as usize].copy_from_slice(&src[s as usize..(s + l) as usize]);
    }
    want
}

/// The chunks a daemon has sent and received on all its lanes.
pub async fn chunks(c: &mut Client) -> (u64, u64) {
    let s = c.get_stats(pb::GetStatsRequest {}).await.unwrap().into_inner();
    s.peers
        .iter()
        .flat_map(|p| &p.lanes)
        .fold((0, 0), |(a, b), l| (a + l.chunks_sent, b + l.chunks_received))
}

pub fn first_difference(got: &[u8], want: &[u8]) -> String {
    match got.iter().zip(want).position(|(a, b)| a != b) {
        Some(i) => format!("first difference at byte {i}: {} != {}", got[i], want[i]),
        None => format!("lengths {} and {}", got.len(), want.len()),
    }
}

/// A WRITE batch of [`ENTRIES`] scattered entries from `src` (on `ac`'s node) into `dst` (on
/// `bc`'s), then a READ batch of other entries from `dst` into `back`: every byte of the
/// destinations compared with a per-entry copy, the batches coalesced (far fewer chunks than
/// entries), the lanes at rest afterwards on both nodes, the read's source unchanged. `form`: how
/// both batches carry their entries.
pub async fn write_then_read(
    ac: &mut Client,
    bc: &mut Client,
    bufs: (&pb::Buffer, &pb::Buffer, &pb::Buffer),
    tag: &str,
    form: Form,
) {
    let lists = (entries(0x9e37_79b9), entries(0x7f4a_7c15));
    write_then_read_lists(ac, bc, bufs, tag, form, lists).await;
}

/// [`write_then_read`] of the given `(source, destination, length)` lists: the WRITE's, then the
/// READ's (its sources in `dst`, its destinations in `back`).
pub async fn write_then_read_lists(
    ac: &mut Client,
    bc: &mut Client,
    (src, back, dst): (&pb::Buffer, &pb::Buffer, &pb::Buffer),
    tag: &str,
    form: Form,
    (list, read_list): (List, List),
) {
    // WRITE: a's scattered source entries into b's scattered destination entries.
    let count = list.len();
    let (s0, d0) = (bytes(ac, src.id).await, bytes(bc, dst.id).await);
    let want = expect(&s0, &d0, &list);
    let (sent0, _) = chunks(ac).await;
    let id = ac
        .write_batch(match form {
            Form::Entries => pb::WriteBatchRequest {
                entries: list
                    .iter()
                    .map(|&(s, d, l)| write_entry(src, s, dst, d, l))
                    .collect(),
                timeout_ms: 60_000,
                ..Default::default()
            },
            Form::Ranges => pb::WriteBatchRequest {
                ranges: Some(ranges(src, dst, &list)),
                timeout_ms: 60_000,
                ..Default::default()
            },
        })
        .await
        .expect("write batch")
        .into_inner()
        .transfer_id;
    let ev = wait_ok(ac, id).await;
    let total: u64 = list.iter().map(|e| e.2).sum();
    assert_eq!(ev.total_bytes, total);
    let statuses = match form {
        Form::Entries => count,
        Form::Ranges => 0,
    };
    assert_eq!(ev.entries.len(), statuses);
    let got = bytes(bc, dst.id).await;
    assert!(got == want, "{tag}: write: {}", first_difference(&got, &want));
    let (sent1, _) = chunks(ac).await;
    assert!(
        sent1 - sent0 < count as u64 / 4,
        "{tag}: {} chunks for {count} entries: the batch was not coalesced",
        sent1 - sent0
    );
    assert_lanes_drain(ac).await;
    assert_lanes_drain(bc).await;

    // READ: b's scattered entries back into a's scattered entries (other offsets).
    let list = read_list;
    let count = list.len();
    let statuses = match form {
        Form::Entries => count,
        Form::Ranges => 0,
    };
    let (s0, d0) = (bytes(bc, dst.id).await, bytes(ac, back.id).await);
    let want = expect(&s0, &d0, &list);
    let (_, recv0) = chunks(ac).await;
    let id = ac
        .read_batch(match form {
            Form::Entries => pb::ReadBatchRequest {
                entries: list
                    .iter()
                    .map(|&(s, d, l)| read_entry(dst, s, back, d, l))
                    .collect(),
                timeout_ms: 60_000,
                ..Default::default()
            },
            Form::Ranges => pb::ReadBatchRequest {
                // Local: the destination `back`; remote: the source `dst`.
                ranges: Some(ranges(
                    back,
                    dst,
                    &list.iter().map(|&(s, d, l)| (d, s, l)).collect::<Vec<_>>(),
                )),
                timeout_ms: 60_000,
                ..Default::default()
            },
        })
        .await
        .expect("read batch")
        .into_inner()
        .transfer_id;
    let ev = wait_ok(ac, id).await;
    assert_eq!(ev.entries.len(), statuses);
    let got = bytes(ac, back.id).await;
    assert!(got == want, "{tag}: read: {}", first_difference(&got, &want));
    let (_, recv1) = chunks(ac).await;
    assert!(
        recv1 - recv0 < count as u64 / 4,
        "{tag}: {} chunks for {count} entries: the batch was not coalesced",
        recv1 - recv0
    );
    assert_lanes_drain(ac).await;
    assert_lanes_drain(bc).await;
    // The read's source did not change.
    assert!(bytes(bc, dst.id).await == s0, "{tag}: a read changed its source");
}
