//! When a kernel batch is done: the kernels' host-mapped completion word, and the stream query
//! for the newest batch and for faults.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::SLOTS;
use crate::gpu::{Gpu, LaunchSignal, PersistentGrid, PinnedRegion, Stream};
use crate::unpack::{TicketBook, UnpackError};

/// How often, at most, an outstanding batch's stream is queried for errors.
const HEALTH_EVERY: Duration = Duration::from_millis(1);

/// Batch completion through the kernels' signal (`signal_previous` in kernels/unpack.cu): every
/// launch carries the number of the newest batch issued before it and stores it into `word` once
/// the grids before it have completed. Batches run in order on one stream, so the word only grows
/// and a batch is done once the word has reached it; the newest batch, which no launch follows
/// yet, is done when the stream is idle (one query). The persistent grid stores each batch's
/// number itself when the batch is finished.
pub(super) struct Completions {
    pub(super) book: TicketBook,
    /// 8 bytes, host-mapped: the newest batch known finished.
    pub(super) word: PinnedRegion,
    /// Persistent mode: the word is the grid's, and an idle stream means a grid that left.
    pub(super) persistent: bool,
    last_health: Instant,
}

impl Completions {
    pub(super) fn new(gpu: &Arc<Gpu>) -> Result<Completions, UnpackError> {
        Ok(Completions {
            book: TicketBook::new(SLOTS),
            word: gpu.alloc_pinned(8)?,
            persistent: false,
            last_health: Instant::now(),
        })
    }

    /// What every launch carries: the newest batch issued so far, to report once it is done
    /// (nothing when the host already knows it is: a batch on an idle stream).
    pub(super) fn signal(&self) -> Result<LaunchSignal, UnpackError> {
        let last = self.book.last_seq();
        let value = if self.book.is_known_done(last) { 0 } else { last };
        Ok(LaunchSignal::new(&self.word, 0, value)?)
    }

    /// Reads the word; true once batch `seq` finished.
    pub(super) fn reached(&mut self, seq: u64) -> Result<bool, UnpackError> {
        if self.book.is_known_done(seq) {
            return Ok(true);
        }
        self.book.mark_done(self.word.load_u64(0)?);
        Ok(self.book.is_known_done(seq))
    }

    /// The stream finished everything: in launch mode every batch issued is done; a persistent
    /// grid must have signalled batch `seq` (allow the store a moment to land), or it died
    /// without it.
    pub(super) fn settle(&mut self, seq: u64) -> Result<bool, UnpackError> {
        if !self.persistent {
            self.book.mark_done(self.book.last_seq());
            return Ok(true);
        }
        for _ in 0..1000 {
            if self.reached(seq)? {
                return Ok(true);
            }
            std::hint::spin_loop();
        }
        Err(UnpackError::NoSignal {
            batch: seq,
            signalled: self.book.done_upto(),
        })
    }

    /// Non-blocking. Queries the stream (a driver call) only when the word says not yet, and
    /// then only for the newest batch (nothing follows it to report it) or once per
    /// [`HEALTH_EVERY`] (a faulted kernel). With a persistent grid, first makes sure a grid will
    /// take the batch (one load of host memory).
    pub(super) fn poll(
        &mut self,
        seq: u64,
        stream: &Stream,
        mut grid: Option<&mut PersistentGrid>,
    ) -> Result<bool, UnpackError> {
        if self.reached(seq)? {
            return Ok(true);
        }
        if let Some(g) = grid.as_deref_mut() {
            g.revive(stream)?;
        }
        let newest = !self.persistent && seq == self.book.last_seq();
        if !newest && self.last_health.elapsed() < HEALTH_EVERY {
            return Ok(false);
        }
        self.last_health = Instant::now();
        self.idle_check(seq, stream, grid)
    }

    /// The stream says whether the kernels are still running: idle with the batch unsignalled is
    /// an error, unless a persistent grid left without taking it (then it is relaunched).
    pub(super) fn idle_check(
        &mut self,
        seq: u64,
        stream: &Stream,
        grid: Option<&mut PersistentGrid>,
    ) -> Result<bool, UnpackError> {
        if !stream.is_idle()? {
            return Ok(false);
        }
        if let Some(g) = grid {
            if g.revive(stream)? {
                return Ok(false);
            }
        }
        self.settle(seq)
    }

    /// Blocks until batch `seq` finished.
    pub(super) fn wait(
        &mut self,
        seq: u64,
        stream: &Stream,
        mut grid: Option<&mut PersistentGrid>,
    ) -> Result<(), UnpackError> {
        let mut spins = 0u32;
        while !self.reached(seq)? {
            if self.idle_check(seq, stream, grid.as_deref_mut())? {
                return Ok(());
            }
            spins += 1;
            if spins > 64 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        Ok(())
    }

    /// The slot the next batch will use, once the batch that held it finished (waits if not:
    /// back-pressure when more batches are in flight than there are slots).
    pub(super) fn reserve(
        &mut self,
        stream: &Stream,
        grid: Option<&mut PersistentGrid>,
    ) -> Result<usize, UnpackError> {
        let (slot, prev) = self.book.next_slot();
        if !self.reached(prev)? {
            self.book.stalled();
            self.wait(prev, stream, grid)?;
        }
        Ok(slot)
    }
}
