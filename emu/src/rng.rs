//! A tiny SplitMix64 generator: page shuffling, odd fragment sizes, nonces.

#[derive(Debug, Clone)]
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in `lo..=hi`.
    pub(crate) fn range_incl(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
}

/// A seed nobody chose: time, pid and a stack address, mixed.
pub(crate) fn entropy() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let local = 0u8;
    let addr = &local as *const u8 as u64;
    let mut r = SplitMix64::new(t ^ (u64::from(std::process::id()) << 32) ^ addr.rotate_left(17));
    r.next_u64()
}

/// Derive an independent stream from a seed and a salt.
pub(crate) fn derive(seed: u64, salt: u64) -> SplitMix64 {
    let mut r = SplitMix64::new(seed ^ salt.wrapping_mul(0xD6E8_FEB8_6659_FD93));
    r.next_u64();
    r
}
