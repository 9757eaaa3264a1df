//! What a framed local session writes to its client, from any thread: the session's task and
//! the threads that finish its transfers and deliver its notifications (`inline.rs`: the
//! poller's thread, for a transfer between nodes). Every event is framed whole into one buffer
//! under one lock, in the order pushed, and written at once without blocking as far as the
//! socket takes it; what it does not take is left for the session's task, which waits until the
//! socket is writable (`FramedEvents`, src/api/local/mod.rs). So a transfer's completion reaches
//! the client's socket from where it is known, with no thread woken in between, and frames
//! never interleave.

use std::io::{self, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use bytes::{Buf, BytesMut};
use tokio::sync::Notify;

use super::board::Board;
use super::frame::put_event;
use crate::api::proto::v1 as pb;

/// Bytes the client may leave unread before the session stops reading its requests, and its
/// notifications wait (then lag, as a slow subscriber's do: DATA_LOSS, "missed N").
pub const BACKLOG: usize = 256 << 10;

/// The framed session's writing side, shared.
pub struct Outbox {
    /// The connection (a descriptor of its own, non-blocking): written from any thread.
    sock: UnixStream,
    state: Mutex<State>,
    /// Bytes in `state.pending`, readable without the lock.
    backlog: AtomicUsize,
    /// The session's task: something is left to write, or the connection broke.
    work: Notify,
    /// Writers waiting for the backlog to go under [`BACKLOG`].
    room: Notify,
    /// The session's completion board, once attached (`attach_board`; board.rs): transfers'
    /// ends are published there too, right before their events are pushed.
    board: OnceLock<Board>,
}

#[derive(Default)]
struct State {
    /// Framed events not written yet, in order.
    pending: BytesMut,
    /// The connection failed (the client is gone): nothing more is written.
    broken: bool,
}

/// Why an event could not be handed over: the client is gone.
#[derive(Debug)]
pub struct Broken;

impl Outbox {
    /// An outbox writing to `sock` (made non-blocking here).
    pub fn new(sock: UnixStream) -> io::Result<Outbox> {
        sock.set_nonblocking(true)?;
        Ok(Outbox {
            sock,
            state: Mutex::new(State::default()),
            backlog: AtomicUsize::new(0),
            work: Notify::new(),
            room: Notify::new(),
            board: OnceLock::new(),
        })
    }

    /// Attaches the session's board; `Err` (the board back) when it has one already.
    pub fn attach_board(&self, board: Board) -> Result<(), Board> {
        self.board.set(board)
    }

    /// Publishes a transfer's end on the session's board, if it has one and the end goes there
    /// (`Board::publish`); whether it did. Called right before the end's event is pushed.
    pub fn publish(&self, tag: u64, ev: &pb::TransferEvent) -> bool {
        self.board.get().is_some_and(|b| b.publish(tag, ev))
    }

    /// Numbers a notification event about to be pushed and puts its payload on the session's
    /// board, if it has one with room (`Board::note`); whether it did.
    pub fn note(&self, payload: &[u8]) -> bool {
        self.board.get().is_some_and(|b| b.note(payload))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Frames `event` after those pushed before and writes what the socket takes now, without
    /// blocking; the rest is the session task's to write (it is told). `Err` once the
    /// connection failed.
    pub fn push(&self, event: &pb::SessionEvent) -> Result<(), Broken> {
        let (pushed, wake) = self.push_unwoken(event);
        if wake {
            self.wake_writer();
        }
        pushed
    }

    /// [`Outbox::push`] without waking the session's task: `true` in the second place when it
    /// must be woken ([`Outbox::wake_writer`]: bytes left for it to write, or the connection
    /// broke). For a caller holding a lock the session's task takes: waking it may poll it right
    /// here (an inline task, src/api/local/inline.rs), which would then wait for that lock on
    /// this very thread (`api::delivery::deliver_finished` holds the session's delivered tags).
    pub fn push_unwoken(&self, event: &pb::SessionEvent) -> (Result<(), Broken>, bool) {
        let mut st = self.lock();
        if st.broken {
            return (Err(Broken), false);
        }
        let was_empty = st.pending.is_empty();
        if let Err(e) = put_event(&mut st.pending, event) {
            tracing::error!("local session: encoding an event: {e}");
            return (Err(Broken), false);
        }
        // Bytes already waiting mean the socket was full: the session's task writes them (and
        // these) once it is writable.
        if was_empty {
            let _ = self.write_locked(&mut st);
        }
        let left = st.pending.len();
        let broken = st.broken;
        self.backlog.store(left, Ordering::Release);
        drop(st);
        (if broken { Err(Broken) } else { Ok(()) }, left > 0 || broken)
    }

    /// Wakes the session's task to write what is pending (after [`Outbox::push_unwoken`]).
    pub fn wake_writer(&self) {
        self.work.notify_one();
    }

    /// Writes what is pending until done or the socket is full (`WouldBlock`); `Err(Broken)`
    /// once the connection failed.
    pub fn flush(&self) -> io::Result<()> {
        let mut st = self.lock();
        if st.broken {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        let r = self.write_locked(&mut st);
        let left = st.pending.len();
        self.backlog.store(left, Ordering::Release);
        drop(st);
        if left < BACKLOG {
            self.room.notify_waiters();
        }
        r
    }

    fn write_locked(&self, st: &mut State) -> io::Result<()> {
        while !st.pending.is_empty() {
            match (&self.sock).write(&st.pending) {
                Ok(0) => {
                    st.broken = true;
                    return Err(io::ErrorKind::WriteZero.into());
                }
                Ok(n) => st.pending.advance(n),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Err(e),
                Err(e) => {
                    tracing::debug!("local session: the client went away: {e}");
                    st.broken = true;
                    st.pending.clear();
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Bytes pushed and not written yet.
    pub fn backlog(&self) -> usize {
        self.backlog.load(Ordering::Acquire)
    }

    pub fn is_broken(&self) -> bool {
        self.lock().broken
    }

    /// Resolves when something pushed is left to write or the connection broke (a push from
    /// another thread tells the session's task so).
    pub async fn work(&self) {
        loop {
            let notified = self.work.notified();
            if self.backlog() > 0 || self.is_broken() {
                return;
            }
            notified.await;
        }
    }

    /// Resolves once the backlog is under [`BACKLOG`] (or the connection broke).
    pub async fn room(&self) {
        loop {
            let notified = self.room.notified();
            if self.backlog() < BACKLOG || self.is_broken() {
                return;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;
    use std::task::{Context, Wake, Waker};

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Session 27: a push under a lock the session's task takes must not wake that task (woken,
    /// an inline task is polled on the pushing thread and waits for the lock: the poller's
    /// thread deadlocked so in `deliver_finished`). `push_unwoken` leaves the task asleep and
    /// says it must be woken once the socket is full; `wake_writer` wakes it then.
    #[test]
    fn a_push_unwoken_wakes_no_one_until_the_caller_wakes_the_writer() {
        let (ours, _client) = UnixStream::pair().unwrap();
        let outbox = Outbox::new(ours).unwrap();
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        let mut work = Box::pin(outbox.work());
        assert!(work.as_mut().poll(&mut cx).is_pending(), "nothing to write yet");
        let ev = pb::SessionEvent {
            tag: 7,
            event: Some(pb::session_event::Event::Refused(pb::EntryStatus {
                code: 2,
                message: "x".repeat(4096),
            })),
        };
        // The client reads nothing: the socket fills, then the bytes stay pending.
        let mut pushes = 0;
        loop {
            let (pushed, wake) = outbox.push_unwoken(&ev);
            assert!(pushed.is_ok());
            pushes += 1;
            assert!(pushes < 100_000, "the socket never filled");
            if wake {
                break;
            }
        }
        assert!(outbox.backlog() > 0);
        assert_eq!(
            count.0.load(Ordering::SeqCst),
            0,
            "push_unwoken woke the session's task"
        );
        outbox.wake_writer();
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "wake_writer did not wake it");
        assert!(work.as_mut().poll(&mut cx).is_ready(), "bytes are left to write");
    }
}
