//! The daemon bench: transfers between two running daemons through the client API, measured by
//! the client as users see them.
//!
//! Daemon A (`--endpoint`) issues every transfer: a WRITE moves A's local buffer into B's, a READ
//! moves B's buffer into A's. Each side's buffer is registered once (largest block size × batch
//! size), the source filled once with a seeded pattern. Per block size: the destination range is
//! zeroed, the warm-up and measured transfers run one after the other (`Write`/`Read` for a batch
//! of 1, `WriteBatch`/`ReadBatch` with `batch` entries otherwise, block `i` at offset
//! `i × size`), then the source and destination ranges are checksummed (CRC-32C) once. A
//! transfer's latency runs from just before the start RPC to the reply of `WaitTransfer` (the
//! API's completion path with no polling). The buffers are released at the end, whatever happened.

use std::time::{Duration, Instant};

use tonic::Status;

use crate::api::proto::v1::register_buffer_request::Source;
use crate::api::proto::v1::{
    ChecksumBufferRequest, ConnectPeerRequest, CudaAllocation, FillBufferRequest, GetStatsRequest,
    HostAllocation, ListPeersRequest, PeerState, ReadBatchRequest, ReadEntry, ReadRequest,
    RegisterBufferRequest, ReleaseBufferRequest, WaitTransferRequest, WriteBatchRequest, WriteEntry,
    WriteRequest, fill_buffer_request,
};
use crate::bench::{BenchRow, Harness, LatencyStats, Memory, Op, SEED, Workload};
use crate::client::ApiClient;
use crate::client::{code_and_message, code_number_name, status_line};

/// How long ConnectPeer may leave the peer CONNECTING.
const PEER_UP_TIMEOUT: Duration = Duration::from_secs(30);

/// Why the daemon bench failed.
#[derive(Debug, thiserror::Error)]
pub enum DaemonBenchError {
    #[error("bad option: {0}")]
    BadOption(String),
    #[error("{what} failed: {}", status_line(status))]
    Rpc { what: String, status: Status },
    #[error("{what} failed: {}{entries}", code_and_message(&code_number_name(*code), message))]
    Transfer {
        what: String,
        code: i32,
        message: String,
        entries: String,
    },
    #[error("{0}")]
    Peer(String),
    #[error("interrupted; the bench's buffers were released")]
    Interrupted,
}

fn rpc(what: impl Into<String>) -> impl FnOnce(Status) -> DaemonBenchError {
    let what = what.into();
    move |status| DaemonBenchError::Rpc { what, status }
}

/// The two daemons: A issues the transfers, B is the peer.
pub struct DaemonPair {
    pub a: ApiClient,
    pub b: ApiClient,
    /// The chunk size the daemons use, when the caller knows it (it started them).
    pub chunk_bytes: Option<u32>,
}

/// Makes sure A has B as an UP peer: connects to `peer_address` when given (and waits for UP),
/// else checks that A already knows B. Returns B's node id and the lanes A has to it.
pub async fn ensure_peer(
    pair: &mut DaemonPair,
    peer_address: Option<&str>,
) -> Result<(String, u32), DaemonBenchError> {
    let b_node = pair
        .b
        .get_stats(GetStatsRequest {})
        .await
        .map_err(rpc("asking the peer daemon (--peer-endpoint) for its node id"))?
        .into_inner()
        .node_id;
    let a_node = pair
        .a
        .get_stats(GetStatsRequest {})
        .await
        .map_err(rpc("asking the daemon (--endpoint) for its node id"))?
        .into_inner()
        .node_id;
    if a_node == b_node {
        return Err(DaemonBenchError::BadOption(format!(
            "--endpoint and --peer-endpoint reach the same node ({a_node}); give two daemons"
        )));
    }
    if let Some(addr) = peer_address {
        pair.a
            .connect_peer(ConnectPeerRequest {
                address: addr.to_string(),
            })
            .await
            .map_err(rpc(format!("connecting {a_node} to {b_node} at {addr}")))?;
    }
    let deadline = Instant::now() + PEER_UP_TIMEOUT;
    loop {
        let peers = pair
            .a
            .list_peers(ListPeersRequest {})
            .await
            .map_err(rpc(format!("listing {a_node}'s peers")))?
            .into_inner()
            .peers;
        match peers.iter().find(|p| p.node_id == b_node) {
            Some(p) if p.state == PeerState::Up as i32 => return Ok((b_node, p.lanes)),
            Some(p) if p.state == PeerState::Failed as i32 => {
                return Err(DaemonBenchError::Peer(format!(
                    "{a_node}'s link to {b_node} failed: {}",
                    p.error
                )));
            }
            None if peer_address.is_none() => {
                return Err(DaemonBenchError::Peer(format!(
                    "{a_node} is not connected to {b_node}; pass --peer-address with {b_node}'s peer \
                     address (host:port) to connect them"
                )));
            }
            _ => {}
        }
        if Instant::now() >= deadline {
            return Err(DaemonBenchError::Peer(format!(
                "{a_node}'s link to {b_node} is still not UP after {} s",
                PEER_UP_TIMEOUT.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs the daemon bench between an already connected pair (see [`ensure_peer`]). When `stop`
/// completes first (Ctrl-C), the run ends with [`DaemonBenchError::Interrupted`] after releasing
/// its buffers.
pub async fn run_daemon_bench(
    pair: &mut DaemonPair,
    workload: &Workload,
    lanes: Option<u32>,
    progress: &indicatif::ProgressBar,
    stop: impl std::future::Future<Output = ()>,
) -> Result<Vec<BenchRow>, DaemonBenchError> {
    workload.validate().map_err(DaemonBenchError::BadOption)?;
    let bytes = workload.buffer_bytes();
    let label = |side: &str| format!("tcpxctl-bench-{}-{side}", std::process::id());
    let local = register(&mut pair.a, workload.memory, bytes, &label("local"), "--endpoint").await?;
    let remote = match register(
        &mut pair.b,
        workload.peer_memory.unwrap_or(workload.memory),
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
    let outcome = tokio::select! {
        r = run_sizes(pair, workload, lanes, progress, &local, &remote) => r,
        () = stop => Err(DaemonBenchError::Interrupted),
    };
    if matches!(outcome, Err(DaemonBenchError::Interrupted)) {
        // A transfer cut short still holds the buffers until it ends (its deadline at worst).
        let (mut a, mut b) = (pair.a.clone(), pair.b.clone());
        for _ in 0..50 {
            let busy = |s: Result<tonic::Response<crate::api::proto::v1::Stats>, Status>| {
                s.map(|s| s.into_inner().active_transfers > 0).unwrap_or(false)
            };
            if !busy(a.get_stats(GetStatsRequest {}).await) && !busy(b.get_stats(GetStatsRequest {}).await) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // Released whatever happened; a release failure is worth knowing only if the run succeeded.
    let r1 = release(&mut pair.a, local.id).await;
    let r2 = release(&mut pair.b, remote.id).await;
    let rows = outcome?;
    r1?;
    r2?;
    Ok(rows)
}

async fn run_sizes(
    pair: &mut DaemonPair,
    w: &Workload,
    lanes: Option<u32>,
    progress: &indicatif::ProgressBar,
    local: &crate::api::proto::v1::Buffer,
    remote: &crate::api::proto::v1::Buffer,
) -> Result<Vec<BenchRow>, DaemonBenchError> {
    // The source is filled once; the destination range is zeroed before each size.
    let (src_client, src_id, src_name) = match w.op {
        Op::Write => (&mut pair.a, local.id, "the local buffer"),
        Op::Read => (&mut pair.b, remote.id, "the remote buffer"),
    };
    fill(
        src_client,
        src_id,
        0,
        0,
        fill_buffer_request::Pattern::Seed(SEED),
        src_name,
    )
    .await?;
    let mut rows = Vec::new();
    for &size in &w.sizes {
        progress.set_message(crate::client::format_bytes(size));
        let span = size * u64::from(w.batch);
        let (dst_client, dst_id, dst_name) = match w.op {
            Op::Write => (&mut pair.b, remote.id, "the remote buffer"),
            Op::Read => (&mut pair.a, local.id, "the local buffer"),
        };
        fill(
            dst_client,
            dst_id,
            0,
            span,
            fill_buffer_request::Pattern::Byte(0),
            dst_name,
        )
        .await?;
        let request = TransferRequest::new(w.op, w.batch, size, local.id, &remote.descriptor);
        let mut latencies = Vec::with_capacity(w.iterations as usize);
        for i in 0..(w.warmup + w.iterations) {
            let req = request.clone();
            let t0 = Instant::now();
            let id = req.start(&mut pair.a).await?;
            let ev = pair
                .a
                .wait_transfer(WaitTransferRequest { transfer_id: id })
                .await
                .map_err(rpc(format!("waiting for transfer {id}")))?
                .into_inner();
            let elapsed = t0.elapsed();
            if ev.status_code != 0 {
                let entries = ev
                    .entries
                    .iter()
                    .enumerate()
                    .filter(|(_, e)| e.code != 0)
                    .take(4)
                    .map(|(i, e)| {
                        format!(
                            "\n  entries[{i}]: {}",
                            code_and_message(&code_number_name(e.code), &e.message)
                        )
                    })
                    .collect();
                return Err(DaemonBenchError::Transfer {
                    what: format!("{} of {} × {size} bytes (transfer {id})", w.op.name(), w.batch),
                    code: ev.status_code,
                    message: ev.status_message,
                    entries,
                });
            }
            if i >= w.warmup {
                latencies.push(elapsed);
            }
            progress.inc(1);
        }
        let a = checksum(&mut pair.a, local.id, span, "the local buffer").await?;
        let b = checksum(&mut pair.b, remote.id, span, "the remote buffer").await?;
        rows.push(BenchRow {
            harness: Harness::Daemon,
            op: w.op,
            memory: w.memory,
            block_size: size,
            batch_size: w.batch,
            iterations: w.iterations,
            warmup: w.warmup,
            latency: LatencyStats::from_samples(&latencies),
            verified: a == b,
            chunk_bytes: pair.chunk_bytes,
            lanes,
        });
    }
    Ok(rows)
}

/// One transfer's start request, built once per size and cloned per iteration (outside the
/// timed part).
#[derive(Clone)]
enum TransferRequest {
    Write(WriteRequest),
    Read(ReadRequest),
    WriteBatch(WriteBatchRequest),
    ReadBatch(ReadBatchRequest),
}

impl TransferRequest {
    fn new(op: Op, batch: u32, size: u64, local: u64, descriptor: &str) -> TransferRequest {
        let write = |i: u64| WriteEntry {
            local_buffer_id: local,
            local_offset: i * size,
            remote_descriptor: descriptor.to_string(),
            remote_offset: i * size,
            length: size,
        };
        let read = |i: u64| ReadEntry {
            remote_descriptor: descriptor.to_string(),
            remote_offset: i * size,
            local_buffer_id: local,
            local_offset: i * size,
            length: size,
        };
        match (op, batch) {
            (Op::Write, 1) => TransferRequest::Write(WriteRequest {
                entry: Some(write(0)),
                ..WriteRequest::default()
            }),
            (Op::Read, 1) => TransferRequest::Read(ReadRequest {
                entry: Some(read(0)),
                timeout_ms: 0,
            }),
            (Op::Write, n) => TransferRequest::WriteBatch(WriteBatchRequest {
                entries: (0..u64::from(n)).map(write).collect(),
                ..WriteBatchRequest::default()
            }),
            (Op::Read, n) => TransferRequest::ReadBatch(ReadBatchRequest {
                entries: (0..u64::from(n)).map(read).collect(),
                timeout_ms: 0,
            }),
        }
    }

    /// Starts the transfer; its id.
    async fn start(self, client: &mut ApiClient) -> Result<u64, DaemonBenchError> {
        let r = match self {
            TransferRequest::Write(r) => client.write(r).await.map_err(rpc("starting a WRITE"))?,
            TransferRequest::Read(r) => client.read(r).await.map_err(rpc("starting a READ"))?,
            TransferRequest::WriteBatch(r) => client
                .write_batch(r)
                .await
                .map_err(rpc("starting a WRITE batch"))?,
            TransferRequest::ReadBatch(r) => {
                client.read_batch(r).await.map_err(rpc("starting a READ batch"))?
            }
        };
        Ok(r.into_inner().transfer_id)
    }
}

async fn register(
    client: &mut ApiClient,
    memory: Memory,
    size: u64,
    label: &str,
    which: &str,
) -> Result<crate::api::proto::v1::Buffer, DaemonBenchError> {
    let source = match memory {
        Memory::Host => Source::Host(HostAllocation { size }),
        Memory::Cuda(device) => Source::Cuda(CudaAllocation { device, size }),
    };
    client
        .register_buffer(RegisterBufferRequest {
            source: Some(source),
            label: label.to_string(),
        })
        .await
        .map(tonic::Response::into_inner)
        .map_err(rpc(format!(
            "registering a {} {} buffer on the {which} daemon",
            crate::client::format_bytes(size),
            memory.name()
        )))
}

async fn release(client: &mut ApiClient, id: u64) -> Result<(), DaemonBenchError> {
    client
        .release_buffer(ReleaseBufferRequest { buffer_id: id })
        .await
        .map(|_| ())
        .map_err(rpc(format!("releasing buffer {id}")))
}

async fn fill(
    client: &mut ApiClient,
    id: u64,
    offset: u64,
    length: u64,
    pattern: fill_buffer_request::Pattern,
    name: &str,
) -> Result<(), DaemonBenchError> {
    client
        .fill_buffer(FillBufferRequest {
            buffer_id: id,
            offset,
            length,
            pattern: Some(pattern),
        })
        .await
        .map(|_| ())
        .map_err(rpc(format!("filling {name} (buffer {id})")))
}

async fn checksum(
    client: &mut ApiClient,
    id: u64,
    length: u64,
    name: &str,
) -> Result<(u32, u64), DaemonBenchError> {
    let r = client
        .checksum_buffer(ChecksumBufferRequest {
            buffer_id: id,
            offset: 0,
            length,
        })
        .await
        .map_err(rpc(format!("checksumming {name} (buffer {id})")))?
        .into_inner();
    Ok((r.crc32c, r.length))
}
