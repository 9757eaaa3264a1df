//! What a framed local session writes to its client, from any thread: the session's task and
//! the threads that finish its transfers and deliver its notifications (`inline.rs`: the
//! poller's thread, for a transfer between nodes). Every event is framed whole into one buffer
//! under one lock, in the order pushed, and written at once without blocking as far as the
//! socket takes it; what it does not take is left for the session's task, which waits until the
//! socket is writable (`FramedEvents`, src/api/local/mod.rs). So a transfer's completion reaches
//! the client's socket from where it is known, with no thread woken in between, and frames
//! never interleave.
//!
//! # Batched on the poller's thread
//! While the poller runs a pass's actions it opens a [`Batch`]: events pushed on its thread then
//! (the transfers it finished, delivered inline) are framed at once but written when the batch
//! closes, one write per connection for all of them, not one per event: a poller that finishes
//! several of a session's transfers in one go makes one `send` and wakes the client once
//! (session 28: the per-answer `send` and the client's wake-up it caused were most of the
//! `finished` action's cost). The bytes count in the backlog from their push, so the session's
//! own task, if polled meanwhile (its last transfer ended: it flushes before it closes), writes
//! them itself; one order, the buffer's, whoever writes.

use std::cell::RefCell;
use std::io::{self, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

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
    /// In this thread's open [`Batch`] (bytes pushed into it wait for it to close, not for room).
    batched: bool,
}

thread_local! {
    /// This thread's [`Batch`]: whether one is open, and the outboxes pushed into while it is.
    static BATCH: RefCell<(bool, Vec<Arc<Outbox>>)> = const { RefCell::new((false, Vec::new())) };
}

/// Events pushed on this thread while it lives are written when it is dropped, one write per
/// outbox (the module's "Batched on the poller's thread"). A batch opened inside another is
/// part of it.
pub struct Batch {
    outer: bool,
}

impl Batch {
    pub fn open() -> Batch {
        let outer = BATCH.with(|b| !std::mem::replace(&mut b.borrow_mut().0, true));
        Batch { outer }
    }
}

impl Batch {
    /// Closes the batch now: `true` when it wrote (or tried to write) some outbox's events.
    pub fn close(mut self) -> bool {
        self.write()
    }

    /// Closes the batch without writing: the outboxes pushed into are added to `into`, each
    /// left for a thread that writes it later ([`Outbox::write_batched`]; the sessions thread,
    /// `crate::poller`'s `session_thread.rs`). Until then their bytes count in the backlog, and a
    /// push from another thread writes them with its own, in order (as while a batch is open).
    /// `true` when some outbox was pushed into. (A batch inside another closes nothing.)
    pub fn close_into(mut self, into: &mut Vec<Arc<Outbox>>) -> bool {
        if !std::mem::replace(&mut self.outer, false) {
            return false;
        }
        BATCH.with(|b| {
            let mut b = b.borrow_mut();
            b.0 = false;
            let any = !b.1.is_empty();
            into.append(&mut b.1);
            any
        })
    }

    fn write(&mut self) -> bool {
        if !std::mem::replace(&mut self.outer, false) {
            return false;
        }
        // Closed before the writes: a wake below may poll a session right here (inline), whose
        // own pushes then go out at once.
        let mut list = BATCH.with(|b| {
            let mut b = b.borrow_mut();
            b.0 = false;
            std::mem::take(&mut b.1)
        });
        let wrote = !list.is_empty();
        for outbox in list.drain(..) {
            outbox.write_batched();
        }
        // The list's room kept for the next batch.
        BATCH.with(|b| {
            let mut b = b.borrow_mut();
            if b.1.capacity() == 0 {
                b.1 = list;
            }
        });
        wrote
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        self.write();
    }
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
    pub fn push(self: &Arc<Self>, event: &pb::SessionEvent) -> Result<(), Broken> {
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
    /// Inside a [`Batch`] the event is written when the batch closes (and the task woken then,
    /// if need be): `(Ok, false)`.
    pub fn push_unwoken(self: &Arc<Self>, event: &pb::SessionEvent) -> (Result<(), Broken>, bool) {
        let batch = BATCH.with(|b| b.borrow().0);
        let mut st = self.lock();
        if st.broken {
            return (Err(Broken), false);
        }
        let was_empty = st.pending.is_empty();
        if let Err(e) = put_event(&mut st.pending, event) {
            tracing::error!("local session: encoding an event: {e}");
            return (Err(Broken), false);
        }
        if batch {
            let first = !std::mem::replace(&mut st.batched, true);
            self.backlog.store(st.pending.len(), Ordering::Release);
            drop(st);
            if first {
                BATCH.with(|b| b.borrow_mut().1.push(self.clone()));
            }
            return (Ok(()), false);
        }
        // Bytes already waiting mean the socket was full (the session's task writes them, and
        // these, once it is writable), unless they wait for a batch on another thread: written
        // now, in order, with these.
        if was_empty || st.batched {
            let _ = self.write_locked(&mut st);
        }
        let left = st.pending.len();
        let broken = st.broken;
        self.backlog.store(left, Ordering::Release);
        drop(st);
        (if broken { Err(Broken) } else { Ok(()) }, left > 0 || broken)
    }

    /// A [`Batch`] closes (on its thread, or on the thread it was handed to: `Batch::close_into`):
    /// writes what is pending as far as the socket takes it; the session's task is woken for
    /// the rest (or a broken connection), as a push would.
    pub fn write_batched(&self) {
        let mut st = self.lock();
        st.batched = false;
        if st.broken {
            return;
        }
        let _ = self.write_locked(&mut st);
        let left = st.pending.len();
        let broken = st.broken;
        let before = self.backlog.swap(left, Ordering::AcqRel);
        drop(st);
        if left > 0 || broken {
            self.wake_writer();
        }
        if before >= BACKLOG && left < BACKLOG {
            self.room.notify_waiters();
        }
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
        let outbox = Arc::new(Outbox::new(ours).unwrap());
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

    fn refused(tag: u64, len: usize) -> pb::SessionEvent {
        pb::SessionEvent {
            tag,
            event: Some(pb::session_event::Event::Refused(pb::EntryStatus {
                code: 2,
                message: "y".repeat(len),
            })),
        }
    }

    /// The client's socket: the events it can read now, decoded in order.
    fn read_events(client: &UnixStream) -> Vec<u64> {
        use prost::Message;
        use std::io::Read;
        client.set_nonblocking(true).unwrap();
        let mut bytes = Vec::new();
        let mut buf = [0u8; 1 << 16];
        loop {
            match (&*client).read(&mut buf) {
                Ok(0) => break,
                Ok(n) => bytes.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("{e}"),
            }
        }
        let mut tags = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let len = u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
            tags.push(
                pb::SessionEvent::decode(&bytes[at + 4..at + 4 + len])
                    .unwrap()
                    .tag,
            );
            at += 4 + len;
        }
        tags
    }

    /// Session 28: inside a batch the pushes are framed but not written; the batch's close writes
    /// each outbox's events once, in their order, and wakes no one when the socket took them.
    #[test]
    fn a_batch_writes_its_pushes_when_it_closes_in_order() {
        let (ours, client) = UnixStream::pair().unwrap();
        let outbox = Arc::new(Outbox::new(ours).unwrap());
        let (ours2, client2) = UnixStream::pair().unwrap();
        let other = Arc::new(Outbox::new(ours2).unwrap());
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        let mut work = Box::pin(outbox.work());
        assert!(work.as_mut().poll(&mut cx).is_pending());
        outbox.push(&refused(1, 8)).unwrap();
        assert_eq!(read_events(&client), [1], "outside a batch: written at once");
        {
            let _batch = Batch::open();
            let inner = Batch::open();
            for tag in 2..=4 {
                assert!(matches!(outbox.push_unwoken(&refused(tag, 8)), (Ok(()), false)));
            }
            other.push(&refused(9, 8)).unwrap();
            drop(inner);
            assert!(outbox.backlog() > 0, "the batch's bytes count in the backlog");
            assert_eq!(
                read_events(&client),
                [] as [u64; 0],
                "nothing written inside the batch"
            );
            assert_eq!(read_events(&client2), [] as [u64; 0]);
            outbox.push(&refused(5, 8)).unwrap();
        }
        assert_eq!(read_events(&client), [2, 3, 4, 5]);
        assert_eq!(read_events(&client2), [9]);
        assert_eq!(outbox.backlog(), 0);
        assert_eq!(count.0.load(Ordering::SeqCst), 0, "all written: no one woken");
        // Written by the session's own flush while the batch is open: in order, nothing twice.
        {
            let _batch = Batch::open();
            outbox.push(&refused(6, 8)).unwrap();
            outbox.flush().unwrap();
            assert_eq!(read_events(&client), [6]);
            outbox.push(&refused(7, 8)).unwrap();
        }
        assert_eq!(read_events(&client), [7]);
        // Outside a batch again, on another thread: at once.
        let o = outbox.clone();
        std::thread::spawn(move || o.push(&refused(8, 8)).unwrap())
            .join()
            .unwrap();
        assert_eq!(read_events(&client), [8]);
    }

    /// A batch whose writes fill the socket leaves the rest to the session's task, woken once;
    /// a client gone meanwhile is found by the batch's write (the session's task then finds the
    /// connection broken).
    #[test]
    fn a_batch_that_fills_the_socket_wakes_the_writer_and_a_broken_one_too() {
        let (ours, client) = UnixStream::pair().unwrap();
        let outbox = Arc::new(Outbox::new(ours).unwrap());
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        let mut work = Box::pin(outbox.work());
        assert!(work.as_mut().poll(&mut cx).is_pending());
        {
            let _batch = Batch::open();
            for tag in 1..=200 {
                outbox.push(&refused(tag, 4096)).unwrap();
            }
        }
        assert!(outbox.backlog() > 0, "the socket took only part");
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        assert!(work.as_mut().poll(&mut cx).is_ready());
        drop(client);
        {
            let _batch = Batch::open();
            outbox.push(&refused(300, 8)).unwrap();
        }
        assert!(outbox.is_broken(), "the batch's write found the client gone");
        let mut work = Box::pin(outbox.work());
        assert!(
            work.as_mut().poll(&mut cx).is_ready(),
            "the session's task finds it so"
        );
        assert!(outbox.push(&refused(301, 8)).is_err());
    }
}
