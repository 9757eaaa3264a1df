//! The client service (`tcpxd.v1.Tcpxd`): validates requests, hands them to the poller and maps
//! every error to a gRPC status once, here.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{broadcast, oneshot, watch};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::proto::v1 as pb;
use crate::buffers::{self, BufferEntry, BufferKind, BufferRegistry, Descriptor, Pattern};
use crate::engine::{self, EngineError, EntrySpec, Outcome, RemoteRange, TransferId};
use crate::peers::Peers;
use crate::poller::{Command, NotificationEvent, PeerLink, Phase, TransferStatus};

/// Maps an engine error to a gRPC status (the codes are the same numbers).
pub fn status(e: EngineError) -> Status {
    Status::new(tonic::Code::from_i32(e.code as i32), e.message)
}

/// Everything the services share.
pub struct DaemonState {
    pub node_id: String,
    pub buffers: BufferRegistry,
    pub poller: std_mpsc::Sender<Command>,
    pub peers: Peers,
    pub notifications: broadcast::Sender<NotificationEvent>,
    pub transfers: Mutex<HashMap<u64, watch::Receiver<TransferStatus>>>,
    pub default_timeout: Duration,
    pub finished_retention: Duration,
    /// Becomes true when the daemon stops serving: long-lived streams end.
    pub stopping: watch::Receiver<bool>,
    /// The Prometheus series (also behind GetStats).
    pub metrics: Arc<crate::metrics::Metrics>,
}

impl DaemonState {
    pub(crate) async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> Result<T, Status> {
        let (tx, rx) = oneshot::channel();
        self.poller
            .send(make(tx))
            .map_err(|_| Status::unavailable("the daemon is shutting down"))?;
        rx.await
            .map_err(|_| Status::unavailable("the daemon is shutting down"))
    }

    fn transfer(&self, id: u64) -> Result<watch::Receiver<TransferStatus>, Status> {
        self.transfers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .cloned()
            .ok_or_else(|| {
                Status::not_found(format!(
                    "transfer_id: transfer {id} is unknown (or finished long ago)"
                ))
            })
    }

    /// Forgets transfers that finished more than `finished_retention` ago.
    pub fn prune_finished(&self, now: Instant) {
        let keep = self.finished_retention;
        self.transfers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|_, rx| {
                rx.borrow()
                    .finished_at
                    .is_none_or(|t| now.duration_since(t) < keep)
            });
    }

    fn buffer_pb(&self, b: &BufferEntry) -> pb::Buffer {
        pb::Buffer {
            id: b.id,
            kind: match b.kind {
                BufferKind::Host => pb::BufferKind::Host,
                BufferKind::Cuda => pb::BufferKind::Cuda,
                BufferKind::CudaIpc => pb::BufferKind::CudaIpc,
            } as i32,
            size: b.size,
            label: b.label.clone(),
            descriptor: self.buffers.descriptor(b).encode(),
            cuda_ipc_handle: b.ipc_export().map(|e| e.handle.to_vec()).unwrap_or_default(),
            cuda_ipc_offset: b.ipc_export().map(|e| e.offset).unwrap_or(0),
            device: b.gpu().map(|g| g.ordinal() as u32).unwrap_or(0),
            active_transfers: 0,
        }
    }

    /// Resolves a descriptor to a connected peer and checks the range against its size.
    fn remote(
        &self,
        i: usize,
        descriptor: &str,
        offset: u64,
        length: u64,
    ) -> Result<(engine::PeerIdx, RemoteRange), Status> {
        let field = format!("entries[{i}].remote_descriptor");
        let d = Descriptor::parse(&field, descriptor).map_err(status)?;
        if d.node_id == self.node_id {
            return Err(Status::invalid_argument(format!(
                "{field}: names a buffer of this node ({}); transfers go between nodes",
                self.node_id
            )));
        }
        match offset.checked_add(length) {
            None => {
                return Err(Status::invalid_argument(format!(
                    "entries[{i}].remote_offset: {offset} + length {length} overflows 64 bits"
                )));
            }
            Some(end) if end > d.size => {
                return Err(Status::invalid_argument(format!(
                    "entries[{i}].remote_offset: range {offset}..{end} is past the end of the remote buffer ({} bytes)",
                    d.size
                )));
            }
            Some(_) => {}
        }
        let peer = self.peers.by_node(&d.node_id).ok_or_else(|| {
            Status::not_found(format!(
                "{field}: node {} is not a connected peer (call ConnectPeer with its address first)",
                d.node_id
            ))
        })?;
        if let PeerLink::Failed(why) = &*peer.link.borrow() {
            return Err(Status::unavailable(format!(
                "{field}: peer {} failed: {why}",
                d.node_id
            )));
        }
        Ok((
            peer.idx,
            RemoteRange {
                buffer_id: d.buffer_id,
                access_key: d.key,
                offset,
                length,
            },
        ))
    }

    /// The transfer's deadline: the call's gRPC deadline, else `timeout_ms`, else the default.
    fn deadline<T>(&self, req: &Request<T>, timeout_ms: u64) -> Instant {
        let budget = grpc_timeout(req)
            .or((timeout_ms > 0).then(|| Duration::from_millis(timeout_ms)))
            .unwrap_or(self.default_timeout);
        engine::deadline_after(Instant::now(), budget)
    }

    fn started(
        &self,
        id: TransferId,
        rx: watch::Receiver<TransferStatus>,
        total: u64,
    ) -> pb::TransferStarted {
        self.transfers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id.0, rx);
        pb::TransferStarted {
            transfer_id: id.0,
            total_bytes: total,
        }
    }
}

/// Parses the `grpc-timeout` header ("<digits><H|M|S|m|u|n>").
pub fn grpc_timeout<T>(req: &Request<T>) -> Option<Duration> {
    let v = req.metadata().get("grpc-timeout")?.to_str().ok()?;
    let (num, unit) = v.split_at(v.len().checked_sub(1)?);
    let n: u64 = num.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

fn event(id: u64, s: &TransferStatus) -> pb::TransferEvent {
    let (status_code, status_message, entries) = match &s.outcome {
        Some(Outcome {
            code,
            message,
            entries,
            ..
        }) => (
            *code as i32,
            message.clone(),
            entries
                .iter()
                .map(|(c, m)| pb::EntryStatus {
                    code: *c as i32,
                    message: m.clone(),
                })
                .collect(),
        ),
        None => (0, String::new(), Vec::new()),
    };
    pb::TransferEvent {
        transfer_id: id,
        state: match s.phase {
            Phase::Offered => pb::TransferState::Offered,
            Phase::Running => pb::TransferState::Running,
            Phase::Finished => pb::TransferState::Finished,
        } as i32,
        bytes_done: s.bytes_done,
        total_bytes: s.total,
        status_code,
        status_message,
        entries,
        elapsed_us: s
            .finished_at
            .unwrap_or_else(Instant::now)
            .duration_since(s.started)
            .as_micros() as u64,
    }
}

fn local_offset_field(i: usize) -> String {
    format!("entries[{i}].local_buffer_id")
}

/// The client service.
pub struct ClientService {
    pub state: Arc<DaemonState>,
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::TransferEvent, Status>> + Send>>;
type NotificationStream = Pin<Box<dyn Stream<Item = Result<pb::Notification, Status>> + Send>>;

impl ClientService {
    async fn write(
        &self,
        req: Request<pb::WriteBatchRequest>,
    ) -> Result<Response<pb::TransferStarted>, Status> {
        let st = &self.state;
        let deadline = st.deadline(&req, req.get_ref().timeout_ms);
        let r = req.into_inner();
        st.revive_peers(r.entries.iter().map(|e| e.remote_descriptor.as_str()), deadline)
            .await?;
        let (specs, total) = st.entry_specs(r.entries.iter().map(EntryFields::from))?;
        if !r.ready_event_ipc_handle.is_empty() {
            st.wait_ready_event(&r.ready_event_ipc_handle, &specs, deadline)
                .await?;
        }
        let (id, rx) = st
            .ask(|reply| Command::Write {
                specs,
                notification: r.notification,
                deadline,
                reply,
            })
            .await?
            .map_err(status)?;
        Ok(Response::new(st.started(id, rx, total)))
    }

    async fn read(
        &self,
        req: Request<pb::ReadBatchRequest>,
    ) -> Result<Response<pb::TransferStarted>, Status> {
        let st = &self.state;
        let deadline = st.deadline(&req, req.get_ref().timeout_ms);
        let r = req.into_inner();
        st.revive_peers(r.entries.iter().map(|e| e.remote_descriptor.as_str()), deadline)
            .await?;
        let (specs, total) = st.entry_specs(r.entries.iter().map(EntryFields::from))?;
        let (id, rx) = st
            .ask(|reply| Command::Read {
                specs,
                deadline,
                reply,
            })
            .await?
            .map_err(status)?;
        Ok(Response::new(st.started(id, rx, total)))
    }
}

impl DaemonState {
    /// Dials again, first, the failed peers the entries' descriptors name (bad descriptors are
    /// left for the entry checks to report).
    async fn revive_peers<'a>(
        &self,
        descriptors: impl Iterator<Item = &'a str>,
        deadline: Instant,
    ) -> Result<(), Status> {
        let mut nodes: std::collections::BTreeSet<String> = std::collections::BTreeSet::new();
        for d in descriptors {
            if let Ok(d) = Descriptor::parse("remote_descriptor", d) {
                nodes.insert(d.node_id);
            }
        }
        let nodes: Vec<&str> = nodes.iter().map(String::as_str).collect();
        self.peers.revive(&nodes, deadline).await
    }

    /// Orders a write after the client's GPU work: waits (without holding a runtime thread) for
    /// the client's IPC event, on the GPU of the first CUDA source buffer.
    async fn wait_ready_event(
        &self,
        handle: &[u8],
        specs: &[EntrySpec],
        deadline: Instant,
    ) -> Result<(), Status> {
        let handle: [u8; 64] = handle.try_into().map_err(|_| {
            Status::invalid_argument(format!(
                "ready_event_ipc_handle: {} bytes, expected 64",
                handle.len()
            ))
        })?;
        let gpu = specs
            .iter()
            .find_map(|s| {
                self.buffers
                    .get(s.local_buffer)
                    .ok()
                    .and_then(|b| b.gpu().cloned())
            })
            .ok_or_else(|| {
                Status::invalid_argument("ready_event_ipc_handle: no entry reads from a CUDA buffer")
            })?;
        let done = tokio::task::spawn_blocking(move || crate::gpu::wait_ipc_event(&gpu, &handle, deadline))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(|e| Status::invalid_argument(format!("ready_event_ipc_handle: {e}")))?;
        if done {
            Ok(())
        } else {
            Err(Status::deadline_exceeded(
                "the client's ready event did not complete before the transfer's deadline",
            ))
        }
    }
}

/// The fields WriteEntry and ReadEntry share.
struct EntryFields<'a> {
    local_buffer: u64,
    local_offset: u64,
    remote_descriptor: &'a str,
    remote_offset: u64,
    length: u64,
}

impl<'a> From<&'a pb::WriteEntry> for EntryFields<'a> {
    fn from(e: &'a pb::WriteEntry) -> Self {
        EntryFields {
            local_buffer: e.local_buffer_id,
            local_offset: e.local_offset,
            remote_descriptor: &e.remote_descriptor,
            remote_offset: e.remote_offset,
            length: e.length,
        }
    }
}

impl<'a> From<&'a pb::ReadEntry> for EntryFields<'a> {
    fn from(e: &'a pb::ReadEntry) -> Self {
        EntryFields {
            local_buffer: e.local_buffer_id,
            local_offset: e.local_offset,
            remote_descriptor: &e.remote_descriptor,
            remote_offset: e.remote_offset,
            length: e.length,
        }
    }
}

impl DaemonState {
    /// Checks what the API layer can (non-empty, lengths, local buffers, descriptors, peers) and
    /// builds the engine's entries; the engine checks bounds and limits. Returns the total bytes.
    fn entry_specs<'a>(
        &self,
        entries: impl ExactSizeIterator<Item = EntryFields<'a>>,
    ) -> Result<(Vec<EntrySpec>, u64), Status> {
        if entries.len() == 0 {
            return Err(Status::invalid_argument(
                "entries: at least one entry is required",
            ));
        }
        let mut specs = Vec::with_capacity(entries.len());
        let mut total = 0u64;
        for (i, e) in entries.enumerate() {
            if e.length == 0 {
                return Err(Status::invalid_argument(format!(
                    "entries[{i}].length: must be at least 1 byte"
                )));
            }
            self.buffers
                .get(e.local_buffer)
                .map_err(|err| Status::not_found(format!("{}: {}", local_offset_field(i), err.message)))?;
            let (peer, remote) = self.remote(i, e.remote_descriptor, e.remote_offset, e.length)?;
            total = total.saturating_add(e.length);
            specs.push(EntrySpec {
                local_buffer: e.local_buffer,
                local_offset: e.local_offset,
                peer,
                remote,
            });
        }
        Ok((specs, total))
    }
}

/// Re-wraps a single-entry request as a batch, keeping its metadata (deadline).
fn as_batch<T, U>(req: Request<T>, f: impl FnOnce(T) -> U) -> Request<U> {
    let (meta, ext, inner) = req.into_parts();
    Request::from_parts(meta, ext, f(inner))
}

#[tonic::async_trait]
impl pb::tcpxd_server::Tcpxd for ClientService {
    async fn register_buffer(
        &self,
        req: Request<pb::RegisterBufferRequest>,
    ) -> Result<Response<pb::Buffer>, Status> {
        let r = req.into_inner();
        let entry = match r.source {
            Some(pb::register_buffer_request::Source::Host(h)) => {
                let reg_label = r.label.clone();
                let state = self.state.clone();
                tokio::task::spawn_blocking(move || state.buffers.allocate_host(h.size, &reg_label))
                    .await
                    .map_err(|e| Status::internal(e.to_string()))?
                    .map_err(status)?
            }
            Some(pb::register_buffer_request::Source::Cuda(c)) => {
                let (label, state) = (r.label.clone(), self.state.clone());
                tokio::task::spawn_blocking(move || state.buffers.allocate_cuda(c.device, c.size, &label))
                    .await
                    .map_err(|e| Status::internal(e.to_string()))?
                    .map_err(status)?
            }
            Some(pb::register_buffer_request::Source::CudaIpc(c)) => {
                let (label, state) = (r.label.clone(), self.state.clone());
                tokio::task::spawn_blocking(move || {
                    state
                        .buffers
                        .import_cuda(c.device, &c.ipc_handle, c.offset, c.size, &label)
                })
                .await
                .map_err(|e| Status::internal(e.to_string()))?
                .map_err(status)?
            }
            None => {
                return Err(Status::invalid_argument(
                    "source: set one of host, cuda, cuda_ipc",
                ));
            }
        };
        // Visible first (the label check is atomic there), then known to the poller; no client
        // can name the id before this call returns it.
        self.state.buffers.publish(entry.clone()).map_err(status)?;
        let e = entry.clone();
        let added = self
            .state
            .ask(|reply| Command::AddBuffer { entry: e, reply })
            .await;
        if let Err(e) = added.and_then(|r| r.map_err(status)) {
            self.state.buffers.remove(entry.id);
            return Err(e);
        }
        tracing::info!(buffer = entry.id, size = entry.size, "buffer registered");
        Ok(Response::new(self.state.buffer_pb(&entry)))
    }

    async fn release_buffer(
        &self,
        req: Request<pb::ReleaseBufferRequest>,
    ) -> Result<Response<pb::ReleaseBufferResponse>, Status> {
        let id = req.into_inner().buffer_id;
        self.state.buffers.get(id).map_err(status)?;
        self.state
            .ask(|reply| Command::RemoveBuffer { id, reply })
            .await?
            .map_err(status)?;
        self.state.buffers.remove(id);
        tracing::info!(buffer = id, "buffer released");
        Ok(Response::new(pb::ReleaseBufferResponse {}))
    }

    async fn rekey_buffer(
        &self,
        req: Request<pb::RekeyBufferRequest>,
    ) -> Result<Response<pb::Buffer>, Status> {
        let id = req.into_inner().buffer_id;
        let b = self.state.buffers.get(id).map_err(status)?;
        let key: [u8; 16] = rand::random();
        // The engine checks offers: once it has the new key, the old one is dead.
        self.state
            .ask(|reply| Command::RekeyBuffer { id, key, reply })
            .await?
            .map_err(status)?;
        b.set_key(key);
        tracing::info!(buffer = id, "buffer re-keyed");
        Ok(Response::new(self.state.buffer_pb(&b)))
    }

    async fn describe_buffer(
        &self,
        req: Request<pb::DescribeBufferRequest>,
    ) -> Result<Response<pb::Buffer>, Status> {
        let b = self
            .state
            .buffers
            .get(req.into_inner().buffer_id)
            .map_err(status)?;
        Ok(Response::new(self.state.buffer_pb(&b)))
    }

    async fn list_buffers(
        &self,
        _: Request<pb::ListBuffersRequest>,
    ) -> Result<Response<pb::ListBuffersResponse>, Status> {
        let buffers = self
            .state
            .buffers
            .list()
            .iter()
            .map(|b| self.state.buffer_pb(b))
            .collect();
        Ok(Response::new(pb::ListBuffersResponse { buffers }))
    }

    async fn fill_buffer(
        &self,
        req: Request<pb::FillBufferRequest>,
    ) -> Result<Response<pb::FillBufferResponse>, Status> {
        let r = req.into_inner();
        let b = self.state.buffers.get(r.buffer_id).map_err(status)?;
        let (offset, length) = buffers::resolve_range(&b, r.offset, r.length, true).map_err(status)?;
        let pattern = match r.pattern {
            Some(pb::fill_buffer_request::Pattern::Byte(v)) if v <= 255 => Pattern::Byte(v as u8),
            Some(pb::fill_buffer_request::Pattern::Byte(v)) => {
                return Err(Status::invalid_argument(format!("byte: {v} is not in 0..=255")));
            }
            Some(pb::fill_buffer_request::Pattern::Seed(s)) => Pattern::Seed(s),
            Some(pb::fill_buffer_request::Pattern::Repeat(v))
                if !v.is_empty() && v.len() <= buffers::MAX_REPEAT_BYTES =>
            {
                Pattern::Repeat(v)
            }
            Some(pb::fill_buffer_request::Pattern::Repeat(v)) => {
                return Err(Status::invalid_argument(format!(
                    "repeat: {} bytes (1 to {} allowed)",
                    v.len(),
                    buffers::MAX_REPEAT_BYTES
                )));
            }
            None => return Err(Status::invalid_argument("pattern: set one of byte, seed, repeat")),
        };
        tokio::task::spawn_blocking(move || buffers::fill(&b, offset, length, &pattern))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(status)?;
        Ok(Response::new(pb::FillBufferResponse {}))
    }

    async fn read_buffer(
        &self,
        req: Request<pb::ReadBufferRequest>,
    ) -> Result<Response<pb::ReadBufferResponse>, Status> {
        let r = req.into_inner();
        let b = self.state.buffers.get(r.buffer_id).map_err(status)?;
        if r.length == 0 || r.length > buffers::MAX_READ_BYTES {
            return Err(Status::invalid_argument(format!(
                "length: {} (1 to {} allowed)",
                r.length,
                buffers::MAX_READ_BYTES
            )));
        }
        let (offset, length) = buffers::resolve_range(&b, r.offset, r.length, false).map_err(status)?;
        let data = tokio::task::spawn_blocking(move || buffers::read(&b, offset, length))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(status)?;
        Ok(Response::new(pb::ReadBufferResponse { data }))
    }

    async fn checksum_buffer(
        &self,
        req: Request<pb::ChecksumBufferRequest>,
    ) -> Result<Response<pb::ChecksumBufferResponse>, Status> {
        let r = req.into_inner();
        let b = self.state.buffers.get(r.buffer_id).map_err(status)?;
        let (offset, length) = buffers::resolve_range(&b, r.offset, r.length, true).map_err(status)?;
        let crc = tokio::task::spawn_blocking(move || buffers::checksum(&b, offset, length))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(status)?;
        Ok(Response::new(pb::ChecksumBufferResponse { crc32c: crc, length }))
    }

    async fn connect_peer(&self, req: Request<pb::ConnectPeerRequest>) -> Result<Response<pb::Peer>, Status> {
        let address = req.into_inner().address;
        if address.trim().is_empty() {
            return Err(Status::invalid_argument(
                "address: required (host:port of the peer service)",
            ));
        }
        let info = self.state.peers.connect(address.trim()).await?;
        Ok(Response::new(peer_pb(&info)))
    }

    async fn list_peers(
        &self,
        _: Request<pb::ListPeersRequest>,
    ) -> Result<Response<pb::ListPeersResponse>, Status> {
        let peers = self.state.peers.list().iter().map(peer_pb).collect();
        Ok(Response::new(pb::ListPeersResponse { peers }))
    }

    async fn write(&self, req: Request<pb::WriteRequest>) -> Result<Response<pb::TransferStarted>, Status> {
        let req = as_batch(req, |r| pb::WriteBatchRequest {
            entries: r.entry.into_iter().collect(),
            notification: r.notification,
            timeout_ms: r.timeout_ms,
            ready_event_ipc_handle: r.ready_event_ipc_handle,
        });
        if req.get_ref().entries.is_empty() {
            return Err(Status::invalid_argument("entry: required"));
        }
        ClientService::write(self, req).await
    }

    async fn read(&self, req: Request<pb::ReadRequest>) -> Result<Response<pb::TransferStarted>, Status> {
        let req = as_batch(req, |r| pb::ReadBatchRequest {
            entries: r.entry.into_iter().collect(),
            timeout_ms: r.timeout_ms,
        });
        if req.get_ref().entries.is_empty() {
            return Err(Status::invalid_argument("entry: required"));
        }
        ClientService::read(self, req).await
    }

    async fn write_batch(
        &self,
        req: Request<pb::WriteBatchRequest>,
    ) -> Result<Response<pb::TransferStarted>, Status> {
        ClientService::write(self, req).await
    }

    async fn read_batch(
        &self,
        req: Request<pb::ReadBatchRequest>,
    ) -> Result<Response<pb::TransferStarted>, Status> {
        ClientService::read(self, req).await
    }

    type WatchStream = EventStream;

    async fn watch(&self, req: Request<pb::WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        let id = req.into_inner().transfer_id;
        let mut rx = self.state.transfer(id)?;
        let (tx, out) = tokio::sync::mpsc::channel(16);
        tokio::spawn(async move {
            loop {
                let s = rx.borrow_and_update().clone();
                let done = s.phase == Phase::Finished;
                if tx.send(Ok(event(id, &s))).await.is_err() || done {
                    return;
                }
                if rx.changed().await.is_err() {
                    let _ = tx
                        .send(Err(Status::unavailable(
                            "the daemon stopped before the transfer finished",
                        )))
                        .await;
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out))))
    }

    async fn wait_transfer(
        &self,
        req: Request<pb::WaitTransferRequest>,
    ) -> Result<Response<pb::TransferEvent>, Status> {
        let id = req.into_inner().transfer_id;
        let mut rx = self.state.transfer(id)?;
        let s = rx
            .wait_for(|s| s.phase == Phase::Finished)
            .await
            .map_err(|_| Status::unavailable("the daemon stopped before the transfer finished"))?
            .clone();
        Ok(Response::new(event(id, &s)))
    }

    async fn cancel(&self, req: Request<pb::CancelRequest>) -> Result<Response<pb::CancelResponse>, Status> {
        let id = req.into_inner().transfer_id;
        self.state.transfer(id)?;
        let cancelled = self
            .state
            .ask(|reply| Command::Cancel {
                id: TransferId(id),
                reply,
            })
            .await?;
        Ok(Response::new(pb::CancelResponse { cancelled }))
    }

    type SubscribeStream = NotificationStream;

    async fn subscribe(
        &self,
        _: Request<pb::SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        let mut rx = self.state.notifications.subscribe();
        let mut stopping = self.state.stopping.clone();
        let (tx, out) = tokio::sync::mpsc::channel(64);
        tokio::spawn(async move {
            loop {
                let next = tokio::select! {
                    n = rx.recv() => n,
                    _ = async { stopping.wait_for(|s| *s).await.map(|_| ()) } => {
                        let _ = tx.send(Err(Status::unavailable("the daemon is shutting down"))).await;
                        return;
                    }
                };
                let item = match next {
                    Ok(n) => Ok(pb::Notification {
                        from_node: n.from_node,
                        transfer_id: n.offer_id,
                        payload: n.payload,
                        buffer_ids: n.buffers,
                    }),
                    Err(broadcast::error::RecvError::Lagged(k)) => Err(Status::data_loss(format!(
                        "this subscriber fell behind and missed {k} notifications; subscribe again"
                    ))),
                    Err(broadcast::error::RecvError::Closed) => return,
                };
                let end = item.is_err();
                if tx.send(item).await.is_err() || end {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out))))
    }

    async fn get_stats(&self, _: Request<pb::GetStatsRequest>) -> Result<Response<pb::Stats>, Status> {
        let snap = self.state.ask(|reply| Command::Stats { reply }).await?;
        let buffers = self.state.buffers.list();
        let peers = snap
            .peers
            .iter()
            .map(|p| {
                let lanes = p.counters.send.len().max(p.counters.recv.len());
                pb::PeerStats {
                    node_id: p.counters.node_id.clone(),
                    state: link_pb(&p.link) as i32,
                    transfers_started: p.counters.transfers_started,
                    transfers_ok: p.counters.transfers_ok,
                    transfers_failed: p.counters.transfers_failed,
                    lanes: (0..lanes)
                        .map(|i| {
                            let s = p.counters.send.get(i).cloned().unwrap_or_default();
                            let r = p.counters.recv.get(i).cloned().unwrap_or_default();
                            pb::LaneStats {
                                lane: i as u32,
                                device: p
                                    .send_devices
                                    .get(i)
                                    .or(p.recv_devices.get(i))
                                    .copied()
                                    .unwrap_or(-1),
                                bytes_sent: s.bytes,
                                bytes_received: r.bytes,
                                chunks_sent: s.chunks,
                                chunks_received: r.chunks,
                                sends_in_flight: s.posted as u32,
                                recvs_in_flight: r.posted as u32,
                                sends_queued: s.queued as u32,
                                recvs_queued: r.queued as u32,
                                send_window_full: s.window_full,
                                recv_window_full: r.window_full,
                            }
                        })
                        .collect(),
                }
            })
            .collect();
        Ok(Response::new(pb::Stats {
            node_id: self.state.node_id.clone(),
            peers,
            active_transfers: snap.active_transfers as u32,
            buffers: buffers.len() as u32,
            buffer_bytes: buffers.iter().map(|b| b.size).sum(),
            ..crate::api::stats::event_stats(&self.state.metrics.summary())
        }))
    }
}

fn link_pb(l: &PeerLink) -> pb::PeerState {
    match l {
        PeerLink::Connecting => pb::PeerState::Connecting,
        PeerLink::Up => pb::PeerState::Up,
        PeerLink::Failed(_) => pb::PeerState::Failed,
    }
}

fn peer_pb(p: &crate::peers::PeerInfo) -> pb::Peer {
    let link = p.link.borrow().clone();
    pb::Peer {
        node_id: p.node_id.clone(),
        address: p.address.clone(),
        state: link_pb(&link) as i32,
        error: match link {
            PeerLink::Failed(why) => why,
            _ => String::new(),
        },
        lanes: p.lanes,
    }
}
