//! The lane threads (`tcpxd-lanes-<gpu>`, `runtime.lane_thread`): the send lanes' comms, driven
//! on threads of their own, one per GPU the comms were opened under (`tcpxd-lanes` for those
//! opened under none). Once a send lane's connect completes, the poller hands its comm over
//! ([`ToLanes::Open`]) and from then on every call on that comm — `regMr`/`deregMr` of the
//! buffers' windows and staging rings, `isend`, `test`, the close — is made here; the poller
//! keeps the lane's bookkeeping (the engine's window, the sends held back, the staging rings'
//! memory and gathers) and tells this thread what to post, in order, through one channel.
//! What completed comes back through [`LaneBox`]: a count of sends done per lane (or a lane's
//! failure), taken by the poller's next pass, which rings the poller's bell when it waits.
//! Receive lanes (session 31) are driven here too once accepted: `recv.rs`. The orders the
//! poller gives in a pass reach each thread as one message ([`LaneThreads::flush`]).
//!
//! # State
//! This thread owns, per lane (peer, lane, generation): the `SendComm`, its tag, its
//! registrations, and the posts the plugin could not take yet (`isend` gave no request, or 16
//! were in flight), in order. The poller owns everything else. The poller counts a lane's sends
//! handed over and not yet reported done (`Threaded::outstanding`) and hands over at most
//! `send_window` (≤ 16) of them: the count it keeps is what this thread's comm has in flight
//! plus what it holds, so the window the engine sees is the one the plugin sees, shifted by the
//! queue's latency. A lane's generation grows with each comm the poller hands over: what this
//! thread reports about an older comm of the lane (closed and reopened since) is ignored.
//! A buffer is never removed while a send from it is held here (the engine removes only
//! buffers no transfer uses, and a source is used until its sends are reported done, the
//! receiver consumed them all, or the pairing failed — its lanes then closed before the
//! removal's [`ToLanes::Forget`]): this thread never registers a removed buffer
//! (docs/ARCHITECTURE.md, "The lane threads", `# State`).
//!
//! # Shutdown
//! - A lane closed when idle (`Action::CloseLane`, a pairing closed): [`ToLanes::Close`]; the
//!   poller first lets the GPU kernels and host copies that touch its staging finish; this
//!   thread drops the lane under its GPU (the plugin's close of an idle comm does not block).
//! - A failed pairing (`close_peer`): [`ToLanes::Close`] with `apart`: the lane goes to the
//!   daemon's closer threads, as the poller's own lanes do (a close may block on a hung peer).
//! - The poller's shutdown: [`LaneThread::stop`] takes every lane back (the thread ends) and
//!   the poller closes them with its own, within the drain's grace period.
//! - A panic: caught; the thread's lanes go to the closer threads and the poller hears
//!   [`LaneEvent::Ended`] at once: it fails the pairings those lanes served and starts a new
//!   thread with the GPU's next lane. (Test hook: `TCPXD_TEST_LANE_THREAD_PANIC_AT`, debug
//!   builds: [`panic_hook_due`].)
//! - The channel's end (the poller dropped another way): the thread ends, dropping its lanes.

mod recv;

pub(super) use recv::{Into as RecvInto, LandTo, Lands, RLane, RecvOrder, RecvSetup};

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use super::park::Bell;
use super::posting::handle_for_entry;
use crate::buffers::BufferEntry;
use crate::engine::PeerIdx;
use crate::idle::{Backoff, LINGER, Pace, Step};
use crate::lanes::{self, GpuStage, Tag};
use crate::metrics::Metrics;
use crate::net::{MemHandle, RecvComm, Region, SendComm};

/// A send lane: its pairing and index.
pub(super) type Key = (PeerIdx, u32);

/// What a send names its bytes by.
pub(super) enum Mem {
    /// A client buffer, at this offset (registered on first use, by window, on this thread).
    Buffer(Arc<BufferEntry>, u64),
    /// The lane's staging ring `ring`, at this offset.
    Staged(usize, u64),
}

/// The poller's orders, carried out in order.
pub(super) enum ToLanes {
    /// A send lane's comm, connected: driven here from now on.
    Open {
        key: Key,
        epoch: u64,
        comm: SendComm,
        gpu: Option<u32>,
    },
    /// One send, after the lane's earlier ones.
    Post {
        key: Key,
        epoch: u64,
        mem: Mem,
        len: u32,
    },
    /// Register the lane's staging ring `ring` (its memory the poller's).
    Staging {
        key: Key,
        epoch: u64,
        ring: usize,
        region: Arc<dyn Region>,
    },
    /// Buffers removed: their registrations go.
    Forget(Vec<u64>),
    /// Close a lane: here, under its GPU, or (`apart`, its pairing failed) on a closer thread.
    Close { key: Key, epoch: u64, apart: bool },
    /// A receive lane's comm, accepted: driven here from now on (with its flow-steering rules'
    /// record, dropped after the comm's close).
    OpenRecv {
        key: Key,
        epoch: u64,
        comm: RecvComm,
        gpu: Option<u32>,
        rules: Option<crate::rx_rules::Recorded>,
    },
    /// A receive lane's order, after its earlier ones.
    Recv { key: Key, epoch: u64, order: RecvOrder },
    /// Close a receive lane, as [`ToLanes::Close`].
    CloseRecv { key: Key, epoch: u64, apart: bool },
    /// The poller's engine expects bytes again: look at the receive lanes (a thread blocked on
    /// its channel with only idle credit receives posted wakes up).
    Wake,
    /// Orders given in one pass, carried out in order ([`LaneThreads::flush`]).
    Batch(Vec<ToLanes>),
    /// Hand every lane back and end.
    Stop(mpsc::Sender<Vec<Handed>>),
}

/// A lane handed back (`stop`).
pub(super) enum Handed {
    Send(Lane),
    Recv(Box<RLane>),
}

impl Handed {
    /// The GPU its comm was opened under (closed under it).
    pub(super) fn gpu(&self) -> Option<u32> {
        match self {
            Handed::Send(l) => l.gpu(),
            Handed::Recv(l) => l.gpu(),
        }
    }
}

/// What the lane thread reports.
#[derive(Debug)]
pub(super) enum LaneEvent {
    /// `n` sends of the lane completed, in order.
    Sent { key: Key, epoch: u64, n: u32 },
    /// The lane's comm failed (a plugin error, a registration refused): nothing more is driven
    /// on it.
    Failed { key: Key, epoch: u64, why: String },
    /// A credit receive of the receive lane completed (in ring order): its header says where
    /// it goes (`Action::Land`).
    Landed { key: Key, epoch: u64 },
    /// A receive of the receive lane was consumed (ring order, or a released one whose copies
    /// ended), with its outcome; a block chunk's by name.
    Consumed {
        key: Key,
        epoch: u64,
        chunk: Option<(u64, u64)>,
        result: Result<(), String>,
    },
    /// The receive lane's comm failed.
    RecvFailed { key: Key, epoch: u64, why: String },
    /// The thread of the lanes opened under `gpu` ended other than by [`ToLanes::Stop`] (it
    /// panicked): every lane it drove is gone (closed on the closer threads), `why` names the
    /// thread and the panic's message. The poller fails their pairings and starts a new thread
    /// with that GPU's next lane.
    Ended { gpu: Option<u32>, why: String },
}

/// Where the lane thread leaves its events for the poller.
pub(super) struct LaneBox {
    events: Mutex<Vec<LaneEvent>>,
    pending: AtomicBool,
    bell: Arc<Bell>,
}

impl LaneBox {
    /// Whether events wait (the poller's park looks at this after saying it waits, as it does
    /// at its channel: park.rs, "Why no wake-up is lost").
    pub(super) fn pending(&self) -> bool {
        self.pending.load(Ordering::Acquire)
    }

    /// Swaps the events waiting into `into` (empty).
    pub(super) fn take(&self, into: &mut Vec<LaneEvent>) {
        if !self.pending() {
            return;
        }
        let mut e = self.events.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::swap(&mut *e, into);
        self.pending.store(false, Ordering::Release);
    }

    fn put(&self, from: &mut Vec<LaneEvent>) {
        if from.is_empty() {
            return;
        }
        {
            let mut e = self.events.lock().unwrap_or_else(|e| e.into_inner());
            e.append(from);
            self.pending.store(true, Ordering::Release);
        }
        self.bell.ring_if_waiting();
    }
}

/// A send lane driven here.
pub(super) struct Lane {
    epoch: u64,
    gpu: Option<u32>,
    // The registrations go before the comm (each holds it open until it goes).
    handles: HashMap<(u64, u64), MemHandle>,
    staging: Vec<Option<MemHandle>>,
    pending: VecDeque<(Mem, u32)>,
    comm: SendComm,
    tag: Tag,
    failed: bool,
}

impl Lane {
    /// The GPU its comm was opened under (closed under it).
    pub(super) fn gpu(&self) -> Option<u32> {
        self.gpu
    }
}

/// One lane thread's channel and thread.
struct LaneThread {
    tx: mpsc::Sender<ToLanes>,
    /// Orders given since the last [`LaneThreads::flush`], sent together (one wake-up).
    pending: std::cell::RefCell<Vec<ToLanes>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The poller's handle on its lane threads: one per GPU the send lanes' comms are opened under
/// (`tcpxd-lanes-<gpu>`, as NCCL has a proxy thread per GPU), and one for lanes opened under
/// none (`tcpxd-lanes`), each started with its first lane. They share one [`LaneBox`].
pub(super) struct LaneThreads {
    pub(super) events: Arc<LaneBox>,
    metrics: Arc<Metrics>,
    spin: bool,
    threads: HashMap<Option<u32>, LaneThread>,
    setup: Arc<RecvSetup>,
    /// Whether the poller's engine expects bytes on some lane (read by the threads' waits).
    expecting: Arc<AtomicBool>,
}

impl LaneThreads {
    /// No thread yet. `spin` (`runtime.spin`) and the host's CPUs decide how each polls
    /// ([`polling`]).
    pub(super) fn new(bell: Arc<Bell>, metrics: Arc<Metrics>, spin: bool, setup: RecvSetup) -> LaneThreads {
        LaneThreads {
            events: Arc::new(LaneBox {
                events: Mutex::new(Vec::new()),
                pending: AtomicBool::new(false),
                bell,
            }),
            metrics,
            spin,
            threads: HashMap::new(),
            setup: Arc::new(setup),
            expecting: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Tells the threads whether the engine expects bytes on some lane; when it starts to, each
    /// is woken (a thread blocked with only idle credit receives posted must test them now).
    pub(super) fn expect(&self, busy: bool) {
        if self.expecting.swap(busy, Ordering::AcqRel) != busy && busy {
            for t in self.threads.values() {
                let _ = t.tx.send(ToLanes::Wake);
            }
        }
    }

    /// Hands a connected comm to the thread of its GPU (started now if it is the first).
    pub(super) fn open(&mut self, gpu: Option<u32>, m: ToLanes) -> Result<(), String> {
        if !self.threads.contains_key(&gpu) {
            let (tx, rx) = mpsc::channel();
            let out = self.events.clone();
            let metrics = self.metrics.clone();
            let setup = self.setup.clone();
            let expecting = self.expecting.clone();
            let (pace, linger) = polling(self.spin, crate::idle::cpus());
            let name = match gpu {
                Some(g) => format!("tcpxd-lanes-{g}"),
                None => "tcpxd-lanes".into(),
            };
            let thread = std::thread::Builder::new()
                .name(name.clone())
                .spawn(move || {
                    let mut d = Driver {
                        rx,
                        out,
                        metrics,
                        pace,
                        linger,
                        lanes: HashMap::new(),
                        recv: HashMap::new(),
                        stages: HashMap::new(),
                        setup,
                        expecting,
                        events: Vec::new(),
                        posts: 0,
                    };
                    // The plugin's calls on this thread's comms read the current device.
                    if let Err(e) = crate::topology::make_current(gpu) {
                        tracing::warn!("lane thread: {e}");
                    }
                    // A panic is caught here, and told to the poller at once (the guard).
                    if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| d.run())) {
                        d.died(gpu, &name, panic_message(&*panic));
                    }
                })
                .map_err(|e| format!("starting a lane thread: {e}"))?;
            self.threads.insert(
                gpu,
                LaneThread {
                    tx,
                    pending: Default::default(),
                    thread: Some(thread),
                },
            );
        }
        self.send(gpu, m);
        Ok(())
    }

    /// Gives an order to the thread of a lane opened under `gpu` (dropped when there is none or
    /// it has ended: only after `stop`). It goes with the others of the pass at the next
    /// [`LaneThreads::flush`], in order.
    pub(super) fn send(&self, gpu: Option<u32>, m: ToLanes) {
        if let Some(t) = self.threads.get(&gpu) {
            t.pending.borrow_mut().push(m);
        }
    }

    /// Sends each thread the orders given since the last flush, as one message: a thread
    /// napping or blocked on its channel is woken once a batch of actions, not once an order (a
    /// wake-up is a futex call on the poller's side, and on a loaded host the CPU it hands the
    /// woken thread: session 31 measured 10-18 µs of the poller's time a transfer for the
    /// `Land` and `PostCredit` orders sent one by one on the 2-CPU VM). The poller flushes at
    /// the end of each batch of actions and of `test_lanes`.
    pub(super) fn flush(&self) {
        for t in self.threads.values() {
            let mut p = t.pending.borrow_mut();
            let m = match p.len() {
                0 => continue,
                1 => p.pop().expect("one"),
                _ => ToLanes::Batch(std::mem::take(&mut *p)),
            };
            let _ = t.tx.send(m);
        }
    }

    /// Buffers removed: every thread forgets their registrations.
    pub(super) fn forget(&self, buffers: &[u64]) {
        for t in self.threads.values() {
            t.pending.borrow_mut().push(ToLanes::Forget(buffers.to_vec()));
        }
    }

    /// The thread of `gpu` ended (it reported [`LaneEvent::Ended`]): forgotten (joined), so
    /// that the GPU's next lane starts a new one.
    pub(super) fn ended(&mut self, gpu: Option<u32>) {
        if let Some(mut t) = self.threads.remove(&gpu)
            && let Some(j) = t.thread.take()
        {
            // It reported its end last thing: the join waits for no work.
            let _ = j.join();
        }
    }

    /// Ends every thread and takes their lanes back.
    pub(super) fn stop(&mut self) -> Vec<Handed> {
        self.flush();
        let mut lanes = Vec::new();
        for (_, mut t) in self.threads.drain() {
            let (tx, rx) = mpsc::channel();
            let _ = t.tx.send(ToLanes::Stop(tx));
            lanes.extend(rx.recv().unwrap_or_default());
            if let Some(j) = t.thread.take() {
                let _ = j.join();
            }
        }
        lanes
    }
}

struct Driver {
    rx: mpsc::Receiver<ToLanes>,
    out: Arc<LaneBox>,
    metrics: Arc<Metrics>,
    pace: Pace,
    linger: Duration,
    lanes: HashMap<Key, Lane>,
    /// The receive lanes (`recv.rs`).
    recv: HashMap<Key, RLane>,
    /// This thread's GPU stages: the unpacks and scatters of its receive lanes.
    stages: HashMap<usize, GpuStage>,
    setup: Arc<RecvSetup>,
    expecting: Arc<AtomicBool>,
    events: Vec<LaneEvent>,
    /// Sends and receives posted so far (the test hook [`panic_hook_due`] counts them).
    posts: u64,
}

impl Driver {
    /// After a panic in [`Driver::run`]: its lanes go to the closer threads (as a failed
    /// pairing's do: a close may wait for a hung peer), with their registrations, and the poller
    /// hears of it ([`LaneEvent::Ended`]) and is rung.
    fn died(&mut self, gpu: Option<u32>, name: &str, message: String) {
        let why = format!("lane thread {name} panicked: {message}");
        tracing::error!(
            thread = name,
            lanes = self.lanes.len(),
            recv_lanes = self.recv.len(),
            "{why}"
        );
        // Told first: the poller fails the pairings with this thread's words before their
        // peers can see the comms close below and fail them with theirs.
        self.events.clear();
        self.out.put(&mut vec![LaneEvent::Ended { gpu, why }]);
        for (_, l) in self.lanes.drain() {
            super::closer::Closers::global().run(Box::new(move || close_under(l)));
        }
        let recv: Vec<RLane> = self.recv.drain().map(|(_, l)| l).collect();
        if !recv.is_empty() {
            self.stages.values_mut().for_each(GpuStage::quiesce_blocks);
            self.setup.copies.quiesce();
        }
        for l in recv {
            super::closer::Closers::global().run(Box::new(move || close_recv_under(l)));
        }
    }

    fn run(&mut self) {
        tracing::debug!("lane thread started");
        let mut backoff = Backoff::with(self.pace);
        let mut last_work = Instant::now();
        loop {
            lanes::next_pass();
            let mut progressed = false;
            loop {
                match self.rx.try_recv() {
                    Ok(m) => {
                        progressed = true;
                        if self.order(m) {
                            return;
                        }
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => return,
                }
            }
            progressed |= self.pass();
            progressed |= self.recv_pass();
            self.out.put(&mut self.events);
            if progressed {
                backoff.reset();
                last_work = Instant::now();
                continue;
            }
            let expecting = self.expecting.load(Ordering::Acquire);
            let busy = self
                .lanes
                .values()
                .any(|l| !l.failed && (l.comm.outstanding() > 0 || !l.pending.is_empty()))
                || self.recv.values().any(|l| l.busy(expecting));
            let next = if busy || last_work.elapsed() < self.linger {
                match backoff.step() {
                    Step::Spun | Step::Yielded => continue,
                    Step::Nap(d) => self
                        .rx
                        .recv_timeout(d)
                        .map_err(|e| e == mpsc::RecvTimeoutError::Disconnected),
                }
            } else {
                backoff.reset();
                self.rx.recv().map_err(|_| true)
            };
            match next {
                Ok(m) => {
                    backoff.reset();
                    last_work = Instant::now();
                    if self.order(m) {
                        return;
                    }
                }
                Err(true) => return,
                Err(false) => {}
            }
        }
    }

    /// Carries out one order; true when the thread ends.
    fn order(&mut self, m: ToLanes) -> bool {
        match m {
            ToLanes::Open {
                key,
                epoch,
                comm,
                gpu,
            } => {
                let lane = Lane {
                    epoch,
                    gpu,
                    handles: HashMap::new(),
                    staging: Vec::new(),
                    pending: VecDeque::new(),
                    comm,
                    tag: Tag::default(),
                    failed: false,
                };
                if let Some(old) = self.lanes.insert(key, lane) {
                    // Not expected: the poller closes a lane before it opens it again.
                    close_under(old);
                }
            }
            ToLanes::Post { key, epoch, mem, len } => {
                if let Some(l) = self.lane(key, epoch) {
                    l.pending.push_back((mem, len));
                }
            }
            ToLanes::Staging {
                key,
                epoch,
                ring,
                region,
            } => {
                let metrics = &self.metrics;
                let Some(l) = self.lanes.get_mut(&key).filter(|l| l.epoch == epoch && !l.failed) else {
                    return false;
                };
                match l.comm.register(region) {
                    Ok(mh) => {
                        if l.staging.len() <= ring {
                            l.staging.resize_with(ring + 1, || None);
                        }
                        l.staging[ring] = Some(mh);
                    }
                    Err(e) => {
                        metrics.plugin_error(&e);
                        l.failed = true;
                        self.events.push(LaneEvent::Failed {
                            key,
                            epoch,
                            why: format!("registering the staging ring: {e}"),
                        });
                    }
                }
            }
            ToLanes::Forget(buffers) => {
                for l in self.lanes.values_mut() {
                    l.handles.retain(|(b, _), _| !buffers.contains(b));
                }
                for l in self.recv.values_mut() {
                    l.forget(&buffers);
                }
            }
            ToLanes::OpenRecv {
                key,
                epoch,
                comm,
                gpu,
                rules,
            } => {
                if let Some(old) = self.recv.insert(key, RLane::new(epoch, gpu, comm, rules)) {
                    self.quiesce_for(&old);
                    close_recv_under(old);
                }
            }
            ToLanes::Recv { key, epoch, order } => self.recv_order(key, epoch, order),
            ToLanes::CloseRecv { key, epoch, apart } => {
                if self.recv.get(&key).is_some_and(|l| l.epoch == epoch)
                    && let Some(l) = self.recv.remove(&key)
                {
                    self.quiesce_for(&l);
                    if apart {
                        super::closer::Closers::global().run(Box::new(move || close_recv_under(l)));
                    } else {
                        close_recv_under(l);
                    }
                }
            }
            ToLanes::Wake => {}
            ToLanes::Batch(orders) => {
                for m in orders {
                    if self.order(m) {
                        return true;
                    }
                }
            }
            ToLanes::Close { key, epoch, apart } => {
                if self.lanes.get(&key).is_some_and(|l| l.epoch == epoch)
                    && let Some(l) = self.lanes.remove(&key)
                {
                    if apart {
                        super::closer::Closers::global().run(Box::new(move || close_under(l)));
                    } else {
                        close_under(l);
                    }
                }
            }
            ToLanes::Stop(reply) => {
                if !self.recv.is_empty() {
                    self.stages.values_mut().for_each(GpuStage::quiesce_blocks);
                }
                let mut handed: Vec<Handed> = self.lanes.drain().map(|(_, l)| Handed::Send(l)).collect();
                handed.extend(self.recv.drain().map(|(_, l)| Handed::Recv(Box::new(l))));
                let _ = reply.send(handed);
                tracing::debug!("lane thread stopped");
                return true;
            }
        }
        false
    }

    fn lane(&mut self, key: Key, epoch: u64) -> Option<&mut Lane> {
        self.lanes.get_mut(&key).filter(|l| l.epoch == epoch)
    }

    /// Posts what each lane holds while the plugin takes it, then tests the head of each comm.
    fn pass(&mut self) -> bool {
        let mut progressed = false;
        for (&key, l) in self.lanes.iter_mut() {
            if l.failed {
                continue;
            }
            // Sends the tests after each post found done count with the pass's test.
            let mut early = 0;
            let failure =
                post_held(l, &mut self.posts, &mut early).err().or_else(|| {
                    match lanes::test_sends(&mut l.comm, || {}).map(|n| n + early) {
                        Ok(0) => None,
                        Ok(n) => {
                            progressed = true;
                            self.events.push(LaneEvent::Sent {
                                key,
                                epoch: l.epoch,
                                n: n as u32,
                            });
                            None
                        }
                        Err(e) => {
                            self.metrics.plugin_error(&e);
                            Some(e.to_string())
                        }
                    }
                });
            if let Some(why) = failure {
                l.failed = true;
                progressed = true;
                self.events.push(LaneEvent::Failed {
                    key,
                    epoch: l.epoch,
                    why,
                });
            }
        }
        progressed
    }
}

/// How a lane thread polls while its sends are out, and how long it goes on after its last work
/// before it blocks on its channel. With CPUs to spare (`runtime.spin`, or as many CPUs as make
/// `spin = auto` on) it polls as the poller does — spinning with `spin`, yielding — and lingers
/// [`LINGER`]: a post to a thread blocked on its channel costs the poller a futex wake (~2 µs of
/// its `post_send` on the build VM). On fewer CPUs a yielding lane thread takes the CPU the
/// plugin's threads and the receiver need, and a yield on a CPU others want can give it back a
/// scheduler slice later (256 KiB one at a time 1.5× slower on the 2-CPU VM, measured): there it
/// naps [`crate::idle::NAP`] between tests (a post ends the nap) and blocks at once when idle.
fn polling(spin: bool, cpus: usize) -> (Pace, Duration) {
    match (spin, cpus >= crate::idle::SPIN_AUTO_CPUS) {
        (true, _) => (Pace::POLL, LINGER),
        (false, true) => (Pace::POLL_SHARED, LINGER),
        (false, false) => (
            Pace {
                spins: 0,
                yield_for: Duration::ZERO,
                nap_min: crate::idle::NAP,
                nap_max: crate::idle::NAP,
            },
            Duration::ZERO,
        ),
    }
}

/// Posts a lane's held sends in order while the plugin takes them, testing the comm after each
/// post ([`lanes::post_send`]'s note: a send moves only once tested); `done` counts the sends
/// those tests found done. Their failure fails the lane, as a post's does.
fn post_held(l: &mut Lane, posts: &mut u64, done: &mut usize) -> Result<(), String> {
    while l.comm.can_post()
        && let Some((mem, len)) = l.pending.front()
    {
        let (mh, at) = match mem {
            Mem::Staged(ring, at) => (
                l.staging
                    .get(*ring)
                    .and_then(Option::as_ref)
                    .ok_or("a staged send without its staging ring")?,
                *at,
            ),
            Mem::Buffer(entry, offset) => {
                let comm = &l.comm;
                handle_for_entry(&mut l.handles, entry, *offset, |r| comm.register(r))?
            }
        };
        if !lanes::post_send(&mut l.comm, &mut l.tag, mh, at as usize, *len).map_err(|e| e.to_string())? {
            break;
        }
        l.pending.pop_front();
        *posts += 1;
        if panic_hook_due(*posts) {
            panic!("TCPXD_TEST_LANE_THREAD_PANIC_AT: post {posts}");
        }
        *done += lanes::test_sends(&mut l.comm, || {}).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The test hook (debug builds only: `cfg!(debug_assertions)`): with
/// `TCPXD_TEST_LANE_THREAD_PANIC_AT=<n>` in the environment, the first lane thread of the process
/// to post its `n`-th send panics right after that post, once per process (the thread started
/// in its place does not). Suite `daemon_lane_thread::a_lane_thread_that_panics_...`.
fn panic_hook_due(posts: u64) -> bool {
    if !cfg!(debug_assertions) {
        return false;
    }
    static AT: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    static FIRED: AtomicBool = AtomicBool::new(false);
    let at = AT.get_or_init(|| {
        std::env::var("TCPXD_TEST_LANE_THREAD_PANIC_AT")
            .ok()
            .and_then(|v| v.parse().ok())
    });
    *at == Some(posts) && !FIRED.swap(true, Ordering::AcqRel)
}

/// A panic's message, when it is a string.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(not a string)".into())
}

/// Drops a receive lane (closing its comm) with its GPU current on this thread.
fn close_recv_under(l: RLane) {
    if let Err(e) = crate::topology::make_current(l.gpu()) {
        tracing::warn!("closing a receive lane's comm: {e}");
    }
    drop(l);
}

/// Drops a lane (closing its comm) with its GPU current on this thread.
fn close_under(l: Lane) {
    if let Err(e) = crate::topology::make_current(l.gpu) {
        tracing::warn!("closing a send lane's comm: {e}");
    }
    drop(l);
}

#[cfg(test)]
mod tests {
    use super::polling;
    use crate::idle::{LINGER, NAP, Pace};
    use std::time::Duration;

    #[test]
    fn lane_threads_poll_like_the_poller_only_with_cpus_to_spare() {
        assert_eq!(polling(true, 2), (Pace::POLL, LINGER));
        assert_eq!(polling(false, 16), (Pace::POLL_SHARED, LINGER));
        let (few, linger) = polling(false, 2);
        assert_eq!(
            (few.spins, few.yield_for, few.nap_min, few.nap_max),
            (0, Duration::ZERO, NAP, NAP)
        );
        assert_eq!(linger, Duration::ZERO);
    }
}
