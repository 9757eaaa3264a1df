//! The transfer state machine, free of I/O: no threads, sockets, plugin or CUDA calls.
//!
//! The poller feeds it events (client requests, control messages from peers, plugin
//! completions, time) and executes the [`Action`]s it emits (post a send or receive, send a
//! control message, report progress or a final status, deliver a notification). It decides
//! everything the plugin's rules depend on:
//!
//! - **Order.** Tags are ignored by TCPX: the k-th send on a comm meets the k-th receive. A
//!   receiver appends an offer's receives to its lane queues when it accepts the offer; the sender
//!   appends the sends when the accept arrives. Offers and accepts travel on one ordered stream,
//!   so both sides build every lane's queue in the same order.
//! - **Windows.** At most `send_window` sends (default 12) and `recv_window` receives (16, held
//!   until consumed) are posted per lane.
//! - **Completion.** A WRITE finishes when the receiver reports `Done`, i.e. after its unpack of
//!   every chunk finished; a READ when every chunk was consumed locally.
//! - **Cancellation and deadlines.** Chunks already agreed on must still meet their partners, so a
//!   cancelled offer sends its remaining chunks with zero length and the receiver discards them;
//!   every slot drains back to zero.
//! - **Failure.** A failed peer fails every transfer that touches it, with the peer named, and its
//!   queues are dropped.

pub mod error;
pub mod plan;
pub mod wire;

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

pub use error::{Code, EngineError, EngineResult};
pub use plan::{Chunk, ChunkPlan, DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES};
pub use wire::{Offer, PeerMsg, ReadPair, RemoteRange};

/// Limits and sizes.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Chunk size for the offers this node makes.
    pub chunk_bytes: u32,
    /// Sends posted per lane at most.
    pub send_window: usize,
    /// Receives posted (until consumed) per lane at most; the plugin allows 16.
    pub recv_window: usize,
    /// Entries per transfer (and ranges per offer).
    pub max_entries: usize,
    /// Notification bytes per transfer.
    pub max_notification: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            send_window: 12,
            recv_window: 16,
            max_entries: 4096,
            max_notification: 1 << 20,
        }
    }
}

/// Index of a peer in the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerIdx(pub u32);

/// A client-visible transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransferId(pub u64);

impl std::fmt::Display for TransferId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Which way a transfer moves data, seen from this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferKind {
    Write,
    Read,
}

/// One entry of a transfer: `remote.length` bytes between a local buffer and a peer's buffer
/// (from local to remote for a WRITE, from remote to local for a READ).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntrySpec {
    pub local_buffer: u64,
    pub local_offset: u64,
    pub peer: PeerIdx,
    pub remote: RemoteRange,
}

/// An entry of a WRITE.
pub type WriteSpec = EntrySpec;
/// An entry of a READ.
pub type ReadSpec = EntrySpec;

/// How a transfer (or one entry of it) ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub code: Code,
    pub message: String,
    /// One per entry, in request order.
    pub entries: Vec<(Code, String)>,
}

/// What the driver must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Send a control message to a peer.
    Control { peer: PeerIdx, msg: PeerMsg },
    /// Post one send on a lane (the window has room).
    PostSend {
        peer: PeerIdx,
        lane: u32,
        buffer: u64,
        offset: u64,
        len: u32,
    },
    /// Post one receive on a lane (the window has room).
    PostRecv {
        peer: PeerIdx,
        lane: u32,
        buffer: u64,
        offset: u64,
        len: u32,
    },
    /// A transfer's end-to-end bytes advanced.
    Progress {
        transfer: TransferId,
        bytes_done: u64,
        total: u64,
        running: bool,
    },
    /// A transfer ended.
    Finished { transfer: TransferId, outcome: Outcome },
    /// Data from a peer landed; deliver its notification to local subscribers.
    Notify {
        peer: PeerIdx,
        offer_id: u64,
        payload: Vec<u8>,
        buffers: Vec<u64>,
    },
    /// The peer failed: close its comms (the engine already dropped its queues).
    ClosePeer { peer: PeerIdx, reason: String },
}

/// Per-lane counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LaneCounters {
    pub bytes: u64,
    pub chunks: u64,
    pub posted: usize,
    pub queued: usize,
    /// Times the lane's window filled while chunks still waited for a slot.
    pub window_full: u64,
}

/// Per-peer counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerCounters {
    pub node_id: String,
    pub failed: Option<String>,
    pub transfers_started: u64,
    pub transfers_ok: u64,
    pub transfers_failed: u64,
    pub send: Vec<LaneCounters>,
    pub recv: Vec<LaneCounters>,
}

/// A registered buffer as the engine knows it: its size, key and users.
#[derive(Debug, Clone)]
struct BufferMeta {
    size: u64,
    key: [u8; 16],
    users: u32,
}

/// A queued or posted chunk: which offer it serves and where its bytes are.
#[derive(Debug, Clone, Copy)]
struct Item {
    offer: u64,
    buffer: u64,
    offset: u64,
    len: u32,
}

#[derive(Debug, Default)]
struct Lane {
    ready: bool,
    queue: VecDeque<Item>,
    posted: VecDeque<Item>,
    bytes: u64,
    chunks: u64,
    window_full: u64,
    /// The window is full and chunks wait (counted once per episode in `window_full`).
    stalled: bool,
}

impl Lane {
    fn counters(&self) -> LaneCounters {
        LaneCounters {
            bytes: self.bytes,
            chunks: self.chunks,
            posted: self.posted.len(),
            queued: self.queue.len(),
            window_full: self.window_full,
        }
    }
}

#[derive(Debug)]
struct Peer {
    node_id: String,
    failed: Option<String>,
    send: Vec<Lane>,
    recv: Vec<Lane>,
    next_lane: u32,
    transfers_started: u64,
    transfers_ok: u64,
    transfers_failed: u64,
}

/// An offer this node made (it sends the data).
#[derive(Debug)]
struct OutOffer {
    peer: PeerIdx,
    /// The local WRITE it belongs to; `None` when serving a peer's READ.
    transfer: Option<TransferId>,
    /// The peer's read id when serving its READ, else 0.
    read_id: u64,
    /// Entry index in the transfer of each range.
    entries: Vec<usize>,
    sources: Vec<(u64, u64)>,
    lengths: Vec<u64>,
    chunk_bytes: u32,
    first_lane: u32,
    accepted: bool,
    /// Remaining chunks go out with zero length.
    cancelled: bool,
    /// Chunks queued or posted and not yet reported sent.
    unfinished: u64,
    done: bool,
}

/// An offer this node accepted (it receives the data).
#[derive(Debug)]
struct InOffer {
    /// Our READ this offer serves.
    read: Option<u64>,
    dests: Vec<(u64, u64)>,
    chunks_total: u64,
    chunks_done: u64,
    bytes_done: u64,
    /// Discard the data (cancelled by the sender, or failed here).
    discard: bool,
    failed: bool,
    notification: Vec<u8>,
}

/// A READ part: one peer's share of a local READ.
#[derive(Debug)]
struct ReadPart {
    peer: PeerIdx,
    transfer: TransferId,
    entries: Vec<usize>,
    pairs: Vec<ReadPair>,
    /// The peer's offer serving this read, once it arrived and was accepted.
    offer: Option<u64>,
    cancelled: bool,
}

#[derive(Debug)]
struct Transfer {
    kind: TransferKind,
    total: u64,
    done_bytes: u64,
    entries: Vec<Option<(Code, String)>>,
    /// Out-offer ids (WRITE) or read ids (READ) not yet complete.
    pending_parts: usize,
    parts: Vec<u64>,
    deadline: Instant,
    running: bool,
    peers: Vec<PeerIdx>,
}

/// The state machine.
#[derive(Debug)]
pub struct Engine {
    cfg: EngineConfig,
    buffers: HashMap<u64, BufferMeta>,
    peers: Vec<Peer>,
    out_offers: HashMap<u64, OutOffer>,
    in_offers: HashMap<(PeerIdx, u64), InOffer>,
    reads: HashMap<u64, ReadPart>,
    transfers: HashMap<TransferId, Transfer>,
    deadlines: BTreeSet<(Instant, TransferId)>,
    next_transfer: u64,
    next_offer: u64,
    next_read: u64,
    actions: VecDeque<Action>,
}

fn keys_equal(a: &[u8; 16], b: &[u8; 16]) -> bool {
    // Constant time: no early exit on the first differing byte.
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

fn range_end(offset: u64, len: u64) -> Option<u64> {
    offset.checked_add(len)
}

impl Engine {
    pub fn new(cfg: EngineConfig) -> Engine {
        Engine {
            cfg,
            buffers: HashMap::new(),
            peers: Vec::new(),
            out_offers: HashMap::new(),
            in_offers: HashMap::new(),
            reads: HashMap::new(),
            transfers: HashMap::new(),
            deadlines: BTreeSet::new(),
            next_transfer: 1,
            next_offer: 1,
            next_read: 1,
            actions: VecDeque::new(),
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The next thing the driver must do.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    // ---- buffers ------------------------------------------------------------------------------

    /// Makes a buffer known (the driver owns its memory).
    pub fn add_buffer(&mut self, id: u64, size: u64, key: [u8; 16]) -> EngineResult<()> {
        if self.buffers.contains_key(&id) {
            return Err(EngineError::new(
                Code::AlreadyExists,
                format!("buffer {id} is already registered"),
            ));
        }
        self.buffers.insert(id, BufferMeta { size, key, users: 0 });
        Ok(())
    }

    /// Replaces a buffer's access key. Offers and reads already accepted keep going; every
    /// later one must carry the new key.
    pub fn rekey_buffer(&mut self, id: u64, key: [u8; 16]) -> EngineResult<()> {
        let b = self
            .buffers
            .get_mut(&id)
            .ok_or_else(|| EngineError::not_found(format!("buffer_id: buffer {id} does not exist")))?;
        b.key = key;
        Ok(())
    }

    /// Forgets a buffer; refused while transfers use it.
    pub fn remove_buffer(&mut self, id: u64) -> EngineResult<()> {
        let b = self
            .buffers
            .get(&id)
            .ok_or_else(|| EngineError::not_found(format!("buffer_id: buffer {id} does not exist")))?;
        if b.users > 0 {
            return Err(EngineError::new(
                Code::FailedPrecondition,
                format!(
                    "buffer {id} is in use by {} chunk ranges of active transfers",
                    b.users
                ),
            ));
        }
        self.buffers.remove(&id);
        Ok(())
    }

    /// Ranges of active transfers using a buffer.
    pub fn buffer_users(&self, id: u64) -> Option<u32> {
        self.buffers.get(&id).map(|b| b.users)
    }

    fn use_buffer(&mut self, id: u64) {
        if let Some(b) = self.buffers.get_mut(&id) {
            b.users += 1;
        }
    }

    fn unuse_buffer(&mut self, id: u64) {
        if let Some(b) = self.buffers.get_mut(&id) {
            b.users = b.users.saturating_sub(1);
        }
    }

    fn check_local(&self, field: &str, buffer: u64, offset: u64, len: u64) -> EngineResult<()> {
        let b = self
            .buffers
            .get(&buffer)
            .ok_or_else(|| EngineError::not_found(format!("{field}: buffer {buffer} does not exist")))?;
        check_bounds(field, buffer, b.size, offset, len)
    }

    // ---- peers --------------------------------------------------------------------------------

    /// Adds a peer with `send_lanes` lanes towards it and `recv_lanes` from it (not ready yet).
    pub fn add_peer(&mut self, node_id: &str, send_lanes: u32, recv_lanes: u32) -> PeerIdx {
        let idx = PeerIdx(self.peers.len() as u32);
        self.peers.push(Peer {
            node_id: node_id.to_string(),
            failed: None,
            send: (0..send_lanes).map(|_| Lane::default()).collect(),
            recv: (0..recv_lanes).map(|_| Lane::default()).collect(),
            next_lane: 0,
            transfers_started: 0,
            transfers_ok: 0,
            transfers_failed: 0,
        });
        idx
    }

    pub fn peer_node(&self, peer: PeerIdx) -> Option<&str> {
        self.peers.get(peer.0 as usize).map(|p| p.node_id.as_str())
    }

    /// A lane's comm is ready: sends (`send == true`) or receives can be posted.
    pub fn lane_ready(&mut self, peer: PeerIdx, lane: u32, send: bool) {
        if let Some(p) = self.peers.get_mut(peer.0 as usize) {
            let lanes = if send { &mut p.send } else { &mut p.recv };
            if let Some(l) = lanes.get_mut(lane as usize) {
                l.ready = true;
            }
        }
        self.pump(peer);
    }

    pub fn peer_counters(&self, peer: PeerIdx) -> Option<PeerCounters> {
        let p = self.peers.get(peer.0 as usize)?;
        Some(PeerCounters {
            node_id: p.node_id.clone(),
            failed: p.failed.clone(),
            transfers_started: p.transfers_started,
            transfers_ok: p.transfers_ok,
            transfers_failed: p.transfers_failed,
            send: p.send.iter().map(Lane::counters).collect(),
            recv: p.recv.iter().map(Lane::counters).collect(),
        })
    }

    /// Transfers not yet finished.
    pub fn active_transfers(&self) -> usize {
        self.transfers.len()
    }

    /// Ids of the transfers not yet finished, oldest first.
    pub fn active_transfer_ids(&self) -> Vec<TransferId> {
        let mut ids: Vec<TransferId> = self.transfers.keys().copied().collect();
        ids.sort();
        ids
    }

    /// Requests posted to the plugin across all lanes (sends, receives).
    pub fn posted(&self) -> (usize, usize) {
        self.peers.iter().fold((0, 0), |(s, r), p| {
            (
                s + p.send.iter().map(|l| l.posted.len()).sum::<usize>(),
                r + p.recv.iter().map(|l| l.posted.len()).sum::<usize>(),
            )
        })
    }

    /// True when nothing is queued, posted or waiting on a peer.
    pub fn is_idle(&self) -> bool {
        self.transfers.is_empty()
            && self.out_offers.is_empty()
            && self.in_offers.is_empty()
            && self.reads.is_empty()
            && self.peers.iter().all(|p| {
                p.send
                    .iter()
                    .chain(&p.recv)
                    .all(|l| l.queue.is_empty() && l.posted.is_empty())
            })
    }

    /// True when no posted request carries a transfer's bytes: the poller then has nothing to
    /// test and parks on its command channel (commands and control messages wake it).
    pub fn lanes_idle(&self) -> bool {
        self.peers
            .iter()
            .all(|p| p.send.iter().chain(&p.recv).all(|l| l.posted.is_empty()))
    }

    fn live_peer(&self, field: &str, peer: PeerIdx) -> EngineResult<&Peer> {
        let p = self
            .peers
            .get(peer.0 as usize)
            .ok_or_else(|| EngineError::not_found(format!("{field}: unknown peer")))?;
        if let Some(why) = &p.failed {
            return Err(EngineError::new(
                Code::Unavailable,
                format!("{field}: peer {} failed: {why}", p.node_id),
            ));
        }
        if p.send.is_empty() || p.recv.is_empty() {
            return Err(EngineError::new(
                Code::Unavailable,
                format!("{field}: peer {} has no data lanes", p.node_id),
            ));
        }
        Ok(p)
    }

    // ---- starting transfers -------------------------------------------------------------------

    fn check_common(&self, entries: usize, notification: usize) -> EngineResult<()> {
        if entries == 0 {
            return Err(EngineError::invalid("entries: at least one entry is required"));
        }
        if entries > self.cfg.max_entries {
            return Err(EngineError::invalid(format!(
                "entries: {entries} entries exceed the limit of {}",
                self.cfg.max_entries
            )));
        }
        if notification > self.cfg.max_notification {
            return Err(EngineError::invalid(format!(
                "notification: {notification} bytes exceed the limit of {} bytes",
                self.cfg.max_notification
            )));
        }
        Ok(())
    }

    /// Validates a transfer's entries against local buffers, limits and peers; returns the total
    /// bytes. Field names in errors are the API's (`entries[i].…`).
    fn check_entries(&self, specs: &[EntrySpec], notification: usize) -> EngineResult<u64> {
        self.check_common(specs.len(), notification)?;
        let mut total = 0u64;
        for (i, s) in specs.iter().enumerate() {
            if s.remote.length == 0 {
                return Err(EngineError::invalid(format!(
                    "entries[{i}].length: must be at least 1 byte"
                )));
            }
            self.check_local(
                &format!("entries[{i}].local_buffer_id"),
                s.local_buffer,
                s.local_offset,
                s.remote.length,
            )?;
            if range_end(s.remote.offset, s.remote.length).is_none() {
                return Err(EngineError::invalid(format!(
                    "entries[{i}].remote_offset: {} + length {} overflows 64 bits",
                    s.remote.offset, s.remote.length
                )));
            }
            self.live_peer(&format!("entries[{i}].remote_descriptor"), s.peer)?;
            total += s.remote.length;
        }
        Ok(total)
    }

    /// Records one peer's share of a transfer (an offer id or a read id).
    fn add_part(&mut self, id: TransferId, part: u64, peer: PeerIdx) {
        let t = self.transfers.get_mut(&id).expect("just created");
        t.parts.push(part);
        t.pending_parts += 1;
        t.peers.push(peer);
        self.peers[peer.0 as usize].transfers_started += 1;
    }

    /// The first progress event of a new transfer.
    fn announce(&mut self, id: TransferId, total: u64) {
        self.actions.push_back(Action::Progress {
            transfer: id,
            bytes_done: 0,
            total,
            running: false,
        });
    }

    fn new_transfer(
        &mut self,
        kind: TransferKind,
        total: u64,
        entries: usize,
        deadline: Instant,
    ) -> TransferId {
        let id = TransferId(self.next_transfer);
        self.next_transfer += 1;
        self.transfers.insert(
            id,
            Transfer {
                kind,
                total,
                done_bytes: 0,
                entries: vec![None; entries],
                pending_parts: 0,
                parts: Vec::new(),
                deadline,
                running: false,
                peers: Vec::new(),
            },
        );
        self.deadlines.insert((deadline, id));
        id
    }

    /// Starts a WRITE. Validates everything local (buffers, bounds, peers, limits) first: on error
    /// nothing changed.
    pub fn start_write(
        &mut self,
        specs: Vec<WriteSpec>,
        notification: Vec<u8>,
        deadline: Instant,
        now: Instant,
    ) -> EngineResult<TransferId> {
        let total = self.check_entries(&specs, notification.len())?;
        let id = self.new_transfer(TransferKind::Write, total, specs.len(), deadline);
        // One offer per peer, ranges in entry order.
        let by_peer = group_by_peer(&specs);
        let deadline_ms = deadline.saturating_duration_since(now).as_millis() as u64;
        for (peer, idxs) in by_peer {
            let offer_id = self.next_offer;
            self.next_offer += 1;
            let lengths: Vec<u64> = idxs.iter().map(|&i| specs[i].remote.length).collect();
            let sources: Vec<(u64, u64)> = idxs
                .iter()
                .map(|&i| (specs[i].local_buffer, specs[i].local_offset))
                .collect();
            let ranges: Vec<RemoteRange> = idxs.iter().map(|&i| specs[i].remote.clone()).collect();
            let msg = self.make_offer(
                peer,
                offer_id,
                0,
                Some(id),
                idxs,
                sources,
                lengths,
                ranges,
                notification.clone(),
                deadline_ms,
            );
            self.actions.push_back(Action::Control { peer, msg });
            self.add_part(id, offer_id, peer);
        }
        self.announce(id, total);
        Ok(id)
    }

    #[allow(clippy::too_many_arguments)]
    fn make_offer(
        &mut self,
        peer: PeerIdx,
        offer_id: u64,
        read_id: u64,
        transfer: Option<TransferId>,
        entries: Vec<usize>,
        sources: Vec<(u64, u64)>,
        lengths: Vec<u64>,
        ranges: Vec<RemoteRange>,
        notification: Vec<u8>,
        deadline_ms: u64,
    ) -> PeerMsg {
        let lanes = self.peers[peer.0 as usize].send.len() as u32;
        let first_lane = self.peers[peer.0 as usize].next_lane % lanes;
        let chunks = ChunkPlan::count(&lengths, self.cfg.chunk_bytes);
        self.peers[peer.0 as usize].next_lane = ((u64::from(first_lane) + chunks) % u64::from(lanes)) as u32;
        for &(b, _) in &sources {
            self.use_buffer(b);
        }
        self.out_offers.insert(
            offer_id,
            OutOffer {
                peer,
                transfer,
                read_id,
                entries,
                sources,
                lengths,
                chunk_bytes: self.cfg.chunk_bytes,
                first_lane,
                accepted: false,
                cancelled: false,
                unfinished: 0,
                done: false,
            },
        );
        PeerMsg::Offer(Offer {
            offer_id,
            read_id,
            chunk_bytes: self.cfg.chunk_bytes,
            first_lane,
            ranges,
            notification,
            deadline_ms,
        })
    }

    /// Starts a READ: asks each peer holding data for an offer into our buffers.
    pub fn start_read(
        &mut self,
        specs: Vec<ReadSpec>,
        deadline: Instant,
        now: Instant,
    ) -> EngineResult<TransferId> {
        let total = self.check_entries(&specs, 0)?;
        let id = self.new_transfer(TransferKind::Read, total, specs.len(), deadline);
        let deadline_ms = deadline.saturating_duration_since(now).as_millis() as u64;
        for (peer, idxs) in group_by_peer(&specs) {
            let read_id = self.next_read;
            self.next_read += 1;
            let pairs: Vec<ReadPair> = idxs
                .iter()
                .map(|&i| {
                    let s = &specs[i];
                    ReadPair {
                        source: s.remote.clone(),
                        dest: RemoteRange {
                            buffer_id: s.local_buffer,
                            access_key: self.buffers[&s.local_buffer].key,
                            offset: s.local_offset,
                            length: s.remote.length,
                        },
                    }
                })
                .collect();
            self.actions.push_back(Action::Control {
                peer,
                msg: PeerMsg::ReadRequest {
                    read_id,
                    pairs: pairs.clone(),
                    deadline_ms,
                },
            });
            self.reads.insert(
                read_id,
                ReadPart {
                    peer,
                    transfer: id,
                    entries: idxs,
                    pairs,
                    offer: None,
                    cancelled: false,
                },
            );
            self.add_part(id, read_id, peer);
        }
        self.announce(id, total);
        Ok(id)
    }

    // ---- control messages from peers ----------------------------------------------------------

    /// Handles one control message from a peer, in stream order.
    pub fn on_message(&mut self, peer: PeerIdx, msg: PeerMsg, now: Instant) {
        if self.peers.get(peer.0 as usize).is_none_or(|p| p.failed.is_some()) {
            return;
        }
        match msg {
            PeerMsg::Offer(offer) => self.on_offer(peer, offer),
            PeerMsg::Accept { offer_id } => self.on_accept(peer, offer_id),
            PeerMsg::Reject {
                offer_id,
                code,
                message,
                range_index,
            } => self.on_reject(peer, offer_id, code, &message, range_index),
            PeerMsg::Done { offer_id } => self.on_done(peer, offer_id),
            PeerMsg::Failed {
                offer_id,
                code,
                message,
            } => self.on_remote_failed(peer, offer_id, code, &message),
            PeerMsg::CancelOffer {
                offer_id,
                code,
                message,
            } => self.on_cancel_offer(peer, offer_id, code, &message),
            PeerMsg::ReadRequest {
                read_id,
                pairs,
                deadline_ms,
            } => self.on_read_request(peer, read_id, pairs, deadline_ms, now),
            PeerMsg::ReadReject {
                read_id,
                code,
                message,
                range_index,
            } => self.on_read_reject(peer, read_id, code, &message, range_index),
            PeerMsg::CancelRead { read_id } => self.on_cancel_read(peer, read_id),
            PeerMsg::Goodbye { reason } => {
                self.peer_failed(peer, &format!("the peer ended the pairing: {reason}"))
            }
        }
    }

    /// Checks a range of one of our buffers as a peer claims it.
    fn check_claimed(&self, i: usize, r: &RemoteRange) -> Result<(), (Code, String)> {
        let b = self.buffers.get(&r.buffer_id).ok_or_else(|| {
            (
                Code::NotFound,
                format!("ranges[{i}]: buffer {} does not exist", r.buffer_id),
            )
        })?;
        if !keys_equal(&b.key, &r.access_key) {
            return Err((
                Code::PermissionDenied,
                format!("ranges[{i}]: wrong access key for buffer {}", r.buffer_id),
            ));
        }
        if r.length == 0 {
            return Err((
                Code::InvalidArgument,
                format!("ranges[{i}]: length must be at least 1 byte"),
            ));
        }
        check_bounds(&format!("ranges[{i}]"), r.buffer_id, b.size, r.offset, r.length)
            .map_err(|e| (e.code, e.message))
    }

    fn on_offer(&mut self, peer: PeerIdx, offer: Offer) {
        let reject = |code: Code, message: String, range_index: u32| PeerMsg::Reject {
            offer_id: offer.offer_id,
            code,
            message,
            range_index,
        };
        let lanes = self.peers[peer.0 as usize].recv.len() as u32;
        let verdict: Result<(), (Code, String, u32)> = (|| {
            if self.in_offers.contains_key(&(peer, offer.offer_id)) {
                return Err((
                    Code::AlreadyExists,
                    format!("offer {} is already active", offer.offer_id),
                    0,
                ));
            }
            plan::check_chunk_bytes(u64::from(offer.chunk_bytes))
                .map_err(|e| (Code::InvalidArgument, e, 0))?;
            if lanes == 0 || offer.first_lane >= lanes {
                return Err((
                    Code::InvalidArgument,
                    format!("first_lane {} is not below the {lanes} lanes", offer.first_lane),
                    0,
                ));
            }
            if offer.ranges.is_empty() || offer.ranges.len() > self.cfg.max_entries {
                return Err((
                    Code::InvalidArgument,
                    format!(
                        "{} ranges (1 to {} allowed)",
                        offer.ranges.len(),
                        self.cfg.max_entries
                    ),
                    0,
                ));
            }
            if offer.notification.len() > self.cfg.max_notification {
                return Err((
                    Code::InvalidArgument,
                    format!(
                        "notification of {} bytes exceeds {}",
                        offer.notification.len(),
                        self.cfg.max_notification
                    ),
                    0,
                ));
            }
            for (i, r) in offer.ranges.iter().enumerate() {
                self.check_claimed(i, r).map_err(|(c, m)| (c, m, i as u32))?;
            }
            if offer.read_id != 0 {
                let read = self.reads.get(&offer.read_id).filter(|r| r.peer == peer);
                let Some(read) = read else {
                    return Err((Code::NotFound, format!("read {} is unknown", offer.read_id), 0));
                };
                if read.cancelled || read.offer.is_some() {
                    return Err((
                        Code::Cancelled,
                        format!("read {} is no longer waiting", offer.read_id),
                        0,
                    ));
                }
                let asked: Vec<&RemoteRange> = read.pairs.iter().map(|p| &p.dest).collect();
                if asked.len() != offer.ranges.len() || asked.iter().zip(&offer.ranges).any(|(a, b)| *a != b)
                {
                    return Err((
                        Code::InvalidArgument,
                        format!("offer does not match read {}", offer.read_id),
                        0,
                    ));
                }
            }
            Ok(())
        })();
        if let Err((code, message, idx)) = verdict {
            self.actions.push_back(Action::Control {
                peer,
                msg: reject(code, message, idx),
            });
            return;
        }
        let lengths: Vec<u64> = offer.ranges.iter().map(|r| r.length).collect();
        let dests: Vec<(u64, u64)> = offer.ranges.iter().map(|r| (r.buffer_id, r.offset)).collect();
        for &(b, _) in &dests {
            self.use_buffer(b);
        }
        let mut chunks_total = 0u64;
        let p = &mut self.peers[peer.0 as usize];
        for c in ChunkPlan::new(&lengths, offer.chunk_bytes, offer.first_lane, lanes) {
            let (b, off) = dests[c.range as usize];
            p.recv[c.lane as usize].queue.push_back(Item {
                offer: offer.offer_id,
                buffer: b,
                offset: off + c.offset,
                len: c.len,
            });
            chunks_total += 1;
        }
        let read = (offer.read_id != 0).then_some(offer.read_id);
        if let Some(rid) = read {
            let r = self.reads.get_mut(&rid).expect("checked");
            r.offer = Some(offer.offer_id);
            let t = r.transfer;
            self.set_running(t);
        }
        self.in_offers.insert(
            (peer, offer.offer_id),
            InOffer {
                read,
                dests,
                chunks_total,
                chunks_done: 0,
                bytes_done: 0,
                discard: false,
                failed: false,
                notification: offer.notification,
            },
        );
        self.actions.push_back(Action::Control {
            peer,
            msg: PeerMsg::Accept {
                offer_id: offer.offer_id,
            },
        });
        self.pump(peer);
    }

    fn set_running(&mut self, id: TransferId) {
        if let Some(t) = self.transfers.get_mut(&id)
            && !t.running
        {
            t.running = true;
            self.actions.push_back(Action::Progress {
                transfer: id,
                bytes_done: t.done_bytes,
                total: t.total,
                running: true,
            });
        }
    }

    fn on_accept(&mut self, peer: PeerIdx, offer_id: u64) {
        let Some(o) = self
            .out_offers
            .get_mut(&offer_id)
            .filter(|o| o.peer == peer && !o.accepted)
        else {
            return;
        };
        o.accepted = true;
        let lanes = self.peers[peer.0 as usize].send.len() as u32;
        let p = &mut self.peers[peer.0 as usize];
        let mut n = 0u64;
        for c in ChunkPlan::new(&o.lengths, o.chunk_bytes, o.first_lane, lanes) {
            let (b, off) = o.sources[c.range as usize];
            p.send[c.lane as usize].queue.push_back(Item {
                offer: offer_id,
                buffer: b,
                offset: off + c.offset,
                // A cancelled offer still meets every posted receive, with nothing in it.
                len: if o.cancelled { 0 } else { c.len },
            });
            n += 1;
        }
        o.unfinished = n;
        if let Some(t) = o.transfer {
            self.set_running(t);
        }
        self.pump(peer);
    }

    fn on_reject(&mut self, peer: PeerIdx, offer_id: u64, code: Code, message: &str, range_index: u32) {
        let Some(o) = self
            .out_offers
            .get(&offer_id)
            .filter(|o| o.peer == peer && !o.accepted)
        else {
            return;
        };
        let entry = o.entries.get(range_index as usize).copied();
        let transfer = o.transfer;
        self.drop_out_offer(offer_id);
        if let Some(t) = transfer {
            let node = self.peers[peer.0 as usize].node_id.clone();
            let msg = match entry {
                Some(e) => format!("entries[{e}]: node {node} refused: {message}"),
                None => format!("node {node} refused: {message}"),
            };
            self.fail_transfer(t, code, &msg, entry);
        }
    }

    fn on_done(&mut self, peer: PeerIdx, offer_id: u64) {
        let Some(o) = self
            .out_offers
            .get_mut(&offer_id)
            .filter(|o| o.peer == peer && o.accepted)
        else {
            return;
        };
        o.done = true;
        let transfer = o.transfer;
        let finished = o.unfinished == 0;
        let entries = o.entries.clone();
        if finished {
            self.drop_out_offer(offer_id);
        }
        if let Some(t) = transfer {
            if let Some(tr) = self.transfers.get_mut(&t) {
                for e in entries {
                    tr.entries[e] = Some((Code::Ok, String::new()));
                }
            }
            self.part_done(t);
        }
    }

    fn on_remote_failed(&mut self, peer: PeerIdx, offer_id: u64, code: Code, message: &str) {
        let Some(o) = self.out_offers.get(&offer_id).filter(|o| o.peer == peer) else {
            return;
        };
        let transfer = o.transfer;
        self.cancel_out_offer(offer_id, None);
        if let Some(t) = transfer {
            let node = self.peers[peer.0 as usize].node_id.clone();
            self.fail_transfer(
                t,
                code,
                &format!("node {node} failed the transfer: {message}"),
                None,
            );
        }
    }

    fn on_cancel_offer(&mut self, peer: PeerIdx, offer_id: u64, code: Code, message: &str) {
        let Some(o) = self.in_offers.get_mut(&(peer, offer_id)) else {
            return;
        };
        o.discard = true;
        let read = o.read;
        if let Some(rid) = read
            && let Some(r) = self.reads.get(&rid)
        {
            let t = r.transfer;
            let node = self.peers[peer.0 as usize].node_id.clone();
            self.fail_transfer(
                t,
                code,
                &format!("node {node} gave up serving the read: {message}"),
                None,
            );
        }
    }

    fn on_read_request(
        &mut self,
        peer: PeerIdx,
        read_id: u64,
        pairs: Vec<ReadPair>,
        deadline_ms: u64,
        _now: Instant,
    ) {
        let verdict: Result<(), (Code, String, u32)> = (|| {
            if pairs.is_empty() || pairs.len() > self.cfg.max_entries {
                return Err((
                    Code::InvalidArgument,
                    format!("{} ranges (1 to {} allowed)", pairs.len(), self.cfg.max_entries),
                    0,
                ));
            }
            for (i, p) in pairs.iter().enumerate() {
                self.check_claimed(i, &p.source)
                    .map_err(|(c, m)| (c, m, i as u32))?;
                if p.dest.length != p.source.length {
                    return Err((
                        Code::InvalidArgument,
                        format!("ranges[{i}]: source and destination lengths differ"),
                        i as u32,
                    ));
                }
            }
            Ok(())
        })();
        if let Err((code, message, range_index)) = verdict {
            self.actions.push_back(Action::Control {
                peer,
                msg: PeerMsg::ReadReject {
                    read_id,
                    code,
                    message,
                    range_index,
                },
            });
            return;
        }
        let offer_id = self.next_offer;
        self.next_offer += 1;
        let lengths: Vec<u64> = pairs.iter().map(|p| p.source.length).collect();
        let sources: Vec<(u64, u64)> = pairs
            .iter()
            .map(|p| (p.source.buffer_id, p.source.offset))
            .collect();
        let ranges: Vec<RemoteRange> = pairs.into_iter().map(|p| p.dest).collect();
        let entries = (0..ranges.len()).collect();
        let msg = self.make_offer(
            peer,
            offer_id,
            read_id,
            None,
            entries,
            sources,
            lengths,
            ranges,
            Vec::new(),
            deadline_ms,
        );
        self.actions.push_back(Action::Control { peer, msg });
    }

    fn on_read_reject(&mut self, peer: PeerIdx, read_id: u64, code: Code, message: &str, range_index: u32) {
        let Some(r) = self.reads.get(&read_id).filter(|r| r.peer == peer) else {
            return;
        };
        let entry = r.entries.get(range_index as usize).copied();
        let t = r.transfer;
        self.reads.remove(&read_id);
        let node = self.peers[peer.0 as usize].node_id.clone();
        let msg = match entry {
            Some(e) => format!("entries[{e}]: node {node} refused: {message}"),
            None => format!("node {node} refused: {message}"),
        };
        self.fail_transfer(t, code, &msg, entry);
    }

    fn on_cancel_read(&mut self, peer: PeerIdx, read_id: u64) {
        // Our offer serving that read (made when the request came) stops sending real bytes.
        let offer = self.out_offers.iter().find_map(|(&id, o)| {
            (o.peer == peer && o.transfer.is_none() && o.read_id == read_id).then_some(id)
        });
        if let Some(id) = offer {
            self.cancel_out_offer(id, Some((Code::Cancelled, "the reader cancelled".to_string())));
        }
    }

    // ---- plugin completions (from the poller) -------------------------------------------------

    /// The oldest posted send on a lane completed.
    pub fn send_done(&mut self, peer: PeerIdx, lane: u32) {
        let Some(l) = self
            .peers
            .get_mut(peer.0 as usize)
            .and_then(|p| p.send.get_mut(lane as usize))
        else {
            return;
        };
        let Some(item) = l.posted.pop_front() else {
            return;
        };
        l.bytes += u64::from(item.len);
        l.chunks += 1;
        if let Some(o) = self.out_offers.get_mut(&item.offer) {
            o.unfinished -= 1;
            let (transfer, finished) = (o.transfer, o.unfinished == 0 && (o.done || o.cancelled));
            if finished {
                self.drop_out_offer(item.offer);
            }
            if let Some(t) = transfer {
                self.add_progress(t, u64::from(item.len));
            }
        }
        self.pump(peer);
    }

    /// The oldest posted receive on a lane was unpacked and consumed (`Err`: its unpack failed).
    pub fn recv_consumed(&mut self, peer: PeerIdx, lane: u32, result: Result<(), String>) {
        let Some(l) = self
            .peers
            .get_mut(peer.0 as usize)
            .and_then(|p| p.recv.get_mut(lane as usize))
        else {
            return;
        };
        let Some(item) = l.posted.pop_front() else {
            return;
        };
        l.bytes += u64::from(item.len);
        l.chunks += 1;
        let key = (peer, item.offer);
        if let Some(o) = self.in_offers.get_mut(&key) {
            o.chunks_done += 1;
            if let Err(why) = result
                && !o.discard
            {
                o.discard = true;
                o.failed = true;
                let offer_id = item.offer;
                self.actions.push_back(Action::Control {
                    peer,
                    msg: PeerMsg::Failed {
                        offer_id,
                        code: Code::Internal,
                        message: why.clone(),
                    },
                });
                if let Some(t) = o.read.and_then(|r| self.reads.get(&r)).map(|r| r.transfer) {
                    self.fail_transfer(t, Code::Internal, &format!("unpack failed: {why}"), None);
                }
            }
            let Some(o) = self.in_offers.get_mut(&key) else {
                return;
            };
            if !o.discard {
                o.bytes_done += u64::from(item.len);
            }
            let (read, discard) = (o.read, o.discard);
            if !discard && let Some(t) = read.and_then(|r| self.reads.get(&r)).map(|r| r.transfer) {
                self.add_progress(t, u64::from(item.len));
            }
            if self.in_offers[&key].chunks_done == self.in_offers[&key].chunks_total {
                self.finish_in_offer(peer, item.offer);
            }
        }
        self.pump(peer);
    }

    fn finish_in_offer(&mut self, peer: PeerIdx, offer_id: u64) {
        let o = self.in_offers.remove(&(peer, offer_id)).expect("present");
        for &(b, _) in &o.dests {
            self.unuse_buffer(b);
        }
        if o.discard {
            if let Some(rid) = o.read {
                self.reads.remove(&rid);
            }
            return;
        }
        self.actions.push_back(Action::Control {
            peer,
            msg: PeerMsg::Done { offer_id },
        });
        if !o.notification.is_empty() {
            self.actions.push_back(Action::Notify {
                peer,
                offer_id,
                payload: o.notification,
                buffers: o.dests.iter().map(|d| d.0).collect(),
            });
        }
        if let Some(rid) = o.read
            && let Some(r) = self.reads.remove(&rid)
        {
            self.part_done(r.transfer);
        }
    }

    /// The lane (or control stream) of a peer failed: every transfer touching it fails.
    pub fn peer_failed(&mut self, peer: PeerIdx, reason: &str) {
        let Some(p) = self.peers.get_mut(peer.0 as usize) else {
            return;
        };
        if p.failed.is_some() {
            return;
        }
        p.failed = Some(reason.to_string());
        let node = p.node_id.clone();
        for l in p.send.iter_mut().chain(p.recv.iter_mut()) {
            l.queue.clear();
            l.posted.clear();
            l.ready = false;
        }
        let msg = format!("peer {node} failed: {reason}");
        let outs: Vec<u64> = self
            .out_offers
            .iter()
            .filter(|(_, o)| o.peer == peer)
            .map(|(&id, _)| id)
            .collect();
        let mut hit: Vec<TransferId> = Vec::new();
        for id in outs {
            if let Some(t) = self.out_offers[&id].transfer {
                hit.push(t);
            }
            self.drop_out_offer(id);
        }
        let ins: Vec<u64> = self
            .in_offers
            .keys()
            .filter(|(p, _)| *p == peer)
            .map(|&(_, id)| id)
            .collect();
        for id in ins {
            let o = self.in_offers.remove(&(peer, id)).expect("present");
            for &(b, _) in &o.dests {
                self.unuse_buffer(b);
            }
        }
        let reads: Vec<u64> = self
            .reads
            .iter()
            .filter(|(_, r)| r.peer == peer)
            .map(|(&id, _)| id)
            .collect();
        for id in reads {
            hit.push(self.reads.remove(&id).expect("present").transfer);
        }
        for t in hit {
            self.fail_transfer(t, Code::Unavailable, &msg, None);
        }
        self.actions.push_back(Action::ClosePeer {
            peer,
            reason: reason.to_string(),
        });
    }

    // ---- cancellation and time ----------------------------------------------------------------

    /// Cancels a transfer. `false` when it already ended (or never existed).
    pub fn cancel(&mut self, id: TransferId, code: Code, message: &str) -> bool {
        if !self.transfers.contains_key(&id) {
            return false;
        }
        self.fail_transfer(id, code, message, None);
        true
    }

    /// Fails every transfer whose deadline passed.
    pub fn tick(&mut self, now: Instant) {
        while let Some(&(when, id)) = self.deadlines.first() {
            if when > now {
                break;
            }
            self.deadlines.pop_first();
            if self.transfers.contains_key(&id) {
                self.fail_transfer(id, Code::DeadlineExceeded, "the transfer's deadline passed", None);
            }
        }
    }

    /// The next deadline, for the driver's sleep.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.first().map(|&(t, _)| t)
    }

    /// Ends a transfer with an error; stops its parts on both sides (slots drain normally).
    fn fail_transfer(&mut self, id: TransferId, code: Code, message: &str, entry: Option<usize>) {
        let Some(mut t) = self.transfers.remove(&id) else {
            return;
        };
        self.deadlines.remove(&(t.deadline, id));
        for part in std::mem::take(&mut t.parts) {
            match t.kind {
                TransferKind::Write => {
                    if self.out_offers.contains_key(&part) {
                        self.cancel_out_offer(part, Some((code, message.to_string())));
                    }
                }
                TransferKind::Read => {
                    if let Some(r) = self.reads.get_mut(&part) {
                        r.cancelled = true;
                        let (peer, offer) = (r.peer, r.offer);
                        self.actions.push_back(Action::Control {
                            peer,
                            msg: PeerMsg::CancelRead { read_id: part },
                        });
                        match offer.and_then(|o| self.in_offers.get_mut(&(peer, o))) {
                            // Data already agreed on keeps coming; it is discarded.
                            Some(o) => o.discard = true,
                            None => {
                                self.reads.remove(&part);
                            }
                        }
                    }
                }
            }
        }
        for p in &t.peers {
            self.peers[p.0 as usize].transfers_failed += 1;
        }
        let entries = (0..t.entries.len())
            .map(|i| match (&t.entries[i], entry) {
                (Some(s), _) => s.clone(),
                (None, Some(e)) if e == i => (code, message.to_string()),
                (None, Some(_)) => (
                    Code::Aborted,
                    format!("not completed: another entry failed: {message}"),
                ),
                (None, None) => (code, message.to_string()),
            })
            .collect();
        self.actions.push_back(Action::Finished {
            transfer: id,
            outcome: Outcome {
                code,
                message: message.to_string(),
                entries,
            },
        });
    }

    /// Stops an offer we made: unaccepted, it is withdrawn; accepted, its remaining chunks go out
    /// empty. The peer is told unless `notify` is `None`.
    fn cancel_out_offer(&mut self, offer_id: u64, notify: Option<(Code, String)>) {
        let Some(o) = self.out_offers.get_mut(&offer_id) else {
            return;
        };
        if o.cancelled {
            return;
        }
        o.cancelled = true;
        let peer = o.peer;
        if let Some((code, message)) = notify {
            self.actions.push_back(Action::Control {
                peer,
                msg: PeerMsg::CancelOffer {
                    offer_id,
                    code,
                    message,
                },
            });
        }
        let o = &self.out_offers[&offer_id];
        if o.accepted {
            let p = &mut self.peers[peer.0 as usize];
            for l in &mut p.send {
                for item in l.queue.iter_mut().filter(|i| i.offer == offer_id) {
                    item.len = 0;
                }
            }
            if o.unfinished == 0 {
                self.drop_out_offer(offer_id);
            }
        }
        // Unaccepted: kept until the peer's Accept (then sent empty) or Reject arrives.
    }

    fn drop_out_offer(&mut self, offer_id: u64) {
        if let Some(o) = self.out_offers.remove(&offer_id) {
            for &(b, _) in &o.sources {
                self.unuse_buffer(b);
            }
        }
    }

    fn add_progress(&mut self, id: TransferId, bytes: u64) {
        if bytes == 0 {
            return;
        }
        if let Some(t) = self.transfers.get_mut(&id) {
            t.done_bytes += bytes;
            self.actions.push_back(Action::Progress {
                transfer: id,
                bytes_done: t.done_bytes,
                total: t.total,
                running: t.running,
            });
        }
    }

    fn part_done(&mut self, id: TransferId) {
        let Some(t) = self.transfers.get_mut(&id) else {
            return;
        };
        t.pending_parts -= 1;
        if t.pending_parts > 0 {
            return;
        }
        let t = self.transfers.remove(&id).expect("present");
        self.deadlines.remove(&(t.deadline, id));
        for p in &t.peers {
            self.peers[p.0 as usize].transfers_ok += 1;
        }
        self.actions.push_back(Action::Progress {
            transfer: id,
            bytes_done: t.total,
            total: t.total,
            running: true,
        });
        self.actions.push_back(Action::Finished {
            transfer: id,
            outcome: Outcome {
                code: Code::Ok,
                message: String::new(),
                entries: vec![(Code::Ok, String::new()); t.entries.len()],
            },
        });
    }

    /// Posts what the windows allow on every lane of a peer.
    fn pump(&mut self, peer: PeerIdx) {
        let (send_window, recv_window) = (self.cfg.send_window, self.cfg.recv_window);
        let Some(p) = self.peers.get_mut(peer.0 as usize) else {
            return;
        };
        if p.failed.is_some() {
            return;
        }
        for (lane, l) in p.send.iter_mut().enumerate() {
            while l.ready && l.posted.len() < send_window {
                let Some(item) = l.queue.pop_front() else { break };
                l.posted.push_back(item);
                self.actions.push_back(Action::PostSend {
                    peer,
                    lane: lane as u32,
                    buffer: item.buffer,
                    offset: item.offset,
                    len: item.len,
                });
            }
        }
        for (lane, l) in p.recv.iter_mut().enumerate() {
            while l.ready && l.posted.len() < recv_window {
                let Some(item) = l.queue.pop_front() else { break };
                l.posted.push_back(item);
                self.actions.push_back(Action::PostRecv {
                    peer,
                    lane: lane as u32,
                    buffer: item.buffer,
                    offset: item.offset,
                    len: item.len,
                });
            }
        }
        for l in p.send.iter_mut().chain(p.recv.iter_mut()) {
            l.note_window();
        }
    }
}

impl Lane {
    /// Counts the start of each stretch in which the window is full and chunks wait.
    fn note_window(&mut self) {
        let stalled = self.ready && !self.queue.is_empty();
        if stalled && !self.stalled {
            self.window_full += 1;
        }
        self.stalled = stalled;
    }
}

/// Entry indices grouped by peer, peers in order of first appearance, entries in order.
fn group_by_peer(specs: &[EntrySpec]) -> Vec<(PeerIdx, Vec<usize>)> {
    let mut by_peer: Vec<(PeerIdx, Vec<usize>)> = Vec::new();
    for (i, s) in specs.iter().enumerate() {
        match by_peer.iter_mut().find(|(p, _)| *p == s.peer) {
            Some((_, v)) => v.push(i),
            None => by_peer.push((s.peer, vec![i])),
        }
    }
    by_peer
}

fn check_bounds(field: &str, buffer: u64, size: u64, offset: u64, len: u64) -> EngineResult<()> {
    match range_end(offset, len) {
        None => Err(EngineError::invalid(format!(
            "{field}: offset {offset} + length {len} overflows 64 bits"
        ))),
        Some(end) if end > size => Err(EngineError::invalid(format!(
            "{field}: range {offset}..{end} is past the end of buffer {buffer} ({size} bytes)"
        ))),
        Some(_) => Ok(()),
    }
}

/// Converts a remaining-time budget to an absolute deadline.
pub fn deadline_after(now: Instant, budget: Duration) -> Instant {
    now.checked_add(budget)
        .unwrap_or(now + Duration::from_secs(86400 * 365))
}

#[cfg(test)]
mod tests;
