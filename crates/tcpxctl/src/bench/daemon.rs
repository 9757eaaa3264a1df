//! The daemon bench: transfers between two running daemons through the client API, measured by
//! the client as users see them.
//!
//! Daemon A (`--endpoint`) issues every transfer: a WRITE moves A's local buffer into B's, a READ
//! moves B's buffer into A's. Each side's buffer is registered once (largest block size × batch
//! size × concurrency), the source filled once with a seeded pattern. Per block size: the
//! destination range is zeroed, then one `Session` stream carries the warm-up and measured
//! transfers (`write`/`read` for a batch of 1, `write_batch`/`read_batch` with `batch` entries
//! otherwise), `concurrency` of them in flight at once: transfer `k` uses slot
//! `k % concurrency`, block `i` of it at offset `(slot × batch + i) × size` on both sides. Then
//! the source and destination ranges are checksummed (CRC-32C) once. A transfer's latency runs
//! from just before its request is handed to the stream to the arrival of its `finished` event
//! (one client round trip, no polling). The buffers are released at the end, whatever happened.
//!
//! The transfers go on a gRPC `Session` stream (harness `daemon`), or with `--via local` on a
//! framed local session on A's API unix socket (harness `daemon-local`: the crossing the Python
//! package's client uses, `local_session.rs`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tonic::Status;

use crate::bench::local_session::LocalSession;
use crate::bench::{BenchRow, Harness, LatencyStats, Memory, Op, SEED, Workload};
use crate::client::ApiClient;
use crate::client::{code_and_message, code_number_name, status_line};
use tcpxd::api::proto::v1::register_buffer_request::Source;
use tcpxd::api::proto::v1::session_event::Event;
use tcpxd::api::proto::v1::session_request::Op as SessionOp;
use tcpxd::api::proto::v1::{
    ChecksumBufferRequest, ConnectPeerRequest, CudaAllocation, FillBufferRequest, GetStatsRequest,
    HostAllocation, ListPeersRequest, PeerState, ReadBatchRequest, ReadBufferRequest, ReadEntry, ReadRequest,
    RegisterBufferRequest, ReleaseBufferRequest, SessionRequest, TransferEvent, WriteBatchRequest,
    WriteEntry, WriteRequest, fill_buffer_request,
};

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

pub(crate) fn rpc(what: impl Into<String>) -> impl FnOnce(Status) -> DaemonBenchError {
    let what = what.into();
    move |status| DaemonBenchError::Rpc { what, status }
}

/// The two daemons: A issues the transfers, B is the peer.
pub struct DaemonPair {
    pub a: ApiClient,
    pub b: ApiClient,
    /// The chunk size the daemons use, when the caller knows it (it started them).
    pub chunk_bytes: Option<u32>,
    /// How the size sweep's transfers reach A.
    pub via: Via,
}

/// How the daemon bench's transfers reach daemon A.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Via {
    /// A gRPC `Session` stream on A's client API.
    #[default]
    Grpc,
    /// A framed local session on A's API unix socket (this path).
    Local(PathBuf),
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
            // Idle: closed when idle by both daemons; the bench's first transfer pairs again.
            Some(p) if p.state == PeerState::Up as i32 || p.state == PeerState::Idle as i32 => {
                return Ok((b_node, p.lanes));
            }
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
            let busy = |s: Result<tonic::Response<tcpxd::api::proto::v1::Stats>, Status>| {
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
    local: &tcpxd::api::proto::v1::Buffer,
    remote: &tcpxd::api::proto::v1::Buffer,
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
        let span = size * u64::from(w.batch) * u64::from(w.slots());
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
        let slots: Vec<SessionOp> = (0..w.slots())
            .map(|slot| slot_op(w.op, w.batch, size, slot, local.id, &remote.descriptor))
            .collect();
        let cpu = crate::bench::steal::now();
        let mut session = match &pair.via {
            Via::Grpc => Transport::grpc(&mut pair.a, w).await?,
            Via::Local(socket) => Transport::local(socket).await?,
        };
        let (latencies, wall) = run_session(&mut session, w, size, &slots, progress).await?;
        session.close().await?;
        let steal = crate::bench::steal::since(cpu);
        let a = checksum(&mut pair.a, local.id, span, "the local buffer").await?;
        let b = checksum(&mut pair.b, remote.id, span, "the remote buffer").await?;
        rows.push(BenchRow {
            harness: match pair.via {
                Via::Grpc => Harness::Daemon,
                Via::Local(_) => Harness::DaemonLocal,
            },
            op: w.op,
            memory: w.memory,
            block_size: size,
            batch_size: w.batch,
            iterations: w.iterations,
            warmup: w.warmup,
            latency: LatencyStats::from_samples(&latencies),
            concurrency: w.concurrency,
            wall,
            verified: a == b,
            chunk_bytes: pair.chunk_bytes,
            lanes,
            steal,
        });
    }
    Ok(rows)
}

/// The session request of one slot: its blocks at `(slot × batch + i) × size` on both sides.
/// Built once per size and cloned per transfer (outside the timed part).
fn slot_op(op: Op, batch: u32, size: u64, slot: u32, local: u64, descriptor: &str) -> SessionOp {
    let base = u64::from(slot) * u64::from(batch);
    let write = |i: u64| WriteEntry {
        local_buffer_id: local,
        local_offset: (base + i) * size,
        remote_descriptor: descriptor.to_string(),
        remote_offset: (base + i) * size,
        length: size,
    };
    let read = |i: u64| ReadEntry {
        remote_descriptor: descriptor.to_string(),
        remote_offset: (base + i) * size,
        local_buffer_id: local,
        local_offset: (base + i) * size,
        length: size,
    };
    match (op, batch) {
        (Op::Write, 1) => SessionOp::Write(WriteRequest {
            entry: Some(write(0)),
            ..WriteRequest::default()
        }),
        (Op::Read, 1) => SessionOp::Read(ReadRequest {
            entry: Some(read(0)),
            ..ReadRequest::default()
        }),
        (Op::Write, n) => SessionOp::WriteBatch(WriteBatchRequest {
            entries: (0..u64::from(n)).map(write).collect(),
            ..WriteBatchRequest::default()
        }),
        (Op::Read, n) => SessionOp::ReadBatch(ReadBatchRequest {
            entries: (0..u64::from(n)).map(read).collect(),
            ..ReadBatchRequest::default()
        }),
    }
}

/// Runs one size's transfers on one session, `concurrency` in flight. Returns the measured
/// latencies and the wall time from the first measured start to the last measured end.
async fn run_session(
    session: &mut Transport,
    w: &Workload,
    size: u64,
    slots: &[SessionOp],
    progress: &indicatif::ProgressBar,
) -> Result<(Vec<Duration>, Duration), DaemonBenchError> {
    let total = w.warmup + w.iterations;
    let depth = w.concurrency.max(1);
    let what = |k: u32| format!("{} {k} of {} × {size} bytes", w.op.name(), w.batch);
    // Start times by transfer (transfer k has tag k + 1).
    let mut started: Vec<Option<Instant>> = vec![None; total as usize];
    let mut latencies = Vec::with_capacity(w.iterations as usize);
    let (mut next, mut done) = (0u32, 0u32);
    let (mut first, mut last) = (None, None);
    while done < total {
        while next < total && super::may_start(next, next - done, depth, w.warmup) {
            let op = slots[next as usize % slots.len()].clone();
            let now = Instant::now();
            started[next as usize] = Some(now);
            if next == w.warmup {
                first = Some(now);
            }
            let request = SessionRequest {
                tag: u64::from(next) + 1,
                op: Some(op),
            };
            // The client's own legs beside the daemons' hops (`benches/legs.py`): its request
            // handed to the transport, its answer read.
            tracing::trace!(target: "tcpxd::hop", hop = "bench.send", tag = request.tag);
            session.send(request, &what(next)).await?;
            next += 1;
        }
        session.flush().await?;
        let ev = session.next().await?.ok_or_else(|| DaemonBenchError::Rpc {
            what: "the Session stream".into(),
            status: Status::unavailable("the daemon ended the session early"),
        })?;
        let end = Instant::now();
        tracing::trace!(target: "tcpxd::hop", hop = "bench.answer", tag = ev.tag);
        let k = ev.tag.wrapping_sub(1) as u32;
        let t0 = started
            .get_mut(k as usize)
            .and_then(Option::take)
            .ok_or_else(|| DaemonBenchError::Peer(format!("the session answered unknown tag {}", ev.tag)))?;
        match ev.event {
            Some(Event::Finished(t)) if t.status_code == 0 => {}
            Some(Event::Finished(t)) => return Err(transfer_failed(what(k), t)),
            Some(Event::Refused(st)) => {
                return Err(DaemonBenchError::Transfer {
                    what: what(k),
                    code: st.code,
                    message: st.message,
                    entries: String::new(),
                });
            }
            other => {
                return Err(DaemonBenchError::Peer(format!(
                    "the session answered tag {} with {other:?}",
                    ev.tag
                )));
            }
        }
        if k >= w.warmup {
            latencies.push(end - t0);
            last = Some(end);
        }
        done += 1;
        progress.inc(1);
    }
    let wall = match (first, last) {
        (Some(f), Some(l)) => l - f,
        _ => Duration::ZERO,
    };
    Ok((latencies, wall))
}

/// One size's session: a gRPC `Session` stream, or a framed local session.
enum Transport {
    Grpc {
        tx: tokio::sync::mpsc::Sender<SessionRequest>,
        events: Box<tonic::Streaming<tcpxd::api::proto::v1::SessionEvent>>,
    },
    Local(Box<LocalSession>),
}

impl Transport {
    async fn grpc(client: &mut ApiClient, w: &Workload) -> Result<Transport, DaemonBenchError> {
        let (tx, rx) = tokio::sync::mpsc::channel(w.concurrency.max(1) as usize + 1);
        let events = client
            .session(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .map_err(rpc("opening a Session"))?
            .into_inner();
        Ok(Transport::Grpc {
            tx,
            events: Box::new(events),
        })
    }

    async fn local(socket: &std::path::Path) -> Result<Transport, DaemonBenchError> {
        let s = LocalSession::open(socket).await.map_err(local_failed(format!(
            "opening a framed session on {}",
            socket.display()
        )))?;
        Ok(Transport::Local(Box::new(s)))
    }

    /// Hands one request on (the framed session queues it until [`Transport::flush`]).
    async fn send(&mut self, request: SessionRequest, what: &str) -> Result<(), DaemonBenchError> {
        match self {
            Transport::Grpc { tx, .. } => tx.send(request).await.map_err(|_| DaemonBenchError::Rpc {
                what: what.to_string(),
                status: Status::unavailable("the session closed"),
            }),
            Transport::Local(s) => {
                s.queue(&request);
                Ok(())
            }
        }
    }

    async fn flush(&mut self) -> Result<(), DaemonBenchError> {
        match self {
            Transport::Grpc { .. } => Ok(()),
            Transport::Local(s) => s.flush().await.map_err(local_failed("the framed session")),
        }
    }

    async fn next(&mut self) -> Result<Option<tcpxd::api::proto::v1::SessionEvent>, DaemonBenchError> {
        match self {
            Transport::Grpc { events, .. } => events.message().await.map_err(rpc("the Session stream")),
            Transport::Local(s) => s.next().await.map_err(local_failed("the framed session")),
        }
    }

    /// Half-closes the request side with nothing in flight; the daemon ends the session.
    async fn close(self) -> Result<(), DaemonBenchError> {
        match self {
            Transport::Grpc { tx, mut events } => {
                drop(tx);
                while events
                    .message()
                    .await
                    .map_err(rpc("the Session stream"))?
                    .is_some()
                {}
                Ok(())
            }
            Transport::Local(mut s) => {
                s.close()
                    .await
                    .map_err(local_failed("closing the framed session"))?;
                while s
                    .next()
                    .await
                    .map_err(local_failed("the framed session"))?
                    .is_some()
                {}
                Ok(())
            }
        }
    }
}

fn local_failed(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> DaemonBenchError {
    let what = what.into();
    move |e| DaemonBenchError::Rpc {
        what,
        status: Status::unavailable(e.to_string()),
    }
}

pub(crate) fn transfer_failed(what: String, ev: TransferEvent) -> DaemonBenchError {
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
    DaemonBenchError::Transfer {
        what: format!("{what} (transfer {})", ev.transfer_id),
        code: ev.status_code,
        message: ev.status_message,
        entries,
    }
}

pub(crate) async fn register(
    client: &mut ApiClient,
    memory: Memory,
    size: u64,
    label: &str,
    which: &str,
) -> Result<tcpxd::api::proto::v1::Buffer, DaemonBenchError> {
    let source = match memory {
        Memory::Host => Source::Host(HostAllocation { size }),
        Memory::Cuda(device) => Source::Cuda(CudaAllocation { device, size }),
    };
    client
        .register_buffer(RegisterBufferRequest {
            reattach_id: Default::default(),
            reattach_key: Default::default(),
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

pub(crate) async fn release(client: &mut ApiClient, id: u64) -> Result<(), DaemonBenchError> {
    client
        .release_buffer(ReleaseBufferRequest { buffer_id: id })
        .await
        .map(|_| ())
        .map_err(rpc(format!("releasing buffer {id}")))
}

pub(crate) async fn fill(
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

pub(crate) async fn checksum(
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
        .await;
    match r {
        Ok(r) => {
            let r = r.into_inner();
            Ok((r.crc32c, r.length))
        }
        // A GPU without the daemon's kernels (the CUDA stand-in CI uses, a daemon built without
        // nvcc and no NVRTC): the bytes come back through ReadBuffer and are summed here.
        Err(s) if s.message().contains("GPU kernels") => read_back_checksum(client, id, length, name).await,
        Err(s) => Err(rpc(format!("checksumming {name} (buffer {id})"))(s)),
    }
}

/// CRC-32C of the buffer's first `length` bytes, read back 1 MiB (ReadBuffer's most) at a time.
async fn read_back_checksum(
    client: &mut ApiClient,
    id: u64,
    length: u64,
    name: &str,
) -> Result<(u32, u64), DaemonBenchError> {
    const PIECE: u64 = 1 << 20;
    let (mut crc, mut pos) = (0u32, 0u64);
    while pos < length {
        let n = (length - pos).min(PIECE);
        let data = client
            .read_buffer(ReadBufferRequest {
                buffer_id: id,
                offset: pos,
                length: n,
            })
            .await
            .map_err(rpc(format!("reading {name} back (buffer {id})")))?
            .into_inner()
            .data;
        crc = crc32c::crc32c_append(crc, &data);
        pos += n;
    }
    Ok((crc, length))
}
