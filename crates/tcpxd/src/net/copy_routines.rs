//! How a host copy helper copies a chunk's pieces (`transfer.host_copy_routine`, issue 38 point
//! 3): a block chunk is 32 pieces of 16 KiB at random addresses of a large buffer, which a plain
//! `memcpy` per piece moved at ~6 GB/s a helper on the 16-core host (session 22), against 11–15
//! GB/s for one contiguous copy. The hardware's stream prefetchers stop at every 4 KiB page and
//! start over on every piece; a scatter's destinations are read by nobody soon but are read for
//! ownership first.
//!
//! - [`CopyRoutine::Plain`]: `copy_nonoverlapping` per piece.
//! - [`CopyRoutine::Prefetch`]: the same, each piece whole (glibc's `memcpy` of 16 KiB uses the
//!   CPU's fast string copy, which writes whole lines without reading them first: copying in
//!   1 KiB steps with the targets prefetched for writing was 2–3× slower on the build VM), with
//!   the next piece's first [`AHEAD`] bytes of source prefetched before it.
//! - [`CopyRoutine::Stream`]: as `Prefetch`, and where the job's targets are cold (a scatter
//!   into the client's buffer, not a staging slot the plugin reads next) the target is written
//!   with non-temporal stores (no read for ownership, no cache filled with bytes nobody reads),
//!   followed by a store fence before the job is reported done.
//! - [`CopyRoutine::StreamAll`] (session 24): as `Stream`, and every other store of a helper
//!   too: a gather's staging slot and the zeroing of a direct receive's landing slot. Those
//!   slots are read or written next by the plugin's socket threads on other cores; written
//!   normally they sit modified in the helper's cache, and each line the socket thread then
//!   reads (a send) or overwrites (the next receive) is fetched from that cache, core to core,
//!   instead of streamed from memory.
//!
//! Elsewhere than x86-64, `Prefetch`, `Stream` and `StreamAll` copy as `Plain`.

use super::host_copies::HostCopy;

/// How a helper copies a job's pieces (`transfer.host_copy_routine`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CopyRoutine {
    #[default]
    Plain,
    Prefetch,
    Stream,
    StreamAll,
}

impl CopyRoutine {
    /// Parses a setting's value, the error naming `what` and the values allowed.
    pub fn parse(what: &str, v: &str) -> Result<CopyRoutine, String> {
        match v {
            "plain" => Ok(CopyRoutine::Plain),
            "prefetch" => Ok(CopyRoutine::Prefetch),
            "stream" => Ok(CopyRoutine::Stream),
            "stream-all" => Ok(CopyRoutine::StreamAll),
            _ => Err(format!(
                "{what}: {v:?} (plain, prefetch, stream or stream-all allowed)"
            )),
        }
    }

    /// The setting's word.
    pub fn name(self) -> &'static str {
        match self {
            CopyRoutine::Plain => "plain",
            CopyRoutine::Prefetch => "prefetch",
            CopyRoutine::Stream => "stream",
            CopyRoutine::StreamAll => "stream-all",
        }
    }
}

/// How much of the next piece's source is prefetched before a piece is copied (the next
/// piece's first lines, where a stream prefetcher would start over).
pub const AHEAD: usize = 4096;
const LINE: usize = 64;

/// Copies every piece with `routine`; with `zero_sources`, each piece's source is zeroed right
/// after it is copied (a direct receive's landed bytes); with `cold_targets` (a scatter into a
/// buffer) `Stream` writes the targets non-temporally, `StreamAll` every target and the zeroes,
/// and the stores are fenced before this returns.
///
/// # Safety
/// Every copy's `from` readable and `to` writable for `n` bytes, targets overlapping no other
/// target or source, nothing else writing them meanwhile; with `zero_sources`, every source
/// writable by the caller alone and read by this copy only.
pub unsafe fn copy_list(copies: &[HostCopy], routine: CopyRoutine, zero_sources: bool, cold_targets: bool) {
    let stream = match routine {
        CopyRoutine::Stream => cold_targets,
        CopyRoutine::StreamAll => true,
        CopyRoutine::Plain | CopyRoutine::Prefetch => false,
    };
    let nt_zero = routine == CopyRoutine::StreamAll && zero_sources;
    for (k, c) in copies.iter().enumerate() {
        if routine != CopyRoutine::Plain
            && let Some(next) = copies.get(k + 1)
        {
            // The next piece's first lines, while this one is copied.
            let mut off = 0;
            while off < next.n.min(AHEAD) {
                prefetch_read(next.from.wrapping_add(off));
                off += LINE;
            }
        }
        if stream {
            // SAFETY: the caller's contract.
            unsafe { copy_nt(c.from, c.to, c.n) };
        } else {
            // A whole piece at once: `memcpy` of 16 KiB uses the CPU's fast string copy.
            // SAFETY: the caller's contract.
            unsafe { std::ptr::copy_nonoverlapping(c.from, c.to, c.n) };
        }
        if nt_zero {
            // SAFETY: the caller's contract: the source is the caller's to write.
            unsafe { zero_nt(c.from.cast_mut(), c.n) };
        } else if zero_sources {
            // SAFETY: the caller's contract: the source is the caller's to write.
            unsafe { std::ptr::write_bytes(c.from.cast_mut(), 0, c.n) };
        }
    }
    if stream || nt_zero {
        store_fence();
    }
}

/// Zeroes `n` bytes at `at` as `routine` writes: non-temporally, fenced, for `StreamAll`.
///
/// # Safety
/// `n` bytes at `at` writable by the caller alone.
pub unsafe fn zero(at: *mut u8, n: usize, routine: CopyRoutine) {
    if routine == CopyRoutine::StreamAll {
        // SAFETY: the caller's contract.
        unsafe { zero_nt(at, n) };
        store_fence();
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::write_bytes(at, 0, n) };
    }
}

/// `n` zero bytes at `to`, its aligned 16-byte words written non-temporally (not fenced).
///
/// # Safety
/// As `write_bytes`.
#[cfg(target_arch = "x86_64")]
unsafe fn zero_nt(to: *mut u8, n: usize) {
    use std::arch::x86_64::{_mm_setzero_si128, _mm_stream_si128};
    let head = to.align_offset(16).min(n);
    // SAFETY: the caller's contract, for the first `head` bytes.
    unsafe { std::ptr::write_bytes(to, 0, head) };
    let mut i = head;
    while i + 16 <= n {
        // SAFETY: `i + 16 <= n`: inside the range; `to + i` is 16-byte aligned (`head`); SSE2
        // is part of x86-64.
        unsafe { _mm_stream_si128(to.add(i).cast(), _mm_setzero_si128()) };
        i += 16;
    }
    // SAFETY: the caller's contract, for the last `n - i` bytes.
    unsafe { std::ptr::write_bytes(to.add(i), 0, n - i) };
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn zero_nt(to: *mut u8, n: usize) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::write_bytes(to, 0, n) };
}

#[cfg(target_arch = "x86_64")]
fn prefetch_read(p: *const u8) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    // SAFETY: a prefetch is a hint: it never faults nor changes memory, whatever the address.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) };
}

#[cfg(not(target_arch = "x86_64"))]
fn prefetch_read(_: *const u8) {}

/// Makes the non-temporal stores so far visible before anything stored after (the helper's
/// "done" count, a Release store, does not order them on x86).
#[cfg(target_arch = "x86_64")]
fn store_fence() {
    // SAFETY: a fence has no operands and no precondition.
    unsafe { std::arch::x86_64::_mm_sfence() };
}

#[cfg(not(target_arch = "x86_64"))]
fn store_fence() {}

/// `n` bytes from `from` to `to`, the target's aligned 16-byte words written non-temporally.
///
/// # Safety
/// As `copy_nonoverlapping`.
#[cfg(target_arch = "x86_64")]
unsafe fn copy_nt(from: *const u8, to: *mut u8, n: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
    let head = to.align_offset(16).min(n);
    // SAFETY: the caller's contract, for the first `head` bytes.
    unsafe { std::ptr::copy_nonoverlapping(from, to, head) };
    let mut i = head;
    while i + 64 <= n {
        // SAFETY: `i + 64 <= n`: inside both ranges; `to + i` is 16-byte aligned (`head`),
        // loads are unaligned ones; SSE2 is part of x86-64.
        unsafe {
            let s = from.add(i).cast::<__m128i>();
            let d = to.add(i).cast::<__m128i>();
            let (a, b, c, e) = (
                _mm_loadu_si128(s),
                _mm_loadu_si128(s.add(1)),
                _mm_loadu_si128(s.add(2)),
                _mm_loadu_si128(s.add(3)),
            );
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
        i += 64;
    }
    while i + 16 <= n {
        // SAFETY: as above, one word.
        unsafe { _mm_stream_si128(to.add(i).cast(), _mm_loadu_si128(from.add(i).cast())) };
        i += 16;
    }
    // SAFETY: the caller's contract, for the last `n - i` bytes.
    unsafe { std::ptr::copy_nonoverlapping(from.add(i), to.add(i), n - i) };
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn copy_nt(from: *const u8, to: *mut u8, n: usize) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(from, to, n) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use tcpxd_testkit::Rng;

    /// Every routine, with and without zeroing the sources, with cold targets or not, lands the
    /// bytes exactly as one copy per piece: pieces of 1 byte to 40 KiB at odd offsets (unaligned
    /// heads and tails for the non-temporal words), nothing outside the targets touched.
    #[test]
    fn every_routine_lands_exactly_as_plain_copies() {
        let mut rng = Rng::new(23);
        for routine in [
            CopyRoutine::Plain,
            CopyRoutine::Prefetch,
            CopyRoutine::Stream,
            CopyRoutine::StreamAll,
        ] {
            for (zero, cold) in [(false, false), (false, true), (true, false), (true, true)] {
                let slot_len = 40 * 1024 + 64;
                let slots = 24usize;
                let orig: Vec<u8> = (0..slots * slot_len).map(|i| (i * 31 + i / 251) as u8).collect();
                let mut src = orig.clone();
                let mut dst = vec![0xEEu8; slots * slot_len];
                let mut want = dst.clone();
                let mut copies = Vec::new();
                let mut order: Vec<usize> = (0..slots).collect();
                for i in (1..slots).rev() {
                    order.swap(i, rng.below(i as u64 + 1) as usize);
                }
                let mut zeroed = Vec::new();
                let (sp, dp) = (src.as_mut_ptr(), dst.as_mut_ptr());
                for (k, &s) in order.iter().enumerate() {
                    let n = 1 + rng.below(if k % 3 == 0 { 63 } else { 40 * 1024 }) as usize;
                    let from = k * slot_len + rng.below(64) as usize;
                    let to = s * slot_len + rng.below((slot_len - n + 1) as u64) as usize;
                    want[to..to + n].copy_from_slice(&orig[from..from + n]);
                    zeroed.push(from..from + n);
                    copies.push(HostCopy {
                        from: sp.wrapping_add(from).cast_const(),
                        to: dp.wrapping_add(to),
                        n,
                    });
                }
                // SAFETY: sources in `src`, distinct targets in `dst` (one piece per slot),
                // both alive across the call; each source is read by one copy only.
                unsafe { copy_list(&copies, routine, zero, cold) };
                assert!(dst == want, "{routine:?} zero {zero} cold {cold}");
                let mut src_want = orig.clone();
                if zero {
                    for r in zeroed {
                        src_want[r].fill(0);
                    }
                }
                assert!(src == src_want, "{routine:?} zero {zero}: the sources");
                src.fill(0);
            }
        }
    }

    #[test]
    fn routine_words_parse_and_others_are_refused() {
        for r in [
            CopyRoutine::Plain,
            CopyRoutine::Prefetch,
            CopyRoutine::Stream,
            CopyRoutine::StreamAll,
        ] {
            assert_eq!(CopyRoutine::parse("x", r.name()), Ok(r));
        }
        let e = CopyRoutine::parse("transfer.host_copy_routine", "fast").unwrap_err();
        assert!(
            e.contains("transfer.host_copy_routine") && e.contains("plain, prefetch, stream or stream-all"),
            "{e}"
        );
    }

    /// `zero` clears exactly its range, whatever its alignment and length, with every routine.
    #[test]
    fn zeroing_clears_exactly_its_range() {
        for routine in [CopyRoutine::Plain, CopyRoutine::StreamAll] {
            for (at, n) in [
                (0, 0),
                (3, 1),
                (5, 15),
                (16, 16),
                (7, 100),
                (1, 4096 + 33),
                (0, 65536),
            ] {
                let mut buf = vec![0xA5u8; 70_000];
                // SAFETY: `at + n` lies inside `buf`, which nothing else touches.
                unsafe { zero(buf.as_mut_ptr().add(at), n, routine) };
                assert!(
                    buf[..at].iter().all(|&b| b == 0xA5),
                    "{routine:?} {at}+{n}: before"
                );
                assert!(
                    buf[at..at + n].iter().all(|&b| b == 0),
                    "{routine:?} {at}+{n}: the range"
                );
                assert!(
                    buf[at + n..].iter().all(|&b| b == 0xA5),
                    "{routine:?} {at}+{n}: after"
                );
            }
        }
    }
}
