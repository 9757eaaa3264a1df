//! The poller: the one thread that calls the plugin's data path (and, with it, owns every comm
//! and the engine). Commands come in over a channel; progress, final statuses and notifications
//! go out through tokio `watch` and `broadcast` channels; control messages for peers through one
//! unbounded channel per peer.
//!
//! Each pass it: looks (a zero-timeout `epoll_wait`, when it has any) which direct control
//! sockets have bytes and reads them itself (`direct.rs`), takes the peers' messages and the commands
//! (for at most `COMMAND_SLICE`: the rest wait for the next pass),
//! drives connect/accept of lanes being set up, executes the
//! engine's actions (posting sends and receives as the windows allow) — then has the engine plan
//! a slice of what a large prepared READ left after its early first part went out
//! (`Engine::plan_pending`) and executes those too —, tests only the head of
//! each comm, unpacks completed receives (host unpacker) and consumes them in ring order,
//! executes the actions that made (an eager chunk's `Land`: its GPU unpack launched and, once
//! done, the chunk consumed in this pass, `drive.rs`'s `consume_landed`), and checks deadlines.
//! Every pass advances a per-thread count (`crate::lanes::next_pass`): the hop trace's `pass`. With bytes in flight it spins, then yields at every pass, and naps only after
//! a stall of 2 ms; with nothing in flight it parks in `epoll_wait` on the command channel's
//! eventfd and its direct sockets (`park.rs`: no CPU; a command or a peer's control message
//! wakes it at once, one wake-up), after lingering 1 ms since its last progress when
//! `runtime.spin` is on (traffic flowing: the next transfer finds it awake; an idle pass reads
//! the clock only for its phases); while it carries out
//! a command it holds the async worker awake, so the messages a long command makes are sent by a
//! running thread. See `crate::idle`.
//!
//! This file holds the thread's own state, its start and join, and the pass loop (`run`);
//! `interface.rs` the commands and the types the rest of the daemon exchanges with it;
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

use tokio::sync::{broadcast, watch};

use crate::buffers::BufferEntry;
use crate::engine::{Engine, PeerIdx, TransferId};
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
mod fast_starts;
mod inline;
mod inline_copies;
mod interface;
mod lane_life;
mod lane_thread;
mod park;
mod pass_clock;
mod peers;
mod posting;
mod rings;
mod session_thread;
mod sessions;
mod threaded_recv;

use crate::engine::idhash::IdMap;
use crate::lanes::{GpuStage, RecvQueue, Tag};
pub use crate::peer_stats::{PeerLink, PeerStats, StatsSnapshot};
use crate::status_watch;
pub use direct::{Decode, DirectConn, MAX_UNSENT};
pub use fast_starts::{FastStart, FastStarted, StartSink, queue as queue_fast_start};
pub use park::PollerTx;
use pass_clock::{ActionClock, PassClock, PassPhase, Sampler, TIMED_ONE_IN};
pub use posting::{WINDOW_LEN, WINDOW_STRIDE};
pub use rings::{RingWatch, RingWatching};
pub use sessions::{
    PASS_BUDGET, PassBudget, Rearm, SessionWatch, Watched, Watching, keep_off_here, on_poller_thread,
    serving_sessions_here,
};

pub use interface::*;

/// The running poller thread.
pub struct PollerHandle {
    tx: PollerTx,
    thread: Option<std::thread::JoinHandle<()>>,
    /// With `runtime.session_thread`: the sessions thread (`session_thread.rs`), ended by the
    /// poller's end.
    sessions: Option<std::thread::JoinHandle<()>>,
}

impl PollerHandle {
    /// Starts the thread.
    pub fn start(
        plugin: Arc<Plugin>,
        cfg: PollerConfig,
        notifications: broadcast::Sender<NotificationEvent>,
    ) -> std::io::Result<PollerHandle> {
        let (tx, rx) = mpsc::channel();
        let (park, tx, side) = park::Park::new(tx, cfg.serve_sessions, cfg.session_thread)?;
        // Closed when the poller's thread ends, however it ends (a panic too): the sessions
        // thread must not outlive it waiting (`PollerHandle::join` joins both).
        let closes = session_thread::CloseOnDrop(park.hub().cloned());
        let sessions = match side {
            Some(side) => Some(side.spawn(cfg.warmth.is_some())?),
            None => None,
        };
        let unpack_impl = cfg.unpack_impl;
        let host_copies = Arc::new(HostCopies::with_policy(cfg.host_copy_threads, cfg.host_copy));
        let meter = Meter::new(cfg.metrics.clone());
        let mut park = park;
        let lanes = match cfg.lane_thread {
            true => {
                let e = &cfg.engine;
                let setup = lane_thread::RecvSetup {
                    recv_window: e.recv_window,
                    landing: (e.recv_window + e.scatter_ahead).max(1) as u64,
                    unpack_impl,
                    copies: host_copies.clone(),
                };
                let t = lane_thread::LaneThreads::new(
                    park.bell(),
                    cfg.metrics.clone(),
                    cfg.warmth.is_some(),
                    setup,
                );
                park.watch_lanes(t.events.clone());
                Some(t)
            }
            false => None,
        };
        let thread = std::thread::Builder::new()
            .name("tcpxd-poller".into())
            .spawn(move || {
                // (dropped last: after the poller and its transfers' sinks)
                let _closes = closes;
                Poller {
                    engine: {
                        let mut e = Engine::new(cfg.engine.clone());
                        e.set_topology((*cfg.topology).clone());
                        e
                    },
                    plugin,
                    cfg,
                    rx,
                    buffers: IdMap::default(),
                    peers: BTreeMap::new(),
                    prepared: HashMap::new(),
                    next_prepared: 1,
                    transfers: IdMap::default(),
                    sinks: Default::default(),
                    progress: IdMap::default(),
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
                    action_clock: ActionClock::new(),
                    park,
                    direct_ready: Vec::new(),
                    inbound: VecDeque::new(),
                    read_buf: vec![0; direct::READ_BUF],
                    lanes,
                    lane_events: Vec::new(),
                    lands: HashMap::new(),
                    hub_starts: VecDeque::new(),
                    hub_answers: Vec::new(),
                    hub_writes: Vec::new(),
                    hub_unrung: false,
                }
                .run();
            })?;
        Ok(PollerHandle {
            tx,
            thread: Some(thread),
            sessions,
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
        if let Some(t) = self.sessions.take() {
            let _ = t.join();
        }
    }
}

enum SendLaneState {
    Connecting(Connector, Instant),
    Ready(SendComm),
    /// Connected, its comm driven by the lane thread (`runtime.lane_thread`, `lane_thread.rs`).
    Threaded(Threaded),
    Closed,
}

/// A send lane whose comm the lane thread drives: what the poller knows of it.
struct Threaded {
    /// Sends handed to the lane thread and not yet reported done (at most `send_window`).
    outstanding: usize,
    /// The comm's number in the hop trace.
    trace_id: usize,
}

enum RecvLaneState {
    Accepting(ListenComm, Instant),
    Ready(RecvComm),
    /// Accepted, its comm driven by the lane thread of its GPU (`runtime.lane_thread`,
    /// `lane_thread/recv.rs`): the poller hands it the receives and hears their ends.
    Threaded {
        /// The comm's number in the hop trace.
        trace_id: usize,
    },
    Closed,
}

struct SendLane {
    device: i32,
    /// The GPU made current at each connect call (one its NIC serves; `None`: no GPU).
    gpu: Option<u32>,
    state: SendLaneState,
    /// Which comm of the lane the lane thread drives: grows with each one handed over, so what
    /// it reports of an older one is ignored.
    epoch: u64,
    /// Registrations by (buffer, window).
    handles: HashMap<(u64, u64), MemHandle>,
    /// Posts the plugin could not take yet, whose gather is still running, or held while the
    /// plugin has `send_window` of the lane's sends (gathered ahead), in order.
    deferred: VecDeque<blocks::SendPost>,
    /// Sends the test after a post (`posting::post_sends`) found done, not yet reported to the
    /// engine: the next test pass reports them before what it finds itself.
    sent_early: u32,
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
    /// Which comm of the lane the lane thread drives (as `SendLane::epoch`).
    epoch: u64,
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
    /// Received into the lane's host landing ring at this offset: the slot is free once the
    /// receive is consumed.
    ring_slot: Option<u64>,
    /// A block chunk's receive (offer, wire offset), as `PostScatterRecv` named it: told to the
    /// engine by name when consumed (`Engine::on_scatter_consumed`), so it may be consumed
    /// before older receives of the lane whose copies are still running.
    chunk: Option<(u64, u64)>,
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
    buffers: IdMap<u64, Arc<BufferEntry>>,
    /// Every pairing the engine keeps (it says when one is released: `Action::ReleasePeer`).
    peers: BTreeMap<PeerIdx, PeerSlot>,
    prepared: HashMap<u64, Vec<ListenComm>>,
    next_prepared: u64,
    transfers: IdMap<TransferId, status_watch::Sender<TransferStatus>>,
    /// The transfers framed sessions started fast (`fast_starts.rs`): told their end directly.
    sinks: fast_starts::Sinks,
    /// Progress the current batch of actions reported, published at its end (`actions.rs`).
    progress: IdMap<TransferId, (u64, u64, bool)>,
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
    host_copies: Arc<HostCopies>,
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
    /// The actions phase's time by what ran, published at the end of each busy pass.
    action_clock: ActionClock,
    /// Where the poller waits: epoll on the channel's eventfd and the direct sockets (`park.rs`).
    park: park::Park,
    /// Direct sockets epoll reported readable, read at the start of the next pass.
    direct_ready: Vec<mio::Token>,
    /// The peers' messages read from direct sockets, handled with the commands (in order per
    /// connection, under the same [`COMMAND_SLICE`]).
    inbound: VecDeque<Command>,
    /// Scratch for a direct socket's read.
    read_buf: Vec<u8>,
    /// `runtime.lane_thread`: the threads driving the send lanes' comms (one per GPU).
    lanes: Option<lane_thread::LaneThreads>,
    /// Scratch for what the lane thread reported.
    lane_events: Vec<lane_thread::LaneEvent>,
    /// The offers whose receives went to a lane thread: whether they still land
    /// (`Engine::recv_lands`), cleared once the engine discards or ends them (`drive.rs`,
    /// `sweep_lands`).
    lands: HashMap<(PeerIdx, u64), lane_thread::Lands>,
    /// With a sessions thread (`session_thread.rs`): the starts taken from it, the answers and
    /// the batches' outboxes handed back to it (scratch, kept: nothing allocated a pass).
    hub_starts: VecDeque<FastStart>,
    hub_answers: Vec<session_thread::Answer>,
    hub_writes: Vec<Arc<crate::api::local::outbox::Outbox>>,
    /// Answers were handed to the sessions thread and it was not rung since.
    hub_unrung: bool,
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
    /// A block chunk's receive (offer, wire offset) consumed, in whatever order.
    ScatterConsumed(PeerIdx, u32, (u64, u64), Result<(), String>),
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
        // Each pass's time, busy or idle (`tcpxd_poller_pass_seconds_total`): how much of the
        // thread the work takes, apart from its polling and waits.
        let passes = self.meter.metrics.pass_counters();
        // One pass in `TIMED_ONE_IN` is timed by phase and action (`pass_clock.rs`).
        let mut sampler = Sampler::new();
        loop {
            crate::lanes::next_pass();
            let pass_start = Instant::now();
            let mut clock = PassClock::start(pass_start, sampler.next());
            self.action_clock.set_on(clock.timed());
            if !looked && (self.reads_direct() || self.park.serves_sessions()) {
                self.park.look(Some(Duration::ZERO), &mut self.direct_ready);
            }
            looked = false;
            let mut progressed = self.park.serve_sessions();
            // What the sessions just read, started on the engine now (`fast_starts.rs`).
            progressed |= self.take_fast_starts(true);
            progressed |= self.read_direct();
            clock.lap(PassPhase::Intake);
            let slice = clock.now();
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
            progressed |= self.take_fast_starts(false);
            clock.lap(PassPhase::Commands);
            progressed |= self.drive_setup();
            clock.lap(PassPhase::Setup);
            progressed |= self.run_actions();
            // A large prepared READ's first read request is on its way now: a slice of the rest
            // of its parts (engine::prepared's plan; more each pass, offers taken between).
            if self.engine.plan_pending() {
                progressed = true;
                self.run_actions();
            }
            clock.lap(PassPhase::Actions);
            progressed |= self.test_lanes();
            clock.lap(PassPhase::TestLanes);
            self.engine.on_tick(clock.now());
            clock.lap(PassPhase::Tick);
            progressed |= self.run_actions();
            clock.lap(PassPhase::Actions);
            // Eager chunks landed by those actions and unpacked at once: consumed in this pass,
            // their transfers' ends sent with it.
            if self.consume_landed() {
                progressed = true;
                self.run_actions();
            }
            clock.lap(PassPhase::Consume);
            progressed |= self.flush_direct();
            self.send_answers();
            // (a session polled by an answer or an end may have queued starts: none waits for
            // a park)
            progressed |= self.take_fast_starts(false);
            self.ring_sessions();
            if self.check_drain() {
                return;
            }
            clock.lap(PassPhase::Flush);
            let pass_end = clock.now();
            passes.pass(progressed, pass_end - pass_start);
            if progressed && clock.timed() {
                // A timed pass stands for `TIMED_ONE_IN` (`pass_clock.rs`).
                let actions = self.action_clock.take();
                passes.busy_phases(&clock.spent().map(|d| d * TIMED_ONE_IN));
                passes.busy_actions(&actions.map(|d| d * TIMED_ONE_IN));
            } else if clock.timed() {
                self.action_clock.take();
            }
            // Actions run between passes (a command taken at a wake-up) are not timed: only a
            // timed pass's own count, each standing for `TIMED_ONE_IN`.
            self.action_clock.set_on(false);
            if progressed {
                backoff.reset();
                last_progress = pass_end;
                if let Some(w) = &self.cfg.warmth {
                    w.touch_at(pass_end);
                }
                continue;
            }
            let lingering = self.cfg.warmth.is_some() && pass_end - last_progress < LINGER;
            let wait = if self.busy() || lingering {
                // Bytes in flight, or traffic a moment ago: spin and yield; nap only once
                // stalled (a command still ends the nap at once). The linger keeps yielding:
                // a `sched_yield` with no other thread on the CPU is a few hundred ns, and a
                // poller that never yields keeps a client or a plugin thread that shares its
                // CPU off it for a scheduler slice (session 28, ping).
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
                park::Woken::Ring => {}
                park::Woken::Disconnected => return self.shutdown_now(),
            }
        }
    }

    /// With a sessions thread: the answers handed this pass without a look since, served here
    /// if it is parked (`session_thread.rs`, `Hub::served_if_parked`).
    fn ring_sessions(&mut self) {
        if std::mem::take(&mut self.hub_unrung)
            && let Some(hub) = self.park.hub()
        {
            hub.served_if_parked(&mut self.hub_answers, &mut self.hub_writes);
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
