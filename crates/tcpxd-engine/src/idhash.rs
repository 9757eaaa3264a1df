//! A fast hash for the maps keyed by ids this daemon hands out itself (its transfers, its
//! offers, its buffers): the multiply-and-rotate hash of rustc's `FxHasher`, in place of std's
//! SipHash-1-3, which is built to resist keys an attacker picks. Ids this node assigns are not
//! picked by anyone else, so that resistance buys nothing there; a busy poller hashed such ids
//! ~25 times a transfer, ~1 µs of its ~23 at 16 in flight on one H200 (docs/BENCHMARKS.md,
//! session 33, pollcpu). Maps keyed by what a peer sends (its offer ids) keep std's hasher.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// `FxHasher`'s constant (rustc-hash 1.x, 64-bit).
const K: u64 = 0x517c_c1b7_2722_0a95;

/// The hasher ([`IdMap`]'s).
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl IdHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(K);
    }
}

impl Hasher for IdHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.add(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        for &b in chunks.remainder() {
            self.add(u64::from(b));
        }
    }

    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u16(&mut self, i: u16) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map keyed by ids this node assigns (module docs).
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_ids_spread_over_the_buckets_and_the_tags() {
        use std::hash::BuildHasher;
        let b = BuildHasherDefault::<IdHasher>::default();
        // hashbrown takes the bucket from the low bits and a 7-bit tag from the top ones.
        let mut low = std::collections::HashSet::new();
        let mut top = std::collections::HashSet::new();
        for id in 0u64..1024 {
            let h = b.hash_one(id);
            low.insert(h & 1023);
            top.insert(h >> 57);
        }
        assert_eq!(low.len(), 1024, "sequential ids collide in the low bits");
        assert_eq!(top.len(), 128, "tags not spread");
        // A map works as one.
        let mut m: IdMap<(u32, u64), u64> = IdMap::default();
        for i in 0..1000u64 {
            m.insert((i as u32 % 3, i), i * 2);
        }
        assert!((0..1000u64).all(|i| m.get(&(i as u32 % 3, i)) == Some(&(i * 2))));
        assert_eq!(m.len(), 1000);
    }
}
