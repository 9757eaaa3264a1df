//! What the services share: [`DaemonState`] (the registry, the poller's command channel, the
//! peers, the transfers' status channels and the metrics), and the one mapping of engine errors
//! to gRPC statuses.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{broadcast, oneshot, watch};
use tonic::Status;

use super::proto::v1 as pb;
use crate::buffers::{BufferEntry, BufferKind, BufferRegistry};
use crate::engine::EngineError;
use crate::peers::Peers;
use crate::poller::{Command, NotificationEvent, TransferStatus};
use crate::status_watch;

/// Maps an engine error to a gRPC status (the codes are the same numbers).
pub fn status(e: EngineError) -> Status {
    Status::new(tonic::Code::from_i32(e.code as i32), e.message)
}

/// Everything the services share.
pub struct DaemonState {
    pub node_id: String,
    pub buffers: BufferRegistry,
    pub poller: crate::poller::PollerTx,
    /// Shared with the dials it runs as tasks of their own (`Peers::connect`).
    pub peers: Arc<Peers>,
    pub notifications: broadcast::Sender<NotificationEvent>,
    /// The accepted transfers by id, kept their retention after they finished.
    pub transfers: super::transfer_index::TransferIndex,
    pub default_timeout: Duration,
    /// Becomes true when the daemon stops serving: long-lived streams end.
    pub stopping: watch::Receiver<bool>,
    /// The Prometheus series (also behind GetStats).
    pub metrics: Arc<crate::metrics::Metrics>,
    /// What DescribeNode reports.
    pub node: super::node::NodeFacts,
    /// Transfers between two buffers of this daemon, which it copies itself.
    pub same_node: Arc<super::same_node_registry::SameNode>,
    /// The state directory (`runtime.state_dir`): registrations outlive the process.
    pub journal: Option<Arc<crate::journal::Journal>>,
    /// Remote prepared lists: the first token each was prepared from (its node and where to
    /// dial it), so a transfer pairs again with a node that restarted.
    pub remote_prepared: Mutex<HashMap<u64, crate::block_token::BlockToken>>,
    /// `runtime.shared_completions`: framed sessions may attach a completion board.
    pub shared_completions: bool,
    /// `runtime.request_ring`: framed sessions may attach a request ring.
    pub request_ring: bool,
}

impl DaemonState {
    pub(crate) async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Command) -> Result<T, Status> {
        let (tx, rx) = oneshot::channel();
        // The hop trace's split of `api.in → poller.cmd`: the API's own checks end here.
        tracing::trace!(target: "tcpxd::hop", hop = "api.ask");
        self.poller
            .send(make(tx))
            .map_err(|_| Status::unavailable("the daemon is shutting down"))?;
        rx.await
            .map_err(|_| Status::unavailable("the daemon is shutting down"))
    }

    /// The poller's stats snapshot, its `active_transfers` counting the same-node copies in
    /// flight too.
    pub(crate) async fn stats_snapshot(&self) -> Result<crate::peer_stats::StatsSnapshot, Status> {
        let mut snap = self.ask(|reply| Command::Stats { reply }).await?;
        snap.active_transfers += self.same_node.active();
        Ok(snap)
    }

    /// Cancels a transfer, a same-node one or the poller's: `false` when it already ended.
    pub(crate) async fn cancel_transfer(&self, id: crate::engine::TransferId) -> Result<bool, Status> {
        match self.same_node.cancel(id.0) {
            Some(c) => Ok(c),
            None => self.ask(|reply| Command::Cancel { id, reply }).await,
        }
    }

    pub(super) fn transfer(&self, id: u64) -> Result<status_watch::Receiver<TransferStatus>, Status> {
        self.transfers.get(id).ok_or_else(|| {
            Status::not_found(format!(
                "transfer_id: transfer {id} is unknown (or finished long ago)"
            ))
        })
    }

    /// Forgets transfers that finished `transfer.finished_retention_s` ago, and the oldest
    /// finished past `transfer.finished_kept_max` (`api::transfer_index`).
    pub fn prune_finished(&self, now: Instant) {
        let p = self.transfers.prune(now);
        if p.over_cap > 0 {
            tracing::debug!(
                expired = p.expired,
                over_cap = p.over_cap,
                "forgot finished transfers early: more than transfer.finished_kept_max kept"
            );
        }
    }

    pub(super) fn buffer_pb(&self, b: &BufferEntry) -> pb::Buffer {
        pb::Buffer {
            id: b.id,
            kind: match b.kind {
                BufferKind::Host => pb::BufferKind::Host,
                BufferKind::Cuda => pb::BufferKind::Cuda,
                BufferKind::CudaIpc => pb::BufferKind::CudaIpc,
                BufferKind::HostShared => pb::BufferKind::HostShared,
                BufferKind::HostAttached => pb::BufferKind::HostAttached,
            } as i32,
            size: b.size,
            label: b.label.clone(),
            descriptor: self.buffers.descriptor(b).encode(),
            cuda_ipc_handle: b.ipc_export().map(|e| e.handle.to_vec()).unwrap_or_default(),
            cuda_ipc_offset: b.ipc_export().map(|e| e.offset).unwrap_or(0),
            device: b.gpu().map(|g| g.ordinal() as u32).unwrap_or(0),
            active_transfers: 0,
            block_lists: Vec::new(),
            block_list_status: Vec::new(),
        }
    }
}
