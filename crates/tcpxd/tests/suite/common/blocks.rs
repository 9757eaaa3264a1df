//! Block lists as the suite's block tests use them (`daemon_blocks`, `daemon_gather_ahead`,
//! `daemon_client_pages`, `daemon_same_node`, `daemon_prepared`, `daemon_gpu_batches`): index
//! arrays, permutations, layouts, registrations, and WriteBlocks / ReadBlocks requests.

use tcpxd::api::proto::v1 as pb;
use tcpxd::api::proto::v1::register_blocks_request::Layout;

use super::daemons::Client;

/// Block indices as packed little-endian u32s.
pub fn u32s(v: &[u32]) -> pb::BlockIndices {
    pb::BlockIndices {
        encoding: pb::IndexEncoding::U32 as i32,
        data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// The permutation of 0..n a seed gives (a small LCG-driven Fisher-Yates): the same on every call
/// with one seed.
pub fn permutation(n: u32, seed: u64) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n).collect();
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let j = ((x >> 33) % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v
}

/// `count` blocks of `length` bytes, the first at `first`, `stride` apart.
pub fn strided(first: u64, stride: u64, length: u32, count: u32) -> Layout {
    Layout::Strided(pb::StridedBlocks {
        first,
        stride,
        length,
        count,
    })
}

/// Registers a block list of `buffer`; the daemon's answer as it is.
pub async fn register(c: &mut Client, buffer: u64, layout: Layout) -> Result<pb::BlockList, tonic::Status> {
    c.register_blocks(pb::RegisterBlocksRequest {
        reattach_id: Default::default(),
        buffer_id: buffer,
        layout: Some(layout),
    })
    .await
    .map(|r| r.into_inner())
}

/// Registers a block list of `buffer`, which must succeed.
pub async fn list(c: &mut Client, buffer: u64, layout: Layout) -> pb::BlockList {
    register(c, buffer, layout).await.expect("register blocks")
}

/// A WriteBlocks of `local`'s blocks `li` into `remote`'s blocks `ri` (60 s deadline); `wait`:
/// the answer carries the final event.
pub fn write_request(
    local: &pb::BlockList,
    li: pb::BlockIndices,
    remote: &pb::BlockList,
    ri: pb::BlockIndices,
    wait: bool,
) -> pb::WriteBlocksRequest {
    pb::WriteBlocksRequest {
        local_list_id: local.id,
        local_indices: Some(li),
        remote_token: remote.token.clone(),
        remote_indices: Some(ri),
        timeout_ms: 60_000,
        wait,
        ..Default::default()
    }
}

/// A ReadBlocks of `remote`'s blocks `ri` into `local`'s blocks `li`, as [`write_request`].
pub fn read_request(
    remote: &pb::BlockList,
    ri: pb::BlockIndices,
    local: &pb::BlockList,
    li: pb::BlockIndices,
    wait: bool,
) -> pb::ReadBlocksRequest {
    pb::ReadBlocksRequest {
        remote_token: remote.token.clone(),
        remote_indices: Some(ri),
        local_list_id: local.id,
        local_indices: Some(li),
        timeout_ms: 60_000,
        wait,
    }
}
