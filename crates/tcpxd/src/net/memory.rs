//! Memory that can be registered with the plugin. A registration keeps its region alive, and so
//! does every request posted on it, so the plugin never touches freed memory.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;

use super::abi;
use super::error::{NetError, NetResult};
use crate::gpu::{DeviceRegion, PinnedRegion};

pub use super::abi::REGION_ALIGN;

/// Where a region's bytes live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemType {
    Host,
    Cuda,
}

impl MemType {
    /// The `regMr` type constant.
    pub fn nccl_ptr_type(self) -> i32 {
        match self {
            MemType::Host => abi::NCCL_PTR_HOST,
            MemType::Cuda => abi::NCCL_PTR_CUDA,
        }
    }
}

/// A contiguous range of memory the plugin may read or write while requests are in flight.
pub trait Region: Send + Sync + 'static {
    fn as_ptr(&self) -> *mut u8;
    fn len(&self) -> usize;
    fn mem_type(&self) -> MemType;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

// The GPU's regions, as the plugin registers them: device memory as CUDA memory, pinned (mapped)
// host memory as host memory.
impl Region for DeviceRegion {
    fn as_ptr(&self) -> *mut u8 {
        self.device_ptr() as *mut u8
    }
    fn len(&self) -> usize {
        DeviceRegion::len(self)
    }
    fn mem_type(&self) -> MemType {
        MemType::Cuda
    }
}

impl Region for PinnedRegion {
    fn as_ptr(&self) -> *mut u8 {
        PinnedRegion::as_ptr(self)
    }
    fn len(&self) -> usize {
        PinnedRegion::len(self)
    }
    fn mem_type(&self) -> MemType {
        MemType::Host
    }
}

/// Host memory: page-aligned and zero-initialised (an anonymous mapping), or a range of a
/// client's file mapped shared ([`HostRegion::map_file_lazily`]).
///
/// The plugin writes into it from its own threads while a receive is in flight, so its bytes are
/// only ever accessed through explicit copies ([`HostRegion::read`], [`HostRegion::write`]), never
/// through references that could alias such a write.
pub struct HostRegion {
    ptr: NonNull<u8>,
    len: usize,
    /// The mapping holding the region (unmapped on drop): `ptr` itself for anonymous memory; the
    /// page holding `ptr` for a mapped file (`HostRegion::map_file_lazily`).
    map: NonNull<u8>,
    map_len: usize,
}

// SAFETY: the region is plain memory owned by this value; all access goes through raw copies.
unsafe impl Send for HostRegion {}
// SAFETY: as above; concurrent copies into disjoint ranges are the caller's (and the engine's) rule.
unsafe impl Sync for HostRegion {}

impl HostRegion {
    /// Maps `len` bytes of anonymous memory: page-aligned and zero-filled lazily by the kernel,
    /// so a large buffer costs RAM only where it is written.
    pub fn new(len: usize) -> NetResult<HostRegion> {
        Self::map(len)
    }

    /// As [`HostRegion::new`], with every page faulted in now (`populate`): what the daemon
    /// registers, so that no transfer pays a page fault per 4 KiB on first touch.
    pub fn populated(len: usize) -> NetResult<HostRegion> {
        let region = Self::map(len)?;
        // SAFETY: the range is exactly the fresh private mapping just made, which nothing else
        // sees yet.
        unsafe { populate(region.map, region.map_len, Touch::Zero) }.map_err(|e| {
            NetError::InvalidArgument(format!("could not fault in {len} bytes of host memory: {e}"))
        })?;
        Ok(region)
    }

    fn map(len: usize) -> NetResult<HostRegion> {
        let map_len = Self::map_len(len)?;
        // SAFETY: an anonymous private mapping with no address hint; the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(NetError::InvalidArgument(format!(
                "could not map {len} bytes of host memory: {}",
                std::io::Error::last_os_error()
            )));
        }
        let ptr = NonNull::new(ptr.cast::<u8>()).expect("mmap never returns NULL on success");
        Ok(HostRegion {
            ptr,
            len,
            map: ptr,
            map_len,
        })
    }

    /// Maps `len` bytes of the file `fd`, starting `offset` bytes in (any alignment), shared
    /// (`MAP_SHARED`: the pages every other mapping of the file sees, no copy), not yet faulted
    /// in. The mapping starts at the page holding `offset`. The caller has checked that the file
    /// is a regular file open for reading and writing that holds the range, and that it cannot
    /// shrink (or accepted that it may: touching pages past a file's end raises SIGBUS).
    pub fn map_file_lazily(fd: BorrowedFd<'_>, offset: u64, len: usize) -> NetResult<HostRegion> {
        let bad = |why: String| NetError::InvalidArgument(why);
        let skip = offset % page_size() as u64;
        let map_len = usize::try_from(skip)
            .ok()
            .and_then(|skip| skip.checked_add(len.max(1)))
            .ok_or_else(|| bad(format!("a file range of {len} bytes is too large to map")))?;
        let file_offset = libc::off_t::try_from(offset - skip)
            .map_err(|_| bad(format!("file offset {offset} is too large to map")))?;
        // SAFETY: a new shared mapping of a caller-owned descriptor with no address hint; the
        // result is checked; the mapping is unmapped once, on drop.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                file_offset,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(bad(format!(
                "could not map {len} bytes of the file at offset {offset}: {}",
                std::io::Error::last_os_error()
            )));
        }
        let map = NonNull::new(ptr.cast::<u8>()).expect("mmap never returns NULL on success");
        // SAFETY: `skip < page <= map_len`: the pointer stays inside the mapping.
        let ptr = unsafe { map.add(skip as usize) };
        Ok(HostRegion {
            ptr,
            len,
            map,
            map_len,
        })
    }

    /// Faults in every page of a region from [`HostRegion::map_file_lazily`] (what the client
    /// wrote stays as it is).
    pub fn fault_in_file(&self) -> NetResult<()> {
        // SAFETY: the range is exactly this region's shared mapping; reads only (the client may
        // be writing the file). The caller checked that the file holds the range; should it not,
        // `MADV_POPULATE_READ` answers EFAULT here rather than a SIGBUS later (only the fallback
        // for kernels before 5.14, which touches each page, relies on the caller's check).
        unsafe { populate(self.map, self.map_len, Touch::Read) }.map_err(|e| {
            let past_end = if e.raw_os_error() == Some(libc::EFAULT) {
                " (the range runs past the file's end)"
            } else {
                ""
            };
            NetError::InvalidArgument(format!(
                "could not fault in {} bytes of the file: {e}{past_end}",
                self.len
            ))
        })
    }

    /// Pages of the mapping resident in RAM now, and pages in all (`mincore`).
    pub fn resident_pages(&self) -> NetResult<(usize, usize)> {
        let map_len = self.map_len;
        let pages = map_len.div_ceil(page_size());
        let mut vec = vec![0u8; pages];
        // SAFETY: the range is exactly this mapping (page-aligned base, its mapped length) and
        // `vec` holds one byte per page of it, as mincore requires.
        let rc = unsafe { libc::mincore(self.map.as_ptr().cast(), map_len, vec.as_mut_ptr()) };
        if rc != 0 {
            return Err(NetError::InvalidArgument(format!(
                "mincore: {}",
                std::io::Error::last_os_error()
            )));
        }
        Ok((vec.iter().filter(|&&b| b & 1 != 0).count(), pages))
    }

    fn map_len(len: usize) -> NetResult<usize> {
        len.max(1)
            .checked_next_multiple_of(REGION_ALIGN)
            .ok_or_else(|| NetError::InvalidArgument(format!("host region of {len} bytes is too large")))
    }

    pub(super) fn check(&self, offset: usize, len: usize) -> NetResult<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(NetError::InvalidArgument(format!(
                "range {offset}+{len} is outside the {}-byte region",
                self.len
            ))),
        }
    }

    /// Copies `dst.len()` bytes starting at `offset` out of the region.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> NetResult<()> {
        self.check(offset, dst.len())?;
        // SAFETY: the range was bounds-checked; `dst` is a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` into the region at `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> NetResult<()> {
        self.check(offset, src.len())?;
        // SAFETY: the range was bounds-checked; `src` is a distinct Rust buffer.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.as_ptr().add(offset), src.len()) };
        Ok(())
    }

    /// Copies `len` bytes at `src_off` of this region to `dst_off` of `dst` (the same region
    /// too: overlapping ranges are copied as by `memmove`).
    pub fn copy_to(&self, src_off: usize, dst: &HostRegion, dst_off: usize, len: usize) -> NetResult<()> {
        self.check(src_off, len)?;
        dst.check(dst_off, len)?;
        // SAFETY: both ranges were bounds-checked against live mappings; `ptr::copy` allows
        // them to overlap (one region copied within itself).
        unsafe { std::ptr::copy(self.ptr.as_ptr().add(src_off), dst.ptr.as_ptr().add(dst_off), len) };
        Ok(())
    }

    /// Reads `len` bytes at `offset` into a new vector.
    pub fn to_vec(&self, offset: usize, len: usize) -> NetResult<Vec<u8>> {
        let mut v = vec![0u8; len];
        self.read(offset, &mut v)?;
        Ok(v)
    }
}

impl Region for HostRegion {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
    fn mem_type(&self) -> MemType {
        MemType::Host
    }
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        // SAFETY: the mapping was created in `map` or `map_file_lazily` with this base and
        // length and is unmapped once.
        unsafe { libc::munmap(self.map.as_ptr().cast(), self.map_len) };
    }
}

/// A window of another region: what `regMr` registers when a buffer is larger than its `int`
/// size allows (2 GiB − 1 bytes). Keeps the parent alive.
pub struct RegionWindow {
    parent: std::sync::Arc<dyn Region>,
    offset: usize,
    len: usize,
}

impl RegionWindow {
    pub fn new(parent: std::sync::Arc<dyn Region>, offset: usize, len: usize) -> NetResult<RegionWindow> {
        match offset.checked_add(len) {
            Some(end) if end <= parent.len() => Ok(RegionWindow { parent, offset, len }),
            _ => Err(NetError::InvalidArgument(format!(
                "window {offset}+{len} is outside the {}-byte region",
                parent.len()
            ))),
        }
    }
}

impl Region for RegionWindow {
    fn as_ptr(&self) -> *mut u8 {
        // SAFETY: `offset + len <= parent.len()` was checked at construction.
        unsafe { self.parent.as_ptr().add(self.offset) }
    }
    fn len(&self) -> usize {
        self.len
    }
    fn mem_type(&self) -> MemType {
        self.parent.mem_type()
    }
}

/// Copies `len` bytes from `src` to `dst` if every source byte is readable by this process,
/// without risking a fault: device memory and unmapped addresses return `false`.
pub(super) fn probe_copy(src: *const u8, dst: &mut [u8]) -> bool {
    if src.is_null() {
        return false;
    }
    let local = libc::iovec {
        iov_base: dst.as_mut_ptr().cast(),
        iov_len: dst.len(),
    };
    let remote = libc::iovec {
        iov_base: src as *mut libc::c_void,
        iov_len: dst.len(),
    };
    // SAFETY: process_vm_readv on our own pid copies through the kernel, which reports EFAULT for
    // addresses the CPU cannot read instead of faulting; `local` is a valid Rust buffer.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    n == dst.len() as isize
}

/// The system's page size.
fn page_size() -> usize {
    rustix::param::page_size()
}

/// How [`populate`] faults pages in.
#[derive(Clone, Copy)]
enum Touch {
    /// Write a zero: only for a fresh private anonymous mapping (already zero, seen by no one).
    Zero,
    /// Read a byte: for a shared file mapping whose bytes belong to the client.
    Read,
}

/// The most one `madvise` populates: the kernel holds the process's mmap lock (read) for the
/// whole call, and every other thread's `mmap`/`munmap` (allocator, thread stacks, another
/// registration) waits on it. `MAP_POPULATE` held it for the whole region: 2.6 s for 3 GiB on
/// CI's 2-core machine, long enough to starve the daemon's heartbeats; in 8 MiB steps the longest
/// wait seen was 40 ms, and populating was no slower.
const POPULATE_STEP: usize = 8 << 20;

/// Faults in every page of `map..map + len` now, a step at a time, so that no transfer pays a
/// fault later: `MADV_POPULATE_WRITE` for fresh anonymous memory, `MADV_POPULATE_READ` for a
/// client's shared file (what `MAP_POPULATE` did for each; a shared page is not dirtied), falling
/// back to touching each page on kernels before 5.14.
///
/// # Safety
/// `map..map + len` is one live mapping of the caller's, readable and writable, and for
/// [`Touch::Zero`] a fresh private anonymous one no other thread uses yet.
unsafe fn populate(map: NonNull<u8>, len: usize, touch: Touch) -> std::io::Result<()> {
    let advice = match touch {
        Touch::Zero => libc::MADV_POPULATE_WRITE,
        Touch::Read => libc::MADV_POPULATE_READ,
    };
    let mut done = 0;
    while done < len {
        let step = POPULATE_STEP.min(len - done);
        // SAFETY: `done + step <= len`: the range lies inside the caller's mapping.
        let at = unsafe { map.as_ptr().add(done) };
        // SAFETY: madvise on a range of the caller's mapping; it only faults pages in.
        let rc = unsafe { libc::madvise(at.cast(), step, advice) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EINVAL) {
                return Err(err);
            }
            // SAFETY: as this function's contract; the touch goes page by page inside the range.
            unsafe { touch_pages(at, len - done, touch) };
            return Ok(());
        }
        done += step;
    }
    Ok(())
}

/// The fallback of [`populate`]: one volatile access per page.
///
/// # Safety
/// As [`populate`]'s, for `at..at + len`.
unsafe fn touch_pages(at: *mut u8, len: usize, touch: Touch) {
    for off in (0..len).step_by(page_size()) {
        // SAFETY: `off < len`: inside the caller's mapping; a zero written only where the
        // contract says the memory is fresh, private and already zero.
        unsafe {
            let p = at.add(off);
            match touch {
                Touch::Zero => std::ptr::write_volatile(p, 0),
                Touch::Read => {
                    std::ptr::read_volatile(p);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::fs::FileExt;

    #[test]
    fn host_region_is_page_aligned_zeroed_and_bounds_checked() {
        let r = HostRegion::new(10_000).unwrap();
        assert_eq!(r.as_ptr() as usize % REGION_ALIGN, 0);
        assert_eq!(r.to_vec(0, 10_000).unwrap(), vec![0u8; 10_000]);
        r.write(9_990, &[7u8; 10]).unwrap();
        assert_eq!(r.to_vec(9_990, 10).unwrap(), vec![7u8; 10]);
        assert!(r.write(9_991, &[7u8; 10]).is_err());
        assert!(r.read(usize::MAX, &mut [0u8; 2]).is_err());
    }

    #[test]
    fn populated_regions_are_resident_lazy_ones_are_not() {
        let len = 8 << 20;
        let lazy = HostRegion::new(len).unwrap();
        let (resident, pages) = lazy.resident_pages().unwrap();
        assert_eq!(pages, len / 4096);
        assert!(
            resident < pages / 2,
            "{resident} of {pages} pages resident before any write"
        );
        let ready = HostRegion::populated(len).unwrap();
        assert_eq!(ready.resident_pages().unwrap(), (pages, pages));
        assert_eq!(ready.to_vec(len - 10, 10).unwrap(), vec![0u8; 10]);
    }

    #[test]
    fn regions_past_a_step_are_populated_whole_and_old_kernels_touch_each_page() {
        // Three steps and a part: every page resident, and still zero.
        let len = 3 * POPULATE_STEP + 5 * 4096 + 1;
        let r = HostRegion::populated(len).unwrap();
        let (resident, pages) = r.resident_pages().unwrap();
        assert_eq!(resident, pages);
        assert_eq!(r.to_vec(len - 4097, 4097).unwrap(), vec![0u8; 4097]);
        // The fallback for kernels without MADV_POPULATE_*: one touch a page.
        let lazy = HostRegion::new(len).unwrap();
        // SAFETY: `lazy` is a fresh private anonymous mapping of `map_len` bytes used by no one.
        unsafe { touch_pages(lazy.map.as_ptr(), lazy.map_len, Touch::Zero) };
        assert_eq!(lazy.resident_pages().unwrap(), (pages, pages));
        assert_eq!(lazy.to_vec(0, 4096).unwrap(), vec![0u8; 4096]);
    }

    #[test]
    fn a_file_range_past_the_files_end_is_an_error_not_a_sigbus() {
        use rustix::fs::{MemfdFlags, ftruncate, memfd_create};
        let fd = memfd_create("tcpxd-populate", MemfdFlags::CLOEXEC).unwrap();
        ftruncate(&fd, 4096).unwrap();
        std::fs::File::from(fd.try_clone().unwrap())
            .write_all_at(b"kept", 100)
            .unwrap();
        let r = HostRegion::map_file_lazily(fd.as_fd(), 0, 4096).unwrap();
        r.fault_in_file().unwrap();
        assert_eq!(r.resident_pages().unwrap(), (1, 1));
        // Populating read it in without changing it.
        assert_eq!(r.to_vec(100, 4).unwrap(), b"kept");
        let err = HostRegion::map_file_lazily(fd.as_fd(), 0, 3 * 4096)
            .unwrap()
            .fault_in_file()
            .expect_err("a range past the end is refused");
        assert!(err.to_string().contains("past the file's end"), "{err}");
    }

    #[test]
    fn windows_stay_inside_their_region() {
        let r: std::sync::Arc<dyn Region> = std::sync::Arc::new(HostRegion::new(8192).unwrap());
        let w = RegionWindow::new(r.clone(), 4096, 4096).unwrap();
        assert_eq!(w.as_ptr() as usize, r.as_ptr() as usize + 4096);
        assert_eq!(w.len(), 4096);
        assert!(RegionWindow::new(r.clone(), 4097, 4096).is_err());
        assert!(RegionWindow::new(r, usize::MAX, 2).is_err());
    }

    #[test]
    fn probe_copy_refuses_unreadable_addresses() {
        let src = [1u8, 2, 3, 4];
        let mut dst = [0u8; 4];
        assert!(probe_copy(src.as_ptr(), &mut dst));
        assert_eq!(dst, src);
        assert!(!probe_copy(std::ptr::null(), &mut dst));
        assert!(!probe_copy(0x10 as *const u8, &mut dst));
    }
}
