//! The framed local sessions served on a thread of their own, `tcpxd-sessions`
//! (`runtime.session_thread`, session 30; issue #38): the thread owns the sessions' epoll set
//! and their request rings, wakes and polls the session futures (`crate::api::local::inline`),
//! so a request's read, decode and checks (`crate::api::session`'s `fast.rs`) run here, not on
//! the poller. What a fast start hands the engine goes to the poller through [`Hub`] (a queue
//! under a lock; the poller's bell rung only when it waits), and the poller takes it at the
//! start of its next pass. Back the other way, what the poller would do for a session besides
//! the engine's own work is handed over too: a fast start's answer (the ticket's `answered`: the
//! transfers table's insert, the `Starting` slot) and the socket writes of the events its
//! actions pushed (`crate::api::local::outbox::Batch::close_into`: the events are framed, and
//! their board entries published, on the poller at once; the `write` happens here). So the
//! poller's pass keeps the engine, the peers' messages and the lanes.
//!
//! Off (`runtime.session_thread = off`), the sessions are served on the poller's thread as before
//! (`sessions.rs`), or on the runtime with `runtime.poller_sessions = off`.
//!
//! # State
//! [`Hub`] is shared by the poller, the sessions thread and the sessions themselves: the fast
//! starts queued for the poller (and whether the poller still takes them: `closed`), the
//! answers and outboxes handed to the sessions thread, and where the sessions thread is
//! (`AWAKE` or `IN_EPOLL`, written by it alone). Which thread serves the sessions is a
//! thread-local mark (`sessions::mark_serving`): set on this thread, or on the poller's when
//! the option is off.
//!
//! # Why no request or hand-over is missed
//! A session's socket is in this thread's epoll set, edge-triggered, and read as `sessions.rs`
//! argues ("Why no request is missed"): the same argument with this thread in the poller's
//! place. This thread spins (zero-timeout looks, yielding between) while it had work within
//! [`LINGER`] and `runtime.spin` is on (or the poller runs passes, with spin); otherwise it parks
//! in `epoll_wait` with no timeout. A hand-over from the poller (answers, outboxes to write) is
//! never left with a parked thread: the poller puts it in the hub and sets `any_handed`, then (a
//! `SeqCst` fence between) reads this thread's state, and if it is `IN_EPOLL` serves the
//! hand-overs itself ([`Hub::served_if_parked`]; for a pass's answers, at the pass's end); this
//! thread writes `IN_EPOLL`, then (a `SeqCst` fence between) reads `any_handed` and parks only if
//! it is unset. One of the two sees the other's write, and whichever takes the hand-overs does so
//! under the hub's lock: each is served once. (The eventfd is rung only for the shutdown.) The
//! request rings are looked at every turn and told before the park (`rings.rs`'s `parking`, which
//! looks once more: an entry found then is looked at, its reader woken, before any park), as the
//! poller did.
//! The other way, a fast start queued for the poller sets `queued` before the poller's bell is
//! rung if it waits (`Bell::ring_if_waiting`), and the poller's wait reads `queued` after its
//! own state's write and fence (`Park::wait`): a queued start never waits for a park's end.
//!
//! # Shutdown
//! When the poller's thread ends (a drain, the channel's end, or a panic: a guard,
//! [`CloseOnDrop`], dropped after the poller and its transfers' sinks), it closes the hub
//! ([`Hub::close`]): the starts still queued are dropped, each answered as the command channel
//! would answer (UNAVAILABLE, "the daemon is shutting down", `FastStart`'s drop), and a start
//! queued after that is answered so at once. Then it tells this thread to stop and rings it;
//! this thread serves what was handed to it (answers, writes) one last time and ends. Sessions
//! still open then are woken by nothing more (as `sessions.rs`'s "Shutdown" says of the
//! poller's set); their registrations go with this thread's epoll set. `PollerHandle::join`
//! joins this thread after the poller's.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering, fence};
use std::sync::{Arc, Mutex};
use std::task::Waker;
use std::time::{Duration, Instant};

use mio::{Events, Poll, Token};

use super::fast_starts::{FastStart, StartSink};
use super::park::Bell;
use super::rings::RingWatch;
use super::sessions::{self, SessionWatch};
use crate::api::local::outbox::Outbox;
use crate::idle::LINGER;

const AWAKE: u8 = 0;
const IN_EPOLL: u8 = 1;

/// The hub's eventfd in the sessions thread's set.
const WAKE: Token = Token(usize::MAX);

/// A fast start's ticket whose answer it holds, applied on the sessions thread
/// (`StartSink::hold`).
pub(super) type Answer = Arc<dyn StartSink>;

thread_local! {
    /// On the sessions thread: its hub (where the fast starts its sessions check go).
    static HUB_HERE: RefCell<Option<Arc<Hub>>> = const { RefCell::new(None) };
}

/// What the poller and the sessions thread hand each other (the module's "State").
pub(super) struct Hub {
    starts: Mutex<Starts>,
    /// Starts are queued (a hint read without the lock; the lock's queue is the truth).
    queued: AtomicBool,
    /// The poller's bell: rung after a start is queued, when the poller waits.
    bell: Arc<Bell>,
    handed: Mutex<Handed>,
    /// Something is handed to the sessions thread (read without the lock).
    any_handed: AtomicBool,
    /// Where the sessions thread is: `AWAKE` or `IN_EPOLL`.
    state: AtomicU8,
    /// The sessions thread's eventfd.
    waker: mio::Waker,
    /// The poller ended: the sessions thread serves what was handed and ends.
    stop: AtomicBool,
}

#[derive(Default)]
struct Starts {
    queue: VecDeque<FastStart>,
    /// The poller takes no more starts.
    closed: bool,
}

#[derive(Default)]
struct Handed {
    answers: Vec<Answer>,
    writes: Vec<Arc<Outbox>>,
}

/// The sessions thread's side, until it starts: its epoll set and what it serves.
pub(super) struct SessionsSide {
    poll: Poll,
    hub: Arc<Hub>,
    watch: Arc<SessionWatch>,
    rings: Arc<RingWatch>,
}

impl Hub {
    /// The hub and the sessions thread's epoll set, its [`SessionWatch`] registering there.
    pub(super) fn new(bell: Arc<Bell>, rings: Arc<RingWatch>) -> io::Result<(Arc<Hub>, SessionsSide)> {
        let poll = Poll::new()?;
        let waker = mio::Waker::new(poll.registry(), WAKE)?;
        let watch = Arc::new(SessionWatch::new(poll.registry().try_clone()?));
        let hub = Arc::new(Hub {
            starts: Mutex::new(Starts::default()),
            queued: AtomicBool::new(false),
            bell,
            handed: Mutex::new(Handed::default()),
            any_handed: AtomicBool::new(false),
            state: AtomicU8::new(AWAKE),
            waker,
            stop: AtomicBool::new(false),
        });
        let side = SessionsSide {
            poll,
            hub: hub.clone(),
            watch,
            rings,
        };
        Ok((hub, side))
    }

    /// Queues a checked start for the poller (on the sessions thread) and rings its bell if it
    /// waits; once the poller stopped, the start is dropped: answered UNAVAILABLE at once.
    fn queue(&self, start: FastStart) {
        let mut s = self.starts.lock().unwrap_or_else(|e| e.into_inner());
        if s.closed {
            drop(s);
            drop(start);
            return;
        }
        s.queue.push_back(start);
        self.queued.store(true, Ordering::Relaxed);
        drop(s);
        self.bell.ring_if_waiting();
    }

    /// Whether starts are queued (the poller's wait reads it after its fence: `Park::wait`).
    pub(super) fn has_starts(&self) -> bool {
        self.queued.load(Ordering::Relaxed)
    }

    /// The poller takes the queued starts into `into` (its scratch, empty on entry).
    pub(super) fn take_starts(&self, into: &mut VecDeque<FastStart>) {
        if !self.queued.load(Ordering::Acquire) {
            return;
        }
        let mut s = self.starts.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::swap(&mut s.queue, into);
        self.queued.store(false, Ordering::Relaxed);
    }

    /// The poller hands its fast starts' answers to the sessions thread (`answers`: the
    /// poller's scratch, empty on return) without ringing it: `true` when there were any, and
    /// the poller then looks by the end of its pass ([`Hub::served_if_parked`], unless a hand
    /// of writes looked meanwhile).
    pub(super) fn hand_answers(&self, answers: &mut Vec<Answer>) -> bool {
        if answers.is_empty() {
            return false;
        }
        let mut h = self.handed.lock().unwrap_or_else(|e| e.into_inner());
        h.answers.append(answers);
        self.any_handed.store(true, Ordering::Relaxed);
        true
    }

    /// The poller hands the outboxes its batch of actions pushed into (`writes`: its scratch,
    /// empty on return), then looks whether the sessions thread is parked
    /// ([`Hub::served_if_parked`]): `true` when there were any (what was handed before goes
    /// with them).
    pub(super) fn hand_writes(&self, writes: &mut Vec<Arc<Outbox>>, scratch: &mut Vec<Answer>) -> bool {
        if writes.is_empty() {
            return false;
        }
        {
            let mut h = self.handed.lock().unwrap_or_else(|e| e.into_inner());
            h.writes.append(writes);
            self.any_handed.store(true, Ordering::Relaxed);
        }
        self.served_if_parked(scratch, writes);
        true
    }

    /// After a hand-over: when the sessions thread is parked, the poller serves what was handed
    /// itself, on its own thread (the answers applied, the outboxes written, as before the
    /// sessions thread), instead of waking it: a parked thread has nothing else to do, and its
    /// wake-up (the eventfd's write, the switch) costs the poller more than the work. When it
    /// is awake it serves them (the module's "Why no request or hand-over is missed": it reads
    /// `handed` after its state's write and a fence, and does not park while anything is).
    /// Either thread takes the hand-overs under the lock: each is served once. (`answers` and
    /// `writes`: the caller's empty scratch.)
    pub(super) fn served_if_parked(&self, answers: &mut Vec<Answer>, writes: &mut Vec<Arc<Outbox>>) {
        fence(Ordering::SeqCst);
        if self.state.load(Ordering::Relaxed) == IN_EPOLL {
            serve_handed(self, answers, writes);
        }
    }

    fn ring(&self) {
        if let Err(e) = self.waker.wake() {
            tracing::warn!("could not wake the sessions thread: {e}");
        }
    }

    /// The poller ended (on its thread, after `run`): the queued starts are answered as
    /// shutting down, later ones at once; the sessions thread serves what it was handed and ends.
    pub(super) fn close(&self) {
        let left = {
            let mut s = self.starts.lock().unwrap_or_else(|e| e.into_inner());
            s.closed = true;
            self.queued.store(false, Ordering::Relaxed);
            std::mem::take(&mut s.queue)
        };
        drop(left);
        self.stop.store(true, Ordering::SeqCst);
        self.ring();
    }
}

/// Closes the hub when dropped ([`Hub::close`]): held by the poller's thread until it ends, so
/// the queued starts are answered and the sessions thread ends however the poller ends.
pub(super) struct CloseOnDrop(pub(super) Option<Arc<Hub>>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        if let Some(hub) = self.0.take() {
            hub.close();
        }
    }
}

/// Queues `start` on the sessions thread's hub; handed back when the calling thread is not the
/// sessions thread.
pub(super) fn queue_here(start: FastStart) -> Option<FastStart> {
    HUB_HERE.with(|h| match &*h.borrow() {
        Some(hub) => {
            hub.queue(start);
            None
        }
        None => Some(start),
    })
}

impl SessionsSide {
    /// Where framed sessions put their sockets.
    pub(super) fn watch(&self) -> &Arc<SessionWatch> {
        &self.watch
    }

    /// Starts the thread; `spin`: it lingers (zero-timeout looks) after its last work.
    pub(super) fn spawn(self, spin: bool) -> io::Result<std::thread::JoinHandle<()>> {
        std::thread::Builder::new()
            .name("tcpxd-sessions".into())
            .spawn(move || self.run(spin))
    }

    fn run(mut self, spin: bool) {
        tracing::debug!("sessions thread started");
        sessions::mark_serving();
        HUB_HERE.with(|h| *h.borrow_mut() = Some(self.hub.clone()));
        let hub = self.hub.clone();
        let mut events = Events::with_capacity(256);
        let mut ready: Vec<Token> = Vec::new();
        let mut wakers: Vec<Waker> = Vec::new();
        let (mut answers, mut writes): (Vec<Answer>, Vec<Arc<Outbox>>) = (Vec::new(), Vec::new());
        let mut last_work = Instant::now();
        loop {
            self.watch.next_pass();
            let mut worked = serve_handed(&hub, &mut answers, &mut writes);
            if hub.stop.load(Ordering::SeqCst) {
                serve_handed(&hub, &mut answers, &mut writes);
                break;
            }
            // With `runtime.spin`: looks again at once while the poller runs passes (transfers
            // in flight: their ends come back here to be written, and the next requests follow
            // them) and within the linger after its own last work. Without, it parks at once:
            // on a small host a thread that yields still takes the CPU from the poller and the
            // lanes (2-core VM: 29 µs of CPU a transfer, 0.85x the rate; BENCHMARKS, session 30).
            let lingering = spin && (hub.bell.awake() || last_work.elapsed() < LINGER);
            let timeout = match worked || lingering {
                true => Some(Duration::ZERO),
                false => {
                    // The module's "Why no request or hand-over is missed".
                    hub.state.store(IN_EPOLL, Ordering::Relaxed);
                    fence(Ordering::SeqCst);
                    let park = !hub.any_handed.load(Ordering::Relaxed)
                        && !hub.stop.load(Ordering::SeqCst)
                        && !self.rings.parking();
                    if park {
                        None
                    } else {
                        // Something came meanwhile: a look, then what it needs (a ring's entry
                        // wakes its reader below, a hand-over is served at the next turn).
                        self.rings.unparked();
                        hub.state.store(AWAKE, Ordering::Relaxed);
                        Some(Duration::ZERO)
                    }
                }
            };
            let polled = self.poll.poll(&mut events, timeout);
            if timeout.is_none() {
                hub.state.store(AWAKE, Ordering::Relaxed);
                self.rings.unparked();
            }
            match polled {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!("the sessions thread's epoll_wait failed: {e}");
                    std::thread::sleep(crate::idle::NAP);
                    continue;
                }
            }
            ready.extend(events.iter().map(|e| e.token()).filter(|&t| t != WAKE));
            worked |= !ready.is_empty();
            self.watch.wake(&mut ready, &mut wakers);
            // A request taken off a ring is work too: the linger runs from it (before session
            // 31 it did not count, and a tight loop on one node, whose poller runs no passes,
            // saw this thread park every 1 ms and a request pay the doorbell's wake-up).
            worked |= self.rings.wake(&mut wakers);
            if worked {
                last_work = Instant::now();
            } else if lingering {
                std::thread::yield_now();
            }
        }
        HUB_HERE.with(|h| *h.borrow_mut() = None);
        tracing::debug!("sessions thread ended");
    }
}

/// Serves the answers and writes the poller handed over; `true` when there were any.
fn serve_handed(hub: &Hub, answers: &mut Vec<Answer>, writes: &mut Vec<Arc<Outbox>>) -> bool {
    if !hub.any_handed.load(Ordering::Acquire) {
        return false;
    }
    {
        let mut h = hub.handed.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::swap(&mut h.answers, answers);
        std::mem::swap(&mut h.writes, writes);
        hub.any_handed.store(false, Ordering::Relaxed);
    }
    for sink in answers.drain(..) {
        sink.answer_held();
    }
    for outbox in writes.drain(..) {
        outbox.write_batched();
    }
    true
}

#[cfg(test)]
mod tests {
    use super::super::fast_starts::FastStarted;
    use super::super::park::Park;
    use super::super::{Batch, TransferStatus};
    use super::*;
    use crate::engine::{Code, EngineError, TransferId};
    use std::sync::mpsc;

    /// Records what a start's sink is told.
    #[derive(Default)]
    struct Told(Mutex<Vec<Result<TransferId, (Code, String)>>>);

    impl StartSink for Told {
        fn answered(self: Arc<Self>, r: Result<FastStarted, EngineError>) {
            let r = r.map(|s| s.id).map_err(|e| (e.code, e.message));
            self.0.lock().unwrap().push(r);
        }
        fn hold(&self, _: Result<FastStarted, EngineError>) {}
        fn answer_held(self: Arc<Self>) {}
        fn finished(&self, _: TransferId, _: Option<&TransferStatus>) {}
    }

    fn start(sink: &Arc<Told>) -> FastStart {
        FastStart {
            write: true,
            batch: Batch::Entries(Vec::new()),
            notification: Vec::new(),
            deadline: Instant::now(),
            sink: Some(sink.clone() as Arc<dyn StartSink>),
        }
    }

    /// Shutdown with starts queued: the poller's end answers each as the command channel would
    /// (UNAVAILABLE, "the daemon is shutting down"), a start queued after it at once; the
    /// sessions thread ends.
    #[test]
    fn starts_queued_when_the_poller_ends_are_answered_unavailable_and_the_thread_ends() {
        let (tx, _rx) = mpsc::channel();
        let (park, _sender, side) = Park::new(tx, true, true).unwrap();
        let side = side.expect("a sessions thread");
        let hub = park.hub().expect("a hub").clone();
        let thread = side.spawn(false).unwrap();
        let told = Arc::new(Told::default());
        for _ in 0..3 {
            hub.queue(start(&told));
        }
        assert!(hub.has_starts());
        assert!(told.0.lock().unwrap().is_empty(), "queued, not answered");
        // The poller took one before it ended: taken starts are its own to answer.
        let mut taken = VecDeque::new();
        hub.take_starts(&mut taken);
        assert_eq!(taken.len(), 3);
        let one = taken.pop_front().unwrap();
        hub.queue(taken.pop_front().unwrap());
        hub.queue(taken.pop_front().unwrap());
        hub.close();
        assert!(!hub.has_starts());
        hub.queue(start(&told));
        drop(one);
        let got = told.0.lock().unwrap().clone();
        assert_eq!(got.len(), 4, "every start answered once: {got:?}");
        for r in got {
            assert_eq!(
                r,
                Err((Code::Unavailable, "the daemon is shutting down".to_string()))
            );
        }
        thread
            .join()
            .expect("the sessions thread ends once the poller did");
    }

    /// A hand-over the sessions thread is woken for is served there.
    #[test]
    fn a_hand_over_wakes_the_parked_sessions_thread() {
        struct Held(Mutex<Vec<std::thread::ThreadId>>);
        impl StartSink for Held {
            fn answered(self: Arc<Self>, _: Result<FastStarted, EngineError>) {}
            fn hold(&self, _: Result<FastStarted, EngineError>) {}
            fn answer_held(self: Arc<Self>) {
                self.0.lock().unwrap().push(std::thread::current().id());
            }
            fn finished(&self, _: TransferId, _: Option<&TransferStatus>) {}
        }
        let (tx, _rx) = mpsc::channel();
        let (park, _sender, side) = Park::new(tx, true, true).unwrap();
        let hub = park.hub().unwrap().clone();
        let thread = side.unwrap().spawn(false).unwrap();
        let sessions = thread.thread().id();
        let held = Arc::new(Held(Mutex::new(Vec::new())));
        for round in 1..=3 {
            // (parked or about to be: nothing else wakes it)
            std::thread::sleep(Duration::from_millis(20));
            // Handed without a ring: the thread serves it when it next looks (woken here).
            assert!(hub.hand_answers(&mut vec![held.clone() as Arc<dyn StartSink>]));
            hub.ring();
            let end = Instant::now() + Duration::from_secs(30);
            while held.0.lock().unwrap().len() < round {
                assert!(
                    Instant::now() < end,
                    "round {round}: the hand-over was not served"
                );
                std::thread::yield_now();
            }
        }
        assert!(held.0.lock().unwrap().iter().all(|&t| t == sessions));
        hub.close();
        thread.join().unwrap();
    }
}
