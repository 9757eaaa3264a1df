//! Registrations across a restart (docs/OPERATIONS.md, "Restarts"): what the state directory
//! records as registrations come and go (src/journal.rs), the checks a re-attach request passes
//! (the id and key the previous instance handed out, for the same kind and size of memory), and
//! what the daemon restores itself at start-up (its own host buffers, bytes included).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tonic::Status;

use super::state::{DaemonState, status};
use crate::buffers::{BufferEntry, BufferKind, Ident};
use crate::journal::{Owner, Record, Space};

/// The journal's name of a buffer kind.
pub fn kind_name(kind: BufferKind) -> &'static str {
    match kind {
        BufferKind::Host => "host",
        BufferKind::HostShared => "host_shared",
        BufferKind::Cuda => "cuda",
        BufferKind::CudaIpc => "cuda_ipc",
        BufferKind::HostAttached => "host_attached",
    }
}

/// A registration taken back from the state directory for a re-attach under way: put back (it
/// waits for its client again) unless [`Claim::keep`] says the re-attach succeeded, so a refused
/// or failed re-attach changes nothing.
#[must_use]
pub struct Claim {
    journal: Option<Arc<crate::journal::Journal>>,
    metrics: Option<Arc<crate::metrics::Metrics>>,
    space: Space,
    id: u64,
    record: Option<Record>,
}

impl Claim {
    fn none() -> Claim {
        Claim {
            journal: None,
            metrics: None,
            space: Space::Buffer,
            id: 0,
            record: None,
        }
    }

    /// The re-attach succeeded.
    pub fn keep(mut self) {
        if let (Some(m), Some(_)) = (&self.metrics, self.record.take()) {
            m.reattached(match self.space {
                Space::Buffer => "buffer",
                Space::List => "block_list",
                Space::Prepared => "prepared_list",
            });
        }
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if let (Some(j), Some(r)) = (&self.journal, self.record.take()) {
            j.unclaim(self.space, self.id, r);
        }
    }
}

fn no_state_dir(field: &str) -> Status {
    Status::failed_precondition(format!(
        "{field}: this daemon keeps no state directory (runtime.state_dir): nothing registered before \
         its start can be re-attached; register anew"
    ))
}

impl DaemonState {
    /// The id and key a buffer registration re-attaches (`reattach_id` non-zero), checked
    /// against the state directory: the same kind and size, the key the buffer had last.
    pub(crate) fn reattach_buffer(
        &self,
        id: u64,
        key: &[u8],
        kind: BufferKind,
        size: u64,
    ) -> Result<(Option<Ident>, Claim), Status> {
        self.reattach_buffer_of(id, key, kind, size, None)
    }

    /// As [`DaemonState::reattach_buffer`], for memory registered by address: `owner` (the
    /// session's peer process, where its memory is) must be the one the buffer was of.
    pub(crate) fn reattach_buffer_of(
        &self,
        id: u64,
        key: &[u8],
        kind: BufferKind,
        size: u64,
        owner: Option<Owner>,
    ) -> Result<(Option<Ident>, Claim), Status> {
        if id == 0 {
            return Ok((None, Claim::none()));
        }
        let journal = self.journal.as_ref().ok_or_else(|| no_state_dir("reattach_id"))?;
        let key: [u8; 16] = key.try_into().map_err(|_| {
            Status::invalid_argument(format!("reattach_key: {} bytes, expected 16", key.len()))
        })?;
        let want = hex::encode(key);
        let record = journal
            .claim("reattach_id", Space::Buffer, id, |r| match r {
                Record::Buffer {
                    kind: k,
                    size: s,
                    key: current,
                    owner: was,
                    ..
                } => {
                    if k != kind_name(kind) {
                        Err(format!("it was a {k} buffer, this is {}", kind_name(kind)))
                    } else if *s != size {
                        Err(format!("it was {s} bytes, this is {size}"))
                    } else if *current != want {
                        Err("reattach_key is not its access key (re-keyed since? describe it again)".into())
                    } else {
                        match (was, owner) {
                            (Some(w), Some(o)) if w.pid != o.pid || w.start != o.start => Err(format!(
                                "it was memory of process {} (started at tick {}), this request comes from process {} (tick {})",
                                w.pid, w.start, o.pid, o.start
                            )),
                            (Some(w), Some(o)) if w.address != o.address => Err(format!(
                                "it was at address {:#x}, this is {:#x}",
                                w.address, o.address
                            )),
                            _ => Ok(()),
                        }
                    }
                }
                _ => Err("not a buffer".into()),
            })
            .map_err(status)?;
        Ok((
            Some(Ident { id, key }),
            claimed(self, journal, Space::Buffer, id, record),
        ))
    }

    /// Records a buffer (registered, re-attached or re-keyed) in the state directory.
    pub(crate) fn journal_buffer(&self, b: &BufferEntry) -> Result<(), Status> {
        let Some(journal) = &self.journal else {
            return Ok(());
        };
        let owner = b.attached.map(|p| Owner {
            pid: p.pid,
            start: process_start(p.pid).unwrap_or(0),
            address: p.addr,
        });
        let record = Record::Buffer {
            kind: kind_name(b.kind).to_string(),
            size: b.size,
            key: hex::encode(b.key()),
            label: b.label.clone(),
            owner,
            device: self.buffers.kept_cuda_device(b),
            lists: Vec::new(), // (the lists its record named before are kept)
        };
        journal.record(Space::Buffer, b.id, &record).map_err(status)
    }

    /// A list re-attached on `buffer` (`id` non-zero), checked against the state directory.
    pub(crate) fn reattach_list(&self, id: u64, buffer: u64) -> Result<(Option<u64>, Claim), Status> {
        if id == 0 {
            return Ok((None, Claim::none()));
        }
        let journal = self.journal.as_ref().ok_or_else(|| no_state_dir("reattach_id"))?;
        let record = journal
            .claim("reattach_id", Space::List, id, |r| match r {
                Record::List { buffer: b } if *b == buffer => Ok(()),
                Record::List { buffer: b } => Err(format!("it was on buffer {b}, not {buffer}")),
                _ => Err("not a block list".into()),
            })
            .map_err(status)?;
        Ok((Some(id), claimed(self, journal, Space::List, id, record)))
    }

    /// A prepared list re-attached (`id` non-zero), checked against the state directory.
    pub(crate) fn reattach_prepared(&self, id: u64) -> Result<(Option<u64>, Claim), Status> {
        if id == 0 {
            return Ok((None, Claim::none()));
        }
        let journal = self.journal.as_ref().ok_or_else(|| no_state_dir("reattach_id"))?;
        let record = journal
            .claim("reattach_id", Space::Prepared, id, |r| match r {
                Record::Prepared => Ok(()),
                _ => Err("not a prepared list".into()),
            })
            .map_err(status)?;
        Ok((Some(id), claimed(self, journal, Space::Prepared, id, record)))
    }

    /// Records a registration other than a buffer.
    pub(crate) fn journal_record(&self, space: Space, id: u64, record: Record) -> Result<(), Status> {
        match &self.journal {
            Some(j) => j.record(space, id, &record).map_err(status),
            None => Ok(()),
        }
    }

    /// Forgets a released registration.
    pub(crate) fn journal_forget(&self, space: Space, id: u64) {
        if let Some(j) = &self.journal {
            j.forget(space, id);
        }
        if space == Space::Buffer {
            self.buffers.forget_kept_cuda(id);
        }
    }
}

/// When process `pid` started (`/proc/<pid>/stat` field 22, clock ticks since boot): with the
/// pid, names one process for the machine's uptime.
pub fn process_start(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces and parentheses): state is field 3.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

fn claimed(
    state: &DaemonState,
    journal: &Arc<crate::journal::Journal>,
    space: Space,
    id: u64,
    record: Record,
) -> Claim {
    Claim {
        journal: Some(journal.clone()),
        metrics: Some(state.metrics.clone()),
        space,
        id,
        record: Some(record),
    }
}

/// At start-up: restores the previous instance's daemon-allocated host buffers (their memory
/// files, bytes and all, under their ids and keys) and CUDA buffers (their fds from the
/// descriptor store: src/cuda_kept.rs), then forgets, once `grace` has passed, what
/// no client re-attached. Returns how many buffers came back.
pub async fn restore(state: &Arc<DaemonState>, grace: Duration, mut stop: watch::Receiver<bool>) -> usize {
    let Some(journal) = state.journal.clone() else {
        return 0;
    };
    let mut restored = 0;
    for kept in journal.take_kept_host() {
        let k = kept.clone();
        match restore_one(state, move |st| st.buffers.restore_host(&k)).await {
            Ok(entry) => {
                restored += 1;
                state.metrics.reattached("host_restored");
                tracing::info!(
                    buffer = entry.id,
                    size = entry.size,
                    "daemon-allocated host buffer restored"
                );
            }
            Err(e) => {
                tracing::warn!(
                    buffer = kept.id,
                    "a daemon-allocated host buffer could not be restored: {}",
                    e.message()
                );
                journal.forget(Space::Buffer, kept.id);
            }
        }
    }
    restored += restore_cuda(state, &journal).await;
    let pending = journal.pending();
    state.metrics.set_reattach_pending(pending);
    if pending > 0 {
        tracing::info!(
            pending,
            grace_s = grace.as_secs(),
            "registrations of the previous instance wait for their clients to re-attach them"
        );
        let metrics = state.metrics.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = tokio::time::sleep(grace) => {
                    let n = journal.expire();
                    metrics.reattach_forgotten(n);
                    metrics.set_reattach_pending(0);
                    if n > 0 {
                        tracing::info!(forgotten = n, "registrations no client re-attached within runtime.reattach_grace_s were forgotten");
                    }
                }
                _ = stop.wait_for(|s| *s) => {}
            }
        });
    }
    restored
}

/// Makes one kept buffer again off the runtime (`restore`: its memory mapped back) and installs
/// it: the buffer, or why it could not come back.
async fn restore_one<F>(state: &Arc<DaemonState>, restore: F) -> Result<Arc<BufferEntry>, Status>
where
    F: FnOnce(&DaemonState) -> Result<Arc<BufferEntry>, crate::engine::EngineError> + Send + 'static,
{
    let st = state.clone();
    match tokio::task::spawn_blocking(move || restore(&st)).await {
        Ok(Ok(entry)) => state.install(&entry).await.map(|_| entry),
        Ok(Err(e)) => Err(status(e)),
        Err(e) => Err(Status::internal(e.to_string())),
    }
}

/// Restores the previous instance's daemon-allocated CUDA buffers from the descriptors the
/// store kept (systemd's, passed back as `LISTEN_FDS`; or the fd keeper's); a record without its descriptor, or a descriptor
/// without its record, is dropped (and taken out of the store). Returns how many came back.
async fn restore_cuda(state: &Arc<DaemonState>, journal: &Arc<crate::journal::Journal>) -> usize {
    use crate::fd_store::fd_name;
    let mut fds = match &state.buffers.cuda_store {
        Some(store) => store.take_stored(),
        None => crate::fd_store::take_inherited(),
    };
    let mut restored = 0;
    for kept in journal.take_kept_cuda() {
        let Some(fd) = fds.remove(&fd_name(kept.id)) else {
            tracing::warn!(
                buffer = kept.id,
                "a daemon-allocated CUDA buffer's descriptor did not come back from the service manager's \
                 store (a restart outside it, or the store was emptied): not restored"
            );
            journal.forget(Space::Buffer, kept.id);
            continue;
        };
        if !state.buffers.keeps_cuda() {
            tracing::warn!(
                buffer = kept.id,
                "a daemon-allocated CUDA buffer's descriptor came back, but this instance has no descriptor \
                 store (NOTIFY_SOCKET and FDSTORE, or runtime.fd_keeper): not restored"
            );
            journal.forget(Space::Buffer, kept.id);
            continue;
        }
        let k = kept.clone();
        match restore_one(state, move |st| st.buffers.restore_cuda(&k, fd)).await {
            Ok(entry) => {
                restored += 1;
                state.metrics.reattached("cuda_restored");
                tracing::info!(
                    buffer = entry.id,
                    size = entry.size,
                    device = kept.device,
                    "daemon-allocated CUDA buffer restored"
                );
            }
            Err(e) => {
                tracing::warn!(
                    buffer = kept.id,
                    "a daemon-allocated CUDA buffer could not be restored: {}",
                    e.message()
                );
                state.journal_forget(Space::Buffer, kept.id);
            }
        }
    }
    for (name, fd) in fds {
        drop(fd);
        if name.starts_with("tcpxd-cuda-b")
            && let Some(store) = &state.buffers.cuda_store
        {
            tracing::info!(
                name,
                "a kept CUDA descriptor no registration claims: taken out of the store"
            );
            store.remove_unclaimed(&name);
        }
    }
    restored
}
