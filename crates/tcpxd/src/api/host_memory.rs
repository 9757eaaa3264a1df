//! Buffers coming and going through the client API: installing a new buffer (the registry, then
//! the poller), and releasing one once no transfer uses it. A local client's own host memory
//! (the file descriptor that came with its request, src/host_fd.rs, or its addresses) is
//! registered in batches (src/api/register_batch.rs); a buffer registered that way belongs to the
//! session that registered it: released when that session ends (as by ReleaseBuffer), unless the
//! client released it before.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::Status;

use super::state::{DaemonState, status};
use crate::buffers::BufferEntry;
use crate::engine::{self, Code};
use crate::host_file::Unsealed;
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
