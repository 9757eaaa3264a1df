//! Where the poller waits when a pass made no progress, and how it is woken: an epoll set
//! (`mio::Poll`) holding an eventfd (`mio::Waker`) that the command channel's senders ring and
//! the pairings' direct control sockets (`direct.rs`), which the poller reads itself. A control
//! message from a peer therefore costs one thread wake-up when the poller is parked (the kernel
//! wakes it in `epoll_wait`) and none when it is running passes (the next pass's zero-timeout
//! look finds the socket readable); a command from the async side costs one eventfd write, and
//! only when the poller is waiting. With `runtime.poller_sessions` the set also holds the framed
//! local sessions' sockets (`sessions.rs`): a client's request wakes a parked poller the same
//! way, and the session is polled on the poller's thread at the start of the next pass.
//!
//! # State
//! [`Bell`] holds where the poller is, written by the poller only:
//! - `AWAKE`: running passes. Senders ring nothing; each pass begins with a zero-timeout
//!   `epoll_wait` (`Park::look`) for the direct sockets, when some pairing has one, or a framed
//!   session's socket is watched, wakes the sessions it reported (`Park::serve_sessions`: the
//!   commands they make are taken by the same pass), and takes commands with `try_recv`.
//! - `NAPPING`: stalled with bytes in flight, sleeping [`crate::idle::NAP`] in `park_timeout`
//!   (epoll's timeout has millisecond resolution). A sender unparks the thread; a socket
//!   becoming readable waits for the nap's end (≤ 50 µs, only during a stall).
//! - `IN_EPOLL`: parked in `epoll_wait` until the next timer is due, with no timeout when none
//!   is: nothing in flight. A sender writes the eventfd; a direct socket's data wakes it by
//!   itself. An idle daemon therefore blocks here with no timeout-spin: no CPU, waking for its
//!   timers only.
//!
//! # Why no timer is missed
//! Everything the poller does when no command or socket asks it to is due at a time it knows
//! when it parks: the engine's deadlines, orphaned eager data's header timeout, the drain's
//! grace period and the idle lanes' and pairings' closes (`Engine::next_deadline`), and the
//! poller's own one, a pairing whose control stream ended while its direct connection stayed
//! open, failed [`super::direct::STREAM_END_GRACE`] later (`Poller::stream_end_due`). The park
//! waits until the earliest. Everything else reaches the poller as a command (the bell) or a
//! direct socket's data (epoll): the API's and the peers' streams, the heartbeat's silence
//! (`Command::PeerDown`, from the stream's reader), a direct connection handed over; work the
//! poller started (posted requests, unpacks, host copies, lanes connecting or accepting) keeps
//! it out of the park (`busy`). Until session 22 the park was capped at 1 s (`PARK_MAX`), which
//! only the stream-end grace needed: a timer added outside `next_deadline` must join
//! `stream_end_due`'s minimum, or it fires only at the next command.
//!
//! With `runtime.session_thread` the sessions' sockets and rings are the sessions thread's
//! (`session_thread.rs`), and a fast start it queues for the poller is a command of its own kind:
//! put in the hub (`queued` set), then the bell rung if the poller waits, exactly as a command on
//! the channel; the wait reads `queued` after its fence, as it tries the channel.
//!
//! # Why no wake-up is lost
//! A sender puts the command on the channel, then (a `SeqCst` fence between) reads the state;
//! the poller writes the state, then (a `SeqCst` fence between) tries the channel once more and
//! waits only if it is empty. Of two threads each writing one location and then reading the
//! other's across a `SeqCst` fence, at least one reads the other's write: either the poller's
//! last try finds the command (it does not wait), or the sender sees `NAPPING` / `IN_EPOLL` and
//! rings. A ring before the wait begins is not lost either: the eventfd's write puts the waker
//! on epoll's ready list at once (so the coming `epoll_wait` returns), and an `unpark` before
//! `park_timeout` makes it return at once. A ring the poller did not need (it found the command
//! itself) costs one spurious pass. Data on a direct socket needs no ring: epoll reports it
//! whenever the poller looks (edge-triggered; the poller reads until a short read or
//! `WouldBlock`, and any byte arriving later raises a new edge). A session's socket is the same
//! (`sessions.rs`, "Why no request is missed"): its tokens are kept apart in the park
//! (`sessions_ready`) until the next pass wakes them, whichever `epoll_wait` reported them.
//!
//! # Shutdown
//! The poller ends when every [`PollerTx`] is gone (the channel disconnects, and the last one
//! rings on its way out, so a parked poller sees it at once) or when a drain ends (`peers.rs`).
//! Framed sessions still watched then are woken by nothing more (`sessions.rs`, "Shutdown").

use std::io;
use std::sync::atomic::{AtomicU8, Ordering, fence};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use mio::{Events, Interest, Poll, Token, Waker};

use super::Command;
use super::rings::RingWatch;
use super::session_thread::{Hub, SessionsSide};
use super::sessions::{self, SessionWatch};
use crate::engine::PeerIdx;

const AWAKE: u8 = 0;
const NAPPING: u8 = 1;
const IN_EPOLL: u8 = 2;

/// The command channel's eventfd.
const WAKE: Token = Token(usize::MAX);

// A direct socket's token carries its pairing and the link's generation (`Park::register`).
const _: () = assert!(usize::BITS >= 64, "tokens pack a pairing and a generation");

/// How the poller is woken: where it waits, the eventfd, its thread.
pub(super) struct Bell {
    state: AtomicU8,
    waker: Waker,
    thread: OnceLock<std::thread::Thread>,
}

impl Bell {
    /// After a command went on the channel (or a fast start in the sessions thread's hub, or a
    /// lane thread's report): wakes the poller if it waits (see the module's "Why no wake-up is
    /// lost").
    pub(super) fn ring_if_waiting(&self) {
        fence(Ordering::SeqCst);
        match self.state.load(Ordering::Relaxed) {
            NAPPING => self.unpark(),
            IN_EPOLL => self.wake(),
            _ => {}
        }
    }

    /// Whether the poller is running passes (not napping or parked): it has work in flight,
    /// or lingers after it (the sessions thread lingers meanwhile too, `session_thread.rs`).
    pub(super) fn awake(&self) -> bool {
        self.state.load(Ordering::Relaxed) == AWAKE
    }

    fn wake(&self) {
        if let Err(e) = self.waker.wake() {
            tracing::warn!("could not wake the poller: {e}");
        }
    }

    fn unpark(&self) {
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }
}

/// The poller has stopped: a command sent now is dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the poller has stopped")]
pub struct Stopped;

/// The sending side of the poller's command channel: every sender wakes a waiting poller.
#[derive(Clone)]
pub struct PollerTx(Arc<TxInner>);

struct TxInner {
    /// `None` only while dropping.
    tx: Option<mpsc::Sender<Command>>,
    bell: Arc<Bell>,
    /// With `runtime.poller_sessions`: where framed sessions put their sockets (`sessions.rs`).
    sessions: Option<Arc<SessionWatch>>,
    /// Where framed sessions put their request rings (`rings.rs`).
    rings: Arc<RingWatch>,
    /// `runtime.session_thread`: the sessions are served on the sessions thread.
    threaded: bool,
}

impl PollerTx {
    /// Puts `cmd` on the channel and wakes the poller if it waits; `Err` when it has stopped
    /// (the command is dropped: its reply channel tells its sender).
    pub fn send(&self, cmd: Command) -> Result<(), Stopped> {
        let tx = self.0.tx.as_ref().expect("set until dropped");
        tx.send(cmd).map_err(|_| Stopped)?;
        self.0.bell.ring_if_waiting();
        Ok(())
    }

    /// Where a framed session puts its socket to be served on the poller's thread; `None` when
    /// `runtime.poller_sessions` is off (sessions run on the runtime).
    pub fn sessions(&self) -> Option<&Arc<SessionWatch>> {
        self.0.sessions.as_ref()
    }

    /// Where a framed session puts its request ring, looked at every pass (`rings.rs`).
    pub fn rings(&self) -> &Arc<RingWatch> {
        &self.0.rings
    }

    /// Whether the framed sessions are served on a thread of their own
    /// (`runtime.session_thread`, `session_thread.rs`), not the poller's.
    pub fn session_thread(&self) -> bool {
        self.0.threaded
    }
}

impl Drop for TxInner {
    fn drop(&mut self) {
        // The last sender: disconnect first, then ring whatever the state, so a poller that
        // waits (or is about to) sees the channel's end at once and shuts down.
        self.tx = None;
        self.bell.wake();
        self.bell.unpark();
    }
}

/// How long the poller waits.
#[derive(Debug, Clone, Copy)]
pub(super) enum Wait {
    /// Stalled with bytes in flight: a short sleep a command ends.
    Nap(Duration),
    /// Nothing in flight: until a command, a direct socket's data or this long (`None`: no
    /// timer is due; see the module's "Why no timer is missed").
    Park(Option<Duration>),
}

/// What ended a wait.
pub(super) enum Woken {
    /// The channel held a command after all (handle it now).
    Command(Command),
    /// A ring, a socket, the timeout: the next pass looks.
    Look,
    /// A request ring held an entry its session waits for: no wait (the next pass wakes it).
    Ring,
    /// Every sender is gone.
    Disconnected,
}

/// The poller's side: its epoll set and what it reported.
pub(super) struct Park {
    poll: Poll,
    events: Events,
    bell: Arc<Bell>,
    next_generation: u32,
    /// Framed sessions' sockets in the set (`sessions.rs`), and those epoll reported readable,
    /// woken at the start of the next pass (`serve_sessions`). `None` with a sessions thread.
    sessions: Option<Arc<SessionWatch>>,
    /// With `runtime.session_thread`: what the poller and the sessions thread hand each other
    /// (`session_thread.rs`); the rings are that thread's to look at then, not the poller's.
    hub: Option<Arc<Hub>>,
    sessions_ready: Vec<Token>,
    /// Scratch for their wakers while the sessions' map is locked (kept: no allocation a pass).
    session_wakers: Vec<std::task::Waker>,
    /// The framed sessions' request rings (`rings.rs`): looked at every pass, told when the
    /// poller waits.
    rings: Arc<RingWatch>,
    /// With `runtime.lane_thread`: where the lane thread leaves what completed
    /// (`lane_thread.rs`); looked at as the channel is before a wait.
    lanes: Option<Arc<super::lane_thread::LaneBox>>,
}

impl Park {
    /// The epoll set with the channel's eventfd in it, and the channel's first sender.
    /// `serve_sessions`: framed sessions may put their sockets in the set (`sessions.rs`);
    /// `session_thread` too: in the sessions thread's set instead, whose side comes third.
    pub(super) fn new(
        tx: mpsc::Sender<Command>,
        serve_sessions: bool,
        session_thread: bool,
    ) -> io::Result<(Park, PollerTx, Option<SessionsSide>)> {
        let poll = Poll::new()?;
        let waker = Waker::new(poll.registry(), WAKE)?;
        let bell = Arc::new(Bell {
            state: AtomicU8::new(AWAKE),
            waker,
            thread: OnceLock::new(),
        });
        let rings = Arc::new(RingWatch::default());
        let (hub, side) = match serve_sessions && session_thread {
            true => {
                let (hub, side) = Hub::new(bell.clone(), rings.clone())?;
                (Some(hub), Some(side))
            }
            false => (None, None),
        };
        let sessions = match (&side, serve_sessions) {
            (Some(_), _) | (None, false) => None,
            (None, true) => Some(Arc::new(SessionWatch::new(poll.registry().try_clone()?))),
        };
        let watched = match &side {
            Some(side) => Some(side.watch().clone()),
            None => sessions.clone(),
        };
        let sender = PollerTx(Arc::new(TxInner {
            tx: Some(tx),
            bell: bell.clone(),
            sessions: watched,
            rings: rings.clone(),
            threaded: side.is_some(),
        }));
        let park = Park {
            poll,
            events: Events::with_capacity(256),
            bell,
            next_generation: 0,
            sessions,
            hub,
            sessions_ready: Vec::new(),
            session_wakers: Vec::new(),
            rings,
            lanes: None,
        };
        Ok((park, sender, side))
    }

    /// The bell the lane thread rings (`lane_thread.rs`).
    pub(super) fn bell(&self) -> Arc<Bell> {
        self.bell.clone()
    }

    /// Looks at the lane thread's events before each wait, as at the channel.
    pub(super) fn watch_lanes(&mut self, lanes: Arc<super::lane_thread::LaneBox>) {
        self.lanes = Some(lanes);
    }

    /// On the poller's thread, before its first pass: whom a sender unparks.
    pub(super) fn bind_thread(&self) {
        let _ = self.bell.thread.set(std::thread::current());
        sessions::mark_poller_thread();
        if self.hub.is_none() {
            sessions::mark_serving();
        }
    }

    /// With `runtime.session_thread`: the hub the sessions thread shares.
    pub(super) fn hub(&self) -> Option<&Arc<Hub>> {
        self.hub.as_ref()
    }

    /// Whether some framed session's socket is in the set: each pass looks at it then.
    pub(super) fn serves_sessions(&self) -> bool {
        self.sessions.as_ref().is_some_and(|s| s.any())
    }

    /// Wakes the sessions whose sockets were reported readable since the last call, and those
    /// whose request ring holds what they wait for (`rings.rs`): each served on the poller's
    /// thread is polled here, and the commands it makes are taken by this pass. True when one
    /// was woken: the pass made progress (a request served here that the engine never sees — a
    /// same-node copy, a notification on one node — still keeps the poller lingering).
    pub(super) fn serve_sessions(&mut self) -> bool {
        let mut woke = false;
        if let Some(s) = &self.sessions {
            woke |= s.wake(&mut self.sessions_ready, &mut self.session_wakers);
        }
        if self.hub.is_none() {
            woke |= self.rings.wake(&mut self.session_wakers);
        }
        woke
    }

    /// Adds a direct control socket to the set (readable, edge-triggered): the token its events
    /// will carry, unique to this link (`direct_peer` turns it back into the pairing).
    pub(super) fn register(&mut self, fd: std::os::fd::RawFd, peer: PeerIdx) -> io::Result<Token> {
        self.next_generation = self.next_generation.wrapping_add(1);
        debug_assert!(peer.0 < 1 << 31, "a pairing's token never has the session bit");
        let token = Token(((peer.0 as usize) << 32) | self.next_generation as usize);
        self.poll
            .registry()
            .register(&mut mio::unix::SourceFd(&fd), token, Interest::READABLE)?;
        Ok(token)
    }

    /// Collects the tokens of the direct sockets that became readable (or ended) into `ready`,
    /// waiting at most `timeout` (zero: only looks; `None`: until a socket or a ring).
    pub(super) fn look(&mut self, timeout: Option<Duration>, ready: &mut Vec<Token>) {
        match self.poll.poll(&mut self.events, timeout) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return,
            Err(e) => {
                // Not expected of epoll_wait with a valid set; never spin on it.
                tracing::warn!("the poller's epoll_wait failed: {e}");
                std::thread::sleep(crate::idle::NAP);
                return;
            }
        }
        for t in self.events.iter().map(|e| e.token()) {
            if t == WAKE {
                continue;
            }
            if t.0 & sessions::SESSION != 0 {
                self.sessions_ready.push(t);
            } else {
                ready.push(t);
            }
        }
    }

    /// Waits as `wait` says, unless the channel holds a command after all (see the module's
    /// "Why no wake-up is lost"). Readable direct sockets go to `ready`.
    pub(super) fn wait(&mut self, wait: Wait, rx: &mpsc::Receiver<Command>, ready: &mut Vec<Token>) -> Woken {
        let state = match wait {
            Wait::Nap(_) => NAPPING,
            Wait::Park(_) => IN_EPOLL,
        };
        self.bell.state.store(state, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        // What the lane threads reported meanwhile (lane_thread.rs): no wait.
        if self.lanes.as_ref().is_some_and(|l| l.pending()) {
            self.bell.state.store(AWAKE, Ordering::Relaxed);
            return Woken::Ring;
        }
        // A fast start the sessions thread queued meanwhile (session_thread.rs): no wait.
        if let Some(hub) = &self.hub {
            if hub.has_starts() {
                self.bell.state.store(AWAKE, Ordering::Relaxed);
                return Woken::Ring;
            }
        } else if self.rings.parking() {
            // The request rings say the poller may not look, then it looks once more (rings.rs).
            self.rings.unparked();
            self.bell.state.store(AWAKE, Ordering::Relaxed);
            return Woken::Ring;
        }
        let woken = match rx.try_recv() {
            Ok(cmd) => Woken::Command(cmd),
            Err(mpsc::TryRecvError::Disconnected) => Woken::Disconnected,
            Err(mpsc::TryRecvError::Empty) => {
                match wait {
                    Wait::Nap(d) => std::thread::park_timeout(d),
                    Wait::Park(d) => self.look(d, ready),
                }
                Woken::Look
            }
        };
        self.bell.state.store(AWAKE, Ordering::Relaxed);
        if self.hub.is_none() {
            self.rings.unparked();
        }
        woken
    }
}

/// The pairing a direct socket's token names, and the link's generation.
pub(super) fn direct_peer(token: Token) -> (PeerIdx, u32) {
    (PeerIdx((token.0 >> 32) as u32), token.0 as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Waits far longer than any test may take: only a ring, a socket or the channel's end can
    /// end it (a lost wake-up hangs the test, which nextest reports).
    const FOREVER: Duration = Duration::from_secs(3600);

    fn command(n: u64) -> Command {
        Command::StartIdsAt {
            lists: n,
            prepared: n,
        }
    }

    fn number(cmd: Command) -> u64 {
        match cmd {
            Command::StartIdsAt { lists, .. } => lists,
            _ => panic!("not a test command"),
        }
    }

    #[test]
    fn no_command_is_missed_by_a_poller_that_parks_or_naps_between_commands() {
        let (tx, rx) = mpsc::channel();
        let (mut park, sender, _) = Park::new(tx, false, false).unwrap();
        park.bind_thread();
        const N: u64 = 20_000;
        let from = std::thread::spawn(move || {
            for n in 0..N {
                sender.send(command(n)).unwrap();
                if n % 7 == 0 {
                    std::thread::yield_now();
                }
            }
        });
        let mut ready = Vec::new();
        let mut next = 0;
        let mut waits = 0u64;
        while next < N {
            match rx.try_recv() {
                Ok(cmd) => {
                    assert_eq!(number(cmd), next);
                    next += 1;
                    continue;
                }
                Err(mpsc::TryRecvError::Empty) => {}
                Err(mpsc::TryRecvError::Disconnected) => panic!("the sender ended early"),
            }
            // Every wait is an hour long: each command must end it (half parks, half naps).
            let wait = if waits.is_multiple_of(2) {
                Wait::Park(None)
            } else {
                Wait::Nap(FOREVER)
            };
            waits += 1;
            match park.wait(wait, &rx, &mut ready) {
                Woken::Command(cmd) => {
                    assert_eq!(number(cmd), next);
                    next += 1;
                }
                Woken::Look | Woken::Ring => {}
                Woken::Disconnected => panic!("the sender ended early"),
            }
        }
        from.join().unwrap();
        assert!(ready.is_empty(), "no socket was registered: {ready:?}");
    }

    #[test]
    fn the_last_sender_gone_wakes_a_parked_poller() {
        let (tx, rx) = mpsc::channel();
        let (mut park, sender, _) = Park::new(tx, false, false).unwrap();
        park.bind_thread();
        let other = sender.clone();
        let from = std::thread::spawn(move || {
            drop(other);
            std::thread::sleep(Duration::from_millis(20));
            drop(sender);
        });
        let mut ready = Vec::new();
        loop {
            match park.wait(Wait::Park(None), &rx, &mut ready) {
                Woken::Disconnected => break,
                Woken::Look | Woken::Ring => {}
                Woken::Command(_) => panic!("nothing was sent"),
            }
        }
        from.join().unwrap();
    }

    #[test]
    fn a_registered_socket_with_data_ends_a_park_and_is_reported_by_its_token() {
        use std::io::{Read, Write};
        use std::os::fd::AsRawFd;
        let (tx, rx) = mpsc::channel();
        let (mut park, _sender, _) = Park::new(tx, false, false).unwrap();
        let (mut a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        let token = park.register(b.as_raw_fd(), PeerIdx(7)).unwrap();
        assert_eq!(direct_peer(token).0, PeerIdx(7));
        let mut ready = Vec::new();
        for round in 0..3u8 {
            a.write_all(&[round; 5]).unwrap();
            while ready.is_empty() {
                assert!(matches!(
                    park.wait(Wait::Park(None), &rx, &mut ready),
                    Woken::Look
                ));
            }
            assert_eq!(ready, vec![token]);
            ready.clear();
            let mut got = [0u8; 16];
            assert_eq!(b.read(&mut got).unwrap(), 5, "round {round}");
            assert_eq!(&got[..5], &[round; 5]);
        }
        // The peer's end is reported too (its read then gives 0).
        drop(a);
        while ready.is_empty() {
            park.wait(Wait::Park(None), &rx, &mut ready);
        }
        assert_eq!(b.read(&mut [0u8; 4]).unwrap(), 0);
    }
}
