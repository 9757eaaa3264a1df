//! When a kernel batch is done: the kernels' host-mapped completion word, and the stream query
//! for the newest batch and for faults. Used by the kernel unpacker (its launches report the
//! batch before them; its persistent grid reports each batch itself) and by the block batches
//! (each batch's last launch reports that batch itself: `gpu::blocks::BlockSignal`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::gpu::{Gpu, LaunchSignal, PersistentGrid, PinnedRegion, Stream};
use crate::unpack::{TicketBook, UnpackError};

/// How often, at most, an outstanding batch's stream is queried for errors.
const HEALTH_EVERY: Duration = Duration::from_millis(1);

/// Batch completion through the kernels' host-mapped word. Two ways to fill it:
/// - **The launch after** (`signal_previous` in kernels/unpack.cu, the kernel unpacker's
///   launches): every launch carries the number of the newest batch issued before it and stores
///   it once the grids before it have completed; the newest batch, which no launch follows yet,
///   is done when the stream is idle (one query).
/// - **Self-signalled** (`self_signalled`): each batch's own work stores its number when it is
///   finished (the persistent grid; the block kernels' last thread block, `signal_done` in
///   kernels/blocks.cu). No batch needs a stream query; a stream gone idle without the number is
///   an error (`UnpackError::NoSignal`), or, with a persistent grid, a grid that left.
///
/// Batches run in order on one stream, so the word only grows and a batch is done once the word
/// has reached it.
pub(crate) struct Completions {
    pub(crate) book: TicketBook,
    /// 8 bytes, host-mapped: the newest batch known finished.
    pub(crate) word: PinnedRegion,
    /// Each batch stores its own number (module doc); with a persistent grid, an idle stream
    /// also means a grid that left.
    pub(crate) self_signalled: bool,
    last_health: Instant,
}

impl Completions {
    /// Completions of batches launched from `slots` reusable slots (launch-after mode).
    pub(crate) fn new(gpu: &Arc<Gpu>, slots: usize) -> Result<Completions, UnpackError> {
        Ok(Completions {
            book: TicketBook::new(slots),
            word: gpu.alloc_pinned(8)?,
            self_signalled: false,
            last_health: Instant::now(),
        })
    }

    /// What every launch carries: the newest batch issued so far, to report once it is done
    /// (nothing when the host already knows it is: a batch on an idle stream).
    pub(crate) fn signal(&self) -> Result<LaunchSignal, UnpackError> {
        let last = self.book.last_seq();
        let value = if self.book.is_known_done(last) { 0 } else { last };
        Ok(LaunchSignal::new(&self.word, 0, value)?)
    }

    /// Reads the word; true once batch `seq` finished.
    pub(crate) fn reached(&mut self, seq: u64) -> Result<bool, UnpackError> {
        if self.book.is_known_done(seq) {
            return Ok(true);
        }
        self.book.mark_done(self.word.load_u64(0)?);
        Ok(self.book.is_known_done(seq))
    }

    /// The stream finished everything: in launch-after mode every batch issued is done; a
    /// self-signalled batch must have stored its number (allow the store a moment to land), or
    /// its work died without it.
    pub(crate) fn settle(&mut self, seq: u64) -> Result<bool, UnpackError> {
        if !self.self_signalled {
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
    /// then only for the newest batch in launch-after mode (nothing follows it to report it) or
    /// once per [`HEALTH_EVERY`] (a faulted kernel). With a persistent grid, first makes sure a
    /// grid will take the batch (one load of host memory).
    pub(crate) fn poll(
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
        let newest = !self.self_signalled && seq == self.book.last_seq();
        if !newest && self.last_health.elapsed() < HEALTH_EVERY {
            return Ok(false);
        }
        self.last_health = Instant::now();
        self.idle_check(seq, stream, grid)
    }

    /// The stream says whether the kernels are still running: idle with the batch unsignalled is
    /// an error, unless a persistent grid left without taking it (then it is relaunched).
    pub(crate) fn idle_check(
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
    pub(crate) fn wait(
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
    pub(crate) fn reserve(
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
