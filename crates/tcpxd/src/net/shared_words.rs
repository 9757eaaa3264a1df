//! 64-bit words in memory shared with another process: a client's sealed memfd, mapped
//! `MAP_SHARED` (the completion board of a framed local session, src/api/local/board.rs).
//!
//! The other process writes the same pages whenever it likes, so the words are only ever
//! touched through atomic operations on raw pointers — never through references to plain
//! integers, which the compiler could assume stable — and every index is bounds-checked here:
//! whatever the other side writes, this side reads some value and writes only inside its own
//! mapping. The file cannot shrink under the mapping (the caller checks `F_SEAL_SHRINK`), so no
//! access raises SIGBUS.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{NetError, NetResult};

/// A shared mapping of `len` u64 words (unmapped on drop).
pub struct SharedWords {
    ptr: NonNull<u64>,
    len: usize,
}

// SAFETY: the mapping is owned by this value and only touched through atomic operations.
unsafe impl Send for SharedWords {}
// SAFETY: as above: atomic operations from any thread.
unsafe impl Sync for SharedWords {}

impl SharedWords {
    /// Maps the first `words` u64 words of the file `fd` shared, read-write, faulted in now.
    /// The caller has checked that the file holds them and cannot shrink.
    pub fn map(fd: BorrowedFd<'_>, words: usize) -> NetResult<SharedWords> {
        let bytes = words
            .checked_mul(8)
            .filter(|&b| b > 0)
            .ok_or_else(|| NetError::InvalidArgument(format!("{words} words cannot be mapped")))?;
        // SAFETY: a new shared mapping of a caller-owned descriptor with no address hint; the
        // result is checked; the mapping is unmapped once, on drop.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(NetError::InvalidArgument(format!(
                "could not map {bytes} bytes of the file: {}",
                std::io::Error::last_os_error()
            )));
        }
        let ptr = NonNull::new(ptr.cast::<u64>()).expect("mmap never returns NULL on success");
        Ok(SharedWords { ptr, len: words })
    }

    /// How many words.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i < self.len, "shared word {i} of {}", self.len);
        // SAFETY: `i` is within the mapping (checked above), which is page-aligned, so the word
        // is 8-byte aligned; the mapping lives as long as `self`. AtomicU64 has u64's layout,
        // and every access to the word from this process is atomic.
        unsafe { AtomicU64::from_ptr(self.ptr.as_ptr().add(i)) }
    }

    pub fn load(&self, i: usize, order: Ordering) -> u64 {
        self.word(i).load(order)
    }

    pub fn store(&self, i: usize, v: u64, order: Ordering) {
        self.word(i).store(v, order)
    }

    /// `compare_exchange(current, new)` on word `i`, acquiring on success.
    pub fn claim(&self, i: usize, current: u64, new: u64) -> bool {
        self.word(i)
            .compare_exchange(current, new, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    }

    pub fn fetch_add(&self, i: usize, v: u64, order: Ordering) -> u64 {
        self.word(i).fetch_add(v, order)
    }
}

impl Drop for SharedWords {
    fn drop(&mut self) {
        // SAFETY: the mapping was made in `map` with this base and length and is unmapped once.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len * 8);
        }
    }
}
