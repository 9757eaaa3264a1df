//! The framed local session: the `Session` RPC's semantics over the API unix socket without
//! HTTP/2 or gRPC, for local clients whose gRPC library costs more than a small transfer (as
//! containerd's ttrpc does). A connection that opens with [`frame::PREFACE`] gets the preface
//! back, then sends `SessionRequest` frames and reads `SessionEvent` frames (docs/API.md, "The
//! framed local session"); any other connection is gRPC as before (`listener`).
//!
//! One task per connection: it reads the frames and runs the session (src/api/session/). Its
//! events go out through the connection's [`outbox::Outbox`]: written at once, one write per
//! event, from whichever thread has the event — the session's task, or the thread that finished
//! a transfer or published a notification (`inline`: the poller's, between nodes).
//! It reads with `recvmsg`, so a `register_host_fd` frame's file descriptor comes with it
//! (`fds`); the client's credentials decide whether it may hand over an unsealable file.
//! Once the client attaches a request ring (`ring`), the session also takes requests from it,
//! in the client's one order across the ring and the socket (`FramedRequests::poll_next`).

pub mod board;
pub mod fds;
pub mod frame;
pub mod inline;
pub mod listener;
pub mod outbox;
pub mod ring;

#[cfg(test)]
#[path = "requests_tests.rs"]
mod requests_tests;

use std::future::pending;
use std::net::Shutdown;
use std::os::fd::AsFd;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use prost::Message;
use tokio_stream::Stream;

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::UnixStream;
use tokio_util::codec::FramedRead;

use self::fds::{FdReader, Positioned, Queued};
use self::frame::{FrameError, PREFACE};
use self::inline::{Inline, OffPoller, OffPollerHold};
use self::outbox::Outbox;
use self::ring::{Ring, RingError};
use super::host_memory::Attached;
use super::proto::v1 as pb;
use super::proto::v1::session_request::Op;
use super::session::{self, Events, Gone, Incoming, Requests};
use super::state::DaemonState;
use crate::host_file::Unsealed;

/// How long a connection whose session ended early (the client broke the framing, or went away)
/// may still send: what it sends is read and dropped, so that closing does not reset the
/// connection before the client has read the refusal.
const LINGER: Duration = Duration::from_secs(1);

/// Serves one framed session on a connection whose preface has been read.
pub async fn serve(state: Arc<DaemonState>, mut stream: UnixStream) {
    if let Err(e) = stream.write_all(PREFACE).await {
        tracing::debug!("local session: answering the preface: {e}");
        return;
    }
    // Who the client is decides whether it may hand over memory that cannot be sealed.
    let cred = stream.peer_cred().ok();
    let peer_uid = cred.map(|c| c.uid());
    // The client's process (SO_PEERCRED): what register_client_memory reads and writes.
    // 0: the client's process is in a PID namespace the daemon's cannot see.
    let peer_pid = cred.and_then(|c| c.pid()).filter(|&p| p > 0);
    let unsealed = Unsealed::for_peer(peer_uid, rustix::process::geteuid().as_raw());
    tracing::debug!(?peer_uid, "local session opened");
    let outbox = match stream
        .as_fd()
        .try_clone_to_owned()
        .map(std::os::unix::net::UnixStream::from)
        .and_then(Outbox::new)
    {
        Ok(o) => Arc::new(o),
        Err(e) => {
            tracing::warn!("local session: cannot share the connection for writing ({e}); closing it");
            return;
        }
    };
    // Registered for reading only (fds.rs says why): writability is asked for only while events
    // wait for room (`FramedEvents::flush`). With `runtime.poller_sessions`, the poller's epoll
    // set watches it instead, and the session is polled by whoever wakes it: the poller, for
    // its requests (`crate::poller::SessionWatch`).
    let watch = state.poller.sessions().cloned();
    let reader = stream.into_std().and_then(|io| {
        let conn = io.try_clone()?;
        let reader = match &watch {
            Some(w) => FdReader::on_poller(io, w)?,
            None => FdReader::new(io)?,
        };
        Ok((conn, reader))
    });
    let (conn, reader) = match reader {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!("local session: cannot register the connection for reading ({e}); closing it");
            return;
        }
    };
    let off_poller = watch.as_ref().map(|_| Arc::new(OffPoller::default()));
    let requests = FramedRequests {
        frames: FramedRead::new(reader, Positioned::default()),
        unsealed,
        peer_pid,
        off_poller: off_poller.clone(),
        unread: watch.is_some(),
        watch,
        rings: state.poller.rings().clone(),
        ring: None,
        from_ring: None,
        held: None,
        #[cfg(test)]
        before_read: None,
    };
    let events = FramedEvents {
        conn,
        writable: None,
        outbox,
        hangup: None,
    };
    let Some(off) = off_poller else {
        return run(state, requests, events).await;
    };
    // The session's own task only waits for its end (the listener's drain waits for this task).
    let (done, ended) = tokio::sync::oneshot::channel();
    let served = Inline::start_served(tokio::runtime::Handle::current(), off, async move {
        run(state, requests, events).await;
        let _ = done.send(());
    });
    let _ = ended.await;
    drop(served);
}

/// Runs the session to its end, then closes the connection.
async fn run(state: Arc<DaemonState>, mut requests: FramedRequests, mut events: FramedEvents) {
    let ended = session::serve(state, None, &mut requests, &mut events).await;
    // The ring says first that no one reads it any more (`spinning` 0: a client's next request
    // rings the doorbell, which finds the connection closed).
    requests.ring = None;
    // Either way nothing more is sent: the client reads EOF after the last event.
    if ended.is_ok() {
        let _ = events.flush().await;
    }
    let _ = events.conn.shutdown(Shutdown::Write);
    if ended.is_err() {
        let mut read = requests.frames.into_inner();
        let mut sink = [0u8; 16 << 10];
        let _ = tokio::time::timeout(LINGER, async {
            while matches!(read.read(&mut sink).await, Ok(n) if n > 0) {}
        })
        .await;
    }
    tracing::debug!(clean = ended.is_ok(), "local session closed");
}

/// The request side: frames read from the connection, and the descriptors that came with them.
struct FramedRequests {
    frames: FramedRead<FdReader, Positioned>,
    unsealed: Unsealed,
    peer_pid: Option<i32>,
    /// Served on the poller's thread: what holds the session off it (`Requests::off_poller`).
    off_poller: Option<Arc<OffPoller>>,
    watch: Option<Arc<crate::poller::SessionWatch>>,
    /// The poller's list of request rings, and this session's, once attached.
    rings: Arc<crate::poller::RingWatch>,
    ring: Option<RingReader>,
    /// The bytes of the request `next` returned last when it came from the ring.
    from_ring: Option<usize>,
    /// A socket frame (or the socket's end: `None`) read while ring entries the client wrote
    /// before sending it were still untaken: handed out once they are ([`FramedRequests::poll_next`]).
    held: Option<Option<Result<pb::SessionRequest, FrameError>>>,
    /// Served by a thread of its own (`watch`) and no request read there yet: a poll elsewhere
    /// (the runtime worker the session starts on) hands the read to that thread
    /// ([`FramedRequests::read_here`]).
    unread: bool,
    /// Tests: runs right before each read of the socket (an interleaving injected there).
    #[cfg(test)]
    before_read: Option<Box<dyn FnMut() + Send>>,
}

/// Looks at the ring and the socket in one poll of the request side, at most: only an entry that
/// appears and vanishes again (a client rewriting it) costs more than two.
const LOOKS: usize = 64;

/// A session's request ring as its reader holds it.
struct RingReader {
    ring: Arc<Ring>,
    /// In the poller's list while the session reads (dropped before the mapping).
    _watching: crate::poller::RingWatching,
    /// Socket frames handed out since the ring was attached (doorbells not counted).
    socket_read: u64,
    /// The last entry's copy (kept: no allocation a request).
    buf: Vec<u8>,
}

impl RingReader {
    /// Whether the ring's next entry was written before the socket's next unread frame (its
    /// `socket_before` at most the frames handed out): its turn first.
    fn entry_due(&self) -> bool {
        self.ring.peek().is_some_and(|before| before <= self.socket_read)
    }
}

impl FramedRequests {
    /// The next request in the client's order (ring.rs, "Order"): the ring's next entry when
    /// every socket frame before it was handed out, else the socket's next frame; doorbells are
    /// handed on as requests, not counted (the session ignores them; they count against the
    /// poller's pass budget as any request). At most [`LOOKS`] looks a poll: an entry that comes
    /// and goes under the daemon (a client rewriting it) cannot hold the thread that polls.
    ///
    /// The ring is looked at again *after* a frame is read, before the frame is handed out: an
    /// entry the client wrote before sending the frame is visible by then (the client's store
    /// of the entry's `k` precedes its `sendmsg`, and the `recvmsg` that brought the frame
    /// follows it), and one whose `socket_before` says it came before the frame goes first,
    /// the frame held meanwhile. A look only before the read is not enough: the client may
    /// write the entry and send the frame between the two (session 31, CI: a `cancel_tag` on
    /// the socket handled before its WRITE on the ring, "no unfinished request … has tag 7").
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Incoming> {
        if self.unread && !self.read_here(cx) {
            return Poll::Pending;
        }
        for _ in 0..LOOKS {
            if let Some(r) = &mut self.ring
                && r.entry_due()
            {
                r.ring.unwait();
                let taken = match r.ring.take(&mut r.buf) {
                    Ok(Some(t)) => t,
                    // There a moment ago, gone now: the client rewrote it.
                    Ok(None) => {
                        let entry = r.ring.taken() + 1;
                        return Poll::Ready(Incoming::Broken(RingError::Torn { entry }.status()));
                    }
                    Err(e) => return Poll::Ready(Incoming::Broken(e.status())),
                };
                return Poll::Ready(match pb::SessionRequest::decode(r.buf.as_slice()) {
                    Ok(req) => {
                        self.from_ring = Some(taken.len);
                        Incoming::Request(Box::new(req))
                    }
                    Err(err) => Incoming::Broken(
                        RingError::NotARequest {
                            entry: taken.entry,
                            err,
                        }
                        .status(),
                    ),
                });
            }
            // Every entry written before the held frame was sent is taken: its turn.
            if let Some(frame) = self.held.take() {
                return Poll::Ready(self.hand_out(frame));
            }
            #[cfg(test)]
            if let Some(hook) = &mut self.before_read {
                hook();
            }
            let frame = match Pin::new(&mut self.frames).poll_next(cx) {
                Poll::Pending => {
                    let Some(r) = &self.ring else {
                        return Poll::Pending;
                    };
                    // Waits for the ring too, unless its next entry waits for the socket.
                    if r.ring.peek().is_none() {
                        r.ring.wait(cx.waker());
                        if r.ring.peek().is_none() {
                            return Poll::Pending;
                        }
                        r.ring.unwait();
                        continue;
                    }
                    if r.entry_due() {
                        continue;
                    }
                    return Poll::Pending;
                }
                Poll::Ready(f) => f,
            };
            // Read: an entry written before the frame was sent is visible now (see above).
            if self.ring.as_ref().is_some_and(RingReader::entry_due) {
                self.held = Some(frame);
                continue;
            }
            return Poll::Ready(self.hand_out(frame));
        }
        let entry = self.ring.as_ref().map_or(0, |r| r.ring.taken() + 1);
        Poll::Ready(Incoming::Broken(
            RingError::Flicker { entry, looks: LOOKS }.status(),
        ))
    }

    /// Whether a session served by a thread of its own (the sessions thread, or the poller's)
    /// reads its first requests here: on that thread, or held off it (`OffPoller`). On the
    /// runtime worker the session starts on (`serve`) it depends on what waits in the socket
    /// (`FdReader::queued`):
    /// - more than one frame (a burst sent with or right after the preface): handed to that
    ///   thread (`FdReader::hand_over`: the session's waker stored, the socket's readiness
    ///   reported again once this poll ended), the caller waits. Read on the worker, its
    ///   requests were all checked and started there, none fast (session 31: the
    ///   sessions-thread burst test, once in CI and once on Google's plugin).
    /// - nothing yet: handed over the same way; the first request's arrival is that thread's
    ///   to report, as every later one's (and a burst arriving after this look is its to read).
    /// - one frame: read here. Handed over, it would wake the serving thread, parked, for one
    ///   request, which one fast start does not pay back (16-CPU host, spin off: a first
    ///   `cancel_tag` 1.27–1.72x, a first WRITE 1.09–1.23x slower; BENCHMARKS, session 32).
    ///
    /// Only the first read decides so: later ones are where the session is polled (a
    /// registration's hold, the rest of a burst over the pass budget, a wake by its writer on a
    /// worker: ARCHITECTURE, "the framed session").
    fn read_here(&mut self, cx: &mut Context<'_>) -> bool {
        let held_off = self.off_poller.as_ref().is_some_and(|o| o.held());
        if crate::poller::serving_sessions_here() || held_off || self.frames.get_ref().queued() == Queued::One
        {
            self.unread = false;
            return true;
        }
        let Some(rearm) = self.frames.get_ref().hand_over(cx.waker()) else {
            self.unread = false;
            return true;
        };
        // Once this poll ended (the future alive: its socket open), not inside it.
        let waker = cx.waker().clone();
        inline::after_this_poll(move || {
            if let Err(e) = rearm.run() {
                // (not expected: the socket is registered and open) Polled again, it tries again.
                tracing::warn!("local session: handing its first read to the serving thread: {e}");
                waker.wake();
            }
        });
        false
    }

    /// A socket frame (or its end) handed out: counted in the ring's order.
    fn hand_out(&mut self, frame: Option<Result<pb::SessionRequest, FrameError>>) -> Incoming {
        match frame {
            Some(Ok(req)) => {
                if let Some(r) = &mut self.ring
                    && !matches!(req.op, Some(Op::RingDoorbell(_)))
                {
                    r.socket_read += 1;
                }
                self.from_ring = None;
                Incoming::Request(Box::new(req))
            }
            // An entry after socket frames that never came: the client broke the order.
            None => match self.ring.as_ref().and_then(|r| Some((r, r.ring.peek()?))) {
                Some((r, said)) => Incoming::Broken(
                    RingError::Ahead {
                        entry: r.ring.taken() + 1,
                        said,
                        read: r.socket_read,
                    }
                    .status(),
                ),
                None => Incoming::HalfClosed,
            },
            Some(Err(e)) => match e.status() {
                Some(status) => Incoming::Broken(status),
                None => {
                    tracing::debug!("local session: the client went away: {e}");
                    Incoming::Gone
                }
            },
        }
    }

    /// A request that came on the ring carries no descriptor: refused naming why.
    fn no_ring_fds(&self) -> Result<(), tonic::Status> {
        match self.from_ring {
            Some(_) => Err(tonic::Status::invalid_argument(
                "this request came on the request ring, which carries no file descriptor: a request with one goes on \
                 the socket (SCM_RIGHTS)",
            )),
            None => Ok(()),
        }
    }
}

impl Requests for FramedRequests {
    async fn next(&mut self) -> Incoming {
        std::future::poll_fn(|cx| self.poll_next(cx)).await
    }

    fn attach_ring(&mut self, ring: Ring) -> Result<(), tonic::Status> {
        if self.ring.is_some() {
            return Err(tonic::Status::invalid_argument(
                "attach_request_ring: this session has a request ring already",
            ));
        }
        let ring = Arc::new(ring);
        self.ring = Some(RingReader {
            _watching: self.rings.watch(ring.clone()),
            ring,
            socket_read: 0,
            buf: Vec::new(),
        });
        Ok(())
    }

    fn attached(&mut self) -> Result<Attached, tonic::Status> {
        self.no_ring_fds()?;
        let at = self.frames.decoder().last_frame();
        let fd = self.frames.get_mut().take(at)?;
        Ok(Attached {
            fd,
            unsealed: self.unsealed,
        })
    }

    fn attached_n(&mut self, n: usize) -> Result<Vec<Attached>, tonic::Status> {
        self.no_ring_fds()?;
        let at = self.frames.decoder().last_frame();
        let fds = self.frames.get_mut().take_n(at, n)?;
        Ok(fds
            .into_iter()
            .map(|fd| Attached {
                fd,
                unsealed: self.unsealed,
            })
            .collect())
    }

    fn off_poller(&self) -> Option<OffPollerHold> {
        self.off_poller.as_ref().map(|o| o.hold())
    }

    fn watch(&self) -> Option<&Arc<crate::poller::SessionWatch>> {
        self.watch.as_ref()
    }

    fn last_len(&self) -> u64 {
        if let Some(len) = self.from_ring {
            return len as u64;
        }
        let (start, end) = self.frames.decoder().last_frame();
        end - start
    }

    fn peer_pid(&self) -> Result<i32, tonic::Status> {
        self.peer_pid.ok_or_else(|| {
            tonic::Status::failed_precondition(
                "register_client_memory: the kernel does not say which process is at the other end of this socket \
                 (SO_PEERCRED): the client runs in a PID namespace the daemon cannot see; run the daemon in the \
                 host's (Kubernetes: hostPID: true on its DaemonSet) or register memory the daemon can map",
            )
        })
    }
}

/// The event side: frames pushed into the connection's outbox, written at once as far as the
/// socket takes them; the rest written here once it is writable.
struct FramedEvents {
    /// The connection (a descriptor of its own): shut down for writing at the end.
    conn: std::os::unix::net::UnixStream,
    /// Registered for writability only while pushed events wait for room: a registration for it
    /// is woken by every event the client reads (fds.rs).
    writable: Option<AsyncFd<std::os::unix::net::UnixStream>>,
    outbox: Arc<Outbox>,
    /// Watches the connection for the client's going away once it has half-closed.
    hangup: Option<UnixStream>,
}

impl FramedEvents {
    /// Writes everything pushed so far, waiting for the socket to take it; `Err` once the
    /// connection failed.
    async fn flush(&mut self) -> Result<(), Gone> {
        // Bytes left by a batch not written yet (`outbox::Batch`: the session polled while the
        // poller's batch is open) go at once; only a full socket is waited for.
        if self.writable.is_none() && self.outbox.backlog() > 0 {
            match self.outbox.flush() {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => return Err(Gone),
            }
        }
        while self.outbox.backlog() > 0 || self.outbox.is_broken() {
            if self.writable.is_none() {
                let watch = self
                    .conn
                    .try_clone()
                    .and_then(|w| fds::register(w, Interest::WRITABLE));
                match watch {
                    Ok(w) => self.writable = Some(w),
                    Err(e) => {
                        tracing::warn!("local session: cannot wait for room to write ({e}); closing it");
                        return Err(Gone);
                    }
                }
            }
            let Some(w) = &self.writable else {
                return Err(Gone);
            };
            let Ok(mut ready) = w.writable().await else {
                return Err(Gone);
            };
            match ready.try_io(|_| self.outbox.flush()) {
                Ok(Ok(())) => {}
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Ok(Err(_)) => return Err(Gone),
                // Not writable after all (readiness cleared): wait for the next edge.
                Err(_would_block) => {}
            }
        }
        // Nothing waits for room: no registration that the client's reads would wake.
        self.writable = None;
        Ok(())
    }
}

impl Events for FramedEvents {
    async fn send(&mut self, event: pb::SessionEvent) -> Result<(), Gone> {
        self.outbox.push(&event).map_err(|_| Gone)?;
        // Written whole before the session goes on (as the client reads: backpressure).
        self.flush().await
    }

    fn outbox(&self) -> Option<Arc<Outbox>> {
        Some(self.outbox.clone())
    }

    async fn attend(&mut self, reading: bool) -> Result<(), Gone> {
        let outbox = self.outbox.clone();
        tokio::select! {
            _ = outbox.work() => self.flush().await,
            _ = self.gone(reading) => Err(Gone),
        }
    }

    /// While the client may still send, its going away ends the request side (EOF or reset).
    /// After its half-close only the hang-up tells: a second descriptor of the socket, polled
    /// for writing, reports it (EPOLLHUP) without touching the connection's own readiness (the
    /// writable readiness this watcher clears is its own; nothing is ever written through it).
    async fn gone(&mut self, reading: bool) {
        if reading {
            return pending().await;
        }
        if self.hangup.is_none() {
            let watch = self
                .conn
                .as_fd()
                .try_clone_to_owned()
                .map(std::os::unix::net::UnixStream::from)
                .and_then(UnixStream::from_std);
            match watch {
                Ok(w) => self.hangup = Some(w),
                Err(e) => {
                    tracing::warn!(
                        "local session: cannot watch for the client's hang-up ({e}); it is noticed at the next event"
                    );
                    return pending().await;
                }
            }
        }
        let Some(watch) = &self.hangup else {
            return pending().await;
        };
        loop {
            match watch.ready(Interest::WRITABLE).await {
                Ok(ready) if ready.is_write_closed() => return,
                // Writable, not hung up: forget this readiness and wait for the next change.
                Ok(_) => {
                    let _ = watch.try_io(Interest::WRITABLE, || {
                        Err::<(), _>(std::io::ErrorKind::WouldBlock.into())
                    });
                }
                Err(_) => return pending().await,
            }
        }
    }
}
