//! The poller: the one thread that calls the plugin's data path (and, with it, owns every comm
//! and the engine). Commands come in over a channel; progress, final statuses and notifications
//! go out through tokio `watch` and `broadcast` channels; control messages for peers through one
//! unbounded channel per peer.
//!
//! Each pass it: looks (a zero-timeout `epoll_wait`, when it has any) which direct control
//! sockets have bytes and reads them itself (`direct.rs`), takes the peers' messages and the commands
//! (for at most [`COMMAND_SLICE`]: the rest wait for the next pass),
//! drives connect/accept of lanes being set up, executes the
//! engine's actions (posting sends and receives as the windows allow) — then has the engine plan
//! a slice of what a large prepared READ left after its early first part went out
//! (`Engine::plan_pending`) and executes those too —, tests only the head of
//! each comm, unpacks completed receives (host unpacker) and consumes them in ring order, and
//! checks deadlines. With bytes in flight it spins, then yields at every pass, and naps only after
//! a stall of 2 ms; with nothing in flight it parks in `epoll_wait` on the command channel's
//! eventfd and its direct sockets (`park.rs`: no CPU; a command or a peer's control message
//! wakes it at once, one wake-up), after lingering 1 ms since its last progress when
//! `runtime.spin` is on (traffic flowing: the next transfer finds it awake); while it carries out
//! a command it holds the async worker awake, so the messages a long command makes are sent by a
//! running thread. See `crate::idle`.
//!
//! This file holds the types, the thread's start and join, and the pass loop (`run`);
//! `commands.rs` carries out each [`Command`], `peers.rs` sets pairings up and tears everything
//! down (drain, shutdown), `drive.rs` the passes that drive the comms (connect and accept, test,
//! consume), turn what they report into completions and say whether bytes are in flight (`busy`), `actions.rs` executes the engine's
//! actions (one method each), `posting.rs` what they post to the plugin (registration windows, deferred sends and receives, landing slots, unpacks),
//! `blocks.rs` its block chunks. What the poller reports of its pairings (`PeerLink`, `PeerStats`,
//! `StatsSnapshot`) is `crate::peer_stats`, below the metrics that read it.
//!
//! # State
//! The thread owns the engine, the comms and the pairings' direct sockets; nothing is shared
//! but the command channel ([`PollerTx`]) and what goes out. Where it waits and who wakes it
//! (awake, napping, parked in epoll) is `park.rs`'s `Bell`, which also argues why a command
//! sent while the poller is between its last look and its wait is never missed.
//!
//! # Shutdown
//! A drain (`Command::Drain`) ends the thread once the engine says it is drained; the channel's
//! end (every [`PollerTx`] dropped: the last one rings) fails what is left and closes every comm
//! (`peers.rs`, `shutdown_now`).

use crate::net::host_copies::HostCopies;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::mpsc::{self, TryRecvError};
use std::time::{Duration, Instant};

use tokio::sync::{broadcast, oneshot, watch};

use crate::buffers::BufferEntry;
use crate::engine::blocks::Layout;
use crate::engine::{
    BlockSpec, Engine, EngineConfig, EngineError, EntrySpec, Outcome, PackedBatch, PeerIdx, PeerMsg,
    PreparedEntry, PreparedInfo, RemoteList, TransferId, TransferKind,
};
use crate::idle::{Backoff, LINGER, Pace, Step};
use crate::metrics::Meter;
use crate::net::{Connector, ListenComm, MemHandle, Plugin, RecvComm, SendComm};
use crate::unpack::UnpackImpl;

mod actions;
mod blocks;
mod closer;
mod commands;
mod direct;
mod drive;
mod inline;
mod inline_copies;
mod lane_life;
mod park;
mod peers;
mod posting;

use crate::lanes::{GpuStage, RecvQueue, Tag};
pub use crate::peer_stats::{PeerLink, PeerStats, StatsSnapshot};
pub use direct::{Decode, DirectConn, MAX_UNSENT};
pub use park::PollerTx;
pub use posting::{WINDOW_LEN, WINDOW_STRIDE};

/// One lane a node receives on, as the handshake announces it (its handle comes on the control
/// stream when the lane is first used: peer protocol 6).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneInfo {
    pub lane: u32,
    pub device: i32,
}

/// What a peer announced of its topology at pairing (checked): its NICs and GPUs and its lanes
/// per route as a receiver, from which the pairing's routed lanes follow (`engine::routes`).
#[derive(Debug, Clone)]
pub struct PeerTopology {
    pub topology: crate::engine::topology::Topology,
    pub lanes_per_route: u32,
}

/// Where a transfer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Offered,
    Running,
    Finished,
}

/// A transfer's status, published on its watch channel.
#[derive(Debug, Clone)]
pub struct TransferStatus {
    pub phase: Phase,
    pub bytes_done: u64,
    pub total: u64,
    pub outcome: Option<Outcome>,
    pub started: Instant,
    pub finished_at: Option<Instant>,
}

/// Data from a peer landed with a notification attached.
#[derive(Debug, Clone)]
pub struct NotificationEvent {
    pub from_node: String,
    /// The peer's transfer that carried it.
    pub transfer_id: u64,
    pub payload: Vec<u8>,
    pub buffers: Vec<u64>,
}

/// What the poller puts on a peer's control stream: an engine message, or the marker after
/// which its engine messages go on the pairing's direct control connection (`direct.rs`).
#[derive(Debug)]
pub enum ControlOut {
    Msg(PeerMsg),
    DirectSwitch,
}

/// The channels a peer's async side gives the poller.
pub struct PeerChannels {
    pub control: tokio::sync::mpsc::UnboundedSender<ControlOut>,
    pub link: watch::Sender<PeerLink>,
}

pub use crate::engine::DrainReport;

type Reply<T> = oneshot::Sender<T>;

/// A plain WRITE's or READ's entries as the API hands them over: an engine entry each, or one
/// buffer pair packed (the API's `BatchRanges`: no entry objects, one status for all).
#[derive(Debug)]
pub enum Batch {
    Entries(Vec<EntrySpec>),
    Packed(PackedBatch),
}

impl Batch {
    /// The local buffers the entries read from or write to (once for a packed batch).
    pub fn local_buffers(&self) -> Vec<u64> {
        match self {
            Batch::Entries(s) => s.iter().map(|s| s.local_buffer).collect(),
            Batch::Packed(b) => vec![b.local_buffer],
        }
    }
}

pub enum Command {
    AddBuffer {
        entry: Arc<BufferEntry>,
        reply: Reply<Result<(), EngineError>>,
    },
    /// Several buffers at once, each with the block lists registered on it (a local client's
    /// registrations that came together): per buffer, its lists' facts or why it was refused.
    AddBuffers {
        items: Vec<(Arc<BufferEntry>, Vec<Layout>)>,
        reply: Reply<Vec<AddedBuffer>>,
    },
    RemoveBuffer {
        id: u64,
        reply: Reply<Result<(), EngineError>>,
    },
    /// Several buffers at once (a local client's `release_batch`): per id, in order, what
    /// `RemoveBuffer` would answer.
    RemoveBuffers {
        ids: Vec<u64>,
        reply: Reply<Vec<Result<(), EngineError>>>,
    },
    /// Answers once no transfer uses the buffer (at once when none does): the engine's
    /// `Action::BufferIdle`.
    WhenBufferIdle {
        id: u64,
        reply: Reply<()>,
    },
    /// Replaces a buffer's access key: offers naming the old one are refused from now on.
    RekeyBuffer {
        id: u64,
        key: [u8; 16],
        reply: Reply<Result<(), EngineError>>,
    },
    /// Initiator side: describe the lanes the peer will send on (none is listened for yet: each
    /// is on first use; the prepared id only pairs this with `CompletePeer`).
    PrepareLanes {
        reply: Reply<Result<(u64, Vec<LaneInfo>), String>>,
    },
    /// Initiator side: the handshake failed; close the listening comms prepared for it.
    DropPrepared {
        prepared: u64,
    },
    /// Initiator side: the handshake answered; connect to the peer's lanes.
    CompletePeer {
        prepared: u64,
        node_id: String,
        remote: Vec<LaneInfo>,
        /// The peer's topology from its handshake (checked).
        topology: PeerTopology,
        channels: PeerChannels,
        reply: Reply<Result<PeerIdx, String>>,
    },
    /// Callee side: a handshake arrived; add the pairing, its lanes closed until first use.
    AcceptPeer {
        node_id: String,
        remote: Vec<LaneInfo>,
        topology: PeerTopology,
        channels: PeerChannels,
        reply: Reply<Result<(PeerIdx, Vec<LaneInfo>), String>>,
    },
    Write {
        batch: Batch,
        notification: Vec<u8>,
        deadline: Instant,
        reply: Reply<Result<(TransferId, watch::Receiver<TransferStatus>), EngineError>>,
    },
    Read {
        batch: Batch,
        deadline: Instant,
        reply: Reply<Result<(TransferId, watch::Receiver<TransferStatus>), EngineError>>,
    },
    /// Registers a block list inside a buffer.
    RegisterBlocks {
        buffer: u64,
        layout: Layout,
        /// The id of a list re-attached after a restart; `None`: a new id.
        reattach: Option<u64>,
        reply: Reply<Result<ListFacts, EngineError>>,
    },
    /// New block-list and prepared-list ids start at these at the lowest (the state
    /// directory's floors: ids of earlier instances are never reused).
    StartIdsAt {
        lists: u64,
        prepared: u64,
    },
    ReleaseBlocks {
        list: u64,
        reply: Reply<Result<(), EngineError>>,
    },
    /// A list's facts, with its buffer's current key (NOT_FOUND when unknown).
    DescribeBlocks {
        list: u64,
        reply: Reply<Result<ListFacts, EngineError>>,
    },
    WriteBlocks {
        spec: BlockSpec,
        notification: Vec<u8>,
        deadline: Instant,
        reply: Reply<Result<BlocksStarted, Refused<BlockSpec>>>,
    },
    ReadBlocks {
        spec: BlockSpec,
        deadline: Instant,
        reply: Reply<Result<BlocksStarted, Refused<BlockSpec>>>,
    },
    /// A block transfer between two lists of this node (two clients of one daemon): checked and
    /// turned into byte ranges by the engine; the API copies them (`api/same_node.rs`).
    PlanSameNodeBlocks {
        local_list: u64,
        local_indices: crate::engine::blocks::IndexArray,
        remote: crate::engine::RemoteBlocks,
        write: bool,
        reply: Reply<Result<crate::engine::SameNodePlan, EngineError>>,
    },
    /// Prepares a list over other clients' lists of this node, by their tokens.
    PrepareSameNode {
        lists: Vec<RemoteList>,
        entries: Vec<PreparedEntry>,
        reply: Reply<Result<PreparedInfo, EngineError>>,
    },
    /// A prepared transfer whose remote list is of this node (`PrepareSameNode`): planned into
    /// byte ranges for the API to copy.
    PlanSameNodePrepared {
        transfer: PreparedTransfer,
        write: bool,
        reply: Reply<Result<crate::engine::SameNodePlan, EngineError>>,
    },
    /// Prepares a list over block lists of this node (docs/BLOCKS.md, "Prepared lists").
    PrepareLocal {
        reattach: Option<u64>,
        lists: Vec<u64>,
        entries: Vec<PreparedEntry>,
        reply: Reply<Result<PreparedInfo, EngineError>>,
    },
    /// Prepares a list over block lists of the node of pairing `peer`.
    PrepareRemote {
        reattach: Option<u64>,
        peer: PeerIdx,
        lists: Vec<RemoteList>,
        entries: Vec<PreparedEntry>,
        reply: Reply<Result<PreparedInfo, EngineError>>,
    },
    ReleasePrepared {
        id: u64,
        reply: Reply<Result<(), EngineError>>,
    },
    /// A WRITE or READ by prepared entries.
    StartPrepared {
        kind: TransferKind,
        transfer: PreparedTransfer,
        deadline: Instant,
        reply: Reply<Result<BlocksStarted, Refused<PreparedTransfer>>>,
    },
    Cancel {
        id: TransferId,
        reply: Reply<bool>,
    },
    Message {
        peer: PeerIdx,
        msg: PeerMsg,
    },
    /// A peer's offer or read request that could not be read: the engine refuses it.
    Malformed {
        peer: PeerIdx,
        request: crate::engine::Malformed,
    },
    PeerDown {
        peer: PeerIdx,
        reason: String,
    },
    /// A pairing's direct control connection, set up (the callee's after the caller presented
    /// its token, the caller's after the callee's answer): `direct.rs`.
    DirectControl {
        peer: PeerIdx,
        conn: DirectConn,
    },
    /// The peer's control stream ended or broke: the pairing fails, or, once the peer switched
    /// to a direct connection, when that ends (`direct.rs`, `stream_ended`).
    ControlStreamEnded {
        peer: PeerIdx,
        reason: String,
    },
    /// The peer's `DirectSwitch` came on its control stream (after every engine message it sent
    /// there): its next ones come on the direct connection.
    DirectSwitch {
        peer: PeerIdx,
    },
    Stats {
        reply: Reply<StatsSnapshot>,
    },
    /// Finish in-flight transfers until `deadline`, fail the rest, then stop the thread.
    Drain {
        deadline: Instant,
        reply: Reply<DrainReport>,
    },
}

/// A transfer by prepared entries, as the API parsed it.
#[derive(Debug, Clone)]
pub struct PreparedTransfer {
    pub local: u64,
    pub local_indices: Vec<u32>,
    pub remote: u64,
    pub remote_indices: Vec<u32>,
    pub notification: Vec<u8>,
}

/// A block transfer the poller started: its id, its status channel and the bytes it moves.
pub type BlocksStarted = (TransferId, watch::Receiver<TransferStatus>, u64);

/// One buffer of [`Command::AddBuffers`]: refused, or added with each of its lists registered
/// or refused.
pub type AddedBuffer = Result<Vec<Result<ListFacts, EngineError>>, EngineError>;
/// A start the engine refused. `again`: the request, handed back when it was refused only
/// because its pairing closed when idle or is closing (`EngineError::closed_pairing`), to be
/// started again once paired anew (`api/dial.rs`, `after_idle_close`) without copying its index
/// arrays.
#[derive(Debug)]
pub struct Refused<T> {
    pub error: EngineError,
    pub again: Option<T>,
}

impl<T> From<EngineError> for Refused<T> {
    fn from(error: EngineError) -> Self {
        Refused { error, again: None }
    }
}

/// What the API hands out about a block list (its token's fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListFacts {
    pub id: u64,
    pub buffer: u64,
    pub count: u32,
    /// Every block's length when they are all equal, else 0.
    pub block_len: u32,
    /// The buffer's current access key.
    pub key: [u8; 16],
}

/// Settings the poller needs.
#[derive(Debug, Clone)]
pub struct PollerConfig {
    pub engine: EngineConfig,
    /// How receives into GPU memory are unpacked (`UCCL_TCPX_UNPACK_IMPL`).
    pub unpack_impl: UnpackImpl,
    /// The devices the lanes use, in the engine's lane layout's order (`engine.devices` of them).
    pub devices: Vec<i32>,
    /// Which NIC(s) serve each GPU: each lane's comm is opened under a GPU its NIC serves.
    pub topology: Arc<crate::engine::topology::Topology>,
    pub connect_timeout: Duration,
    /// Where transfer, unpack and plugin-error events are counted.
    pub metrics: Arc<crate::metrics::Metrics>,
    /// `runtime.spin`: keep polling for [`LINGER`] after the last progress before parking, and
    /// tell this of every pass that made progress (it keeps an async worker awake meanwhile).
    pub warmth: Option<Arc<crate::idle::Warmth>>,
    /// With a state directory: where the receive comms' flow-steering rules are recorded.
    pub rx_rules: Option<Arc<crate::rx_rules::RuleBook>>,
    /// Helper threads for block chunks' host gathers and scatters (`transfer.host_copy_threads`;
    /// 0: the poller copies alone).
    pub host_copy_threads: usize,
    /// How the helpers spin and copy (`transfer.host_copy_spin_us`, `host_copy_spinners`,
    /// `host_copy_routine`, `host_copy_split`).
    pub host_copy: crate::net::host_copies::HelperPolicy,
}

/// The running poller thread.
pub struct PollerHandle {
    tx: PollerTx,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl PollerHandle {
    /// Starts the thread.
    pub fn start(
        plugin: Arc<Plugin>,
        cfg: PollerConfig,
        notifications: broadcast::Sender<NotificationEvent>,
    ) -> std::io::Result<PollerHandle> {
        let (tx, rx) = mpsc::channel();
        let (park, tx) = park::Park::new(tx)?;
        let unpack_impl = cfg.unpack_impl;
        let host_copies = HostCopies::with_policy(cfg.host_copy_threads, cfg.host_copy);
        let meter = Meter::new(cfg.metrics.clone());
        let thread = std::thread::Builder::new()
            .name("tcpxd-poller".into())
            .spawn(move || {
                Poller {
                    engine: {
                        let mut e = Engine::new(cfg.engine.clone());
                        e.set_topology((*cfg.topology).clone());
                        e
                    },
                    plugin,
                    cfg,
                    rx,
                    buffers: HashMap::new(),
                    peers: BTreeMap::new(),
                    prepared: HashMap::new(),
                    next_prepared: 1,
                    transfers: HashMap::new(),
                    progress: HashMap::new(),
                    notifications,
                    drain: None,
                    idle_waiters: HashMap::new(),
                    stages: HashMap::new(),
                    unpack_impl,
                    host_copies,
                    inline_copies: Default::default(),
                    completions: Vec::new(),
                    meter,
                    segs: Vec::new(),
                    direct_broken: Vec::new(),
                    direct_pending: Vec::new(),
                    answers: Vec::new(),
                    landed_in_actions: false,
                    park,
                    direct_ready: Vec::new(),
                    inbound: VecDeque::new(),
                    read_buf: vec![0; direct::READ_BUF],
                }
                .run()
            })?;
        Ok(PollerHandle {
            tx,
            thread: Some(thread),
        })
    }

    /// Sends a command; `false` when the poller has stopped.
    pub fn send(&self, cmd: Command) -> bool {
        self.tx.send(cmd).is_ok()
    }

    pub fn sender(&self) -> PollerTx {
        self.tx.clone()
    }

    /// Waits for the thread to end (after a drain).
    pub fn join(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

enum SendLaneState {
    Connecting(Connector, Instant),
    Ready(SendComm),
    Closed,
}

enum RecvLaneState {
    Accepting(ListenComm, Instant),
    Ready(RecvComm),
    Closed,
}

struct SendLane {
    device: i32,
    /// The GPU made current at each connect call (one its NIC serves; `None`: no GPU).
    gpu: Option<u32>,
    state: SendLaneState,
    /// Registrations by (buffer, window).
    handles: HashMap<(u64, u64), MemHandle>,
    /// Posts the plugin could not take yet, whose gather is still running, or held while the
    /// plugin has `send_window` of the lane's sends (gathered ahead), in order.
    deferred: VecDeque<blocks::SendPost>,
    tag: Tag,
    /// Block chunks: the staging rings gathers write into (one per memory kind, made on first
    /// use) and the gathers so far (slot `n % (send_window + gather_ahead)`).
    staging: blocks::SendStaging,
}

struct RecvLane {
    device: i32,
    /// The GPU made current at listen and each accept call: its bounce memory and flow-steering
    /// rules are this GPU's (one its NIC serves; `None`: no GPU).
    gpu: Option<u32>,
    state: RecvLaneState,
    /// Registrations by (buffer, window).
    handles: HashMap<(u64, u64), MemHandle>,
    /// Posted receives, then completed ones being unpacked, in ring order; consumed from the
    /// front once ready.
    queue: RecvQueue<Posted, Landing>,
    deferred: VecDeque<blocks::RecvPost>,
    /// Eager: the landing slots credit receives are posted into (host memory, registered on
    /// this comm once), and how many credit receives were posted so far (slot `n % credits`).
    landing_slots: Option<MemHandle>,
    /// The landing registration is CUDA memory on the lane's GPU (`transfer.gpu_credits`):
    /// every credit receive names its start, whatever its size, and lands in bounce pages.
    landing_on_gpu: bool,
    credit_seq: u64,
    /// Block chunks: the host landing ring of scattered receives into host memory and the
    /// pinned segment tables of GPU scatters (one per ring slot).
    scatter: blocks::RecvScatter,
    /// The flow-steering rules the plugin installed for this lane's comm, recorded in the state
    /// directory (src/rx_rules.rs). Last: dropped after the comm, whose close removed them.
    rules: Option<crate::rx_rules::Recorded>,
}

impl RecvLane {
    /// The GPU this receive lane's comm was listened and accepted under (its bounce memory's):
    /// the one place the credit machinery asks (the lane model may change under it).
    fn lane_gpu(&self) -> Option<u32> {
        self.gpu
    }
}

/// The buffer id of a credit receive's landing slot (no client buffer has it).
pub(super) const LANDING: u64 = u64::MAX;

/// A posted receive: where its bytes go.
#[derive(Debug, Clone, Copy)]
struct Posted {
    buffer: u64,
    offset: u64,
    /// A block chunk: where its bytes go once received.
    scatter: Option<blocks::ScatterTo>,
    /// The offer whose chunk it receives: unpacked only while `Engine::recv_lands` says so.
    /// `None` for an eager credit receive (its `Land` decides) and a receive posted into the
    /// lane's own place for a transfer that ended (`PostDropRecv`: never unpacked).
    offer: Option<u64>,
}

/// A completed receive waiting for its unpack before `irecvConsumed`.
#[derive(Debug)]
struct Landing {
    /// When the plugin reported the receive complete, and when its data was in place (copied
    /// at once on the host).
    landed: Instant,
    unpacked: Option<Instant>,
    /// Unpacked by host copies (at once, or on a copy helper), not on a GPU.
    on_host: bool,
}

struct PeerSlot {
    node_id: String,
    control: tokio::sync::mpsc::UnboundedSender<ControlOut>,
    /// The pairing's direct control connection, once set up (`direct.rs`).
    direct: Option<direct::DirectLink>,
    /// When the peer's control stream ended while its messages came on the direct connection.
    stream_ended: Option<(Instant, String)>,
    link: watch::Sender<PeerLink>,
    send: Vec<SendLane>,
    recv: Vec<RecvLane>,
    /// The lanes of each direction ever opened on this pairing, which the passes walk (a routed
    /// pairing has hundreds of lanes, a workload uses a few: `engine::lane_use`); only grows.
    send_opened: Vec<usize>,
    recv_opened: Vec<usize>,
    /// The peer's first control message came: the pairing is up (`PeerLink::Up`).
    up: bool,
    failed: bool,
}

struct Poller {
    plugin: Arc<Plugin>,
    cfg: PollerConfig,
    engine: Engine,
    rx: mpsc::Receiver<Command>,
    buffers: HashMap<u64, Arc<BufferEntry>>,
    /// Every pairing the engine keeps (it says when one is released: `Action::ReleasePeer`).
    peers: BTreeMap<PeerIdx, PeerSlot>,
    prepared: HashMap<u64, Vec<ListenComm>>,
    next_prepared: u64,
    transfers: HashMap<TransferId, watch::Sender<TransferStatus>>,
    /// Progress the current batch of actions reported, published at its end (`actions.rs`).
    progress: HashMap<TransferId, (u64, u64, bool)>,
    notifications: broadcast::Sender<NotificationEvent>,
    /// Who waits for the drain's end (the engine decides it).
    drain: Option<Reply<DrainReport>>,
    /// Callers waiting for a buffer's last user to end (`Command::WhenBufferIdle`).
    idle_waiters: HashMap<u64, Vec<Reply<()>>>,
    /// Unpack stages by GPU ordinal, made when the GPU's first buffer is registered (or by its first
    /// receive, if that failed).
    stages: HashMap<usize, GpuStage>,
    unpack_impl: UnpackImpl,
    /// Block chunks' host copies on helper threads (`net::host_copies`): queued whole per chunk.
    host_copies: HostCopies,
    inline_copies: inline_copies::InlineCopies,
    /// Scratch for the completions gathered during a pass.
    completions: Vec<Completion>,
    meter: Meter,
    /// Scratch for a block chunk's pieces (reused: nothing allocated per chunk).
    segs: Vec<crate::engine::blocks::Segment>,
    /// Pairings whose direct control connection broke (or whose peer broke its protocol),
    /// failed at the end of the pass (`direct.rs`, `flush_direct`).
    direct_broken: Vec<(PeerIdx, String)>,
    /// Pairings whose direct connection has messages framed in this batch of actions, not sent
    /// yet (`direct.rs`, `send_direct`).
    direct_pending: Vec<PeerIdx>,
    /// Answers to the commands that started transfers, sent at the end of the pass
    /// (`commands.rs`, `answer_later`): the transfer's first messages and posts go out before
    /// the API's task is woken.
    answers: Vec<Box<dyn FnOnce() + Send>>,
    /// The batch of actions just run landed eager chunks (`drive.rs`, `consume_landed`).
    landed_in_actions: bool,
    /// Where the poller waits: epoll on the channel's eventfd and the direct sockets (`park.rs`).
    park: park::Park,
    /// Direct sockets epoll reported readable, read at the start of the next pass.
    direct_ready: Vec<mio::Token>,
    /// The peers' messages read from direct sockets, handled with the commands (in order per
    /// connection, under the same [`COMMAND_SLICE`]).
    inbound: VecDeque<Command>,
    /// Scratch for a direct socket's read.
    read_buf: Vec<u8>,
}

impl Drop for Poller {
    fn drop(&mut self) {
        // Before any field goes (the peers' comms, whose bounce pages a queued host copy may
        // still read, are declared first): every queued copy ends. The shutdown quiesced
        // already; this covers leaving `run` any other way (a panic).
        self.host_copies.quiesce();
    }
}

/// Plugin completions gathered during a pass, applied to the engine afterwards.
enum Completion {
    SendDone(PeerIdx, u32),
    RecvConsumed(PeerIdx, u32, Result<(), String>),
    /// An eager credit receive completed (its destination comes with its header).
    Landed(PeerIdx, u32),
    LaneReady(PeerIdx, u32, bool),
    Failed(PeerIdx, String),
}

/// How long one pass may spend carrying out commands before it runs the actions they made and
/// tests the lanes; the commands left wait for the next pass. A batch of expensive ones (a
/// NIXL pull's 64 block offers or read requests arriving together, each checked and planned in
/// ~10–20 µs) would otherwise hold back the first part's accept or offer, and every posted
/// request's completion, until the last is planned; cheap ones (a whole batch of small
/// transfers) still go in one pass.
pub(crate) const COMMAND_SLICE: Duration = Duration::from_micros(50);

impl Poller {
    fn run(mut self) {
        tracing::debug!("poller started");
        self.park.bind_thread();
        let mut backoff = Backoff::with(match self.cfg.warmth {
            Some(_) => Pace::POLL,
            None => Pace::POLL_SHARED,
        });
        // The last pass (or command) that made progress: the poller lingers after it.
        let mut last_progress = Instant::now();
        // The wait that ended the last pass looked at the sockets already.
        let mut looked = false;
        loop {
            if !looked && self.reads_direct() {
                self.park.look(Some(Duration::ZERO), &mut self.direct_ready);
            }
            looked = false;
            let mut progressed = self.read_direct();
            let slice = Instant::now();
            loop {
                let cmd = match self.inbound.pop_front() {
                    Some(cmd) => cmd,
                    None => match self.rx.try_recv() {
                        Ok(cmd) => cmd,
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => return self.shutdown_now(),
                    },
                };
                progressed = true;
                self.handle_held(cmd);
                if slice.elapsed() >= COMMAND_SLICE {
                    break;
                }
            }
            progressed |= self.drive_setup();
            progressed |= self.run_actions();
            // A large prepared READ's first read request is on its way now: a slice of the rest
            // of its parts (engine::prepared's plan; more each pass, offers taken between).
            if self.engine.plan_pending() {
                progressed = true;
                self.run_actions();
            }
            progressed |= self.test_lanes();
            self.engine.on_tick(Instant::now());
            progressed |= self.run_actions();
            // Eager chunks landed by those actions and unpacked at once: consumed in this pass,
            // their transfers' ends sent with it.
            if self.consume_landed() {
                progressed = true;
                self.run_actions();
            }
            progressed |= self.flush_direct();
            self.send_answers();
            if self.check_drain() {
                return;
            }
            if progressed {
                backoff.reset();
                last_progress = Instant::now();
                if let Some(w) = &self.cfg.warmth {
                    w.touch();
                }
                continue;
            }
            let lingering = self.cfg.warmth.is_some() && last_progress.elapsed() < LINGER;
            let wait = if self.busy() || lingering {
                // Bytes in flight, or traffic a moment ago: spin and yield; nap only once
                // stalled (a command still ends the nap at once).
                match backoff.step() {
                    Step::Nap(d) => park::Wait::Nap(d),
                    Step::Spun | Step::Yielded => continue,
                }
            } else {
                // Nothing in flight: park in epoll until a command, a peer's control message
                // or the next timer (none due: no timeout; park.rs, "State").
                backoff.reset();
                let now = Instant::now();
                let due = [self.engine.next_deadline(), self.stream_end_due()]
                    .into_iter()
                    .flatten()
                    .min();
                park::Wait::Park(due.map(|d| d.saturating_duration_since(now)))
            };
            match self.park.wait(wait, &self.rx, &mut self.direct_ready) {
                park::Woken::Command(cmd) => {
                    backoff.reset();
                    last_progress = Instant::now();
                    self.handle_held(cmd)
                }
                // The park's `epoll_wait` collected the readable sockets.
                park::Woken::Look => looked = matches!(wait, park::Wait::Park(_)),
                park::Woken::Disconnected => return self.shutdown_now(),
            }
        }
    }

    /// Carries out `cmd` with the async worker held awake ([`crate::idle::Warmth::hold`]): the
    /// messages it makes are sent by a running worker, however long it takes.
    fn handle_held(&mut self, cmd: Command) {
        let warmth = self.cfg.warmth.clone();
        let _held = warmth.as_deref().map(crate::idle::Warmth::hold);
        self.handle(cmd);
    }
}
