//! Framed local sessions served on the poller's thread (`runtime.poller_sessions`): the poller's
//! epoll set (`park.rs`) also holds the framed sessions' sockets, and when one is readable the
//! poller wakes that session right there, on its own thread, at the start of its pass. The
//! session's future is polled by the thread that wakes it (`crate::api::local::inline`), so the
//! request is read, decoded and checked, and its command put on the channel, on the poller's
//! thread — and taken by the same pass's command loop: no runtime worker woken by tokio's
//! reactor, no hand-over to the poller through its eventfd. A parked poller is woken by the
//! kernel at once (one wake-up where there were two: the worker's, then the poller's), a
//! spinning one finds the socket at its next zero-timeout look. Since session 29 the common
//! transfer request (a WRITE or READ batch to peers paired and up) skips the channel too: its
//! engine batch is queued on this thread and started right after the session's poll, in the same
//! pass (`fast_starts.rs`, `crate::api::session`'s `fast.rs`).
//!
//! With `runtime.session_thread` (session 30) the set is the sessions thread's instead
//! (`session_thread.rs`) and everything below holds with that thread in the poller's place: it is
//! the thread marked as serving the sessions ([`serving_sessions_here`]), it wakes them, and their
//! fast starts go to the poller through its hub.
//!
//! What a session does that could stall the poller runs on the runtime instead: the session
//! holds its task off this thread ([`crate::api::local::inline::OffPoller`]) for registrations,
//! prepared lists and requests larger than `crate::api::session::OFF_POLLER_BYTES`, and for the
//! rest of a burst once it has handled [`PASS_BUDGET`] requests in one of the poller's passes (a
//! client that writes thousands of small requests at once does not hold the data path).
//!
//! # State
//! [`SessionWatch`] is shared by the poller and the sessions: a clone of the epoll set's registry
//! (`epoll_ctl` is safe from any thread) and, per watched socket, the waker of the session's
//! last read that found nothing ([`Watched`]). A session adds its socket when it starts
//! ([`SessionWatch::watch`]) and removes it when its reader is dropped ([`Watching`]'s drop:
//! deregistered before its descriptors close, since epoll follows the open file, which the
//! session's other descriptors keep open). The poller only reads the map: the tokens epoll
//! reported (`Park::look`), each turned into its waker under the map's lock and woken after it
//! is released (a session woken here may itself add or remove a socket).
//!
//! # Why no request is missed
//! The socket is registered edge-triggered for reading: every arrival of bytes raises an edge,
//! which epoll reports at the poller's next look (or ends its park), whether or not earlier bytes
//! were read; the poller then wakes the waker stored for the socket at that moment (a stored
//! waker stays until another replaces it: a wake does not take it). A session's read
//! ([`Watched::poll`]) tries `recvmsg`; on `WouldBlock`:
//! - if its waker is the one stored already (stored by an earlier poll, so before this try:
//!   the session's waker is the same on every poll), it waits. Bytes that arrived before the
//!   try were read by it; bytes arriving after it raise an edge after the waker was stored, and
//!   the poller wakes that waker.
//! - if its waker is new (the first read, or the session is polled through another waker), it
//!   stores it, then tries once more, and waits only if that finds nothing too: bytes arriving
//!   between the first try and the store raised an edge the poller may have answered with the
//!   old waker (or none), and the second try reads them; bytes arriving after it are as above.
//!
//! So a session waiting for its next request makes one `recvmsg` that finds nothing, not two
//! (session 25; before, every `WouldBlock` was tried again after the store). A wake the session
//! did not need (it had read the bytes already) costs one poll that finds nothing.
//!
//! # Shutdown
//! The poller's thread ends after a drain or when its channel closes; sessions still open then
//! are woken by nothing on their socket (the daemon stops reading requests once it drains, and
//! a session that still drains its transfers learns of the client's going through its own
//! hang-up watch, `crate::api::local`). Their registrations go with the epoll set.

use std::cell::Cell;
use std::collections::HashMap;
use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Waker};

use mio::{Interest, Registry, Token};

/// A session socket's token has this bit set (a direct socket's token is its pairing's index
/// shifted up 32 bits, `Park::register`: pairings stay far below 2^31).
pub(super) const SESSION: usize = 1 << 63;

thread_local! {
    static ON_POLLER: Cell<bool> = const { Cell::new(false) };
    static SERVING: Cell<bool> = const { Cell::new(false) };
}

/// Marks the calling thread as the poller's (`Park::bind_thread`).
pub(super) fn mark_poller_thread() {
    ON_POLLER.with(|p| p.set(true));
}

/// Marks the calling thread as the one that serves the framed sessions: the poller's, or the
/// sessions thread (`runtime.session_thread`, `session_thread.rs`).
pub(super) fn mark_serving() {
    SERVING.with(|p| p.set(true));
}

/// Whether the calling thread is the poller's.
pub fn on_poller_thread() -> bool {
    ON_POLLER.with(|p| p.get())
}

/// Whether the calling thread serves the framed sessions (the poller's, or the sessions thread
/// with `runtime.session_thread`): where a session checks and queues its fast starts, and
/// counts its requests against the pass budget.
pub fn serving_sessions_here() -> bool {
    SERVING.with(|p| p.get())
}

/// Whether work that could stall a thread must leave the calling one for the runtime: the
/// poller's, and the sessions thread (`crate::api::local::inline::OffPoller`).
pub fn keep_off_here() -> bool {
    on_poller_thread() || serving_sessions_here()
}

/// Requests one session handles on the poller's thread in one pass; the rest of its burst goes
/// to the runtime (about 3–5 µs each: within the poller's `COMMAND_SLICE`-sized slices).
pub const PASS_BUDGET: u32 = 16;

/// A session's count of the requests it handled on the poller's thread in its current pass.
#[derive(Debug, Default)]
pub struct PassBudget {
    pass: u64,
    used: u32,
}

/// The framed sessions' sockets in the poller's epoll set.
pub struct SessionWatch {
    registry: Registry,
    next: AtomicU64,
    watched: Mutex<HashMap<usize, Arc<Watched>>>,
    /// Sockets watched now: the poller looks at its set each pass while there are any.
    count: AtomicUsize,
    /// Requests the watched sessions handled on the poller's thread, and off it (`counted`).
    on_poller: AtomicU64,
    off_poller: AtomicU64,
    /// The poller's passes (each `wake` call), for [`PassBudget`]; bursts sent to the runtime.
    pass: AtomicU64,
    over_budget: AtomicU64,
    /// Transfers the watched sessions started straight on the engine (`fast_starts.rs`).
    fast: AtomicU64,
}

/// One watched socket: the waker of the session's read that last found nothing.
#[derive(Default)]
pub struct Watched {
    waker: Mutex<Option<Waker>>,
}

impl Watched {
    /// Runs `read` (a non-blocking read of the socket); when it would block, waits if `cx`'s
    /// waker was stored already, else stores it and runs `read` once more (the module's "Why no
    /// request is missed"). `None`: wait for the wake.
    pub fn poll<T>(
        &self,
        cx: &mut Context<'_>,
        mut read: impl FnMut() -> io::Result<T>,
    ) -> Option<io::Result<T>> {
        match read() {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            done => return Some(done),
        }
        if !self.store(cx.waker()) {
            // Stored before the try above: an edge after it wakes this waker.
            return None;
        }
        match read() {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
            done => Some(done),
        }
    }

    /// Stores `waker` unless the one stored would wake the same task; `true` when it was new.
    fn store(&self, waker: &Waker) -> bool {
        let mut w = self.waker.lock().unwrap_or_else(|e| e.into_inner());
        match w.as_ref() {
            Some(old) if old.will_wake(waker) => false,
            _ => {
                *w = Some(waker.clone());
                true
            }
        }
    }

    fn waker(&self) -> Option<Waker> {
        self.waker.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// A socket's place in the poller's set, removed when dropped.
pub struct Watching {
    watch: Arc<SessionWatch>,
    token: usize,
    fd: RawFd,
    watched: Arc<Watched>,
}

impl Watching {
    pub fn watched(&self) -> &Watched {
        &self.watched
    }

    /// Hands the socket's next read to the thread that serves the sessions, from a thread that
    /// does not (the runtime worker a session starts on): `waker` is stored as a read that found
    /// nothing stores it; the [`Rearm`] returned renews the socket's registration
    /// (`EPOLL_CTL_MOD`), which reports it readable again at that thread's next look if bytes
    /// are there already (bytes that come later raise their own edge). Either way that thread
    /// then wakes `waker` and polls the session itself (the module's "Why no request is
    /// missed": the waker stored before the edge it answers). The caller runs the `Rearm` once
    /// its poll of the session has ended (`crate::api::local::inline::after_this_poll`): run
    /// inside it, the serving thread's wake found the session still being polled here, which
    /// then polled it again here and handed over again (a debug build counted 38 hand-overs a
    /// session on the 2-core VM).
    pub fn hand_over(&self, waker: &Waker) -> Rearm {
        self.watched.store(waker);
        Rearm {
            watch: self.watch.clone(),
            fd: self.fd,
            token: self.token,
        }
    }
}

/// A watched socket's registration to renew ([`Watching::hand_over`]). Run only while the socket
/// is still open and watched (its session's future alive).
pub struct Rearm {
    watch: Arc<SessionWatch>,
    fd: RawFd,
    token: usize,
}

impl Rearm {
    /// Renews the registration: epoll reports the socket again if it is readable now.
    pub fn run(self) -> io::Result<()> {
        self.watch.registry.reregister(
            &mut mio::unix::SourceFd(&self.fd),
            Token(self.token),
            Interest::READABLE,
        )
    }
}

impl Drop for Watching {
    fn drop(&mut self) {
        // Before the socket's descriptors close (the caller's field order): epoll follows the
        // open file, which another descriptor of the session may keep open.
        let _ = self.watch.registry.deregister(&mut mio::unix::SourceFd(&self.fd));
        self.watch.lock().remove(&self.token);
        self.watch.count.fetch_sub(1, Ordering::Release);
    }
}

impl SessionWatch {
    pub(crate) fn new(registry: Registry) -> SessionWatch {
        SessionWatch {
            registry,
            next: AtomicU64::new(0),
            watched: Mutex::new(HashMap::new()),
            count: AtomicUsize::new(0),
            on_poller: AtomicU64::new(0),
            off_poller: AtomicU64::new(0),
            pass: AtomicU64::new(0),
            over_budget: AtomicU64::new(0),
            fast: AtomicU64::new(0),
        }
    }

    /// Counts a request about to be handled by a watched session on the calling thread against
    /// its pass budget: `true` when it is on the poller's thread and over [`PASS_BUDGET`] in this
    /// pass (the session then goes on off the poller's thread).
    pub fn spend(&self, budget: &mut PassBudget) -> bool {
        if !serving_sessions_here() {
            return false;
        }
        let pass = self.pass.load(Ordering::Relaxed);
        if budget.pass != pass {
            *budget = PassBudget { pass, used: 0 };
        }
        budget.used += 1;
        let over = budget.used > PASS_BUDGET;
        if over {
            self.over_budget.fetch_add(1, Ordering::Relaxed);
        }
        over
    }

    /// Requests that went to the runtime because their session's burst was over the budget.
    pub fn over_budget(&self) -> u64 {
        self.over_budget.load(Ordering::Relaxed)
    }

    /// A watched session's transfer started straight on the engine (`fast_starts.rs`).
    pub fn count_fast(&self) {
        self.fast.fetch_add(1, Ordering::Relaxed);
    }

    /// Transfers the watched sessions started straight on the engine so far.
    pub fn fast_started(&self) -> u64 {
        self.fast.load(Ordering::Relaxed)
    }

    /// A watched session handles a request on the calling thread: counted as on the poller's
    /// thread or off it (what the tests and the logs read: `handled`).
    pub fn counted(&self) {
        let which = match serving_sessions_here() {
            true => &self.on_poller,
            false => &self.off_poller,
        };
        which.fetch_add(1, Ordering::Relaxed);
    }

    /// Requests handled so far on the poller's thread and off it, and the sockets watched now.
    pub fn handled(&self) -> (u64, u64, usize) {
        (
            self.on_poller.load(Ordering::Relaxed),
            self.off_poller.load(Ordering::Relaxed),
            self.count.load(Ordering::Acquire),
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<usize, Arc<Watched>>> {
        self.watched.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds a session's socket `fd` (non-blocking, kept open by the caller for as long as the
    /// returned [`Watching`] lives) to the poller's set.
    pub fn watch(self: &Arc<Self>, fd: RawFd) -> io::Result<Watching> {
        let seq = self.next.fetch_add(1, Ordering::Relaxed) as usize & !SESSION;
        let token = SESSION | seq;
        let watched = Arc::new(Watched::default());
        self.lock().insert(token, watched.clone());
        self.count.fetch_add(1, Ordering::Release);
        let watching = Watching {
            watch: self.clone(),
            token,
            fd,
            watched,
        };
        self.registry
            .register(&mut mio::unix::SourceFd(&fd), Token(token), Interest::READABLE)?;
        Ok(watching)
    }

    /// Whether any socket is watched (the poller then looks at its set every pass).
    pub(super) fn any(&self) -> bool {
        self.count.load(Ordering::Acquire) > 0
    }

    /// A new pass for the [`PassBudget`]s (the sessions thread's turn begins: what it serves
    /// before its look, `session_thread.rs`, is not counted with the turn before).
    pub(super) fn next_pass(&self) {
        self.pass.fetch_add(1, Ordering::Relaxed);
    }

    /// Wakes the sessions whose sockets epoll reported (on the poller's thread: each session's
    /// future is polled right here). `wakers` is the caller's scratch space (empty on return), so
    /// a pass allocates nothing. True when it woke one (work done: `RingWatch::wake`).
    pub(super) fn wake(&self, ready: &mut Vec<Token>, wakers: &mut Vec<Waker>) -> bool {
        self.pass.fetch_add(1, Ordering::Relaxed);
        if ready.is_empty() {
            return false;
        }
        {
            let map = self.lock();
            wakers.extend(ready.drain(..).filter_map(|t| map.get(&t.0)?.waker()));
        }
        let woke = !wakers.is_empty();
        for w in wakers.drain(..) {
            w.wake();
        }
        woke
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    use std::sync::atomic::AtomicUsize;
    use std::task::Wake;

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_read_that_finds_nothing_is_woken_by_the_next_bytes_and_a_dropped_watch_leaves_the_set() {
        let mut poll = mio::Poll::new().unwrap();
        let watch = Arc::new(SessionWatch::new(poll.registry().try_clone().unwrap()));
        let (mut client, server) = std::os::unix::net::UnixStream::pair().unwrap();
        server.set_nonblocking(true).unwrap();
        let watching = watch.watch(server.as_raw_fd()).unwrap();
        assert!(watch.any());
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        let mut events = mio::Events::with_capacity(8);
        let tries = Cell::new(0usize);
        let read = || {
            tries.set(tries.get() + 1);
            let mut b = [0u8; 8];
            (&server).read(&mut b)
        };
        for round in 1..=3usize {
            tries.set(0);
            assert!(watching.watched().poll(&mut cx, read).is_none(), "nothing yet");
            // The waker is stored by the first read that finds nothing (tried again after the
            // store); later ones find it stored already: one recvmsg each.
            assert_eq!(tries.get(), if round == 1 { 2 } else { 1 }, "round {round}");
            client.write_all(&[round as u8]).unwrap();
            let mut ready = Vec::new();
            while ready.is_empty() {
                poll.poll(&mut events, None).unwrap();
                ready.extend(events.iter().map(|e| e.token()));
            }
            assert!(ready.iter().all(|t| t.0 & SESSION != 0));
            assert!(
                watch.wake(&mut ready, &mut Vec::new()),
                "a session woken: work done"
            );
            assert_eq!(count.0.load(Ordering::SeqCst), round);
            assert!(
                !watch.wake(&mut ready, &mut Vec::new()),
                "nothing reported: no work"
            );
            match watching.watched().poll(&mut cx, read) {
                Some(Ok(1)) => {}
                other => panic!("round {round}: {other:?}"),
            }
        }
        drop(watching);
        assert!(!watch.any());
        assert!(watch.lock().is_empty());
        client.write_all(&[9]).unwrap();
        poll.poll(&mut events, Some(std::time::Duration::ZERO)).unwrap();
        assert!(events.is_empty(), "a removed socket is not reported");
    }

    /// A session's future woken on the poller's thread runs there; while it holds itself off
    /// (`OffPoller`) its polls go to a runtime worker, and back to the poller's thread after.
    #[test]
    fn a_future_held_off_the_poller_thread_is_polled_by_the_runtime_until_released() {
        use crate::api::local::inline::{Inline, OffPoller, off_poller};
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("test-worker")
            .build()
            .unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<bool>();
        let (seen_tx, seen) = std::sync::mpsc::channel::<(bool, bool)>();
        let off = Arc::new(OffPoller::default());
        let hold = off.clone();
        // Each message: whether to hold off; reports (held, polled on the poller's thread).
        let task = Inline::start_served(rt.handle().clone(), off, async move {
            while let Some(heavy) = rx.recv().await {
                let _held = heavy.then(|| hold.hold());
                if heavy {
                    off_poller().await;
                }
                seen_tx.send((heavy, on_poller_thread())).unwrap();
            }
        });
        let polled = task.clone();
        let poller = std::thread::spawn(move || {
            mark_poller_thread();
            mark_serving();
            let wait = || seen.recv_timeout(std::time::Duration::from_secs(30)).unwrap();
            for heavy in [false, true, false, true, false] {
                // The worker's poll that reported last has returned (bounded: 30 s).
                let end = std::time::Instant::now() + std::time::Duration::from_secs(30);
                while !polled.idle() {
                    assert!(std::time::Instant::now() < end, "a poll never ended");
                    std::thread::yield_now();
                }
                // The send wakes the future here, on the "poller's" thread.
                tx.send(heavy).unwrap();
                let got = wait();
                assert_eq!(got, (heavy, !heavy), "held: off the poller's thread; else on it");
            }
        });
        poller.join().unwrap();
        assert!(task.finished(), "the channel closed: the future ended");
    }

    #[test]
    fn bytes_that_came_before_the_waker_was_stored_are_read_by_the_second_try() {
        let poll = mio::Poll::new().unwrap();
        let watch = Arc::new(SessionWatch::new(poll.registry().try_clone().unwrap()));
        let (mut client, server) = std::os::unix::net::UnixStream::pair().unwrap();
        server.set_nonblocking(true).unwrap();
        let watching = watch.watch(server.as_raw_fd()).unwrap();
        let waker = Waker::noop();
        let mut cx = Context::from_waker(waker);
        let mut tries = 0;
        // The first try finds nothing; the bytes arrive before the second.
        let got = watching.watched().poll(&mut cx, || {
            tries += 1;
            if tries == 1 {
                let r = (&server).read(&mut [0u8; 4]);
                client.write_all(b"ab").unwrap();
                return r;
            }
            let mut b = [0u8; 4];
            (&server).read(&mut b)
        });
        assert!(matches!(got, Some(Ok(2))), "{got:?}");
    }

    /// A session polled through another waker (a different task): its first read that finds
    /// nothing stores the new waker and tries again; the next edge wakes the new one, not the old.
    #[test]
    fn a_new_waker_is_stored_and_tried_again_and_the_next_bytes_wake_it() {
        let mut poll = mio::Poll::new().unwrap();
        let watch = Arc::new(SessionWatch::new(poll.registry().try_clone().unwrap()));
        let (mut client, server) = std::os::unix::net::UnixStream::pair().unwrap();
        server.set_nonblocking(true).unwrap();
        let watching = watch.watch(server.as_raw_fd()).unwrap();
        let (old, new) = (
            Arc::new(Count(AtomicUsize::new(0))),
            Arc::new(Count(AtomicUsize::new(0))),
        );
        let tries = Cell::new(0usize);
        let read = || {
            tries.set(tries.get() + 1);
            (&server).read(&mut [0u8; 8])
        };
        let mut events = mio::Events::with_capacity(8);
        for (count, want_tries) in [(&old, 2), (&old, 1), (&new, 2), (&new, 1)] {
            tries.set(0);
            let waker = Waker::from(count.clone());
            assert!(
                watching
                    .watched()
                    .poll(&mut Context::from_waker(&waker), read)
                    .is_none()
            );
            assert_eq!(tries.get(), want_tries);
        }
        client.write_all(b"x").unwrap();
        let mut ready = Vec::new();
        while ready.is_empty() {
            poll.poll(&mut events, None).unwrap();
            ready.extend(events.iter().map(|e| e.token()));
        }
        watch.wake(&mut ready, &mut Vec::new());
        assert_eq!(
            (old.0.load(Ordering::SeqCst), new.0.load(Ordering::SeqCst)),
            (0, 1),
            "the waker stored last is woken"
        );
    }
}
