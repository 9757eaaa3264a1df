//! Host copies of block chunks split across threads (issue 38 point 3): a chunk's gather (its
//! pieces of a host buffer into a staging slot, `blocks::gather_region`) and scatter (the landed
//! bytes into a host buffer's pieces, `RecvComm::scatter_landed`) run on the poller thread, one
//! memcpy after another; on a host whose lanes move 13–15 GB/s of contiguous bytes that single
//! thread bounds block transfers (~4 GB/s, issue 38). [`HostCopies::copy_all`] cuts a chunk's
//! copies into parts of about equal bytes (a piece may be cut), hands all but the first to its
//! helper threads, copies the first itself, and returns only once every part is done.
//!
//! Fork and join, not a queue the poller leaves copies in: every copy has finished when the
//! call returns, exactly as the single-threaded copy had, so nothing about a request's life
//! changes (its staging slot, landing slot or bounce pages, cancellation, a peer lost mid-way,
//! the slot zeroed after a direct receive). What the helpers take off the poller is the copy's
//! time, which is most of a block chunk's host work.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

/// A chunk's copies of fewer bytes than this run on the calling thread alone: handing parts out
/// costs a few µs a helper, a 128 KiB memcpy ~10–30 µs.
pub const MIN_SPLIT_BYTES: usize = 128 * 1024;
/// No part is smaller than this (fewer parts than helpers for a small chunk).
pub const MIN_PART_BYTES: usize = 64 * 1024;
/// `transfer.host_copy_threads` at most.
pub const MAX_HOST_COPY_THREADS: usize = 64;

/// `transfer.host_copy_threads`' default for a host of `cores` cores: a quarter of them, at most
/// 4 (16 cores: 4 helpers besides the poller; 2 cores: none, the poller copies alone).
pub fn default_threads(cores: usize) -> usize {
    (cores / 4).min(4)
}

/// One copy: `n` bytes from `from` to `to`.
#[derive(Debug, Clone, Copy)]
pub struct HostCopy {
    pub from: *const u8,
    pub to: *mut u8,
    pub n: usize,
}

/// A part of a chunk's copies handed to a helper, and the count it lowers when done.
struct Part {
    copies: Vec<HostCopy>,
    left: Arc<AtomicUsize>,
}

// SAFETY: a `Part` carries raw pointers into memory that `HostCopies::copy_all`'s caller
// guarantees readable (`from`) and writable by this copy alone (`to`) until `copy_all` returns,
// and `copy_all` returns only after every part it handed out was copied (`left` reached 0).
unsafe impl Send for Part {}

/// A helper thread's end: where parts go.
struct Helper {
    tx: mpsc::Sender<Part>,
    thread: Option<JoinHandle<()>>,
}

/// The poller's host copies and their helper threads (see the module's documentation).
pub struct HostCopies {
    helpers: Vec<Helper>,
}

impl std::fmt::Debug for HostCopies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostCopies({} helpers)", self.helpers.len())
    }
}

fn copy_part(copies: &[HostCopy]) {
    for c in copies {
        // SAFETY: see `Part` and `HostCopies::copy_all`'s contract: both ranges are valid for
        // `n` bytes and do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(c.from, c.to, c.n) };
    }
}

impl HostCopies {
    /// `threads` helper threads besides the caller (0: every copy on the calling thread). A
    /// helper that cannot be started leaves fewer (logged).
    pub fn new(threads: usize) -> HostCopies {
        let mut helpers = Vec::new();
        for i in 0..threads.min(MAX_HOST_COPY_THREADS) {
            let (tx, rx) = mpsc::channel::<Part>();
            let spawned = std::thread::Builder::new()
                .name(format!("tcpxd-copy-{i}"))
                .spawn(move || {
                    while let Ok(part) = rx.recv() {
                        copy_part(&part.copies);
                        part.left.fetch_sub(1, Ordering::Release);
                    }
                });
            match spawned {
                Ok(thread) => helpers.push(Helper {
                    tx,
                    thread: Some(thread),
                }),
                Err(e) => {
                    tracing::warn!("host copy helper {i} could not start: {e}");
                    break;
                }
            }
        }
        HostCopies { helpers }
    }

    /// Helper threads besides the caller.
    pub fn threads(&self) -> usize {
        self.helpers.len()
    }

    /// Copies every `copies[i]`, split across the helpers and this thread when they total at
    /// least [`MIN_SPLIT_BYTES`]; returns once every byte is copied.
    ///
    /// # Safety
    /// Every copy's `from` must be readable and its `to` writable for `n` bytes until this call
    /// returns, no two copies' targets may overlap each other or any source, and nothing else may
    /// write the targets meanwhile.
    pub unsafe fn copy_all(&self, copies: &[HostCopy]) {
        let total: usize = copies.iter().map(|c| c.n).sum();
        let parts = (total / MIN_PART_BYTES).min(self.helpers.len() + 1);
        if total < MIN_SPLIT_BYTES || parts < 2 {
            copy_part(copies);
            return;
        }
        let per = total.div_ceil(parts);
        let mut split: Vec<Vec<HostCopy>> = vec![Vec::new(); parts];
        let (mut k, mut room) = (0usize, per);
        for c in copies {
            let mut c = *c;
            while c.n > 0 {
                if room == 0 && k + 1 < parts {
                    k += 1;
                    room = per;
                }
                let n = if k + 1 == parts { c.n } else { c.n.min(room) };
                split[k].push(HostCopy { n, ..c });
                // SAFETY: `n <= c.n`: the rest of the same valid ranges.
                c = unsafe {
                    HostCopy {
                        from: c.from.add(n),
                        to: c.to.add(n),
                        n: c.n - n,
                    }
                };
                room = room.saturating_sub(n);
            }
        }
        let first = std::mem::take(&mut split[0]);
        let left = Arc::new(AtomicUsize::new(0));
        for (part, helper) in split.into_iter().skip(1).zip(&self.helpers) {
            left.fetch_add(1, Ordering::Relaxed);
            let part = Part {
                copies: part,
                left: left.clone(),
            };
            if let Err(mpsc::SendError(part)) = helper.tx.send(part) {
                // The helper is gone: its part is copied here.
                copy_part(&part.copies);
                left.fetch_sub(1, Ordering::Release);
            }
        }
        copy_part(&first);
        while left.load(Ordering::Acquire) != 0 {
            std::hint::spin_loop();
            std::thread::yield_now();
        }
    }
}

impl Drop for HostCopies {
    fn drop(&mut self) {
        let threads: Vec<JoinHandle<()>> = self.helpers.iter_mut().filter_map(|h| h.thread.take()).collect();
        self.helpers.clear(); // closes every channel: the helpers end
        for t in threads {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tcpxd_testkit::Rng;

    /// Random scattered copies (pieces cut across parts, tiny and large ones) land exactly as a
    /// copy one by one, with 0 to 5 helpers; nothing outside the targets is touched.
    #[test]
    fn split_copies_land_exactly_as_one_by_one() {
        let mut rng = Rng::new(38);
        let src: Vec<u8> = (0..4 << 20).map(|i| (i * 7 + i / 4096) as u8).collect();
        for helpers in 0..6 {
            let pool = HostCopies::new(helpers);
            assert_eq!(pool.threads(), helpers);
            for round in 0..20 {
                // Targets: distinct slots of 32 KiB in shuffled order, lengths 1..=32 KiB.
                let slots = 128usize;
                let mut order: Vec<usize> = (0..slots).collect();
                for i in (1..slots).rev() {
                    order.swap(i, rng.below(i as u64 + 1) as usize);
                }
                let count = 1 + rng.below(slots as u64) as usize;
                let mut dst = vec![0xEEu8; slots * 32768];
                let mut want = dst.clone();
                let mut copies = Vec::new();
                for &s in order.iter().take(count) {
                    let n = 1 + rng.below(if round % 2 == 0 { 32768 } else { 64 }) as usize;
                    let from = rng.below((src.len() - n) as u64) as usize;
                    let to = s * 32768 + rng.below((32768 - n + 1) as u64) as usize;
                    want[to..to + n].copy_from_slice(&src[from..from + n]);
                    copies.push(HostCopy {
                        from: src[from..].as_ptr(),
                        to: dst[to..].as_mut_ptr(),
                        n,
                    });
                }
                // SAFETY: sources in `src`, distinct targets in `dst`, both alive across the call.
                unsafe { pool.copy_all(&copies) };
                assert!(dst == want, "{helpers} helpers, round {round}");
            }
        }
    }

    /// One large piece is cut into parts of about equal bytes, one per thread.
    #[test]
    fn one_large_piece_is_cut_across_every_thread() {
        let src: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; 1 << 20];
        let pool = HostCopies::new(3);
        let c = HostCopy {
            from: src.as_ptr(),
            to: dst.as_mut_ptr(),
            n: src.len(),
        };
        // SAFETY: two live, distinct 1 MiB vectors.
        unsafe { pool.copy_all(&[c]) };
        assert!(dst == src);
        assert_eq!(default_threads(2), 0);
        assert_eq!(default_threads(16), 4);
        assert_eq!(default_threads(128), 4);
    }
}
