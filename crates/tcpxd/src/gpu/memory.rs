//! Device memory, IPC, and mapped pinned host memory.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;

use super::error::{GpuError, GpuResult, check};
use super::{Gpu, Stream};
use tcpxd_abi::{REGION_ALIGN, loadMeta};

/// A device address range: what a kernel or a copy may touch. Carries no ownership.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSpan {
    ptr: u64,
    len: u64,
}

impl DeviceSpan {
    /// A span from a raw device address (e.g. the plugin's bounce buffer).
    ///
    /// # Safety
    /// `ptr .. ptr + len` must be device-accessible memory of the current device (device memory,
    /// or the device view of mapped pinned memory) that stays allocated until every GPU operation
    /// given this span has completed, and that no Rust reference aliases while GPU work writes it.
    pub unsafe fn from_raw(ptr: u64, len: u64) -> DeviceSpan {
        DeviceSpan { ptr, len }
    }

    /// A span never given to the GPU, for host-side validation tests.
    #[cfg(test)]
    pub(crate) fn for_validation_tests(ptr: u64, len: u64) -> DeviceSpan {
        DeviceSpan { ptr, len }
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The `len` bytes at `offset` inside this span (bounds-checked, so as valid as the span).
    pub fn sub(&self, offset: u64, len: u64) -> GpuResult<DeviceSpan> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(DeviceSpan {
                ptr: self.ptr + offset,
                len,
            }),
            _ => Err(GpuError::InvalidArgument(format!(
                "range {offset}+{len} is outside the {}-byte span",
                self.len
            ))),
        }
    }
}

impl From<&DeviceRegion> for DeviceSpan {
    fn from(r: &DeviceRegion) -> DeviceSpan {
        r.span()
    }
}

/// A receive's fragment list: the host view of `mem[q][..cnt[q]]`, and optionally the device
/// view of the same memory (the ring is host-mapped, so kernels can read it in place).
#[derive(Debug, Clone, Copy)]
pub struct FragmentList<'a> {
    host: &'a [loadMeta],
    dev: Option<DeviceSpan>,
}

impl<'a> FragmentList<'a> {
    /// A list known only to the host: an unpacker that needs it on the device copies it.
    pub fn host(frags: &'a [loadMeta]) -> FragmentList<'a> {
        FragmentList {
            host: frags,
            dev: None,
        }
    }

    /// A list with a device view.
    ///
    /// # Safety
    /// `dev` must be the device address of the memory `frags` views (host-mapped memory, such as
    /// the plugin's `netUnpackMeta`), and that memory must stay unchanged until the ticket of the
    /// batch this list is pushed into is done (the ring slot is only reused after
    /// `irecvConsumed`).
    pub unsafe fn mapped(frags: &'a [loadMeta], dev: u64) -> FragmentList<'a> {
        FragmentList {
            host: frags,
            dev: Some(DeviceSpan {
                ptr: dev,
                len: size_of_val(frags) as u64,
            }),
        }
    }

    /// `count` fragments at byte `offset` of a pinned region, with its device view.
    pub fn from_pinned(region: &'a PinnedRegion, offset: usize, count: usize) -> GpuResult<FragmentList<'a>> {
        let host = region.typed::<loadMeta>(offset, count)?;
        Ok(FragmentList {
            host,
            dev: Some(DeviceSpan {
                ptr: region.device_ptr() + offset as u64,
                len: size_of_val(host) as u64,
            }),
        })
    }

    /// A host list with a copy of it in device memory (`count` entries at byte `offset` of
    /// `copy`). The copy must hold the same entries: the kernel bounds-checks what it reads, so
    /// a stale copy gives wrong bytes, never out-of-bounds writes.
    pub fn from_device(
        frags: &'a [loadMeta],
        copy: &DeviceRegion,
        offset: u64,
    ) -> GpuResult<FragmentList<'a>> {
        let dev = copy.subspan(offset, size_of_val(frags) as u64)?;
        Ok(FragmentList {
            host: frags,
            dev: Some(dev),
        })
    }

    pub fn as_slice(&self) -> &'a [loadMeta] {
        self.host
    }

    /// The device view, when there is one.
    pub fn device_span(&self) -> Option<DeviceSpan> {
        self.dev
    }

    pub fn len(&self) -> usize {
        self.host.len()
    }

    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Backing {
    /// cuMemAlloc'd here; `base` is the allocation.
    Owned,
    /// cuIpcOpenMemHandle'd here; `base` is the mapping.
    Imported,
    /// Another window onto an imported mapping, which `DeviceRegion::shares` keeps open.
    View,
    /// A VMM allocation (`cuMemCreate` here, or `cuMemImportFromShareableHandle` of its fd) mapped
    /// over `reserved` bytes reserved at `base` (vmm.rs): unmapped, released and unreserved on drop.
    Vmm { handle: u64, reserved: usize },
}

/// Device memory of one GPU, 4 KiB-aligned (as TCPX `regMr` demands), freed (or, for an
/// imported region, unmapped) on drop.
pub struct DeviceRegion {
    pub(super) gpu: Arc<Gpu>,
    pub(super) base: u64,
    pub(super) ptr: u64,
    pub(super) len: usize,
    pub(super) backing: Backing,
    /// For a view (`DeviceRegion::view_of`): the imported region whose mapping it is a window of.
    pub(super) shares: Option<Arc<DeviceRegion>>,
}

/// What another process needs to import a [`DeviceRegion`]: the IPC handle of the allocation
/// and where the region sits inside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpcExport {
    pub handle: [u8; 64],
    pub offset: u64,
    pub len: u64,
}

impl std::fmt::Debug for DeviceRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceRegion")
            .field("gpu", &self.gpu.ordinal())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("backing", &self.backing)
            .finish()
    }
}

impl Gpu {
    /// Allocates `len` bytes of zeroed device memory at a 4 KiB-aligned address.
    pub fn alloc(self: &Arc<Self>, len: usize) -> GpuResult<DeviceRegion> {
        self.bind_to_thread()?;
        let bytes = len
            .max(1)
            .checked_add(REGION_ALIGN)
            .ok_or_else(|| GpuError::InvalidArgument(format!("device region of {len} bytes is too large")))?;
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: writes one device pointer; freed in Drop.
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut base, bytes) })?;
        let ptr = base.next_multiple_of(REGION_ALIGN as u64);
        let region = DeviceRegion {
            gpu: self.clone(),
            base,
            ptr,
            len,
            backing: Backing::Owned,
            shares: None,
        };
        // SAFETY: the range lies inside the allocation just made.
        check("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(ptr, 0, len) })?;
        // A "synchronous" memset of device memory may still be running when it returns, on the
        // legacy stream, which our non-blocking streams do not wait for.
        legacy_sync()?;
        Ok(region)
    }

    /// Maps another process's exported region (`cuIpcOpenMemHandle` with lazy peer access) and
    /// returns the `len` bytes at `offset` inside it. Unmapped on drop.
    ///
    /// The handle must come from another process: CUDA refuses to open a handle of its own
    /// process (`CUDA_ERROR_INVALID_CONTEXT`).
    pub fn import_ipc(
        self: &Arc<Self>,
        handle: &[u8; 64],
        offset: u64,
        len: usize,
    ) -> GpuResult<DeviceRegion> {
        self.bind_to_thread()?;
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        for (d, s) in h.reserved.iter_mut().zip(handle) {
            *d = *s as std::ffi::c_char;
        }
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: writes one device pointer; the handle is 64 plain bytes the driver validates.
        check("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut base,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })?;
        let mut region = DeviceRegion {
            gpu: self.clone(),
            base,
            ptr: base,
            len: 0,
            backing: Backing::Imported,
            shares: None,
        };
        let mut range_base: sys::CUdeviceptr = 0;
        let mut range_len: usize = 0;
        // SAFETY: writes a pointer and a size for an address the driver just mapped.
        check("cuMemGetAddressRange", unsafe {
            sys::cuMemGetAddressRange_v2(&mut range_base, &mut range_len, base)
        })?;
        let avail = (range_base + range_len as u64).saturating_sub(base);
        match offset.checked_add(len as u64) {
            Some(end) if end <= avail => {
                region.ptr = base + offset;
                region.len = len;
                Ok(region)
            }
            _ => Err(GpuError::InvalidArgument(format!(
                "IPC range {offset}+{len} is outside the exported {avail}-byte allocation"
            ))),
        }
    }
}

impl Gpu {
    /// The device allocation containing `ptr`: `(base, len)` (`cuMemGetAddressRange`). Gives
    /// the bounce buffer's extent from the pointer the plugin publishes.
    pub fn allocation_range(&self, ptr: u64) -> GpuResult<(u64, u64)> {
        self.bind_to_thread()?;
        let (mut base, mut len): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: a query; writes a pointer and a size, and fails for an unknown address.
        check("cuMemGetAddressRange", unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut len, ptr)
        })?;
        Ok((base, len as u64))
    }

    /// Copies `out.len()` bytes from the device address `ptr` (e.g. the plugin's 24-byte
    /// `unpackNetDeviceHandle`, which lives in device memory). A bad address is an error.
    pub fn read_device(&self, ptr: u64, out: &mut [u8]) -> GpuResult<()> {
        self.bind_to_thread()?;
        // SAFETY: `out` is a live, exclusive host buffer; the driver validates the device range
        // and reports an invalid one instead of touching host memory.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), ptr, out.len())
        })
    }
}

impl DeviceRegion {
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The device address of byte 0.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether this region was imported from another process.
    pub fn is_imported(&self) -> bool {
        matches!(self.backing, Backing::Imported | Backing::View)
    }

    /// Another window onto the mapping `of` was imported from (`import_ipc`): `len` bytes at
    /// `offset` into the mapping, sharing it rather than opening the handle again (a process
    /// opens an IPC handle once). The mapping is closed with the last region using it.
    pub fn view_of(of: &Arc<DeviceRegion>, offset: u64, len: usize) -> GpuResult<DeviceRegion> {
        let root = of.shares.clone().unwrap_or_else(|| of.clone());
        if root.backing != Backing::Imported {
            return Err(GpuError::InvalidArgument(
                "only an imported region's mapping can be shared".into(),
            ));
        }
        let (range_base, range_len) = root.gpu.allocation_range(root.base)?;
        let avail = (range_base + range_len).saturating_sub(root.base);
        match offset.checked_add(len as u64) {
            Some(end) if end <= avail => Ok(DeviceRegion {
                gpu: root.gpu.clone(),
                base: root.base,
                ptr: root.base + offset,
                len,
                backing: Backing::View,
                shares: Some(root),
            }),
            _ => Err(GpuError::InvalidArgument(format!(
                "IPC range {offset}+{len} is outside the exported {avail}-byte allocation"
            ))),
        }
    }

    /// The whole region as a span.
    pub fn span(&self) -> DeviceSpan {
        DeviceSpan {
            ptr: self.ptr,
            len: self.len as u64,
        }
    }

    /// `len` bytes at `offset`, bounds-checked.
    pub fn subspan(&self, offset: u64, len: u64) -> GpuResult<DeviceSpan> {
        self.check(offset, len)?;
        Ok(DeviceSpan {
            ptr: self.ptr + offset,
            len,
        })
    }

    pub(crate) fn check(&self, offset: u64, len: u64) -> GpuResult<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len as u64 => Ok(()),
            _ => Err(GpuError::InvalidArgument(format!(
                "range {offset}+{len} is outside the {}-byte device region",
                self.len
            ))),
        }
    }

    /// The IPC handle of this region's allocation, with the region's place in it.
    pub fn export_ipc(&self) -> GpuResult<IpcExport> {
        match self.backing {
            Backing::Owned => {}
            Backing::Imported | Backing::View => {
                return Err(GpuError::InvalidArgument(
                    "an imported region cannot be exported again".into(),
                ));
            }
            Backing::Vmm { .. } => {
                return Err(GpuError::InvalidArgument(
                    "a VMM allocation has no CUDA IPC handle (it is shared by its POSIX fd)".into(),
                ));
            }
        }
        self.gpu.bind_to_thread()?;
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: writes 64 bytes; `base` is the start of a live cuMemAlloc allocation.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut h, self.base)
        })?;
        let mut handle = [0u8; 64];
        for (d, s) in handle.iter_mut().zip(h.reserved) {
            *d = s as u8;
        }
        Ok(IpcExport {
            handle,
            offset: self.ptr - self.base,
            len: self.len as u64,
        })
    }

    /// Synchronous copy of `src` into the region at `offset` (from pageable memory).
    pub fn write(&self, offset: u64, src: &[u8]) -> GpuResult<()> {
        self.check(offset, src.len() as u64)?;
        self.gpu.bind_to_thread()?;
        // SAFETY: the destination range was bounds-checked; `src` is a live Rust slice.
        check("cuMemcpyHtoD", unsafe {
            sys::cuMemcpyHtoD_v2(self.ptr + offset, src.as_ptr().cast(), src.len())
        })?;
        // From pageable memory the call may return before the DMA has landed (on the legacy
        // stream, which non-blocking streams do not wait for): wait for it.
        legacy_sync()
    }

    /// Synchronous copy of `dst.len()` bytes at `offset` out of the region (to pageable memory).
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> GpuResult<()> {
        self.check(offset, dst.len() as u64)?;
        self.gpu.bind_to_thread()?;
        // SAFETY: the source range was bounds-checked; `dst` is a live, exclusive Rust slice.
        check("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), self.ptr + offset, dst.len())
        })
    }

    /// Sets `len` bytes at `offset` to `value`, asynchronously on `stream`.
    pub fn memset_async(&self, stream: &Stream, offset: u64, len: u64, value: u8) -> GpuResult<()> {
        self.check(offset, len)?;
        self.gpu.bind_to_thread()?;
        // SAFETY: the range was bounds-checked; the region outlives the operation because
        // dropping it frees with cuMemFree, which waits for outstanding work.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(self.ptr + offset, value, len as usize, stream.raw())
        })
    }
}

/// Waits for the legacy default stream (where the driver's synchronous copies and memsets run).
fn legacy_sync() -> GpuResult<()> {
    // SAFETY: the NULL stream is always valid in the current context.
    check("cuStreamSynchronize", unsafe {
        sys::cuStreamSynchronize(std::ptr::null_mut())
    })
}

impl Drop for DeviceRegion {
    fn drop(&mut self) {
        if self.backing == Backing::View {
            return; // the mapping is `shares`'s, closed when its last user goes
        }
        if let Err(e) = self.gpu.bind_to_thread() {
            tracing::warn!("freeing device memory: {e}");
            return;
        }
        let (call, code) = match self.backing {
            // SAFETY: `base` is this value's own allocation, freed once.
            Backing::Owned => ("cuMemFree", unsafe { sys::cuMemFree_v2(self.base) }),
            // SAFETY: `base` is this value's own mapping, closed once.
            Backing::Imported => ("cuIpcCloseMemHandle", unsafe {
                sys::cuIpcCloseMemHandle(self.base)
            }),
            Backing::View => return,
            Backing::Vmm { handle, reserved } => super::vmm::release(self.base, reserved, handle),
        };
        if let Err(e) = check(call, code) {
            tracing::warn!("releasing device memory at {:#x}: {e}", self.base);
        }
    }
}

/// Page-locked host memory mapped into the device's address space (`cuMemHostAlloc` with
/// DEVICEMAP | PORTABLE): the host reaches it at [`PinnedRegion::as_ptr`], kernels and copies at
/// [`PinnedRegion::device_ptr`]. Contents start zeroed.
///
/// GPU work may write it asynchronously: host access goes through copies, and callers
/// synchronise with that work first (an event, a stream) before reading what it wrote.
pub struct PinnedRegion {
    gpu: Arc<Gpu>,
    host: *mut u8,
    dev: u64,
    len: usize,
}

// SAFETY: plain memory owned by this value; access goes through raw copies or `&mut self`.
unsafe impl Send for PinnedRegion {}
// SAFETY: as above; shared access only reads through copies.
unsafe impl Sync for PinnedRegion {}

impl std::fmt::Debug for PinnedRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedRegion")
            .field("host", &self.host)
            .field("dev", &format_args!("{:#x}", self.dev))
            .field("len", &self.len)
            .finish()
    }
}

impl Gpu {
    /// Allocates `len` bytes of zeroed, mapped, pinned host memory.
    pub fn alloc_pinned(self: &Arc<Self>, len: usize) -> GpuResult<PinnedRegion> {
        self.bind_to_thread()?;
        let bytes = len.max(1);
        let mut host: *mut c_void = std::ptr::null_mut();
        // SAFETY: writes one host pointer; freed in Drop.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(
                &mut host,
                bytes,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        })?;
        let mut region = PinnedRegion {
            gpu: self.clone(),
            host: host.cast(),
            dev: 0,
            len,
        };
        // SAFETY: writes one device pointer for a mapped allocation made above.
        check("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut region.dev, host, 0)
        })?;
        // SAFETY: `bytes` writable bytes were just allocated.
        unsafe { std::ptr::write_bytes(region.host, 0, bytes) };
        Ok(region)
    }
}

impl PinnedRegion {
    /// The host address of byte 0.
    pub fn as_ptr(&self) -> *mut u8 {
        self.host
    }

    /// The device address of byte 0 (equal to the host address under unified addressing).
    pub fn device_ptr(&self) -> u64 {
        self.dev
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The whole region's device view.
    pub fn span(&self) -> DeviceSpan {
        DeviceSpan {
            ptr: self.dev,
            len: self.len as u64,
        }
    }

    pub(crate) fn check(&self, offset: u64, len: u64) -> GpuResult<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len as u64 => Ok(()),
            _ => Err(GpuError::InvalidArgument(format!(
                "range {offset}+{len} is outside the {}-byte pinned region",
                self.len
            ))),
        }
    }

    /// Copies `dst.len()` bytes at `offset` out of the region.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> GpuResult<()> {
        self.check(offset as u64, dst.len() as u64)?;
        // SAFETY: bounds-checked; `dst` is a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(self.host.add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` into the region at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> GpuResult<()> {
        self.check(offset as u64, src.len() as u64)?;
        // SAFETY: bounds-checked; `src` is a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.host.add(offset), src.len()) };
        Ok(())
    }

    /// The bytes, for exclusive host use (no GPU work touching the region may be in flight).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes were allocated; `&mut self` excludes other host access.
        unsafe { std::slice::from_raw_parts_mut(self.host, self.len) }
    }

    /// The bytes, for host reading (no GPU work writing the region may be in flight).
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes were allocated; host writes need `&mut self` or go through copies
        // the caller orders with this borrow.
        unsafe { std::slice::from_raw_parts(self.host, self.len) }
    }

    /// Volatile read of the u32 at byte `offset` (a word GPU work may have written).
    pub fn load_u32(&self, offset: usize) -> GpuResult<u32> {
        let v = self.typed::<u32>(offset, 1)?;
        // SAFETY: an aligned, in-bounds u32 of this allocation.
        Ok(unsafe { std::ptr::read_volatile(v.as_ptr()) })
    }

    /// Volatile write of the u32 at byte `offset` (a word GPU work will read or write).
    pub fn store_u32(&self, offset: usize, value: u32) -> GpuResult<()> {
        let v = self.typed::<u32>(offset, 1)?;
        // SAFETY: an aligned, in-bounds u32 of this allocation; host writes to pinned memory go
        // through raw pointers, never through references held elsewhere.
        unsafe { std::ptr::write_volatile(v.as_ptr() as *mut u32, value) };
        Ok(())
    }

    /// The host address of byte 0 (for the gpu module's own structured writes).
    pub(super) fn host_ptr(&self) -> *mut u8 {
        self.host
    }

    /// Volatile read of the u64 at byte `offset` (a word GPU work may have written; an aligned
    /// 8-byte load, so never torn).
    pub fn load_u64(&self, offset: usize) -> GpuResult<u64> {
        let v = self.typed::<u64>(offset, 1)?;
        // SAFETY: an aligned, in-bounds u64 of this allocation.
        Ok(unsafe { std::ptr::read_volatile(v.as_ptr()) })
    }

    /// Reinterprets `count` elements of plain data at byte `offset` as a slice of `T`.
    pub fn typed<T: plain::Plain>(&self, offset: usize, count: usize) -> GpuResult<&[T]> {
        let bytes = count
            .checked_mul(size_of::<T>())
            .ok_or_else(|| GpuError::InvalidArgument("typed view too large".into()))?;
        self.check(offset as u64, bytes as u64)?;
        // SAFETY: `host` is page-aligned, so `host + offset` is aligned for T when `offset` is;
        // checked below. T is plain data (any bit pattern valid), the range is in bounds.
        let p = unsafe { self.host.add(offset) };
        if (p as usize) % align_of::<T>() != 0 {
            return Err(GpuError::InvalidArgument(format!(
                "offset {offset} is not aligned for a {}-byte element",
                align_of::<T>()
            )));
        }
        // SAFETY: aligned, in bounds, plain data; see above.
        Ok(unsafe { std::slice::from_raw_parts(p.cast::<T>(), count) })
    }

    /// Mutable counterpart of [`PinnedRegion::typed`].
    pub fn typed_mut<T: plain::Plain>(&mut self, offset: usize, count: usize) -> GpuResult<&mut [T]> {
        let p = self.typed::<T>(offset, count)?.as_ptr() as *mut T;
        // SAFETY: same checks as `typed`; `&mut self` makes the view exclusive.
        Ok(unsafe { std::slice::from_raw_parts_mut(p, count) })
    }
}

impl Drop for PinnedRegion {
    fn drop(&mut self) {
        if let Err(e) = self.gpu.bind_to_thread() {
            tracing::warn!("freeing pinned memory: {e}");
            return;
        }
        // SAFETY: this value's own allocation, freed once.
        if let Err(e) = check("cuMemFreeHost", unsafe { sys::cuMemFreeHost(self.host.cast()) }) {
            tracing::warn!("freeing pinned memory: {e}");
        }
    }
}

/// Plain-data marker for typed views of pinned memory (no external crate needed).
pub mod plain {
    /// # Safety
    /// Every bit pattern must be a valid value and the type must contain no padding-sensitive
    /// invariants or pointers it would be unsound to forge.
    pub unsafe trait Plain: Copy + 'static {}
    // SAFETY: integers accept any bit pattern.
    unsafe impl Plain for u8 {}
    // SAFETY: as above.
    unsafe impl Plain for u32 {}
    // SAFETY: as above.
    unsafe impl Plain for u64 {}
    // SAFETY: two u32 and a u64, any bit pattern valid.
    unsafe impl Plain for tcpxd_abi::loadMeta {}
    // SAFETY: a u64 and two u32 (`repr(C)`, 16 bytes, no padding), any bit pattern valid.
    unsafe impl Plain for crate::engine::blocks::Segment {}
}
