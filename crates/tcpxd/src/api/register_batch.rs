//! A local client's own host memory registered, several regions at a time: the registrations a
//! session finds waiting together (a client sends them pipelined: tcpxd.nixl's `register_memory`
//! sends 64 before it reads an answer) are carried out as one batch, so what costs a round trip
//! between the daemon's threads is paid once a batch rather than once a region:
//!
//! 1. each request checked, and a re-attach claimed from the state directory (async side);
//! 2. every region mapped in one blocking task: a file descriptor's range mapped shared and its
//!    pages faulted in (src/host_file.rs), or memory of the client's process checked for
//!    cross-memory attach (src/net/cross_memory.rs);
//! 3. the buffers published, then handed to the poller with the block lists asked for on each in
//!    one command (`Command::AddBuffers`);
//! 4. the state directory's records of every buffer and list written together
//!    (`Journal::record_many`, one write of the id floors), before any is answered.
//!
//! Each registration still succeeds or fails alone, with its own status; one that fails leaves
//! nothing registered for it. A batch of one is the single registration.

use std::sync::Arc;

use tonic::Status;

use super::host_memory::Attached;
use super::proto::v1 as pb;
use super::reattach::{Claim, kind_name, process_start};
use super::state::{DaemonState, status};
use crate::buffers::{BufferEntry, BufferKind, Ident};
use crate::engine::EngineError;
use crate::engine::blocks::Layout;
use crate::journal::{Owner, Record, Space};
use crate::net::cross_memory::ClientPages;
use crate::poller::{AddedBuffer, Command, ListFacts};

/// Registrations one batch takes at most (a client's pipeline is 64).
pub const MAX_BATCH: usize = 64;

/// One registration of a batch, as the session read it.
pub enum Registration {
    /// `register_host_fd`, with the descriptor that came with it.
    HostFd(pb::RegisterHostFdRequest, Result<Attached, Status>),
    /// `register_client_memory`, with the session's peer process.
    ClientMemory(pb::RegisterClientMemoryRequest, Result<i32, Status>),
}

/// What step 2 maps, per registration.
enum Work {
    File {
        attached: Attached,
        offset: u64,
        size: u64,
        label: String,
    },
    Pages {
        pages: ClientPages,
        size: u64,
        label: String,
    },
}

/// A registration past its checks: its work, re-attach and lists.
struct Checked {
    work: Work,
    ident: Option<Ident>,
    claim: Claim,
    lists: Vec<pb::StridedBlocks>,
}

/// A registration mapped and added: its buffer and lists.
struct Added {
    entry: Arc<BufferEntry>,
    claim: Claim,
    lists: Vec<Result<ListFacts, EngineError>>,
}

impl DaemonState {
    /// Registers a batch (each with the strided block lists it asked for): per registration, in
    /// order, its buffer (lists and their statuses in `block_lists`, `block_list_status`) or why
    /// it was refused.
    pub(crate) async fn register_batch(
        self: &Arc<Self>,
        batch: Vec<(Registration, Vec<pb::StridedBlocks>)>,
    ) -> Vec<Result<pb::Buffer, Status>> {
        let mut starts = ProcessStarts::default();
        let mut out: Vec<Option<Result<pb::Buffer, Status>>> = (0..batch.len()).map(|_| None).collect();
        let mut checked: Vec<(usize, Checked)> = Vec::new();
        for (i, (reg, lists)) in batch.into_iter().enumerate() {
            match self.check(reg, &mut starts) {
                Ok((work, ident, claim)) => checked.push((
                    i,
                    Checked {
                        work,
                        ident,
                        claim,
                        lists,
                    },
                )),
                Err(e) => out[i] = Some(Err(e)),
            }
        }
        let added = self.map_and_add(checked).await;
        let added = self.journal_batch(added).await;
        let mut registered = (0u64, 0u64);
        for (i, r) in added {
            out[i] = Some(r.map(|a| {
                a.claim.keep();
                registered.0 += 1;
                registered.1 += a.entry.size;
                let mut buffer = self.buffer_pb(&a.entry);
                for (k, list) in a.lists.into_iter().enumerate() {
                    let (list, st) = match list {
                        Ok(f) => (self.block_list_pb(&f), pb::EntryStatus::default()),
                        Err(e) => (
                            pb::BlockList::default(),
                            pb::EntryStatus {
                                code: e.code as i32,
                                message: format!("block_lists[{k}]: {}", e.message),
                            },
                        ),
                    };
                    buffer.block_lists.push(list);
                    buffer.block_list_status.push(st);
                }
                tracing::debug!(
                    buffer = a.entry.id,
                    size = a.entry.size,
                    kind = kind_name(a.entry.kind),
                    "client host memory registered"
                );
                buffer
            }));
        }
        if registered.0 > 0 {
            tracing::info!(
                buffers = registered.0,
                bytes = registered.1,
                "client host memory registered"
            );
        }
        out.into_iter()
            .map(|o| {
                o.unwrap_or_else(|| Err(Status::internal("a registration of the batch went unanswered")))
            })
            .collect()
    }

    /// Step 1: the request's checks and its re-attach claim.
    fn check(
        &self,
        reg: Registration,
        starts: &mut ProcessStarts,
    ) -> Result<(Work, Option<Ident>, Claim), Status> {
        match reg {
            Registration::HostFd(req, attached) => {
                let attached = attached?;
                let (ident, claim) = self.reattach_buffer(
                    req.reattach_id,
                    &req.reattach_key,
                    BufferKind::HostShared,
                    req.size,
                )?;
                let work = Work::File {
                    attached,
                    offset: req.offset,
                    size: req.size,
                    label: req.label,
                };
                Ok((work, ident, claim))
            }
            Registration::ClientMemory(req, pid) => {
                let pid = pid?;
                if req.address == 0 {
                    return Err(Status::invalid_argument("address: must not be 0"));
                }
                if req.address.checked_add(req.size).is_none() {
                    return Err(Status::invalid_argument(format!(
                        "size: address {:#x} + {} bytes overflows 64 bits",
                        req.address, req.size
                    )));
                }
                // A re-attach after a restart: the same process (pid and start time, the
                // kernel's word for the session's peer), address and size, with the buffer's
                // current key.
                let owner = (req.reattach_id != 0).then(|| Owner {
                    pid,
                    start: starts.of(pid),
                    address: req.address,
                });
                let (ident, claim) = self.reattach_buffer_of(
                    req.reattach_id,
                    &req.reattach_key,
                    BufferKind::HostAttached,
                    req.size,
                    owner,
                )?;
                let pages = ClientPages {
                    pid,
                    addr: req.address,
                };
                let work = Work::Pages {
                    pages,
                    size: req.size,
                    label: req.label,
                };
                Ok((work, ident, claim))
            }
        }
    }

    /// Steps 2 and 3: every region mapped in one blocking task, then the buffers published and
    /// added to the poller, with their lists, in one command.
    async fn map_and_add(
        self: &Arc<Self>,
        checked: Vec<(usize, Checked)>,
    ) -> Vec<(usize, Result<Added, Status>)> {
        let mut claims = Vec::with_capacity(checked.len());
        let mut jobs = Vec::with_capacity(checked.len());
        for (i, c) in checked {
            claims.push((i, c.claim, c.lists));
            jobs.push((c.work, c.ident));
        }
        let state = self.clone();
        let mapped = tokio::task::spawn_blocking(move || {
            jobs.into_iter()
                .map(|(work, ident)| state.map_one(work, ident))
                .collect::<Vec<_>>()
        })
        .await;
        let mapped = match mapped {
            Ok(m) => m,
            Err(e) => {
                let e = Status::internal(format!("mapping the registrations: {e}"));
                return claims.into_iter().map(|(i, _, _)| (i, Err(e.clone()))).collect();
            }
        };
        let mut out = Vec::with_capacity(claims.len());
        let mut items: Vec<(Arc<BufferEntry>, Vec<Layout>)> = Vec::new();
        let mut waiting = Vec::new();
        for ((i, claim, lists), entry) in claims.into_iter().zip(mapped) {
            match entry.and_then(|e| self.buffers.publish(e.clone()).map(|()| e)) {
                Ok(entry) => {
                    let layouts = lists.into_iter().map(strided).collect();
                    items.push((entry.clone(), layouts));
                    waiting.push((i, claim, entry));
                }
                Err(e) => out.push((i, Err(status(e)))),
            }
        }
        if items.is_empty() {
            return out;
        }
        let answers: Vec<AddedBuffer> = match self.ask(|reply| Command::AddBuffers { items, reply }).await {
            Ok(a) => a,
            Err(e) => {
                for (i, _, entry) in waiting {
                    self.buffers.remove(entry.id);
                    out.push((i, Err(e.clone())));
                }
                return out;
            }
        };
        for ((i, claim, entry), added) in waiting.into_iter().zip(answers) {
            match added {
                Ok(lists) => out.push((i, Ok(Added { entry, claim, lists }))),
                Err(e) => {
                    self.buffers.remove(entry.id);
                    out.push((i, Err(status(e))));
                }
            }
        }
        out
    }

    /// Step 2 for one region (blocking).
    fn map_one(&self, work: Work, ident: Option<Ident>) -> Result<Arc<BufferEntry>, EngineError> {
        match work {
            Work::File {
                attached,
                offset,
                size,
                label,
            } => {
                // The descriptor closes here: the mapping holds the file.
                let (entry, _) = self.buffers.register_host_file_as(
                    &attached.fd,
                    offset,
                    size,
                    &label,
                    attached.unsealed,
                    ident,
                )?;
                Ok(entry)
            }
            Work::Pages { pages, size, label } => {
                let entry = self.buffers.client_pages(pages, size, &label, ident)?;
                pages.probe(size).map_err(crate::buffers::attach_error)?;
                Ok(entry)
            }
        }
    }

    /// Step 4: the records of every buffer added and of its lists, written together before any
    /// is answered. A buffer whose record could not be written is released (refused); a list
    /// whose record could not be, released and refused in the buffer's `block_list_status`.
    async fn journal_batch(
        &self,
        added: Vec<(usize, Result<Added, Status>)>,
    ) -> Vec<(usize, Result<Added, Status>)> {
        let Some(journal) = self.journal.clone() else {
            return added;
        };
        let mut starts = ProcessStarts::default();
        let mut records = Vec::new();
        for (_, a) in &added {
            let Ok(a) = a else { continue };
            let b = &a.entry;
            let owner = b.attached.map(|p| Owner {
                pid: p.pid,
                start: starts.of(p.pid),
                address: p.addr,
            });
            records.push((
                Space::Buffer,
                b.id,
                Record::Buffer {
                    kind: kind_name(b.kind).to_string(),
                    size: b.size,
                    key: hex::encode(b.key()),
                    label: b.label.clone(),
                    owner,
                    device: None,
                },
            ));
            for f in a.lists.iter().flatten() {
                records.push((Space::List, f.id, Record::List { buffer: b.id }));
            }
        }
        let mut written = journal.record_many(&records).into_iter();
        let mut out = Vec::with_capacity(added.len());
        for (i, a) in added {
            let Ok(mut a) = a else {
                out.push((i, a));
                continue;
            };
            let buffer_written = written.next().unwrap_or(Ok(()));
            let mut lists_written = Vec::new();
            for l in a.lists.iter() {
                if l.is_ok() {
                    lists_written.push(written.next().unwrap_or(Ok(())));
                } else {
                    lists_written.push(Ok(()));
                }
            }
            if let Err(e) = buffer_written {
                let _ = self.release(a.entry.id, None).await;
                out.push((i, Err(status(e))));
                continue;
            }
            for (list, w) in a.lists.iter_mut().zip(lists_written) {
                if let (Ok(f), Err(e)) = (&*list, w) {
                    let _ = self.release_blocks(f.id).await;
                    *list = Err(e);
                }
            }
            out.push((i, Ok(a)));
        }
        out
    }
}

/// A registration's granule list, as the engine takes it.
fn strided(s: pb::StridedBlocks) -> Layout {
    Layout::Strided {
        first: s.first,
        stride: s.stride,
        len: s.length,
        count: s.count,
    }
}

/// When each client process started (`/proc/<pid>/stat`), read once a batch.
#[derive(Default)]
struct ProcessStarts(Vec<(i32, u64)>);

impl ProcessStarts {
    fn of(&mut self, pid: i32) -> u64 {
        if let Some(&(_, s)) = self.0.iter().find(|(p, _)| *p == pid) {
            return s;
        }
        let s = process_start(pid).unwrap_or(0);
        self.0.push((pid, s));
        s
    }
}
