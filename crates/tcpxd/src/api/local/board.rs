//! A framed session's completion board: memory the client and the daemon both map (a sealed
//! memfd the client hands over with `attach_board`), where the daemon publishes the end of each
//! of the session's transfers that finished OK, so that a client polling in a tight loop learns
//! it by reading memory — no `recv`, no protobuf decode (docs/API.md, "The completion board").
//!
//! # Layout
//!
//! Little-endian u64 words. Word 0 is `published`: how many ends the daemon has published (the
//! client's cheap "anything new?"). Words 1–7 are reserved (zero). Then `slots` slots of 8 words
//! (one 64-byte cache line each); slot `i` starts at word `8 × (i + 1)`:
//!
//! | word | what |
//! | --- | --- |
//! | 0 | state: 0 free; [`CLAIMED`] being written; else the tag whose end it holds |
//! | 1 | the transfer's id |
//! | 2 | `total_bytes` |
//! | 3 | `bytes_done` |
//! | 4 | `elapsed_us` |
//! | 5 | how many per-entry statuses the event has (each OK, with no message) |
//! | 6–7 | reserved |
//!
//! A request with tag `t` is published in slot `t mod slots`.
//!
//! A board may also have `notification_slots` after those (`attach_board.notification_slots`):
//! 32 words (256 bytes) each, where a subscribed session's notifications go in order — the `k`th
//! notification event of the session is number `k` (from 1) and goes in slot `(k - 1) mod
//! notification_slots`: word 0 its number (0: none yet), word 1 its payload's length, words 2–31
//! the payload (at most [`NOTE_BYTES`]). Header word 2 is `notified`, the number of the newest
//! notification event (whether or not its payload went in a slot), word 3 `consumed`, written by
//! the client: the number of the last notification it has taken (from a slot or its event).
//!
//! # State
//!
//! A slot goes free → CLAIMED → tag (the daemon) → free (the client, once it has read it). The
//! daemon claims a slot only by a compare-exchange from 0 (acquire), so of two ends racing for
//! one slot (tags `slots` apart) one wins and the other is not published; it writes words 1–4,
//! then the tag (release), then adds 1 to `published` (release). The client reads `published`
//! (acquire), then a slot's state (acquire): equal to its tag, words 1–4 are that end's; it
//! reads them, then frees the slot (a release store of 0), after which the daemon may claim it
//! again (its acquire pairs with that release, so it does not overwrite words the client is
//! still reading). The Python reader relies on x86-64's ordering (loads are not reordered with
//! loads, nor stores with earlier loads) and the C pass on acquire / release builtins.
//!
//! A notification `k` goes in its slot only when its payload fits and the slot's previous one
//! (`k - notification_slots`) is consumed (`consumed` read with acquire); the daemon writes the
//! length and payload, then `k` (release), then `notified` (release), then pushes the event. The
//! client takes slot by slot while the next one holds the number after `consumed`, then stores
//! `consumed` (release: the daemon may reuse the slot), and drops the events whose number it has
//! consumed already; where a slot does not hold the next number (skipped: too long, or the ring
//! was full) it waits for that notification's event, so the order is the events' order.
//!
//! # Why nothing is missed
//!
//! The board is only ever in addition to the socket: every end the daemon publishes is also
//! written as its `finished` event right after, under the same lock of the session's delivered
//! tags (`crate::api::delivery::deliver_finished`), and refusals, failures and ends with a
//! per-entry status that is not a plain OK go only as events. So a slot that is taken (an earlier end the client has
//! not read), a client that never reads the board, or a hostile one that scribbles on it, only
//! sends ends the socket's way; and a client that sleeps in `poll` on the socket is woken by the
//! event as before. A DONE on the board means exactly what the `finished` event with status OK
//! means: it is published at the same point, after the transfer's bytes are in place and its
//! status is final. The client skips an event whose tag it already settled from the board. The
//! same for notifications: each still comes as its event (the ring carries only the payload,
//! which is what tcpxd.nixl reads; the event has the rest), right after it went in the ring.
//!
//! # What the daemon trusts
//!
//! Nothing it reads from the board: a slot's state decides only whether this session's end is
//! published there (a compare-exchange), `published` is only added to. Every access is
//! bounds-checked in `crate::net::shared_words`; the file is a memfd sealed against shrinking
//! (`F_SEAL_SHRINK`, checked, so it can never be truncated under the mapping) and at least the
//! board's size. A session's board is its own: another session's client cannot reach it.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering;

use rustix::fs::{FileType, SealFlags};
use tonic::Status;

use crate::api::proto::v1 as pb;
use crate::net::shared_words::SharedWords;

/// A slot's state while the daemon writes it.
pub const CLAIMED: u64 = u64::MAX;
/// Words of the header and of each slot.
pub const SLOT_WORDS: usize = 8;
/// The fewest and the most slots a board may have: at most 256 KiB (+ its header), whose pages
/// the daemon faults in when it maps the board (none of its own then waits on a page fault).
pub const MIN_SLOTS: u32 = 64;
pub const MAX_SLOTS: u32 = 4_096;
/// Words of a notification slot, and the payload bytes it holds.
pub const NOTE_WORDS: usize = 32;
pub const NOTE_BYTES: usize = (NOTE_WORDS - 2) * 8;

/// A session's board, mapped.
pub struct Board {
    words: SharedWords,
    slots: u64,
    /// Notification slots (0: none) and where they start (a word index).
    notes: u64,
    notes_at: usize,
    /// The number of the session's last notification event (this side's own count).
    noted: std::sync::atomic::AtomicU64,
}

impl Board {
    /// Checks the client's file (a memfd sealed against shrinking, holding the board) and maps
    /// it; the refusal names the field and the limit.
    pub fn attach(fd: &OwnedFd, slots: u32, notes: u32) -> Result<Board, Status> {
        if !slots.is_power_of_two() || !(MIN_SLOTS..=MAX_SLOTS).contains(&slots) {
            return Err(Status::invalid_argument(format!(
                "attach_board.slots: {slots} (a power of two, {MIN_SLOTS} to {MAX_SLOTS})"
            )));
        }
        if notes != 0 && (!notes.is_power_of_two() || notes > MAX_SLOTS) {
            return Err(Status::invalid_argument(format!(
                "attach_board.notification_slots: {notes} (0, or a power of two up to {MAX_SLOTS})"
            )));
        }
        let notes_at = (slots as usize + 1) * SLOT_WORDS;
        let words = notes_at + notes as usize * NOTE_WORDS;
        sealed_memfd(
            fd,
            words as u64 * 8,
            "attach_board",
            &format!(
                "a board of {slots} slots and {notes} notification slots needs {} (64 × (slots + 1) + 256 × \
                 notification_slots)",
                words as u64 * 8
            ),
        )?;
        let words = SharedWords::map(fd.as_fd(), words)
            .map_err(|e| Status::failed_precondition(format!("attach_board: {e}")))?;
        Ok(Board {
            words,
            slots: u64::from(slots),
            notes: u64::from(notes),
            notes_at,
            noted: Default::default(),
        })
    }

    pub fn slots(&self) -> u32 {
        self.slots as u32
    }

    pub fn notification_slots(&self) -> u32 {
        self.notes as u32
    }

    /// Numbers the session's next notification event and puts its payload in its slot when it
    /// fits and the slot is consumed; whether it did. Called for every notification event, right
    /// before it is pushed, by the session's one delivery (in order).
    pub fn note(&self, payload: &[u8]) -> bool {
        let k = self.noted.fetch_add(1, Ordering::Relaxed) + 1;
        let w = &self.words;
        let mut put = false;
        if self.notes > 0 && payload.len() <= NOTE_BYTES {
            let consumed = w.load(3, Ordering::Acquire);
            // The slot's previous notification (k - notes) is taken: the client is done with it.
            if k.wrapping_sub(consumed) <= self.notes {
                let at = self.notes_at + ((k - 1) % self.notes) as usize * NOTE_WORDS;
                w.store(at + 1, payload.len() as u64, Ordering::Relaxed);
                for (i, chunk) in payload.chunks(8).enumerate() {
                    let mut b = [0u8; 8];
                    b[..chunk.len()].copy_from_slice(chunk);
                    w.store(at + 2 + i, u64::from_le_bytes(b), Ordering::Relaxed);
                }
                w.store(at, k, Ordering::Release);
                put = true;
            }
        }
        w.store(2, k, Ordering::Release);
        put
    }

    /// Publishes a transfer's end under `tag` when its event says OK (and every per-entry status
    /// OK, with no message) and its slot is free; whether it did. (The event goes to the socket
    /// either way.)
    pub fn publish(&self, tag: u64, ev: &pb::TransferEvent) -> bool {
        let all_ok = ev.entries.iter().all(|e| e.code == 0 && e.message.is_empty());
        if tag == 0 || tag == CLAIMED || ev.status_code != 0 || !all_ok {
            return false;
        }
        let at = ((tag & (self.slots - 1)) as usize + 1) * SLOT_WORDS;
        if !self.words.claim(at, 0, CLAIMED) {
            return false;
        }
        let w = &self.words;
        w.store(at + 1, ev.transfer_id, Ordering::Relaxed);
        w.store(at + 2, ev.total_bytes, Ordering::Relaxed);
        w.store(at + 3, ev.bytes_done, Ordering::Relaxed);
        w.store(at + 4, ev.elapsed_us, Ordering::Relaxed);
        w.store(at + 5, ev.entries.len() as u64, Ordering::Relaxed);
        w.store(at, tag, Ordering::Release);
        w.fetch_add(0, 1, Ordering::Release);
        true
    }
}

/// Checks that `fd` is a memfd sealed against shrinking (and not against writing) of at least
/// `need` bytes, for `what` (`attach_board`, `attach_request_ring`); `sizes` says what the size
/// is made of, in the refusal.
pub(super) fn sealed_memfd(fd: &OwnedFd, need: u64, what: &str, sizes: &str) -> Result<(), Status> {
    let bad = |why: String| Status::invalid_argument(format!("{what}: {why}"));
    let st = rustix::fs::fstat(fd).map_err(|e| bad(format!("fstat: {e}")))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(bad("the descriptor is not a memfd".into()));
    }
    let seals = rustix::fs::fcntl_get_seals(fd).map_err(|e| {
        bad(format!(
            "the descriptor is not a memfd that takes seals (F_GET_SEALS: {e})"
        ))
    })?;
    if !seals.contains(SealFlags::SHRINK) {
        return Err(bad(
            "the memfd is not sealed against shrinking (F_SEAL_SHRINK): the daemon maps only memory that cannot be \
             truncated under it"
                .into(),
        ));
    }
    if seals.contains(SealFlags::WRITE) || seals.contains(SealFlags::FUTURE_WRITE) {
        return Err(bad(
            "the memfd is sealed against writing: the daemon writes in it".into(),
        ));
    }
    let size = u64::try_from(st.st_size).unwrap_or(0);
    if size < need {
        return Err(bad(format!("the memfd is {size} bytes; {sizes}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::fs::MemfdFlags;

    fn memfd(bytes: u64, seals: SealFlags) -> OwnedFd {
        let fd = rustix::fs::memfd_create(
            "tcpxd-board-test",
            MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
        )
        .unwrap();
        rustix::fs::ftruncate(&fd, bytes).unwrap();
        if !seals.is_empty() {
            rustix::fs::fcntl_add_seals(&fd, seals).unwrap();
        }
        fd
    }

    fn ok(id: u64, bytes: u64) -> pb::TransferEvent {
        pb::TransferEvent {
            transfer_id: id,
            total_bytes: bytes,
            bytes_done: bytes,
            elapsed_us: 7,
            ..Default::default()
        }
    }

    /// What a client sees: the file's words read back through a mapping of its own.
    fn client_view(fd: &OwnedFd, words: usize) -> SharedWords {
        SharedWords::map(fd.as_fd(), words).unwrap()
    }

    #[test]
    fn an_end_is_published_in_its_slot_with_its_fields_then_freed_and_reused() {
        let fd = memfd(64 * 65, SealFlags::SHRINK);
        let board = Board::attach(&fd, 64, 0).unwrap();
        let view = client_view(&fd, 65 * 8);
        assert!(board.publish(70, &ok(9, 4096)));
        // tag 70 is slot 6: words 56.. (header 8, 8 a slot)
        let at = (6 + 1) * 8;
        assert_eq!(view.load(at, Ordering::Acquire), 70);
        assert_eq!(
            (1..6)
                .map(|k| view.load(at + k, Ordering::Relaxed))
                .collect::<Vec<_>>(),
            vec![9, 4096, 4096, 7, 0]
        );
        assert_eq!(view.load(0, Ordering::Acquire), 1, "published counted");
        // Taken until the client frees it: tag 134 (= 70 + 64) is not published.
        assert!(!board.publish(134, &ok(10, 1)));
        view.store(at, 0, Ordering::Release);
        let mut two = ok(10, 1);
        two.entries = vec![pb::EntryStatus::default(); 2];
        assert!(board.publish(134, &two));
        assert_eq!(view.load(at, Ordering::Acquire), 134);
        assert_eq!(view.load(at + 5, Ordering::Relaxed), 2, "two OK entries");
        assert_eq!(view.load(0, Ordering::Acquire), 2);
    }

    #[test]
    fn failures_entries_tag_zero_and_claimed_go_only_as_events() {
        let fd = memfd(64 * 65, SealFlags::SHRINK);
        let board = Board::attach(&fd, 64, 0).unwrap();
        let mut failed = ok(1, 1);
        failed.status_code = tonic::Code::DeadlineExceeded as i32;
        failed.status_message = "the transfer's deadline passed".into();
        assert!(!board.publish(1, &failed));
        let mut entries = ok(2, 1);
        entries.entries.push(pb::EntryStatus::default());
        entries.entries.push(pb::EntryStatus {
            code: 0,
            message: "a message".into(),
        });
        assert!(!board.publish(2, &entries));
        assert!(!board.publish(0, &ok(3, 1)));
        assert!(!board.publish(CLAIMED, &ok(4, 1)));
        let view = client_view(&fd, 65 * 8);
        assert!(
            (0..65 * 8).all(|i| view.load(i, Ordering::Relaxed) == 0),
            "nothing written"
        );
    }

    #[test]
    fn garbage_from_the_client_never_reaches_past_the_board_nor_stops_the_daemon() {
        let fd = memfd(64 * 65, SealFlags::SHRINK);
        let board = Board::attach(&fd, 64, 0).unwrap();
        let view = client_view(&fd, 65 * 8);
        for i in 0..65 * 8 {
            view.store(i, 0xdead_beef_dead_beef ^ i as u64, Ordering::Relaxed);
        }
        // Every slot taken (nonzero): nothing is published, the events carry the ends.
        assert!((1..200).all(|tag| !board.publish(tag, &ok(tag, 1))));
        // `published` is only added to, whatever it held.
        view.store(0, u64::MAX, Ordering::Relaxed);
        view.store(8, 0, Ordering::Relaxed);
        assert!(board.publish(64, &ok(1, 1)));
        assert_eq!(view.load(0, Ordering::Relaxed), 0, "wrapped, no panic");
    }

    #[test]
    fn notifications_go_in_order_in_their_slots_when_consumed_and_short_enough() {
        // 64 end slots, 4 notification slots: 64 × 65 + 256 × 4 bytes.
        let fd = memfd(64 * 65 + 256 * 4, SealFlags::SHRINK);
        let board = Board::attach(&fd, 64, 4).unwrap();
        assert_eq!(board.notification_slots(), 4);
        let view = client_view(&fd, 65 * 8 + 4 * 32);
        let slot = |k: u64| 65 * 8 + ((k - 1) % 4) as usize * 32;
        let read = |k: u64| -> Option<Vec<u8>> {
            let at = slot(k);
            (view.load(at, Ordering::Acquire) == k).then(|| {
                let len = view.load(at + 1, Ordering::Relaxed) as usize;
                let bytes: Vec<u8> = (0..30)
                    .flat_map(|i| view.load(at + 2 + i, Ordering::Relaxed).to_le_bytes())
                    .collect();
                bytes[..len].to_vec()
            })
        };
        // 1..=4 fit; 5 waits for 1 to be consumed: skipped (its event carries it).
        for k in 1..=4u64 {
            assert!(board.note(format!("note {k}").as_bytes()));
        }
        assert!(!board.note(b"note 5"));
        assert_eq!(view.load(2, Ordering::Acquire), 5, "notified counts every event");
        assert_eq!(read(1).as_deref(), Some(&b"note 1"[..]));
        assert_eq!(read(4).as_deref(), Some(&b"note 4"[..]));
        // The client took 1..=5 (5 by its event): 6 goes in slot 2 (1's).
        view.store(3, 5, Ordering::Release);
        assert!(board.note(b"note 6"));
        assert_eq!(read(6).as_deref(), Some(&b"note 6"[..]));
        // Too long for a slot: not put there, still numbered.
        view.store(3, 6, Ordering::Release);
        assert!(!board.note(&[7u8; NOTE_BYTES + 1]));
        assert!(board.note(&[8u8; NOTE_BYTES]));
        assert_eq!(read(8), Some(vec![8u8; NOTE_BYTES]));
        assert_eq!(view.load(2, Ordering::Acquire), 8);
        // A client that says it consumed what it never could changes only its own slots.
        view.store(3, u64::MAX, Ordering::Release);
        assert!(!board.note(b"note 9"));
        // No notification slots: numbered, never put.
        let fd = memfd(64 * 65, SealFlags::SHRINK);
        let plain = Board::attach(&fd, 64, 0).unwrap();
        assert!(!plain.note(b"x"));
        let e = Board::attach(&memfd(64 * 65 + 256 * 3, SealFlags::SHRINK), 64, 3)
            .err()
            .unwrap();
        assert_eq!(
            e.message(),
            "attach_board.notification_slots: 3 (0, or a power of two up to 4096)"
        );
        let e = Board::attach(&memfd(64 * 65, SealFlags::SHRINK), 64, 4)
            .err()
            .unwrap();
        assert!(e.message().contains("needs 5184"), "{}", e.message());
    }

    #[test]
    fn the_file_must_be_a_sealed_memfd_of_the_boards_size() {
        let code = |r: Result<Board, Status>| {
            let e = r.err().expect("refused");
            (e.code(), e.message().to_string())
        };
        let (c, m) = code(Board::attach(&memfd(64 * 65, SealFlags::SHRINK), 100, 0));
        assert_eq!(c, tonic::Code::InvalidArgument);
        assert_eq!(m, "attach_board.slots: 100 (a power of two, 64 to 4096)");
        assert!(
            code(Board::attach(&memfd(64 * 65, SealFlags::SHRINK), 32, 0))
                .1
                .contains("32")
        );
        assert!(
            code(Board::attach(&memfd(64 * 65, SealFlags::SHRINK), 1 << 13, 0))
                .1
                .contains("8192")
        );
        let (_, m) = code(Board::attach(&memfd(64 * 65, SealFlags::empty()), 64, 0));
        assert!(m.contains("F_SEAL_SHRINK"), "{m}");
        let (_, m) = code(Board::attach(&memfd(64 * 64, SealFlags::SHRINK), 64, 0));
        assert_eq!(
            m,
            "attach_board: the memfd is 4096 bytes; a board of 64 slots and 0 notification slots needs 4160 \
             (64 × (slots + 1) + 256 × notification_slots)"
        );
        // A socket is not a memfd.
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let (_, m) = code(Board::attach(&OwnedFd::from(a), 64, 0));
        assert!(m.contains("not a memfd"), "{m}");
        // Larger than needed is fine.
        assert_eq!(
            Board::attach(&memfd(1 << 20, SealFlags::SHRINK), 64, 0)
                .unwrap()
                .slots(),
            64
        );
    }
}
