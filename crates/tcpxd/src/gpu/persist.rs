//! The persistent unpack grid (`tcpxd_unpack_persistent` in kernels/unpack.cu): batches are
//! posted through pinned host memory instead of launched, so a batch costs no driver call while
//! the grid is resident.
//!
//! The host writes batch n's descriptor into queue slot n % 16 and stores n into its `seq`
//! field last. The grid's block 0 polls that field over the host mapping, copies the descriptor
//! into device memory and announces it; all blocks split its work units; the last to finish
//! stores n into the unpacker's done word (the same word the launched kernels signal). After
//! `linger` without a new batch the grid leaves and stores `epoch << 40 | n` (n: the first batch
//! it did not take) into `exited`; [`PersistentGrid::revive`] launches a new grid from there when
//! that batch was posted after all (the two crossed), and [`PersistentGrid::post`] launches one
//! when none is resident.

use std::ffi::c_void;
use std::mem::offset_of;
use std::sync::Arc;
use std::sync::atomic::{Ordering, fence};
use std::time::Duration;

use super::error::{GpuError, GpuResult};
use super::launch::{UNPACK_WARPS_PER_BLOCK, UnpackTask};
use super::memory::{DeviceRegion, PinnedRegion};
use super::stream::Stream;
use super::{Gpu, Kernels};

/// Descriptor slots (the unpacker keeps at most this many batches in flight).
pub const PERSIST_QUEUE: usize = 16;
/// Receives one posted batch carries.
pub const PERSIST_MAX_TASKS: usize = 64;
const PERSIST_STOP: u32 = u32::MAX;
const EPOCH_SHIFT: u32 = 40;
const SEQ_MASK: u64 = (1 << EPOCH_SHIFT) - 1;

/// `struct PersistDesc` of kernels/unpack.cu.
#[repr(C, align(16))]
#[derive(Clone, Copy)]
struct PersistDesc {
    seq: u64,
    ntasks: u32,
    units: u32,
    err: u64,
    list_src: u64,
    list_dst: u64,
    list_bytes: u32,
    pad0: u32,
    unit_first: [u32; PERSIST_MAX_TASKS + 1],
    pad: [u32; 3],
    tasks: [UnpackTask; PERSIST_MAX_TASKS],
}

const _: () = assert!(offset_of!(PersistDesc, unit_first) == 48);
const _: () = assert!(offset_of!(PersistDesc, tasks) == 320);
const _: () = assert!(size_of::<PersistDesc>() == 3392);
const DESC: usize = size_of::<PersistDesc>();

/// `struct PersistParams`.
#[repr(C)]
struct PersistParams {
    queue: u64,
    scratch: u64,
    ctl: u64,
    done: u64,
    exited: u64,
    first_seq: u64,
    epoch: u64,
    linger_ns: u64,
}

/// How the persistent grid is shaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PersistConfig {
    /// Worker blocks of 256 threads (plus one leader block); 0: one per multiprocessor.
    pub blocks: u32,
    /// How long the grid waits for a new batch before it leaves (its multiprocessors are free
    /// again once it has).
    pub linger: Duration,
}

impl Default for PersistConfig {
    fn default() -> Self {
        PersistConfig {
            blocks: 0,
            linger: Duration::from_micros(200),
        }
    }
}

/// A posted batch's encoded fragment lists: `bytes` (a multiple of 16) at the device-visible
/// (host-mapped) address `src`, which the leader copies to the device address `dst` before the
/// workers start; the tasks' lists point into `dst`. The caller keeps both valid until the
/// batch finished.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PostedLists {
    pub src: u64,
    pub dst: u64,
    pub bytes: u64,
}

/// The queue, its device copy and control words, and the state of the resident grid.
pub struct PersistentGrid {
    gpu: Arc<Gpu>,
    kernels: Arc<Kernels>,
    queue: PinnedRegion,
    scratch: DeviceRegion,
    ctl: DeviceRegion,
    exited: PinnedRegion,
    done_ptr: u64,
    blocks: u32,
    linger_ns: u64,
    /// The epoch of the grid launched last, and whether it may still be resident.
    epoch: u64,
    resident: bool,
    /// While none is resident: the batch the next grid starts at (every earlier one was taken).
    resume: u64,
    /// The newest batch posted.
    posted: u64,
    launches: u64,
}

impl PersistentGrid {
    /// `done`/`done_off`: the unpacker's 8-byte done word, host-mapped.
    pub fn new(
        gpu: &Arc<Gpu>,
        config: PersistConfig,
        done: &PinnedRegion,
        done_off: usize,
    ) -> GpuResult<PersistentGrid> {
        done.check(done_off as u64, 8)?;
        if done_off % 8 != 0 {
            return Err(GpuError::InvalidArgument("unaligned done word".into()));
        }
        let kernels = gpu.kernels()?;
        // Every block must be resident at once (a worker left waiting for a multiprocessor would
        // hold its batch until the grid lingers out): at most what fits the device, less one
        // for the leader.
        let mut per_sm: std::ffi::c_int = 0;
        gpu.bind_to_thread()?;
        // SAFETY: writes one int; a loaded function of this context.
        super::error::check("cuOccupancyMaxActiveBlocksPerMultiprocessor", unsafe {
            cudarc::driver::sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut per_sm,
                kernels.unpack_persistent,
                (UNPACK_WARPS_PER_BLOCK * 32) as std::ffi::c_int,
                0,
            )
        })?;
        let fit = (per_sm.max(1) as u32 * gpu.sm_count()).saturating_sub(1).max(1);
        let wanted = if config.blocks == 0 {
            gpu.sm_count()
        } else {
            config.blocks
        };
        let blocks = wanted.min(fit);
        if blocks < wanted {
            tracing::info!(
                wanted,
                blocks,
                "unpack grid: {per_sm} block(s) per multiprocessor fit; fewer workers"
            );
        }
        Ok(PersistentGrid {
            gpu: gpu.clone(),
            kernels,
            queue: gpu.alloc_pinned(PERSIST_QUEUE * DESC)?,
            scratch: gpu.alloc(PERSIST_QUEUE * DESC)?,
            ctl: gpu.alloc(16 + 4 * PERSIST_QUEUE)?,
            exited: gpu.alloc_pinned(8)?,
            done_ptr: done.device_ptr() + done_off as u64,
            blocks: blocks.clamp(1, 65_534),
            linger_ns: u64::try_from(config.linger.as_nanos()).unwrap_or(u64::MAX),
            epoch: 0,
            resident: false,
            resume: 1,
            posted: 0,
            launches: 0,
        })
    }

    /// Grids launched so far (one per burst of batches, more when a grid and a batch crossed).
    pub fn launches(&self) -> u64 {
        self.launches
    }

    /// Posts batch `seq` (the next after the last posted; its slot's previous batch must have
    /// finished): `tasks` (at most [`PERSIST_MAX_TASKS`]), whose fragment lists the leader copies
    /// from `lists.src` to `lists.dst` first; errors reported into the u32 at byte `err_off` of
    /// `err`. Launches a grid when none is resident.
    pub fn post(
        &mut self,
        stream: &Stream,
        seq: u64,
        tasks: &[UnpackTask],
        lists: PostedLists,
        err: &PinnedRegion,
        err_off: usize,
    ) -> GpuResult<()> {
        if tasks.len() > PERSIST_MAX_TASKS {
            return Err(GpuError::InvalidArgument(format!(
                "{} receives in one posted batch (at most {PERSIST_MAX_TASKS})",
                tasks.len()
            )));
        }
        if seq != self.posted + 1 || seq > SEQ_MASK {
            return Err(GpuError::InvalidArgument(format!(
                "batch {seq} posted after batch {}",
                self.posted
            )));
        }
        err.check(err_off as u64, 4)?;
        if err_off % 4 != 0 {
            return Err(GpuError::InvalidArgument("unaligned error word".into()));
        }
        if lists.bytes % 16 != 0 || lists.bytes > u64::from(u32::MAX) {
            return Err(GpuError::InvalidArgument(format!(
                "{} bytes of fragment lists (a multiple of 16 under 4 GiB)",
                lists.bytes
            )));
        }
        self.write(seq, tasks, lists, err.device_ptr() + err_off as u64)?;
        self.posted = seq;
        self.ensure_resident(stream).map(|_| ())
    }

    /// Writes slot `seq % 16` and publishes it by storing `seq` last.
    fn write(&mut self, seq: u64, tasks: &[UnpackTask], lists: PostedLists, err: u64) -> GpuResult<()> {
        let mut d = PersistDesc {
            seq: 0,
            ntasks: tasks.len() as u32,
            units: 0,
            err,
            list_src: lists.src,
            list_dst: lists.dst,
            list_bytes: lists.bytes as u32,
            pad0: 0,
            unit_first: [0; PERSIST_MAX_TASKS + 1],
            pad: [0; 3],
            tasks: [UnpackTask::default(); PERSIST_MAX_TASKS],
        };
        let mut units = 0u32;
        for (i, t) in tasks.iter().enumerate() {
            d.unit_first[i] = units;
            units += t.count().div_ceil(UNPACK_WARPS_PER_BLOCK);
            d.tasks[i] = *t;
        }
        d.unit_first[tasks.len()] = units;
        d.units = units;
        if tasks.is_empty() {
            d.ntasks = PERSIST_STOP;
        }
        let slot = (seq % PERSIST_QUEUE as u64) as usize;
        self.queue.check((slot * DESC) as u64, DESC as u64)?;
        // SAFETY: slot `slot` of the queue (checked in bounds; the allocation is page-aligned, so
        // the slot is 16-byte aligned). The grid reads only a slot whose `seq` it is waiting for,
        // and this slot's previous batch has finished (the caller's contract), so nothing reads
        // it while it is written; the body goes first, then a release fence, then `seq`.
        unsafe {
            let p = self.queue.host_ptr().add(slot * DESC).cast::<PersistDesc>();
            std::ptr::write_volatile(p, d);
            fence(Ordering::Release);
            std::ptr::write_volatile(std::ptr::addr_of_mut!((*p).seq), seq);
        }
        Ok(())
    }

    /// Where the resident grid left, if it has: the first batch it did not take.
    fn left_at(&self) -> GpuResult<Option<u64>> {
        if !self.resident {
            return Ok(None);
        }
        let e = self.exited.load_u64(0)?;
        Ok((e >> EPOCH_SHIFT == self.epoch).then_some(e & SEQ_MASK))
    }

    /// Launches a grid when none is resident (or the resident one has left) and a posted
    /// batch is untaken. Returns whether it launched.
    fn ensure_resident(&mut self, stream: &Stream) -> GpuResult<bool> {
        if let Some(at) = self.left_at()? {
            self.resident = false;
            self.resume = at;
        }
        if self.resident || self.resume > self.posted {
            return Ok(false);
        }
        self.launch(stream, self.resume)?;
        Ok(true)
    }

    /// While a posted batch is outstanding (one load of host memory): relaunches when the grid
    /// left without taking it. Returns whether it launched.
    pub fn revive(&mut self, stream: &Stream) -> GpuResult<bool> {
        self.ensure_resident(stream)
    }

    fn launch(&mut self, stream: &Stream, first_seq: u64) -> GpuResult<()> {
        self.epoch += 1;
        let mut params = PersistParams {
            queue: self.queue.device_ptr(),
            scratch: self.scratch.device_ptr(),
            ctl: self.ctl.device_ptr(),
            done: self.done_ptr,
            exited: self.exited.device_ptr(),
            first_seq,
            epoch: self.epoch,
            linger_ns: self.linger_ns,
        };
        let mut args = [(&mut params as *mut PersistParams).cast::<c_void>()];
        // SAFETY: the parameters match `tcpxd_unpack_persistent(PersistParams)`; the queue,
        // scratch, control and exit words are this value's own allocations, alive until the grid
        // has left (Drop stops it and waits); the tasks' addresses come from DeviceSpans, valid
        // until their batch completes, and every fragment is bounds-checked in the kernel.
        unsafe {
            self.gpu.launch(
                self.kernels.unpack_persistent,
                (self.blocks + 1, 1),
                UNPACK_WARPS_PER_BLOCK * 32,
                stream,
                &mut args,
                false,
            )?
        };
        self.resident = true;
        self.launches += 1;
        tracing::trace!(
            epoch = self.epoch,
            first_seq,
            blocks = self.blocks,
            "unpack grid launched"
        );
        Ok(())
    }

    /// Asks a resident grid to leave and waits until it has. Every posted batch must have
    /// finished (the stop descriptor takes the next slot). Nothing is resident afterwards, and
    /// the next posted batch launches a new grid.
    pub fn stop(&mut self, stream: &Stream) -> GpuResult<()> {
        if self.left_at()?.is_none() && self.resident {
            self.write(self.posted + 1, &[], PostedLists::default(), 0)?;
        }
        self.resident = false;
        self.resume = self.posted + 1;
        stream.synchronize()
    }
}
