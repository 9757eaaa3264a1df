//! The block bench (`tcpxctl bench transfer --blocks N --block-size S`): N blocks of S bytes per
//! transfer as block lists (WriteBlocks / ReadBlocks), beside one contiguous transfer of the same
//! N × S bytes between the same buffers, in the same run.
//!
//! Each side's buffer holds N blocks back to back and is registered as one strided list. The
//! block transfers pair source block `src[k]` with destination block `dst[k]`, two seeded
//! permutations of 0..N, so both sides are scattered (no two neighbours on either side stay
//! neighbours but by chance). Each transfer is started without waiting (its *posting* time:
//! until the daemon answered TransferStarted, which includes the API's and the engine's checks
//! and planning), then waited for (WaitTransfer); its latency runs from the start to the final
//! event. The two kinds alternate transfer by transfer (a contiguous one, then a block one), so
//! a drift of the machine during the run weighs on both alike. After the runs, every pair is
//! compared (the two buffers read back and compared block by block when they hold at most 1 GiB,
//! else 4,096 pairs checksummed); then one more contiguous transfer, after which the two buffers'
//! checksums must agree. `--scattered local|remote` permutes one side only.
//!
//! When N is at most a batch's 65,536 entries, a third kind runs in the same alternation: the
//! same pairs as one plain `WriteBatch` / `ReadBatch` of one buffer pair (entry k: block
//! `src[k]`'s offset to block `dst[k]`'s, as a client without block lists sends scattered KV
//! blocks), in the form `--batch-form` picks; its pairs are compared as the blocks' are, and the
//! row prints batch ÷ blocks beside scattered ÷ contiguous (issue 38, point 4).

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::daemon::{DaemonBenchError, DaemonPair, checksum, fill, register, release, rpc, transfer_failed};
use crate::bench::{LatencyStats, Memory, Op, SEED};
use crate::cli::output::Table;
use crate::client::{ApiClient, format_bytes};
use tcpxd::api::proto::v1::{
    self as pb, ReadBlocksRequest, ReadEntry, ReadRequest, RegisterBlocksRequest, ReleaseBlocksRequest,
    TransferStarted, WaitTransferRequest, WriteBlocksRequest, WriteEntry, WriteRequest, fill_buffer_request,
    register_blocks_request::Layout,
};
use tcpxd::engine::blocks::{IndexArray, MAX_LIST_BLOCKS, MAX_TRANSFER_BLOCKS};

/// Buffers up to this size are compared in full after the block runs.
const FULL_COMPARE_BYTES: u64 = 1 << 30;
/// Pairs checksummed when the buffers are larger.
const SAMPLED_PAIRS: u32 = 4096;

/// What the block bench moves.
#[derive(Debug, Clone)]
pub struct BlocksWorkload {
    pub op: Op,
    pub memory: Memory,
    pub peer_memory: Option<Memory>,
    pub blocks: u32,
    pub block_size: u64,
    pub iterations: u32,
    pub warmup: u32,
    pub seed: u64,
    /// Which sides' blocks are permuted (the other side's are in order: one run).
    pub scattered: Scattered,
    /// Also move the same pairs as one plain batch (`None`: not run).
    pub batch: Option<BatchForm>,
}

/// How the bench's plain batch carries its entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum BatchForm {
    /// `entries`: one WriteEntry / ReadEntry message per pair, each naming both buffers (what a
    /// client sends that builds entries one by one).
    Entries,
    /// `ranges`: one buffer pair and packed offset arrays (`BatchRanges`).
    #[default]
    Ranges,
}

/// The sides a block bench scatters: both (the default), or only the caller's (`local`: the
/// source of a WRITE) or only the peer's (`remote`), to tell the gather's cost from the scatter's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Scattered {
    #[default]
    Both,
    Local,
    Remote,
}

impl Scattered {
    pub fn describe(self) -> &'static str {
        match self {
            Scattered::Both => "both sides permuted",
            Scattered::Local => "local side permuted, remote in order",
            Scattered::Remote => "remote side permuted, local in order",
        }
    }
}

impl BlocksWorkload {
    pub fn validate(&self) -> Result<(), String> {
        if self.blocks == 0 || u64::from(self.blocks) > MAX_TRANSFER_BLOCKS {
            return Err(format!(
                "--blocks: {} is outside 1..={MAX_TRANSFER_BLOCKS} (the most one transfer may move)",
                self.blocks
            ));
        }
        if self.blocks > MAX_LIST_BLOCKS {
            return Err(format!("--blocks: over a list's {MAX_LIST_BLOCKS} blocks"));
        }
        if self.block_size == 0 || self.block_size > u64::from(u32::MAX) {
            return Err(format!(
                "--block-size: {} is outside 1..={} bytes",
                self.block_size,
                u32::MAX
            ));
        }
        if self.bytes() > crate::bench::MAX_BUFFER_BYTES {
            return Err(format!(
                "--blocks × --block-size: {} exceeds {} per side",
                format_bytes(self.bytes()),
                format_bytes(crate::bench::MAX_BUFFER_BYTES)
            ));
        }
        if self.iterations == 0 {
            return Err("--iters: at least one measured iteration is needed".into());
        }
        Ok(())
    }

    pub fn bytes(&self) -> u64 {
        u64::from(self.blocks) * self.block_size
    }
}

/// Posting times and latencies of one kind of transfer.
#[derive(Debug, Clone)]
pub struct Measured {
    pub posting: LatencyStats,
    pub latency: LatencyStats,
}

impl Measured {
    /// GB/s (10^9 bytes a second) over the measured transfers back to back.
    pub fn gbps(&self, bytes: u64, iterations: u32) -> f64 {
        let t = self.latency.total.as_secs_f64();
        if t > 0.0 {
            bytes as f64 * f64::from(iterations) / t / 1e9
        } else {
            0.0
        }
    }
}

/// The run's one row: the block transfers and the contiguous ones beside them.
#[derive(Debug, Clone)]
pub struct BlocksRow {
    pub workload: BlocksWorkload,
    pub blocks: Measured,
    pub contiguous: Measured,
    /// The same pairs as one plain batch, when run.
    pub batch: Option<Measured>,
    /// Every pair compared (or sampled) equal after the block runs, and the two buffers equal
    /// after the contiguous runs.
    pub verified: bool,
    /// How the block runs were checked: "all pairs" or "N sampled pairs".
    pub checked: String,
}

impl BlocksRow {
    pub fn ratio(&self) -> f64 {
        let w = &self.workload;
        let c = self.contiguous.gbps(w.bytes(), w.iterations);
        if c > 0.0 {
            self.blocks.gbps(w.bytes(), w.iterations) / c
        } else {
            0.0
        }
    }

    /// The plain batch's GB/s over the block transfers' (the same pairs), when the batch ran.
    pub fn batch_ratio(&self) -> Option<f64> {
        let w = &self.workload;
        let b = self.blocks.gbps(w.bytes(), w.iterations);
        let m = self.batch.as_ref()?;
        (b > 0.0).then(|| m.gbps(w.bytes(), w.iterations) / b)
    }

    /// The plain batch's GB/s over the contiguous transfers', when the batch ran.
    pub fn batch_contiguous_ratio(&self) -> Option<f64> {
        let w = &self.workload;
        let c = self.contiguous.gbps(w.bytes(), w.iterations);
        let m = self.batch.as_ref()?;
        (c > 0.0).then(|| m.gbps(w.bytes(), w.iterations) / c)
    }

    pub fn to_json(&self) -> Value {
        let w = &self.workload;
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        let side = |m: &Measured| {
            json!({
                "gbps": m.gbps(w.bytes(), w.iterations),
                "posting_p50_us": us(m.posting.p50),
                "posting_p99_us": us(m.posting.p99),
                "latency_p50_us": us(m.latency.p50),
                "latency_p99_us": us(m.latency.p99),
            })
        };
        json!({
            "harness": "daemon-blocks",
            "op": w.op.name(),
            "memory": w.memory.name(),
            "peer_memory": w.peer_memory.unwrap_or(w.memory).name(),
            "blocks": w.blocks,
            "block_size": w.block_size,
            "bytes": w.bytes(),
            "iterations": w.iterations,
            "seed": w.seed,
            "scattered_sides": format!("{:?}", w.scattered).to_lowercase(),
            "scattered": side(&self.blocks),
            "contiguous": side(&self.contiguous),
            "ratio": self.ratio(),
            "batch_form": w.batch.map(|f| format!("{f:?}").to_lowercase()),
            "batch": self.batch.as_ref().map(side),
            "batch_ratio": self.batch_ratio(),
            "batch_contiguous_ratio": self.batch_contiguous_ratio(),
            "verified": self.verified,
            "checked": self.checked,
        })
    }

    pub fn table(&self) -> Table {
        let w = &self.workload;
        let us = |d: Duration| format!("{:.1}", d.as_secs_f64() * 1e6);
        let mut t = Table::new([
            "op",
            "transfer",
            "blocks",
            "block size",
            "bytes",
            "GB/s",
            "posting p50 (us)",
            "posting p99 (us)",
            "p50 (us)",
            "p99 (us)",
        ]);
        let mut kinds = vec![("scattered", w.blocks, &self.blocks)];
        if let Some(b) = &self.batch {
            kinds.push(("batch", w.blocks, b));
        }
        kinds.push(("contiguous", 1, &self.contiguous));
        for (name, n, m) in kinds {
            t.row([
                w.op.name().to_string(),
                name.to_string(),
                n.to_string(),
                if n == 1 {
                    format_bytes(w.bytes())
                } else {
                    format_bytes(w.block_size)
                },
                format_bytes(w.bytes()),
                format!("{:.3}", m.gbps(w.bytes(), w.iterations)),
                us(m.posting.p50),
                us(m.posting.p99),
                us(m.latency.p50),
                us(m.latency.p99),
            ]);
        }
        t
    }
}

/// The permutation of 0..n a seed gives (splitmix64-driven Fisher–Yates): the same on every
/// machine, so runs can be compared.
pub fn permutation(n: u32, seed: u64) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n).collect();
    let mut x = seed;
    let mut next = || {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    for i in (1..v.len()).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v
}

/// Runs the block bench between a connected pair; the buffers and lists are released at the
/// end, whatever happened (when `stop` completes first, Ctrl-C, with
/// [`DaemonBenchError::Interrupted`]).
pub async fn run_blocks_bench(
    pair: &mut DaemonPair,
    w: &BlocksWorkload,
    stop: impl std::future::Future<Output = ()>,
) -> Result<BlocksRow, DaemonBenchError> {
    w.validate().map_err(DaemonBenchError::BadOption)?;
    let bytes = w.bytes();
    let label = |side: &str| format!("tcpxctl-bench-blocks-{}-{side}", std::process::id());
    let local = register(&mut pair.a, w.memory, bytes, &label("local"), "--endpoint").await?;
    let remote = match register(
        &mut pair.b,
        w.peer_memory.unwrap_or(w.memory),
        bytes,
        &label("remote"),
        "--peer-endpoint",
    )
    .await
    {
        Ok(r) => r,
        Err(e) => {
            let _ = release(&mut pair.a, local.id).await;
            return Err(e);
        }
    };
    // The lists go with their buffers.
    let outcome = tokio::select! {
        r = run(pair, w, &local, &remote) => r,
        () = stop => Err(DaemonBenchError::Interrupted),
    };
    if matches!(outcome, Err(DaemonBenchError::Interrupted)) {
        // A transfer cut short holds the buffers until the daemons end it.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let r1 = release(&mut pair.a, local.id).await;
    let r2 = release(&mut pair.b, remote.id).await;
    let row = outcome?;
    r1?;
    r2?;
    Ok(row)
}

async fn list(
    client: &mut ApiClient,
    buffer: u64,
    w: &BlocksWorkload,
) -> Result<pb::BlockList, DaemonBenchError> {
    client
        .register_blocks(RegisterBlocksRequest {
            reattach_id: Default::default(),
            buffer_id: buffer,
            layout: Some(Layout::Strided(pb::StridedBlocks {
                first: 0,
                stride: w.block_size,
                length: w.block_size as u32,
                count: w.blocks,
            })),
        })
        .await
        .map(tonic::Response::into_inner)
        .map_err(rpc(format!(
            "registering a list of {} blocks in buffer {buffer}",
            w.blocks
        )))
}

/// One transfer: started (the posting time), then waited for (the latency, from the start).
async fn timed(
    client: &mut ApiClient,
    what: &str,
    start: impl std::future::Future<Output = Result<tonic::Response<TransferStarted>, tonic::Status>>,
) -> Result<(Duration, Duration), DaemonBenchError> {
    let t0 = Instant::now();
    let started = start.await.map_err(rpc(what.to_string()))?.into_inner();
    let posted = t0.elapsed();
    let ev = client
        .wait_transfer(WaitTransferRequest {
            transfer_id: started.transfer_id,
        })
        .await
        .map_err(rpc(format!("waiting for the {what}")))?
        .into_inner();
    let done = t0.elapsed();
    if ev.status_code != 0 {
        return Err(transfer_failed(what.to_string(), ev));
    }
    Ok((posted, done))
}

async fn run(
    pair: &mut DaemonPair,
    w: &BlocksWorkload,
    local: &pb::Buffer,
    remote: &pb::Buffer,
) -> Result<BlocksRow, DaemonBenchError> {
    let bytes = w.bytes();
    let ll = list(&mut pair.a, local.id, w).await?;
    let rl = list(&mut pair.b, remote.id, w).await?;
    let (src_client, src_id) = match w.op {
        Op::Write => (&mut pair.a, local.id),
        Op::Read => (&mut pair.b, remote.id),
    };
    fill(
        src_client,
        src_id,
        0,
        0,
        fill_buffer_request::Pattern::Seed(SEED),
        "the source buffer",
    )
    .await?;
    let in_order = || (0..w.blocks).collect::<Vec<u32>>();
    let local_idx = match w.scattered {
        Scattered::Remote => in_order(),
        _ => permutation(w.blocks, w.seed),
    };
    let remote_idx = match w.scattered {
        Scattered::Local => in_order(),
        _ => permutation(w.blocks, w.seed.wrapping_add(1)),
    };
    let li = crate::client::pack_indices(&IndexArray::compact(&local_idx));
    let ri = crate::client::pack_indices(&IndexArray::compact(&remote_idx));
    let timeout_ms = 600_000;
    let batch = w.batch.map(|form| BatchPairs {
        form,
        local: local_idx.iter().map(|&i| u64::from(i) * w.block_size).collect(),
        remote: remote_idx.iter().map(|&i| u64::from(i) * w.block_size).collect(),
        length: w.block_size,
    });
    let ids = Ids {
        local_list: ll.id,
        local_indices: li,
        remote_token: rl.token.clone(),
        remote_indices: ri,
        local_buffer: local.id,
        remote_descriptor: remote.descriptor.clone(),
        bytes,
        timeout_ms,
        batch,
    };
    // The kinds alternate, transfer by transfer, so that a drift of the machine (the
    // contiguous p50 moved by 10% between runs on the H200s) weighs on both alike: a contiguous
    // transfer, then a block transfer, so the destination ends with the block transfers' bytes.
    // With the batch: contiguous, batch, blocks, so the destination ends with the blocks' bytes
    // (the batch's are checked after the first measured one: the same pairs, the same bytes).
    let (mut bp, mut bl, mut cp, mut cl) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut tp, mut tl) = (Vec::new(), Vec::new());
    let mut batch_checked = true;
    for k in 0..w.warmup + w.iterations {
        let (p, l) = contiguous_once(pair, w.op, &ids).await?;
        if ids.batch.is_some() {
            let (p3, l3) = batch_once(pair, w.op, &ids).await?;
            if k == w.warmup {
                batch_checked = pairs_equal(pair, w, local, remote, &local_idx, &remote_idx)
                    .await?
                    .0;
            }
            if k >= w.warmup {
                tp.push(p3);
                tl.push(l3);
            }
        }
        let (p2, l2) = blocks_once(pair, w.op, &ids).await?;
        if k >= w.warmup {
            cp.push(p);
            cl.push(l);
            bp.push(p2);
            bl.push(l2);
        }
    }
    let blocks = Measured {
        posting: LatencyStats::from_samples(&bp),
        latency: LatencyStats::from_samples(&bl),
    };
    let batch = ids.batch.as_ref().map(|_| Measured {
        posting: LatencyStats::from_samples(&tp),
        latency: LatencyStats::from_samples(&tl),
    });
    let (mut verified, checked) = pairs_equal(pair, w, local, remote, &local_idx, &remote_idx).await?;
    verified &= batch_checked;
    for l in [(&mut pair.a, ll.id), (&mut pair.b, rl.id)] {
        l.0.release_blocks(ReleaseBlocksRequest { list_id: l.1 })
            .await
            .map_err(rpc(format!("releasing list {}", l.1)))?;
    }

    // One more contiguous transfer: afterwards both buffers must hold the same bytes.
    contiguous_once(pair, w.op, &ids).await?;
    let a = checksum(&mut pair.a, local.id, bytes, "the local buffer").await?;
    let b = checksum(&mut pair.b, remote.id, bytes, "the remote buffer").await?;
    verified &= a == b;
    Ok(BlocksRow {
        workload: w.clone(),
        blocks,
        contiguous: Measured {
            posting: LatencyStats::from_samples(&cp),
            latency: LatencyStats::from_samples(&cl),
        },
        batch,
        verified,
        checked,
    })
}

/// Whether every pair's bytes are equal (source block `local_idx[k]` landed in `remote_idx[k]`
/// for a WRITE, the reverse for a READ): the buffers compared in full up to 1 GiB, else 4,096
/// pairs checksummed. Returns how they were checked.
async fn pairs_equal(
    pair: &DaemonPair,
    w: &BlocksWorkload,
    local: &pb::Buffer,
    remote: &pb::Buffer,
    local_idx: &[u32],
    remote_idx: &[u32],
) -> Result<(bool, String), DaemonBenchError> {
    let bytes = w.bytes();
    let (src_idx, dst_idx) = match w.op {
        Op::Write => (local_idx, remote_idx),
        Op::Read => (remote_idx, local_idx),
    };
    let (mut src_c, src_b, mut dst_c, dst_b) = match w.op {
        Op::Write => (pair.a.clone(), local.id, pair.b.clone(), remote.id),
        Op::Read => (pair.b.clone(), remote.id, pair.a.clone(), local.id),
    };
    if bytes <= FULL_COMPARE_BYTES {
        let s = read_all(&mut src_c, src_b, bytes).await?;
        let d = read_all(&mut dst_c, dst_b, bytes).await?;
        let bs = w.block_size as usize;
        let ok = src_idx.iter().zip(dst_idx).all(|(&a, &b)| {
            let (a, b) = (a as usize * bs, b as usize * bs);
            s[a..a + bs] == d[b..b + bs]
        });
        Ok((ok, "all pairs".to_string()))
    } else {
        let mut ok = true;
        let step = (w.blocks / SAMPLED_PAIRS).max(1);
        let mut n = 0;
        for k in (0..w.blocks).step_by(step as usize) {
            let (a, b) = (src_idx[k as usize], dst_idx[k as usize]);
            let ca = crc_at(&mut src_c, src_b, u64::from(a) * w.block_size, w.block_size).await?;
            let cb = crc_at(&mut dst_c, dst_b, u64::from(b) * w.block_size, w.block_size).await?;
            ok &= ca == cb;
            n += 1;
        }
        Ok((ok, format!("{n} sampled pairs")))
    }
}

/// The bench's plain batch: entry k moves `length` bytes between `local[k]` and `remote[k]`.
struct BatchPairs {
    form: BatchForm,
    local: Vec<u64>,
    remote: Vec<u64>,
    length: u64,
}

/// Little-endian u64s, as `BatchRanges` packs offsets.
fn packed(v: &[u64]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// One plain batch of the bench's pairs (WriteBatch / ReadBatch): its posting time and latency.
/// The request is built before the clock starts, as the block transfers' are.
async fn batch_once(
    pair: &mut DaemonPair,
    op: Op,
    ids: &Ids,
) -> Result<(Duration, Duration), DaemonBenchError> {
    let b = ids.batch.as_ref().expect("the batch runs");
    let mut caller = pair.a.clone();
    let ranges = (b.form == BatchForm::Ranges).then(|| pb::BatchRanges {
        local_buffer_id: ids.local_buffer,
        remote_descriptor: ids.remote_descriptor.clone(),
        local_offsets: packed(&b.local),
        remote_offsets: packed(&b.remote),
        lengths: Vec::new(),
        uniform_length: b.length,
    });
    let pairs = || b.local.iter().zip(&b.remote);
    match op {
        Op::Write => {
            let entries = match b.form {
                BatchForm::Ranges => Vec::new(),
                BatchForm::Entries => pairs()
                    .map(|(&l, &r)| WriteEntry {
                        local_buffer_id: ids.local_buffer,
                        local_offset: l,
                        remote_descriptor: ids.remote_descriptor.clone(),
                        remote_offset: r,
                        length: b.length,
                    })
                    .collect(),
            };
            let req = pb::WriteBatchRequest {
                entries,
                ranges,
                timeout_ms: ids.timeout_ms,
                ..Default::default()
            };
            timed(&mut pair.a, "batch write", caller.write_batch(req)).await
        }
        Op::Read => {
            let entries = match b.form {
                BatchForm::Ranges => Vec::new(),
                BatchForm::Entries => pairs()
                    .map(|(&l, &r)| ReadEntry {
                        remote_descriptor: ids.remote_descriptor.clone(),
                        remote_offset: r,
                        local_buffer_id: ids.local_buffer,
                        local_offset: l,
                        length: b.length,
                    })
                    .collect(),
            };
            let req = pb::ReadBatchRequest {
                entries,
                ranges,
                timeout_ms: ids.timeout_ms,
                ..Default::default()
            };
            timed(&mut pair.a, "batch read", caller.read_batch(req)).await
        }
    }
}

/// What each transfer of a block bench names.
struct Ids {
    local_list: u64,
    local_indices: pb::BlockIndices,
    remote_token: String,
    remote_indices: pb::BlockIndices,
    local_buffer: u64,
    remote_descriptor: String,
    bytes: u64,
    timeout_ms: u64,
    batch: Option<BatchPairs>,
}

/// One block transfer (WriteBlocks / ReadBlocks): its posting time and latency.
async fn blocks_once(
    pair: &mut DaemonPair,
    op: Op,
    ids: &Ids,
) -> Result<(Duration, Duration), DaemonBenchError> {
    let mut caller = pair.a.clone();
    match op {
        Op::Write => {
            let req = WriteBlocksRequest {
                local_list_id: ids.local_list,
                local_indices: Some(ids.local_indices.clone()),
                remote_token: ids.remote_token.clone(),
                remote_indices: Some(ids.remote_indices.clone()),
                timeout_ms: ids.timeout_ms,
                ..Default::default()
            };
            timed(&mut pair.a, "block write", caller.write_blocks(req)).await
        }
        Op::Read => {
            let req = ReadBlocksRequest {
                remote_token: ids.remote_token.clone(),
                remote_indices: Some(ids.remote_indices.clone()),
                local_list_id: ids.local_list,
                local_indices: Some(ids.local_indices.clone()),
                timeout_ms: ids.timeout_ms,
                wait: false,
            };
            timed(&mut pair.a, "block read", caller.read_blocks(req)).await
        }
    }
}

/// One contiguous transfer of the same bytes between the same buffers (Write / Read).
async fn contiguous_once(
    pair: &mut DaemonPair,
    op: Op,
    ids: &Ids,
) -> Result<(Duration, Duration), DaemonBenchError> {
    let mut caller = pair.a.clone();
    match op {
        Op::Write => {
            let req = WriteRequest {
                entry: Some(WriteEntry {
                    local_buffer_id: ids.local_buffer,
                    local_offset: 0,
                    remote_descriptor: ids.remote_descriptor.clone(),
                    remote_offset: 0,
                    length: ids.bytes,
                }),
                timeout_ms: ids.timeout_ms,
                ..Default::default()
            };
            timed(&mut pair.a, "contiguous write", caller.write(req)).await
        }
        Op::Read => {
            let req = ReadRequest {
                entry: Some(ReadEntry {
                    remote_descriptor: ids.remote_descriptor.clone(),
                    remote_offset: 0,
                    local_buffer_id: ids.local_buffer,
                    local_offset: 0,
                    length: ids.bytes,
                }),
                timeout_ms: ids.timeout_ms,
                wait: false,
            };
            timed(&mut pair.a, "contiguous read", caller.read(req)).await
        }
    }
}

async fn read_all(client: &mut ApiClient, buffer: u64, bytes: u64) -> Result<Vec<u8>, DaemonBenchError> {
    let mut out = Vec::with_capacity(bytes as usize);
    let mut off = 0;
    while off < bytes {
        let n = (bytes - off).min(1 << 20);
        let r = client
            .read_buffer(pb::ReadBufferRequest {
                buffer_id: buffer,
                offset: off,
                length: n,
            })
            .await
            .map_err(rpc(format!("reading buffer {buffer} back")))?
            .into_inner();
        out.extend_from_slice(&r.data);
        off += n;
    }
    Ok(out)
}

async fn crc_at(
    client: &mut ApiClient,
    buffer: u64,
    offset: u64,
    length: u64,
) -> Result<u32, DaemonBenchError> {
    Ok(client
        .checksum_buffer(pb::ChecksumBufferRequest {
            buffer_id: buffer,
            offset,
            length,
        })
        .await
        .map_err(rpc(format!("checksumming buffer {buffer}")))?
        .into_inner()
        .crc32c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutations_are_seeded_and_complete() {
        let p = permutation(1000, 1);
        assert_eq!(p, permutation(1000, 1));
        assert_ne!(p, permutation(1000, 2));
        let mut s = p.clone();
        s.sort_unstable();
        assert_eq!(s, (0..1000).collect::<Vec<_>>());
        let neighbours = p.windows(2).filter(|w| w[1] == w[0] + 1).count();
        assert!(neighbours < 10, "scattered: {neighbours} neighbours kept");
    }

    #[test]
    fn workloads_name_the_option_at_fault() {
        let w = BlocksWorkload {
            op: Op::Write,
            memory: Memory::Host,
            peer_memory: None,
            blocks: 1000,
            block_size: 4096,
            iterations: 5,
            warmup: 1,
            seed: 1,
            scattered: Scattered::Both,
            batch: Some(BatchForm::Ranges),
        };
        assert!(w.validate().is_ok());
        let bad = |f: fn(&mut BlocksWorkload), want: &str| {
            let mut x = w.clone();
            f(&mut x);
            let e = x.validate().unwrap_err();
            assert!(e.starts_with(want), "{e}");
        };
        bad(|x| x.blocks = 0, "--blocks");
        bad(|x| x.blocks = 5_000_000, "--blocks");
        bad(|x| x.block_size = 0, "--block-size");
        bad(|x| x.block_size = 1 << 33, "--block-size");
        bad(|x| x.iterations = 0, "--iters");
        bad(
            |x| {
                x.blocks = 1 << 22;
                x.block_size = 1 << 20
            },
            "--blocks × --block-size",
        );
    }
}
