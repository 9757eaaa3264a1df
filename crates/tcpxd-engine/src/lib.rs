//! The transfer state machine, free of I/O: no threads, sockets, plugin or CUDA calls.
//!
//! The poller feeds it events (client requests, control messages from peers, plugin
//! completions, time) and executes the [`Action`]s it emits (post a send or receive, send a
//! control message, report progress or a final status, deliver a notification). It decides
//! everything the plugin's rules depend on:
//!
//! - **Protocol per transfer.** A receiver announces at pairing which of its lanes keep eager
//!   credits and up to what size it wants transfers eager (`ReceiveMode`); the sender picks eager
//!   or rendezvous for each transfer from that alone, and plans its chunks over the lanes of the
//!   protocol it picked (see [`credits`]).
//! - **Order.** Tags are ignored by TCPX: the k-th send on a comm meets the k-th receive. A
//!   receiver appends an offer's receives to its lane queues when it accepts the offer; the sender
//!   appends the sends when the accept arrives. Offers and accepts travel on one ordered stream,
//!   so both sides build every lane's queue in the same order.
//! - **Windows.** At most `send_window` sends (default 12) and `recv_window` receives (16, held
//!   until consumed) are posted per lane. A send in pieces (`PostGatherSend`) may be posted
//!   `gather_ahead` (default 0: off; from host memory `host_gather_ahead`) further, so that its
//!   gather runs while the sends before it are
//!   in flight; the queue's head decides, so a plain send still waits until fewer than
//!   `send_window` sends are posted. The driver then gathers each such send at once (into slot
//!   `n % (send_window + gather_ahead)` of the lane's staging ring: the engine never has more
//!   of them posted and unfinished, so the slot's previous send is done) but hands the plugin
//!   at most `send_window` sends per lane, the rest waiting, in order, until one completes: the
//!   plugin sees the windows it saw without gathers ahead. Likewise a receive in pieces
//!   (`PostScatterRecv`) may be posted `scatter_ahead` (default 0 here; the daemon's
//!   `transfer.scatter_ahead`) beyond `recv_window`: the driver hands the plugin at most
//!   `recv_window` receives per lane and posts the rest as the plugin's slots come back, which
//!   for a receive that landed in the driver's own host slot is before its scatter finished
//!   (the receive is reported consumed only after it). Its landing slot is `n %
//!   (recv_window + scatter_ahead)`: the engine never has more of them posted and unconsumed.
//! - **Completion.** A WRITE finishes when the receiver reports `Done`, i.e. after its unpack of
//!   every chunk finished; a READ when every chunk was consumed locally.
//! - **Cancellation and deadlines.** Chunks already agreed on must still meet their partners, so a
//!   cancelled offer sends its remaining chunks with zero length and the receiver discards them;
//!   every slot drains back to zero (emptied chunks only once the receiver answered
//!   `CancelSeen`). A receive of a transfer that ended here is not unpacked ([`Engine::recv_lands`]).
//! - **Failure.** A failed peer fails every transfer that touches it, with the peer named, and its
//!   queues are dropped.
//!
//! # Driving it
//!
//! The engine does nothing by itself (quinn-proto's `Connection` is the model): a driver — the
//! daemon's poller, or a test's simulation — calls four groups of methods.
//!
//! - **Events**, named for what happened: [`Engine::on_message`] (a control message from a
//!   peer, in stream order), [`Engine::on_malformed`] (a peer's request that could not be
//!   read), [`Engine::on_lane_ready`] (a lane's comm connected), the plugin's completions, each for
//!   the oldest request of its lane ([`Engine::on_send_done`], [`Engine::on_recv_landed`],
//!   [`Engine::on_recv_consumed`]), [`Engine::on_peer_failed`] (its stream or a comm broke) and
//!   [`Engine::on_tick`] (time: transfer deadlines, eager data that waits too long for its header,
//!   the end of a drain's grace period).
//! - **Commands**, the client's requests: [`Engine::add_buffer`], [`Engine::rekey_buffer`],
//!   [`Engine::remove_buffer`], [`Engine::watch_buffer`], [`Engine::add_peer`],
//!   [`Engine::start_write`], [`Engine::start_read`], the block and prepared-list commands
//!   ([`Engine::prepare_local`], [`Engine::start_write_prepared`], …), [`Engine::cancel`],
//!   [`Engine::begin_drain`]. Each checks before it changes anything: an `Err` left the engine
//!   as it was.
//! - **Actions**: [`Engine::poll_action`] until `None`: post sends and receives (within the
//!   windows), send control messages, report progress and ends, deliver notifications, open
//!   and close lanes ([`Action::ListenLane`], [`Action::ConnectLane`], [`Action::CloseLane`]:
//!   lanes open on first use and close when idle, `lane_life.rs`), close and release pairings, wake whoever waits for a buffer ([`Action::BufferIdle`]). The driver
//!   carries them out in order and reports what came of them as events.
//! - **Queries**, without effect: [`Engine::config`], [`Engine::layout`] (the lanes to open
//!   towards each peer), [`Engine::next_deadline`] (how long the driver may sleep),
//!   [`Engine::is_drained`], [`Engine::is_idle`], [`Engine::lanes_idle`], [`Engine::posted`],
//!   [`Engine::active_transfers`], [`Engine::buffer_users`], the counters.
//!
//! The order, per pass of the poller: commands from its channel; lanes connected
//! (`on_lane_ready`); the actions carried out; each lane's head tested and its completions
//! reported; `on_tick(now)`; the actions again; while draining, `is_drained(now)`; then, with
//! nothing in flight, a sleep until a command or `next_deadline()`.

mod action;
mod block_offers;
mod block_transfers;
pub mod blocks;
mod buffers;
mod coalesce;
mod completion;
mod config;
mod counters;
pub mod credits;
mod drain;
pub mod error;
pub mod idhash;
mod inbound;
mod inline;
mod lane;
mod lane_credits;
mod lane_life;
mod lane_use;
mod notice;
mod packed_batch;
pub mod packed_ranges;
mod pair_life;
use lane_credits::{RecvCredits, SendCredits};
pub use lane_life::DEFAULT_LANE_OPEN_TIMEOUT;
pub use pair_life::PairLife;
pub mod layout;
pub mod plan;
mod prepared;
mod prepared_entries;
pub mod ranges;
mod release;
mod route_parts;
mod routes;
pub use route_parts::MAX_SPLIT_PARTS;
pub use routes::{MAX_ROUTED_LANES, ROUTED_EAGER_PER_ROUTE};
pub use streams::GPU_NOT_KNOWN;
mod same_node;
use release::PeerMap;
pub use same_node::{SameNodePlan, SamePiece};
mod start;
mod streams;
pub mod topology;
mod transfer;
pub mod wire;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::ops::Range;
use std::time::{Duration, Instant};

pub use action::{ACTION_KINDS, Action};
pub use block_transfers::{BlockSpec, RemoteBlocks};
pub use config::{
    DEFAULT_CREDIT_BUDGET_BYTES, DEFAULT_EAGER_MAX_BYTES, DEFAULT_GATHER_AHEAD, DEFAULT_HOST_GATHER_AHEAD,
    DEFAULT_INLINE_GPU_IN_FLIGHT, DEFAULT_INLINE_WINDOW_BYTES, DEFAULT_MAX_ENTRIES, EngineConfig,
    MAX_INLINE_BYTES, Protocol,
};
pub use counters::{LaneCounters, PeerCounters};
pub use drain::{CLOSE_AT_LEAST, DrainReport};
pub use error::{Code, EngineError, EngineResult};
pub use layout::LaneLayout;
pub use packed_batch::PackedBatch;
pub use packed_ranges::{PackedRanges, RangeLengths};
pub use plan::{Chunk, ChunkCursor, ChunkPlan, DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES};
pub use prepared::{
    EARLY_PART_MIN_PAIRS, MAX_PREPARED, MAX_PREPARED_ENTRIES, MAX_PREPARED_LISTS, PreparedEntry,
    PreparedInfo, RemoteList, SEAL_MIN_BLOCKS,
};
pub use ranges::{Ranges, ReadPairs};
pub use transfer::{EntrySpec, Outcome, PeerIdx, ReadSpec, TransferId, TransferKind, WriteSpec};
pub use wire::{Malformed, Offer, PeerMsg, ReadBlocks, ReadPair, RemoteRange, ReturnedCredits};

/// A registered buffer as the engine knows it: its size, key and users.
#[derive(Debug, Clone)]
struct BufferMeta {
    size: u64,
    key: [u8; 16],
    users: u32,
    /// Someone waits for its last user to end (`Action::BufferIdle`).
    watched: bool,
    /// Where it is (`set_buffer_memory`; host memory by default): picks a routed pairing's lanes;
    /// GPU memory is told to peers when `gpu_credits` is on.
    memory: topology::Memory,
}

/// A queued or posted chunk: which offer it serves and where its bytes are.
#[derive(Debug, Clone, Copy)]
struct Item {
    offer: u64,
    buffer: u64,
    /// Where the bytes are in `buffer`; with `pieces`, the chunk's offset in its offer's wire
    /// stream instead (the pieces come from the offer's plan).
    offset: u64,
    len: u32,
    /// A block or coalesced chunk of several pieces: gathered (send) or scattered (receive).
    pieces: bool,
}

/// Where one announced eager chunk goes: `dest` (buffer, offset), or nowhere (discarded).
#[derive(Debug, Clone, Copy)]
struct Target {
    offer: u64,
    /// With `pieces`, (buffer, the chunk's offset in its offer's wire stream).
    dest: Option<(u64, u64)>,
    len: u32,
    pieces: bool,
}

#[derive(Debug, Default)]
struct Lane {
    /// Requests may be posted: the lane's comm is open and not closing (`life` is `Open`).
    ready: bool,
    /// Where the lane is in its life (`lane_life.rs`): closed, opening, open, closing.
    life: lane_life::Life,
    queue: VecDeque<Item>,
    posted: VecDeque<Item>,
    /// Eager send lanes: credits held, of those the peer announced.
    send_credits: SendCredits,
    /// Eager receive lanes: credit receives posted and holding no data (with `landed` and
    /// `unpacking`: every receive posted on the lane), and credits owed to the peer.
    recv_credits: RecvCredits,
    /// Eager receive lanes: chunks announced by headers whose data has not completed yet, in
    /// lane order.
    targets: VecDeque<Target>,
    /// Eager receive lanes: completed receives waiting for their header (when each landed).
    landed: VecDeque<Instant>,
    /// Eager receive lanes: chunks handed to the driver (`Land`) and not yet consumed.
    unpacking: VecDeque<Target>,
    bytes: u64,
    chunks: u64,
    window_full: u64,
    /// The window is full and chunks wait (counted once per episode in `window_full`).
    stalled: bool,
}

/// How a peer receives, from its `ReceiveMode`.
#[derive(Debug, Clone, Copy)]
struct RemoteMode {
    /// Credits per eager lane (0: rendezvous on every lane).
    credits: u32,
    /// The largest chunk its credit receives take.
    chunk_bytes: u32,
    /// Our send lanes from this one on are its eager lanes (the lane count: none).
    eager_from: u32,
    /// The largest transfer it wants eager (when it has rendezvous lanes too).
    eager_max: u64,
}

#[derive(Debug)]
struct Peer {
    node_id: String,
    failed: Option<String>,
    /// Live, closing or closed when idle (`pair_life.rs`).
    life: PairLife,
    /// When idle: quiet since (noted by a scan), the activity seen then, and how often
    /// pairings with this node closed when idle (`pair_life.rs`).
    idle: pair_life::Idle,
    send: Vec<Lane>,
    recv: Vec<Lane>,
    /// The lanes of each direction that held work: what the scans for work walk (`lane_use.rs`).
    send_used: lane_use::LanesInUse,
    recv_used: lane_use::LanesInUse,
    /// Where the next transfer's chunks start, as an offset inside the rendezvous lanes and
    /// inside the eager lanes (each protocol rotates over its own lanes).
    next_lane: u32,
    next_eager_lane: u32,
    /// Our receive lanes from this one on keep credits (the lane count: none).
    eager_from: u32,
    /// The size of our credit receives towards this peer: `chunk_bytes`, or with lanes split
    /// (auto) only as large as the largest eager transfer needs (`eager_max_bytes` rounded up to
    /// 4 KiB), so the landing slots of an eager lane take 16 x 64 KiB by default, not 16 x 512 KiB.
    credit_bytes: u32,
    /// How the peer receives (`None` until its `ReceiveMode` arrived).
    remote: Option<RemoteMode>,
    /// Offers waiting for the peer's `ReceiveMode`, in order.
    waiting: Vec<u64>,
    /// The peer's credit lanes land in GPU memory (`PeerMsg::GpuCredits`): its byte budget per
    /// lane (`None`: it did not say; no byte budget, no credits at any size).
    remote_gpu_budget: Option<u64>,
    /// The peer's buffers it said are GPU memory (at most `MAX_GPU_DESTS`), with their GPU
    /// ordinal when it said.
    gpu_dests: HashMap<u64, Option<u32>>,
    /// Our streamed headers towards this peer with chunks still to announce, oldest first.
    streams: VecDeque<u64>,
    transfers_started: u64,
    transfers_ok: u64,
    transfers_failed: u64,
    sent_eager: u64,
    sent_rendezvous: u64,
    received_eager: u64,
    received_rendezvous: u64,
    /// Notifications alone (`notice.rs`) sent to and received from the peer.
    sent_notices: u64,
    received_notices: u64,
    /// Inline transfers (`inline.rs`) sent to and received from the peer, the peer's inline
    /// limit (0 until its `InlineLimit`: never inline), and our inline bytes it has not
    /// answered yet (bytes; and how many of them touch GPU memory: `inline_gpu_in_flight`).
    sent_inline: u64,
    received_inline: u64,
    remote_inline_max: u64,
    inline_outstanding: u64,
    inline_gpu_outstanding: u64,
    /// Our offers towards the peer not yet dropped, and how many of them went inline: the rest
    /// hold or wait for lanes, and a GPU transfer goes inline only while none does (`inline.rs`).
    offers_open: u64,
    inline_open: u64,
    /// The peer's topology as it announced it at pairing (`None` until the driver set it).
    topology: Option<topology::Topology>,
    /// Lanes by memory pair (`routes.rs`); `None`: not routed.
    routes: Option<routes::PeerRoutes>,
    /// Where the next routed offer we accept starts inside its group's lanes.
    next_routed_lane: u32,
    /// The layout lanes of each direction: how each side receives (its eager split). A routed
    /// pairing's lanes are the catalogue's, not these (`routes.rs`).
    send_layout: u32,
    recv_layout: u32,
}

impl Peer {
    /// This node's other open offers to the peer not carried inline (the one being planned,
    /// counted in `offers_open`, left out): whether a transfer has the lanes to itself.
    fn others_on_lanes(&self) -> u64 {
        self.offers_open.saturating_sub(self.inline_open + 1)
    }

    /// This node's receive lanes that carry rendezvous transfers, and those that keep credits.
    fn recv_split(&self) -> (Range<u32>, Range<u32>) {
        let n = self.recv_layout;
        (0..self.eager_from, self.eager_from..n)
    }

    /// Our send lanes towards the peer's rendezvous receives, and towards its credits (both
    /// empty until its `ReceiveMode` came).
    fn send_split(&self) -> (Range<u32>, Range<u32>) {
        let n = self.send_layout;
        match self.remote {
            Some(r) => (0..r.eager_from, r.eager_from..n),
            None => (0..0, 0..0),
        }
    }
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
    /// The lanes its chunk plan rotates over (its protocol's lanes).
    lanes: Range<u32>,
    /// The message, kept until it is sent (the peer's receive mode decides offer or header).
    msg: Option<Offer>,
    /// Sent as an eager header: the sends go out within credits, no accept.
    eager: bool,
    accepted: bool,
    /// Remaining chunks go out with zero length.
    cancelled: bool,
    /// Cancelled with the peer told, its `CancelSeen` not yet here: the chunks still queued
    /// wait (`wire::PeerMsg::CancelSeen` says why) and the offer is kept.
    held: bool,
    /// Chunks queued or posted and not yet reported sent.
    unfinished: u64,
    done: bool,
    /// Every send completed: the source buffers are free again (released before `Done`, so a
    /// client that releases them right after its transfer ended is not refused).
    sent: bool,
    /// A block or coalesced offer: its sources as one side's plan over the wire stream (the
    /// chunks are those of one range of its total), in the buffer `sources[0].0`.
    plan: Option<blocks::SidePlan>,
    /// A streamed header: where its chunk plan stands (`streams.rs`).
    stream: Option<streams::Stream>,
    /// Sent inline (`inline.rs`): its payload's bytes, counted in the peer's inline window
    /// until the offer is dropped.
    inline_bytes: u64,
    /// Sent inline touching GPU memory (`inline.rs`): counted in the peer's GPU inline bound
    /// (`inline_gpu_in_flight`) until the offer is dropped.
    inline_gpu: bool,
    /// Sent inline from GPU memory, its payload still being copied out (`inline.rs`): the
    /// message is not framed yet, so a cancel only marks it (`Engine::on_inline_gathered`).
    gathering: bool,
    /// Serving a READ whose reader said every destination is host memory (`inline.rs`).
    host_dests: bool,
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
    /// What the notification names: the sender's transfer id, or the offer id when the sender
    /// did not say (`Offer::transfer_id` 0).
    notify_id: u64,
    /// A block or coalesced offer: its destinations as this side's plan over the wire stream,
    /// in the buffer `dests[0].0`.
    plan: Option<blocks::SidePlan>,
    /// A streamed header: its lengths and where its chunk plan stands (`streams.rs`).
    stream: Option<Box<streams::InStream>>,
}

/// A READ part: one peer's share of a local READ.
#[derive(Debug)]
struct ReadPart {
    peer: PeerIdx,
    transfer: TransferId,
    entries: Vec<usize>,
    /// The destinations asked for (in our buffers): the holder's offer must carry them back.
    dests: Ranges,
    /// A block READ: the header the holder's offer must carry back (our list, indices, lengths).
    blocks: Option<Box<blocks::BlockHeader>>,
    /// The peer's offer serving this read, once it arrived and was accepted.
    offer: Option<u64>,
    cancelled: bool,
}

#[derive(Debug)]
struct Transfer {
    kind: TransferKind,
    total: u64,
    done_bytes: u64,
    /// Bytes confirmed end to end (`Outcome::landed`): a WRITE's offers the receiver reported
    /// done, a READ's chunks consumed here.
    landed: u64,
    entries: Vec<Option<(Code, String)>>,
    /// Out-offer ids (WRITE) or read ids (READ) not yet complete.
    pending_parts: usize,
    parts: Vec<u64>,
    deadline: Instant,
    running: bool,
    peers: Vec<PeerIdx>,
    /// The outcome's `entries` stays empty: every entry has the transfer's status (a plain
    /// batch sent as packed ranges, `Engine::report_one_status`).
    one_status: bool,
}

/// The state machine.
#[derive(Debug)]
pub struct Engine {
    cfg: EngineConfig,
    buffers: idhash::IdMap<u64, BufferMeta>,
    /// Every pairing not released yet (`release.rs`): the live ones and, per node, the newest
    /// failed one, plus failed ones transfers still name.
    peers: PeerMap,
    next_peer: u32,
    /// This node's topology (`set_topology`): routes pairings' rendezvous lanes (`routes.rs`).
    topology: Option<topology::Topology>,
    /// Failed pairings waiting to be released once nothing names them.
    dying: Vec<PeerIdx>,
    /// Per node: the counters of its released pairings, added up (the metrics count over every
    /// pairing a node had).
    retired: BTreeMap<String, PeerCounters>,
    out_offers: idhash::IdMap<u64, OutOffer>,
    in_offers: HashMap<(PeerIdx, u64), InOffer>,
    reads: idhash::IdMap<u64, ReadPart>,
    transfers: idhash::IdMap<TransferId, Transfer>,
    deadlines: BTreeSet<(Instant, TransferId)>,
    next_transfer: u64,
    next_offer: u64,
    next_read: u64,
    /// A drain under way (`drain.rs`).
    drain: Option<drain::Drain>,
    /// The block lists registered here (`block_transfers.rs`).
    lists: blocks::BlockRegistry,
    /// The prepared lists kept here (`prepared/`).
    prepared: prepared::PreparedRegistry,
    actions: VecDeque<Action>,
    /// The peers this batch of actions already asked to be written to at once
    /// ([`Action::SendNow`], once a peer and batch: `completion.rs`); emptied as the batch ends.
    sent_now: Vec<PeerIdx>,
    /// Inline payloads a driver copies to or from GPU memory asynchronously, with the buffers
    /// each keeps in use until it reports the copy's end (`inline.rs`).
    inline_copies: HashMap<inline::InlineCopy, Vec<u64>>,
    /// When `on_tick` next looks for idle lanes and lanes slow to open (`lane_life.rs`).
    next_lane_scan: Option<Instant>,
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
            buffers: Default::default(),
            peers: PeerMap::default(),
            next_peer: 0,
            topology: None,
            dying: Vec::new(),
            retired: BTreeMap::new(),
            out_offers: Default::default(),
            in_offers: HashMap::new(),
            reads: Default::default(),
            transfers: Default::default(),
            deadlines: BTreeSet::new(),
            next_transfer: 1,
            next_offer: 1,
            next_read: 1,
            drain: None,
            lists: blocks::BlockRegistry::default(),
            prepared: prepared::PreparedRegistry::default(),
            actions: VecDeque::new(),
            sent_now: Vec::new(),
            next_lane_scan: None,
            inline_copies: HashMap::new(),
        }
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The lanes this node opens towards each peer, and which are eager.
    pub fn layout(&self) -> LaneLayout {
        LaneLayout::of(&self.cfg)
    }

    /// The next thing the driver must do.
    pub fn poll_action(&mut self) -> Option<Action> {
        if self.actions.is_empty() {
            // Credits go back once per batch of actions, after the receives were re-posted.
            self.flush_credits();
            self.release_dead();
            self.sent_now.clear();
        }
        self.actions.pop_front()
    }

    // ---- peers --------------------------------------------------------------------------------

    /// Adds a peer with `send_lanes` lanes towards it and `recv_lanes` from it (not ready yet).
    pub fn add_peer(&mut self, node_id: &str, send_lanes: u32, recv_lanes: u32) -> PeerIdx {
        self.add_peer_lanes(node_id, send_lanes, recv_lanes, send_lanes, recv_lanes)
    }

    /// A pairing whose layout (how each side receives: `send_lanes`, `recv_lanes`) may differ
    /// from the lanes it has (`send_alloc`, `recv_alloc`: on a routed pairing the catalogue's).
    fn add_peer_lanes(
        &mut self,
        node_id: &str,
        send_lanes: u32,
        recv_lanes: u32,
        send_alloc: u32,
        recv_alloc: u32,
    ) -> PeerIdx {
        // Never one still in use (only after 2^32 pairings could the counter come round to one).
        while self.peers.contains_key(&PeerIdx(self.next_peer)) {
            self.next_peer = self.next_peer.wrapping_add(1);
        }
        let idx = PeerIdx(self.next_peer);
        self.next_peer = self.next_peer.wrapping_add(1);
        let eager_from = match self.cfg.protocol {
            Protocol::Rendezvous => recv_lanes,
            Protocol::Eager => 0,
            Protocol::Auto => recv_lanes.saturating_sub(self.layout().eager_lanes()),
        };
        let credit_bytes = if eager_from > 0 && eager_from < recv_lanes && !self.gpu_credits() {
            let needed =
                self.cfg.eager_max_bytes.div_ceil(u64::from(MIN_CHUNK_BYTES)) * u64::from(MIN_CHUNK_BYTES);
            needed.min(u64::from(self.cfg.chunk_bytes)) as u32
        } else {
            self.cfg.chunk_bytes
        };
        self.peers.insert(
            idx,
            Peer {
                node_id: node_id.to_string(),
                failed: None,
                life: PairLife::Live,
                idle: pair_life::Idle::default(),
                send: (0..send_alloc).map(|_| Lane::default()).collect(),
                recv: (0..recv_alloc).map(|_| Lane::default()).collect(),
                send_used: Default::default(),
                recv_used: Default::default(),
                next_lane: 0,
                next_eager_lane: 0,
                eager_from,
                credit_bytes,
                remote: None,
                waiting: Vec::new(),
                remote_gpu_budget: None,
                gpu_dests: HashMap::new(),
                streams: VecDeque::new(),
                transfers_started: 0,
                transfers_ok: 0,
                transfers_failed: 0,
                sent_eager: 0,
                sent_rendezvous: 0,
                received_eager: 0,
                received_rendezvous: 0,
                sent_notices: 0,
                received_notices: 0,
                sent_inline: 0,
                received_inline: 0,
                remote_inline_max: 0,
                inline_outstanding: 0,
                inline_gpu_outstanding: 0,
                offers_open: 0,
                inline_open: 0,
                topology: None,
                routes: None,
                next_routed_lane: 0,
                send_layout: send_lanes,
                recv_layout: recv_lanes,
            },
        );
        self.adopt_closed(idx);
        self.announce_gpu_credits(idx);
        self.announce_inline(idx);
        self.announce_mode(idx);
        idx
    }

    /// Records the topology a peer announced at pairing (checked: `Topology::from_summary`).
    pub fn set_peer_topology(&mut self, peer: PeerIdx, topology: topology::Topology) {
        if let Some(p) = self.peers.get_mut(&peer) {
            p.topology = Some(topology);
        }
    }

    /// The topology a peer announced at pairing.
    pub fn peer_topology(&self, peer: PeerIdx) -> Option<&topology::Topology> {
        self.peers.get(&peer).and_then(|p| p.topology.as_ref())
    }

    pub fn peer_node(&self, peer: PeerIdx) -> Option<&str> {
        self.peers.get(&peer).map(|p| p.node_id.as_str())
    }

    /// Whether a receive lane from a peer keeps credits (this node's protocol and lane split).
    pub fn recv_lane_is_eager(&self, peer: PeerIdx, lane: u32) -> bool {
        self.peers.get(&peer).is_some_and(|p| p.recv_lane_eager(lane))
    }

    /// A lane's comm is ready: sends (`send == true`) or receives can be posted (from any state:
    /// a driver may open its lanes before it needs them, as the engine tests do).
    pub fn on_lane_ready(&mut self, peer: PeerIdx, lane: u32, send: bool) {
        if let Some(p) = self.peers.get_mut(&peer) {
            p.mark_used(lane, send);
            let lanes = if send { &mut p.send } else { &mut p.recv };
            if let Some(l) = lanes.get_mut(lane as usize) {
                l.set_life(lane_life::Life::OPEN);
                if !send {
                    self.post_credits(peer, lane);
                }
            }
        }
        self.pump(peer);
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

    /// Requests posted to the plugin across all lanes that carry a transfer's bytes (sends,
    /// receives): eager credit receives still waiting for data are not counted.
    pub fn posted(&self) -> (usize, usize) {
        self.peers.values().fold((0, 0), |(s, r), p| {
            (
                s + p.send.iter().map(|l| l.posted.len()).sum::<usize>(),
                r + p
                    .recv
                    .iter()
                    .map(|l| l.posted.len() + l.landed.len() + l.unpacking.len())
                    .sum::<usize>(),
            )
        })
    }

    /// True when nothing is queued, posted or waiting on a peer.
    pub fn is_idle(&self) -> bool {
        self.transfers.is_empty()
            && self.out_offers.is_empty()
            && self.in_offers.is_empty()
            && self.inline_copies.is_empty()
            && self.reads.is_empty()
            && self.peers.values().all(|p| {
                p.send.iter().chain(&p.recv).all(|l| {
                    l.queue.is_empty()
                        && l.posted.is_empty()
                        && l.targets.is_empty()
                        && l.landed.is_empty()
                        && l.unpacking.is_empty()
                })
            })
    }

    /// True when no posted request carries a transfer's bytes and no header announced data still
    /// to come: the poller then has nothing to test and parks on its command channel (commands
    /// and control messages, headers included, wake it). Idle credit receives do not count.
    pub fn lanes_idle(&self) -> bool {
        self.peers.values().all(|p| {
            p.lanes_in_use().all(|l| {
                l.posted.is_empty() && l.targets.is_empty() && l.landed.is_empty() && l.unpacking.is_empty()
            })
        })
    }
}

fn check_bounds(
    offset_field: &str,
    length_field: &str,
    what: &str,
    size: u64,
    offset: u64,
    len: u64,
) -> EngineResult<()> {
    match range_fault(offset_field, length_field, what, size, offset, len) {
        Some(message) => Err(EngineError::invalid(message)),
        None => Ok(()),
    }
}

/// Why `offset..offset+len` does not fit a `size`-byte buffer (`what`: "buffer 3", "the remote
/// buffer"), naming the field at fault: the length when it alone is more than the buffer holds
/// (at offset 0 too), else the offset. `None` when the range fits.
pub fn range_fault(
    offset_field: &str,
    length_field: &str,
    what: &str,
    size: u64,
    offset: u64,
    len: u64,
) -> Option<String> {
    let field = if len > size { length_field } else { offset_field };
    match range_end(offset, len) {
        None => Some(format!(
            "{field}: the range of {what} at offset {offset}, {len} bytes long, overflows 64 bits"
        )),
        Some(end) if end <= size => None,
        Some(_) if len > size => Some(format!(
            "{field}: {len} bytes is more than {what} holds ({size} bytes): past the end at any offset"
        )),
        Some(_) if offset >= size => Some(format!(
            "{field}: {offset} is past the end of {what} ({size} bytes)"
        )),
        Some(end) => Some(format!(
            "{field}: {len} bytes from offset {offset} end at {end}, past the end of {what} ({size} bytes; {} fit there)",
            size - offset
        )),
    }
}

/// Converts a remaining-time budget to an absolute deadline.
pub fn deadline_after(now: Instant, budget: Duration) -> Instant {
    now.checked_add(budget)
        .unwrap_or(now + Duration::from_secs(86400 * 365))
}

#[cfg(test)]
mod tests;
