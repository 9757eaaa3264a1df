//! Memory a receive comm hands to its consumer — the unpack ring, the bounce pages and the
//! 24-byte `unpackNetDeviceHandle` — and the pinned staging the socket threads use in CUDA mode.
//!
//! Host mode: all three live in host memory (anonymous mappings and a box).
//! CUDA mode (`docs/EMULATION.md`, "CUDA mode"): the ring is host-mapped pinned memory
//! (`cuMemHostAlloc(DEVICEMAP | PORTABLE)`; the plugin writes it through the host pointer, the
//! handle carries the device pointer), the bounce pages are device memory (`cuMemAlloc`), and the
//! handle itself is device memory, mirrored page for page in pinned host memory: socket threads
//! land bytes in the mirror and upload whole blocks with [`RecvStaging`]; senders of device
//! memory download through [`SendStaging`]. Every CUDA call lives in
//! `cuda.rs`; `recv.rs` and `send.rs` only see these types.

use crate::abi::{
    NET_UNPACK_MAX_SLICE_PAGES, SLICE_PAGE_SIZE, loadMeta, netUnpackMeta, unpackNetDeviceHandle,
};
use crate::cuda::{self, Ctx, DeviceMem, Pinned, Stream};
use crate::rng::SplitMix64;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// A CUDA failure as an `io::Error` (for the constructors, whose callers log and map it).
fn cuda_err(what: &str, e: String) -> io::Error {
    io::Error::other(format!("{what}: {e}"))
}

/// An anonymous private mapping: zeroed, page-aligned, and untouched pages cost nothing.
#[derive(Debug)]
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; concurrent access to its bytes is
// coordinated by the owners (atomics, the page pool), never through `&mut Mapping`.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` only exposes the base pointer and the length.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn new(len: usize) -> io::Result<Mapping> {
        // SAFETY: an anonymous private mapping with no address hint; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { ptr: p.cast(), len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned; nothing uses them afterwards (the
        // owning comm joined its helper threads before dropping its memory).
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

#[derive(Debug)]
enum RingBacking {
    Host(#[allow(dead_code)] Mapping),
    Pinned(#[allow(dead_code)] Pinned),
}

/// The `netUnpackMeta` ring (524416 bytes, zeroed, page- hence 16-aligned).
#[derive(Debug)]
pub(crate) struct RingMemory {
    /// Keeps the memory alive.
    _backing: RingBacking,
    /// Where the plugin writes (and a host consumer reads).
    host: *mut netUnpackMeta,
    /// What the `unpackNetDeviceHandle.meta` field says (equal to `host` in host mode and under
    /// unified addressing).
    device: *mut netUnpackMeta,
}

// SAFETY: the pointers address memory owned by `_backing`; access to the bytes is coordinated
// through atomics and the slot protocol (see `write_entry`).
unsafe impl Send for RingMemory {}
// SAFETY: as above.
unsafe impl Sync for RingMemory {}

impl RingMemory {
    fn len() -> usize {
        std::mem::size_of::<netUnpackMeta>().next_multiple_of(SLICE_PAGE_SIZE)
    }

    /// Host mode: an anonymous mapping.
    pub(crate) fn new() -> io::Result<RingMemory> {
        let map = Mapping::new(Self::len())?;
        let p: *mut netUnpackMeta = map.ptr.cast();
        Ok(RingMemory {
            _backing: RingBacking::Host(map),
            host: p,
            device: p,
        })
    }

    /// CUDA mode: `cuMemHostAlloc(DEVICEMAP | PORTABLE)`, zeroed.
    pub(crate) fn new_cuda(ctx: &Arc<Ctx>) -> io::Result<RingMemory> {
        let pinned = Pinned::new(ctx, Self::len(), true).map_err(|e| cuda_err("unpack ring", e))?;
        let host: *mut netUnpackMeta = pinned.host().cast();
        let device = pinned.device() as usize as *mut netUnpackMeta;
        Ok(RingMemory {
            _backing: RingBacking::Pinned(pinned),
            host,
            device,
        })
    }

    /// The host view: where the plugin writes.
    pub(crate) fn meta(&self) -> *mut netUnpackMeta {
        self.host
    }

    /// The pointer published in `unpackNetDeviceHandle.meta`.
    pub(crate) fn meta_device(&self) -> *mut netUnpackMeta {
        self.device
    }

    fn cnt(&self, q: usize) -> &AtomicU64 {
        assert!(q < 16);
        // SAFETY: `cnt[q]` lies inside the live mapping and is 8-aligned; the consumer only reads
        // it, and every write by the plugin goes through this atomic view.
        unsafe { AtomicU64::from_ptr(std::ptr::addr_of_mut!((*self.meta()).cnt[q])) }
    }

    /// `cnt[q] = 0` when a receive takes slot `q`.
    pub(crate) fn reset_cnt(&self, q: usize) {
        self.cnt(q).store(0, Ordering::Release);
    }

    /// Publish `cnt[q]` once every byte and every entry of the request is in place.
    pub(crate) fn publish_cnt(&self, q: usize, n: u64) {
        self.cnt(q).store(n, Ordering::Release);
    }

    /// Write entry `idx` of slot `q`.
    pub(crate) fn write_entry(&self, q: usize, idx: usize, e: loadMeta) {
        assert!(q < 16 && idx < NET_UNPACK_MAX_SLICE_PAGES);
        // SAFETY: in bounds of the mapping (checked above); each (q, idx) is written by exactly
        // one thread (idx comes from a per-request atomic counter) and read by the consumer only
        // after the release store of cnt[q].
        unsafe { std::ptr::write_volatile(std::ptr::addr_of_mut!((*self.meta()).mem[q][idx]), e) };
    }
}

struct PoolState {
    /// Free blocks (see [`BouncePool`]).
    free: Vec<u32>,
    rng: SplitMix64,
    warned: bool,
}

#[derive(Debug)]
enum PoolBacking {
    Host(Mapping),
    /// The device pages and their page-for-page pinned host mirror, where socket threads land
    /// the bytes before one copy per run of blocks uploads them.
    Device {
        dev: DeviceMem,
        mirror: Pinned,
    },
}

/// Pages per block in CUDA mode: a block (64 KiB) is the unit of allocation and of the
/// host → device copy, and the pages inside the blocks a batch takes are shuffled.
pub(crate) const CUDA_BLOCK_PAGES: u32 = 16;

/// The bounce buffer: `npages` pages of 4 KiB, handed out in shuffled order. Host memory in
/// host mode, device memory in CUDA mode (written only by [`RecvStaging::upload`], from the
/// pinned mirror).
///
/// The free list holds *blocks* of `block` consecutive pages (the last one may be shorter),
/// taken at random (`swap_remove`). Host mode: `block` is 1 (unless `TCPXEMU_HOST_BLOCK_PAGES`
/// says otherwise), so every page is drawn at random.
/// CUDA mode: `block` is [`CUDA_BLOCK_PAGES`]; the socket thread shuffles the pages of the
/// blocks it took before shaping fragments, so fragment lists stay unordered while each block
/// needs one copy instead of sixteen.
pub(crate) struct BouncePool {
    mem: PoolBacking,
    npages: u32,
    block: u32,
    state: Mutex<PoolState>,
    cv: Condvar,
}

impl BouncePool {
    fn with(mem: PoolBacking, npages: u32, block: u32, rng: SplitMix64) -> BouncePool {
        BouncePool {
            mem,
            npages,
            block,
            state: Mutex::new(PoolState {
                free: (0..npages.div_ceil(block)).collect(),
                rng,
                warned: false,
            }),
            cv: Condvar::new(),
        }
    }

    /// Host mode: an anonymous mapping; `block` pages per block (1 unless a test asks for the
    /// CUDA mode's blocks).
    pub(crate) fn new(npages: u32, block: u32, rng: SplitMix64) -> io::Result<BouncePool> {
        let map = Mapping::new(npages as usize * SLICE_PAGE_SIZE)?;
        Ok(Self::with(PoolBacking::Host(map), npages, block.max(1), rng))
    }

    /// CUDA mode: `cuMemAlloc`, 4096-aligned, plus a pinned host mirror of the same size.
    pub(crate) fn new_cuda(ctx: &Arc<Ctx>, npages: u32, rng: SplitMix64) -> io::Result<BouncePool> {
        let len = npages as usize * SLICE_PAGE_SIZE;
        let dev = DeviceMem::new(ctx, len, SLICE_PAGE_SIZE).map_err(|e| cuda_err("bounce buffer", e))?;
        let mirror = Pinned::new(ctx, len, false).map_err(|e| cuda_err("bounce buffer host mirror", e))?;
        Ok(Self::with(
            PoolBacking::Device { dev, mirror },
            npages,
            CUDA_BLOCK_PAGES,
            rng,
        ))
    }

    /// Host mode: faults in part `part` of `parts` (consecutive page ranges) with
    /// `MADV_POPULATE_WRITE`, so receives never take a page fault in the pool. The pages'
    /// contents are untouched (already present pages stay as they are), so it is safe while
    /// receives land in the pool. Device memory is resident already: nothing to do. Returns the
    /// pages populated.
    pub(crate) fn populate_part(&self, part: usize, parts: usize) -> io::Result<u32> {
        let PoolBacking::Host(map) = &self.mem else {
            return Ok(0);
        };
        let parts = parts.max(1) as u64;
        let n = u64::from(self.npages);
        let first = n * part as u64 / parts;
        let end = n * (part as u64 + 1) / parts;
        if first >= end {
            return Ok(0);
        }
        let off = first as usize * SLICE_PAGE_SIZE;
        let len = (end - first) as usize * SLICE_PAGE_SIZE;
        debug_assert!(off + len <= map.len);
        // SAFETY: the range is whole pages inside the live mapping (first < end ≤ npages, and
        // the mapping holds npages pages); MADV_POPULATE_WRITE only faults pages in, writing
        // no byte, so receives landing in these pages meanwhile are unaffected.
        let rc = unsafe { libc::madvise(map.ptr.add(off).cast(), len, libc::MADV_POPULATE_WRITE) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok((end - first) as u32)
    }

    /// Does the pool live in device memory?
    pub(crate) fn is_device(&self) -> bool {
        matches!(self.mem, PoolBacking::Device { .. })
    }

    /// Pages per block (1 in host mode).
    pub(crate) fn block_pages(&self) -> u32 {
        self.block
    }

    /// The pages of `block`.
    pub(crate) fn block_range(&self, block: u32) -> std::ops::Range<u32> {
        let first = block.saturating_mul(self.block).min(self.npages);
        first..first.saturating_add(self.block).min(self.npages)
    }

    /// The pointer published in `unpackNetDeviceHandle.bounce_buf` (a device address in CUDA
    /// mode).
    pub(crate) fn base(&self) -> *mut u8 {
        match &self.mem {
            PoolBacking::Host(m) => m.ptr,
            PoolBacking::Device { dev, .. } => dev.addr() as usize as *mut u8,
        }
    }

    /// Where a socket thread lands the bytes of `page`: the page itself in host mode, its
    /// pinned mirror in CUDA mode (uploaded with [`RecvStaging::upload`]).
    pub(crate) fn host_page(&self, page: u32) -> Option<*mut u8> {
        if page >= self.npages {
            return None;
        }
        let base = match &self.mem {
            PoolBacking::Host(m) => m.ptr,
            PoolBacking::Device { mirror, .. } => mirror.host(),
        };
        // SAFETY: page < npages, so the offset stays inside the mapping (or the mirror, which
        // has the pool's size).
        Some(unsafe { base.add(page as usize * SLICE_PAGE_SIZE) })
    }

    /// CUDA mode: (device address, mirror address, bytes) of pages `pages`, if they exist.
    fn device_run(&self, pages: std::ops::Range<u32>) -> Option<(u64, *const u8, usize)> {
        match &self.mem {
            PoolBacking::Device { dev, mirror } if pages.start < pages.end && pages.end <= self.npages => {
                let off = pages.start as usize * SLICE_PAGE_SIZE;
                let len = (pages.end - pages.start) as usize * SLICE_PAGE_SIZE;
                if off + len > mirror.len() {
                    return None;
                }
                // SAFETY: off + len ≤ the mirror's length (checked above).
                Some((dev.addr() + off as u64, unsafe { mirror.host().add(off) }, len))
            }
            _ => None,
        }
    }

    /// Take up to `out.len()` random free blocks; waits while none is free. Returns 0 only when
    /// `stop()` says to give up.
    pub(crate) fn take(&self, out: &mut [u32], stop: &dyn Fn() -> bool) -> usize {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if stop() {
                return 0;
            }
            if !st.free.is_empty() {
                let n = out.len().min(st.free.len());
                for slot in out.iter_mut().take(n) {
                    let len = st.free.len() as u64;
                    let i = st.rng.below(len) as usize;
                    *slot = st.free.swap_remove(i);
                }
                return n;
            }
            if !st.warned {
                st.warned = true;
                warn!(
                    "tcpxemu: bounce pool exhausted: all {} pages are held by receives not yet \
                     released with irecvConsumed; waiting",
                    self.npages
                );
            }
            st = self
                .cv
                .wait_timeout(st, Duration::from_millis(50))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Return blocks to the pool.
    pub(crate) fn give_back(&self, blocks: impl Iterator<Item = u32>) {
        let nblocks = self.npages.div_ceil(self.block);
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let before = st.free.len();
        st.free.extend(blocks.filter(|&b| b < nblocks));
        if st.free.len() != before {
            self.cv.notify_all();
        }
    }

    pub(crate) fn wake_all(&self) {
        let _st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.cv.notify_all();
    }
}

#[derive(Debug)]
enum HandleBacking {
    Host(*mut unpackNetDeviceHandle),
    /// The device copy, and the stream and pinned source its contents were uploaded with: kept
    /// until the comm closes, so creating a comm frees nothing (a free may wait for the device).
    Device {
        mem: DeviceMem,
        _upload: (Stream, Pinned),
    },
}

/// Storage for the 24-byte `unpackNetDeviceHandle` the device handle points at. The consumer
/// (NCCL) owns its `head` field and may write it, so it is kept behind a raw pointer (host mode)
/// or in device memory that only the consumer touches after creation (CUDA mode).
#[derive(Debug)]
pub(crate) struct HandleMemory {
    mem: HandleBacking,
}

// SAFETY: the handle is plain memory owned by this value and only read or written by the
// consumer through the pointer it was given; the plugin never touches it after creation.
unsafe impl Send for HandleMemory {}
// SAFETY: as above.
unsafe impl Sync for HandleMemory {}

impl HandleMemory {
    fn contents(ring: &RingMemory, pool: &BouncePool) -> unpackNetDeviceHandle {
        unpackNetDeviceHandle {
            meta: ring.meta_device(),
            bounce_buf: pool.base().cast(),
            head: u64::MAX,
        }
    }

    /// Host mode: a box.
    pub(crate) fn new(ring: &RingMemory, pool: &BouncePool) -> HandleMemory {
        HandleMemory {
            mem: HandleBacking::Host(Box::into_raw(Box::new(Self::contents(ring, pool)))),
        }
    }

    /// CUDA mode: `cuMemAlloc`, and the 24 bytes uploaded from pinned memory with
    /// `cuMemcpyHtoDAsync` on a non-blocking stream of its own, then that stream synchronised.
    ///
    /// Never a synchronous `cuMemcpyHtoD`: that copy runs on the legacy default stream, which is
    /// the application's (PyTorch's) default stream too. Under NCCL, `accept` runs on the proxy
    /// thread while the application's stream may be waiting for a large send to finish, and that
    /// send's data leaves through this emulation's own CUDA copies: the synchronous copy hung
    /// there (docs/EMULATION.md, "accept while a large send is in flight"). A non-blocking stream
    /// does not synchronise with the legacy stream (NCCL's own set-up copies work this way).
    pub(crate) fn new_cuda(ctx: &Arc<Ctx>, ring: &RingMemory, pool: &BouncePool) -> io::Result<HandleMemory> {
        let h = Self::contents(ring, pool);
        let len = std::mem::size_of::<unpackNetDeviceHandle>();
        let mem = DeviceMem::new(ctx, len, 16).map_err(|e| cuda_err("device handle", e))?;
        let src = Pinned::new(ctx, len, false).map_err(|e| cuda_err("device handle", e))?;
        let stream = Stream::new(ctx).map_err(|e| cuda_err("device handle", e))?;
        // SAFETY: `h` is a plain #[repr(C)] struct of three 8-byte fields (no padding) and `src`
        // a fresh pinned allocation of `len` bytes that nothing else references yet.
        unsafe {
            std::ptr::copy_nonoverlapping((&h as *const unpackNetDeviceHandle).cast::<u8>(), src.host(), len)
        };
        {
            let _b = cuda::bind(ctx).map_err(|e| cuda_err("device handle", e))?;
            // SAFETY: `src` is pinned host memory and `mem` device memory, both `len` bytes, both
            // kept alive (in the returned value) and untouched until the sync below returns.
            unsafe { stream.htod(mem.addr(), src.host(), len) }.map_err(|e| cuda_err("device handle", e))?;
        }
        stream.sync().map_err(|e| cuda_err("device handle", e))?;
        Ok(HandleMemory {
            mem: HandleBacking::Device {
                mem,
                _upload: (stream, src),
            },
        })
    }

    /// What the device handle's `handle` field gets (a device address in CUDA mode).
    pub(crate) fn ptr(&self) -> *mut unpackNetDeviceHandle {
        match &self.mem {
            HandleBacking::Host(h) => *h,
            HandleBacking::Device { mem, .. } => mem.addr() as usize as *mut unpackNetDeviceHandle,
        }
    }
}

impl Drop for HandleMemory {
    fn drop(&mut self) {
        if let HandleBacking::Host(h) = self.mem {
            // SAFETY: `h` came from Box::into_raw in `new` and is freed exactly once, here.
            drop(unsafe { Box::from_raw(h) });
        }
    }
}

/// Bytes per staged piece of a device-memory send (two pieces in flight).
pub(crate) const SEND_PIECE: usize = 256 * 1024;

/// A receive socket thread's stream (CUDA mode), created once at comm creation. The thread
/// lands bytes in the pool's pinned mirror and uploads whole blocks from there.
pub(crate) struct RecvStaging {
    stream: Stream,
}

impl RecvStaging {
    pub(crate) fn new(ctx: &Arc<Ctx>) -> io::Result<RecvStaging> {
        let stream = Stream::new(ctx).map_err(|e| cuda_err("receive stream", e))?;
        Ok(RecvStaging { stream })
    }

    /// Make the comm's context current on this (helper) thread for as long as the guard lives.
    pub(crate) fn bind(&self) -> Result<cuda::Bound, String> {
        cuda::bind(self.stream.ctx())
    }

    /// Copy `blocks` (sorted ascending, owned by the calling thread, their bytes in the pool's
    /// pinned mirror) to the same offsets of the device pool — one `cuMemcpyHtoDAsync` per run
    /// of adjacent blocks — and wait until every byte is there.
    pub(crate) fn upload(&self, pool: &BouncePool, blocks: &[u32]) -> Result<(), String> {
        let mut i = 0;
        while i < blocks.len() {
            let mut j = i + 1;
            while j < blocks.len() && blocks[j] == blocks[j - 1] + 1 {
                j += 1;
            }
            let pages = pool.block_range(blocks[i]).start..pool.block_range(blocks[j - 1]).end;
            let Some((dst, src, len)) = pool.device_run(pages.clone()) else {
                let _ = self.stream.sync();
                return Err(format!("pages {pages:?} lie outside the device pool"));
            };
            // SAFETY: `src` is the pinned mirror of these pages and `dst` the same pages of the
            // pool's device allocation (checked by device_run). The calling thread owns the
            // blocks: nobody writes their mirror bytes or reads their device bytes until the
            // stream is synchronised below and the entries are published.
            if let Err(e) = unsafe { self.stream.htod(dst, src, len) } {
                let _ = self.stream.sync();
                return Err(e);
            }
            i = j;
        }
        self.stream.sync()
    }
}

/// Why a staged send stopped.
#[derive(Debug)]
pub(crate) enum StageError {
    Cuda(String),
    Io(io::Error),
}

/// A send socket thread's two pinned pieces and stream (CUDA mode), allocated once at comm
/// creation.
pub(crate) struct SendStaging {
    bufs: [Pinned; 2],
    stream: Stream,
}

impl SendStaging {
    pub(crate) fn new(ctx: &Arc<Ctx>) -> io::Result<SendStaging> {
        let a = Pinned::new(ctx, SEND_PIECE, false).map_err(|e| cuda_err("send staging", e))?;
        let b = Pinned::new(ctx, SEND_PIECE, false).map_err(|e| cuda_err("send staging", e))?;
        let stream = Stream::new(ctx).map_err(|e| cuda_err("send stream", e))?;
        Ok(SendStaging { bufs: [a, b], stream })
    }

    pub(crate) fn bind(&self) -> Result<cuda::Bound, String> {
        cuda::bind(self.stream.ctx())
    }

    /// Send `len` bytes of device memory at `src`: piece by piece, each downloaded into pinned
    /// memory (the next piece's copy overlaps the current piece's `write`).
    pub(crate) fn send_device(
        &self,
        src: u64,
        len: usize,
        mut write: impl FnMut(*const u8, usize) -> io::Result<()>,
    ) -> Result<(), StageError> {
        if len == 0 {
            return Ok(());
        }
        let pieces = len.div_ceil(SEND_PIECE);
        let piece = |i: usize| (i * SEND_PIECE, (len - i * SEND_PIECE).min(SEND_PIECE));
        let fetch = |i: usize| -> Result<(), String> {
            let (off, n) = piece(i);
            // SAFETY: the destination is one of our pinned pieces (n ≤ SEND_PIECE), not read
            // again before the stream is synchronised; the source is the caller's registered
            // device range, alive and unmodified until the send completes (NCCL's contract).
            unsafe { self.stream.dtoh(self.bufs[i % 2].host(), src + off as u64, n) }
        };
        fetch(0).map_err(StageError::Cuda)?;
        self.stream.sync().map_err(StageError::Cuda)?;
        for i in 0..pieces {
            if i + 1 < pieces {
                if let Err(e) = fetch(i + 1) {
                    let _ = self.stream.sync();
                    return Err(StageError::Cuda(e));
                }
            }
            let (_, n) = piece(i);
            if let Err(e) = write(self.bufs[i % 2].host(), n) {
                let _ = self.stream.sync();
                return Err(StageError::Io(e));
            }
            if i + 1 < pieces {
                self.stream.sync().map_err(StageError::Cuda)?;
            }
        }
        Ok(())
    }
}
