//! Device memory that outlives the process (docs/OPERATIONS.md, "Restarts"): allocated with the
//! CUDA virtual memory management API (`cuMemCreate` requesting a POSIX fd handle, reserved,
//! mapped, read-write for its device) and exported as a file descriptor
//! (`cuMemExportToShareableHandle`). While anyone holds that fd (systemd's file-descriptor store,
//! across a restart of the daemon), the memory and its bytes live; the next process imports the
//! fd (`cuMemImportFromShareableHandle`) and maps it again.

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::sys;

use super::Gpu;
use super::error::{GpuError, GpuResult, check};
use super::memory::{Backing, DeviceRegion};

/// The allocation's properties: pinned device memory of `gpu`, shareable as a POSIX fd, and
/// usable for GPUDirect (dma-buf export for the plugin's sends) where the device supports that
/// for VMM memory.
fn properties(gpu: &Gpu) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct of integers and one pointer, for which all-zero is valid.
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = gpu.ordinal() as i32;
    let mut rdma = 0;
    // SAFETY: writes one int for a valid device; an unknown attribute is an error (then 0).
    let asked = unsafe {
        sys::cuDeviceGetAttribute(
            &mut rdma,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
            gpu.dev,
        )
    };
    if asked == sys::CUresult::CUDA_SUCCESS && rdma != 0 {
        prop.allocFlags.gpuDirectRDMACapable = 1;
    }
    prop
}

impl Gpu {
    /// The size a VMM allocation of `len` bytes takes: `len` rounded up to the device's
    /// allocation granularity (2 MiB on current GPUs).
    pub fn shareable_size(&self, len: usize) -> GpuResult<usize> {
        self.bind_to_thread()?;
        let prop = properties(self);
        let mut gran = 0usize;
        // SAFETY: writes one size; `prop` is a valid property struct.
        check("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut gran,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        let gran = gran.max(1);
        len.max(1)
            .checked_next_multiple_of(gran)
            .ok_or_else(|| GpuError::InvalidArgument(format!("device region of {len} bytes is too large")))
    }

    /// Allocates `len` zeroed bytes that another process can map again from the returned fd,
    /// after this one ended (the fd keeps the memory).
    pub fn alloc_shareable(self: &Arc<Self>, len: usize) -> GpuResult<(DeviceRegion, OwnedFd)> {
        let size = self.shareable_size(len)?;
        let prop = properties(self);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: writes one handle; released by the region (or below on failure).
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut handle, size, &prop, 0)
        })?;
        let mut raw: i32 = -1;
        // SAFETY: writes one int (the fd this process then owns) for a live handle.
        let exported = check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut raw as *mut i32).cast(),
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        });
        if let Err(e) = exported {
            // SAFETY: the handle made above, released once.
            unsafe { sys::cuMemRelease(handle) };
            return Err(e);
        }
        // SAFETY: the driver handed this process a new fd.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let region = self.map_handle(handle, size, len)?;
        // SAFETY: the range lies inside the mapping just made.
        check("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(region.ptr, 0, len) })?;
        // SAFETY: the NULL stream is always valid in the current context (the memset above runs
        // on it; the region's users' streams do not wait for it).
        check("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(std::ptr::null_mut())
        })?;
        Ok((region, fd))
    }

    /// Maps the memory behind `fd` (from [`Gpu::alloc_shareable`], maybe of an earlier process):
    /// its first `len` bytes, bytes as they were. The fd stays the caller's.
    pub fn import_shareable(self: &Arc<Self>, fd: BorrowedFd<'_>, len: usize) -> GpuResult<DeviceRegion> {
        let size = self.shareable_size(len)?;
        let have = rustix::fs::fstat(fd).map(|s| s.st_size as u64).ok();
        // A file's size is checked where the fd is a file (the stand-in's memfd); the driver's own
        // fd answers its own size or none, and cuMemMap refuses a range past the allocation.
        if let Some(have) = have.filter(|&h| h > 0)
            && have < size as u64
        {
            return Err(GpuError::InvalidArgument(format!(
                "the kept allocation holds {have} bytes, {size} are needed"
            )));
        }
        self.bind_to_thread()?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: the driver reads the fd (passed by value in the pointer, as the API wants) and
        // takes its own reference; writes one handle.
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        self.map_handle(handle, size, len)
    }

    /// Reserves `size` bytes of address space, maps `handle` there read-write for this device;
    /// the region's first `len` bytes. On failure the handle is released.
    fn map_handle(self: &Arc<Self>, handle: u64, size: usize, len: usize) -> GpuResult<DeviceRegion> {
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: writes one address; freed by the region (or below).
        if let Err(e) = check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut base, size, 0, 0, 0)
        }) {
            // SAFETY: the caller's handle, released once.
            unsafe { sys::cuMemRelease(handle) };
            return Err(e);
        }
        // From here the region owns all three: dropping it unmaps, releases and unreserves.
        let region = DeviceRegion {
            gpu: self.clone(),
            base,
            ptr: base,
            len,
            backing: Backing::Vmm {
                handle,
                reserved: size,
            },
            shares: None,
        };
        // SAFETY: maps the whole allocation over the whole reservation made above.
        check("cuMemMap", unsafe { sys::cuMemMap(base, size, 0, handle, 0) })?;
        let access = sys::CUmemAccessDesc {
            location: properties(self).location,
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: one access descriptor for the range mapped above.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(base, size, &access, 1)
        })?;
        Ok(region)
    }
}

/// Unmaps, releases and unreserves a VMM region (its drop): the first error's call and code.
/// Unmapping a range that was never mapped fails harmlessly (a region dropped half-made).
pub(super) fn release(base: u64, reserved: usize, handle: u64) -> (&'static str, sys::CUresult) {
    // SAFETY: the region's own mapping, reservation and handle, each given back once.
    let unmap = unsafe { sys::cuMemUnmap(base, reserved) };
    // SAFETY: as above.
    let rel = unsafe { sys::cuMemRelease(handle) };
    // SAFETY: as above.
    let free = unsafe { sys::cuMemAddressFree(base, reserved) };
    let ok = sys::CUresult::CUDA_SUCCESS;
    match (rel, free, unmap) {
        (r, _, _) if r != ok => ("cuMemRelease", r),
        (_, f, _) if f != ok => ("cuMemAddressFree", f),
        _ => ("cuMemUnmap", ok),
    }
}
