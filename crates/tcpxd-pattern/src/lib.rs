//! The one byte pattern of tcpxd: what `FillBuffer` writes for a seed, what the benchmarks, the
//! demo, the conformance suite, the emulation's tests and bench send, and what every test
//! compares against. One definition, so a checksum computed by one side matches bytes another
//! wrote (`tcpxctl buffer checksum` against a local recomputation, a test against a daemon).
//!
//! The seeded stream is position-addressed: byte `p` depends only on the seed and on `p` (byte
//! `p % 8` of the little-endian word [`splitmix64`]`(seed ^ (p / 8))`), so any range can be
//! generated on its own, in any order, in pieces of any size — a buffer filled in 1 MiB steps, a
//! GPU buffer through staging buffers, a receive checked at its offset.
//!
//! The stream is part of the API: `FillBuffer`'s `seed` and the checksums clients compute rest on
//! it, so it never changes.

/// SplitMix64's increment (2^64 / φ).
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64: the output that follows state `state` (Steele, Lea and Flood's mixer, as in
/// `java.util.SplittableRandom`). A generator keeps a state, adds `GOLDEN` per call and mixes;
/// this is that step as a pure function, so `splitmix64(s)` for distinct `s` are independent
/// words.
#[inline]
pub fn splitmix64(state: u64) -> u64 {
    let mut z = state.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A SplitMix64 generator: [`splitmix64`] over a state that advances by one increment per word.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }

    /// The next word.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        let out = splitmix64(self.0);
        self.0 = self.0.wrapping_add(GOLDEN);
        out
    }

    /// Uniform in `0..n` (multiply and shift, no modulo bias); 0 when `n` is 0.
    #[inline]
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in `lo..=hi` (`lo <= hi < u64::MAX`).
    pub fn range_incl(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
}

/// The seeded stream's bytes for positions `pos..pos + out.len()`.
#[inline]
pub fn seeded_bytes(seed: u64, pos: u64, out: &mut [u8]) {
    // One 8-byte word per aligned position group: byte p is byte (p % 8) of word p / 8.
    let mut i = 0;
    while i < out.len() {
        let p = pos + i as u64;
        let word = splitmix64(seed ^ (p >> 3)).to_le_bytes();
        let start = (p & 7) as usize;
        let take = (8 - start).min(out.len() - i);
        out[i..i + take].copy_from_slice(&word[start..start + take]);
        i += take;
    }
}

/// The seeded stream's first `len` bytes: a test's data for `seed`.
pub fn seeded_vec(seed: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    seeded_bytes(seed, 0, &mut out);
    out
}

/// What `FillBuffer` writes over a range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pattern {
    /// Every byte the same.
    Byte(u8),
    /// The seeded stream: byte `i` of the buffer depends only on the seed and on `i`.
    Seed(u64),
    /// These bytes over and over, from the start of the range filled.
    Repeat(Vec<u8>),
}

impl Pattern {
    /// The bytes for positions `pos..pos + out.len()` of a fill that starts at `origin`
    /// (`origin <= pos`; only [`Pattern::Repeat`] depends on it). An empty `Repeat` writes nothing.
    pub fn write(&self, origin: u64, pos: u64, out: &mut [u8]) {
        match self {
            Pattern::Byte(v) => out.fill(*v),
            Pattern::Seed(seed) => seeded_bytes(*seed, pos, out),
            Pattern::Repeat(rep) if rep.is_empty() => {}
            Pattern::Repeat(rep) => {
                let start = ((pos - origin) % rep.len() as u64) as usize;
                for (c, r) in out.iter_mut().zip(rep.iter().cycle().skip(start)) {
                    *c = *r;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_seeded_stream_is_fixed() {
        // FillBuffer's seed is part of the API: these bytes never change.
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF);
        assert_eq!(seeded_vec(0, 8), 0xE220_A839_7B1D_CDAFu64.to_le_bytes());
        assert_eq!(seeded_vec(7, 16)[8..], splitmix64(7 ^ 1).to_le_bytes());
    }

    #[test]
    fn the_generator_yields_the_mixer_over_successive_states() {
        let mut g = SplitMix64::new(5);
        assert_eq!(g.next_u64(), splitmix64(5));
        assert_eq!(g.next_u64(), splitmix64(5u64.wrapping_add(GOLDEN)));
        for n in [1, 2, 3, 1000, u64::MAX] {
            assert!(g.below(n) < n);
        }
        assert_eq!(g.below(0), 0);
        for _ in 0..100 {
            assert!((3..=5).contains(&g.range_incl(3, 5)));
        }
    }

    #[test]
    fn any_range_of_the_stream_stands_on_its_own() {
        let whole = seeded_vec(42, 1000);
        for (pos, len) in [(0, 1), (1, 7), (3, 8), (5, 100), (999, 1), (8, 992), (13, 0)] {
            let mut part = vec![0u8; len];
            seeded_bytes(42, pos as u64, &mut part);
            assert_eq!(part, whole[pos..pos + len], "{len} bytes at {pos}");
        }
        // Made in odd pieces, the same bytes.
        let mut pieces = vec![0u8; 1000];
        let mut at = 0;
        for n in [1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 392].iter().copied() {
            seeded_bytes(42, at as u64, &mut pieces[at..at + n]);
            at += n;
        }
        assert_eq!(at, 1000);
        assert_eq!(pieces, whole);
    }

    #[test]
    fn seeds_give_different_streams() {
        assert_ne!(seeded_vec(1, 64), seeded_vec(2, 64));
        assert!(seeded_vec(3, 0).is_empty());
    }

    #[test]
    fn fills_by_pattern() {
        let mut out = [0u8; 5];
        Pattern::Byte(9).write(0, 0, &mut out[..3]);
        assert_eq!(out, [9, 9, 9, 0, 0]);
        // A repeat starts over at the fill's origin, wherever a piece begins.
        let rep = Pattern::Repeat(vec![1, 2, 3]);
        let mut out = [0u8; 5];
        rep.write(10, 10, &mut out);
        assert_eq!(out, [1, 2, 3, 1, 2]);
        rep.write(10, 14, &mut out);
        assert_eq!(out, [2, 3, 1, 2, 3]);
        Pattern::Repeat(Vec::new()).write(0, 0, &mut out);
        assert_eq!(out, [2, 3, 1, 2, 3]);
        let mut out = [0u8; 16];
        Pattern::Seed(7).write(0, 100, &mut out);
        assert_eq!(out.to_vec(), seeded_vec(7, 116)[100..]);
    }
}
