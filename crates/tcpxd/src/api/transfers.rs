//! Transfers through the client API: checking entries, starting WRITE and READ batches on the
//! poller, the deadline of each, and waiting for the final event (the unary calls' `wait`).

use std::time::{Duration, Instant};

use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

use super::proto::v1 as pb;
use super::state::{DaemonState, status};
use crate::buffers::Descriptor;
use crate::engine::{self, EntrySpec, Outcome, RemoteRange, TransferId};
use crate::metrics::Op;
use crate::poller::{Batch, Command, PeerLink, Phase, TransferStatus};
use crate::status_watch;

impl DaemonState {
    /// A remote descriptor parsed, refused when it names this node.
    fn remote_descriptor(&self, field: &str, descriptor: &str) -> Result<Descriptor, Status> {
        let d = Descriptor::parse(field, descriptor).map_err(status)?;
        self.not_this_node(&d, || field.to_string())?;
        Ok(d)
    }

    /// Refuses a parsed remote descriptor naming this node (`field` formatted only then).
    pub(crate) fn not_this_node(&self, d: &Descriptor, field: impl FnOnce() -> String) -> Result<(), Status> {
        if d.node_id == self.node_id {
            return Err(Status::invalid_argument(format!(
                "{}: names a buffer of this node ({}) while other entries name other nodes: a batch goes within this node or to other nodes, not both",
                field(),
                self.node_id
            )));
        }
        Ok(())
    }

    /// The remote buffer a descriptor (the field `field`) names, and the pairing with its node.
    pub(crate) fn remote_buffer(
        &self,
        field: &str,
        descriptor: &str,
    ) -> Result<(engine::PeerIdx, Descriptor), Status> {
        let d = self.remote_descriptor(field, descriptor)?;
        let peer = self.peer_of(field, &d.node_id)?;
        Ok((peer, d))
    }

    /// The pairing with `node`, which `field` names: NOT_FOUND when there is none (a descriptor
    /// or token without addresses), UNAVAILABLE when it failed.
    pub(crate) fn peer_of(&self, field: &str, node: &str) -> Result<engine::PeerIdx, Status> {
        self.peer_named(|| field.to_string(), node)
    }

    /// As `peer_of`, the field's name made only for an error.
    fn peer_named(&self, field: impl Fn() -> String, node: &str) -> Result<engine::PeerIdx, Status> {
        // (looked at in place: a copy of the peer's record is three strings a request)
        let found = self.peers.with_node(node, |p| match &*p.link.borrow() {
            PeerLink::Failed(why) => Err(why.clone()),
            // Closed when idle (and not paired anew: no address to dial) or closing: the
            // engine refuses it for a retry (`after_idle_close`).
            _ => Ok(p.idx),
        });
        let idx = found.ok_or_else(|| {
            let field = field();
            let what = if field.ends_with("token") {
                "token"
            } else {
                "descriptor"
            };
            Status::not_found(format!(
                "{field}: node {node} is not a connected peer and its {what} carries no peer address (one from an older daemon): connect to the node first with its peer address, `tcpxctl peer connect HOST:PORT` or the ConnectPeer call"
            ))
        })?;
        idx.map_err(|why| Status::unavailable(format!("{}: peer {node} failed: {why}", field())))
    }

    /// The transfer's deadline: the call's gRPC deadline (a little before it: `answer_within`),
    /// else `timeout_ms`, else the default.
    pub(crate) fn deadline<T>(&self, req: &Request<T>, timeout_ms: u64) -> Instant {
        let budget = grpc_timeout(req)
            .map(answer_within)
            .or((timeout_ms > 0).then(|| Duration::from_millis(timeout_ms)))
            .unwrap_or(self.default_timeout);
        engine::deadline_after(Instant::now(), budget)
    }

    /// The deadline of a request inside a session: its own `timeout_ms` (else the default),
    /// never past the session's own deadline.
    pub(crate) fn request_deadline(&self, timeout_ms: u64, session: Option<Instant>) -> Instant {
        let budget = if timeout_ms > 0 {
            Duration::from_millis(timeout_ms)
        } else {
            self.default_timeout
        };
        let own = engine::deadline_after(Instant::now(), budget);
        session.map_or(own, |s| own.min(s))
    }

    /// Makes an accepted transfer known to Watch, WaitTransfer and Cancel.
    pub(crate) fn started(
        &self,
        id: TransferId,
        rx: status_watch::Receiver<TransferStatus>,
        total: u64,
    ) -> Started {
        self.transfers.insert(id.0, rx.clone());
        Started { id, rx, total }
    }

    /// Starts a WRITE batch: checks the entries, waits for the client's ready event if any, and
    /// hands it to the poller.
    pub(crate) async fn start_write(
        &self,
        r: pb::WriteBatchRequest,
        deadline: Instant,
    ) -> Result<Started, Status> {
        tracing::trace!(target: "tcpxd::hop", hop = "api.in");
        let mut first = first_descriptor(&r.entries, r.ranges.as_ref());
        if self.batch_is_same_node(first.as_ref()) {
            let fields = same_node_fields(&r.entries, r.ranges.as_ref())?;
            let copy = self.same_node_batch(Op::Write, fields.iter().copied(), r.notification, deadline)?;
            if !r.ready_event_ipc_handle.is_empty() {
                let locals: Vec<u64> = fields.iter().map(|e| e.local_buffer).collect();
                self.wait_ready_event(&r.ready_event_ipc_handle, locals.into_iter(), deadline)
                    .await?;
            }
            return self.start_same_node(copy);
        }
        let (mut retries, mut ready) = (0, r.ready_event_ipc_handle.is_empty());
        loop {
            let alone = notification_alone(r.entries.len(), &r.notification);
            let (batch, total) = self
                .batch_specs(&r.entries, r.ranges.as_ref(), alone, first.take(), deadline)
                .await?;
            if !ready {
                self.wait_ready_event(
                    &r.ready_event_ipc_handle,
                    batch.local_buffers().into_iter(),
                    deadline,
                )
                .await?;
                ready = true;
            }
            let asked = self
                .ask(|reply| Command::Write {
                    batch,
                    notification: r.notification.clone(),
                    deadline,
                    reply,
                })
                .await?;
            match asked {
                Ok((id, rx)) => return Ok(self.started(id, rx, total)),
                // Its pairing closed when idle meanwhile: again, on the next one.
                Err(e) => self.after_idle_close(e, &mut retries, deadline).await?,
            }
        }
    }

    /// Starts a READ batch.
    pub(crate) async fn start_read(
        &self,
        r: pb::ReadBatchRequest,
        deadline: Instant,
    ) -> Result<Started, Status> {
        tracing::trace!(target: "tcpxd::hop", hop = "api.in");
        let mut first = first_descriptor(&r.entries, r.ranges.as_ref());
        if self.batch_is_same_node(first.as_ref()) {
            let fields = same_node_fields(&r.entries, r.ranges.as_ref())?;
            let copy = self.same_node_batch(Op::Read, fields.iter().copied(), Vec::new(), deadline)?;
            return self.start_same_node(copy);
        }
        let mut retries = 0;
        loop {
            let (batch, total) = self
                .batch_specs(&r.entries, r.ranges.as_ref(), false, first.take(), deadline)
                .await?;
            let asked = self
                .ask(|reply| Command::Read {
                    batch,
                    deadline,
                    reply,
                })
                .await?;
            match asked {
                Ok((id, rx)) => return Ok(self.started(id, rx, total)),
                // Its pairing closed when idle meanwhile: again, on the next one.
                Err(e) => self.after_idle_close(e, &mut retries, deadline).await?,
            }
        }
    }

    /// The unary Write/WriteBatch: starts the transfer and, with `wait`, answers only when it
    /// finished (cancelling it if the caller goes away first).
    pub(crate) async fn write_call(
        &self,
        req: Request<pb::WriteBatchRequest>,
    ) -> Result<Response<pb::TransferStarted>, Status> {
        let deadline = self.deadline(&req, req.get_ref().timeout_ms);
        let r = req.into_inner();
        let wait = r.wait;
        let started = self.start_write(r, deadline).await?;
        self.answer(started, wait).await
    }

    /// The unary Read/ReadBatch, as `write_call`.
    pub(crate) async fn read_call(
        &self,
        req: Request<pb::ReadBatchRequest>,
    ) -> Result<Response<pb::TransferStarted>, Status> {
        let deadline = self.deadline(&req, req.get_ref().timeout_ms);
        let r = req.into_inner();
        let wait = r.wait;
        let started = self.start_read(r, deadline).await?;
        self.answer(started, wait).await
    }

    pub(crate) async fn answer(
        &self,
        s: Started,
        wait: bool,
    ) -> Result<Response<pb::TransferStarted>, Status> {
        let (transfer_id, total_bytes) = (s.id.0, s.total);
        let r#final = if wait {
            let mut guard = CancelOnDrop::new(self, s.id);
            let event = finished(s.id, s.rx).await;
            guard.disarm();
            Some(event?)
        } else {
            None
        };
        tracing::trace!(target: "tcpxd::hop", hop = "api.out", id = transfer_id);
        Ok(Response::new(pb::TransferStarted {
            transfer_id,
            total_bytes,
            r#final,
        }))
    }
}

/// A transfer the poller accepted.
pub(crate) struct Started {
    pub id: TransferId,
    pub rx: status_watch::Receiver<TransferStatus>,
    pub total: u64,
}

/// Waits for a transfer's final event.
pub(crate) async fn finished(
    id: TransferId,
    mut rx: status_watch::Receiver<TransferStatus>,
) -> Result<pb::TransferEvent, Status> {
    let s = rx
        .wait_for(|s| s.phase == Phase::Finished)
        .await
        .map_err(|_| Status::unavailable("the daemon stopped before the transfer finished"))?
        .clone();
    tracing::trace!(target: "tcpxd::hop", hop = "api.woken", id = id.0);
    Ok(event(id.0, &s))
}

/// Cancels a transfer (on both sides) when dropped armed: a waiting caller that went away.
pub(crate) struct CancelOnDrop {
    poller: crate::poller::PollerTx,
    same_node: std::sync::Arc<super::same_node_registry::SameNode>,
    id: Option<TransferId>,
}

impl CancelOnDrop {
    pub(crate) fn new(state: &DaemonState, id: TransferId) -> CancelOnDrop {
        CancelOnDrop {
            poller: state.poller.clone(),
            same_node: state.same_node.clone(),
            id: Some(id),
        }
    }

    pub(crate) fn disarm(&mut self) {
        self.id = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            tracing::debug!(transfer = id.0, "the waiting caller went away: cancelling");
            if self.same_node.cancel(id.0).is_none() {
                cancel_unheard(&self.poller, id);
            }
        }
    }
}

/// Asks the poller to cancel a transfer without waiting for its answer (same-node transfers:
/// `SameNode::cancel` first).
pub(crate) fn cancel_unheard(poller: &crate::poller::PollerTx, id: TransferId) {
    let (reply, _) = oneshot::channel();
    let _ = poller.send(Command::Cancel { id, reply });
}

/// The part of a call's gRPC timeout the daemon spends before answering: 10% less, at least
/// 40 ms (never more than half) and at most 50 ms less. tonic (the server, and a tonic client
/// too) ends a call whose timeout passed with CANCELLED "Timeout expired", racing the daemon's own
/// answer (DEADLINE_EXCEEDED, with what the transfer did); ending the wait a little earlier makes
/// the daemon's answer the one the caller gets, even on a loaded machine (10 ms, then 20 ms, were
/// too little on the 2-core CI machine for a 100 ms timeout while the emulation moved data).
pub(crate) fn answer_within(t: Duration) -> Duration {
    let margin = (t / 10).max(Duration::from_millis(40)).min(t / 2);
    t.saturating_sub(margin.min(Duration::from_millis(50)))
}

/// Parses the `grpc-timeout` header (`<digits><H|M|S|m|u|n>`).
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

pub(crate) fn event(id: u64, s: &TransferStatus) -> pb::TransferEvent {
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

/// A batch gives `entries` or `ranges`, not both.
fn only_ranges(no_entries: bool) -> Result<(), Status> {
    if no_entries {
        Ok(())
    } else {
        Err(Status::invalid_argument(
            "ranges: give entries or ranges, not both",
        ))
    }
}

/// Whether `length` bytes from `offset` do not fit in `size` bytes (or overflow): only then is
/// `engine::range_fault` asked for its words.
pub(crate) fn past_end(offset: u64, length: u64, size: u64) -> bool {
    offset.checked_add(length).is_none_or(|end| end > size)
}

fn local_buffer_field(i: usize) -> String {
    format!("entries[{i}].local_buffer_id")
}

impl DaemonState {
    /// Orders a write after the client's GPU work: waits (without holding a runtime thread) for
    /// the client's IPC event, on the GPU of the first CUDA source buffer.
    pub(crate) async fn wait_ready_event(
        &self,
        handle: &[u8],
        mut sources: impl Iterator<Item = u64>,
        deadline: Instant,
    ) -> Result<(), Status> {
        let handle: [u8; 64] = handle.try_into().map_err(|_| {
            Status::invalid_argument(format!(
                "ready_event_ipc_handle: {} bytes, expected 64",
                handle.len()
            ))
        })?;
        let gpu = sources
            .find_map(|id| self.buffers.get(id).ok().and_then(|b| b.gpu().cloned()))
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

/// The first descriptor a batch names, in either form (the packed buffer pair's, else the first
/// entry's), parsed: `None` when it does not parse (for the checks to refuse, naming the field).
/// Parsed once per request: it decides whether the batch stays within this node, and the remote
/// path's checks start from it.
fn first_descriptor<'a, E>(entries: &'a [E], ranges: Option<&'a pb::BatchRanges>) -> Option<Descriptor>
where
    &'a E: Into<EntryFields<'a>>,
{
    let first = match ranges {
        Some(g) => g.remote_descriptor.as_str(),
        None => entries.first()?.into().remote_descriptor,
    };
    Descriptor::read(first).ok()
}

/// A run of a batch's entries naming the same remote descriptor (as most batches do), parsed
/// once: `first`, the index of its first entry.
pub(crate) struct Run<'a> {
    first: usize,
    text: &'a str,
    descriptor: Descriptor,
}

fn remote_field(i: usize) -> String {
    format!("entries[{i}].remote_descriptor")
}

/// A same-node batch's entries, either form: packed ranges are read (shape checked, naming the
/// field) and listed as entries, since the daemon copies them itself.
fn same_node_fields<'a, E>(
    entries: &'a [E],
    ranges: Option<&'a pb::BatchRanges>,
) -> Result<Vec<EntryFields<'a>>, Status>
where
    &'a E: Into<EntryFields<'a>>,
{
    let Some(g) = ranges else {
        return Ok(entries.iter().map(Into::into).collect());
    };
    only_ranges(entries.is_empty())?;
    let rs = super::batch_ranges::Ranges::read(g, crate::engine::DEFAULT_MAX_ENTRIES)
        .map_err(Status::invalid_argument)?;
    Ok((0..rs.len())
        .map(|k| {
            let (local_offset, remote_offset, length) = rs.get(k);
            EntryFields {
                local_buffer: g.local_buffer_id,
                local_offset,
                remote_descriptor: &g.remote_descriptor,
                remote_offset,
                length,
            }
        })
        .collect())
}

/// The fields WriteEntry and ReadEntry share.
#[derive(Clone, Copy)]
pub(crate) struct EntryFields<'a> {
    pub local_buffer: u64,
    pub local_offset: u64,
    pub remote_descriptor: &'a str,
    pub remote_offset: u64,
    pub length: u64,
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
    /// A batch to other nodes, either form: checked on this side first (`check_without_peers`, so
    /// a mistake in the request is answered as itself, not as a failed pairing), its nodes dialled,
    /// then its engine entries built, or its packed batch (`BatchRanges`). Returns it with the
    /// total bytes. `alone`: a WRITE of one entry with a notification, whose entry may be of zero
    /// bytes (a notification alone, [`notification_alone`]). `first`: the batch's first
    /// descriptor already parsed ([`first_descriptor`]; `None` parses it again). Each descriptor
    /// is parsed once per call.
    async fn batch_specs<'a, E>(
        &self,
        entries: &'a [E],
        ranges: Option<&pb::BatchRanges>,
        alone: bool,
        first: Option<Descriptor>,
        deadline: Instant,
    ) -> Result<(Batch, u64), Status>
    where
        &'a E: Into<EntryFields<'a>>,
    {
        if let Some(ranges) = ranges {
            only_ranges(entries.is_empty())?;
            let first = first.or_else(|| Descriptor::read(&ranges.remote_descriptor).ok());
            self.reach_peers(first.iter().map(|d| (0, d)), deadline).await?;
            let (b, total) = self.packed_batch(ranges, first)?;
            return Ok((Batch::Packed(b), total));
        }
        let fields = || entries.iter().map(Into::into);
        let runs = self.check_without_peers(fields(), alone, first)?;
        self.reach_peers(runs.iter().map(|r| (r.first, &r.descriptor)), deadline)
            .await?;
        let (specs, total) = self.entry_specs(fields(), &runs)?;
        Ok((Batch::Entries(specs), total))
    }

    /// A framed session's fast start (`session/fast.rs`): a batch (its `entries`, or its packed
    /// `ranges`) to other nodes whose peers are all paired and up, checked as `batch_specs`
    /// checks it (the same refusals, naming the same fields, in the same order) and built into
    /// the engine's batch. `Ok(None)`: not such a batch (within this node, or a node to reach
    /// first): the caller starts it the usual way, which checks it again.
    pub(crate) fn fast_specs<'a, E>(
        &self,
        entries: &'a [E],
        ranges: Option<&'a pb::BatchRanges>,
        alone: bool,
    ) -> Result<Option<Batch>, Status>
    where
        &'a E: Into<EntryFields<'a>>,
    {
        let first = first_descriptor(entries, ranges);
        if self.batch_is_same_node(first.as_ref()) {
            return Ok(None);
        }
        if let Some(ranges) = ranges {
            only_ranges(entries.is_empty())?;
            if !self.all_up(first.iter()) {
                return Ok(None);
            }
            let (b, _) = self.packed_batch(ranges, first)?;
            return Ok(Some(Batch::Packed(b)));
        }
        let fields = || entries.iter().map(Into::into);
        let runs = self.check_without_peers(fields(), alone, first)?;
        if !self.all_up(runs.iter().map(|r| &r.descriptor)) {
            return Ok(None);
        }
        let (specs, _) = self.entry_specs(fields(), &runs)?;
        Ok(Some(Batch::Entries(specs)))
    }

    /// Builds the engine's entries of a batch `check_without_peers` passed (the peers are known
    /// now); the engine checks bounds and limits. Returns the total bytes.
    /// `runs`: the batch's descriptors as `check_without_peers` parsed and checked them (each
    /// entry's remote range is inside its buffer); each run's pairing is looked up once.
    fn entry_specs<'a>(
        &self,
        entries: impl ExactSizeIterator<Item = EntryFields<'a>>,
        runs: &[Run<'a>],
    ) -> Result<(Vec<EntrySpec>, u64), Status> {
        let mut specs = Vec::with_capacity(entries.len());
        let mut total = 0u64;
        let Some(run) = runs.first() else {
            return Ok((specs, total));
        };
        let (mut k, mut d) = (0, &run.descriptor);
        let mut peer = self.peer_named(|| remote_field(run.first), &d.node_id)?;
        for (i, e) in entries.enumerate() {
            if let Some(next) = runs.get(k + 1).filter(|r| r.first == i) {
                (k, d) = (k + 1, &next.descriptor);
                peer = self.peer_named(|| remote_field(i), &d.node_id)?;
            }
            total = total.saturating_add(e.length);
            specs.push(EntrySpec {
                local_buffer: e.local_buffer,
                local_offset: e.local_offset,
                peer,
                remote: RemoteRange {
                    buffer_id: d.buffer_id,
                    access_key: d.key,
                    offset: e.remote_offset,
                    length: e.length,
                },
            });
        }
        Ok((specs, total))
    }

    /// What needs no peer: the batch's size, each entry's length, its local buffer, its remote
    /// descriptor's form, and both ranges (the remote one against the size the descriptor
    /// carries), in the order a single pass always reported them. Checked before the remote nodes
    /// are dialled, so a mistake in the request (`--local 9`) is answered at once as itself, not
    /// after, or as, a failed pairing. Returns the descriptors parsed, one per run of entries
    /// naming the same one (`first`: entries[0]'s, already parsed, if it was); field names are
    /// formatted only for an error.
    fn check_without_peers<'a>(
        &self,
        entries: impl ExactSizeIterator<Item = EntryFields<'a>>,
        alone: bool,
        mut first: Option<Descriptor>,
    ) -> Result<Vec<Run<'a>>, Status> {
        if entries.len() == 0 {
            return Err(Status::invalid_argument(
                "entries: at least one entry is required",
            ));
        }
        // Counted before any descriptor is parsed: an oversized batch costs nothing to refuse.
        let limit = crate::engine::DEFAULT_MAX_ENTRIES;
        if entries.len() > limit {
            return Err(Status::invalid_argument(format!(
                "entries: {} entries exceed the limit of {limit}",
                entries.len()
            )));
        }
        let mut last_local: Option<(u64, u64)> = None;
        let mut runs: Vec<Run<'a>> = Vec::new();
        for (i, e) in entries.enumerate() {
            if e.length == 0 && !alone {
                return Err(zero_length(i));
            }
            let size = match last_local {
                Some((id, size)) if id == e.local_buffer => size,
                _ => {
                    let b = self
                        .buffers
                        .get_named(e.local_buffer, || local_buffer_field(i))
                        .map_err(status)?;
                    last_local = Some((b.id, b.size));
                    b.size
                }
            };
            if runs.last().is_none_or(|r| r.text != e.remote_descriptor) {
                let descriptor = match first.take().filter(|_| i == 0) {
                    Some(d) => d,
                    None => Descriptor::read(e.remote_descriptor)
                        .map_err(|fault| status(fault.named(&remote_field(i))))?,
                };
                self.not_this_node(&descriptor, || remote_field(i))?;
                runs.push(Run {
                    first: i,
                    text: e.remote_descriptor,
                    descriptor,
                });
            }
            let remote_size = runs.last().map_or(0, |r| r.descriptor.size);
            // The remote range worded as the engine's peer words it, and the local range as the
            // engine does (the engine checks the local one again when the transfer starts); the
            // words are made only for a range that does not fit.
            if past_end(e.remote_offset, e.length, remote_size)
                && let Some(why) = engine::range_fault(
                    &format!("entries[{i}].remote_offset"),
                    &format!("entries[{i}].length"),
                    "the remote buffer",
                    remote_size,
                    e.remote_offset,
                    e.length,
                )
            {
                return Err(Status::invalid_argument(why));
            }
            if past_end(e.local_offset, e.length, size)
                && let Some(why) = engine::range_fault(
                    &format!("entries[{i}].local_offset"),
                    &format!("entries[{i}].length"),
                    &format!("buffer {}", e.local_buffer),
                    size,
                    e.local_offset,
                    e.length,
                )
            {
                return Err(Status::invalid_argument(why));
            }
        }
        Ok(runs)
    }
}

/// Re-wraps a single-entry request as a batch, keeping its metadata (deadline).
pub(crate) fn try_as_batch<T, U>(
    req: Request<T>,
    f: impl FnOnce(T) -> Result<U, Status>,
) -> Result<Request<U>, Status> {
    let (meta, ext, inner) = req.into_parts();
    Ok(Request::from_parts(meta, ext, f(inner)?))
}

/// A WriteRequest as a one-entry batch.
pub(crate) fn write_batch(r: pb::WriteRequest) -> Result<pb::WriteBatchRequest, Status> {
    let entry = r
        .entry
        .ok_or_else(|| Status::invalid_argument("entry: required"))?;
    Ok(pb::WriteBatchRequest {
        entries: vec![entry],
        notification: r.notification,
        timeout_ms: r.timeout_ms,
        ready_event_ipc_handle: r.ready_event_ipc_handle,
        wait: r.wait,
        ranges: None,
    })
}

/// A ReadRequest as a one-entry batch.
pub(crate) fn read_batch(r: pb::ReadRequest) -> Result<pb::ReadBatchRequest, Status> {
    let entry = r
        .entry
        .ok_or_else(|| Status::invalid_argument("entry: required"))?;
    Ok(pb::ReadBatchRequest {
        entries: vec![entry],
        timeout_ms: r.timeout_ms,
        wait: r.wait,
        ranges: None,
    })
}

/// Whether a WRITE of `entries` entries carrying `notification` may have an entry of zero bytes:
/// a notification alone, exactly one entry with a notification (it travels as control messages
/// only, peer protocol 10; within this node, a copy of nothing).
pub(crate) fn notification_alone(entries: usize, notification: &[u8]) -> bool {
    entries == 1 && !notification.is_empty()
}

/// An entry of zero bytes where no notification alone is allowed.
pub(crate) fn zero_length(i: usize) -> Status {
    Status::invalid_argument(format!(
        "entries[{i}].length: must be at least 1 byte (0 only for a WRITE of one entry that carries a notification)"
    ))
}
