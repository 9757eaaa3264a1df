//! Buffers coming and going through the client API: installing a new buffer (the registry, then
//! the poller), releasing one once no transfer uses it, and registering a local client's own host
//! memory from the file descriptor that came with its request (src/host_fd.rs). A buffer
//! registered that way belongs to the session that registered it: released when that session
//! ends (as by ReleaseBuffer), unless the client released it before.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::Status;

use super::proto::v1 as pb;
use super::state::{DaemonState, status};
use crate::buffers::{BufferEntry, BufferKind};
use crate::engine::{self, Code};
use crate::host_file::{Shrink, Unsealed};
use crate::net::cross_memory::ClientPages;
use crate::poller::Command;

/// A file descriptor that came with a request (the framed local session's SCM_RIGHTS), and
/// whether its sender may hand over a file that cannot be sealed against shrinking.
#[derive(Debug)]
pub struct Attached {
    pub fd: OwnedFd,
    pub unsealed: Unsealed,
}

/// What a transport without descriptor passing answers a `register_host_fd`.
pub fn no_descriptors() -> Status {
    Status::failed_precondition(
        "register_host_fd: file descriptors pass only over the framed local session on the daemon's \
         unix socket (docs/API.md, \"Client host memory\"); a gRPC stream cannot carry them",
    )
}

/// What a transport without peer credentials answers a `register_client_memory`.
pub fn no_peer_process() -> Status {
    Status::failed_precondition(
        "register_client_memory: memory is registered by address only over the framed local session on \
         the daemon's unix socket (docs/API.md, \"Client host memory\"), where the kernel names the client's process",
    )
}

/// How often a release still waiting on transfers says so.
const STILL_WAITING: Duration = Duration::from_secs(10);

impl DaemonState {
    /// Makes a new buffer visible, then known to the poller; nothing stays registered on failure.
    /// No client can name the id before this returns it.
    pub(crate) async fn install(&self, entry: &Arc<BufferEntry>) -> Result<(), Status> {
        // The label check is atomic in the registry.
        self.buffers.publish(entry.clone()).map_err(status)?;
        let e = entry.clone();
        let added = self.ask(|reply| Command::AddBuffer { entry: e, reply }).await;
        if let Err(e) = added.and_then(|r| r.map_err(status)) {
            self.buffers.remove(entry.id);
            return Err(e);
        }
        Ok(())
    }

    /// Releases buffer `id` once no transfer uses it, waiting until `deadline` (None: as long as
    /// it takes) for the transfers using it to end. NOT_FOUND when it does not exist.
    pub(crate) async fn release(&self, id: u64, deadline: Option<Instant>) -> Result<(), Status> {
        self.buffers.get(id).map_err(status)?;
        self.same_node.idle(id, deadline).await?;
        let started = Instant::now();
        loop {
            match self.ask(|reply| Command::RemoveBuffer { id, reply }).await? {
                Ok(()) => break,
                Err(e)
                    if e.code == engine::Code::FailedPrecondition
                        && deadline.is_none_or(|d| Instant::now() < d) =>
                {
                    // The engine says when the buffer's last user ended (`Action::BufferIdle`);
                    // then try again (a new transfer may have taken it meanwhile). Without a
                    // deadline, say every STILL_WAITING that it is still in use.
                    let idle = self.ask(|reply| Command::WhenBufferIdle { id, reply });
                    let until = deadline.unwrap_or_else(|| Instant::now() + STILL_WAITING);
                    if tokio::time::timeout_at(until.into(), idle).await.is_err() {
                        if deadline.is_some() {
                            // The deadline passed with the buffer still in use: answer now, with
                            // the engine's words, rather than after another round trip to a
                            // poller busy with the very transfers it waits for.
                            return Err(status(e));
                        }
                        tracing::info!(
                            buffer = id,
                            waited_s = started.elapsed().as_secs(),
                            "releasing a buffer: still waiting for the transfers using it"
                        );
                    }
                }
                Err(e) => return Err(status(e)),
            }
        }
        self.buffers.remove(id);
        self.journal_forget(crate::journal::Space::Buffer, id);
        tracing::info!(buffer = id, "buffer released");
        Ok(())
    }

    /// Registers a local client's host memory from the descriptor that came with the request.
    pub(crate) async fn register_host_fd(
        self: &Arc<Self>,
        req: pb::RegisterHostFdRequest,
        attached: Result<Attached, Status>,
    ) -> Result<pb::Buffer, Status> {
        let Attached { fd, unsealed } = attached?;
        let (ident, claim) = self.reattach_buffer(
            req.reattach_id,
            &req.reattach_key,
            BufferKind::HostShared,
            req.size,
        )?;
        let state = self.clone();
        let (entry, shrink) = tokio::task::spawn_blocking(move || {
            // The descriptor closes here: the mapping holds the file.
            state
                .buffers
                .register_host_file_as(&fd, req.offset, req.size, &req.label, unsealed, ident)
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?
        .map_err(status)?;
        self.install(&entry).await?;
        if let Err(e) = self.journal_buffer(&entry) {
            let _ = self.release(entry.id, None).await;
            return Err(e);
        }
        claim.keep();
        tracing::info!(
            buffer = entry.id,
            size = entry.size,
            reattached = ident.is_some(),
            sealed = shrink == Shrink::Sealed,
            "client host memory registered"
        );
        Ok(self.buffer_pb(&entry))
    }

    /// Registers a local client's memory by address (`pid`: the session's peer), after checking
    /// that the daemon may read and write it (cross-memory attach).
    pub(crate) async fn register_client_memory(
        self: &Arc<Self>,
        req: pb::RegisterClientMemoryRequest,
        pid: i32,
    ) -> Result<pb::Buffer, Status> {
        if req.address == 0 {
            return Err(Status::invalid_argument("address: must not be 0"));
        }
        if req.address.checked_add(req.size).is_none() {
            return Err(Status::invalid_argument(format!(
                "size: address {:#x} + {} bytes overflows 64 bits",
                req.address, req.size
            )));
        }
        let pages = ClientPages {
            pid,
            addr: req.address,
        };
        // A re-attach after a restart: the same process (pid and start time, the kernel's word
        // for the session's peer), address and size, with the buffer's current key.
        let owner = crate::journal::Owner {
            pid,
            start: super::reattach::process_start(pid).unwrap_or(0),
            address: req.address,
        };
        let (ident, claim) = self.reattach_buffer_of(
            req.reattach_id,
            &req.reattach_key,
            BufferKind::HostAttached,
            req.size,
            Some(owner),
        )?;
        let state = self.clone();
        let entry = tokio::task::spawn_blocking(move || {
            let entry = state.buffers.client_pages(pages, req.size, &req.label, ident)?;
            pages.probe(req.size).map_err(crate::buffers::attach_error)?;
            Ok::<_, engine::EngineError>(entry)
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?
        .map_err(status)?;
        self.install(&entry).await?;
        if let Err(e) = self.journal_buffer(&entry) {
            let _ = self.release(entry.id, None).await;
            return Err(e);
        }
        claim.keep();
        tracing::info!(
            buffer = entry.id,
            size = entry.size,
            pid,
            reattached = ident.is_some(),
            "client memory registered by address"
        );
        Ok(self.buffer_pb(&entry))
    }

    /// The session that registered `ids` ended: each still registered is made unreachable by
    /// descriptor (a new key nobody knows), then released once no transfer uses it, in the
    /// background (its mapping goes with the last transfer holding it).
    pub(crate) fn release_owned(self: &Arc<Self>, ids: Vec<u64>) {
        if ids.is_empty() {
            return;
        }
        let state = self.clone();
        tokio::spawn(async move {
            for id in ids {
                if *state.stopping.borrow() {
                    // The daemon stops (an upgrade, a restart): the registrations stay in the
                    // state directory for the client to re-attach to the next instance.
                    return;
                }
                if state.buffers.get(id).is_err() {
                    continue; // released by the client already
                }
                let key: [u8; 16] = rand::random();
                match state.ask(|reply| Command::RekeyBuffer { id, key, reply }).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) if e.code == Code::NotFound => continue,
                    Ok(Err(e)) => tracing::warn!(buffer = id, "re-keying a session's buffer at its end: {e}"),
                    Err(_) => return, // the daemon is shutting down
                }
                match state.release(id, None).await {
                    Ok(()) => tracing::debug!(buffer = id, "released with the session that registered it"),
                    Err(e) if e.code() == tonic::Code::NotFound => {}
                    Err(e) if e.code() == tonic::Code::Unavailable => return, // shutting down
                    Err(e) => tracing::warn!(
                        buffer = id,
                        "releasing a session's buffer at its end: {}",
                        e.message()
                    ),
                }
            }
        });
    }
}
