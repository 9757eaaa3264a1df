//! Safe launch of the unpack kernel (`kernels/unpack.cu`).

use std::ffi::c_void;

use super::error::{GpuError, GpuResult};
use super::memory::{DeviceSpan, PinnedRegion};
use super::stream::Stream;
use super::{Gpu, Kernels};
use tcpxd_abi::loadMeta;

mod inline;
pub use inline::{
    INLINE_MAX_FRAGS, INLINE_MAX_TASKS, INLINE_PAGES_MAX_FRAGS, INLINE_PAGES_MAX_TASKS, InlineBatch,
    InlinePagesBatch,
};

/// Tasks one launch carries (passed by value as a kernel parameter: 64 × 48 = 3 KiB).
pub const UNPACK_MAX_TASKS_PER_LAUNCH: usize = 64;
/// Warps per block of the unpack kernel (256 threads).
pub const UNPACK_WARPS_PER_BLOCK: u32 = 8;
const SMALL_LAUNCH: usize = 8;
const MEDIUM_LAUNCH: usize = 16;

/// `struct Signal` of kernels/unpack.cu: how launches report completion without a CUDA event or
/// any cross-block traffic. Every launch carries `value`, the number of the newest batch issued
/// before it, and its first block stores that into the host-mapped u64 at `done` once the
/// previous grids on the stream have completed: batch n is reported done by the first launch
/// after it. (The newest batch, which nothing follows yet, is seen done by asking the stream.)
/// `value == 0`: nothing to report. `sums` (host-mapped, 0: none): the task kernels' blocks store
/// the lengths of the list entries each fetched, added up, one u32 per block
/// ([`LaunchSignal::with_sums`]).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LaunchSignal {
    done: u64,
    value: u64,
    sums: u64,
}

const _: () = assert!(size_of::<LaunchSignal>() == 24);

impl LaunchSignal {
    /// Reports nothing.
    pub const NONE: LaunchSignal = LaunchSignal {
        done: 0,
        value: 0,
        sums: 0,
    };

    /// Store `value` into the u64 at byte `done_off` of `done` (host-mapped, 8-byte aligned)
    /// once the grids before this launch have completed.
    pub fn new(done: &PinnedRegion, done_off: usize, value: u64) -> GpuResult<LaunchSignal> {
        done.check(done_off as u64, 8)?;
        if done_off % 8 != 0 {
            return Err(GpuError::InvalidArgument(
                "a launch signal needs an aligned 8-byte done word".into(),
            ));
        }
        Ok(LaunchSignal {
            done: done.device_ptr() + done_off as u64,
            value,
            sums: 0,
        })
    }

    /// This signal, with the task kernels' blocks storing their sums of fragment lengths into
    /// the u32s from byte `offset` of `sums` (host-mapped): block x of task y at entry
    /// `y * blocks_per_task + x`. `entries`: how many the launch may write (checked).
    pub fn with_sums(self, sums: &PinnedRegion, offset: usize, entries: usize) -> GpuResult<LaunchSignal> {
        sums.check(offset as u64, (entries * 4) as u64)?;
        if offset % 4 != 0 {
            return Err(GpuError::InvalidArgument(
                "launch sums need 4-byte alignment".into(),
            ));
        }
        Ok(LaunchSignal {
            sums: sums.device_ptr() + offset as u64,
            ..self
        })
    }
}

/// Where a launch reports: the u32 at byte `err_off` of `err` receives an out-of-bounds
/// fragment the kernel skipped, and `signal` says how it signals completion. `overlap`: launch
/// it as a programmatic dependent launch (the `tcpxd_unpack_*` task kernels fetch their lists
/// while the previous grid finishes, then wait for it; [`Gpu::launch_unpack`] only).
#[derive(Debug, Clone, Copy)]
pub struct LaunchReport<'a> {
    pub err: &'a PinnedRegion,
    pub err_off: usize,
    pub signal: LaunchSignal,
    pub overlap: bool,
}

impl LaunchReport<'_> {
    /// The device address of the error word (checked to lie in `err`, aligned).
    fn err_ptr(&self) -> GpuResult<u64> {
        self.err.check(self.err_off as u64, 4)?;
        if self.err_off % 4 != 0 {
            return Err(GpuError::InvalidArgument("unaligned error word".into()));
        }
        Ok(self.err.device_ptr() + self.err_off as u64)
    }
}

/// One receive for the unpack kernel: `struct UnpackTask` of kernels/unpack.cu.
#[repr(C, align(16))]
#[derive(Debug, Clone, Copy, Default)]
pub struct UnpackTask {
    frags: u64,
    bounce: u64,
    bounce_len: u64,
    dst: u64,
    dst_len: u64,
    count: u32,
    format: u32,
}

const _: () = assert!(size_of::<UnpackTask>() == 48);

/// How a task's fragment list is encoded (`FMT_*` in kernels/unpack.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum ListFormat {
    /// The plugin's 16-byte `loadMeta` entries (the ring itself, or a copy).
    Meta = 0,
    /// One u32 per whole 4 KiB page: `(src_off / 4096) << 12 | dst_off / 4096` (source offsets
    /// under 4 GiB, destination offsets under 16 MiB, every fragment a whole aligned page).
    Page32 = 1,
    /// Three u32 per fragment (src_off, len, dst_off): destinations under 4 GiB.
    Packed12 = 2,
}

/// What [`ListFormat::scan`] found in one pass over a list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListScan {
    /// The most compact encoding that holds the list.
    pub format: ListFormat,
    /// Every fragment lies inside the destination and the bounce buffer.
    pub in_bounds: bool,
    /// The fragments' lengths added up.
    pub total: u64,
}

/// A whole-page fragment as its `ListFormat::Page32` entry.
pub(super) fn page32(f: &loadMeta) -> u32 {
    (f.src_off >> 12) << 12 | (f.dst_off >> 12) as u32
}

impl ListFormat {
    /// Bytes per fragment.
    pub fn entry_bytes(self) -> usize {
        match self {
            ListFormat::Meta => 16,
            ListFormat::Page32 => 4,
            ListFormat::Packed12 => 12,
        }
    }

    /// The most compact encoding that holds every fragment of `frags` going into a
    /// `dst_len`-byte destination (fragments already validated against it).
    pub fn choose(frags: &[loadMeta], dst_len: u64) -> ListFormat {
        const PAGE: u32 = 4096;
        let page32 = frags.iter().all(|f| {
            f.len == PAGE
                && f.src_off % PAGE == 0
                && f.dst_off % u64::from(PAGE) == 0
                && f.dst_off < (1 << 24)
        });
        if page32 {
            ListFormat::Page32
        } else if dst_len <= u64::from(u32::MAX) {
            ListFormat::Packed12
        } else {
            ListFormat::Meta
        }
    }

    /// [`ListFormat::choose`] and the unpack stage's bounds check in one branch-free pass over
    /// the list (the poller does this for every receive): the format, whether every fragment
    /// lies inside `dst_len` and `bounce_len` (the same test as `unpack::validate`'s fast path),
    /// and the bytes in all.
    pub fn scan(frags: &[loadMeta], dst_len: u64, bounce_len: u64) -> ListScan {
        let (dst_end, src_end, not_page, total) =
            frags.iter().fold((0u64, 0u64, 0u64, 0u64), |(d, s, p, t), f| {
                let len = u64::from(f.len);
                (
                    d.max(f.dst_off.saturating_add(len)),
                    s.max(u64::from(f.src_off) + len),
                    p | u64::from(f.len ^ 4096)
                        | u64::from(f.src_off & 0xfff)
                        | (f.dst_off & 0xfff)
                        | (f.dst_off >> 24),
                    t + len,
                )
            });
        ListScan {
            format: Self::pick(not_page, dst_len),
            in_bounds: dst_end <= dst_len && src_end <= bounce_len,
            total,
        }
    }

    fn pick(not_page: u64, dst_len: u64) -> ListFormat {
        if not_page == 0 {
            ListFormat::Page32
        } else if dst_len <= u64::from(u32::MAX) {
            ListFormat::Packed12
        } else {
            ListFormat::Meta
        }
    }

    /// [`ListFormat::scan`] and [`ListFormat::encode`] in one pass for the common case: writes
    /// the whole-page encoding while checking, and re-encodes only when the list turns out not
    /// to be whole pages. `out` must hold the largest encoding (`frags.len() * 16` bytes).
    /// Out of bounds: what `out` holds is unspecified.
    pub fn scan_encode(frags: &[loadMeta], dst_len: u64, bounce_len: u64, out: &mut [u8]) -> ListScan {
        let (mut dst_end, mut src_end, mut not_page, mut total) = (0u64, 0u64, 0u64, 0u64);
        for (o, f) in out.chunks_exact_mut(4).zip(frags) {
            let len = u64::from(f.len);
            dst_end = dst_end.max(f.dst_off.saturating_add(len));
            src_end = src_end.max(u64::from(f.src_off) + len);
            not_page |= u64::from(f.len ^ 4096)
                | u64::from(f.src_off & 0xfff)
                | (f.dst_off & 0xfff)
                | (f.dst_off >> 24);
            total += len;
            o.copy_from_slice(&page32(f).to_le_bytes());
        }
        let scan = ListScan {
            format: Self::pick(not_page, dst_len),
            in_bounds: dst_end <= dst_len && src_end <= bounce_len,
            total,
        };
        if scan.format != ListFormat::Page32 && scan.in_bounds {
            scan.format.encode(frags, out);
        }
        scan
    }

    /// Writes `frags` in this encoding into `out` (at least `frags.len() * entry_bytes()`
    /// bytes); the caller chose the format with [`ListFormat::choose`].
    pub fn encode(self, frags: &[loadMeta], out: &mut [u8]) {
        match self {
            ListFormat::Meta => {
                for (o, f) in out.chunks_exact_mut(16).zip(frags) {
                    o[..4].copy_from_slice(&f.src_off.to_le_bytes());
                    o[4..8].copy_from_slice(&f.len.to_le_bytes());
                    o[8..].copy_from_slice(&f.dst_off.to_le_bytes());
                }
            }
            ListFormat::Page32 => {
                for (o, f) in out.chunks_exact_mut(4).zip(frags) {
                    o.copy_from_slice(&page32(f).to_le_bytes());
                }
            }
            ListFormat::Packed12 => {
                for (o, f) in out.chunks_exact_mut(12).zip(frags) {
                    o[..4].copy_from_slice(&f.src_off.to_le_bytes());
                    o[4..8].copy_from_slice(&f.len.to_le_bytes());
                    o[8..].copy_from_slice(&(f.dst_off as u32).to_le_bytes());
                }
            }
        }
    }
}

impl UnpackTask {
    /// `count` fragments read from `frags` (device-visible), copied from `bounce` into `dst`.
    /// The kernel skips (and reports) any fragment outside `bounce` or `dst`.
    pub fn new(frags: DeviceSpan, count: u32, bounce: DeviceSpan, dst: DeviceSpan) -> GpuResult<UnpackTask> {
        if u64::from(count) * size_of::<loadMeta>() as u64 > frags.len() {
            return Err(GpuError::InvalidArgument(format!(
                "{count} fragments do not fit a {}-byte list",
                frags.len()
            )));
        }
        Ok(UnpackTask {
            frags: frags.ptr(),
            bounce: bounce.ptr(),
            bounce_len: bounce.len(),
            dst: dst.ptr(),
            dst_len: dst.len(),
            count,
            format: ListFormat::Meta as u32,
        })
    }

    /// As [`UnpackTask::new`], for a list in `format` (see [`ListFormat`]).
    pub fn with_format(
        list: DeviceSpan,
        count: u32,
        format: ListFormat,
        bounce: DeviceSpan,
        dst: DeviceSpan,
    ) -> GpuResult<UnpackTask> {
        if u64::from(count) * format.entry_bytes() as u64 > list.len() {
            return Err(GpuError::InvalidArgument(format!(
                "{count} fragments do not fit a {}-byte list",
                list.len()
            )));
        }
        Ok(UnpackTask {
            frags: list.ptr(),
            bounce: bounce.ptr(),
            bounce_len: bounce.len(),
            dst: dst.ptr(),
            dst_len: dst.len(),
            count,
            format: format as u32,
        })
    }

    pub fn count(&self) -> u32 {
        self.count
    }
}

#[repr(C, align(16))]
struct TaskArray<const N: usize> {
    t: [UnpackTask; N],
}

impl Gpu {
    /// Launches the unpack kernel over `tasks` (at most [`UNPACK_MAX_TASKS_PER_LAUNCH`]) with
    /// `blocks_per_task` blocks of 256 threads per task. A fragment the kernel finds out of
    /// bounds is skipped and `1 + (task << 12 | fragment)` is stored in the u32 at byte `err_off`
    /// of `err`.
    pub fn launch_unpack(
        &self,
        kernels: &Kernels,
        stream: &Stream,
        tasks: &[UnpackTask],
        blocks_per_task: u32,
        report: LaunchReport<'_>,
    ) -> GpuResult<()> {
        if tasks.is_empty() {
            return Ok(());
        }
        if tasks.len() > UNPACK_MAX_TASKS_PER_LAUNCH {
            return Err(GpuError::InvalidArgument(format!(
                "{} unpack tasks in one launch (at most {UNPACK_MAX_TASKS_PER_LAUNCH})",
                tasks.len()
            )));
        }
        let mut err_ptr = report.err_ptr()?;
        let mut signal = report.signal;
        let grid = (blocks_per_task.clamp(1, 65_535), tasks.len() as u32);
        let block = UNPACK_WARPS_PER_BLOCK * 32;
        let err_arg = (&mut err_ptr as *mut u64).cast::<c_void>();
        let signal_arg = (&mut signal as *mut LaunchSignal).cast::<c_void>();
        // The smallest parameter block that holds the tasks (the driver copies it per launch).
        if tasks.len() <= SMALL_LAUNCH {
            let mut arr = TaskArray::<SMALL_LAUNCH> {
                t: [UnpackTask::default(); SMALL_LAUNCH],
            };
            arr.t[..tasks.len()].copy_from_slice(tasks);
            let mut params = [
                (&mut arr as *mut TaskArray<SMALL_LAUNCH>).cast::<c_void>(),
                err_arg,
                signal_arg,
            ];
            // SAFETY: the parameters match `tcpxd_unpack_8(TaskArray<8>, u32*, Signal)` (layouts
            // asserted above); every address the kernel uses comes from a DeviceSpan (valid until
            // the work completes by that type's contract) and is bounds-checked in the kernel; the
            // error and done words are inside live pinned allocations (checked). Parameters are
            // copied at launch.
            unsafe { self.launch(kernels.unpack_8, grid, block, stream, &mut params, report.overlap) }
        } else if tasks.len() <= MEDIUM_LAUNCH {
            let mut arr = TaskArray::<MEDIUM_LAUNCH> {
                t: [UnpackTask::default(); MEDIUM_LAUNCH],
            };
            arr.t[..tasks.len()].copy_from_slice(tasks);
            let mut params = [
                (&mut arr as *mut TaskArray<MEDIUM_LAUNCH>).cast::<c_void>(),
                err_arg,
                signal_arg,
            ];
            // SAFETY: as above, for `tcpxd_unpack_16(TaskArray<16>, u32*, Signal)`.
            unsafe {
                self.launch(
                    kernels.unpack_16,
                    grid,
                    block,
                    stream,
                    &mut params,
                    report.overlap,
                )
            }
        } else {
            let mut arr = TaskArray::<UNPACK_MAX_TASKS_PER_LAUNCH> {
                t: [UnpackTask::default(); UNPACK_MAX_TASKS_PER_LAUNCH],
            };
            arr.t[..tasks.len()].copy_from_slice(tasks);
            let mut params = [
                (&mut arr as *mut TaskArray<UNPACK_MAX_TASKS_PER_LAUNCH>).cast::<c_void>(),
                err_arg,
                signal_arg,
            ];
            // SAFETY: as above, for `tcpxd_unpack_64(TaskArray<64>, u32*, Signal)`.
            unsafe {
                self.launch(
                    kernels.unpack_64,
                    grid,
                    block,
                    stream,
                    &mut params,
                    report.overlap,
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lm(src_off: u32, len: u32, dst_off: u64) -> loadMeta {
        loadMeta {
            src_off,
            len,
            dst_off,
        }
    }

    #[test]
    fn whole_pages_use_four_bytes_a_fragment() {
        let frags = [
            lm(8192, 4096, 4096),
            lm(0, 4096, 0),
            lm(0xFFFF_F000, 4096, 0xFF_F000),
        ];
        let f = ListFormat::choose(&frags, 1 << 40);
        assert_eq!(f, ListFormat::Page32);
        let mut out = vec![0u8; 12];
        f.encode(&frags, &mut out);
        let e: Vec<u32> = out
            .chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(e, vec![2 << 12 | 1, 0, 0xF_FFFF << 12 | 0xFFF]);
    }

    #[test]
    fn scan_agrees_with_choose_and_the_bounds() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for round in 0..2000 {
            let n = (next() % 40) as usize;
            let frags: Vec<loadMeta> = (0..n)
                .map(|_| {
                    let r = next();
                    if round % 3 == 0 {
                        // Mostly whole pages, sometimes one off by a little.
                        let off = if r % 17 == 0 { r as u32 % 4096 } else { 0 };
                        lm(
                            ((r >> 8) as u32 % 512) * 4096 + off,
                            4096,
                            ((r >> 20) % 4200) * 4096,
                        )
                    } else {
                        lm(
                            (r >> 32) as u32 % (1 << 21),
                            (r % 9000) as u32,
                            (r >> 12) % (1 << 25),
                        )
                    }
                })
                .collect();
            for (dst_len, bounce_len) in [(1u64 << 24, 1u64 << 21), (1 << 25, 1 << 22), (8 << 30, 1 << 22)] {
                let scan = ListFormat::scan(&frags, dst_len, bounce_len);
                let (format, in_bounds) = (scan.format, scan.in_bounds);
                assert_eq!(format, ListFormat::choose(&frags, dst_len));
                assert_eq!(scan.total, frags.iter().map(|f| u64::from(f.len)).sum::<u64>());
                let mut fused = vec![0u8; frags.len() * 16];
                assert_eq!(
                    ListFormat::scan_encode(&frags, dst_len, bounce_len, &mut fused),
                    scan
                );
                if in_bounds {
                    let mut apart = vec![0u8; frags.len() * format.entry_bytes()];
                    format.encode(&frags, &mut apart);
                    assert_eq!(&fused[..apart.len()], &apart[..]);
                }
                let by_hand = frags.iter().all(|f| {
                    f.dst_off
                        .checked_add(u64::from(f.len))
                        .is_some_and(|e| e <= dst_len)
                        && u64::from(f.src_off) + u64::from(f.len) <= bounce_len
                });
                assert_eq!(in_bounds, by_hand, "{frags:?}");
            }
        }
        let wrap = [lm(0, 16, u64::MAX - 4)];
        assert!(!ListFormat::scan(&wrap, u64::MAX - 1, 1 << 20).in_bounds);
    }

    #[test]
    fn partial_or_unaligned_pages_fall_back() {
        // A short page, an unaligned source, a destination past 16 MiB.
        for bad in [lm(0, 100, 0), lm(12, 4096, 0), lm(0, 4096, 16 << 20)] {
            let frags = [lm(0, 4096, 4096), bad];
            assert_eq!(ListFormat::choose(&frags, 64 << 20), ListFormat::Packed12);
            assert_eq!(ListFormat::choose(&frags, 8 << 30), ListFormat::Meta);
        }
        let frags = [lm(7, 9, 3), lm(4096, 1, 0xFFFF_FFF0)];
        let mut out = vec![0u8; 24];
        ListFormat::Packed12.encode(&frags, &mut out);
        let e: Vec<u32> = out
            .chunks(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(e, vec![7, 9, 3, 4096, 1, 0xFFFF_FFF0]);
        let mut out = vec![0u8; 32];
        ListFormat::Meta.encode(&frags, &mut out);
        assert_eq!(&out[16..20], &4096u32.to_le_bytes());
        assert_eq!(&out[24..32], &0xFFFF_FFF0u64.to_le_bytes());
    }
}
