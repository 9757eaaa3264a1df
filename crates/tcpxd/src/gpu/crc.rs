//! Folding per-4-KiB-block CRC-32C values (from the checksum kernel) into the CRC of the whole
//! range, on the host: `crc(A‖B) = Z(crc(A)) ^ crc(B)`, where `Z` is the linear map "feed 4096
//! zero bytes through the raw CRC register" (the conditioning of init and final xor cancels, as
//! in zlib's `crc32_combine`). `Z` is applied with four 256-entry tables: four lookups per block,
//! about 1 ms per GiB.

use std::sync::OnceLock;

/// Reflected Castagnoli polynomial.
const POLY: u32 = 0x82F6_3B78;
const BLOCK: usize = 4096;

fn zero_bits(mut c: u32, bits: usize) -> u32 {
    for _ in 0..bits {
        c = if c & 1 != 0 { (c >> 1) ^ POLY } else { c >> 1 };
    }
    c
}

fn tables() -> &'static [[u32; 256]; 4] {
    static T: OnceLock<[[u32; 256]; 4]> = OnceLock::new();
    T.get_or_init(|| {
        let mut cols = [0u32; 32];
        for (i, c) in cols.iter_mut().enumerate() {
            *c = zero_bits(1 << i, BLOCK * 8);
        }
        let mut t = [[0u32; 256]; 4];
        for (k, tk) in t.iter_mut().enumerate() {
            for (b, e) in tk.iter_mut().enumerate() {
                let x = (b as u32) << (8 * k);
                *e = (0..32)
                    .filter(|i| x & (1 << i) != 0)
                    .fold(0, |acc, i| acc ^ cols[i]);
            }
        }
        t
    })
}

/// `Z(crc)`: the CRC shifted past 4096 more bytes, before xoring in those bytes' own CRC.
pub fn shift_4096(crc: u32) -> u32 {
    let t = tables();
    t[0][(crc & 0xff) as usize]
        ^ t[1][((crc >> 8) & 0xff) as usize]
        ^ t[2][((crc >> 16) & 0xff) as usize]
        ^ t[3][(crc >> 24) as usize]
}

/// The CRC-32C of `len` bytes whose consecutive 4096-byte blocks (the last one possibly shorter)
/// have the CRC-32C values `blocks`.
pub fn crc32c_fold_blocks(blocks: &[u32], len: u64) -> u32 {
    let Some((&first, rest)) = blocks.split_first() else {
        return 0;
    };
    let last_len = match len % BLOCK as u64 {
        0 => BLOCK,
        r => r as usize,
    };
    let mut crc = first;
    for (i, &b) in rest.iter().enumerate() {
        crc = if i + 1 == rest.len() && last_len != BLOCK {
            crc32c::crc32c_combine(crc, b, last_len)
        } else {
            shift_4096(crc) ^ b
        };
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u32).wrapping_mul(2_654_435_761).rotate_left(7) as u8)
            .collect()
    }

    #[test]
    fn shift_matches_the_crates_combine() {
        for &(a, b) in &[(0u32, 0u32), (0xdead_beef, 0x1234_5678), (u32::MAX, 1)] {
            assert_eq!(shift_4096(a) ^ b, crc32c::crc32c_combine(a, b, 4096));
        }
    }

    #[test]
    fn folding_block_crcs_gives_the_whole_crc() {
        for n in [1usize, 4095, 4096, 4097, 3 * 4096, 5 * 4096 + 17] {
            let d = data(n);
            let blocks: Vec<u32> = d.chunks(BLOCK).map(crc32c::crc32c).collect();
            assert_eq!(
                crc32c_fold_blocks(&blocks, n as u64),
                crc32c::crc32c(&d),
                "n = {n}"
            );
        }
        assert_eq!(crc32c_fold_blocks(&[], 0), crc32c::crc32c(&[]));
    }
}
