//! A local client's own host memory registered, several regions at a time: the registrations a
//! session finds waiting together (a client sends them pipelined: tcpxd.nixl's `register_memory`
//! sends 64 before it reads an answer) are carried out as one batch, so what costs a round trip
//! between the daemon's threads is paid once a batch rather than once a region:
//!
//! 1. each request checked, and a re-attach claimed from the state directory (async side);
//! 2. every region mapped: a file descriptor's range mapped shared and its pages faulted in
//!    (src/host_file.rs) in one blocking task, or, for a batch of memory by address only, on the
//!    session's task, memory of the client's process checked for cross-memory attach
//!    (src/net/cross_memory.rs);
//! 3. the buffers published, then handed to the poller with the block lists asked for on each in
//!    one command (`Command::AddBuffers`);
//! 4. the state directory's records of every buffer written together (`Journal::record_many`,
//!    one write of the id floors; a buffer's lists named in its record, one file a region),
//!    before any is answered.
//!
//! Each registration still succeeds or fails alone, with its own status; one that fails leaves
//! nothing registered for it. A batch of one is the single registration.
//!
//! Releases of a session's buffers that come together (`release_batch`) likewise go to the
//! poller in one command (`release_batch` below).

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

/// A buffer made for memory by address, its range not probed yet (`map_pages`).
type Made = (Arc<BufferEntry>, ClientPages, u64);

/// A registration mapped and added: its buffer and lists.
struct Added {
    entry: Arc<BufferEntry>,
    claim: Claim,
    lists: Vec<Result<ListFacts, EngineError>>,
}

/// A registration carried out: its buffer, and each list asked for with it (made, or why not).
pub struct Registered {
    pub entry: Arc<BufferEntry>,
    pub lists: Vec<Result<ListFacts, EngineError>>,
}

impl DaemonState {
    /// Registers a batch (each with the strided block lists it asked for): per registration, in
    /// order, its buffer and lists (`buffer_answer`, `packed_answer`) or why it was refused.
    pub(crate) async fn register_batch(
        self: &Arc<Self>,
        batch: Vec<(Registration, Vec<pb::StridedBlocks>)>,
    ) -> Vec<Result<Registered, Status>> {
        let mut starts = ProcessStarts::default();
        let mut out: Vec<Option<Result<Registered, Status>>> = (0..batch.len()).map(|_| None).collect();
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
                tracing::debug!(
                    buffer = a.entry.id,
                    size = a.entry.size,
                    kind = kind_name(a.entry.kind),
                    "client host memory registered"
                );
                Registered {
                    entry: a.entry,
                    lists: a.lists,
                }
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

    /// A registration's answer as a Buffer message: its lists and their statuses in
    /// `block_lists`, `block_list_status`.
    pub(crate) fn buffer_answer(&self, r: Registered) -> pb::Buffer {
        let mut buffer = self.buffer_pb(&r.entry);
        for (k, list) in r.lists.into_iter().enumerate() {
            let (list, st) = match list {
                Ok(f) => (self.block_list_pb(&f), pb::EntryStatus::default()),
                Err(e) => (pb::BlockList::default(), list_status(k, &e)),
            };
            buffer.block_lists.push(list);
            buffer.block_list_status.push(st);
        }
        buffer
    }

    /// A `register_batch`'s answers as arrays (`packed_answer`): per entry, its outcome
    /// (refused before or by the batch).
    pub(crate) fn packed_answer(&self, answers: Vec<Result<Registered, Status>>) -> pb::PackedRegistrations {
        let mut p = pb::PackedRegistrations::default();
        let mut text = String::new();
        let mut ends: Vec<u8> = Vec::new();
        let end = |text: &String, ends: &mut Vec<u8>| {
            ends.extend_from_slice(&u32::try_from(text.len()).unwrap_or(u32::MAX).to_le_bytes())
        };
        let mut slot = 0u32;
        for (i, answer) in answers.into_iter().enumerate() {
            match answer {
                Ok(r) => {
                    // (at most 8 lists a registration: session/registrations.rs's check_lists)
                    p.entry_lists.push(u8::try_from(r.lists.len()).unwrap_or(u8::MAX));
                    p.buffer_ids.extend_from_slice(&r.entry.id.to_le_bytes());
                    let key = r.entry.key();
                    text.push_str(&self.buffers.descriptor(&r.entry).encode());
                    end(&text, &mut ends);
                    for (k, list) in r.lists.into_iter().enumerate() {
                        match list {
                            Ok(f) => {
                                p.list_ids.extend_from_slice(&f.id.to_le_bytes());
                                p.list_counts.extend_from_slice(&u64::from(f.count).to_le_bytes());
                                let token = crate::block_token::BlockToken {
                                    node_id: self.node_id.clone(),
                                    list_id: f.id,
                                    blocks: f.count,
                                    block_len: f.block_len,
                                    key,
                                    addresses: self.buffers.descriptor(&r.entry).addresses,
                                };
                                text.push_str(&token.encode());
                            }
                            Err(e) => {
                                p.list_ids.extend_from_slice(&0u64.to_le_bytes());
                                p.list_counts.extend_from_slice(&0u64.to_le_bytes());
                                p.refused_lists.push(slot);
                                p.lists_refused.push(list_status(k, &e));
                            }
                        }
                        end(&text, &mut ends);
                        slot += 1;
                    }
                }
                Err(status) => {
                    p.buffer_ids.extend_from_slice(&0u64.to_le_bytes());
                    p.refused_entries.push(i as u32);
                    p.refused.push(pb::EntryStatus {
                        code: status.code() as i32,
                        message: status.message().to_string(),
                    });
                    p.entry_lists.push(0);
                    end(&text, &mut ends);
                }
            }
        }
        p.text = text.into_bytes();
        p.text_ends = ends;
        p
    }

    /// Releases buffers together (a `release_batch`): per id, in order, released or why not.
    /// Those no transfer uses go to the poller in one command (`Command::RemoveBuffers`) and
    /// are logged in one line; one a transfer uses is refused at once (FAILED_PRECONDITION), as
    /// `release` with a deadline of now refuses it. The released buffers' last references come
    /// back with the answers (`Released`): their memory is unmapped where the caller drops them
    /// (the session: right after it sent the answer).
    pub(crate) async fn release_batch(&self, ids: &[u64]) -> (Vec<Result<(), Status>>, Released) {
        let mut gone = Vec::new();
        let now = Some(std::time::Instant::now());
        let mut out: Vec<Option<Result<(), Status>>> = (0..ids.len()).map(|_| None).collect();
        let mut todo: Vec<(usize, u64)> = Vec::with_capacity(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            if let Err(e) = self.buffers.get(id) {
                out[i] = Some(Err(status(e)));
            } else if let Err(e) = self.same_node.idle(id, now).await {
                out[i] = Some(Err(e));
            } else {
                todo.push((i, id));
            }
        }
        if !todo.is_empty() {
            let asked: Vec<u64> = todo.iter().map(|&(_, id)| id).collect();
            match self
                .ask(|reply| Command::RemoveBuffers { ids: asked, reply })
                .await
            {
                Ok(results) => {
                    let mut released = 0usize;
                    for ((i, id), r) in todo.into_iter().zip(results) {
                        out[i] = Some(r.map_err(status).map(|()| {
                            gone.extend(self.buffers.remove(id));
                            self.journal_forget(Space::Buffer, id);
                            tracing::debug!(buffer = id, "buffer released");
                            released += 1;
                        }));
                    }
                    if released > 0 {
                        tracing::info!(buffers = released, "buffers released");
                    }
                }
                Err(e) => {
                    for (i, _) in todo {
                        out[i] = Some(Err(e.clone()));
                    }
                }
            }
        }
        let out = out
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Err(Status::internal("a release of the batch went unanswered"))))
            .collect();
        (out, Released { _buffers: gone })
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
        // Memory by address is a reservation and two small copies a region, done here; a file's
        // mapping may fault in gigabytes, done off the runtime.
        let mapped = if jobs.iter().all(|(w, _)| matches!(w, Work::Pages { .. })) {
            Ok(self.map_pages(jobs))
        } else {
            let state = self.clone();
            tokio::task::spawn_blocking(move || {
                jobs.into_iter()
                    .map(|(work, ident)| state.map_one(work, ident))
                    .collect::<Vec<_>>()
            })
            .await
        };
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

    /// Step 2 for a batch of memory by address only: the buffers made, then the client's ranges
    /// probed together (`probe_many`: two system calls for the batch rather than four a
    /// region); a range that fails its probe leaves no buffer.
    fn map_pages(&self, jobs: Vec<(Work, Option<Ident>)>) -> Vec<Result<Arc<BufferEntry>, EngineError>> {
        let made: Vec<Result<Made, EngineError>> = jobs
            .into_iter()
            .map(|(work, ident)| match work {
                Work::Pages { pages, size, label } => self
                    .buffers
                    .client_pages(pages, size, &label, ident)
                    .map(|e| (e, pages, size)),
                Work::File { .. } => Err(EngineError::new(
                    crate::engine::Code::Internal,
                    "map_pages: a file among memory by address",
                )),
            })
            .collect();
        let ranges: Vec<(ClientPages, u64)> = made.iter().flatten().map(|&(_, p, n)| (p, n)).collect();
        let mut probed = crate::net::cross_memory::probe_many(&ranges).into_iter();
        made.into_iter()
            .map(|m| {
                let (entry, _, _) = m?;
                match probed.next() {
                    Some(Ok(())) => Ok(entry),
                    Some(Err(e)) => Err(crate::buffers::attach_error(e)),
                    None => Err(EngineError::new(
                        crate::engine::Code::Internal,
                        "a range went unprobed",
                    )),
                }
            })
            .collect()
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

    /// Step 4: the records of every buffer added, its lists named in it, written together before
    /// any is answered. A buffer whose record could not be written is released (refused), its
    /// lists with it.
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
                    // One record a region: its lists named in it, not a file each.
                    lists: a.lists.iter().flatten().map(|f| f.id).collect(),
                },
            ));
        }
        let mut written = journal.record_many(&records).into_iter();
        let mut out = Vec::with_capacity(added.len());
        for (i, a) in added {
            let Ok(a) = a else {
                out.push((i, a));
                continue;
            };
            // The buffer's record names its lists: written or not, they go with it.
            if let Err(e) = written.next().unwrap_or(Ok(())) {
                let _ = self.release(a.entry.id, None).await;
                out.push((i, Err(status(e))));
                continue;
            }
            out.push((i, Ok(a)));
        }
        out
    }
}

/// Buffers a `release_batch` released, held until dropped: the last references to their memory
/// (a memfd's shared mapping is unmapped then, a reservation unmapped), so that the session
/// answers first and unmaps after (docs/API.md, "Client host memory").
#[must_use = "dropping it unmaps the released buffers' memory: drop it after answering"]
pub struct Released {
    _buffers: Vec<Arc<BufferEntry>>,
}

/// The status of a list asked for with a registration and not made (`k`: its place).
fn list_status(k: usize, e: &EngineError) -> pb::EntryStatus {
    pb::EntryStatus {
        code: e.code as i32,
        message: format!("block_lists[{k}]: {}", e.message),
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
