//! Buffer helpers for the daemon's FillBuffer / ReadBuffer / ChecksumBuffer on GPU memory.
//!
//! - fill: the host generates the pattern into two 1 MiB pinned staging buffers in turn while
//!   the other one's H2D copy runs.
//! - read: D2H through the same double buffering.
//! - checksum: the checksum kernel writes the CRC-32C of every 4 KiB block (4 bytes per 4 KiB,
//!   so 1 MiB of results per GiB), those come back D2H and the host folds them
//!   ([`super::crc32c_fold_blocks`]). The bytes never cross PCIe; see docs/GPU.md for the
//!   measured cost per GiB. [`DeviceRegion::crc32c_via_host`] is the D2H + host reference.

use std::ffi::c_void;

use super::crc::crc32c_fold_blocks;
use super::error::GpuResult;
use super::memory::DeviceRegion;
use super::stream::{Event, Stream};

const STAGING: usize = 1 << 20;
/// Bytes checksummed per kernel launch (4 MiB of block CRCs).
const CRC_PIECE: u64 = 4 << 30;
const CRC_BLOCK: u64 = 4096;

impl DeviceRegion {
    /// Fills `[offset, offset + len)` with what `generate(pos, chunk)` writes, `pos` being the
    /// region offset of `chunk[0]` (chunks of at most 1 MiB, in order). Returns once the bytes
    /// are on the device.
    pub fn fill_with(
        &self,
        stream: &Stream,
        offset: u64,
        len: u64,
        mut generate: impl FnMut(u64, &mut [u8]),
    ) -> GpuResult<()> {
        self.check(offset, len)?;
        let gpu = self.gpu();
        let mut bufs = [gpu.alloc_pinned(STAGING)?, gpu.alloc_pinned(STAGING)?];
        let events = [Event::new(gpu)?, Event::new(gpu)?];
        let (mut pos, end) = (offset, offset + len);
        let mut i = 0;
        while pos < end {
            let n = (end - pos).min(STAGING as u64);
            let b = i % 2;
            events[b].synchronize()?;
            generate(pos, &mut bufs[b].as_mut_slice()[..n as usize]);
            stream.copy_h2d(self, pos, &bufs[b], 0, n)?;
            stream.record(&events[b])?;
            pos += n;
            i += 1;
        }
        stream.synchronize()
    }

    /// Copies `out.len()` bytes at `offset` to `out`, staged through pinned memory.
    pub fn read_into(&self, stream: &Stream, offset: u64, out: &mut [u8]) -> GpuResult<()> {
        self.check(offset, out.len() as u64)?;
        let gpu = self.gpu();
        let bufs = [gpu.alloc_pinned(STAGING)?, gpu.alloc_pinned(STAGING)?];
        let events = [Event::new(gpu)?, Event::new(gpu)?];
        let chunks: Vec<(usize, usize)> = (0..out.len())
            .step_by(STAGING)
            .map(|s| (s, (out.len() - s).min(STAGING)))
            .collect();
        for (i, &(start, n)) in chunks.iter().enumerate() {
            let b = i % 2;
            stream.copy_d2h(&bufs[b], 0, self, offset + start as u64, n as u64)?;
            stream.record(&events[b])?;
            if i > 0 {
                let (ps, pn) = chunks[i - 1];
                events[1 - b].synchronize()?;
                bufs[1 - b].read(0, &mut out[ps..ps + pn])?;
            }
        }
        if let Some(&(ps, pn)) = chunks.last() {
            let b = (chunks.len() - 1) % 2;
            events[b].synchronize()?;
            bufs[b].read(0, &mut out[ps..ps + pn])?;
        }
        Ok(())
    }

    /// CRC-32C (as the `crc32c` crate computes it) of `[offset, offset + len)`, computed on the
    /// GPU (per-4-KiB-block kernel + host fold). Fastest when `offset` is 16-byte aligned.
    pub fn crc32c(&self, stream: &Stream, offset: u64, len: u64) -> GpuResult<u32> {
        self.check(offset, len)?;
        if len == 0 {
            return Ok(0);
        }
        let gpu = self.gpu();
        let kernels = gpu.kernels()?;
        let max_blocks = CRC_PIECE.min(len).div_ceil(CRC_BLOCK) as usize;
        let out = gpu.alloc(max_blocks * 4)?;
        let host = gpu.alloc_pinned(max_blocks * 4)?;
        let mut crc = 0u32;
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let n = (end - pos).min(CRC_PIECE);
            let nblocks = n.div_ceil(CRC_BLOCK);
            let mut data = self.device_ptr() + pos;
            let mut plen = n;
            let mut optr = out.device_ptr();
            let mut params = [
                (&mut data as *mut u64).cast::<c_void>(),
                (&mut plen as *mut u64).cast::<c_void>(),
                (&mut optr as *mut u64).cast::<c_void>(),
            ];
            let grid = nblocks.div_ceil(256).min(u64::from(gpu.sm_count()) * 16) as u32;
            // SAFETY: the parameters match `tcpxd_crc32c_blocks(const u8*, u64, u32*)`; the kernel
            // reads `n` bytes of this region (bounds-checked above) and writes `nblocks` u32 into
            // `out`, which holds `max_blocks >= nblocks`. Both outlive the synchronize below.
            unsafe { gpu.launch(kernels.crc32c_blocks, (grid, 1), 256, stream, &mut params, false)? };
            stream.copy_d2h(&host, 0, &out, 0, nblocks * 4)?;
            stream.synchronize()?;
            let blocks = host.typed::<u32>(0, nblocks as usize)?;
            let piece = crc32c_fold_blocks(blocks, n);
            crc = if pos == offset {
                piece
            } else {
                crc32c::crc32c_combine(crc, piece, n as usize)
            };
            pos += n;
        }
        Ok(crc)
    }

    /// CRC-32C computed on the host after copying the bytes back (the reference, and the path
    /// for checking the kernel).
    pub fn crc32c_via_host(&self, stream: &Stream, offset: u64, len: u64) -> GpuResult<u32> {
        self.check(offset, len)?;
        let mut crc = 0u32;
        let mut buf = vec![0u8; (len as usize).min(64 << 20)];
        let mut pos = offset;
        while pos < offset + len {
            let n = (offset + len - pos).min(buf.len() as u64) as usize;
            self.read_into(stream, pos, &mut buf[..n])?;
            crc = crc32c::crc32c_append(crc, &buf[..n]);
            pos += n as u64;
        }
        Ok(crc)
    }
}
