//! Block chunks on a GPU: the batches of `tcpxd_gather_blocks` (a sender's gathers into its
//! staging slots) and `tcpxd_scatter_blocks` (a receiver's scatters of received chunks into their
//! blocks) the poller queues during a pass and launches once at its end, up to
//! [`BLOCK_TASKS`] chunks per launch, on a stream of their own, with an error word per batch (the
//! kernels' bounds guard). A batch reports itself done: its last launch's last thread block
//! stores the batch's number into a host-mapped word ([`BlockSignal`]), so the poller sees it with
//! one load of host memory, with no event recorded or queried (each such driver call costs the
//! poller µs while the plugin's threads copy); the stream is queried once a millisecond at most,
//! for a kernel that died. Each chunk's piece table comes with it. At launch:
//!
//! - **Inline** when every launch's tables hold at most the largest of [`INLINE_CAPS`] pieces
//!   (16 chunks of 64 KiB or 16 KiB blocks): the tables travel in the launch's parameter block
//!   (`tcpxd_*_blocks_inline_<cap>`), one driver call per launch. On the emulation each driver
//!   call costs the poller ~8 µs while the plugin's threads copy (session 10's traces), and the
//!   receive waits for the submit before its scatter even starts.
//! - **Through the device arena** otherwise: the batch's tables go into one pinned arena and, by
//!   a small copy kernel on the batch's stream (not a copy engine: on a receiving GPU those queue
//!   it behind the plugin's own copies), into device memory, where every thread block reads its
//!   chunk's table (from pinned host memory, each of a chunk's thread blocks read the whole table
//!   across PCIe: for 4 KiB blocks, 16 blocks × 128 pieces per chunk, the bulk of a batch's
//!   time).
//!
//! Nothing is allocated per chunk: the arenas grow per batch slot and are reused, the tasks and
//! tables live in reused vectors.

use std::sync::Arc;

use super::completions::Completions;
use super::{Ticket, UnpackError};
use crate::engine::blocks::Segment;
use crate::gpu::blocks::{
    BLOCK_TASKS, BlockSignal, GATHER_UNIT, GatherTask, INLINE_CAPS, InlineTask, ScatterTask,
};
use crate::gpu::{DeviceRegion, Gpu, GpuError, Kernels, PinnedRegion, Stream};

/// Batches in flight at once (a slot's error word and table arena are reused after its batch is
/// done).
const SLOTS: usize = 16;

/// Which kernel a batcher launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockOp {
    Gather,
    Scatter,
}

/// One GPU's batches of one block kernel.
pub struct BlockBatcher {
    op: BlockOp,
    gpu: Arc<Gpu>,
    kernels: Arc<Kernels>,
    stream: Stream,
    /// The batches issued and the word their last launches store their numbers into.
    done: Completions,
    /// The device u32 the thread blocks of a batch's last launch count themselves on.
    counter: DeviceRegion,
    /// One u32 per slot: the kernel's report of what it skipped (0: nothing).
    errors: PinnedRegion,
    gathers: Vec<GatherTask>,
    scatters: Vec<ScatterTask>,
    /// The queued chunks' tables, in push order (each task's `nsegs` pieces).
    tables: Vec<Segment>,
    /// Per batch slot: the tables of the batch launched from it, pinned and on the device
    /// (grown, never shrunk; rewritten only once the slot's previous batch is done).
    arenas: Vec<Option<(PinnedRegion, DeviceRegion)>>,
    /// Reports of batches whose slot was reused before anyone asked about them (more than
    /// `SLOTS` batches in flight): (batch, word).
    early: Vec<(u64, u32)>,
    /// Blocks of 256 threads per task for this batch (the largest any task asked).
    blocks_per_task: u32,
    /// Whether tables small enough may travel in the launch's parameter block (benchmarks turn
    /// it off to time the arena path).
    allow_inline: bool,
}

impl BlockBatcher {
    pub fn new(gpu: &Arc<Gpu>, op: BlockOp) -> Result<BlockBatcher, UnpackError> {
        gpu.bind_to_thread()?;
        Ok(BlockBatcher {
            op,
            gpu: gpu.clone(),
            kernels: gpu.kernels()?,
            stream: Stream::new(gpu)?,
            done: {
                let mut c = Completions::new(gpu, SLOTS)?;
                c.self_signalled = true;
                c
            },
            counter: gpu.alloc(4)?,
            errors: gpu.alloc_pinned(SLOTS * 4)?,
            gathers: Vec::with_capacity(4 * BLOCK_TASKS),
            scatters: Vec::with_capacity(4 * BLOCK_TASKS),
            tables: Vec::new(),
            arenas: (0..SLOTS).map(|_| None).collect(),
            early: Vec::new(),
            blocks_per_task: 1,
            allow_inline: true,
        })
    }

    /// Whether small tables travel inline (default) or always through the device arena (for
    /// benchmarks: `tcpxd-unpack-bench`'s `blocks-scatter-*-arena` rows).
    pub fn set_inline(&mut self, allow: bool) {
        self.allow_inline = allow;
    }

    /// Queues a chunk's gather (`bytes` bytes: a warp per 4 KiB unit, 8 warps a block) with its
    /// piece table (`table`: the task's `nsegs` pieces, copied to the device at launch).
    pub fn push_gather(
        &mut self,
        task: GatherTask,
        bytes: u32,
        table: &[Segment],
    ) -> Result<(), UnpackError> {
        if self.op != BlockOp::Gather {
            return Err(UnpackError::Gpu(GpuError::InvalidArgument(
                "a gather pushed into a scatter batcher".into(),
            )));
        }
        same_table(task.nsegs(), table)?;
        self.tables.extend_from_slice(table);
        self.gathers.push(task);
        let units = bytes.div_ceil(GATHER_UNIT);
        self.blocks_per_task = self.blocks_per_task.max(units.div_ceil(8));
        Ok(())
    }

    /// Queues a received chunk's scatter of `fragments` fragments (a warp each) with its piece
    /// table (as for `push_gather`).
    pub fn push_scatter(
        &mut self,
        task: ScatterTask,
        fragments: u32,
        table: &[Segment],
    ) -> Result<(), UnpackError> {
        if self.op != BlockOp::Scatter {
            return Err(UnpackError::Gpu(GpuError::InvalidArgument(
                "a scatter pushed into a gather batcher".into(),
            )));
        }
        same_table(task.nsegs(), table)?;
        self.tables.extend_from_slice(table);
        self.scatters.push(task);
        self.blocks_per_task = self.blocks_per_task.max(fragments.div_ceil(8));
        Ok(())
    }

    /// Whether anything was queued since the last submit.
    pub fn pending(&self) -> bool {
        !self.gathers.is_empty() || !self.scatters.is_empty()
    }

    /// Launches what was queued (16 chunks a launch) and records the batch's event. `None` when
    /// nothing was queued.
    pub fn submit(&mut self) -> Result<Option<Ticket>, UnpackError> {
        if !self.pending() {
            return Ok(None);
        }
        let t0 = std::time::Instant::now();
        self.gpu.bind_to_thread()?;
        let (_, prev) = self.done.book.next_slot();
        let slot = self.done.reserve(&self.stream, None)?;
        // The slot's previous batch is done (reserve waited): nothing writes its word now. Its
        // report is kept until asked for.
        let word = self.errors.load_u32(slot * 4)?;
        if word != 0 && prev != 0 {
            // Bounded: a report nobody asked for (its batch was checked before) goes eventually.
            if self.early.len() >= 4 * SLOTS {
                self.early.remove(0);
            }
            self.early.push((prev, word));
        }
        self.errors.store_u32(slot * 4, 0)?;
        let t1 = std::time::Instant::now();
        let inline = self.allow_inline && self.fits_inline();
        if !inline && let Err(e) = self.tables_to_device(slot) {
            self.gathers.clear();
            self.scatters.clear();
            self.tables.clear();
            return Err(e);
        }
        let t2 = std::time::Instant::now();
        let bpt = self.blocks_per_task;
        self.blocks_per_task = 1;
        // The batch's number, stored by its last launch once every block of it is done.
        let seq = self.done.book.last_seq() + 1;
        let signal = BlockSignal::new(&self.counter, &self.done.word, 0, seq);
        let launches = match self.op {
            BlockOp::Gather => self.gathers.len(),
            BlockOp::Scatter => self.scatters.len(),
        }
        .div_ceil(BLOCK_TASKS);
        let result = signal.and_then(|signal| {
            let ctx = LaunchCtx {
                gpu: &self.gpu,
                kernels: &self.kernels,
                stream: &self.stream,
                tables: &self.tables,
                blocks_per_task: bpt,
                errors: &self.errors,
                slot,
                launches,
                signal,
            };
            match (self.op, inline) {
                (BlockOp::Gather, true) => ctx.inline(&self.gathers),
                (BlockOp::Scatter, true) => ctx.inline(&self.scatters),
                (BlockOp::Gather, false) => ctx.placed(&self.gathers),
                (BlockOp::Scatter, false) => ctx.placed(&self.scatters),
            }
        });
        self.gathers.clear();
        self.scatters.clear();
        self.tables.clear();
        result?;
        let ticket = self.done.book.issue();
        debug_assert_eq!(ticket.seq(), seq);
        let t3 = std::time::Instant::now();
        tracing::trace!(
            target: "tcpxd::blocks",
            op = ?self.op,
            inline,
            reserve_ns = (t1 - t0).as_nanos() as u64,
            tables_ns = (t2 - t1).as_nanos() as u64,
            launch_ns = (t3 - t2).as_nanos() as u64,
            "block submit"
        );
        Ok(Some(ticket))
    }

    /// Whether every launch of the queued tasks (16 at a time) has a table small enough to travel
    /// in its parameter block.
    fn fits_inline(&self) -> bool {
        let max = INLINE_CAPS[INLINE_CAPS.len() - 1] as u64;
        let fits = |pieces: &mut dyn Iterator<Item = u32>| pieces.map(u64::from).sum::<u64>() <= max;
        match self.op {
            BlockOp::Gather => self
                .gathers
                .chunks(BLOCK_TASKS)
                .all(|c| fits(&mut c.iter().map(|t| t.nsegs()))),
            BlockOp::Scatter => self
                .scatters
                .chunks(BLOCK_TASKS)
                .all(|c| fits(&mut c.iter().map(|t| t.nsegs()))),
        }
    }

    /// Copies the queued tables into slot `slot`'s arena (its previous batch is done) and on to
    /// the device, on the batch's stream, and points each task at its copy.
    fn tables_to_device(&mut self, slot: usize) -> Result<(), UnpackError> {
        // One spare piece: a task without pieces still gets an in-bounds (unread) table.
        let n = self.tables.len() + 1;
        let bytes = (n * size_of::<Segment>()) as u64;
        let arena = &mut self.arenas[slot];
        if arena.as_ref().is_none_or(|(p, _)| (p.len() as u64) < bytes) {
            let cap = (bytes.next_power_of_two()).max(64 * size_of::<Segment>() as u64) as usize;
            *arena = Some((self.gpu.alloc_pinned(cap)?, self.gpu.alloc(cap)?));
        }
        let (pinned, device) = arena.as_mut().expect("just made");
        pinned
            .typed_mut::<Segment>(0, self.tables.len())?
            .copy_from_slice(&self.tables);
        let span = device.span();
        let copied = std::time::Instant::now();
        let r = self
            .gpu
            .launch_copy_tables(&self.kernels, &self.stream, pinned.span(), span, bytes);
        tracing::trace!(target: "tcpxd::blocks", pieces = n, copy_launch_ns = copied.elapsed().as_nanos() as u64, "tables copied");
        r?;
        let mut at = 0u64;
        let seg = size_of::<Segment>() as u64;
        for t in &mut self.gathers {
            let k = u64::from(t.nsegs());
            t.relocate_table(span.sub(at * seg, k.max(1) * seg)?)?;
            at += k;
        }
        for t in &mut self.scatters {
            let k = u64::from(t.nsegs());
            t.relocate_table(span.sub(at * seg, k.max(1) * seg)?)?;
            at += k;
        }
        Ok(())
    }

    /// Non-blocking: has the batch finished? Once it has, a chunk the kernel skipped as out of
    /// bounds fails it ([`UnpackError::DeviceRejected`], naming task and item).
    pub fn is_done(&mut self, t: &Ticket) -> Result<bool, UnpackError> {
        self.done.book.known(t)?;
        if !self.done.poll(t.seq(), &self.stream, None)? {
            return Ok(false);
        }
        self.check(t)?;
        Ok(true)
    }

    /// Blocks until the batch has finished (tests, shutdown), then as [`BlockBatcher::is_done`].
    pub fn wait(&mut self, t: &Ticket) -> Result<(), UnpackError> {
        self.done.book.known(t)?;
        self.done.wait(t.seq(), &self.stream, None)?;
        self.check(t)
    }

    fn check(&mut self, t: &Ticket) -> Result<(), UnpackError> {
        let slot = (t.seq() % SLOTS as u64) as usize;
        let word = if self.done.book.last_seq() >= t.seq() + SLOTS as u64 {
            // A later batch took the slot; a report found then was kept.
            match self.early.iter().position(|&(seq, _)| seq == t.seq()) {
                Some(i) => self.early.swap_remove(i).1,
                None => 0,
            }
        } else {
            self.errors.load_u32(slot * 4)?
        };
        match word {
            0 => Ok(()),
            w => {
                let w = w - 1;
                Err(UnpackError::DeviceRejected {
                    task: w >> 12,
                    fragment: w & 0xfff,
                })
            }
        }
    }

    pub fn stream(&self) -> &Stream {
        &self.stream
    }
}

/// What every launch of one batch shares; the batch's signal rides its last launch only.
struct LaunchCtx<'a> {
    gpu: &'a Gpu,
    kernels: &'a Kernels,
    stream: &'a Stream,
    /// The tasks' pieces back to back, in task order.
    tables: &'a [Segment],
    blocks_per_task: u32,
    errors: &'a PinnedRegion,
    slot: usize,
    /// Launches the batch takes (16 tasks each).
    launches: usize,
    signal: BlockSignal,
}

impl LaunchCtx<'_> {
    /// The signal launch `i` carries: the batch's on the last, none before.
    fn signal_for(&self, i: usize) -> BlockSignal {
        if i + 1 == self.launches {
            self.signal
        } else {
            BlockSignal::NONE
        }
    }

    /// `launch(i, group)` for each group of 16 tasks.
    fn each<T>(
        &self,
        tasks: &[T],
        mut launch: impl FnMut(usize, &[T]) -> Result<(), GpuError>,
    ) -> Result<(), GpuError> {
        tasks
            .chunks(BLOCK_TASKS)
            .enumerate()
            .try_for_each(|(i, group)| launch(i, group))
    }

    /// The launches of `tasks` whose tables were placed in the device arena.
    fn placed<T: InlineTask>(&self, tasks: &[T]) -> Result<(), GpuError> {
        self.each(tasks, |i, group| {
            self.gpu.launch_placed_blocks(
                self.kernels,
                self.stream,
                group,
                self.blocks_per_task,
                self.errors,
                self.slot * 4,
                self.signal_for(i),
            )
        })
    }

    /// The inline launches of `tasks`, each with its share of the tables.
    fn inline<T: InlineTask>(&self, tasks: &[T]) -> Result<(), GpuError> {
        let mut at = 0usize;
        self.each(tasks, |i, group| {
            let n: usize = group.iter().map(|t| t.pieces() as usize).sum();
            let table = self.tables.get(at..at + n).ok_or_else(|| {
                GpuError::InvalidArgument(format!(
                    "the tasks name {} pieces, the batch holds {}",
                    at + n,
                    self.tables.len()
                ))
            })?;
            self.gpu.launch_blocks_inline(
                self.kernels,
                self.stream,
                group,
                table,
                self.blocks_per_task,
                self.errors,
                self.slot * 4,
                self.signal_for(i),
            )?;
            at += n;
            Ok(())
        })
    }
}

fn same_table(nsegs: u32, table: &[Segment]) -> Result<(), UnpackError> {
    if table.len() != nsegs as usize {
        return Err(UnpackError::Gpu(GpuError::InvalidArgument(format!(
            "a task of {nsegs} pieces came with a table of {}",
            table.len()
        ))));
    }
    Ok(())
}
