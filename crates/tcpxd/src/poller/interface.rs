//! What the rest of the daemon hands the poller and gets back from it: the commands
//! ([`Command`], carried out in `commands.rs`), their replies and the types they carry (lanes,
//! topology, transfer statuses, notifications, batches, prepared transfers), and the poller's
//! configuration ([`PollerConfig`]). The thread itself is `mod.rs`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, watch};

use crate::buffers::BufferEntry;
use crate::engine::blocks::Layout;
use crate::engine::{
    BlockSpec, EngineConfig, EngineError, EntrySpec, Outcome, PackedBatch, PeerIdx, PeerMsg, PreparedEntry,
    PreparedInfo, RemoteList, TransferId, TransferKind,
};
use crate::status_watch;
use crate::unpack::UnpackImpl;

use super::{DirectConn, PeerLink, StatsSnapshot};

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

pub(super) type Reply<T> = oneshot::Sender<T>;

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
        reply: Reply<Result<(TransferId, status_watch::Receiver<TransferStatus>), EngineError>>,
    },
    Read {
        batch: Batch,
        deadline: Instant,
        reply: Reply<Result<(TransferId, status_watch::Receiver<TransferStatus>), EngineError>>,
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
pub type BlocksStarted = (TransferId, status_watch::Receiver<TransferStatus>, u64);

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
    /// `runtime.spin`: keep polling for [`crate::idle::LINGER`] after the last progress before parking, and
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
    /// `runtime.poller_sessions`: framed sessions' requests are read on this thread (`sessions.rs`).
    pub serve_sessions: bool,
    /// `runtime.lane_thread`: the send lanes' comms are driven by a lane thread
    /// (`lane_thread.rs`), not this one.
    pub lane_thread: bool,
    /// `runtime.session_thread`: with `serve_sessions`, on a thread of their own instead
    /// (`session_thread.rs`).
    pub session_thread: bool,
}
