//! Randomness: the SplitMix64 generator of the test byte pattern (`tcpxd-pattern`) for page
//! shuffling and odd fragment sizes, seeds and nonces nobody chose, independent streams.

pub(crate) use tcpxd_pattern::SplitMix64;

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
