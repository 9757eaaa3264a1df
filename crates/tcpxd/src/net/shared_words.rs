//! 64-bit words in memory shared with another process: a client's sealed memfd, mapped
//! `MAP_SHARED` (the completion board of a framed local session, src/api/local/board.rs).
//!
//! The other process writes the same pages whenever it likes, so the words are only ever
//! touched through atomic operations on raw pointers — never through references to plain
//! integers, which the compiler could assume stable — and every index is bounds-checked here:
//! whatever the other side writes, this side reads some value and writes only inside its own
//! mapping. The file cannot shrink under the mapping (the caller checks `F_SEAL_SHRINK`), so no
//! access raises SIGBUS.

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicU64, Ordering};

use super::memory::{HostRegion, Region};
use super::{NetError, NetResult};

/// A shared mapping of `len` u64 words: a [`HostRegion`] of the file, read as atomic words.
pub struct SharedWords {
    region: HostRegion,
    len: usize,
}

impl SharedWords {
    /// Maps the first `words` u64 words of the file `fd` shared, read-write, faulted in now
    /// ([`HostRegion::map_file_lazily`], [`HostRegion::fault_in_file`]). The caller has checked
    /// that the file holds them and cannot shrink.
    pub fn map(fd: BorrowedFd<'_>, words: usize) -> NetResult<SharedWords> {
        let bytes = words
            .checked_mul(8)
            .filter(|&b| b > 0)
            .ok_or_else(|| NetError::InvalidArgument(format!("{words} words cannot be mapped")))?;
        let region = HostRegion::map_file_lazily(fd, 0, bytes)?;
        region.fault_in_file()?;
        Ok(SharedWords { region, len: words })
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
        // SAFETY: `i` is within the mapping (checked above), which starts at the file's offset 0,
        // page-aligned, so the word is 8-byte aligned; the mapping lives as long as `self`.
        // AtomicU64 has u64's layout, and every access to the word from this process is atomic.
        unsafe { AtomicU64::from_ptr(self.region.as_ptr().cast::<u64>().add(i)) }
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
