//! The client service (`tcpxd.v1.Tcpxd`): validates requests, hands them to the poller and maps
//! every error to a gRPC status once, here. Buffers, peers and stats are served here; transfers
//! (starting, waiting) in `transfers`, the streaming session in `session`.

use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::broadcast;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use super::proto::v1 as pb;
use super::session;
use super::state::{DaemonState, status};
use super::transfers::{self, event, try_as_batch};
use crate::buffers::{self, Pattern};
use crate::engine::{self, TransferId};
use crate::poller::{Command, PeerLink, Phase};

/// How long `ReleaseBuffer` waits for the transfers using a buffer to end when the call carries
/// no deadline of its own.
pub const RELEASE_WAIT: Duration = Duration::from_secs(10);

/// The client service.
pub struct ClientService {
    pub state: Arc<DaemonState>,
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::TransferEvent, Status>> + Send>>;
type NotificationStream = Pin<Box<dyn Stream<Item = Result<pb::Notification, Status>> + Send>>;

#[tonic::async_trait]
impl pb::tcpxd_server::Tcpxd for ClientService {
    async fn register_buffer(
        &self,
        req: Request<pb::RegisterBufferRequest>,
    ) -> Result<Response<pb::Buffer>, Status> {
        let r = req.into_inner();
        if r.reattach_id != 0 && !matches!(r.source, Some(pb::register_buffer_request::Source::CudaIpc(_))) {
            return Err(Status::invalid_argument(
                "reattach_id: only a cuda_ipc import is re-attached by its client; daemon-allocated host \
                 buffers come back by themselves, daemon-allocated CUDA memory too where the service manager \
                 keeps its descriptor (docs/OPERATIONS.md, \"Restarts\")",
            ));
        }
        // A re-attach taken from the state directory: put back if anything below fails.
        let mut claim = None;
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
                tokio::task::spawn_blocking(move || {
                    state.buffers.allocate_cuda_kept(c.device, c.size, &label)
                })
                .await
                .map_err(|e| Status::internal(e.to_string()))?
                .map_err(status)?
            }
            Some(pb::register_buffer_request::Source::CudaIpc(c)) => {
                let (ident, c_claim) = self.state.reattach_buffer(
                    r.reattach_id,
                    &r.reattach_key,
                    crate::buffers::BufferKind::CudaIpc,
                    c.size,
                )?;
                claim = Some(c_claim);
                let (label, state) = (r.label.clone(), self.state.clone());
                tokio::task::spawn_blocking(move || {
                    state
                        .buffers
                        .import_cuda_as(c.device, &c.ipc_handle, c.offset, c.size, &label, ident)
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
        self.state.install(&entry).await?;
        if let Err(e) = self.state.journal_buffer(&entry) {
            let _ = self.state.release(entry.id, None).await;
            return Err(e);
        }
        if let Some(c) = claim {
            c.keep();
        }
        tracing::info!(
            buffer = entry.id,
            size = entry.size,
            reattached = r.reattach_id != 0,
            "buffer registered"
        );
        Ok(Response::new(self.state.buffer_pb(&entry)))
    }

    async fn release_buffer(
        &self,
        req: Request<pb::ReleaseBufferRequest>,
    ) -> Result<Response<pb::ReleaseBufferResponse>, Status> {
        // Transfers that still use the buffer get until the call's deadline (else
        // RELEASE_WAIT) to end: a transfer that just failed on one side (a deadline, a cancel)
        // is still being torn down on the other, and its receives may still land.
        let wait = transfers::grpc_timeout(&req).map_or(RELEASE_WAIT, transfers::answer_within);
        let deadline = Instant::now() + wait;
        let id = req.into_inner().buffer_id;
        self.state.release(id, Some(deadline)).await?;
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
        // A rotated key stays rotated across a restart.
        self.state.journal_buffer(&b)?;
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

    async fn register_blocks(
        &self,
        req: Request<pb::RegisterBlocksRequest>,
    ) -> Result<Response<pb::BlockList>, Status> {
        Ok(Response::new(self.state.register_blocks(req.into_inner()).await?))
    }

    async fn release_blocks(
        &self,
        req: Request<pb::ReleaseBlocksRequest>,
    ) -> Result<Response<pb::ReleaseBlocksResponse>, Status> {
        self.state.release_blocks(req.into_inner().list_id).await?;
        Ok(Response::new(pb::ReleaseBlocksResponse {}))
    }

    async fn describe_blocks(
        &self,
        req: Request<pb::DescribeBlocksRequest>,
    ) -> Result<Response<pb::BlockList>, Status> {
        Ok(Response::new(
            self.state.describe_blocks(req.into_inner().list_id).await?,
        ))
    }

    async fn prepare_blocks(
        &self,
        req: Request<pb::PrepareBlocksRequest>,
    ) -> Result<Response<pb::PreparedBlocks>, Status> {
        self.state.prepare_blocks_call(req).await
    }

    async fn release_prepared(
        &self,
        req: Request<pb::ReleasePreparedRequest>,
    ) -> Result<Response<pb::ReleasePreparedResponse>, Status> {
        self.state.release_prepared(req.into_inner().prepared_id).await?;
        Ok(Response::new(pb::ReleasePreparedResponse {}))
    }

    async fn write_prepared(
        &self,
        req: Request<pb::WritePreparedRequest>,
    ) -> Result<Response<pb::TransferStarted>, Status> {
        self.state.write_prepared_call(req).await
    }

    async fn read_prepared(
        &self,
        req: Request<pb::ReadPreparedRequest>,
    ) -> Result<Response<pb::TransferStarted>, Status> {
        self.state.read_prepared_call(req).await
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

    async fn describe_node(
        &self,
        _: Request<pb::DescribeNodeRequest>,
    ) -> Result<Response<pb::NodeDescription>, Status> {
        Ok(Response::new(
            self.state.node.describe(&self.state.node_id).await?,
        ))
    }

    async fn write(&self, req: Request<pb::WriteRequest>) -> Result<Response<pb::TransferStarted>, Status> {
        let req = try_as_batch(req, transfers::write_batch)?;
        self.state.write_call(req).await
    }

    async fn read(&self, req: Request<pb::ReadRequest>) -> Result<Response<pb::TransferStarted>, Status> {
        let req = try_as_batch(req, transfers::read_batch)?;
        self.state.read_call(req).await
    }

    async fn write_batch(
        &self,
        req: Request<pb::WriteBatchRequest>,
    ) -> Result<Response<pb::TransferStarted>, Status> {
        self.state.write_call(req).await
    }

    async fn read_batch(
        &self,
        req: Request<pb::ReadBatchRequest>,
    ) -> Result<Response<pb::TransferStarted>, Status> {
        self.state.read_call(req).await
    }

    async fn write_blocks(
        &self,
        req: Request<pb::WriteBlocksRequest>,
    ) -> Result<Response<pb::TransferStarted>, Status> {
        self.state.write_blocks_call(req).await
    }

    async fn read_blocks(
        &self,
        req: Request<pb::ReadBlocksRequest>,
    ) -> Result<Response<pb::TransferStarted>, Status> {
        self.state.read_blocks_call(req).await
    }

    type SessionStream = session::EventStream;

    async fn session(
        &self,
        req: Request<tonic::Streaming<pb::SessionRequest>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let deadline = transfers::grpc_timeout(&req)
            .map(|t| engine::deadline_after(Instant::now(), transfers::answer_within(t)));
        Ok(Response::new(session::start(
            self.state.clone(),
            deadline,
            req.into_inner(),
        )))
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
        let cancelled = self.state.cancel_transfer(TransferId(id)).await?;
        Ok(Response::new(pb::CancelResponse { cancelled }))
    }

    type SubscribeStream = NotificationStream;

    async fn subscribe(
        &self,
        req: Request<pb::SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        let to = super::delivery::addressed(req.get_ref());
        let mut rx = self.state.notifications.subscribe();
        let mut stopping = self.state.stopping.clone();
        let (tx, out) = tokio::sync::mpsc::channel(64);
        tokio::spawn(async move {
            loop {
                let next = tokio::select! {
                    n = super::delivery::next_for(&mut rx, &to) => n,
                    _ = async { stopping.wait_for(|s| *s).await.map(|_| ()) } => {
                        let _ = tx.send(Err(Status::unavailable("the daemon is shutting down"))).await;
                        return;
                    }
                };
                let item = match next {
                    Ok(n) => Ok(pb::Notification {
                        from_node: n.from_node,
                        transfer_id: n.transfer_id,
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
        let snap = self.state.stats_snapshot().await?;
        let buffers = self.state.buffers.list();
        let peers = snap
            .peers
            .iter()
            .map(|p| {
                let c = &p.counters;
                pb::PeerStats {
                    node_id: c.node_id.clone(),
                    state: link_pb(&p.link) as i32,
                    transfers_started: c.transfers_started,
                    transfers_ok: c.transfers_ok,
                    transfers_failed: c.transfers_failed,
                    sent_eager: c.sent_eager,
                    sent_rendezvous: c.sent_rendezvous,
                    received_eager: c.received_eager,
                    received_rendezvous: c.received_rendezvous,
                    sent_notices: c.sent_notices,
                    sent_inline: c.sent_inline,
                    received_inline: c.received_inline,
                    received_notices: c.received_notices,
                    idle_closes: c.idle_closes,
                    direct_control: p.direct_control,
                    direct_messages_sent: p.direct_messages_sent,
                    error: match &p.link {
                        PeerLink::Failed(why) => why.clone(),
                        _ => String::new(),
                    },
                    send_lanes: c.send_lanes,
                    recv_lanes: c.recv_lanes,
                    routed: c.routed,
                    bytes_sent: c.send.iter().map(|l| l.bytes).sum(),
                    bytes_received: c.recv.iter().map(|l| l.bytes).sum(),
                    lanes: crate::api::stats::lane_stats(p),
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
        // Closing: still up until the peer answered (a transfer waits for the answer).
        PeerLink::Up | PeerLink::Closing => pb::PeerState::Up,
        PeerLink::Idle => pb::PeerState::Idle,
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
