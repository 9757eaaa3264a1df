//! A framed session's request ring: memory the client writes and the daemon reads (a sealed
//! memfd the client hands over with `attach_request_ring`), where the client puts its next
//! requests instead of `sendmsg`-ing them, and the daemon's poller looks on every pass while it
//! spins — so a spinning client's request reaches a spinning daemon with no system call on
//! either side (docs/API.md, "The request ring").
//!
//! # Why a memfd of its own
//!
//! The completion board (board.rs) is written by the daemon and belongs to the session's event
//! side (its outbox); the ring is written by the client and belongs to the request side (the
//! session's reader, which alone takes from it, and the poller, which only looks). Separate
//! files keep each side's checks, sizes and lifetimes apart: a client may have either, a refusal
//! of one leaves the other, and a ring never shares a page with words the daemon writes often
//! (only `taken` and `spinning`, in its header).
//!
//! # Layout
//!
//! Little-endian u64 words. The header is 8 words (64 bytes): word 0 `taken`, written by the
//! daemon: how many entries it has copied out (a slot's entry `k` may be overwritten by entry
//! `k + slots` once `taken ≥ k`); word 1 `spinning`, written by the daemon: 1 while its poller
//! looks at the ring every pass, 0 when it may be parked (then a client that put an entry rings
//! the doorbell: an empty `ring_doorbell` frame on the socket); word 2 `ended`, written by the
//! daemon: 1 once the session no longer reads the ring (an entry past `taken` then never will
//! be: the client may send it another way; set before the daemon closes the connection, so a
//! client that finds the connection closed reads it); words 3–7 reserved. Then `slots`
//! slots of `slot_bytes` each; entry `k` (from 1) is in slot `(k - 1) mod slots`:
//!
//! | word | what |
//! | --- | --- |
//! | 0 | `k`, written last (release): the entry is complete |
//! | 1 | the request's length in bytes (at most `slot_bytes - 32`) |
//! | 2 | `socket_before`: how many socket frames (doorbells not counted) the client sent after its `attach_request_ring` frame and before this entry |
//! | 3 | reserved |
//! | 4… | the request: a `SessionRequest`'s bytes, as a frame's body |
//!
//! # Order
//!
//! One order across the ring and the socket, the client's: an entry with `socket_before = s`
//! comes after the session's `s`th socket frame and before its `s + 1`th. The daemon takes the
//! next entry only once it has handled `s` socket frames, and looks at the ring again after it
//! has read a socket frame, before handing the frame out (held meanwhile). A socket frame sent
//! after an entry was written finds the entry visible once the frame is read (the client wrote
//! it before its `sendmsg`, the daemon looks after its `recvmsg`), so the entries before it
//! are taken first; and a frame sent before an entry is in the socket's queue by the time the
//! entry is visible, so the session reads it first. (A look only before the read left a
//! window: entry and frame both written between the look and the read, the frame went first:
//! session 31's CI, `FramedRequests::poll_next`.) Requests that carry descriptors (registrations by file, boards) can
//! only go on the socket, in this same order; one that comes on the ring is refused.
//!
//! # No request sits unseen
//!
//! The client writes the entry, then (a `SeqCst` fence between) reads `spinning`; the poller
//! writes `spinning = 0` when it is about to wait (nap or park), then (a `SeqCst` fence between)
//! looks at every ring and does not wait if one holds an entry its session waits for. Of the two,
//! one sees the other's write (as the poller's bell, poller/park.rs): either the poller sees the
//! entry and runs another pass, or the client sees 0 and rings the doorbell, whose bytes wake the
//! session (and a parked poller) the socket's way. The session's reader, when it finds nothing,
//! stores its waker, says it waits, and looks at the ring once more (poller/rings.rs).
//!
//! # What the daemon trusts
//!
//! Nothing it reads from the ring beyond one entry's bytes, which only ever become that client's
//! own request. The entry is copied out of the shared memory (at most a slot, whatever its length
//! word says: a longer one is refused) and decoded from the copy; `k` read again after the copy
//! tells an entry the client rewrote meanwhile (a torn write: refused). A refusal ends that
//! session as a bad frame does (one `refused` event under tag 0); the daemon, the poller and
//! every other session go on. The daemon's count of what it took is its own (never read back
//! from `taken`); every access is bounds-checked (`crate::net::shared_words`), and the memfd is
//! sealed against shrinking.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering, fence};
use std::task::Waker;

use tonic::Status;

use super::board::sealed_memfd;
use crate::net::shared_words::SharedWords;

/// Words of the header.
pub const HEADER_WORDS: usize = 8;
/// Bytes at the start of a slot before the request.
pub const SLOT_HEAD: usize = 32;
/// The fewest and the most slots, and bytes of a slot; a ring is at most [`MAX_RING_BYTES`].
pub const MIN_SLOTS: u32 = 16;
pub const MAX_SLOTS: u32 = 4_096;
pub const MIN_SLOT_BYTES: u32 = 128;
pub const MAX_SLOT_BYTES: u32 = 4_096;
pub const MAX_RING_BYTES: u64 = 1 << 20;

/// Why a ring's entry was refused (the session then ends: docs/API.md, "The request ring").
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    #[error("request ring: entry {entry} says it is {len} bytes; a slot holds at most {cap}")]
    TooLong { entry: u64, len: u64, cap: usize },
    #[error(
        "request ring: entry {entry} changed while the daemon copied it (the client wrote its slot again before the \
         daemon's `taken` passed it)"
    )]
    Torn { entry: u64 },
    #[error("request ring: entry {entry} is not a SessionRequest: {err}")]
    NotARequest { entry: u64, err: prost::DecodeError },
    #[error(
        "request ring: entry {entry} appeared and vanished again {looks} times in one look (the client rewrites it)"
    )]
    Flicker { entry: u64, looks: usize },
    #[error(
        "request ring: entry {entry} says {said} socket requests came before it, but the socket ended after {read}"
    )]
    Ahead { entry: u64, said: u64, read: u64 },
}

impl RingError {
    pub fn status(&self) -> Status {
        Status::invalid_argument(self.to_string())
    }
}

/// One entry copied out: where it stands in the order, and its bytes' length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Taken {
    pub entry: u64,
    pub socket_before: u64,
    pub len: usize,
}

/// A session's ring, mapped: shared by the session's reader (which takes) and the poller (which
/// looks, wakes the reader and says whether it spins). Dropped when the session stops reading,
/// saying so (`spinning` 0) to a client that still writes in it.
pub struct Ring {
    words: SharedWords,
    slots: u64,
    slot_words: usize,
    /// Entries taken: the daemon's own count.
    taken: AtomicU64,
    /// The reader found nothing and waits for the poller to wake `waker`.
    waiting: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

impl Ring {
    /// Checks the client's file (a memfd sealed against shrinking, holding the ring) and maps it;
    /// the refusal names the field and the limit.
    pub fn attach(fd: &OwnedFd, slots: u32, slot_bytes: u32) -> Result<Ring, Status> {
        if !slots.is_power_of_two() || !(MIN_SLOTS..=MAX_SLOTS).contains(&slots) {
            return Err(Status::invalid_argument(format!(
                "attach_request_ring.slots: {slots} (a power of two, {MIN_SLOTS} to {MAX_SLOTS})"
            )));
        }
        if !slot_bytes.is_power_of_two() || !(MIN_SLOT_BYTES..=MAX_SLOT_BYTES).contains(&slot_bytes) {
            return Err(Status::invalid_argument(format!(
                "attach_request_ring.slot_bytes: {slot_bytes} (a power of two, {MIN_SLOT_BYTES} to {MAX_SLOT_BYTES})"
            )));
        }
        let ring_bytes = u64::from(slots) * u64::from(slot_bytes);
        if ring_bytes > MAX_RING_BYTES {
            return Err(Status::invalid_argument(format!(
                "attach_request_ring: slots × slot_bytes is {ring_bytes}; at most {MAX_RING_BYTES}"
            )));
        }
        let need = HEADER_WORDS as u64 * 8 + ring_bytes;
        sealed_memfd(
            fd,
            need,
            "attach_request_ring",
            &format!("a ring of {slots} slots of {slot_bytes} bytes needs {need} (64 + slots × slot_bytes)"),
        )?;
        let words = SharedWords::map(fd.as_fd(), need as usize / 8)
            .map_err(|e| Status::failed_precondition(format!("attach_request_ring: {e}")))?;
        // Whatever the client left there: nothing taken yet, not spinning until the poller says.
        words.store(0, 0, Ordering::Relaxed);
        words.store(1, 0, Ordering::Relaxed);
        words.store(2, 0, Ordering::Relaxed);
        Ok(Ring {
            words,
            slots: u64::from(slots),
            slot_words: slot_bytes as usize / 8,
            taken: AtomicU64::new(0),
            waiting: AtomicBool::new(false),
            waker: Mutex::new(None),
        })
    }

    pub fn slots(&self) -> u32 {
        self.slots as u32
    }

    pub fn slot_bytes(&self) -> u32 {
        (self.slot_words * 8) as u32
    }

    /// The most bytes a request in one slot may have.
    pub fn capacity(&self) -> usize {
        self.slot_words * 8 - SLOT_HEAD
    }

    /// Entries taken so far.
    pub fn taken(&self) -> u64 {
        self.taken.load(Ordering::Relaxed)
    }

    fn slot(&self, entry: u64) -> usize {
        HEADER_WORDS + ((entry - 1) % self.slots) as usize * self.slot_words
    }

    /// The next entry's `socket_before`, once the client has written it whole.
    pub fn peek(&self) -> Option<u64> {
        let k = self.taken() + 1;
        let at = self.slot(k);
        (self.words.load(at, Ordering::Acquire) == k).then(|| self.words.load(at + 2, Ordering::Relaxed))
    }

    /// Copies the next entry's request into `buf` (replacing what it held) and counts it taken;
    /// `Ok(None)` when the client has not written it.
    pub fn take(&self, buf: &mut Vec<u8>) -> Result<Option<Taken>, RingError> {
        let k = self.taken() + 1;
        let at = self.slot(k);
        if self.words.load(at, Ordering::Acquire) != k {
            return Ok(None);
        }
        let len = self.words.load(at + 1, Ordering::Relaxed);
        let socket_before = self.words.load(at + 2, Ordering::Relaxed);
        let cap = self.capacity();
        if len > cap as u64 {
            return Err(RingError::TooLong { entry: k, len, cap });
        }
        let len = len as usize;
        buf.clear();
        for i in 0..len.div_ceil(8) {
            buf.extend_from_slice(
                &self
                    .words
                    .load(at + SLOT_HEAD / 8 + i, Ordering::Relaxed)
                    .to_le_bytes(),
            );
        }
        buf.truncate(len);
        // The copy's loads before the second look at `k` (a seqlock's read).
        fence(Ordering::Acquire);
        if self.words.load(at, Ordering::Relaxed) != k {
            return Err(RingError::Torn { entry: k });
        }
        self.taken.store(k, Ordering::Relaxed);
        // The client may write the slot again from here.
        self.words.store(0, k, Ordering::Release);
        Ok(Some(Taken {
            entry: k,
            socket_before,
            len,
        }))
    }

    /// The reader found nothing: it waits for `waker` (stored unless it wakes the same task).
    /// The caller looks at the ring once more after this (the module's "No request sits unseen").
    pub fn wait(&self, waker: &Waker) {
        {
            let mut w = self.waker.lock().unwrap_or_else(|e| e.into_inner());
            if !w.as_ref().is_some_and(|old| old.will_wake(waker)) {
                *w = Some(waker.clone());
            }
        }
        self.waiting.store(true, Ordering::SeqCst);
    }

    /// The reader does not wait for the ring after all (it found an entry, or waits for the
    /// socket).
    pub fn unwait(&self) {
        self.waiting.store(false, Ordering::Relaxed);
    }

    /// Whether the reader waits and the next entry is there (the poller then wakes it).
    pub fn wanted(&self) -> bool {
        self.waiting.load(Ordering::SeqCst) && self.peek().is_some()
    }

    /// The waker to wake when the reader waits and the next entry is there, once per wait.
    pub fn wake_if_wanted(&self) -> Option<Waker> {
        if !self.wanted() || !self.waiting.swap(false, Ordering::AcqRel) {
            return None;
        }
        self.waker.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Says whether the poller looks every pass (the poller, under its rings' lock).
    pub fn set_spinning(&self, on: bool) {
        self.words.store(1, u64::from(on), Ordering::Relaxed);
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // (out of the poller's list by now: `RingWatching` holds an `Arc` of it) No entry past
        // `taken` will ever be: the client may send it another way.
        self.words.store(2, 1, Ordering::SeqCst);
        self.words.store(1, 0, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::fs::{MemfdFlags, SealFlags};
    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;
    use std::task::Wake;

    fn memfd(bytes: u64, seals: SealFlags) -> OwnedFd {
        let fd = rustix::fs::memfd_create("tcpxd-ring-test", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .unwrap();
        rustix::fs::ftruncate(&fd, bytes).unwrap();
        if !seals.is_empty() {
            rustix::fs::fcntl_add_seals(&fd, seals).unwrap();
        }
        fd
    }

    /// The client's side, as the Python package writes it (tcpxd._ring).
    struct Client {
        view: SharedWords,
        slots: u64,
        slot_words: usize,
        written: u64,
    }

    impl Client {
        fn new(fd: &OwnedFd, slots: u64, slot_bytes: usize) -> Client {
            let words = HEADER_WORDS + slots as usize * slot_bytes / 8;
            Client {
                view: SharedWords::map(fd.as_fd(), words).unwrap(),
                slots,
                slot_words: slot_bytes / 8,
                written: 0,
            }
        }

        fn at(&self, k: u64) -> usize {
            HEADER_WORDS + ((k - 1) % self.slots) as usize * self.slot_words
        }

        /// Puts `bytes` as the next entry; false when the ring is full (the socket's way).
        fn put(&mut self, bytes: &[u8], before: u64) -> bool {
            let k = self.written + 1;
            if k - self.view.load(0, Ordering::Acquire) > self.slots {
                return false;
            }
            let at = self.at(k);
            self.view.store(at + 1, bytes.len() as u64, Ordering::Relaxed);
            self.view.store(at + 2, before, Ordering::Relaxed);
            for (i, c) in bytes.chunks(8).enumerate() {
                let mut b = [0u8; 8];
                b[..c.len()].copy_from_slice(c);
                self.view
                    .store(at + 4 + i, u64::from_le_bytes(b), Ordering::Relaxed);
            }
            self.view.store(at, k, Ordering::Release);
            self.written = k;
            true
        }
    }

    fn ring(slots: u32, slot_bytes: u32) -> (OwnedFd, Ring) {
        let fd = memfd(64 + u64::from(slots) * u64::from(slot_bytes), SealFlags::SHRINK);
        let r = Ring::attach(&fd, slots, slot_bytes).unwrap();
        (fd, r)
    }

    #[test]
    fn entries_are_taken_in_order_across_the_wrap_and_a_full_ring_refuses_the_client() {
        let (fd, r) = ring(16, 128);
        assert_eq!(r.capacity(), 96);
        let mut c = Client::new(&fd, 16, 128);
        let mut buf = Vec::new();
        let mut next = 0u64;
        for round in 0..5u64 {
            // Fill it: the 17th does not fit until the daemon takes one.
            let mut put = 0;
            while c.put(format!("entry {}", c.written + 1).as_bytes(), round) {
                put += 1;
            }
            assert_eq!(put, 16, "round {round}: the ring holds 16");
            for _ in 0..16 {
                next += 1;
                let t = r.take(&mut buf).unwrap().unwrap();
                assert_eq!(
                    t,
                    Taken {
                        entry: next,
                        socket_before: round,
                        len: buf.len()
                    }
                );
                assert_eq!(buf, format!("entry {next}").as_bytes());
            }
            assert!(r.take(&mut buf).unwrap().is_none(), "nothing more");
            assert_eq!(c.view.load(0, Ordering::Acquire), next, "taken for the client");
        }
        // Exactly a slot's capacity fits; an empty request is an entry too.
        assert!(c.put(&[7u8; 96], 9));
        assert!(c.put(&[], 9));
        assert_eq!(r.take(&mut buf).unwrap().unwrap().len, 96);
        assert_eq!(buf, vec![7u8; 96]);
        assert_eq!(r.take(&mut buf).unwrap().unwrap().len, 0);
    }

    #[test]
    fn a_length_past_the_slot_and_a_torn_entry_are_refused_naming_the_entry() {
        let (fd, r) = ring(16, 128);
        let mut c = Client::new(&fd, 16, 128);
        assert!(c.put(b"abc", 0));
        let at = c.at(1);
        c.view.store(at + 1, u64::MAX, Ordering::Relaxed);
        let e = r.take(&mut Vec::new()).unwrap_err();
        assert_eq!(
            e.to_string(),
            "request ring: entry 1 says it is 18446744073709551615 bytes; a slot holds at most 96"
        );
        assert_eq!(e.status().code(), tonic::Code::InvalidArgument);
        assert_eq!(r.taken(), 0, "nothing taken");
        // Torn: the client rewrites the entry's number while the daemon copies (the same check as
        // a rewrite between the copy and the second look).
        c.view.store(at + 1, 3, Ordering::Relaxed);
        let (r2, view) = (&r, &c.view);
        let stop = AtomicBool::new(false);
        let tore = std::thread::scope(|s| {
            let w = s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    view.store(at, 1, Ordering::Release);
                    view.store(at, 17, Ordering::Release);
                }
            });
            let mut seen = None;
            for _ in 0..1_000_000 {
                if let Err(e) = r2.take(&mut Vec::new()) {
                    seen = Some(e);
                    break;
                }
                if r2.taken() > 0 {
                    break;
                }
            }
            stop.store(true, Ordering::Relaxed);
            w.join().unwrap();
            seen
        });
        // Either the writer tore a copy (refused), or every look that matched took it whole.
        match tore {
            Some(e) => assert!(matches!(e, RingError::Torn { entry: 1 }), "{e}"),
            None => assert!(r.taken() <= 1),
        }
        // Deterministically: an entry whose number is not the next one is not there.
        let (fd, r) = ring(16, 128);
        let c = Client::new(&fd, 16, 128);
        c.view.store(c.at(1), 2, Ordering::Release);
        assert!(r.take(&mut Vec::new()).unwrap().is_none());
        assert!(r.peek().is_none());
    }

    #[test]
    fn garbage_in_every_word_is_only_ever_a_refusal_or_nothing() {
        let (fd, r) = ring(16, 128);
        let c = Client::new(&fd, 16, 128);
        for i in 0..c.view.len() {
            c.view.store(
                i,
                0x9e37_79b9_7f4a_7c15u64.wrapping_mul(i as u64 + 1),
                Ordering::Relaxed,
            );
        }
        let mut buf = Vec::new();
        for _ in 0..100 {
            match r.take(&mut buf) {
                Ok(None) => break,
                Ok(Some(t)) => assert!(t.len <= r.capacity()),
                Err(e) => {
                    assert!(e.to_string().starts_with("request ring: "), "{e}");
                    break;
                }
            }
        }
        // `taken` in the header is the daemon's to write: a client's scribble there changes
        // nothing it reads.
        c.view.store(0, u64::MAX, Ordering::Relaxed);
        assert!(r.take(&mut buf).unwrap().is_none());
    }

    #[test]
    fn the_reader_is_woken_once_per_wait_and_only_with_an_entry_there() {
        struct Count(AtomicUsize);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let (fd, r) = ring(16, 128);
        let mut c = Client::new(&fd, 16, 128);
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        assert!(r.wake_if_wanted().is_none(), "not waiting");
        r.wait(&waker);
        assert!(r.wake_if_wanted().is_none(), "nothing there");
        assert!(c.put(b"x", 0));
        r.wake_if_wanted().unwrap().wake();
        assert!(r.wake_if_wanted().is_none(), "once");
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        // The spinning word is the daemon's, in header word 1.
        r.set_spinning(true);
        assert_eq!(c.view.load(1, Ordering::Relaxed), 1);
        r.set_spinning(false);
        assert_eq!(c.view.load(1, Ordering::Relaxed), 0);
        // Dropped (the session stopped reading): `ended`, and not spinning.
        r.set_spinning(true);
        assert_eq!(c.view.load(2, Ordering::Relaxed), 0);
        drop(r);
        assert_eq!(
            (
                c.view.load(1, Ordering::Relaxed),
                c.view.load(2, Ordering::Relaxed)
            ),
            (0, 1)
        );
    }

    #[test]
    fn the_file_and_the_sizes_are_checked_naming_the_field_and_the_limit() {
        let msg = |r: Result<Ring, Status>| r.err().expect("refused").message().to_string();
        let fd = memfd(1 << 20, SealFlags::SHRINK);
        assert_eq!(
            msg(Ring::attach(&fd, 8, 128)),
            "attach_request_ring.slots: 8 (a power of two, 16 to 4096)"
        );
        assert_eq!(
            msg(Ring::attach(&fd, 16, 100)),
            "attach_request_ring.slot_bytes: 100 (a power of two, 128 to 4096)"
        );
        assert_eq!(
            msg(Ring::attach(&fd, 4096, 4096)),
            "attach_request_ring: slots × slot_bytes is 16777216; at most 1048576"
        );
        let small = memfd(64 + 16 * 128 - 1, SealFlags::SHRINK);
        assert_eq!(
            msg(Ring::attach(&small, 16, 128)),
            "attach_request_ring: the memfd is 2111 bytes; a ring of 16 slots of 128 bytes needs 2112 (64 + slots × \
             slot_bytes)"
        );
        let unsealed = memfd(1 << 20, SealFlags::empty());
        assert!(msg(Ring::attach(&unsealed, 16, 128)).contains("F_SEAL_SHRINK"));
        let r = Ring::attach(&fd, 16, 128).unwrap();
        assert_eq!((r.slots(), r.slot_bytes()), (16, 128));
    }
}
