//! The unpack ring of a receive comm (§2 of the ABI): where each completed receive's fragments
//! sit in the bounce buffer.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use super::abi::{self, loadMeta, ncclNetDeviceHandle_v7_t, netUnpackMeta, unpackNetDeviceHandle};
use super::error::{NetError, NetResult};
use super::memory::probe_copy;

/// A view of the plugin's `netUnpackMeta` and bounce buffer, valid while its recv comm is open.
#[derive(Debug)]
pub struct UnpackRing {
    meta: *const netUnpackMeta,
    bounce: *const u8,
    bounce_host_readable: bool,
    /// The GPU holding the bounce buffer (device memory only; `None` when CUDA cannot say).
    /// Asked of CUDA at accept for memory the host cannot read; for memory it can (host mode,
    /// or the CUDA stand-in's "device" memory, which is host memory) on first use, by a GPU
    /// receive, so host mode never opens a CUDA context for it.
    bounce_device: OnceLock<Option<usize>>,
    /// Bytes from the bounce buffer's start to the end of its allocation, when CUDA can say.
    bounce_len: OnceLock<Option<u64>>,
}

impl UnpackRing {
    /// Reads the 24-byte `unpackNetDeviceHandle` a device handle points at.
    ///
    /// The real plugin keeps that handle in device memory; reading it from the host then needs a
    /// CUDA copy, which this function reports as an error rather than faulting. The emulation in
    /// host-bounce mode keeps it in host memory.
    pub(super) fn from_device_handle(dh: &ncclNetDeviceHandle_v7_t) -> NetResult<UnpackRing> {
        if dh.netDeviceType != abi::NCCL_NET_DEVICE_UNPACK {
            return Err(NetError::Ring(format!(
                "device handle type is {}, not NCCL_NET_DEVICE_UNPACK",
                dh.netDeviceType
            )));
        }
        if dh.handle.is_null() || dh.size < std::mem::size_of::<unpackNetDeviceHandle>() {
            return Err(NetError::Ring(format!(
                "device handle points at {:p} with size {} (expected a 24-byte unpackNetDeviceHandle)",
                dh.handle, dh.size
            )));
        }
        let mut raw = [0u8; std::mem::size_of::<unpackNetDeviceHandle>()];
        // The emulation in host mode keeps the handle in host memory; the real plugin (and the
        // emulation in CUDA mode) in device memory, read with a device-to-host copy.
        if !probe_copy(dh.handle as *const u8, &mut raw) {
            crate::gpu::read_any_device(dh.handle as u64, &mut raw).map_err(|e| {
                NetError::Ring(format!(
                    "reading the unpackNetDeviceHandle from device memory: {e}"
                ))
            })?;
        }
        // SAFETY: `raw` holds the 24 bytes of an `unpackNetDeviceHandle` (plain data).
        let h: unpackNetDeviceHandle = unsafe { std::ptr::read_unaligned(raw.as_ptr().cast()) };
        let mut probe = [0u8; 16];
        if !probe_copy(h.meta as *const u8, &mut probe) {
            return Err(NetError::Ring(format!(
                "the unpack ring at {:p} is not readable from the host",
                h.meta
            )));
        }
        let bounce_host_readable = probe_copy(h.bounce_buf as *const u8, &mut probe[..1]);
        // The plugin allocates the bounce buffer on whichever GPU was current at accept (with
        // TCPX: the one RxDM serves for the NIC); receives into other GPUs need peer access.
        // The real plugin leaves it NULL where it imported none (an odd GPU under
        // NCCL_TCPX_RXMEM_IMPORT_SKIP_ODDS=1): host receives still work, nothing to ask CUDA.
        let ring = UnpackRing {
            meta: h.meta,
            bounce: h.bounce_buf as *const u8,
            bounce_host_readable,
            bounce_device: OnceLock::new(),
            bounce_len: OnceLock::new(),
        };
        if h.bounce_buf.is_null() {
            let _ = ring.bounce_device.set(None);
            let _ = ring.bounce_len.set(None);
        } else if !bounce_host_readable {
            ring.bounce_device();
            ring.bounce_span_len();
        }
        Ok(ring)
    }

    /// The ring's address (as a device kernel would use it under unified addressing).
    pub fn meta_ptr(&self) -> *const netUnpackMeta {
        self.meta
    }

    /// The bounce buffer's address.
    pub fn bounce_ptr(&self) -> *const u8 {
        self.bounce
    }

    /// The GPU holding the bounce buffer, when it is device memory CUDA knows.
    pub fn bounce_device(&self) -> Option<usize> {
        *self
            .bounce_device
            .get_or_init(|| crate::gpu::device_of(self.bounce as u64).ok())
    }

    fn bounce_span_len(&self) -> Option<u64> {
        *self.bounce_len.get_or_init(|| {
            self.bounce_device()
                .and_then(|_| crate::gpu::allocation_extent(self.bounce as u64).ok())
        })
    }

    /// Whether the bounce buffer is host memory (the emulation's host mode) rather than GPU memory.
    pub fn bounce_is_host_readable(&self) -> bool {
        self.bounce_host_readable
    }

    /// The fragment list of slot `q` for the GPU unpacker: the host view plus the device view of
    /// the same host-mapped ring memory, so a kernel can read it in place.
    pub fn fragment_list(&self, q: usize) -> NetResult<crate::gpu::FragmentList<'_>> {
        let frags = self.fragments(q)?;
        let dev = frags.as_ptr() as u64;
        // SAFETY: the ring is the plugin's host-mapped `netUnpackMeta` (cuMemHostAlloc with
        // DEVICEMAP; under unified addressing its device address equals the host one); slot `q`
        // is not rewritten before the request is consumed, which the poller does only after the
        // batch this list goes into has finished.
        Ok(unsafe { crate::gpu::FragmentList::mapped(frags, dev) })
    }

    /// The GPU bounce buffer as far as fragments may read: to the end of its allocation when
    /// CUDA can tell (no pass over the list), else (the ABI does not size it) to the end of the
    /// furthest of the given fragments.
    pub fn bounce_span(&self, frags: &[loadMeta]) -> crate::gpu::DeviceSpan {
        let end = self.bounce_span_len().unwrap_or_else(|| {
            frags
                .iter()
                .map(|f| u64::from(f.src_off) + u64::from(f.len))
                .max()
                .unwrap_or(0)
        });
        // SAFETY: the bounce buffer is the plugin's device memory, alive while the comm is open
        // (the poller consumes, and so releases pages, only after the unpack finished); the span
        // ends inside its allocation (CUDA's own range), or at a fragment the plugin published,
        // which lies inside it.
        unsafe { crate::gpu::DeviceSpan::from_raw(self.bounce as u64, end) }
    }

    /// The fragment count the plugin published for slot `q` (acquire-ordered).
    pub fn count(&self, q: usize) -> NetResult<usize> {
        if q >= abi::NCCL_NET_DEVICE_UNPACK_MAX_QUEUE_DEPTH {
            return Err(NetError::Ring(format!("slot {q} is outside the 16-slot ring")));
        }
        // SAFETY: `meta` is the plugin's live ring (checked readable at accept); `cnt[q]` is an
        // 8-aligned u64 the plugin publishes with a release store.
        let cnt = unsafe {
            let p = std::ptr::addr_of!((*self.meta).cnt[q]) as *mut u64;
            AtomicU64::from_ptr(p).load(Ordering::Acquire)
        };
        if cnt as usize > abi::NET_UNPACK_MAX_SLICE_PAGES {
            return Err(NetError::Ring(format!(
                "slot {q} claims {cnt} fragments (at most {})",
                abi::NET_UNPACK_MAX_SLICE_PAGES
            )));
        }
        Ok(cnt as usize)
    }

    /// The fragment list of slot `q`, as published.
    pub fn fragments(&self, q: usize) -> NetResult<&[loadMeta]> {
        let cnt = self.count(q)?;
        // SAFETY: the first `cnt` entries of `mem[q]` were written before `cnt[q]` was published
        // (acquire above); they stay untouched until the request is consumed, and the returned
        // slice borrows the ring, which lives as long as its recv comm.
        Ok(unsafe {
            std::slice::from_raw_parts(std::ptr::addr_of!((*self.meta).mem[q]).cast::<loadMeta>(), cnt)
        })
    }

    /// Host unpack: copies every fragment of slot `q` from the bounce buffer to `dst + dst_off`,
    /// refusing any fragment that would land outside `dst_len` bytes. Returns the bytes copied.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `dst_len` bytes that nothing else accesses meanwhile.
    pub(super) unsafe fn gather_host(&self, q: usize, dst: *mut u8, dst_len: usize) -> NetResult<usize> {
        if !self.bounce_host_readable {
            return Err(NetError::Ring(
                "the bounce buffer is GPU memory; the host unpacker cannot read it".into(),
            ));
        }
        let frags = self.fragments(q)?;
        let mut total = 0usize;
        for f in frags {
            let end = f.dst_off.checked_add(u64::from(f.len));
            if end.is_none_or(|e| e > dst_len as u64) {
                return Err(NetError::Ring(format!(
                    "fragment {}+{} lands outside the {dst_len}-byte receive (sender sent more than was posted)",
                    f.dst_off, f.len
                )));
            }
            // SAFETY: the source is inside the plugin's host bounce buffer (a fragment the plugin
            // published); the destination range was just bounds-checked against the caller's buffer.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.bounce.add(f.src_off as usize),
                    dst.add(f.dst_off as usize),
                    f.len as usize,
                )
            };
            total += f.len as usize;
        }
        Ok(total)
    }
}

// SAFETY: the ring is the plugin's memory for the comm's lifetime; the view only reads it and is
// owned by (and used alongside) its `RecvComm`.
unsafe impl Send for UnpackRing {}

#[cfg(test)]
mod tests {
    use super::*;

    /// The real plugin's receive comm on a GPU it imported no receive buffer for
    /// (`NCCL_TCPX_RXMEM_IMPORT_SKIP_ODDS=1`, an odd ordinal): a NULL bounce buffer. The ring is
    /// still usable for host receives and CUDA is never asked about the NULL address.
    #[test]
    fn a_null_bounce_buffer_is_no_device_and_asks_cuda_nothing() {
        let layout = std::alloc::Layout::new::<netUnpackMeta>();
        // SAFETY: a non-zero-sized layout; freed below with the same layout.
        let meta = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<netUnpackMeta>();
        assert!(!meta.is_null());
        let mut h = unpackNetDeviceHandle {
            meta,
            bounce_buf: std::ptr::null_mut(),
            head: u64::MAX,
        };
        let dh = ncclNetDeviceHandle_v7_t {
            netDeviceType: abi::NCCL_NET_DEVICE_UNPACK,
            netDeviceVersion: abi::NCCL_NET_DEVICE_UNPACK_VERSION,
            handle: (&mut h as *mut unpackNetDeviceHandle).cast(),
            size: std::mem::size_of::<unpackNetDeviceHandle>(),
            needsProxyProgress: 1,
        };
        let ring = UnpackRing::from_device_handle(&dh).expect("a ring without a bounce buffer");
        assert!(!ring.bounce_is_host_readable());
        assert_eq!(ring.bounce_device(), None);
        assert!(ring.bounce_ptr().is_null());
        // SAFETY: allocated above with this layout, no longer referenced.
        unsafe { std::alloc::dealloc(meta.cast(), layout) };
    }
}
