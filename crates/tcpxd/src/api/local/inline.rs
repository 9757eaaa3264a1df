//! Futures run by the thread that wakes them: a framed session's wait for a transfer's end, and
//! its notification subscription. The poller publishes a transfer's final status on its `watch`
//! channel and a notification on the node's `broadcast` channel from its own thread; tokio calls
//! the wakers of those channels' waiters right there, after releasing the channel's locks. A
//! future woken through an [`Inline`] is polled in that call: it reads the status (or the
//! notification) and pushes its event into the session's [`Outbox`](super::outbox::Outbox),
//! which writes it to the client's socket at once. Before, the poller woke a task (a runtime
//! worker thread woken), which woke the session's task, which wrote the event: two thread hops
//! on every small transfer's way back (docs/BENCHMARKS.md, "session 21").
//!
//! What such a future may do when polled is what the waking thread may: only non-blocking work
//! (the channels' reads, encoding an event, a non-blocking write). It runs on no runtime: no
//! timers, no I/O readiness, no spawning — unless it was started with a runtime's handle
//! ([`Inline::start_in`]): then each poll runs inside that runtime's context, so a future that
//! may, on a rare path, wait for a timer or a connection (a transfer's start whose pairing closed
//! when idle meanwhile, `crate::api::session::starting`) can, whichever thread polls it.
//!
//! A framed session served on the poller's thread (`crate::poller::SessionWatch`) is such a
//! future too ([`Inline::start_served`]); while it does what could stall the poller (a
//! registration, a large request) it holds itself off that thread ([`OffPoller::hold`]): a wake
//! there hands the poll to a runtime worker instead ([`off_poller`] moves it at once). With
//! `runtime.session_thread` the sessions thread serves it, and the same hold keeps it off that
//! thread and the poller's alike (`crate::poller::keep_off_here`).
//!
//! # No poll inside a poll
//! A wake that comes while the calling thread is polling some [`Inline`] (a delivery pushing an
//! event wakes the session it belongs to; a session starts a delivery) does not poll the woken
//! future there: it is queued, and the outermost poll on that thread runs the queue, in order,
//! once its own poll returned. A future polled inside another's poll would run while the outer
//! one holds its locks: a delivery marks its tag and pushes its event under the session's lock
//! of delivered tags, and the session woken by that push takes the same lock to reap (CI, session
//! 24: the poller's thread deadlocked there when the client's connection broke). Queued, the
//! woken future still runs on the same thread, right after: no hop is added.
//!
//! A start is not a wake: [`Inline::start`] (and `start_in`, `start_served`) polls its new future
//! once right there, also inside another's poll, as a plain call would run it: its caller knows
//! what it holds (a framed session starting a transfer holds none of the session's locks). Wakes
//! during that first poll are queued as any other (the session woken by the transfer's event
//! pushed runs again after its own poll), and the queue stays with the outermost poll. A framed
//! session relies on it: each transfer's checks (a same-node copy: all of it, its event pushed)
//! run as its request is read, so the outbox's backlog grows while the session reads and stops
//! its reading (`daemon_local_inline::a_client_that_reads_no_events…`); deferred to the session's
//! poll's end, a session would read every request the client sent before any of them started,
//! each one's start queued meanwhile.
//!
//! # After the poll
//! What a poll must do once it has ended — with its future idle, so that a wake it causes polls
//! the future wherever that wake comes from, and alive, so that it may use what the future owns —
//! it asks for with [`after_this_poll`]: a framed session's first read handed to the serving
//! thread (`crate::poller::Watching::hand_over`) renews its socket's registration so.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Wake, Waker};

/// Not being polled.
const IDLE: u8 = 0;
/// Being polled by some thread.
const POLLING: u8 = 1;
/// Being polled, and woken meanwhile: the polling thread polls once more.
const AGAIN: u8 = 2;

type Task = Pin<Box<dyn Future<Output = ()> + Send>>;

/// What one poll asked to run after it ([`after_this_poll`]).
type AfterList = Vec<Box<dyn FnOnce()>>;

thread_local! {
    /// Whether this thread is inside an [`Inline`]'s poll (the module's "No poll inside a poll").
    static POLLING_HERE: Cell<bool> = const { Cell::new(false) };
    /// Futures woken meanwhile, polled by the outermost poll once it returned.
    static WOKEN_HERE: RefCell<VecDeque<Arc<Inline>>> = const { RefCell::new(VecDeque::new()) };
    /// What the poll in progress on this thread asked to run once it ended ([`after_this_poll`]);
    /// `None` outside any poll. Each poll keeps its own (a poll nested in another's saves and
    /// restores the outer one's: `AfterPoll`).
    static AFTER_POLL: RefCell<Option<AfterList>> = const { RefCell::new(None) };
}

/// Runs `f` once the [`Inline`] poll in progress on this thread has ended with its future
/// waiting and no wake pending: the future is idle, so a wake that `f` causes polls it wherever
/// that wake comes from, and still alive and not polled until `f` returns, so `f` may use what
/// the future owns (a socket's descriptor number). Not run when the future completed, nor when
/// it was woken during the poll (it is polled again, and that poll asks again). Outside an
/// `Inline`'s poll, `f` runs now.
pub fn after_this_poll(f: impl FnOnce() + 'static) {
    let f = AFTER_POLL.with(|a| match &mut *a.borrow_mut() {
        Some(list) => {
            list.push(Box::new(f));
            None
        }
        None => Some(f),
    });
    if let Some(f) = f {
        f();
    }
}

/// One poll's list for [`after_this_poll`], the outer poll's (if any) put back when it ends
/// (also when the poll panics).
struct AfterPoll(Option<Option<AfterList>>);

impl AfterPoll {
    fn enter() -> AfterPoll {
        AfterPoll(Some(AFTER_POLL.with(|a| a.replace(Some(Vec::new())))))
    }

    /// This poll's list; the outer one back in place.
    fn leave(mut self) -> AfterList {
        let outer = self.0.take().flatten();
        AFTER_POLL.with(|a| a.replace(outer)).unwrap_or_default()
    }
}

impl Drop for AfterPoll {
    fn drop(&mut self) {
        if let Some(outer) = self.0.take() {
            AFTER_POLL.with(|a| *a.borrow_mut() = outer);
        }
    }
}

/// Marks the thread as polling until dropped (also when a poll panics: later wakes on this thread
/// poll again, and the queue is left to the next outermost poll).
struct PollingHere;

impl PollingHere {
    /// `None` when the thread is polling already (the caller queues its future instead).
    /// (Not `then_some(PollingHere)`: its argument is made either way, and its drop when not
    /// returned marked the thread as not polling, so that only the first wake inside a poll was
    /// queued and later ones were polled inside it; session 32.)
    fn enter() -> Option<PollingHere> {
        POLLING_HERE.with(|p| if p.replace(true) { None } else { Some(PollingHere) })
    }
}

impl Drop for PollingHere {
    fn drop(&mut self) {
        POLLING_HERE.with(|p| p.set(false));
    }
}

/// A future polled by whoever wakes it, until it completes or is stopped.
pub struct Inline {
    state: AtomicU8,
    /// `None` once completed or stopped.
    future: Mutex<Option<Task>>,
    /// The runtime whose context each poll enters, if any.
    runtime: Option<tokio::runtime::Handle>,
    /// While held, the future is not polled on the poller's thread (`runtime` polls it).
    off_poller: Option<Arc<OffPoller>>,
}

/// Holds an [`Inline`] future off the poller's thread while any [`OffPollerHold`] lives.
#[derive(Debug, Default)]
pub struct OffPoller(AtomicUsize);

impl OffPoller {
    /// Until the hold is dropped, a wake on the poller's thread hands the poll to the runtime.
    /// (Await [`off_poller`] after taking it to leave the poller's thread at once.)
    pub fn hold(self: &Arc<Self>) -> OffPollerHold {
        self.0.fetch_add(1, Ordering::AcqRel);
        OffPollerHold(self.clone())
    }

    /// Whether a hold lives now.
    pub fn held(&self) -> bool {
        self.0.load(Ordering::Acquire) > 0
    }
}

/// See [`OffPoller::hold`].
#[derive(Debug)]
pub struct OffPollerHold(Arc<OffPoller>);

impl Drop for OffPollerHold {
    fn drop(&mut self) {
        self.0.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Resolves at once off the poller's thread; on it, wakes its task and yields, so that a future
/// whose [`OffPoller`] is held is polled again by the runtime. (Elsewhere a no-op.)
pub async fn off_poller() {
    std::future::poll_fn(|cx| {
        if crate::poller::keep_off_here() {
            cx.waker().wake_by_ref();
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await
}

impl Inline {
    /// Polls `future` once now (on the calling thread), then each time it is woken.
    pub fn start(future: impl Future<Output = ()> + Send + 'static) -> Arc<Inline> {
        Inline::begin(future, None, None)
    }

    /// As [`Inline::start`], each poll inside `runtime`'s context (timers and I/O may be
    /// created and awaited, whichever thread polls).
    pub fn start_in(
        runtime: tokio::runtime::Handle,
        future: impl Future<Output = ()> + Send + 'static,
    ) -> Arc<Inline> {
        Inline::begin(future, Some(runtime), None)
    }

    /// As [`Inline::start_in`], never polled on the poller's thread while `off` is held: a
    /// wake there spawns the poll on `runtime`.
    pub fn start_served(
        runtime: tokio::runtime::Handle,
        off: Arc<OffPoller>,
        future: impl Future<Output = ()> + Send + 'static,
    ) -> Arc<Inline> {
        Inline::begin(future, Some(runtime), Some(off))
    }

    fn begin(
        future: impl Future<Output = ()> + Send + 'static,
        runtime: Option<tokio::runtime::Handle>,
        off_poller: Option<Arc<OffPoller>>,
    ) -> Arc<Inline> {
        let task = Arc::new(Inline {
            state: AtomicU8::new(IDLE),
            future: Mutex::new(Some(Box::pin(future))),
            runtime,
            off_poller,
        });
        task.clone().run_first();
        task
    }

    /// Drops the future (its channel waits with it), after the poll in progress if one is (never
    /// call it from the future itself). A future that completed is gone already.
    pub fn stop(&self) {
        let taken = self.future.lock().unwrap_or_else(|e| e.into_inner()).take();
        drop(taken);
    }

    /// No thread is polling the future now (tests: wait for a poll on another thread to end).
    #[cfg(test)]
    pub(crate) fn idle(&self) -> bool {
        self.state.load(Ordering::Acquire) == IDLE
    }

    /// Whether the future completed (or was stopped).
    pub fn finished(&self) -> bool {
        self.future.lock().unwrap_or_else(|e| e.into_inner()).is_none()
    }

    /// A wake's poll: now, or queued when this thread is polling some `Inline` already.
    fn run(self: Arc<Self>) {
        let Some(_polling) = PollingHere::enter() else {
            WOKEN_HERE.with(|q| q.borrow_mut().push_back(self));
            return;
        };
        self.run_here();
        Inline::run_woken_here();
    }

    /// A start's first poll: now, also inside another's poll (the module's "No poll inside a
    /// poll"); inside one, what it wakes stays queued for the outermost poll.
    fn run_first(self: Arc<Self>) {
        match PollingHere::enter() {
            Some(_polling) => {
                self.run_here();
                Inline::run_woken_here();
            }
            None => self.run_here(),
        }
    }

    /// Polls what was woken on this thread during the poll that just ended, in order (and what
    /// those polls wake in turn).
    fn run_woken_here() {
        while let Some(next) = WOKEN_HERE.with(|q| q.borrow_mut().pop_front()) {
            next.run_here();
        }
    }

    /// Polls the future on this thread (the caller made sure no other poll is in progress here).
    fn run_here(self: Arc<Self>) {
        // One thread polls at a time; a wake during its poll makes it poll again (none is lost).
        let mut cur = self.state.load(Ordering::Acquire);
        loop {
            let next = if cur == IDLE { POLLING } else { AGAIN };
            match self
                .state
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) if next == AGAIN => return,
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        let waker = Waker::from(self.clone());
        let mut cx = Context::from_waker(&waker);
        let _context = self.runtime.as_ref().map(|r| r.enter());
        loop {
            if let (Some(off), Some(rt)) = (&self.off_poller, &self.runtime)
                && off.held()
                && crate::poller::keep_off_here()
            {
                // Held off the poller's thread: a worker polls it (a wake meanwhile, here or
                // there, polls it again or finds it being polled: none is lost).
                self.state.store(IDLE, Ordering::Release);
                let task = self.clone();
                rt.spawn(async move { task.run() });
                return;
            }
            let mut slot = self.future.lock().unwrap_or_else(|e| e.into_inner());
            let asked = AfterPoll::enter();
            if let Some(f) = slot.as_mut()
                && f.as_mut().poll(&mut cx).is_ready()
            {
                *slot = None;
            }
            let after = asked.leave();
            if self
                .state
                .compare_exchange(POLLING, IDLE, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                // Idle, and held (`slot`) until these ran: `after_this_poll`.
                if slot.is_some() {
                    for f in after {
                        f();
                    }
                }
                return;
            }
            drop(slot);
            // Woken while polling: poll again (what this poll asked to run after it, the next
            // asks again).
            self.state.store(POLLING, Ordering::Release);
        }
    }
}

impl Wake for Inline {
    fn wake(self: Arc<Self>) {
        self.run();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use tokio::sync::{broadcast, watch};

    #[test]
    fn a_watch_send_runs_the_future_on_the_sending_thread() {
        let (tx, mut rx) = watch::channel(0u32);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        let task = Inline::start(async move {
            let v = *rx.wait_for(|v| *v >= 3).await.unwrap();
            s.lock().unwrap().push((v, std::thread::current().id()));
        });
        assert!(!task.finished());
        let sender = std::thread::spawn(move || {
            for v in 1..=3 {
                tx.send(v).unwrap();
            }
            std::thread::current().id()
        })
        .join()
        .unwrap();
        assert!(task.finished());
        assert_eq!(*seen.lock().unwrap(), vec![(3, sender)]);
    }

    #[test]
    fn start_in_polls_inside_the_runtime_whichever_thread_wakes_it() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_time()
            .build()
            .unwrap();
        let (tx, mut rx) = watch::channel(0u32);
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let task = Inline::start_in(rt.handle().clone(), async move {
            rx.wait_for(|v| *v == 1).await.unwrap();
            // Polled by the plain thread below: a timer needs the runtime's context.
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            done_tx.send(std::thread::current().id()).unwrap();
        });
        let waker = std::thread::spawn(move || {
            tx.send(1).unwrap();
            std::thread::current().id()
        })
        .join()
        .unwrap();
        let finisher = done_rx
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("the timer fired");
        // The sleep's end was polled by the runtime's timer, not the thread that sent.
        assert_ne!(finisher, waker);
        drop(task);
    }

    /// A future woken while the thread polls another (a delivery pushing its event wakes its
    /// session while holding the session's lock of delivered tags, which the session then takes)
    /// is polled after that poll returned, on the same thread: no deadlock, nothing lost.
    #[test]
    fn a_future_woken_inside_another_poll_runs_after_it_on_the_same_thread() {
        let tags = Arc::new(Mutex::new(Vec::<u32>::new()));
        let rung = Arc::new(tokio::sync::Notify::new());
        let (reaped_tx, reaped) = std::sync::mpsc::channel::<(Vec<u32>, std::thread::ThreadId)>();
        let (t, r) = (tags.clone(), rung.clone());
        let session = Inline::start(async move {
            loop {
                r.notified().await;
                let got = std::mem::take(&mut *t.lock().unwrap());
                reaped_tx.send((got, std::thread::current().id())).unwrap();
            }
        });
        let (tx, mut rx) = watch::channel(0u32);
        let (t, r) = (tags.clone(), rung.clone());
        let delivery = Inline::start(async move {
            for want in 1..=2u32 {
                let v = *rx.wait_for(|v| *v >= want).await.unwrap();
                let mut held = t.lock().unwrap();
                held.push(v);
                r.notify_one(); // wakes the session while `held` is locked
                drop(held);
            }
        });
        let sender = std::thread::spawn(move || {
            tx.send(1).unwrap();
            tx.send(2).unwrap();
            std::thread::current().id()
        });
        // (a deadlock leaves the sender stuck: the waits time out before the join)
        let wait = || {
            reaped
                .recv_timeout(std::time::Duration::from_secs(10))
                .expect("the session reaped")
        };
        let mut seen = wait().0;
        let (more, on) = wait();
        seen.extend(more);
        let sender = sender.join().unwrap();
        assert_eq!(seen, vec![1, 2]);
        assert_eq!(
            on, sender,
            "polled on the waking thread, after the delivery's poll"
        );
        assert!(delivery.finished());
        session.stop();
    }

    /// What a poll asks to run after it runs once that poll ended with the future idle and no
    /// wake pending: after a poll during which another thread woke the future, only after the
    /// next; not at all when the future completed; at once outside any poll.
    #[test]
    fn after_this_poll_runs_once_the_poll_ended_idle() {
        let log = Arc::new(Mutex::new(Vec::<String>::new()));
        let (tx, mut rx) = watch::channel(0u32);
        let l = log.clone();
        let task = Inline::start(async move {
            let mut polls = 0;
            std::future::poll_fn(|cx| {
                polls += 1;
                let (l2, n) = (l.clone(), polls);
                after_this_poll(move || l2.lock().unwrap().push(format!("after poll {n}")));
                l.lock().unwrap().push(format!("poll {n} ends"));
                if polls == 1 {
                    // Woken by another thread during its poll: polled again at once, here; poll
                    // 1's ask is dropped.
                    let w = cx.waker().clone();
                    std::thread::spawn(move || w.wake()).join().unwrap();
                }
                if polls < 3 {
                    std::task::Poll::Pending
                } else {
                    std::task::Poll::Ready(())
                }
            })
            .await;
            rx.changed().await.unwrap();
        });
        assert_eq!(
            *log.lock().unwrap(),
            ["poll 1 ends", "poll 2 ends", "after poll 2"]
        );
        assert!(task.idle());
        // Poll 3 completes the poll_fn, then waits on the channel: its ask runs after it.
        task.clone().run();
        assert_eq!(log.lock().unwrap().len(), 5);
        assert_eq!(log.lock().unwrap()[4], "after poll 3");
        // A poll that completes the future runs nothing after it.
        let l = log.clone();
        let done = Inline::start(async move {
            let l2 = l.clone();
            after_this_poll(move || l2.lock().unwrap().push("after the last poll".into()));
        });
        assert!(done.finished());
        assert_eq!(log.lock().unwrap().len(), 5);
        // Outside any poll: at once.
        let l = log.clone();
        after_this_poll(move || l.lock().unwrap().push("now".into()));
        assert_eq!(log.lock().unwrap().last().map(String::as_str), Some("now"));
        tx.send(1).unwrap();
        assert!(task.finished());
    }

    /// Two futures woken inside a third's poll both run after it, in order, never inside it
    /// (with `then_some` the first wake's queueing marked the thread as not polling, and the
    /// second was polled inside the outer poll).
    #[test]
    fn every_wake_inside_a_poll_waits_for_its_end() {
        let outer_running = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::<(u32, usize)>::new()));
        let mut inner = Vec::new();
        let mut senders = Vec::new();
        for id in 1..=2u32 {
            let (tx, mut rx) = watch::channel(0u32);
            let (o, s) = (outer_running.clone(), seen.clone());
            inner.push(Inline::start(async move {
                rx.changed().await.unwrap();
                s.lock().unwrap().push((id, o.load(Ordering::SeqCst)));
            }));
            senders.push(tx);
        }
        let (go, mut gone) = watch::channel(0u32);
        let o = outer_running.clone();
        let outer = Inline::start(async move {
            gone.changed().await.unwrap();
            o.store(1, Ordering::SeqCst);
            for tx in &senders {
                tx.send(1).unwrap();
            }
            o.store(0, Ordering::SeqCst);
        });
        go.send(1).unwrap();
        assert!(outer.finished());
        assert_eq!(
            *seen.lock().unwrap(),
            vec![(1, 0), (2, 0)],
            "polled after the outer poll, in order"
        );
        assert!(inner.iter().all(|t| t.finished()));
    }

    /// A start inside another's poll polls its future there, at once (a framed session's
    /// transfer start: its checks and a same-node copy's event as the request is read); what
    /// that first poll wakes runs after the outer poll, and a later wake of the started future
    /// inside the outer poll waits for its end too.
    #[test]
    fn a_start_inside_a_poll_polls_now_and_what_it_wakes_waits() {
        let outer_running = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::<(&'static str, usize)>::new()));
        let (woken_tx, mut woken_rx) = watch::channel(0u32);
        let (o, s) = (outer_running.clone(), seen.clone());
        let woken = Inline::start(async move {
            woken_rx.changed().await.unwrap();
            s.lock()
                .unwrap()
                .push(("woken by the first poll", o.load(Ordering::SeqCst)));
        });
        let (go, mut gone) = watch::channel(0u32);
        let (o, s) = (outer_running.clone(), seen.clone());
        let outer = Inline::start(async move {
            gone.changed().await.unwrap();
            o.store(1, Ordering::SeqCst);
            let (again_tx, mut again_rx) = watch::channel(0u32);
            let (o2, s2) = (o.clone(), s.clone());
            let started = Inline::start(async move {
                s2.lock().unwrap().push(("first poll", o2.load(Ordering::SeqCst)));
                woken_tx.send(1).unwrap();
                again_rx.changed().await.unwrap();
                s2.lock()
                    .unwrap()
                    .push(("second poll", o2.load(Ordering::SeqCst)));
            });
            s.lock().unwrap().push(("started", o.load(Ordering::SeqCst)));
            again_tx.send(1).unwrap();
            assert!(!started.finished(), "its wake waits for this poll's end");
            o.store(0, Ordering::SeqCst);
            // (the started future's wakers hold it)
            drop(started);
            drop(again_tx);
        });
        go.send(1).unwrap();
        assert!(outer.finished());
        assert!(woken.finished());
        assert_eq!(
            *seen.lock().unwrap(),
            vec![
                ("first poll", 1),
                ("started", 1),
                ("woken by the first poll", 0),
                ("second poll", 0)
            ]
        );
    }

    #[test]
    fn a_future_ready_at_once_completes_in_start() {
        let (tx, mut rx) = watch::channel(5u32);
        let hits = Arc::new(AtomicUsize::new(0));
        let h = hits.clone();
        let task = Inline::start(async move {
            rx.wait_for(|v| *v == 5).await.unwrap();
            h.fetch_add(1, Ordering::SeqCst);
        });
        assert!(task.finished());
        // (its receiver went with the future: nothing runs again)
        assert!(tx.send(6).is_err());
        assert_eq!(hits.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn broadcast_items_are_taken_in_order_and_stop_ends_it() {
        let (tx, mut rx) = broadcast::channel(16);
        let got = Arc::new(Mutex::new(Vec::new()));
        let g = got.clone();
        let task = Inline::start(async move {
            while let Ok(v) = rx.recv().await {
                g.lock().unwrap().push(v);
            }
        });
        for v in 0..10u32 {
            tx.send(v).unwrap();
        }
        assert_eq!(*got.lock().unwrap(), (0..10).collect::<Vec<_>>());
        task.stop();
        assert!(task.finished());
        // Its receiver is gone with it.
        assert_eq!(tx.receiver_count(), 0);
    }

    #[test]
    fn wakes_from_many_threads_lose_nothing() {
        let (tx, rx) = broadcast::channel(1 << 16);
        let count = Arc::new(AtomicUsize::new(0));
        let c = count.clone();
        let mut rx = rx;
        let _task = Inline::start(async move {
            while rx.recv().await.is_ok() {
                c.fetch_add(1, Ordering::SeqCst);
            }
        });
        let senders: Vec<_> = (0..4)
            .map(|_| {
                let tx = tx.clone();
                std::thread::spawn(move || {
                    for v in 0..2000u32 {
                        tx.send(v).unwrap();
                    }
                })
            })
            .collect();
        for s in senders {
            s.join().unwrap();
        }
        assert_eq!(count.load(Ordering::SeqCst), 8000);
    }
}
