//! The poller: the one thread that calls the plugin's data path (and, with it, owns every comm
//! and the engine). Commands come in over a channel; progress, final statuses and notifications
//! go out through tokio `watch` and `broadcast` channels; control messages for peers through one
//! unbounded channel per peer.
//!
//! Each pass it: takes commands, drives connect/accept of lanes being set up, executes the
//! engine's actions (posting sends and receives as the windows allow), tests only the head of
//! each comm, unpacks completed receives (host unpacker) and consumes them in ring order, and
//! checks deadlines. With nothing in flight it parks on the command channel (no CPU); with
//! requests in flight it spins briefly, then yields, then naps 50 µs at a time.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};

use tokio::sync::{broadcast, oneshot, watch};

use crate::buffers::BufferEntry;
use crate::engine::{
    Action, Code, Engine, EngineConfig, EngineError, Outcome, PeerCounters, PeerIdx, PeerMsg, ReadSpec,
    TransferId, WriteSpec,
};
use crate::gpu::Gpu;
use crate::metrics::{Meter, Op};
use crate::net::{ConnectHandle, Connector, ListenComm, MemHandle, Plugin, RecvComm, RequestId, SendComm};
use crate::unpack::{Ticket, UnpackImpl, UnpackJob, Unpacker};

/// One lane's listening side, as exchanged in the handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaneHandleInfo {
    pub lane: u32,
    pub device: i32,
    pub handle: ConnectHandle,
}

/// A peer's link state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerLink {
    Connecting,
    Up,
    Failed(String),
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
    pub offer_id: u64,
    pub payload: Vec<u8>,
    pub buffers: Vec<u64>,
}

/// The channels a peer's async side gives the poller.
pub struct PeerChannels {
    pub control: tokio::sync::mpsc::UnboundedSender<PeerMsg>,
    pub link: watch::Sender<PeerLink>,
}

/// Counters for GetStats.
#[derive(Debug, Clone)]
pub struct PeerStats {
    pub counters: PeerCounters,
    pub link: PeerLink,
    pub send_devices: Vec<i32>,
    pub recv_devices: Vec<i32>,
}

#[derive(Debug, Clone)]
pub struct StatsSnapshot {
    pub peers: Vec<PeerStats>,
    pub active_transfers: usize,
}

/// What a drain did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainReport {
    pub finished_in_grace: usize,
    pub failed_at_deadline: usize,
}

type Reply<T> = oneshot::Sender<T>;

pub enum Command {
    AddBuffer {
        entry: Arc<BufferEntry>,
        reply: Reply<Result<(), EngineError>>,
    },
    RemoveBuffer {
        id: u64,
        reply: Reply<Result<(), EngineError>>,
    },
    /// Replaces a buffer's access key: offers naming the old one are refused from now on.
    RekeyBuffer {
        id: u64,
        key: [u8; 16],
        reply: Reply<Result<(), EngineError>>,
    },
    /// Initiator side: open listening comms for the lanes the peer will send on.
    PrepareLanes {
        reply: Reply<Result<(u64, Vec<LaneHandleInfo>), String>>,
    },
    /// Initiator side: the handshake failed; close the listening comms prepared for it.
    DropPrepared {
        prepared: u64,
    },
    /// Initiator side: the handshake answered; connect to the peer's lanes.
    CompletePeer {
        prepared: u64,
        node_id: String,
        remote: Vec<LaneHandleInfo>,
        channels: PeerChannels,
        reply: Reply<Result<PeerIdx, String>>,
    },
    /// Callee side: a handshake arrived; listen for the caller's lanes and connect to its own.
    AcceptPeer {
        node_id: String,
        remote: Vec<LaneHandleInfo>,
        channels: PeerChannels,
        reply: Reply<Result<(PeerIdx, Vec<LaneHandleInfo>), String>>,
    },
    Write {
        specs: Vec<WriteSpec>,
        notification: Vec<u8>,
        deadline: Instant,
        reply: Reply<Result<(TransferId, watch::Receiver<TransferStatus>), EngineError>>,
    },
    Read {
        specs: Vec<ReadSpec>,
        deadline: Instant,
        reply: Reply<Result<(TransferId, watch::Receiver<TransferStatus>), EngineError>>,
    },
    Cancel {
        id: TransferId,
        reply: Reply<bool>,
    },
    Message {
        peer: PeerIdx,
        msg: PeerMsg,
    },
    PeerDown {
        peer: PeerIdx,
        reason: String,
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

/// Settings the poller needs.
#[derive(Debug, Clone)]
pub struct PollerConfig {
    pub engine: EngineConfig,
    /// How receives into GPU memory are unpacked (`UCCL_TCPX_UNPACK_IMPL`).
    pub unpack_impl: UnpackImpl,
    pub devices: Vec<i32>,
    pub lanes_per_device: u32,
    pub connect_timeout: Duration,
    /// Where transfer, unpack and plugin-error events are counted.
    pub metrics: Arc<crate::metrics::Metrics>,
}

/// The running poller thread.
pub struct PollerHandle {
    tx: mpsc::Sender<Command>,
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
        let unpack_impl = cfg.unpack_impl;
        let meter = Meter::new(cfg.metrics.clone());
        let thread = std::thread::Builder::new()
            .name("tcpxd-poller".into())
            .spawn(move || {
                Poller {
                    engine: Engine::new(cfg.engine.clone()),
                    plugin,
                    cfg,
                    rx,
                    buffers: HashMap::new(),
                    peers: Vec::new(),
                    prepared: HashMap::new(),
                    next_prepared: 1,
                    transfers: HashMap::new(),
                    notifications,
                    drain: None,
                    finished_in_grace: 0,
                    stages: HashMap::new(),
                    unpack_impl,
                    completions: Vec::new(),
                    meter,
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

    pub fn sender(&self) -> mpsc::Sender<Command> {
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
    state: SendLaneState,
    /// Registrations by (buffer, window).
    handles: HashMap<(u64, u64), MemHandle>,
    /// Posts the plugin could not take yet, in order.
    deferred: VecDeque<(u64, u64, u32)>,
    tag: i32,
}

struct RecvLane {
    device: i32,
    state: RecvLaneState,
    /// Registrations by (buffer, window).
    handles: HashMap<(u64, u64), MemHandle>,
    /// Posted receives in ring order.
    posted: VecDeque<Posted>,
    /// Completed receives being unpacked, in ring order; consumed from the front once ready.
    landing: VecDeque<Landing>,
    deferred: VecDeque<(u64, u64, u32)>,
    tag: i32,
}

/// A posted receive: where its bytes go.
#[derive(Debug, Clone, Copy)]
struct Posted {
    id: RequestId,
    len: u32,
    buffer: u64,
    offset: u64,
}

/// A completed receive waiting for its unpack before `irecvConsumed`.
#[derive(Debug)]
struct Landing {
    id: RequestId,
    wait: Wait,
    /// When the plugin reported the receive complete, and when its data was in place.
    landed: Instant,
    unpacked: Option<Instant>,
}

#[derive(Debug)]
enum Wait {
    /// Unpacked (or nothing to unpack), with the outcome.
    Ready(Result<(), String>),
    /// In batch `batch` of GPU `gpu`'s unpacker; `len` bytes posted.
    Gpu { gpu: usize, batch: u64, len: u32 },
}

/// How a batch of GPU unpacks ended, for its receives.
#[derive(Debug)]
enum BatchEnd {
    Unpacked,
    /// The unpack stage failed (this batch and every later one).
    Failed(String),
    /// The kernel found a list read in place out of bounds (and skipped the fragment) or not
    /// adding up, in some receive of the batch (logged when found): the receive's own host check
    /// says whether it was this one.
    Rejected,
}

/// The unpack stage of one GPU: its unpacker and the batches in flight, oldest first.
struct GpuStage {
    gpu: Arc<Gpu>,
    unpacker: Box<dyn Unpacker>,
    /// The batch number receives pushed during this pass belong to.
    next_batch: u64,
    pushed: bool,
    in_flight: VecDeque<(u64, Option<Ticket>)>,
    /// Every batch up to this one has finished.
    done_upto: u64,
    /// A batch that failed on the GPU, and why: its receives (and later ones) fail.
    failed: Option<(u64, String)>,
    /// Batches with a rejected receive (`BatchEnd::Rejected`), recent ones only.
    rejected: std::collections::BTreeSet<u64>,
    /// Per other GPU holding bounce buffers: whether this GPU can read them (`reach_bounce`).
    peer_reach: HashMap<usize, Result<(), String>>,
}

struct PeerSlot {
    node_id: String,
    control: tokio::sync::mpsc::UnboundedSender<PeerMsg>,
    link: watch::Sender<PeerLink>,
    send: Vec<SendLane>,
    recv: Vec<RecvLane>,
    up: bool,
    failed: bool,
}

struct Poller {
    plugin: Arc<Plugin>,
    cfg: PollerConfig,
    engine: Engine,
    rx: mpsc::Receiver<Command>,
    buffers: HashMap<u64, Arc<BufferEntry>>,
    peers: Vec<PeerSlot>,
    prepared: HashMap<u64, Vec<ListenComm>>,
    next_prepared: u64,
    transfers: HashMap<TransferId, watch::Sender<TransferStatus>>,
    notifications: broadcast::Sender<NotificationEvent>,
    drain: Option<(Instant, Reply<DrainReport>)>,
    finished_in_grace: usize,
    /// Unpack stages by GPU ordinal, made when the first receive into that GPU completes.
    stages: HashMap<usize, GpuStage>,
    unpack_impl: UnpackImpl,
    /// Scratch for the completions gathered during a pass.
    completions: Vec<Completion>,
    meter: Meter,
}

/// Plugin completions gathered during a pass, applied to the engine afterwards.
enum Completion {
    SendDone(PeerIdx, u32),
    RecvConsumed(PeerIdx, u32, Result<(), String>),
    LaneReady(PeerIdx, u32, bool),
    Failed(PeerIdx, String),
}

/// The poller's idling while requests are in flight (the raw bench idles the same way).
pub(crate) const SPINS_BEFORE_YIELD: u32 = 64;
pub(crate) const YIELDS_BEFORE_NAP: u32 = 256;
pub(crate) const NAP: Duration = Duration::from_micros(50);
const PARK_MAX: Duration = Duration::from_secs(1);

impl Poller {
    fn run(mut self) {
        tracing::debug!("poller started");
        let mut idle = 0u32;
        loop {
            let mut progressed = false;
            loop {
                match self.rx.try_recv() {
                    Ok(cmd) => {
                        progressed = true;
                        self.handle(cmd);
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return self.shutdown_now(),
                }
            }
            progressed |= self.drive_setup();
            progressed |= self.run_actions();
            progressed |= self.test_lanes();
            self.engine.tick(Instant::now());
            progressed |= self.run_actions();
            if self.check_drain() {
                return;
            }
            if progressed {
                idle = 0;
                continue;
            }
            idle = idle.saturating_add(1);
            if self.busy() {
                if idle < SPINS_BEFORE_YIELD {
                    std::hint::spin_loop();
                } else if idle < YIELDS_BEFORE_NAP {
                    std::thread::yield_now();
                } else {
                    match self.rx.recv_timeout(NAP) {
                        Ok(cmd) => self.handle(cmd),
                        Err(RecvTimeoutError::Timeout) => {}
                        Err(RecvTimeoutError::Disconnected) => return self.shutdown_now(),
                    }
                }
            } else {
                // Nothing in flight: park until a command or the next deadline.
                let now = Instant::now();
                let wait = self
                    .engine
                    .next_deadline()
                    .map(|d| d.saturating_duration_since(now))
                    .unwrap_or(PARK_MAX)
                    .min(PARK_MAX);
                match self.rx.recv_timeout(wait) {
                    Ok(cmd) => {
                        idle = 0;
                        self.handle(cmd)
                    }
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return self.shutdown_now(),
                }
            }
        }
    }

    /// True while plugin requests are in flight or lanes are being set up.
    fn busy(&self) -> bool {
        self.peers.iter().any(|p| {
            p.send.iter().any(|l| match &l.state {
                SendLaneState::Connecting(..) => true,
                SendLaneState::Ready(c) => c.outstanding() > 0 || !l.deferred.is_empty(),
                SendLaneState::Closed => false,
            }) || p.recv.iter().any(|l| match &l.state {
                RecvLaneState::Accepting(..) => true,
                RecvLaneState::Ready(c) => {
                    c.outstanding() > 0 || !l.deferred.is_empty() || !l.landing.is_empty()
                }
                RecvLaneState::Closed => false,
            })
        })
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::AddBuffer { entry, reply } => {
                let r = self.engine.add_buffer(entry.id, entry.size, entry.key());
                if r.is_ok() {
                    self.buffers.insert(entry.id, entry);
                }
                let _ = reply.send(r);
            }
            Command::RekeyBuffer { id, key, reply } => {
                let _ = reply.send(self.engine.rekey_buffer(id, key));
            }
            Command::RemoveBuffer { id, reply } => {
                let r = self.engine.remove_buffer(id);
                if r.is_ok() {
                    self.buffers.remove(&id);
                    for p in &mut self.peers {
                        for l in &mut p.send {
                            l.handles.retain(|(b, _), _| *b != id);
                        }
                        for l in &mut p.recv {
                            l.handles.retain(|(b, _), _| *b != id);
                        }
                    }
                }
                let _ = reply.send(r);
            }
            Command::PrepareLanes { reply } => {
                let r = self.open_listens().map(|(listens, infos)| {
                    let id = self.next_prepared;
                    self.next_prepared += 1;
                    self.prepared.insert(id, listens);
                    (id, infos)
                });
                let _ = reply.send(r);
            }
            Command::DropPrepared { prepared } => {
                self.prepared.remove(&prepared);
            }
            Command::CompletePeer {
                prepared,
                node_id,
                remote,
                channels,
                reply,
            } => {
                let r = match self.prepared.remove(&prepared) {
                    None => Err("lane set-up expired".to_string()),
                    Some(listens) => self.add_peer(node_id, listens, remote, channels),
                };
                let _ = reply.send(r);
            }
            Command::AcceptPeer {
                node_id,
                remote,
                channels,
                reply,
            } => {
                let r = self.open_listens().and_then(|(listens, infos)| {
                    self.add_peer(node_id, listens, remote, channels)
                        .map(|idx| (idx, infos))
                });
                let _ = reply.send(r);
            }
            Command::Write {
                specs,
                notification,
                deadline,
                reply,
            } => {
                if self.drain.is_some() {
                    let _ = reply.send(Err(shutting_down()));
                    return;
                }
                let now = Instant::now();
                let total = specs.iter().map(|s| s.remote.length).sum();
                let r = self.engine.start_write(specs, notification, deadline, now);
                let _ = reply.send(r.map(|id| (id, self.track(id, Op::Write, total))));
            }
            Command::Read {
                specs,
                deadline,
                reply,
            } => {
                if self.drain.is_some() {
                    let _ = reply.send(Err(shutting_down()));
                    return;
                }
                let now = Instant::now();
                let total = specs.iter().map(|s| s.remote.length).sum();
                let r = self.engine.start_read(specs, deadline, now);
                let _ = reply.send(r.map(|id| (id, self.track(id, Op::Read, total))));
            }
            Command::Cancel { id, reply } => {
                let _ = reply.send(self.engine.cancel(id, Code::Cancelled, "cancelled by the client"));
            }
            Command::Message { peer, msg } => self.engine.on_message(peer, msg, Instant::now()),
            Command::PeerDown { peer, reason } => self.engine.peer_failed(peer, &reason),
            Command::Stats { reply } => {
                let _ = reply.send(self.stats());
            }
            Command::Drain { deadline, reply } => {
                self.drain = Some((deadline, reply));
            }
        }
    }

    fn track(&mut self, id: TransferId, op: Op, total: u64) -> watch::Receiver<TransferStatus> {
        self.meter.started(id, op, total);
        let (tx, rx) = watch::channel(TransferStatus {
            phase: Phase::Offered,
            bytes_done: 0,
            total: 0,
            outcome: None,
            started: Instant::now(),
            finished_at: None,
        });
        self.transfers.insert(id, tx);
        rx
    }

    fn lane_devices(&self) -> Vec<i32> {
        let lanes = self.cfg.devices.len() as u32 * self.cfg.lanes_per_device;
        (0..lanes)
            .map(|i| self.cfg.devices[(i as usize) % self.cfg.devices.len()])
            .collect()
    }

    fn open_listens(&mut self) -> Result<(Vec<ListenComm>, Vec<LaneHandleInfo>), String> {
        let mut listens = Vec::new();
        let mut infos = Vec::new();
        for (lane, dev) in self.lane_devices().into_iter().enumerate() {
            let l = self
                .plugin
                .listen(dev)
                .map_err(|e| format!("listen on device {dev}: {e}"))?;
            infos.push(LaneHandleInfo {
                lane: lane as u32,
                device: dev,
                handle: l.handle(),
            });
            listens.push(l);
        }
        Ok((listens, infos))
    }

    fn add_peer(
        &mut self,
        node_id: String,
        listens: Vec<ListenComm>,
        remote: Vec<LaneHandleInfo>,
        channels: PeerChannels,
    ) -> Result<PeerIdx, String> {
        if remote.is_empty() || remote.len() > 64 {
            return Err(format!(
                "the peer offered {} lanes (1 to 64 allowed)",
                remote.len()
            ));
        }
        let deadline = Instant::now() + self.cfg.connect_timeout;
        let devices = self.lane_devices();
        let mut send = Vec::new();
        for (i, r) in remote.iter().enumerate() {
            let dev = devices[i % devices.len()];
            let c = self
                .plugin
                .connector(dev, &r.handle)
                .map_err(|e| format!("connect lane {i} on device {dev}: {e}"))?;
            send.push(SendLane {
                device: dev,
                state: SendLaneState::Connecting(c, deadline),
                handles: HashMap::new(),
                deferred: VecDeque::new(),
                tag: 0,
            });
        }
        let recv = listens
            .into_iter()
            .map(|l| RecvLane {
                device: l.dev(),
                state: RecvLaneState::Accepting(l, deadline),
                handles: HashMap::new(),
                posted: VecDeque::new(),
                landing: VecDeque::new(),
                deferred: VecDeque::new(),
                tag: 0,
            })
            .collect::<Vec<_>>();
        let idx = self
            .engine
            .add_peer(&node_id, send.len() as u32, recv.len() as u32);
        debug_assert_eq!(idx.0 as usize, self.peers.len());
        tracing::info!(peer = %node_id, send_lanes = send.len(), recv_lanes = recv.len(), "peer lanes connecting");
        self.peers.push(PeerSlot {
            node_id,
            control: channels.control,
            link: channels.link,
            send,
            recv,
            up: false,
            failed: false,
        });
        Ok(idx)
    }

    /// Drives non-blocking connects and accepts of lanes being set up.
    fn drive_setup(&mut self) -> bool {
        // Reused every pass: no allocation on the hot path once it has grown.
        let mut events = std::mem::take(&mut self.completions);
        let now = Instant::now();
        let meter = &self.meter;
        for (pi, p) in self.peers.iter_mut().enumerate() {
            if p.failed {
                continue;
            }
            let peer = PeerIdx(pi as u32);
            for (li, l) in p.send.iter_mut().enumerate() {
                if let SendLaneState::Connecting(c, deadline) = &mut l.state {
                    match c.step() {
                        Ok(Some(comm)) => {
                            l.state = SendLaneState::Ready(comm);
                            events.push(Completion::LaneReady(peer, li as u32, true));
                        }
                        Ok(None) if now > *deadline => {
                            events.push(Completion::Failed(peer, format!("lane {li}: connect timed out")))
                        }
                        Ok(None) => {}
                        Err(e) => {
                            meter.metrics.plugin_error(&e);
                            events.push(Completion::Failed(peer, format!("lane {li}: {e}")))
                        }
                    }
                }
            }
            for (li, l) in p.recv.iter_mut().enumerate() {
                if let RecvLaneState::Accepting(listen, deadline) = &mut l.state {
                    match listen.accept_step() {
                        Ok(Some(comm)) => {
                            l.state = RecvLaneState::Ready(comm);
                            events.push(Completion::LaneReady(peer, li as u32, false));
                        }
                        Ok(None) if now > *deadline => {
                            events.push(Completion::Failed(peer, format!("lane {li}: accept timed out")))
                        }
                        Ok(None) => {}
                        Err(e) => {
                            meter.metrics.plugin_error(&e);
                            events.push(Completion::Failed(peer, format!("lane {li}: {e}")))
                        }
                    }
                }
            }
        }
        let progressed = !events.is_empty();
        self.apply(&mut events);
        self.completions = events;
        for p in &mut self.peers {
            if !p.up
                && !p.failed
                && p.send.iter().all(|l| matches!(l.state, SendLaneState::Ready(_)))
                && p.recv.iter().all(|l| matches!(l.state, RecvLaneState::Ready(_)))
            {
                p.up = true;
                tracing::info!(peer = %p.node_id, "peer up");
                let _ = p.link.send(PeerLink::Up);
            }
        }
        progressed
    }

    fn apply(&mut self, events: &mut Vec<Completion>) {
        for e in events.drain(..) {
            match e {
                Completion::SendDone(p, l) => self.engine.send_done(p, l),
                Completion::RecvConsumed(p, l, r) => self.engine.recv_consumed(p, l, r),
                Completion::LaneReady(p, l, send) => self.engine.lane_ready(p, l, send),
                Completion::Failed(p, why) => {
                    tracing::warn!(peer = %self.peers[p.0 as usize].node_id, "{why}");
                    self.engine.peer_failed(p, &why)
                }
            }
        }
    }

    /// Executes the engine's actions. Returns whether there were any.
    fn run_actions(&mut self) -> bool {
        let mut any = false;
        let mut failures = Vec::new();
        while let Some(a) = self.engine.poll_action() {
            any = true;
            match a {
                Action::Control { peer, msg } => {
                    let _ = self.peers[peer.0 as usize].control.send(msg);
                }
                Action::PostSend {
                    peer,
                    lane,
                    buffer,
                    offset,
                    len,
                } => {
                    let l = &mut self.peers[peer.0 as usize].send[lane as usize];
                    l.deferred.push_back((buffer, offset, len));
                    if let Err(why) = post_sends(l, &self.buffers) {
                        failures.push((peer, format!("lane {lane} send: {why}")));
                    }
                }
                Action::PostRecv {
                    peer,
                    lane,
                    buffer,
                    offset,
                    len,
                } => {
                    let l = &mut self.peers[peer.0 as usize].recv[lane as usize];
                    l.deferred.push_back((buffer, offset, len));
                    if let Err(why) = post_recvs(l, &self.buffers) {
                        failures.push((peer, format!("lane {lane} receive: {why}")));
                    }
                }
                Action::Progress {
                    transfer,
                    bytes_done,
                    total,
                    running,
                } => {
                    if let Some(tx) = self.transfers.get(&transfer) {
                        tx.send_modify(|s| {
                            s.bytes_done = bytes_done;
                            s.total = total;
                            if running && s.phase == Phase::Offered {
                                s.phase = Phase::Running;
                            }
                        });
                    }
                }
                Action::Finished { transfer, outcome } => {
                    if let Some(tx) = self.transfers.remove(&transfer) {
                        self.meter.finished(transfer, &outcome, tx.borrow().bytes_done);
                        if self.drain.is_some() && outcome.code == Code::Ok {
                            self.finished_in_grace += 1;
                        }
                        tx.send_modify(|s| {
                            s.phase = Phase::Finished;
                            s.outcome = Some(outcome);
                            s.finished_at = Some(Instant::now());
                        });
                    }
                }
                Action::Notify {
                    peer,
                    offer_id,
                    payload,
                    buffers,
                } => {
                    let _ = self.notifications.send(NotificationEvent {
                        from_node: self.peers[peer.0 as usize].node_id.clone(),
                        offer_id,
                        payload,
                        buffers,
                    });
                }
                Action::ClosePeer { peer, reason } => {
                    let p = &mut self.peers[peer.0 as usize];
                    p.failed = true;
                    // Tells the peer why, then ends the outbound control stream (its pump sees
                    // the channel close after sending what was queued).
                    let _ = p.control.send(PeerMsg::Goodbye {
                        reason: reason.clone(),
                    });
                    p.control = tokio::sync::mpsc::unbounded_channel().0;
                    for l in &mut p.send {
                        l.handles.clear();
                        l.deferred.clear();
                        l.state = SendLaneState::Closed;
                    }
                    for l in &mut p.recv {
                        l.handles.clear();
                        l.deferred.clear();
                        l.posted.clear();
                        l.landing.clear();
                        l.state = RecvLaneState::Closed;
                    }
                    tracing::warn!(peer = %p.node_id, "peer failed: {reason}");
                    let _ = p.link.send(PeerLink::Failed(reason));
                }
            }
        }
        for (p, why) in failures {
            self.engine.peer_failed(p, &why);
        }
        any
    }

    /// Tests the head of every comm; completes, unpacks and consumes what finished.
    fn test_lanes(&mut self) -> bool {
        let Poller {
            peers,
            buffers,
            stages,
            unpack_impl,
            meter,
            ..
        } = self;
        // Reused every pass: no allocation on the hot path once it has grown.
        let mut events = std::mem::take(&mut self.completions);
        for (pi, p) in peers.iter_mut().enumerate() {
            if p.failed {
                continue;
            }
            let peer = PeerIdx(pi as u32);
            for (li, l) in p.send.iter_mut().enumerate() {
                if !l.deferred.is_empty()
                    && let Err(why) = post_sends(l, buffers)
                {
                    events.push(Completion::Failed(peer, format!("lane {li} send: {why}")));
                    continue;
                }
                let SendLaneState::Ready(comm) = &mut l.state else {
                    continue;
                };
                while let Some(id) = comm.oldest() {
                    match comm.test(id) {
                        Ok(true) => events.push(Completion::SendDone(peer, li as u32)),
                        Ok(false) => break,
                        Err(e) => {
                            meter.metrics.plugin_error(&e);
                            events.push(Completion::Failed(peer, format!("lane {li} send: {e}")));
                            break;
                        }
                    }
                }
            }
            // Completed receives start their unpack, in ring order.
            for (li, l) in p.recv.iter_mut().enumerate() {
                if !l.deferred.is_empty()
                    && let Err(why) = post_recvs(l, buffers)
                {
                    events.push(Completion::Failed(peer, format!("lane {li} receive: {why}")));
                    continue;
                }
                let RecvLaneState::Ready(comm) = &mut l.state else {
                    continue;
                };
                while let Some(&posted) = l.posted.front() {
                    match comm.test(posted.id) {
                        Ok(Some(_)) => {
                            let landed = Instant::now();
                            let wait = start_unpack(comm, &posted, buffers, stages, *unpack_impl);
                            let unpacked = matches!(wait, Wait::Ready(_)).then(Instant::now);
                            l.posted.pop_front();
                            l.landing.push_back(Landing {
                                id: posted.id,
                                wait,
                                landed,
                                unpacked,
                            });
                        }
                        Ok(None) => break,
                        Err(e) => {
                            meter.metrics.plugin_error(&e);
                            events.push(Completion::Failed(peer, format!("lane {li} receive: {e}")));
                            break;
                        }
                    }
                }
            }
        }
        // One batch of GPU work per GPU for everything pushed in this pass; then what finished.
        for stage in stages.values_mut() {
            stage.advance();
        }
        // Consume what is unpacked, in ring order: only now are the pages returned.
        for (pi, p) in peers.iter_mut().enumerate() {
            if p.failed {
                continue;
            }
            let peer = PeerIdx(pi as u32);
            for (li, l) in p.recv.iter_mut().enumerate() {
                let RecvLaneState::Ready(comm) = &mut l.state else {
                    continue;
                };
                while let Some(front) = l.landing.front() {
                    let result = match &front.wait {
                        Wait::Ready(r) => r.clone(),
                        Wait::Gpu { gpu, batch, len } => {
                            match stages.get(gpu).and_then(|s| s.outcome(*batch)) {
                                None => break,
                                Some(BatchEnd::Unpacked) => Ok(()),
                                Some(BatchEnd::Failed(why)) => Err(why),
                                // The GPU rejected something in this batch: the receive's own list
                                // decides (still in the ring: not consumed yet).
                                Some(BatchEnd::Rejected) => check_list(comm, front.id, *len),
                            }
                        }
                    };
                    if let Err(e) = comm.consume(front.id) {
                        meter.metrics.plugin_error(&e);
                        events.push(Completion::Failed(peer, format!("lane {li} irecvConsumed: {e}")));
                        break;
                    }
                    let now = Instant::now();
                    let kind = if front.unpacked.is_some() { "host" } else { "gpu" };
                    let unpack = front.unpacked.unwrap_or(now) - front.landed;
                    meter.metrics.recv_consumed(kind, unpack, now - front.landed);
                    l.landing.pop_front();
                    events.push(Completion::RecvConsumed(peer, li as u32, result));
                }
            }
        }
        let progressed = !events.is_empty();
        self.apply(&mut events);
        self.completions = events;
        progressed
    }

    fn stats(&self) -> StatsSnapshot {
        StatsSnapshot {
            peers: self
                .peers
                .iter()
                .enumerate()
                .filter_map(|(i, p)| {
                    Some(PeerStats {
                        counters: self.engine.peer_counters(PeerIdx(i as u32))?,
                        link: p.link.borrow().clone(),
                        send_devices: p.send.iter().map(|l| l.device).collect(),
                        recv_devices: p.recv.iter().map(|l| l.device).collect(),
                    })
                })
                .collect(),
            active_transfers: self.engine.active_transfers(),
        }
    }

    /// During a drain: true when the thread should stop.
    fn check_drain(&mut self) -> bool {
        let Some((deadline, _)) = &self.drain else {
            return false;
        };
        let now = Instant::now();
        if self.engine.active_transfers() == 0 && (self.engine.is_idle() || now > *deadline) {
            let (_, reply) = self.drain.take().expect("set");
            let _ = reply.send(DrainReport {
                finished_in_grace: self.finished_in_grace,
                failed_at_deadline: 0,
            });
            self.shutdown_now();
            return true;
        }
        if now > *deadline {
            let ids = self.engine.active_transfer_ids();
            let failed = ids.len();
            for id in ids {
                self.engine.cancel(
                    id,
                    Code::Unavailable,
                    "the daemon is shutting down (grace period over)",
                );
            }
            self.run_actions();
            let (_, reply) = self.drain.take().expect("set");
            let _ = reply.send(DrainReport {
                finished_in_grace: self.finished_in_grace,
                failed_at_deadline: failed,
            });
            self.shutdown_now();
            return true;
        }
        false
    }

    /// Fails whatever is left and closes every comm.
    fn shutdown_now(&mut self) {
        for id in self.engine.active_transfer_ids() {
            self.engine
                .cancel(id, Code::Unavailable, "the daemon is shutting down");
        }
        self.run_actions();
        self.peers.clear();
        self.prepared.clear();
        tracing::debug!("poller stopped");
    }
}

fn shutting_down() -> EngineError {
    EngineError::new(Code::Unavailable, "the daemon is shutting down; no new transfers")
}

/// Buffers are registered in overlapping windows, because `regMr` takes an `int` size: window
/// `k` starts at `k * WINDOW_STRIDE` and is `WINDOW_STRIDE + MAX_CHUNK_BYTES` long (or up to the
/// buffer's end), so every chunk (at most 4 MiB) lies inside the window its offset falls in.
pub const WINDOW_STRIDE: u64 = 1 << 30;
pub const WINDOW_LEN: u64 = WINDOW_STRIDE + crate::engine::MAX_CHUNK_BYTES as u64;

/// The registration covering `[offset, offset + len)` of a buffer on one comm (made on first
/// use) and the offset inside it.
fn handle_for<'a>(
    handles: &'a mut HashMap<(u64, u64), MemHandle>,
    buffers: &HashMap<u64, Arc<BufferEntry>>,
    buffer: u64,
    offset: u64,
    register: impl FnOnce(Arc<dyn crate::net::Region>) -> Result<MemHandle, crate::net::NetError>,
) -> Result<(&'a MemHandle, u64), String> {
    let window = offset / WINDOW_STRIDE;
    let start = window * WINDOW_STRIDE;
    let mh = match handles.entry((buffer, window)) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => {
            let entry = buffers
                .get(&buffer)
                .ok_or_else(|| format!("buffer {buffer} vanished"))?;
            // The plugin registers CUDA memory in the context current on this thread.
            if let Some(gpu) = entry.gpu() {
                gpu.bind_to_thread().map_err(|e| e.to_string())?;
            }
            let len = WINDOW_LEN.min(entry.size - start);
            let region: Arc<dyn crate::net::Region> = if start == 0 && len == entry.size {
                entry.region_dyn()
            } else {
                Arc::new(
                    crate::net::RegionWindow::new(entry.region_dyn(), start as usize, len as usize)
                        .map_err(|e| e.to_string())?,
                )
            };
            v.insert(register(region).map_err(|e| e.to_string())?)
        }
    };
    Ok((mh, offset - start))
}

/// Posts deferred sends in order while the plugin takes them.
fn post_sends(l: &mut SendLane, buffers: &HashMap<u64, Arc<BufferEntry>>) -> Result<(), String> {
    let SendLaneState::Ready(comm) = &mut l.state else {
        return Ok(());
    };
    while let Some(&(buffer, offset, len)) = l.deferred.front() {
        let (mh, at) = handle_for(&mut l.handles, buffers, buffer, offset, |r| comm.register(r))?;
        l.tag = l.tag.wrapping_add(1) & 0x7fff_ffff;
        match comm
            .isend(mh, at as usize, len as usize, l.tag)
            .map_err(|e| e.to_string())?
        {
            Some(_) => {
                l.deferred.pop_front();
            }
            None => break,
        }
    }
    Ok(())
}

/// Posts deferred receives in order while the plugin takes them.
fn post_recvs(l: &mut RecvLane, buffers: &HashMap<u64, Arc<BufferEntry>>) -> Result<(), String> {
    let RecvLaneState::Ready(comm) = &mut l.state else {
        return Ok(());
    };
    while let Some(&(buffer, offset, len)) = l.deferred.front() {
        let (mh, at) = handle_for(&mut l.handles, buffers, buffer, offset, |r| comm.register(r))?;
        l.tag = l.tag.wrapping_add(1) & 0x7fff_ffff;
        match comm
            .irecv(mh, at as usize, len as usize, l.tag)
            .map_err(|e| e.to_string())?
        {
            Some(id) => {
                l.deferred.pop_front();
                l.posted.push_back(Posted {
                    id,
                    len,
                    buffer,
                    offset,
                });
            }
            None => break,
        }
    }
    Ok(())
}

/// Starts unpacking a completed receive: nothing to do when the plugin received in place (or
/// the chunk was sent empty), a host gather for host destinations, a push into the GPU's
/// unpacker for CUDA destinations.
fn start_unpack(
    comm: &RecvComm,
    posted: &Posted,
    buffers: &HashMap<u64, Arc<BufferEntry>>,
    stages: &mut HashMap<usize, GpuStage>,
    unpack_impl: UnpackImpl,
) -> Wait {
    let (ring, q) = match comm.completed(posted.id) {
        Ok(v) => v,
        Err(e) => return Wait::Ready(Err(e.to_string())),
    };
    let frags = match ring.fragments(q) {
        Ok(f) => f,
        Err(e) => return Wait::Ready(Err(e.to_string())),
    };
    if frags.is_empty() {
        return Wait::Ready(Ok(()));
    }
    let Some(entry) = buffers.get(&posted.buffer) else {
        return Wait::Ready(Err(format!("buffer {} vanished", posted.buffer)));
    };
    let Some(region) = entry.device_region() else {
        let landed: u64 = frags.iter().map(|f| u64::from(f.len)).sum();
        if landed != u64::from(posted.len) {
            return Wait::Ready(Err(format!("chunk landed {landed} of {} bytes", posted.len)));
        }
        return Wait::Ready(comm.unpack_host(posted.id).map(|_| ()).map_err(|e| e.to_string()));
    };
    // From here the unpacker checks the list (bounds, and adding up to the posted size:
    // `exact`): on the host at `push`, or, for the ring read in place, on the GPU, reported when
    // the batch is done (`BatchEnd::Rejected`).
    let ordinal = region.gpu().ordinal();
    let stage = match stages.entry(ordinal) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => {
            match GpuStage::new(region.gpu().clone(), unpack_impl) {
                Ok(s) => v.insert(s),
                Err(e) => return Wait::Ready(Err(format!("GPU {ordinal} unpack stage: {e}"))),
            }
        }
    };
    let job = (|| -> Result<(), String> {
        stage.reach_bounce(ring.bounce_device())?;
        let bounce = ring.bounce_span(frags);
        stage.gpu.bind_to_thread().map_err(|e| e.to_string())?;
        let dst = region
            .subspan(posted.offset, u64::from(posted.len))
            .map_err(|e| e.to_string())?;
        let list = ring.fragment_list(q).map_err(|e| e.to_string())?;
        let job = UnpackJob {
            frags: list,
            bounce,
            dst,
            exact: true,
        };
        stage.unpacker.push(&job).map_err(|e| e.to_string())
    })();
    match job {
        Ok(()) => {
            stage.pushed = true;
            Wait::Gpu {
                gpu: ordinal,
                batch: stage.next_batch,
                len: posted.len,
            }
        }
        Err(e) => Wait::Ready(Err(e)),
    }
}

/// The host's check of a completed receive's list (still in the ring: not consumed yet) against
/// the bounce buffer and the posted size, for the receives of a batch the GPU rejected part of:
/// only a receive whose own list is bad fails, named (the kernel skips only out-of-bounds
/// fragments, so the others were unpacked whole).
fn check_list(comm: &RecvComm, id: RequestId, len: u32) -> Result<(), String> {
    let (ring, q) = comm.completed(id).map_err(|e| format!("unpack: {e}"))?;
    let frags = ring.fragments(q).map_err(|e| format!("unpack: {e}"))?;
    let bounce_len = ring.bounce_span(frags).len();
    crate::unpack::validate_list(frags, bounce_len, u64::from(len), true)
        .map(|_| ())
        .map_err(|e| format!("unpack: {e}"))
}

impl GpuStage {
    /// Checks, once per GPU the plugin keeps bounce buffers on, that this GPU's unpacker can
    /// read them: another GPU's memory needs peer access, and without it the receive fails with
    /// this reason instead of an illegal address that would poison the whole context.
    fn reach_bounce(&mut self, bounce_device: Option<usize>) -> Result<(), String> {
        let ordinal = self.gpu.ordinal();
        let Some(dev) = bounce_device else {
            return Err(format!(
                "the receive lands in GPU {ordinal} but CUDA cannot tell which GPU holds the plugin's bounce buffer"
            ));
        };
        if dev == ordinal {
            return Ok(());
        }
        let gpu = self.gpu.clone();
        self.peer_reach
            .entry(dev)
            .or_insert_with(|| {
                crate::gpu::enable_peer_access(&gpu, dev).map_err(|e| {
                    format!(
                        "the receive lands in GPU {ordinal} but the plugin's bounce buffer is on GPU {dev}: {e}; \
                         give each GPU its own lanes (for the emulation: TCPXEMU_CUDA_DEVICE per daemon)"
                    )
                })?;
                tracing::info!(gpu = ordinal, bounce_gpu = dev, "unpack reads the bounce buffer over peer access");
                Ok(())
            })
            .clone()
    }

    fn new(gpu: Arc<Gpu>, imp: UnpackImpl) -> Result<GpuStage, String> {
        gpu.bind_to_thread().map_err(|e| e.to_string())?;
        let unpacker = imp.build(&gpu).map_err(|e| e.to_string())?;
        Ok(GpuStage {
            gpu,
            unpacker,
            next_batch: 1,
            pushed: false,
            in_flight: VecDeque::new(),
            done_upto: 0,
            failed: None,
            rejected: std::collections::BTreeSet::new(),
            peer_reach: HashMap::new(),
        })
    }

    /// Submits this pass's batch (if anything was pushed) and retires finished batches.
    fn advance(&mut self) {
        if self.gpu.bind_to_thread().is_err() {
            return;
        }
        if self.pushed {
            self.pushed = false;
            let batch = self.next_batch;
            self.next_batch += 1;
            match self.unpacker.submit() {
                Ok(ticket) => self.in_flight.push_back((batch, ticket)),
                Err(e) => self.fail(batch, e.to_string()),
            }
        }
        while let Some((batch, ticket)) = self.in_flight.front() {
            let batch = *batch;
            let done = match ticket {
                None => Ok(true),
                Some(t) => self.unpacker.is_done(t),
            };
            match done {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) if e.is_data() => {
                    tracing::warn!(gpu = self.gpu.ordinal(), batch, "unpack rejected a receive: {e}");
                    self.rejected.insert(batch);
                }
                Err(e) => self.fail(batch, e.to_string()),
            }
            self.done_upto = batch;
            self.in_flight.pop_front();
        }
        // A finished batch's receives are consumed within a pass or two.
        while let Some(&b) = self.rejected.first() {
            if b + 1024 >= self.done_upto {
                break;
            }
            self.rejected.pop_first();
        }
    }

    fn fail(&mut self, batch: u64, why: String) {
        tracing::error!(gpu = self.gpu.ordinal(), batch, "unpack failed: {why}");
        if self.failed.is_none() {
            self.failed = Some((batch, why));
        }
    }

    /// The outcome of a batch's receives, once it finished.
    fn outcome(&self, batch: u64) -> Option<BatchEnd> {
        if let Some((failed, why)) = &self.failed
            && batch >= *failed
        {
            return Some(BatchEnd::Failed(format!(
                "unpack on GPU {}: {why}",
                self.gpu.ordinal()
            )));
        }
        if batch > self.done_upto {
            return None;
        }
        Some(if self.rejected.contains(&batch) {
            BatchEnd::Rejected
        } else {
            BatchEnd::Unpacked
        })
    }
}
