//! Transfers whose two buffers are both on this daemon (two clients, or two NIXL agents, of one
//! node): no peer and no lanes, the daemon copies. Host to host by a memory copy, GPU to GPU by
//! a device copy between the two imported allocations (`cuMemcpyDtoDAsync`, which crosses GPUs
//! by peer access where the driver has it), host to GPU and back through a bounce buffer. The
//! semantics are a remote transfer's: the same checks and messages, an id that Watch,
//! WaitTransfer and Cancel know, the deadline, the notification (to this daemon's subscribers,
//! as a peer's WRITE would deliver it), the transfer metrics.
//!
//! Copies of more than [`INLINE_BYTES`] run on tokio's blocking pool, never on a runtime thread,
//! in chunks of [`CHUNK_BYTES`] between which cancel and the deadline are checked.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Instant;

use tokio::sync::watch;
use tonic::Status;

use super::same_node_registry::{CANCELLED, RUNNING, SameNode};
use super::state::{DaemonState, status};
use super::transfers::{EntryFields, Started};
use crate::block_token::BlockToken;
use crate::buffers::{BufferEntry, BufferMemory, Descriptor};
use crate::engine::{self, Code, Outcome, SameNodePlan, TransferId};
use crate::metrics::Op;
use crate::poller::{Command, NotificationEvent, Phase, PreparedTransfer, TransferStatus};

/// Copies up to this size run on the calling task (a few microseconds of memcpy).
pub const INLINE_BYTES: u64 = 256 << 10;
/// Cancel and the deadline are checked between chunks of this size (about a millisecond of
/// memcpy).
pub const CHUNK_BYTES: u64 = 4 << 20;

/// A block transfer's two sides, as the API parsed them.
pub(crate) struct BlockPairs {
    pub local_list: u64,
    pub local_indices: engine::blocks::IndexArray,
    pub token: BlockToken,
    pub remote_indices: engine::blocks::IndexArray,
}

/// One range to copy, for entry `entry` of the request.
pub(crate) struct Piece {
    entry: usize,
    src: Arc<BufferEntry>,
    src_off: u64,
    dst: Arc<BufferEntry>,
    dst_off: u64,
    len: u64,
}

impl Piece {
    /// Whether source and destination share bytes (one buffer copied within itself).
    fn overlaps(&self) -> bool {
        self.src.id == self.dst.id
            && self.src_off < self.dst_off + self.len
            && self.dst_off < self.src_off + self.len
    }
}

/// A checked same-node transfer, ready to copy.
pub(crate) struct Copy {
    op: Op,
    pieces: Vec<Piece>,
    entries: usize,
    total: u64,
    notification: Vec<u8>,
    deadline: Instant,
}

impl DaemonState {
    /// Whether a batch goes within this node: its first entry's descriptor (parsed once, by the
    /// caller) names this node (one that does not parse is left for the normal path to refuse).
    pub(crate) fn batch_is_same_node(&self, first: Option<&Descriptor>) -> bool {
        first.is_some_and(|d| d.node_id == self.node_id)
    }

    /// Checks a same-node batch as the engine checks a remote one (and the peer the claimed
    /// ranges): every entry names this node, its buffers exist, the key is the buffer's current
    /// one, both ranges are inside their buffers.
    pub(crate) fn same_node_batch<'a>(
        &self,
        op: Op,
        entries: impl ExactSizeIterator<Item = EntryFields<'a>>,
        notification: Vec<u8>,
        deadline: Instant,
    ) -> Result<Copy, Status> {
        let n = entries.len();
        if n == 0 {
            return Err(Status::invalid_argument(
                "entries: at least one entry is required",
            ));
        }
        let limit = engine::DEFAULT_MAX_ENTRIES;
        if n > limit {
            return Err(Status::invalid_argument(format!(
                "entries: {n} entries exceed the limit of {limit}"
            )));
        }
        let alone = op == Op::Write && super::transfers::notification_alone(n, &notification);
        let mut pieces = Vec::with_capacity(n);
        let mut total = 0u64;
        let mut last: Option<(&str, Arc<BufferEntry>)> = None;
        for (i, e) in entries.enumerate() {
            if e.length == 0 && !alone {
                return Err(super::transfers::zero_length(i));
            }
            let local = self
                .buffers
                .get_named(e.local_buffer, || format!("entries[{i}].local_buffer_id"))
                .map_err(status)?;
            let field = || format!("entries[{i}].remote_descriptor");
            let theirs = match &last {
                Some((s, b)) if *s == e.remote_descriptor => b.clone(),
                _ => {
                    let d = Descriptor::parse(&field(), e.remote_descriptor).map_err(status)?;
                    if d.node_id != self.node_id {
                        return Err(Status::invalid_argument(format!(
                            "{}: names node {}, but entries[0] names this node ({}): a batch goes within this node or to other nodes, not both",
                            field(),
                            d.node_id,
                            self.node_id
                        )));
                    }
                    let b = self.buffers.get(d.buffer_id).map_err(|_| {
                        Status::not_found(format!(
                            "{}: buffer {} does not exist on this node",
                            field(),
                            d.buffer_id
                        ))
                    })?;
                    if !keys_equal(&b.key(), &d.key) {
                        return Err(Status::permission_denied(format!(
                            "{}: wrong access key for buffer {}",
                            field(),
                            d.buffer_id
                        )));
                    }
                    last = Some((e.remote_descriptor, b.clone()));
                    b
                }
            };
            for (off_field, what, size, offset) in [
                ("local_offset", "the local buffer", local.size, e.local_offset),
                ("remote_offset", "the remote buffer", theirs.size, e.remote_offset),
            ] {
                if super::transfers::past_end(offset, e.length, size)
                    && let Some(why) = engine::range_fault(
                        &format!("entries[{i}].{off_field}"),
                        &format!("entries[{i}].length"),
                        what,
                        size,
                        offset,
                        e.length,
                    )
                {
                    return Err(Status::invalid_argument(why));
                }
            }
            total = total.saturating_add(e.length);
            let p = piece(op, i, local, e.local_offset, theirs, e.remote_offset, e.length);
            if p.overlaps() {
                return Err(Status::invalid_argument(format!(
                    "entries[{i}].remote_offset: the range overlaps entries[{i}].local_offset's in the same buffer {}",
                    p.src.id
                )));
            }
            pieces.push(p);
        }
        Ok(Copy {
            op,
            pieces,
            entries: n,
            total,
            notification,
            deadline,
        })
    }

    /// The block list `token` names, when it is of this node (`None`: another node's, or a
    /// token that does not parse, for the normal path to refuse).
    pub(crate) fn same_node_token(&self, token: &str) -> Option<BlockToken> {
        BlockToken::parse("remote_token", token)
            .ok()
            .filter(|t| t.node_id == self.node_id)
    }

    /// A block WRITE or READ between two lists of this node: the engine checks the pairs and
    /// turns them into byte ranges, which are copied.
    pub(crate) async fn same_node_blocks(
        &self,
        op: Op,
        pairs: BlockPairs,
        notification: Vec<u8>,
        deadline: Instant,
    ) -> Result<Started, Status> {
        let BlockPairs {
            local_list,
            local_indices,
            token,
            remote_indices,
        } = pairs;
        let remote = engine::RemoteBlocks {
            list_id: token.list_id,
            access_key: token.key,
            blocks: token.blocks,
            block_len: token.block_len,
            indices: remote_indices,
        };
        let plan = self
            .ask(|reply| Command::PlanSameNodeBlocks {
                local_list,
                local_indices,
                remote,
                write: op == Op::Write,
                reply,
            })
            .await?
            .map_err(status)?;
        self.copy_plan(op, plan, notification, deadline)
    }

    /// A prepared WRITE or READ whose remote list names another client's lists of this node.
    pub(crate) async fn same_node_prepared(
        &self,
        op: Op,
        mut transfer: PreparedTransfer,
        deadline: Instant,
    ) -> Result<Started, Status> {
        let notification = std::mem::take(&mut transfer.notification);
        let plan = self
            .ask(|reply| Command::PlanSameNodePrepared {
                transfer,
                write: op == Op::Write,
                reply,
            })
            .await?
            .map_err(status)?;
        self.copy_plan(op, plan, notification, deadline)
    }

    /// Starts copying what the engine planned (one entry), its buffers looked up once each.
    fn copy_plan(
        &self,
        op: Op,
        plan: SameNodePlan,
        notification: Vec<u8>,
        deadline: Instant,
    ) -> Result<Started, Status> {
        let mut known: HashMap<u64, Arc<BufferEntry>> = HashMap::new();
        let mut buffer = |id: u64| -> Result<Arc<BufferEntry>, Status> {
            if let Some(b) = known.get(&id) {
                return Ok(b.clone());
            }
            let b = self.buffers.get(id).map_err(|_| {
                Status::not_found(format!("buffer {id} was released while the transfer started"))
            })?;
            known.insert(id, b.clone());
            Ok(b)
        };
        let mut pieces = Vec::with_capacity(plan.pieces.len());
        for p in &plan.pieces {
            if p.local_buffer == p.remote_buffer
                && p.local_offset < p.remote_offset + p.len
                && p.remote_offset < p.local_offset + p.len
            {
                return Err(Status::invalid_argument(format!(
                    "remote_indices: a pair's source and destination overlap in buffer {} (bytes {}..{} and {}..{})",
                    p.local_buffer,
                    p.local_offset,
                    p.local_offset + p.len,
                    p.remote_offset,
                    p.remote_offset + p.len
                )));
            }
            pieces.push(piece(
                op,
                0,
                buffer(p.local_buffer)?,
                p.local_offset,
                buffer(p.remote_buffer)?,
                p.remote_offset,
                p.len,
            ));
        }
        self.start_same_node(Copy {
            op,
            pieces,
            entries: 1,
            total: plan.total,
            notification,
            deadline,
        })
    }

    /// Starts the copy: inline when small, else on the blocking pool. The transfer is known to
    /// Watch, WaitTransfer and Cancel before this returns. UNAVAILABLE once the daemon drains.
    pub(crate) fn start_same_node(&self, copy: Copy) -> Result<Started, Status> {
        let mut buffers: Vec<u64> = copy.pieces.iter().flat_map(|p| [p.src.id, p.dst.id]).collect();
        buffers.sort_unstable();
        buffers.dedup();
        let (id, stop) = self.same_node.open(buffers)?;
        let started_at = Instant::now();
        let (tx, rx) = watch::channel(TransferStatus {
            phase: Phase::Running,
            bytes_done: 0,
            total: copy.total,
            outcome: None,
            started: started_at,
            finished_at: None,
        });
        let started = self.started(TransferId(id), rx, copy.total);
        let finish = Finish {
            id,
            node_id: self.node_id.clone(),
            same_node: self.same_node.clone(),
            metrics: self.metrics.clone(),
            notifications: self.notifications.clone(),
            started_at,
        };
        let job = move || {
            let outcome = run(&copy, &stop, &tx);
            finish.done(&copy, outcome, &tx);
        };
        if started.total <= INLINE_BYTES {
            job();
        } else {
            tokio::task::spawn_blocking(job);
        }
        Ok(started)
    }
}

/// A piece of entry `entry`: a WRITE copies local → remote, a READ remote → local.
fn piece(
    op: Op,
    entry: usize,
    local: Arc<BufferEntry>,
    lo: u64,
    theirs: Arc<BufferEntry>,
    ro: u64,
    len: u64,
) -> Piece {
    let ((src, src_off), (dst, dst_off)) = match op {
        Op::Write => ((local, lo), (theirs, ro)),
        Op::Read => ((theirs, ro), (local, lo)),
    };
    Piece {
        entry,
        src,
        src_off,
        dst,
        dst_off,
        len,
    }
}

fn keys_equal(a: &[u8; 16], b: &[u8; 16]) -> bool {
    // Constant time, as the engine compares keys.
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// What ends a same-node transfer: its status, its metrics, its notification.
struct Finish {
    id: u64,
    node_id: String,
    same_node: Arc<SameNode>,
    metrics: Arc<crate::metrics::Metrics>,
    notifications: tokio::sync::broadcast::Sender<NotificationEvent>,
    started_at: Instant,
}

impl Finish {
    fn done(self, copy: &Copy, outcome: Outcome, tx: &watch::Sender<TransferStatus>) {
        self.metrics.transfer_finished(
            copy.op,
            outcome.code,
            outcome.landed,
            copy.total,
            self.started_at.elapsed(),
        );
        // As a peer's: once every byte landed, naming the other side's buffers (a WRITE's
        // destination, a prepared READ's source).
        if outcome.code == Code::Ok && !copy.notification.is_empty() {
            let remote = |p: &Piece| match copy.op {
                Op::Write => p.dst.id,
                Op::Read => p.src.id,
            };
            let mut buffers: Vec<u64> = copy.pieces.iter().map(remote).collect();
            buffers.sort_unstable();
            buffers.dedup();
            let _ = self.notifications.send(NotificationEvent {
                from_node: self.node_id.clone(),
                transfer_id: self.id,
                payload: copy.notification.clone(),
                buffers,
            });
        }
        tracing::debug!(
            transfer = self.id,
            bytes = outcome.landed,
            code = ?outcome.code,
            "same-node transfer finished"
        );
        // Off the book first: whoever sees it finished sees it no longer active.
        self.same_node.close(self.id);
        tx.send_modify(|s| {
            s.bytes_done = outcome.landed;
            s.phase = Phase::Finished;
            s.outcome = Some(outcome);
            s.finished_at = Some(Instant::now());
        });
    }
}

/// Copies every piece in chunks, checking the stop flag (cancel, the drain's end) and the
/// deadline before each.
fn run(copy: &Copy, stop: &AtomicU8, tx: &watch::Sender<TransferStatus>) -> Outcome {
    let mut entries: Vec<Option<(Code, String)>> = vec![None; copy.entries];
    let mut done = 0u64;
    let mut bounce = Vec::new();
    let mut stream = None;
    for (k, p) in copy.pieces.iter().enumerate() {
        let mut at = 0u64;
        while at < p.len {
            let stop = match stop.load(Ordering::Relaxed) {
                RUNNING => None,
                CANCELLED => Some((Code::Cancelled, "cancelled by the client".to_string())),
                _ => Some((
                    Code::Unavailable,
                    "the daemon is shutting down (grace period over)".to_string(),
                )),
            };
            let stop = if stop.is_some() {
                stop
            } else if Instant::now() >= copy.deadline {
                Some((
                    Code::DeadlineExceeded,
                    "the transfer's deadline passed".to_string(),
                ))
            } else {
                None
            };
            let n = (p.len - at).min(CHUNK_BYTES);
            let failed = stop.or_else(|| copy_chunk(p, at, n, &mut bounce, &mut stream).err());
            if let Some((code, message)) = failed {
                return failed_outcome(entries, code, message, done);
            }
            at += n;
            done += n;
            if copy.total > INLINE_BYTES {
                tx.send_modify(|s| s.bytes_done = done);
            }
        }
        // An entry is done when its last piece is (batches: one piece an entry).
        if copy.pieces.get(k + 1).is_none_or(|q| q.entry != p.entry) {
            entries[p.entry] = Some((Code::Ok, String::new()));
        }
    }
    Outcome {
        code: Code::Ok,
        message: String::new(),
        entries: vec![(Code::Ok, String::new()); copy.entries],
        landed: copy.total,
    }
}

fn failed_outcome(entries: Vec<Option<(Code, String)>>, code: Code, message: String, landed: u64) -> Outcome {
    Outcome {
        entries: entries
            .into_iter()
            .map(|e| e.unwrap_or_else(|| (code, message.clone())))
            .collect(),
        code,
        message,
        landed,
    }
}

/// Copies `n` bytes at `at` of piece `p`.
fn copy_chunk(
    p: &Piece,
    at: u64,
    n: u64,
    bounce: &mut Vec<u8>,
    stream: &mut Option<crate::gpu::Stream>,
) -> Result<(), (Code, String)> {
    let (s, d) = (p.src_off + at, p.dst_off + at);
    let host = |e: crate::net::NetError| (Code::Internal, format!("host copy: {e}"));
    let gpu = |e: crate::gpu::GpuError| (Code::Internal, format!("GPU copy: {e}"));
    let attach = |e: crate::net::cross_memory::AttachError| {
        let e = crate::buffers::attach_error(e);
        (e.code, e.message)
    };
    // A client's pages (cross-memory attach) on either side: straight between them and host
    // memory, through the bounce buffer otherwise.
    match (p.src.attached, p.dst.attached, &p.src.memory, &p.dst.memory) {
        (Some(from), None, _, BufferMemory::Host(b)) => {
            return b
                .read_from_client(d as usize, from, s, n as usize)
                .map_err(attach);
        }
        (None, Some(to), BufferMemory::Host(a), _) => {
            return a.write_to_client(s as usize, to, d, n as usize).map_err(attach);
        }
        (Some(from), Some(to), _, _) => {
            bounce.resize(n as usize, 0);
            from.read(s, bounce).map_err(attach)?;
            return to.write(d, bounce).map_err(attach);
        }
        (Some(from), None, _, BufferMemory::Cuda { region, .. }) => {
            bounce.resize(n as usize, 0);
            from.read(s, bounce).map_err(attach)?;
            return region.write(d, bounce).map_err(gpu);
        }
        (None, Some(to), BufferMemory::Cuda { region, .. }, _) => {
            bounce.resize(n as usize, 0);
            region.read(s, bounce).map_err(gpu)?;
            return to.write(d, bounce).map_err(attach);
        }
        (None, None, ..) => {}
        // (memory of a client's process always comes with its pages)
        (Some(_), None, _, BufferMemory::Client) | (None, Some(_), BufferMemory::Client, _) => {
            return Err((Code::Internal, "a client's memory without its pages".to_string()));
        }
    }
    match (&p.src.memory, &p.dst.memory) {
        (BufferMemory::Host(a), BufferMemory::Host(b)) => {
            a.copy_to(s as usize, b, d as usize, n as usize).map_err(host)
        }
        (BufferMemory::Host(a), BufferMemory::Cuda { region, .. }) => {
            bounce.resize(n as usize, 0);
            a.read(s as usize, bounce).map_err(host)?;
            region.write(d, bounce).map_err(gpu)
        }
        (BufferMemory::Cuda { region, .. }, BufferMemory::Host(b)) => {
            bounce.resize(n as usize, 0);
            region.read(s, bounce).map_err(gpu)?;
            b.write(d as usize, bounce).map_err(host)
        }
        (BufferMemory::Cuda { region: from, .. }, BufferMemory::Cuda { region: to, .. }) => {
            if stream.is_none() {
                *stream = Some(crate::gpu::Stream::new(to.gpu()).map_err(gpu)?);
            }
            let st = stream.as_ref().expect("just made");
            st.copy_d2d(to, d, from, s, n).map_err(gpu)?;
            st.synchronize().map_err(gpu)
        }
        // (memory of a client's process always comes with its pages: taken above)
        (BufferMemory::Client, _) | (_, BufferMemory::Client) => {
            Err((Code::Internal, "a client's memory without its pages".to_string()))
        }
    }
}
