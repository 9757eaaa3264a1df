//! Memory a receive comm hands to its consumer: the unpack ring, the bounce pages and the
//! 24-byte `unpackNetDeviceHandle`.
//!
//! In this host-only version all three live in host memory. The types are the seams for the GPU
//! version (see `docs/EMULATION.md`, "CUDA bounce buffer"): `BouncePool` would own device memory
//! and host staging pages (sockets read into staging, then a copy to the device page),
//! `RingMemory` would come from `cuMemHostAlloc(DEVICEMAP)`, and `HandleMemory` from `cuMemAlloc`.

use crate::abi::{
    NET_UNPACK_MAX_SLICE_PAGES, SLICE_PAGE_SIZE, loadMeta, netUnpackMeta, unpackNetDeviceHandle,
};
use crate::rng::SplitMix64;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

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

/// The `netUnpackMeta` ring (524416 bytes, zeroed, page- hence 16-aligned).
#[derive(Debug)]
pub(crate) struct RingMemory {
    map: Mapping,
}

impl RingMemory {
    pub(crate) fn new() -> io::Result<RingMemory> {
        let len = std::mem::size_of::<netUnpackMeta>().next_multiple_of(SLICE_PAGE_SIZE);
        Ok(RingMemory {
            map: Mapping::new(len)?,
        })
    }

    pub(crate) fn meta(&self) -> *mut netUnpackMeta {
        self.map.ptr.cast()
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
    free: Vec<u32>,
    rng: SplitMix64,
    warned: bool,
}

/// The bounce buffer: `npages` pages of 4 KiB, handed out in shuffled order.
pub(crate) struct BouncePool {
    map: Mapping,
    npages: u32,
    state: Mutex<PoolState>,
    cv: Condvar,
}

impl BouncePool {
    pub(crate) fn new(npages: u32, rng: SplitMix64) -> io::Result<BouncePool> {
        let map = Mapping::new(npages as usize * SLICE_PAGE_SIZE)?;
        Ok(BouncePool {
            map,
            npages,
            state: Mutex::new(PoolState {
                free: (0..npages).collect(),
                rng,
                warned: false,
            }),
            cv: Condvar::new(),
        })
    }

    pub(crate) fn base(&self) -> *mut u8 {
        self.map.ptr
    }

    pub(crate) fn page_ptr(&self, page: u32) -> *mut u8 {
        assert!(page < self.npages);
        // SAFETY: page < npages, so the offset stays inside the mapping.
        unsafe { self.map.ptr.add(page as usize * SLICE_PAGE_SIZE) }
    }

    /// Take up to `out.len()` random free pages; waits while none is free. Returns 0 only when
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

    /// Return pages to the pool.
    pub(crate) fn give_back(&self, pages: impl Iterator<Item = u32>) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let before = st.free.len();
        st.free.extend(pages.filter(|&p| p < self.npages));
        if st.free.len() != before {
            self.cv.notify_all();
        }
    }

    pub(crate) fn wake_all(&self) {
        let _st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.cv.notify_all();
    }
}

/// Storage for the 24-byte `unpackNetDeviceHandle` the device handle points at. The consumer
/// (NCCL) owns its `head` field and may write it, so it is kept behind a raw pointer.
#[derive(Debug)]
pub(crate) struct HandleMemory {
    h: *mut unpackNetDeviceHandle,
}

// SAFETY: the handle is plain memory owned by this value and only read or written by the
// consumer through the pointer it was given; the plugin never touches it after creation.
unsafe impl Send for HandleMemory {}
// SAFETY: as above.
unsafe impl Sync for HandleMemory {}

impl HandleMemory {
    pub(crate) fn new(ring: &RingMemory, pool: &BouncePool) -> HandleMemory {
        HandleMemory {
            h: Box::into_raw(Box::new(unpackNetDeviceHandle {
                meta: ring.meta(),
                bounce_buf: pool.base().cast(),
                head: u64::MAX,
            })),
        }
    }

    pub(crate) fn ptr(&self) -> *mut unpackNetDeviceHandle {
        self.h
    }
}

impl Drop for HandleMemory {
    fn drop(&mut self) {
        // SAFETY: `h` came from Box::into_raw in `new` and is freed exactly once, here.
        drop(unsafe { Box::from_raw(self.h) });
    }
}
