//! A session's registrations: `register_host_fd` and `register_client_memory` requests gathered
//! into batches as they come, `register_batch` frames, and `release_batch`; the buffers each
//! registers go with the session.

use tonic::Status;

use super::{Events, Gone, Requests, Session};
use crate::api::proto::v1 as pb;
use crate::api::proto::v1::session_event::Event;
use crate::api::proto::v1::session_request::Op;
use crate::api::register_batch::{MAX_BATCH, Registered, Registration};

/// Block lists one registration may ask for (`RegisterHostFdRequest.block_lists`).
pub const MAX_REGISTRATION_LISTS: usize = 8;

impl<E: Events> Session<'_, E> {
    /// A registration as read (its descriptor or peer process taken now, with its frame), or
    /// the refusal of its tag or lists.
    pub(super) fn registration<R: Requests>(&self, req: pb::SessionRequest, requests: &mut R) -> Gathered {
        let tag = req.tag;
        let (reg, lists) = match req.op {
            Some(Op::RegisterHostFd(mut r)) => {
                let lists = std::mem::take(&mut r.block_lists);
                (Registration::HostFd(r, requests.attached()), lists)
            }
            Some(Op::RegisterClientMemory(mut r)) => {
                let lists = std::mem::take(&mut r.block_lists);
                (Registration::ClientMemory(r, requests.peer_pid()), lists)
            }
            _ => return (tag, Err(Status::internal("not a registration"))),
        };
        let refused = if tag == 0 {
            Some(Status::invalid_argument("tag: must be nonzero"))
        } else if self.tag_open(tag) {
            Some(Status::invalid_argument(format!(
                "tag: {tag} already names an unfinished request of this session"
            )))
        } else {
            check_lists(&lists).err()
        };
        match refused {
            Some(status) => (tag, Err(status)),
            None => (tag, Ok((reg, lists))),
        }
    }

    /// Carries out registrations read together (src/api/register_batch.rs) and answers each, in
    /// the order they came, with the block lists it asked for registered on its new buffer (each
    /// refused one named in `block_list_status`); the buffers go with this session.
    pub(super) async fn register(&mut self, batch: Vec<Gathered>) -> Result<(), Gone> {
        let mut tags = Vec::with_capacity(batch.len());
        let mut todo = Vec::new();
        for (tag, r) in batch {
            match r {
                Ok(reg) => {
                    tags.push((tag, None));
                    todo.push(reg);
                }
                Err(status) => tags.push((tag, Some(status))),
            }
        }
        let mut done = self.state.register_batch(todo).await.into_iter();
        for (tag, refused) in tags {
            let answer = match refused {
                Some(status) => Err(status),
                None => done
                    .next()
                    .unwrap_or_else(|| Err(Status::internal("a registration of the batch went unanswered"))),
            };
            match answer {
                Ok(r) => {
                    self.owned.push(r.entry.id);
                    self.send(tag, Event::Registered(self.state.buffer_answer(r)))
                        .await?;
                }
                Err(status) => self.refuse(tag, status).await?,
            }
        }
        Ok(())
    }

    /// Carries out a `register_batch` frame: its entries as one batch, answered by one
    /// `registered_batch` event (an entry refused alone has an empty buffer and its status); the
    /// whole frame refused, with nothing registered, when it has too many entries or the
    /// descriptors that came with it are not one per `host_fd` entry.
    pub(super) async fn register_frame<R: Requests>(
        &mut self,
        req: pb::SessionRequest,
        requests: &mut R,
    ) -> Result<(), Gone> {
        let tag = req.tag;
        let Some(Op::RegisterBatch(batch)) = req.op else {
            return self.refuse(tag, Status::internal("not a register_batch")).await;
        };
        let host_fds = batch
            .entries
            .iter()
            .filter(|e| matches!(e.memory, Some(pb::register_batch_entry::Memory::HostFd(_))))
            .count();
        // The descriptors are taken first: refused, they are closed.
        let attached = requests.attached_n(host_fds);
        let refused = if tag == 0 {
            Some(Status::invalid_argument("tag: must be nonzero"))
        } else if self.tag_open(tag) {
            Some(Status::invalid_argument(format!(
                "tag: {tag} already names an unfinished request of this session"
            )))
        } else if batch.entries.len() > MAX_BATCH {
            Some(Status::invalid_argument(format!(
                "register_batch.entries: {} entries is over the limit of {MAX_BATCH} a batch",
                batch.entries.len()
            )))
        } else {
            None
        };
        let mut attached = match (refused, attached) {
            (Some(status), _) | (None, Err(status)) => return self.refuse(tag, status).await,
            (None, Ok(a)) => a.into_iter(),
        };
        let packed = batch.packed_answer;
        let mut answers: Vec<Option<Result<Registered, Status>>> = Vec::with_capacity(batch.entries.len());
        let mut todo = Vec::new();
        for (i, entry) in batch.entries.into_iter().enumerate() {
            use pb::register_batch_entry::Memory;
            let (reg, lists) = match entry.memory {
                Some(Memory::HostFd(mut r)) => {
                    let lists = std::mem::take(&mut r.block_lists);
                    let fd = attached
                        .next()
                        .ok_or_else(|| Status::internal("a host_fd entry without its descriptor"));
                    (Registration::HostFd(r, fd), lists)
                }
                Some(Memory::ClientMemory(mut r)) => {
                    let lists = std::mem::take(&mut r.block_lists);
                    (Registration::ClientMemory(r, requests.peer_pid()), lists)
                }
                None => {
                    let e = format!("register_batch.entries[{i}]: set one of host_fd, client_memory");
                    answers.push(Some(Err(Status::invalid_argument(e))));
                    continue;
                }
            };
            match check_lists(&lists) {
                Ok(()) => {
                    answers.push(None);
                    todo.push((reg, lists));
                }
                Err(e) => answers.push(Some(Err(Status::invalid_argument(format!(
                    "register_batch.entries[{i}].{}",
                    e.message()
                ))))),
            }
        }
        let mut done = self.state.register_batch(todo).await.into_iter();
        let answers: Vec<Result<Registered, Status>> = answers
            .into_iter()
            .map(|a| {
                a.unwrap_or_else(|| {
                    done.next().unwrap_or_else(|| {
                        Err(Status::internal("a registration of the batch went unanswered"))
                    })
                })
            })
            .collect();
        self.owned
            .extend(answers.iter().filter_map(|a| a.as_ref().ok().map(|r| r.entry.id)));
        if packed {
            // (reg-async) Arrays, no message an entry (api/register_batch.rs).
            let out = pb::RegisteredBatch {
                packed: Some(self.state.packed_answer(answers)),
                ..Default::default()
            };
            return self.send(tag, Event::RegisteredBatch(out)).await;
        }
        let mut out = pb::RegisteredBatch::default();
        for answer in answers {
            match answer {
                Ok(r) => {
                    out.buffers.push(self.state.buffer_answer(r));
                    out.statuses.push(pb::EntryStatus::default());
                }
                Err(status) => {
                    out.buffers.push(pb::Buffer::default());
                    out.statuses.push(pb::EntryStatus {
                        code: status.code() as i32,
                        message: status.message().to_string(),
                    });
                }
            }
        }
        self.send(tag, Event::RegisteredBatch(out)).await
    }

    /// Releases buffers this session registered (`release_batch`), none waiting for transfers:
    /// one still in use is answered FAILED_PRECONDITION and stays (ReleaseBuffer waits).
    pub(super) async fn release_batch(&mut self, req: pb::SessionRequest) -> Result<(), Gone> {
        let tag = req.tag;
        let Some(Op::ReleaseBatch(batch)) = req.op else {
            return self.refuse(tag, Status::internal("not a release_batch")).await;
        };
        if batch.buffer_ids.len() > MAX_BATCH {
            let status = Status::invalid_argument(format!(
                "release_batch.buffer_ids: {} ids is over the limit of {MAX_BATCH} a batch",
                batch.buffer_ids.len()
            ));
            return self.refuse(tag, status).await;
        }
        // The buffers of this session, released together (api/register_batch.rs).
        // (an id twice: the second is not this session's any more, as one by one)
        let mut mine = std::collections::HashSet::new();
        let asked: Vec<u64> = batch
            .buffer_ids
            .iter()
            .copied()
            .filter(|id| self.owned.contains(id) && mine.insert(*id))
            .collect();
        let (released, unmapped_after) = self.state.release_batch(&asked).await;
        let mut released = released.into_iter();
        let mut out = pb::ReleasedBatch::default();
        let mut gone = std::collections::HashSet::new();
        for (i, id) in batch.buffer_ids.into_iter().enumerate() {
            let r = if mine.remove(&id) {
                released
                    .next()
                    .unwrap_or_else(|| Err(Status::internal("a release of the batch went unanswered")))
            } else {
                Err(Status::not_found(format!(
                    "release_batch.buffer_ids[{i}]: buffer {id} was not registered on this session (or is released)"
                )))
            };
            let st = match r {
                Ok(()) => {
                    gone.insert(id);
                    pb::EntryStatus::default()
                }
                Err(e) => pb::EntryStatus {
                    code: e.code() as i32,
                    message: e.message().to_string(),
                },
            };
            out.statuses.push(st);
        }
        self.owned.retain(|b| !gone.contains(b));
        let sent = self.send(tag, Event::ReleasedBatch(out)).await;
        // The memory goes now, answered first: the client need not wait for the unmapping of
        // (for memfds) every page of the batch; the session reads its next request after.
        drop(unmapped_after);
        sent
    }
}

/// A registration read from the session: its tag, and the registration with its lists or why
/// it is refused.
type Gathered = (u64, Result<(Registration, Vec<pb::StridedBlocks>), Status>);

/// Whether a request registers memory (those are gathered into batches).
pub(super) fn registration(req: &pb::SessionRequest) -> Option<()> {
    matches!(
        req.op,
        Some(Op::RegisterHostFd(_)) | Some(Op::RegisterClientMemory(_))
    )
    .then_some(())
}

/// Refuses a registration asking for more block lists than one may (it changes nothing).
fn check_lists(lists: &[pb::StridedBlocks]) -> Result<(), Status> {
    if lists.len() > MAX_REGISTRATION_LISTS {
        return Err(Status::invalid_argument(format!(
            "block_lists: {} lists is over the limit of {MAX_REGISTRATION_LISTS} a registration",
            lists.len()
        )));
    }
    Ok(())
}
