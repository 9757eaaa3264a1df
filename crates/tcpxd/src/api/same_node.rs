//! Transfers whose two buffers are both on this daemon (two clients, or two NIXL agents, of one
//! node): no peer and no lanes, the daemon copies. Host to host by a memory copy, GPU to GPU by
//! a device copy between the two imported allocations (`cuMemcpyDtoDAsync`, which crosses GPUs
//! by peer access where the driver has it), host to GPU and back through a bounce buffer. The
//! semantics are a remote transfer's: the same checks and messages, an id that Watch,
//! WaitTransfer and Cancel know, the deadline, the notification (to this daemon's subscribers,
//! as a peer's WRITE would deliver it), the transfer metrics.
//!
//! Copies of more than [`INLINE_BYTES`] run on tokio's blocking pool, never on a runtime thread,
//! in chunks of [`CHUNK_BYTES`] between which cancel and the deadline are checked, spread over
//! up to `transfer.host_copy_threads` workers (the pool's thread and scoped ones, each with its
//! own bounce buffer): a client's pages on both sides take two copies per chunk (read into the
//! bounce buffer, write out), so one thread alone ran at a quarter of memory speed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tonic::Status;

use super::same_node_registry::{CANCELLED, RUNNING, SameNode};
use super::state::{DaemonState, status};
use super::transfers::{EntryFields, Started};
use crate::block_token::BlockToken;
use crate::buffers::{BufferEntry, BufferMemory, Descriptor};
use crate::engine::{self, Code, Outcome, SameNodePlan, TransferId};
use crate::metrics::Op;
use crate::poller::{Command, NotificationEvent, Phase, PreparedTransfer, TransferStatus};
use crate::status_watch;

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
        let (tx, rx) = status_watch::channel(TransferStatus {
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
        let threads = self.same_node.threads();
        let job = move || {
            let outcome = run(&copy, threads, &stop, &tx);
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
    fn done(self, copy: &Copy, outcome: Outcome, tx: &status_watch::Sender<TransferStatus>) {
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

/// One chunk of the work: `n` bytes at `at` of piece `piece`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Chunk {
    piece: usize,
    at: u64,
    n: u64,
}

/// The pieces cut into chunks of at most [`CHUNK_BYTES`], in order.
fn chunks(lens: impl Iterator<Item = u64>) -> Vec<Chunk> {
    let mut out = Vec::new();
    for (piece, len) in lens.enumerate() {
        let mut at = 0;
        while at < len {
            let n = (len - at).min(CHUNK_BYTES);
            out.push(Chunk { piece, at, n });
            at += n;
        }
    }
    out
}

/// The chunks cut into the runs a worker takes at once: consecutive chunks between the same two
/// buffers, together at most [`CHUNK_BYTES`] and [`GROUP_CHUNKS`] (a 4 MiB chunk alone; 256
/// pieces of 16 KiB one run): cancel and the deadline are checked, and progress told, once a run.
fn groups(chunks: &[Chunk], ends: impl Fn(usize) -> (u64, u64)) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut bytes = 0;
    for (i, c) in chunks.iter().enumerate() {
        if i > start
            && (bytes + c.n > CHUNK_BYTES
                || i - start == GROUP_CHUNKS
                || ends(c.piece) != ends(chunks[start].piece))
        {
            out.push(start..i);
            start = i;
            bytes = 0;
        }
        bytes += c.n;
    }
    if start < chunks.len() {
        out.push(start..chunks.len());
    }
    out
}

/// The most chunks in one run (the most iovecs one `process_vm_*` call takes).
const GROUP_CHUNKS: usize = 1024;

/// How many threads copy a transfer of `total` bytes in `chunks` chunks, given `threads`
/// (`transfer.host_copy_threads`) for `runs` runs of chunks: one when inline-sized, when there is
/// one run, or without helpers; else at most one a run.
fn workers(threads: usize, runs: usize, total: u64) -> usize {
    if total <= INLINE_BYTES {
        1
    } else {
        threads.min(runs).max(1)
    }
}

/// What the workers of one copy share: the next chunk to take, the bytes done, the chunks left
/// per entry, the first failure.
struct Shared<'a> {
    copy: &'a Copy,
    chunks: &'a [Chunk],
    groups: &'a [std::ops::Range<usize>],
    next: AtomicUsize,
    done: AtomicU64,
    left: Vec<AtomicUsize>,
    failed: Mutex<Option<(Code, String)>>,
    halt: AtomicBool,
    stop: &'a AtomicU8,
    tx: &'a status_watch::Sender<TransferStatus>,
}

impl Shared<'_> {
    /// Why the copy must stop now (cancel, the drain's end, the deadline), if it must.
    fn stopped(&self) -> Option<(Code, String)> {
        match self.stop.load(Ordering::Relaxed) {
            RUNNING => {}
            CANCELLED => return Some((Code::Cancelled, "cancelled by the client".to_string())),
            _ => {
                return Some((
                    Code::Unavailable,
                    "the daemon is shutting down (grace period over)".to_string(),
                ));
            }
        }
        (Instant::now() >= self.copy.deadline).then(|| {
            (
                Code::DeadlineExceeded,
                "the transfer's deadline passed".to_string(),
            )
        })
    }

    /// Records a failure (the first one wins) and stops every worker before its next chunk.
    fn fail(&self, why: (Code, String)) {
        let mut f = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        if f.is_none() {
            *f = Some(why);
        }
        self.halt.store(true, Ordering::Release);
    }

    /// One worker: takes chunks in order until none is left or the copy stops, with its own
    /// bounce buffer and GPU stream.
    fn work(&self) {
        let mut bounce = Vec::new();
        let mut stream = None;
        loop {
            if self.halt.load(Ordering::Acquire) {
                return;
            }
            // (a stop after the last chunk was taken stops nothing: as with one thread)
            let Some(g) = self.groups.get(self.next.fetch_add(1, Ordering::Relaxed)) else {
                return;
            };
            if let Some(why) = self.stopped() {
                return self.fail(why);
            }
            let run = &self.chunks[g.clone()];
            if let Err(why) = copy_run(&self.copy.pieces, run, &mut bounce, &mut stream) {
                return self.fail(why);
            }
            let mut n = 0;
            for c in run {
                self.left[self.copy.pieces[c.piece].entry].fetch_sub(1, Ordering::AcqRel);
                n += c.n;
            }
            let done = self.done.fetch_add(n, Ordering::AcqRel) + n;
            if self.copy.total > INLINE_BYTES {
                // Workers finish out of order: the figure only grows.
                self.tx.send_modify(|s| s.bytes_done = s.bytes_done.max(done));
            }
        }
    }
}

/// Copies every piece in chunks of [`CHUNK_BYTES`] on `threads` workers at most (this thread
/// and scoped ones), each checking the stop flag (cancel, the drain's end) and the deadline
/// before each chunk. The first failure stops them all; an entry whose every chunk landed is
/// OK, the others carry the failure.
fn run(copy: &Copy, threads: usize, stop: &AtomicU8, tx: &status_watch::Sender<TransferStatus>) -> Outcome {
    let chunks = chunks(copy.pieces.iter().map(|p| p.len));
    let mut left: Vec<AtomicUsize> = (0..copy.entries).map(|_| AtomicUsize::new(0)).collect();
    for c in &chunks {
        *left[copy.pieces[c.piece].entry].get_mut() += 1;
    }
    let ends = |k: usize| (copy.pieces[k].src.id, copy.pieces[k].dst.id);
    let groups = groups(&chunks, ends);
    let shared = Shared {
        copy,
        chunks: &chunks,
        groups: &groups,
        next: AtomicUsize::new(0),
        done: AtomicU64::new(0),
        left,
        failed: Mutex::new(None),
        halt: AtomicBool::new(false),
        stop,
        tx,
    };
    let n = workers(threads, groups.len(), copy.total);
    if n == 1 {
        shared.work();
    } else {
        std::thread::scope(|s| {
            for _ in 1..n {
                s.spawn(|| shared.work());
            }
            shared.work();
        });
    }
    let landed = shared.done.load(Ordering::Acquire);
    match shared.failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
        None => Outcome {
            code: Code::Ok,
            message: String::new(),
            entries: vec![(Code::Ok, String::new()); copy.entries],
            landed: copy.total,
        },
        Some((code, message)) => Outcome {
            entries: shared
                .left
                .iter()
                .map(|l| match l.load(Ordering::Acquire) {
                    0 => (Code::Ok, String::new()),
                    _ => (code, message.clone()),
                })
                .collect(),
            code,
            message,
            landed,
        },
    }
}

/// Copies a run of chunks (between the same two buffers): client pages on both sides in a few
/// calls through the bounce buffer, anything else chunk by chunk.
fn copy_run(
    pieces: &[Piece],
    run: &[Chunk],
    bounce: &mut Vec<u8>,
    stream: &mut Option<crate::gpu::Stream>,
) -> Result<(), (Code, String)> {
    let first = &pieces[run[0].piece];
    if let (true, Some(from), Some(to)) = (run.len() > 1, first.src.attached, first.dst.attached) {
        let list: Vec<(u64, u64, usize)> = run
            .iter()
            .map(|c| {
                let p = &pieces[c.piece];
                (p.src_off + c.at, p.dst_off + c.at, c.n as usize)
            })
            .collect();
        return crate::net::cross_memory::copy_between_clients(from, to, &list, bounce).map_err(|e| {
            let e = crate::buffers::attach_error(e);
            (e.code, e.message)
        });
    }
    for c in run {
        copy_chunk(&pieces[c.piece], c.at, c.n, bounce, stream)?;
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_cut_into_chunks_in_order() {
        let c = chunks([CHUNK_BYTES * 2 + 5, 0, 16 << 10].into_iter());
        let want = [
            (0, 0, CHUNK_BYTES),
            (0, CHUNK_BYTES, CHUNK_BYTES),
            (0, 2 * CHUNK_BYTES, 5),
            (2, 0, 16 << 10),
        ];
        let got: Vec<_> = c.iter().map(|c| (c.piece, c.at, c.n)).collect();
        assert_eq!(got, want);
        let many = chunks(std::iter::repeat_n(16 << 10, 4096));
        assert_eq!(many.len(), 4096);
        assert!(many.iter().enumerate().all(|(i, c)| c.piece == i && c.at == 0));
    }

    #[test]
    fn small_chunks_run_together_up_to_a_chunk_and_between_the_same_buffers() {
        // 4096 pieces of 16 KiB between one pair of buffers: runs of 256 (4 MiB each).
        let c = chunks(std::iter::repeat_n(16 << 10, 4096));
        let g = groups(&c, |_| (1, 2));
        assert_eq!(g.len(), 16);
        assert!(g.iter().enumerate().all(|(i, r)| *r == (i * 256..(i + 1) * 256)));
        // Big chunks alone; a change of buffers starts a run.
        let c = chunks([2 * CHUNK_BYTES, 4096, 4096, 4096, 100].into_iter());
        let g = groups(&c, |k| if k < 3 { (1, 2) } else { (3, 2) });
        assert_eq!(g, vec![0..1, 1..2, 2..4, 4..6]);
        // At most 1024 chunks a run, however small.
        let c = chunks(std::iter::repeat_n(8, 2050));
        let g = groups(&c, |_| (1, 2));
        assert_eq!(g, vec![0..1024, 1024..2048, 2048..2050]);
        assert!(groups(&[], |_| (1, 2)).is_empty());
    }

    #[test]
    fn workers_bounded_by_threads_and_chunks_and_one_when_inline() {
        assert_eq!(workers(8, 16, 64 << 20), 8);
        assert_eq!(workers(8, 3, 12 << 20), 3);
        assert_eq!(workers(0, 16, 64 << 20), 1);
        assert_eq!(workers(1, 16, 64 << 20), 1);
        // Inline-sized copies run on the calling task, alone.
        assert_eq!(workers(8, 16, INLINE_BYTES), 1);
        assert_eq!(workers(8, 4096, 4096 * (16 << 10)), 8);
    }
}
